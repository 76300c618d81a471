"""Apply an entry's compile recipe to a loaded pipeline: the one function the build worker, the
replay and a serving process (neffbuild.serve.prepare) all run, so they cannot drift.

Order, per component module: fused QKV projections, attention backend, memory format, then
quantization (torchao quantizes the fused projection, as diffusers' guide does), then
torch.compile. Module settings run once per module ('vae.decode' and 'vae.encode' share one).

Scope: Inductor settings and the compile mode travel inside the compiler object
(torch._TorchCompileInductorWrapper, what torch.compile(mode=, options=) builds), which patches
Inductor's config only while it compiles a graph. The process-wide settings a recipe has,
float32 matmul precision and, for dynamic shapes, the duck-shape switch and Dynamo's
specialize_float, are read when a graph traces and runs, so each compiled callable sets them
around its own call and restores them: two entries in one process do not leak settings into
each other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

from neffbuild.backends.components import GraphCounter, recorded

if TYPE_CHECKING:
    from neffbuild.documents.compile_recipe import ResolvedRecipe
    from neffbuild.documents.manifest import ModelEntry

log = logging.getLogger(__name__)


class Compilers(Protocol):
    """What compiling a component asks of a backend (backends/base.py's Backend)."""

    @property
    def compiler_name(self) -> str: ...

    def compiler_for(self, recipe: ResolvedRecipe) -> Any: ...


def apply_recipe(pipe: Any, entry: ModelEntry, backend: Compilers, skip: frozenset[str] = frozenset()) -> None:
    """Prepare each listed component's module as its recipe says, then compile the components,
    but those in `skip` (served from packages: exported from the prepared module, so nothing
    else applies to them)."""
    done: set[str] = {c.partition(".")[0] for c in skip}
    for spec, (name, _method) in zip(entry.components, entry.components_named(), strict=True):
        if name in done:
            continue
        done.add(name)
        module = getattr(pipe, name, None)
        if module is None:
            raise ValueError(f"pipeline {entry.pipeline} has no component {name!r}")
        recipe = entry.recipe_for(spec)
        log.debug("%s: recipe %s", spec, describe(recipe))
        prepare_module(module, recipe)
    compile_components(pipe, entry, backend, skip=skip)


def compile_components(pipe: Any, entry: ModelEntry, backend: Compilers, skip: frozenset[str] = frozenset()) -> None:
    """Compile each listed component (but those in `skip`) the way serving must: `name` compiles
    the module's forward (`full`) or its repeated blocks (`regional`); `name.method` compiles that
    bound method. Each with its recipe's compiler settings (below)."""
    import torch

    for spec, (name, method) in zip(entry.components, entry.components_named(), strict=True):
        component = getattr(pipe, name, None)
        if component is None:
            raise ValueError(f"pipeline {entry.pipeline} has no component {name!r}")
        if spec in skip:
            continue
        recipe = entry.recipe_for(spec)
        counter = GraphCounter(spec, backend.compiler_for(recipe), backend.compiler_name)
        options = {"backend": counter, **compile_options(recipe)}
        if method is not None:
            bound = getattr(component, method, None)
            if not callable(bound):
                raise ValueError(f"{type(component).__name__} has no method {method!r}")
            setattr(component, method, scoped(recorded(spec, torch.compile(bound, **options)), recipe))
        elif entry.mode == "full":
            # The recipe's torch.compile arguments (dynamic!), not fixed ones: a dynamic entry
            # compiled static graphs here, one per shape, and nothing said so.
            component.compile(backend=counter, **compile_options(recipe))
            # Module.compile keeps the compiled call here; recording outside it keeps the
            # graph whole (a hook would run inside it).
            component._compiled_call_impl = scoped(recorded(spec, component._compiled_call_impl), recipe)
        elif not getattr(component, "_repeated_blocks", None):
            raise ValueError(f"{type(component).__name__} declares no _repeated_blocks; use mode 'full'")
        else:
            component.compile_repeated_blocks(backend=counter, **compile_options(recipe))
            # The blocks compile inside the component's call: record and scope around it.
            component.forward = scoped(recorded(spec, component.forward), recipe)


def prepare_module(module: Any, recipe: ResolvedRecipe) -> None:
    """What a recipe changes in the module itself, before anything is traced."""
    import torch

    if recipe.fuse_qkv:
        module.fuse_qkv_projections()
    if recipe.attention_backend:
        module.set_attention_backend(recipe.attention_backend)
    if recipe.memory_format == "channels_last":
        module.to(memory_format=torch.channels_last)
    if recipe.quantize is not None:
        quantize(module, recipe)


# torchao's config class per recipe name (torchao.quantization).
QUANTIZE_CONFIGS = {
    "int8-dynamic": "Int8DynamicActivationInt8WeightConfig",
    "float8-dynamic": "Float8DynamicActivationFloat8WeightConfig",
}


def quantize(module: Any, recipe: ResolvedRecipe) -> None:
    """torchao's quantize_ with the recipe's config, on the Linear layers its filter keeps."""
    import torchao.quantization as ao  # plan refuses a quantize recipe where torchao is missing

    config = getattr(ao, QUANTIZE_CONFIGS[str(recipe.quantize)])()
    ao.quantize_(module, config, filter_fn=layer_filter(recipe.quantize_skip, recipe.quantize_min_features))


def layer_filter(skip: tuple[str, ...], min_features: int | None) -> Callable[[Any, str], bool]:
    """The diffusers guide's dynamic_quant_filter_fn as recipe data: a Linear is quantized unless
    its qualified name matches a skip pattern or it has fewer features than min_features. The
    printed recipe (recipecode.py) writes its conditions out."""
    import fnmatch

    import torch

    def keep(module: Any, name: str) -> bool:
        if not isinstance(module, torch.nn.Linear):
            return False
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in skip):
            return False
        return min_features is None or min(module.in_features, module.out_features) >= min_features

    return keep


def scoped(call: Callable[..., Any], recipe: ResolvedRecipe) -> Callable[..., Any]:
    """`call` with the recipe's process-wide settings held for its duration only."""
    if not needs_scope(recipe):
        return call

    def run(*args: Any, **kwargs: Any) -> Any:
        with process_settings(recipe):
            return call(*args, **kwargs)

    return run


def needs_scope(recipe: ResolvedRecipe) -> bool:
    return recipe.matmul_precision is not None or recipe.dynamic is True or not recipe.duck_shape


@contextmanager
def process_settings(recipe: ResolvedRecipe) -> Iterator[None]:
    import torch
    import torch._dynamo
    import torch.fx.experimental._config as fx_config

    saved = torch.get_float32_matmul_precision()
    if recipe.matmul_precision is not None:
        torch.set_float32_matmul_precision(recipe.matmul_precision)
    try:
        # Duck shaping gives equal sizes one symbol (and so specialises their equality): read
        # when a frame traces, so it must hold during the call that compiles.
        with (
            dynamic_settings(recipe, fx_config, torch._dynamo.config) if recipe.dynamic is not False else nullcontext()
        ):
            yield
    finally:
        torch.set_float32_matmul_precision(saved)


@contextmanager
def dynamic_settings(recipe: ResolvedRecipe, fx_config: Any, dynamo_config: Any) -> Iterator[None]:
    # specialize_float: with dynamic=True Dynamo makes every Python float a symbol (diffusers'
    # rotary embedding has float defaults); AOTAutograd cannot turn one used as a scalar into a
    # tensor, so it restarts the frame with those floats constant. That first attempt's
    # AOTAutograd lookup misses in every fresh process (it saves nothing), so a pulled cache
    # never served the first call without one. Constant floats from the start: one attempt, one
    # lookup, a hit (docs/recipes.md, "Dynamic shapes"). "auto" is torch's defaults untouched:
    # what a server written without neffbuild compiles (its first graph is static).
    floats = dynamo_config.patch(specialize_float=True) if recipe.dynamic is True else nullcontext()
    with fx_config.patch(use_duck_shape=recipe.duck_shape), floats:
        yield


def compile_options(recipe: ResolvedRecipe) -> dict[str, Any]:
    """torch.compile's arguments besides the backend: fullgraph always (a graph break would be
    a piece of the model served eager, uncached); dynamic as the recipe says ("auto": None)."""
    return {"fullgraph": True, "dynamic": recipe.compile_dynamic}


def describe(recipe: ResolvedRecipe) -> str:
    """One line for a log: what differs from the defaults."""
    from dataclasses import fields

    from neffbuild.documents.compile_recipe import ResolvedRecipe as Default

    default = Default()
    changed = [
        f"{f.name}={getattr(recipe, f.name)!r}"
        for f in fields(recipe)
        if getattr(recipe, f.name) != getattr(default, f.name)
    ]
    return ", ".join(changed) or "defaults"
