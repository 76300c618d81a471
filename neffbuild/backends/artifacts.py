"""Artifact `package`: one AOTInductor package per listed component and input signature.

Build (a worker, after the entry's warmup call at its shape): each listed component's inputs, as
the real pipeline call passed them at its boundary, are captured; the eager component is exported
(`torch.export`, non-strict) with them and compiled by AOTInductor with the entry's recipe
(`aoti_compile_and_package`), into `<cache dir>/aoti/<component>/<entry digest>/<signature digest>.pt2`.
The package is then loaded once, which compiles its loader's few runtime kernels into the same
cache dir (so they travel in the bundle and a pulled, read-only cache dir loads with no compile),
and its outputs are compared with the compiled component's on the same inputs: the largest
absolute difference is written beside the package (`.json`), and the build fails past the
entry dtype's tolerance.

Serving (`neffbuild.serve.prepare`): each component's call is replaced by a loader holding every
package of its entry; a call is dispatched by its input signature (shapes, dtypes, plain values),
and one no package covers raises UnlistedShape naming the call's size, the component and the entry.
Nothing is traced or compiled. The package holds the component's weights as the build loaded them.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffbuild.backends.components import (
    ComponentCall,
    add_call_hook,
    recorded,
    remove_call_hook,
    signature_parts,
    unlisted_hooks,
)
from neffbuild.errors import NotFoundError, UnlistedShape

if TYPE_CHECKING:
    from neffbuild.documents.compile_recipe import ResolvedRecipe
    from neffbuild.documents.manifest import ModelEntry

log = logging.getLogger(__name__)

ARTIFACT_DIR = "aoti"
# torch._dynamo.utils.counters groups: calls each package served (a hit, by component), and what
# compiled in a process serving packages, where nothing should (count_compiles).
PACKAGE_GROUP = "neffbuild.packages"
COMPILES_GROUP = "neffbuild.compiles"
# Largest absolute difference between a package's outputs and the compiled component's, by dtype.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


class ArtifactMismatch(RuntimeError):
    """A package computes other values than the compiled component it was built beside."""


def uses_packages(entry: ModelEntry) -> bool:
    return entry.mode != "eager" and any(entry.recipe_for(c).artifact == "package" for c in entry.components)


def entry_digest(entry: ModelEntry, spec: str) -> str:
    """What a package bakes in besides its inputs: the model (weights), dtype and the recipe."""
    document = {
        "model": entry.model,
        "revision": entry.revision,
        "pipeline": entry.pipeline,
        "dtype": entry.dtype,
        "recipe": entry.recipe_for(spec).as_dict(),
    }
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:24]


def signature_digest(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    return hashlib.sha256(", ".join(signature_parts(args, kwargs)).encode()).hexdigest()[:24]


def package_dir(cache_dir: Path, entry: ModelEntry, spec: str) -> Path:
    return cache_dir / ARTIFACT_DIR / spec / entry_digest(entry, spec)


# -- build side --------------------------------------------------------------------------------


@contextmanager
def captured_inputs(entry: ModelEntry) -> Iterator[dict[str, dict[str, tuple[tuple[Any, ...], dict[str, Any]]]]]:
    """Listed components' inputs while the block runs: {spec: {signature digest: (args, kwargs)}},
    the first call per signature."""
    seen: dict[str, dict[str, tuple[tuple[Any, ...], dict[str, Any]]]] = {}
    packaged = {c for c in entry.components if entry.recipe_for(c).artifact == "package"}

    def hook(spec: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        if spec in packaged:
            seen.setdefault(spec, {}).setdefault(signature_digest(args, kwargs), (args, dict(kwargs)))

    add_call_hook(hook)
    try:
        yield seen
    finally:
        remove_call_hook(hook)


@dataclass(frozen=True, slots=True)
class Packaged:
    spec: str
    path: Path
    max_abs_diff: float
    export_s: float
    package_s: float


def write_packages(
    pipe: Any, entry: ModelEntry, cache_dir: Path, captured: Mapping[str, Mapping[str, tuple[Any, Any]]]
) -> list[Packaged]:
    """Export and package every captured (component, signature); check each against the compiled one."""
    done = []
    for spec, calls in captured.items():
        for digest, (args, kwargs) in calls.items():
            target = package_dir(cache_dir, entry, spec) / f"{digest}.pt2"
            done.append(_package_one(pipe, entry, spec, target, (args, kwargs)))
    return done


def _package_one(pipe: Any, entry: ModelEntry, spec: str, target: Path, inputs: tuple[Any, Any]) -> Packaged:
    import torch
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    from neffbuild.backends.recipe import process_settings

    args, kwargs = inputs
    recipe = entry.recipe_for(spec)
    compiled = _compiled_call(pipe, spec)
    with torch.inference_mode():
        expected = compiled(*args, **kwargs)
    plain_args, plain_kwargs = torch.utils._pytree.tree_map(_plain, (args, kwargs))
    target.parent.mkdir(parents=True, exist_ok=True)
    with process_settings(recipe), torch.no_grad(), _eager(pipe, spec) as module:
        started = time.perf_counter()
        program = torch.export.export(module, tuple(plain_args), dict(plain_kwargs), strict=False)
        exported = time.perf_counter()
        aoti_compile_and_package(program, package_path=str(target), inductor_configs=inductor_configs(recipe))
        packaged = time.perf_counter()
    loaded = aoti_load_package(str(target))  # compiles the loader's runtime kernels into the cache dir
    with torch.inference_mode():
        diff = max_abs_diff(expected, loaded(*args, **kwargs))
    tolerance = TOLERANCE.get(entry.dtype, 1e-4)
    export_s, package_s = round(exported - started, 3), round(packaged - exported, 3)
    record = {
        "component": spec,
        "inputs": list(signature_parts(args, kwargs)),
        "dtype": entry.dtype,
        "max_abs_diff": diff,
        "tolerance": tolerance,
        "export_s": export_s,
        "package_s": package_s,
    }
    target.with_suffix(".json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    log.info("%s: packaged %s (max abs diff %.3g)", spec, target.name, diff)
    if not diff <= tolerance:  # NaN fails too
        raise ArtifactMismatch(
            f"{spec}: the AOTInductor package differs from the compiled component by {diff:.3g} "
            f"(> {tolerance:g} for {entry.dtype}) at {', '.join(signature_parts(args, kwargs))}"
        )
    return Packaged(spec, target, diff, export_s, package_s)


def inductor_configs(recipe: ResolvedRecipe) -> dict[str, Any]:
    """The recipe's mode and Inductor settings as AOTInductor's config (CUDA graphs do not apply)."""
    from torch._inductor import list_mode_options

    options = {k: v for k, v in list_mode_options(recipe.mode).items() if "cudagraph" not in k}
    return {**options, **recipe.inductor}


def max_abs_diff(expected: Any, got: Any) -> float:
    import torch

    pairs = zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got), strict=True)
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in pairs if isinstance(a, torch.Tensor)]
    return max(diffs, default=0.0)


def _plain(value: Any) -> Any:
    """An inference-mode tensor as a normal one: export records autograd and refuses them."""
    import torch

    return value.clone() if isinstance(value, torch.Tensor) else value


def _compiled_call(pipe: Any, spec: str) -> Callable[..., Any]:
    name, _, method = spec.partition(".")
    component = getattr(pipe, name)
    return getattr(component, method) if method else component


@contextmanager
def _eager(pipe: Any, spec: str) -> Iterator[Any]:
    """The component's own (uncompiled) call as a module to export: the class's method, or the
    module with its compiled call set aside for the duration."""
    import torch

    name, _, method = spec.partition(".")
    component = getattr(pipe, name)
    if method:
        function = getattr(type(component), method)

        class Method(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = component

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return function(self.inner, *args, **kwargs)

        yield Method()
        return
    saved = component._compiled_call_impl
    component._compiled_call_impl = None
    try:
        yield component
    finally:
        component._compiled_call_impl = saved


# -- serving side ------------------------------------------------------------------------------


@dataclass
class PackageLoader:
    """A component's call in a serving process: the package for the call's input signature."""

    entry: ModelEntry
    spec: str
    runners: dict[str, Any]  # signature digest -> loaded package

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.utils import counters

        runner = self.runners.get(signature_digest(args, kwargs))
        if runner is None:
            for hook in tuple(unlisted_hooks):  # a serving guard records the event
                hook(ComponentCall(self.spec, args, kwargs))
            raise self._unlisted(args, kwargs)
        counters[PACKAGE_GROUP][self.spec] += 1
        return runner(*args, **kwargs)

    def _unlisted(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> UnlistedShape:
        from neffbuild.backends.components import call_size

        size = call_size(self.entry)
        at = "x".join(str(size.get(k, "?")) for k in ("height", "width", "batch")) if size else "an unrecovered size"
        listed = ", ".join(s.label for s in self.entry.expanded_shapes())
        return UnlistedShape(
            f"{self.spec} of model[{self.entry.id}] at {at} [{', '.join(signature_parts(args, kwargs))}]: "
            f"no AOTInductor package for these inputs (artifact 'package'); the entry lists {listed}",
            hint="add the shape to the manifest, rebuild and pull",
        )


def load_packages(entry: ModelEntry, spec: str, cache_dir: Path) -> PackageLoader:
    """Every package of the entry's component in the cache dir, loaded now (not on a request),
    and run once on zeros of its recorded inputs: a package's first run sets up what later runs
    reuse (measured: 1.4 s against 0.2 s for the tiny VAE under load), which is load, not request."""
    from torch._inductor import aoti_load_package

    found = sorted(package_dir(cache_dir, entry, spec).glob("*.pt2"))
    if not found:
        raise NotFoundError(
            f"model[{entry.id}]: no AOTInductor package of {spec} in {cache_dir} (artifact 'package')",
            hint="pull a release built from this manifest entry into the cache dir",
        )
    runners = {p.stem: aoti_load_package(str(p)) for p in found}
    for path in found:
        _first_run(runners[path.stem], path.with_suffix(".json"))
    return PackageLoader(entry, spec, runners)


_KEYWORD = re.compile(r"^([A-Za-z_]\w*)=(.*)$")
_TENSOR = re.compile(r"^(\w+)\[([0-9, ]*)\]$")


def _first_run(runner: Any, record: Path) -> None:
    import torch

    try:
        parts = json.loads(record.read_text())["inputs"]
        args, kwargs = [], {}
        for part in parts:
            keyword = _KEYWORD.match(part)
            value = _example(keyword.group(2) if keyword else part)
            if keyword:
                kwargs[keyword.group(1)] = value
            else:
                args.append(value)
    except (OSError, ValueError, KeyError, SyntaxError, AttributeError):
        return  # an input it cannot make (a container, another type): the first request pays instead
    with torch.inference_mode():
        runner(*args, **kwargs)


def _example(text: str) -> Any:
    """Zeros of a described tensor (`float32[1, 64, 16]`), or the described plain value."""
    import torch

    tensor = _TENSOR.match(text)
    if tensor is None:
        return ast.literal_eval(text)
    dims = [int(d) for d in tensor.group(2).split(",") if d.strip()]
    return torch.zeros(dims, dtype=getattr(torch, tensor.group(1)))


def packaged(entry: ModelEntry) -> frozenset[str]:
    """The listed components whose recipe ships a package."""
    return frozenset(spec for spec in entry.components if entry.recipe_for(spec).artifact == "package")


def install_loaders(pipe: Any, entry: ModelEntry, cache_dir: Path) -> None:
    """Replace each packaged component's call with its loader: nothing left for Dynamo to trace.
    Recorded as a compiled call is (components.recorded), so a guard names the call in progress."""
    count_compiles()
    for spec in sorted(packaged(entry), key=entry.components.index):
        loader = recorded(spec, load_packages(entry, spec, cache_dir))
        name, _, method = spec.partition(".")
        component = getattr(pipe, name)
        if method:
            setattr(component, method, loader)
        else:
            component._compiled_call_impl = loader  # nn.Module.__call__ runs it in place of forward


def count_compiles() -> None:
    """Count, from now on in this process, each frame Dynamo starts compiling and each C++ build
    Inductor starts (kernels, a package loader's runtime kernels): where packages serve, both must
    stay 0, which `warmup` and `verify --replay` prove with them (package_compiles). Once per process."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._inductor import cpp_builder

    builder = cpp_builder.CppBuilder
    if getattr(builder, "_neffbuild_counting", False):
        return
    build = builder.build

    def counted_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        counters[COMPILES_GROUP]["kernel_builds"] += 1
        return build(self, *args, **kwargs)

    def frame(*_args: Any) -> None:
        counters[COMPILES_GROUP]["frames"] += 1

    builder.build = counted_build
    builder._neffbuild_counting = True
    torch._dynamo.callback_handler.register_start_callback(frame)


def package_compiles(delta: Mapping[str, int]) -> int:
    """Frames and C++ builds in a counter delta: compiles, in a call that packages serve."""
    return sum(delta.get(f"{COMPILES_GROUP}.{name}", 0) for name in ("frames", "kernel_builds"))
