"""What plan checks against diffusers before any worker starts, and what it knows of pipelines.

A mistake found here costs a second; found by a worker, it costs the 20-50 s of loading a
pipeline first. Checked: the pipeline class exists, the call arguments are parameters of its
`__call__`, the listed components are in the model's model_index.json, are torch modules and
have the method a `component.method` entry names. diffusers (and so torch) is imported lazily,
without autoloading device backends: torch_neuronx would start the Neuron runtime.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neffbuild.backends.base import Problem
from neffbuild.documents.manifest import ModelEntry

# Pipelines whose prompt encoders pad every prompt to a fixed token length (tokenizer
# padding="max_length", truncation=True), read in diffusers 0.42's sources and re-checked against
# the installed diffusers by tests/units/test_plan.py: the text changes tensor values, never shapes,
# so the prompt texts are left out of the key (their number stays in: it is the batch).
# The lines that only warn about truncation (padding="longest") do not feed the models.
PADDED_PROMPTS: Mapping[str, frozenset[str]] = {
    "FluxPipeline": frozenset({"prompt", "prompt_2", "negative_prompt", "negative_prompt_2"}),
    "Flux2KleinPipeline": frozenset({"prompt"}),
    "StableDiffusion3Pipeline": frozenset(
        {"prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3"}
    ),
}
# Call arguments that never change a compiled graph: the scheduler runs eagerly and hands the
# models a timestep tensor per step, so the number of steps changes how often graphs run, not
# what they are (diffusers' Neuron guide says the same; tests/units/test_plan.py replays it).
WARMUP_ONLY = frozenset({"num_inference_steps"})
_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
_LIBRARIES = ("diffusers", "transformers")  # component libraries whose classes plan may import


def import_diffusers() -> Any:
    """diffusers, with torch imported (if it was not yet) without device-backend autoload."""
    if "torch" not in sys.modules:
        saved = os.environ.get(_AUTOLOAD)
        os.environ[_AUTOLOAD] = "0"
        try:
            import torch  # noqa: F401
        finally:
            if saved is None:
                os.environ.pop(_AUTOLOAD, None)
            else:
                os.environ[_AUTOLOAD] = saved
    import diffusers

    return diffusers


def check_pipeline(entry: ModelEntry, index: Mapping[str, Any] | None) -> tuple[list[Problem], list[str]]:
    """Problems with the entry's pipeline, call arguments and components, and what could not be
    checked (index None: the model's model_index.json is not on this host)."""
    diffusers = import_diffusers()
    problems: list[Problem] = []
    unchecked: list[str] = []
    pipeline = _pipeline_class(diffusers, entry.pipeline, problems)
    if pipeline is not None:
        problems.extend(_call_problems(pipeline, entry))
    if index is None:
        unchecked.append("its components (the model's model_index.json is not on this host)")
    else:
        problems.extend(_component_problems(entry, index, unchecked))
    return problems, unchecked


def _pipeline_class(diffusers: Any, name: str, problems: list[Problem]) -> Any:
    known = sorted(n for n in dir(diffusers) if n.endswith("Pipeline"))
    if name not in dir(diffusers):
        problems.append(
            Problem("pipeline", f"diffusers {diffusers.__version__} has no pipeline {name!r}{_did_you_mean(name, known)}",
                    "use the class name of a diffusers pipeline, as in model_index.json's _class_name")
        )  # fmt: skip
        return None
    try:
        cls = getattr(diffusers, name)
    except Exception as exc:  # noqa: BLE001 - an optional dependency of that pipeline is missing
        problems.append(Problem("pipeline", f"{name} cannot be imported here ({type(exc).__name__}: {exc})", "install what it needs"))
        return None
    if type(cls).__name__ == "DummyObject":
        needs = ", ".join(getattr(cls, "_backends", ()))
        problems.append(Problem("pipeline", f"{name} needs packages that are not installed ({needs})", f"pip install {needs}"))
        return None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        problems.append(
            Problem("pipeline", f"{name} is not a pipeline class{_did_you_mean(name, known)}", "name a diffusers *Pipeline class")
        )
        return None
    return cls


def _call_problems(pipeline: type, entry: ModelEntry) -> list[Problem]:
    parameters = inspect.signature(pipeline.__call__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []  # **kwargs: anything goes through
    accepted = [n for n in parameters if n != "self"]
    return [
        Problem(
            f"call.{name}",
            f"{pipeline.__name__}.__call__ has no parameter {name!r}{_did_you_mean(name, accepted)}",
            f"its parameters: {', '.join(accepted)}",
        )
        for name in entry.call
        if name not in parameters
    ]


def _component_problems(entry: ModelEntry, index: Mapping[str, Any], unchecked: list[str]) -> list[Problem]:
    listed = {k: v for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 2}
    problems: list[Problem] = []
    for spec, (name, method) in zip(entry.components, entry.components_named(), strict=True):
        if name not in listed:
            names = sorted(k for k, v in listed.items() if v[0] is not None)
            problems.append(
                Problem("components", f"{name!r} is not a component of this model{_did_you_mean(name, names)}",
                        f"model_index.json lists {', '.join(names) or 'none'}")
            )  # fmt: skip
            continue
        library, class_name = listed[name]
        if not isinstance(library, str) or not isinstance(class_name, str):
            problems.append(Problem("components", f"{name!r} is empty in this model (null in model_index.json)", "remove it"))
            continue
        cls = _component_class(library, class_name)
        if cls is None:
            unchecked.append(f"component {spec!r} ({library}.{class_name} is not importable here)")
            continue
        problems.extend(_class_problems(entry, spec, name, method, cls))
    return problems


def _class_problems(entry: ModelEntry, spec: str, name: str, method: str | None, cls: type) -> list[Problem]:
    import torch

    if not issubclass(cls, torch.nn.Module):
        return [Problem("components", f"{name!r} is a {cls.__name__}, not a torch module: nothing to compile", "remove it")]
    if method is not None:
        if callable(getattr(cls, method, None)) and not method.startswith("_"):
            return []
        methods = [m for m in dir(cls) if not m.startswith("_") and callable(getattr(cls, m, None))]
        return [
            Problem("components", f"{spec!r}: {cls.__name__} has no method {method!r}{_did_you_mean(method, methods)}",
                    f"name a method the pipeline calls on {name}, e.g. '{name}.decode' for a VAE")
        ]  # fmt: skip
    if entry.mode == "regional" and not getattr(cls, "_repeated_blocks", None):
        return [
            Problem("components", f"{name!r}: {cls.__name__} declares no _repeated_blocks, so regional compile has nothing to compile",
                    "use mode = 'full' for it (one entry per mode)")
        ]  # fmt: skip
    return []


def _component_class(library: str, class_name: str) -> type | None:
    if library not in _LIBRARIES:
        return None
    try:
        cls = getattr(importlib.import_module(library), class_name)
    except Exception:  # noqa: BLE001 - unknown to this version, or an optional dependency is missing
        return None
    return cls if isinstance(cls, type) else None


def model_index(model_ref: str, revision: str | None, local: bool) -> Mapping[str, Any] | None:
    """A model's model_index.json: from its directory, or from the local Hugging Face cache for a
    hub model (never from the network); None when this host does not have it."""
    from neffbuild.documents.manifest import read_json_object

    if local:
        return read_json_object(Path(model_ref) / "model_index.json")
    path = _cached_hub_file(model_ref, revision, "model_index.json")
    return read_json_object(path) if path is not None else None


def _cached_hub_file(repo: str, revision: str | None, filename: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo, filename, revision=revision)
    except Exception:  # noqa: BLE001 - an id the hub would refuse: the build will say so
        return None
    return Path(found) if isinstance(found, str) else None


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
