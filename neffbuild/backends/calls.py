"""One warmup call of a prepared pipeline, as the build worker, `verify --replay` and
`neffbuild.serve.warmup` all make it: the manifest's call arguments for a shape, and what the
call cost in compiles (the backend's counters before and after)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from neffbuild.backends.artifacts import package_compiles, uses_packages
from neffbuild.backends.base import Backend
from neffbuild.documents.manifest import ModelEntry, Shape


def call_kwargs(entry: ModelEntry, shape: Shape) -> dict[str, Any]:
    import torch

    from neffbuild.backends.pipelines import pipeline_facts

    facts = pipeline_facts(entry)
    tuples = facts.tuples if facts else {}
    # TOML has no tuples; SDXL's size conditioning concatenates them (original_size + crops...).
    kwargs: dict[str, Any] = {
        k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in entry.call_arguments().items()
    }
    kwargs.update(
        height=shape.height,
        width=shape.width,
        num_images_per_prompt=shape.batch,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="pt",
    )
    return kwargs


@dataclass(frozen=True, slots=True)
class MeasuredCall:
    seconds: float
    counters: dict[str, int]  # what changed in the backend's counters during the call
    compiles: int
    images: Any
    trace_s: float = 0.0  # of seconds: Dynamo tracing the call's Python into graphs
    compile_s: float = 0.0  # of seconds: the compile backend on those graphs (AOTAutograd, Inductor, C++)


def _compile_seconds() -> tuple[float, float]:
    """(Dynamo's compile time, its backend's part) so far in this process, from torch's own
    per-phase timers; zeros where this torch has none (a private table, kept since torch 2.1)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0, 0.0
    return (
        sum(compilation_time_metrics.get("_compile.compile_inner", ())),
        sum(compilation_time_metrics.get("OutputGraph.call_user_compiler", ())),
    )


def measured_call(backend: Backend, runner: Any, entry: ModelEntry, shape: Shape) -> MeasuredCall:
    """Call the prepared pipeline once at `shape` and count what it compiled."""
    import torch

    before = backend.counters()
    dynamo_before, backend_before = _compile_seconds()
    started = time.perf_counter()
    with torch.inference_mode():
        images = runner(**call_kwargs(entry, shape)).images
    seconds = time.perf_counter() - started
    dynamo_after, backend_after = _compile_seconds()
    after = backend.counters()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))}
    delta = {k: v for k, v in delta.items() if v}
    compile_s = backend_after - backend_before
    trace_s = max(0.0, dynamo_after - dynamo_before - compile_s)
    compiles = backend.compiles_in(delta)
    if uses_packages(entry):  # nothing may trace or build: each frame or C++ build is a compile
        compiles += package_compiles(delta)
    return MeasuredCall(seconds, delta, compiles, images, trace_s, compile_s)
