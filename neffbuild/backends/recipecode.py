"""`neffbuild recipe`: an entry's recipe as plain Python, for a server that must not import neffbuild.

Statement for statement what backends/recipe.py applies (same order, same torch.compile
arguments on the same callables), except that the two process-wide settings are set for the whole
process instead of around each compiled call: a server runs one recipe. A test runs the printed
code in a fresh process against a pulled cache and counts 0 compiles. For an entry with artifact
'package', the printed code loads its AOTInductor packages as `prepare` does (artifacts.py) and
compiles nothing.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING

from neffbuild.backends.artifacts import package_dir, packaged
from neffbuild.backends.components import describe_input
from neffbuild.backends.recipe import QUANTIZE_CONFIGS

if TYPE_CHECKING:
    from neffbuild.documents.compile_recipe import ResolvedRecipe
    from neffbuild.documents.manifest import ModelEntry


def recipe_source(entry: ModelEntry, device: str, recompile_limit: int) -> str:
    """Python that applies the entry's recipe to a loaded pipeline named `pipe`."""
    lines = [
        f"# neffbuild recipe: model[{entry.id}] ({entry.pipeline}, {entry.dtype}, mode {entry.mode!r}).",
        "# Before torch is imported, export what `neffbuild pull` prints (TORCHINDUCTOR_CACHE_DIR, ...);",
        f"# load the pipeline as `pipe` with torch_dtype=torch.{entry.dtype}, then run this.",
        f"# Writing it by hand? {MUST_MATCH if len(packaged(entry)) < len(entry.components) else PACKAGES_MATCH}.",
        *(
            [f"# dynamic 'auto': make the first calls at {call_order(entry)}, in this order."]
            if entry.compile.dynamic == "auto"
            else []
        ),
        "import torch",
        "import torch._dynamo",
        "import torch._inductor",
        "",
        "# One recompile per static shape: raise the limit above the shape count.",
        f"torch._dynamo.config.recompile_limit = {recompile_limit}",
        f"torch._dynamo.config.accumulated_recompile_limit = {max(256, 8 * recompile_limit)}",
        f"pipe = pipe.to({device!r})",
    ]
    if entry.mode == "eager":
        return "\n".join([*lines, "# mode 'eager': nothing is compiled", ""])
    loaded = packaged(entry)
    if loaded:
        lines += package_lines(entry, loaded)
    compiled = [(spec, named) for spec, named in zip(entry.components, entry.components_named(), strict=True)]
    compiled = [(spec, named) for spec, named in compiled if spec not in loaded]
    if compiled:
        lines += _process_settings(entry.recipe_for(compiled[0][0]))
    done: set[str] = {spec.partition(".")[0] for spec in loaded}
    for spec, (name, _method) in compiled:
        if name not in done:
            done.add(name)
            lines += _module_lines(name, entry.recipe_for(spec))
    for spec, (name, method) in compiled:
        lines.append(_compile_line(entry.mode, name, method, entry.recipe_for(spec)))
    return "\n".join([*lines, ""])


PACKAGES_MATCH = (
    "artifact 'package': nothing is compiled; each component's call is its packages, picked by the "
    "call's input signature (the inputs recorded beside each package)"
)


# artifact 'package': what artifacts.install_loaders puts on each component, written out. The
# signature is components.describe_input's, printed from its source, and each package's recorded
# inputs (the .json beside it) are that signature.
PACKAGE_LOADER = """
# artifact 'package': AOTInductor packages, one per input signature; nothing is traced or compiled.
# A package's first run sets it up (about a second on the tiny pipeline): call each shape once before traffic.
import json
import os
import pathlib
from typing import Any

from torch._inductor import aoti_load_package


{describe_input}


class Packages:
    \"\"\"A component's call: the package whose recorded inputs are the call's.\"\"\"

    def __init__(self, where):
        found = sorted(pathlib.Path(os.environ["TORCHINDUCTOR_CACHE_DIR"], where).glob("*.pt2"))
        if not found:
            raise FileNotFoundError(f"no AOTInductor package in $TORCHINDUCTOR_CACHE_DIR/{where}")
        self.where = where
        self.runners = {
            ", ".join(json.loads(p.with_suffix(".json").read_text())["inputs"]): aoti_load_package(str(p))
            for p in found
        }

    def __call__(self, *args, **kwargs):
        parts = [describe_input(a) for a in args] + [f"{k}={describe_input(v)}" for k, v in sorted(kwargs.items())]
        runner = self.runners.get(", ".join(parts))
        if runner is None:
            raise RuntimeError(f"{self.where}: no package for inputs [{', '.join(parts)}]: a shape not built")
        return runner(*args, **kwargs)

"""


def package_lines(entry: ModelEntry, loaded: frozenset[str]) -> list[str]:
    """Load each packaged component's packages and put the loader where prepare puts it: a
    module's compiled call (nn.Module.__call__ runs it in place of forward), or the method."""
    lines = PACKAGE_LOADER.replace("{describe_input}", inspect.getsource(describe_input).rstrip()).splitlines()
    for spec, (name, method) in zip(entry.components, entry.components_named(), strict=True):
        if spec in loaded:
            where = package_dir(Path(), entry, spec).as_posix()
            target = f"pipe.{name}.{method}" if method else f"pipe.{name}._compiled_call_impl"
            lines.append(f"{target} = Packages({where!r})")
    return lines


def call_order(entry: ModelEntry) -> str:
    """The shapes a dynamic 'auto' server must call first, in order: the first traces the static
    graph, the second the automatic-dynamic one (what the build compiled)."""
    return ", ".join(entry.unit_label(s) for s in entry.expanded_shapes())


# The one line a hand-writing user needs (also in docs/recipes.md and `neffbuild recipe`'s help).
MUST_MATCH = (
    "what must match the build: the callables compiled and torch.compile's mode, options, dynamic "
    "(omitted = 'auto') and fullgraph=True, the module changes above them, and the process settings"
)


def _process_settings(recipe: ResolvedRecipe) -> list[str]:
    lines = []
    if recipe.matmul_precision is not None:
        lines.append(f"torch.set_float32_matmul_precision({recipe.matmul_precision!r})")
    if recipe.dynamic is not False and not recipe.duck_shape:
        lines += ["import torch.fx.experimental._config", "torch.fx.experimental._config.use_duck_shape = False"]
    if recipe.dynamic is True:
        # Floats constant from the first trace: otherwise the first call misses a pulled cache.
        lines.append("torch._dynamo.config.specialize_float = True")
    return lines


def _module_lines(name: str, recipe: ResolvedRecipe) -> list[str]:
    lines = []
    if recipe.fuse_qkv:
        lines.append(f"pipe.{name}.fuse_qkv_projections()")
    if recipe.attention_backend:
        lines.append(f"pipe.{name}.set_attention_backend({recipe.attention_backend!r})")
    if recipe.memory_format == "channels_last":
        lines.append(f"pipe.{name}.to(memory_format=torch.channels_last)")
    if recipe.quantize is not None:
        config = QUANTIZE_CONFIGS[recipe.quantize]
        lines += [
            f"from torchao.quantization import {config}, quantize_",
            *_filter_lines(recipe),
            f"quantize_(pipe.{name}, {config}(), filter_fn=keep_linear)",
        ]
    return lines


def _filter_lines(recipe: ResolvedRecipe) -> list[str]:
    # recipe.layer_filter's conditions, written out: the same layers quantized.
    conditions = ["isinstance(module, torch.nn.Linear)"]
    if recipe.quantize_skip:
        conditions.append(f"not any(fnmatch.fnmatchcase(name, p) for p in {list(recipe.quantize_skip)!r})")
    if recipe.quantize_min_features is not None:
        conditions.append(f"min(module.in_features, module.out_features) >= {recipe.quantize_min_features}")
    return [
        *(["import fnmatch"] if recipe.quantize_skip else []),
        "def keep_linear(module, name):",
        "    return " + " and ".join(conditions),
    ]


def _compile_line(entry_mode: str, name: str, method: str | None, recipe: ResolvedRecipe) -> str:
    # dynamic "auto" is torch.compile's default (None): left out, as a hand-written server has it.
    arguments = ["fullgraph=True"] + ([] if recipe.dynamic == "auto" else [f"dynamic={recipe.dynamic}"])
    settings = ", ".join(f"{k!r}: {v!r}" for k, v in sorted(recipe.inductor.items()))
    if recipe.mode != "default" and recipe.inductor:
        # torch.compile refuses mode and options together; a mode is its options (what the
        # build's compiler applies first), so they go in one dict, the recipe's settings last.
        options = f"torch._inductor.list_mode_options({recipe.mode!r}, {recipe.compile_dynamic})"
        arguments.append(f"options={{**{options}, {settings}}}")
    elif recipe.mode != "default":
        arguments.append(f"mode={recipe.mode!r}")
    elif recipe.inductor:
        arguments.append(f"options={{{settings}}}")
    args = ", ".join(arguments)
    if method is not None:
        return f"pipe.{name}.{method} = torch.compile(pipe.{name}.{method}, {args})"
    if entry_mode == "regional":
        return f"pipe.{name}.compile_repeated_blocks({args})"
    return f"pipe.{name}.compile({args})"
