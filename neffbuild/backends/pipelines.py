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

from neffbuild.backends.pipecode import FORWARD, WHOLE, CallFacts, call_facts
from neffbuild.backends.problems import Problem
from neffbuild.documents.manifest import ModelEntry

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
    if pipeline is not None and not any(p.field == "components" for p in problems):
        problems.extend(_unreached_components(pipeline, entry))
    return problems, unchecked


def _unreached_components(pipeline: type, entry: ModelEntry) -> list[Problem]:
    """Components the pipeline's call never runs as listed: a VAE's forward or encode in a
    text-to-image call that only decodes. Refused only where the code shows every use of the
    component (it is never handed on whole); the build would compile the rest first, then fail."""
    import torch

    uses = call_facts(pipeline).uses
    problems = []
    for spec, (name, method) in zip(entry.components, entry.components_named(), strict=True):
        used = uses.get(name, frozenset())
        wanted = method or FORWARD
        if not used or WHOLE in used or wanted in used or (method is None and entry.mode == "regional"):
            continue  # regional compiles the blocks forward runs; unknown uses refuse nothing
        called = sorted(m for m in used if not m.startswith(".") and m != FORWARD and not hasattr(torch.nn.Module, m))
        instead = ", ".join(f"'{name}.{m}'" for m in called) or "another component"
        problems.append(
            Problem("components", f"{spec!r}: {pipeline.__name__}.__call__ never calls {name}.{wanted}; it calls {instead}",
                    f"list {instead} instead: only what the call runs is compiled and cached")
        )  # fmt: skip  # arguments packed by meaning, not one a line
    return problems


def _pipeline_class(diffusers: Any, name: str, problems: list[Problem]) -> Any:
    known = sorted(n for n in dir(diffusers) if n.endswith("Pipeline"))
    if name not in dir(diffusers):
        problems.append(
            Problem("pipeline", f"diffusers {diffusers.__version__} has no pipeline {name!r}{_did_you_mean(name, known)}",
                    "use the class name of a diffusers pipeline, as in model_index.json's _class_name")
        )  # fmt: skip  # arguments packed by meaning, not one a line
        return None
    try:
        cls = getattr(diffusers, name)
    except Exception as exc:  # noqa: BLE001 - an optional dependency of that pipeline is missing
        problems.append(
            Problem(
                "pipeline", f"{name} cannot be imported here ({type(exc).__name__}: {exc})", "install what it needs"
            )
        )
        return None
    if type(cls).__name__ == "DummyObject":
        needs = ", ".join(getattr(cls, "_backends", ()))
        problems.append(
            Problem("pipeline", f"{name} needs packages that are not installed ({needs})", f"pip install {needs}")
        )
        return None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        problems.append(
            Problem(
                "pipeline",
                f"{name} is not a pipeline class{_did_you_mean(name, known)}",
                "name a diffusers *Pipeline class",
            )
        )
        return None
    return cls


def pipeline_facts(entry: ModelEntry) -> CallFacts | None:
    """What the entry's pipeline code says about its call arguments; None where diffusers or
    the class is not importable here (plan then keys every argument as written)."""
    try:
        diffusers = import_diffusers()
        cls = getattr(diffusers, entry.pipeline, None)
    except Exception:  # noqa: BLE001 - no diffusers, or the pipeline's optional dependency is missing
        return None
    if not isinstance(cls, type) or not issubclass(cls, diffusers.DiffusionPipeline):
        return None
    return call_facts(cls)


def _call_problems(pipeline: type, entry: ModelEntry) -> list[Problem]:
    # Where __call__ takes **kwargs, diffusers swallows an unknown name (a typo runs the default),
    # so the names it reads out of **kwargs are the only others it accepts.
    facts = call_facts(pipeline)
    accepted = list(facts.accepted)
    through = f" (and {', '.join(facts.pass_through)} through **kwargs)" if facts.pass_through else ""
    problems = [
        Problem(
            f"call.{name}",
            f"{pipeline.__name__}.__call__ has no parameter {name!r}{_did_you_mean(name, accepted)}",
            f"its parameters: {', '.join(facts.parameters)}{through}",
        )
        for name in entry.call
        if name not in accepted
    ]
    for name, length in facts.tuples.items():
        value = entry.call.get(name)
        if isinstance(value, list) and length is not None and len(value) != length:
            problems.append(
                Problem(f"call.{name}", f"{pipeline.__name__} takes a {length}-tuple, got {len(value)} items",
                        f"write {name} = [{', '.join(['…'] * length)}] (passed to the pipeline as a tuple)")
            )  # fmt: skip  # arguments packed by meaning, not one a line
        elif value is not None and not isinstance(value, list):
            problems.append(
                Problem(f"call.{name}", f"{pipeline.__name__} takes a tuple, got {value!r}", f"write {name} = [...]")
            )
    return problems


def _component_problems(entry: ModelEntry, index: Mapping[str, Any], unchecked: list[str]) -> list[Problem]:
    listed = {k: v for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 2}
    problems: list[Problem] = []
    for spec, (name, method) in zip(entry.components, entry.components_named(), strict=True):
        if name not in listed:
            names = sorted(k for k, v in listed.items() if v[0] is not None)
            problems.append(
                Problem("components", f"{name!r} is not a component of this model{_did_you_mean(name, names)}",
                        f"model_index.json lists {', '.join(names) or 'none'}")
            )  # fmt: skip  # arguments packed by meaning, not one a line
            continue
        library, class_name = listed[name]
        if not isinstance(library, str) or not isinstance(class_name, str):
            problems.append(
                Problem("components", f"{name!r} is empty in this model (null in model_index.json)", "remove it")
            )
            continue
        cls = _component_class(library, class_name)
        if cls is None:
            unchecked.append(f"component {spec!r} ({library}.{class_name} is not importable here)")
            continue
        found = _class_problems(entry, spec, name, method, cls)
        if not found:
            from neffbuild.backends.recipe_checks import module_recipe_problems

            found = module_recipe_problems(entry, spec, name, cls)
        problems.extend(found)
    return list({str(p): p for p in problems}.values())


def _class_problems(entry: ModelEntry, spec: str, name: str, method: str | None, cls: type) -> list[Problem]:
    import torch

    if not issubclass(cls, torch.nn.Module):
        return [
            Problem("components", f"{name!r} is a {cls.__name__}, not a torch module: nothing to compile", "remove it")
        ]
    if method is not None:
        if callable(getattr(cls, method, None)) and not method.startswith("_"):
            return []
        methods = [m for m in dir(cls) if not m.startswith("_") and callable(getattr(cls, m, None))]
        return [
            Problem("components", f"{spec!r}: {cls.__name__} has no method {method!r}{_did_you_mean(method, methods)}",
                    f"name a method the pipeline calls on {name}, e.g. '{name}.decode' for a VAE")
        ]  # fmt: skip  # arguments packed by meaning, not one a line
    if entry.mode == "regional" and not getattr(cls, "_repeated_blocks", None):
        return [
            Problem("components", f"{name!r}: {cls.__name__} declares no _repeated_blocks, so regional compile has nothing to compile",
                    "use mode = 'full' for it (one entry per mode)")
        ]  # fmt: skip  # arguments packed by meaning, not one a line
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
    from neffbuild.documents.manifest_reading import read_json_object

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


_CALL_GUIDANCE = object()


def guidance_doubles(entry: ModelEntry, model_ref: str, local: bool, guidance: Any = _CALL_GUIDANCE) -> bool | None:
    """Does classifier-free guidance double the batch the components see? The pipeline's own
    `do_classifier_free_guidance` property, run on the call's guidance_scale (or the one given)
    and the model's configs (model_index.json, <component>/config.json); None where that cannot
    be known here."""
    facts = pipeline_facts(entry)
    if facts is None or not local:
        return None
    cls = getattr(import_diffusers(), entry.pipeline)
    prop = inspect.getattr_static(cls, "do_classifier_free_guidance", None)
    if not isinstance(prop, property) or prop.fget is None:
        return None
    if guidance is _CALL_GUIDANCE:
        guidance = entry.call_arguments().get("guidance_scale", facts.defaults.get("guidance_scale"))
    try:
        return bool(prop.fget(_ConfigView(Path(model_ref), guidance)))
    except Exception:  # noqa: BLE001 - the property reads something a config cannot answer
        return None


class _ConfigView:
    """Just enough of a loaded pipeline for a property that reads configs: `self.config`
    (model_index.json), `self.<component>.config` (its config.json), `self._guidance_scale`."""

    def __init__(self, root: Path, guidance: Any) -> None:
        from types import SimpleNamespace

        from neffbuild.documents.manifest_reading import read_json_object

        self._guidance_scale = guidance
        self._root = root
        index = read_json_object(root / "model_index.json")
        self.config = SimpleNamespace(
            **{k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)}
        )

    def __getattr__(self, name: str) -> Any:
        from types import SimpleNamespace

        from neffbuild.documents.manifest_reading import read_json_object

        path = self._root / name / "config.json"
        if name.startswith("_") or not path.is_file():
            raise AttributeError(name)
        return SimpleNamespace(config=SimpleNamespace(**read_json_object(path)))
