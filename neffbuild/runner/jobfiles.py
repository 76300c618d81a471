"""What the core hands a worker process (a job file) and what it hands back (a result file, and
phase events appended while it runs): the files between the two sides, validated both ways."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from neffbuild.documents.manifest import ModelEntry, Shape
from neffbuild.fs.atomic import write_atomic

OnPhase = Callable[[str, str], None]  # (unit_id, phase) as the worker reports it


# Given the number of units, a context that yields the OnPhase a run reports to (the CLI's display).
Progress = Callable[[int], contextlib.AbstractContextManager[OnPhase]]


def no_progress(total: int) -> contextlib.AbstractContextManager[OnPhase]:
    return contextlib.nullcontext(lambda unit_id, phase: None)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WorkerJob(_Frozen):
    """Run the warmup call for these shapes of one model entry, in this fresh process."""

    purpose: Literal["build", "replay"]  # changes the phase reported and nothing else
    entry: ModelEntry
    model_ref: str
    unit_ids: tuple[str, ...]
    shapes: tuple[Shape, ...]
    outputs_dir: str | None = None  # where to save each call's output tensor, for comparisons
    watch_dir: str | None = None  # replay: report cache files each call creates, modifies or deletes
    events_file: str | None = None  # where the worker appends its phase events (JSON lines)
    trace: bool = False  # replay: also report which files under watch_dir each call opened (runner/opened.py)
    fail_fast: bool = False  # replay: stop at the first compile (or after the first call that compiled)


class WrittenFile(_Frozen):
    """A cache file one call changed: in a replay, what it would have written into the cache."""

    path: str
    size: int  # bytes after the call (0 if deleted)
    change: Literal["new", "modified", "deleted"]


class ShapeRun(_Frozen):
    unit_id: str
    first_call_s: float
    counters: dict[str, int]
    compiles: int
    trace_s: float = 0.0  # of first_call_s: Dynamo tracing (calls.MeasuredCall)
    compile_s: float = 0.0  # of first_call_s: the compile backend
    output: str | None = None
    written: tuple[WrittenFile, ...] = ()
    inputs: dict[
        str, tuple[str, ...]
    ] = {}  # per component: its distinct input signatures (components.input_signatures)
    # With job.trace: files under watch_dir (relative) opened during this call. A kernel an
    # earlier unit of the same process loaded is not opened again: the union is what was read.
    opened: tuple[str, ...] = ()
    stopped: bool = False  # job.fail_fast: the call was stopped at its first compile, before the compiler ran


class WorkerResult(_Frozen):
    fingerprint: dict[str, str]
    load_s: float
    runs: tuple[ShapeRun, ...]
    error: str | None = None
    traceback: str | None = None  # the worker's own, shown by the CLI with --debug
    peak_rss: int = 0  # bytes: the worker's peak resident memory (its own or a child's, whichever is larger)
    opened_loading: tuple[str, ...] = ()  # with job.trace: files under watch_dir opened before the first call
    # Each environment variable the process read from torch's import on (backends/envreads.py):
    # name -> digest of its value, "" where unset; and the compiler's own key inputs, as digests.
    env_reads: dict[str, str] = {}
    compiler_keys: dict[str, str] = {}


def write_json_atomic(path: Path, model: BaseModel) -> None:
    write_atomic(path, model.model_dump_json(indent=1).encode())


def result_path(job_file: Path, rank: int = 0) -> Path:
    """Where a worker leaves its result. Rank 0 speaks for a torchrun group; another rank leaves
    one only when it fails, because torchrun stops the whole group at the first failure and
    rank 0 may be stopped before it can tell what went wrong."""
    suffix = ".result.json" if rank == 0 else f".rank{rank}.result.json"
    return job_file.with_name(job_file.stem + suffix)


def group_result(job_file: Path, code: int) -> WorkerResult | None:
    """Rank 0's result, or the first failing rank's where rank 0 left none or claims success
    for a group that failed."""
    result = read_result(result_path(job_file))
    if result is not None and (result.error is not None or code == 0):
        return result
    failed = (read_result(p) for p in sorted(job_file.parent.glob(f"{job_file.stem}.rank*.result.json")))
    return next((r for r in failed if r is not None), result)


def read_result(path: Path) -> WorkerResult | None:
    """The worker's result; None if it left none or half of one (it was killed, or crashed)."""
    try:
        return WorkerResult.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def append_event(events_file: str | None, phase: str, unit_id: str) -> None:
    """Worker side: one JSON line per phase change (one write, so the parent never reads half)."""
    if not events_file:
        return
    line = json.dumps({"phase": phase, "unit": unit_id, "at": time.time()}) + "\n"
    fd = os.open(events_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class EventReader:
    """Parent side: hands each complete new line of a worker's events file to on_phase."""

    def __init__(self, path: Path, on_phase: OnPhase) -> None:
        self.path = path
        self.on_phase = on_phase
        self._offset = 0

    def poll(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                event = json.loads(line)
                self.on_phase(str(event["unit"]), str(event["phase"]))
