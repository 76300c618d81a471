"""Entry point of a worker process: `python -m neffbuild.backends.worker JOB.json`.

Runs in a fresh interpreter whose environment the parent prepared (cache dir, manifest env), so
nothing compiled earlier in another process can make a build look warm.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from neffbuild.backends import artifacts, envreads, get_backend
from neffbuild.backends.base import Backend
from neffbuild.backends.calls import MeasuredCall, measured_call
from neffbuild.backends.components import input_signatures
from neffbuild.documents.manifest import Shape
from neffbuild.runner.jobfiles import (
    ShapeRun,
    WorkerJob,
    WorkerResult,
    WrittenFile,
    append_event,
    result_path,
    write_json_atomic,
)
from neffbuild.runner.opened import Opened, opened_under
from neffbuild.runner.workers import die_with_parent

# Modules to import before the job runs (comma-separated). The seam through which tests register
# a substitute compile backend (tests/neuron_double.py); future backends may load plugins so.
WORKER_IMPORTS_ENV = "NEFFBUILD_WORKER_IMPORTS"


def run_job(job: WorkerJob, backend: Backend, env: Mapping[str, str]) -> WorkerResult:
    # The runtime first: importing it may set defaults in this environment (torch_neuronx does),
    # and the key must name the environment the compiler runs in.
    with _traced(job) as loading:
        keys = backend.compiler_keys()  # as the environment set them at import, before any setting of ours
        backend.prepare_process(len(job.shapes))
        facts = backend.worker_facts(env, job.entry.device)
        fingerprint = backend.fingerprint(facts, env, backend.scope(job.entry))
        started = time.perf_counter()
        pipe = backend.load_pipeline(job.entry, job.model_ref)
        before = backend.counters()
        runner = backend.apply_mode(pipe, job.entry, _served_packages(job, backend, env))
        loaded = _delta(before, backend.counters())
        load_s = time.perf_counter() - started
    if job.fail_fast:
        backend.watch_compiles(_stop_at_compile)
    runs: list[ShapeRun] = []
    with _packaging(job, backend, env, runner):
        for unit_id, shape in zip(job.unit_ids, job.shapes, strict=True):
            runs.append(_run_shape(job, backend, runner, unit_id, shape))
            if job.fail_fast and (runs[-1].compiles or runs[-1].written):
                break  # the replay has its answer: a miss; the rest would only compile
    if runs and artifacts.package_compiles(loaded):
        runs[0] = _with_load(runs[0], loaded)
    reads = envreads.recorder()
    return WorkerResult(
        fingerprint=fingerprint,
        load_s=load_s,
        runs=tuple(runs),
        opened_loading=loading.paths if loading else (),
        env_reads=reads.recorded() if reads else {},
        compiler_keys=keys,
    )


class FirstCompile(BaseException):
    """Raised from the compiler's own miss count (Backend.watch_compiles) to stop a fail-fast
    replay's call before the compiler works. A BaseException: torch falls back from an Exception
    in its cache lookup (to a bypass that compiles anyway) but lets this one through."""


def _stop_at_compile(counter: str) -> None:
    raise FirstCompile(counter)


def _call(job: WorkerJob, backend: Backend, runner: Any, shape: Shape) -> tuple[MeasuredCall, bool]:
    """The shape's measured call, and whether it was stopped at its first compile (then no
    images, and what the counters showed until then: one compile)."""
    if not job.fail_fast:
        return measured_call(backend, runner, job.entry, shape), False
    before = backend.counters()
    started = time.perf_counter()
    try:
        return measured_call(backend, runner, job.entry, shape), False
    except FirstCompile:
        delta = _delta(before, backend.counters())
        return MeasuredCall(time.perf_counter() - started, delta, max(1, backend.compiles_in(delta)), None), True


def _served_packages(job: WorkerJob, backend: Backend, env: Mapping[str, str]) -> Path | None:
    """A replay of an entry that ships packages serves from them, as `prepare` does on a host:
    the packages in the replayed cache dir, loaded; nothing traced (a build compiles, to package)."""
    if job.purpose == "replay" and artifacts.uses_packages(job.entry):
        return Path(env[backend.cache_env])
    return None


def _delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    changed = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))}
    return {k: v for k, v in changed.items() if v}


def _with_load(run: ShapeRun, loaded: Mapping[str, int]) -> ShapeRun:
    """What loading the packages compiled (a loader's runtime kernels the bundle lacked), charged
    to the entry's first unit: a replay that compiled at load is not a hit."""
    counters = {**run.counters, **{f"load.{k}": v for k, v in loaded.items()}}
    return run.model_copy(update={"counters": counters, "compiles": run.compiles + artifacts.package_compiles(loaded)})


@contextmanager
def _packaging(job: WorkerJob, backend: Backend, env: Mapping[str, str], pipe: Any) -> Iterator[None]:
    """For an entry whose artifact is a package (a build, not a replay): the listed components'
    inputs during the block, exported and packaged into the cache dir after it (artifacts.py)."""
    if job.purpose != "build" or not artifacts.uses_packages(job.entry):
        yield
        return
    with artifacts.captured_inputs(job.entry) as captured:
        yield
    artifacts.write_packages(pipe, job.entry, Path(env[backend.cache_env]), captured)


@contextmanager
def _traced(job: WorkerJob) -> Iterator[Opened | None]:
    """The files under the watched dir the block opens, when the job asks (else None)."""
    if not (job.trace and job.watch_dir):
        yield None
        return
    with opened_under(Path(job.watch_dir)) as seen:
        yield seen


def _run_shape(job: WorkerJob, backend: Backend, runner: Any, unit_id: str, shape: Shape) -> ShapeRun:
    import torch

    append_event(job.events_file, "compiling" if job.purpose == "build" else "replaying", unit_id)
    watched = Path(job.watch_dir) if job.watch_dir else None
    files_before = _snapshot(backend, watched)
    inputs_before = input_signatures()
    with _traced(job) as opened:
        call, stopped = _call(job, backend, runner, shape)
    files_after = _snapshot(backend, watched)
    written = _changes(files_before, files_after)
    inputs = {k: tuple(s for s in v if s not in inputs_before.get(k, ())) for k, v in input_signatures().items()}
    output = None
    if job.outputs_dir and not stopped:
        output = str(Path(job.outputs_dir) / f"{unit_id.replace('/', '__')}.pt")
        torch.save(call.images.detach().cpu(), output)
    return ShapeRun(
        unit_id=unit_id,
        first_call_s=call.seconds,
        counters=call.counters,
        compiles=call.compiles,
        trace_s=call.trace_s,
        compile_s=call.compile_s,
        output=output,
        written=written,
        inputs={k: v for k, v in inputs.items() if v},
        opened=opened.paths if opened else (),
        stopped=stopped,
    )


def _snapshot(backend: Backend, cache_dir: Path | None) -> dict[str, tuple[int, int, int]]:
    """(size, mtime, inode) of every bundle-worthy file, and of any in a layout the backend does
    not know: any change during a replay is a compile (a rewrite by rename changes the inode even
    when size and mtime happen to match), also one the bundler would have missed."""
    if cache_dir is None:
        return {}
    snapshot = {}
    for rel in [*backend.select_files(cache_dir), *backend.unrecognised_files(cache_dir)]:
        st = (cache_dir / rel).stat()
        snapshot[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return snapshot


def _changes(
    before: Mapping[str, tuple[int, int, int]], after: Mapping[str, tuple[int, int, int]]
) -> tuple[WrittenFile, ...]:
    changed = [
        WrittenFile(path=p, size=st[0], change="new" if p not in before else "modified")
        for p, st in after.items()
        if before.get(p) != st
    ]
    changed += [WrittenFile(path=p, size=0, change="deleted") for p in before if p not in after]
    return tuple(sorted(changed, key=lambda w: w.path))


def main(argv: list[str]) -> int:
    job_file = Path(argv[0])
    rank, world = group_rank(os.environ)
    die_with_parent(os.environ)
    job = WorkerJob.model_validate_json(job_file.read_text())
    if not writes_result(os.environ):  # rank 0 speaks for a torchrun group
        job = job.model_copy(update={"events_file": None})
    append_event(job.events_file, "loading", job.unit_ids[0])
    envreads.install()  # before torch is imported: every variable the compiler reads is seen
    try:
        import_seams(os.environ)
        result = run_job(job, get_backend(job.entry.backend), os.environ)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises a typed error
        trace = traceback.format_exc()
        sys.stderr.write(trace)
        first_line = next(iter(str(exc).strip().splitlines()), "")
        error = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
        if world > 1:
            error = f"rank {rank} of {world}: {error}"
        result = WorkerResult(fingerprint={}, load_s=0.0, runs=(), error=error, traceback=trace)
    result = result.model_copy(update={"peak_rss": peak_rss()})
    if writes_result(os.environ) or result.error is not None:
        write_json_atomic(result_path(job_file, rank), result)
    return 0 if result.error is None else 1


def peak_rss() -> int:
    """Bytes: the larger of this process's peak RSS and its largest waited-for child's (the C++
    compiler runs as one); Linux reports kilobytes."""
    import resource

    kib = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    )
    return kib * 1024


def import_seams(env: Mapping[str, str]) -> None:
    for name in (n.strip() for n in env.get(WORKER_IMPORTS_ENV, "").split(",")):
        if name:
            importlib.import_module(name)


def group_rank(env: Mapping[str, str]) -> tuple[int, int]:
    """(this process's rank, the group's size) as torchrun sets them; (0, 1) outside a group, and
    for values torchrun would not set (the worker must still get to report its result)."""
    try:
        return int(env.get("RANK", "0")), max(1, int(env.get("WORLD_SIZE", "1")))
    except ValueError:
        return 0, 1


def writes_result(env: Mapping[str, str]) -> bool:
    """Under torchrun (tensor parallel) every rank runs this module; rank 0 speaks for the group
    (same fingerprint, same graphs); another rank writes only its failure (runner/jobfiles.py)."""
    return group_rank(env)[0] == 0


def exit_now(code: int) -> None:
    """Exit as the interpreter would, less its teardown: threads joined as at exit (a thread pool's
    shutdown first), the exit handlers run (logging flushed), then os._exit. Freeing what torch,
    Dynamo and diffusers built was ~1.6 of a replay worker's ~17 CPU-s (bench/RESULTS.md)."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
