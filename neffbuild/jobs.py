"""What the core hands a worker process, and what the worker hands back (JSON files)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from neffbuild.errors import BuildError
from neffbuild.manifest import ModelEntry, Shape


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WorkerJob(_Frozen):
    """Run the warmup call for these shapes of one model entry, in this fresh process."""

    purpose: str  # "build" or "replay": only changes what is reported
    entry: ModelEntry
    model_ref: str
    unit_ids: tuple[str, ...]
    shapes: tuple[Shape, ...]
    outputs_dir: str | None = None  # where to save each call's output tensor, for comparisons
    watch_dir: str | None = None  # replay: report cache files each call creates or modifies


class ShapeRun(_Frozen):
    unit_id: str
    first_call_s: float
    counters: dict[str, int]
    compiles: int
    output: str | None = None
    written: tuple[str, ...] = ()


class WorkerResult(_Frozen):
    fingerprint: dict[str, str]
    load_s: float
    runs: tuple[ShapeRun, ...]
    error: str | None = None


def write_json_atomic(path: Path, model: BaseModel) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(model.model_dump_json(indent=1))
    os.replace(tmp, path)


def read_result(path: Path, log: Path) -> WorkerResult:
    """The worker's result; a missing or broken one means the process died (OOM, signal)."""
    try:
        return WorkerResult.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise BuildError(
            f"worker left no result ({type(exc).__name__}); it probably crashed",
            hint=f"see its log: {log}",
        ) from None


def run_worker(command_for: Callable[[Path], list[str]], job: WorkerJob, env: Mapping[str, str], scratch: Path) -> WorkerResult:
    """Run a job in a fresh process (its output to scratch/worker.log); raise BuildError if it fails."""
    scratch.mkdir(parents=True, exist_ok=True)
    job_file = scratch / "job.json"
    write_json_atomic(job_file, job)
    log = scratch / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.run(command_for(job_file), env=dict(env), stdout=out, stderr=subprocess.STDOUT, check=False)
    result = read_result(job_file.with_name("job.result.json"), log)
    if result.error or proc.returncode != 0:
        raise BuildError(
            f"{', '.join(job.unit_ids)}: worker failed: {result.error or f'exit code {proc.returncode}'}",
            hint=f"see its log: {log}",
        )
    return result
