"""`neffbuild recipe`: an entry's recipe as plain Python, for a server that must not import neffbuild.

Statement for statement what backends/recipe.py applies (same order, same torch.compile
arguments on the same callables), except that the two process-wide settings are set for the whole
process instead of around each compiled call: a server runs one recipe. A test runs the printed
code in a fresh process against a pulled cache and counts 0 compiles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neffbuild.documents.manifest import ModelEntry, ResolvedRecipe


def recipe_source(entry: ModelEntry, device: str, recompile_limit: int) -> str:
    """Python that applies the entry's recipe to a loaded pipeline named `pipe`."""
    lines = [
        f"# neffbuild recipe: model[{entry.id}] ({entry.pipeline}, {entry.dtype}, mode {entry.mode!r}).",
        "# Before torch is imported, export what `neffbuild pull` prints (TORCHINDUCTOR_CACHE_DIR, ...);",
        f"# load the pipeline as `pipe` with torch_dtype=torch.{entry.dtype}, then run this.",
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
    first = entry.recipe_for(entry.components[0])
    lines += _process_settings(first)
    done: set[str] = set()
    for spec, (name, _method) in zip(entry.components, entry.components_named(), strict=True):
        if name not in done:
            done.add(name)
            lines += _module_lines(name, entry.recipe_for(spec))
    for spec, (name, method) in zip(entry.components, entry.components_named(), strict=True):
        lines.append(_compile_line(entry.mode, name, method, entry.recipe_for(spec)))
    return "\n".join([*lines, ""])


def _process_settings(recipe: ResolvedRecipe) -> list[str]:
    lines = []
    if recipe.matmul_precision is not None:
        lines.append(f"torch.set_float32_matmul_precision({recipe.matmul_precision!r})")
    if recipe.dynamic and not recipe.duck_shape:
        lines += ["import torch.fx.experimental._config", "torch.fx.experimental._config.use_duck_shape = False"]
    if recipe.dynamic:
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
    if recipe.quantize == "int8-dynamic":
        lines += [
            "from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_",
            f"quantize_(pipe.{name}, Int8DynamicActivationInt8WeightConfig())",
        ]
    return lines


def _compile_line(mode: str, name: str, method: str | None, recipe: ResolvedRecipe) -> str:
    arguments = [f"fullgraph=True, dynamic={recipe.dynamic}"]
    settings = ", ".join(f"{k!r}: {v!r}" for k, v in sorted(recipe.inductor.items()))
    if recipe.mode != "default" and recipe.inductor:
        # torch.compile refuses mode and options together; a mode is its options (what the
        # build's compiler applies first), so they go in one dict, the recipe's settings last.
        mode = f"torch._inductor.list_mode_options({recipe.mode!r}, {recipe.dynamic})"
        arguments.append(f"options={{**{mode}, {settings}}}")
    elif recipe.mode != "default":
        arguments.append(f"mode={recipe.mode!r}")
    elif recipe.inductor:
        arguments.append(f"options={{{settings}}}")
    args = ", ".join(arguments)
    if method is not None:
        return f"pipe.{name}.{method} = torch.compile(pipe.{name}.{method}, {args})"
    if mode == "regional":
        return f"pipe.{name}.compile_repeated_blocks({args})"
    return f"pipe.{name}.compile({args})"
