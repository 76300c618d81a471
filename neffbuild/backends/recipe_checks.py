"""Plan-time checks of a compile recipe against what is installed here: Inductor's config (names
and types), diffusers' attention backends, the component classes' fusions, torchao. A recipe that
names something the installed torch or diffusers does not know would otherwise fail in a worker
after a minute of loading, or (an Inductor setting torch ignores) silently build something else.
"""

from __future__ import annotations

import difflib
import importlib.util
import typing
from typing import TYPE_CHECKING, Any

from neffbuild.backends.problems import Problem

if TYPE_CHECKING:
    from neffbuild.documents.manifest import ModelEntry

# Settings that would turn off or move the very caches a build publishes: neffbuild owns them.
OWNED_SETTINGS = frozenset(
    {
        "fx_graph_cache",
        "fx_graph_remote_cache",
        "autotune_local_cache",
        "force_disable_caches",
        "bundled_autotune_remote_cache",
    }
)


def inductor_setting_problems(entry: ModelEntry) -> list[Problem]:
    """Every [model.compile] Inductor setting must be one of torch._inductor.config's, of its type."""
    from torch._inductor import config

    known = config.get_config_copy()
    problems = []
    for spec in entry.components:
        where = "compile.inductor" if spec not in entry.compile.components else f"compile.components.{spec!r}.inductor"
        for name, value in sorted(entry.recipe_for(spec).inductor.items()):
            problem = _setting_problem(config, known, name, value)
            if problem:
                problems.append(Problem(f"{where}.{name}", *problem))
    return list({str(p): p for p in problems}.values())  # an entry-wide setting once, not per component


def _setting_problem(config: Any, known: dict[str, Any], name: str, value: Any) -> tuple[str, str] | None:
    torch_version = _torch_version()
    if name not in known:
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
        return (
            f"not an Inductor setting of torch {torch_version}" + (f"; did you mean {close[0]!r}?" if close else ""),
            "names are torch._inductor.config's (python -c 'import torch._inductor.config as c; print(c.get_config_copy())')",
        )
    if name in OWNED_SETTINGS:
        return (f"{name} switches the caches neffbuild builds and publishes", "remove it: neffbuild owns the caches")
    expected = config.get_type(name)
    if typing.get_origin(expected) is None and isinstance(expected, type) and not _fits(value, expected):
        return (
            f"takes a {expected.__name__}, got {value!r} ({type(value).__name__})",
            f"write it as TOML's {_toml_type(expected)} (the default is {known[name]!r})",
        )
    return None


def _fits(value: Any, expected: type) -> bool:
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, expected)


def _toml_type(expected: type) -> str:
    return {bool: "true/false", int: "integer", float: "number", str: "string"}.get(expected, expected.__name__)


def _torch_version() -> str:
    import torch

    return torch.__version__


def module_recipe_problems(entry: ModelEntry, spec: str, name: str, cls: type) -> list[Problem]:
    """What a component's recipe asks of its class: a fusion it has, a known attention backend, torchao."""
    recipe = entry.recipe_for(spec)
    problems = []
    if recipe.fuse_qkv and not callable(getattr(cls, "fuse_qkv_projections", None)):
        problems.append(
            Problem("compile.fuse_qkv", f"{spec!r}: {cls.__name__} has no fuse_qkv_projections()",
                    f"set fuse_qkv only for a component that has it ([model.compile.components.{name}])")
        )  # fmt: skip  # arguments packed by meaning, not one a line
    if recipe.attention_backend is not None:
        problems.extend(_attention_problems(spec, cls, recipe.attention_backend))
    if recipe.quantize is not None and importlib.util.find_spec("torchao") is None:
        problems.append(
            Problem("compile.quantize", f"{recipe.quantize!r} quantizes through torchao, which is not installed here",
                    "pip install 'neffbuild[quantize]' (torchao) on the build host and the servers, or remove quantize")
        )  # fmt: skip  # arguments packed by meaning, not one a line
    if recipe.quantize == "float8-dynamic" and entry.device != "cuda":
        problems.append(
            Problem("compile.quantize", f"'float8-dynamic' on device {entry.device!r}: torchao's float8 matmuls "
                    "need a CUDA GPU (compute capability 8.9+)",
                    "use quantize = 'int8-dynamic' on CPU, or device = 'cuda'")
        )  # fmt: skip  # arguments packed by meaning, not one a line
    return problems


def _attention_problems(spec: str, cls: type, backend: str) -> list[Problem]:
    from diffusers.models.attention_dispatch import AttentionBackendName

    names = [b.value for b in AttentionBackendName]
    if backend not in names:
        close = difflib.get_close_matches(backend, names, n=1, cutoff=0.6)
        return [
            Problem("compile.attention_backend", f"diffusers knows no attention backend {backend!r}"
                    + (f"; did you mean {close[0]!r}?" if close else ""), f"one of {', '.join(names)}")
        ]  # fmt: skip  # arguments packed by meaning, not one a line
    if not callable(getattr(cls, "set_attention_backend", None)):
        return [
            Problem("compile.attention_backend", f"{spec!r}: {cls.__name__} has no set_attention_backend()",
                    "set attention_backend only for a component that has it (a diffusers transformer)")
        ]  # fmt: skip  # arguments packed by meaning, not one a line
    return []
