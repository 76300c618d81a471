"""What the `neuron` backend refuses in a manifest entry: recipe settings neuronx-cc cannot
honour, and tensor parallel where the transformer has no _tp_plan or the heads do not divide."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffbuild.backends.problems import Problem

if TYPE_CHECKING:
    from neffbuild.documents.manifest import LoadedManifest, ModelEntry

# Transformers whose class declares a `_tp_plan` in diffusers 0.42 (a test checks this list
# against the installed diffusers); planning must not import torch, so it is a table.
TP_TRANSFORMERS = frozenset(
    {
        "FluxTransformer2DModel",
        "Flux2Transformer2DModel",
        "QwenImageTransformer2DModel",
        "QwenImage21Transformer2DModel",
    }
)
_TP_PIPELINES = re.compile(r"^(Flux|Flux2|QwenImage)\w*Pipeline$")


def recipe_refusals(entry: ModelEntry) -> list[Problem]:
    """What a recipe asks that torch.compile(backend="neuron") cannot do: neuronx-cc compiles
    static shapes only and takes no Inductor settings or modes; torchao's int8 kernels are CPU/CUDA ones."""
    problems = []
    for spec in entry.components:
        recipe = entry.recipe_for(spec)
        if recipe.dynamic:
            problems.append(Problem("compile.dynamic", "the neuron backend compiles static shapes only (neuronx-cc)",
                                    "remove dynamic; list every shape in shapes"))  # fmt: skip  # arguments packed by meaning, not one a line
        if recipe.mode != "default" or recipe.inductor:
            problems.append(Problem("compile.mode" if recipe.mode != "default" else "compile.inductor",
                                    "Inductor's modes and settings do not reach neuronx-cc",
                                    "remove mode and inductor; neuronx-cc flags go in [model.env] NEURON_CC_FLAGS"))  # fmt: skip  # arguments packed by meaning, not one a line
        if recipe.artifact != "cache":
            problems.append(Problem("compile.artifact", f"{recipe.artifact!r}: AOTInductor packages are Inductor's "
                                    "(C++/Triton), and nothing here has verified a TorchNeuron path that reaches its "
                                    "NEFF cache without tracing",
                                    "use artifact = 'cache' (the NEFF cache); the documented counterpart is "
                                    "vLLM-Neuron's Precompile Cache (docs/serving.md, 'Neuron')"))  # fmt: skip  # arguments packed by meaning, not one a line
        if recipe.quantize is not None:
            problems.append(Problem("compile.quantize", "torchao's int8 kernels do not run on Neuron",
                                    "remove quantize (quantize for Neuron before saving the model)"))  # fmt: skip  # arguments packed by meaning, not one a line
    return list({str(p): p for p in problems}.values())


def tp_problems(entry: ModelEntry, loaded: LoadedManifest) -> list[Problem]:
    """Why entry's tensor_parallel cannot work (nothing when it is 1)."""
    if entry.tensor_parallel == 1:
        return []
    n = entry.tensor_parallel
    config = _transformer_config(loaded, entry)
    class_name = config.get("_class_name")
    problems = []
    if isinstance(class_name, str) and class_name not in TP_TRANSFORMERS:
        problems.append(
            Problem(
                "tensor_parallel",
                f"{class_name} has no _tp_plan in diffusers; "
                f"tensor parallel works for {', '.join(sorted(TP_TRANSFORMERS))}",
                "use tensor_parallel = 1",
            )
        )
    elif class_name is None and not _TP_PIPELINES.match(entry.pipeline):
        problems.append(
            Problem(
                "tensor_parallel",
                f"cannot confirm that {entry.pipeline}'s transformer has a _tp_plan "
                "(only Flux, Flux2 and QwenImage transformers do)",
                "use tensor_parallel = 1",
            )
        )
    heads = config.get("num_attention_heads")
    if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 and heads % n:
        divisors = [d for d in range(2, min(heads, 4096) + 1) if heads % d == 0]
        problems.append(
            Problem(
                "tensor_parallel",
                f"{n} does not divide the transformer's num_attention_heads ({heads})",
                f"use one of {divisors or [1]}",
            )
        )
    return problems


def _transformer_config(loaded: LoadedManifest, entry: ModelEntry) -> dict[str, Any]:
    """The local model's transformer/config.json, or {} (hub model, or unreadable)."""
    from neffbuild.documents.manifest_types import is_local_model

    if not is_local_model(entry.model):
        return {}
    try:
        data = json.loads((Path(loaded.resolve_model(entry)) / "transformer" / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
