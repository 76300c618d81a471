"""Worker processes: what the core hands one (a job file), what it hands back (a result file and
phase events), and how every worker of a build or replay is started, watched and stopped.

Each worker runs in its own session, so a terminal's Ctrl-C reaches only the CLI, which then
stops every worker's process group (the worker, the compiler's subprocess pool, the C++
compiler) itself: SIGTERM, a short grace, SIGKILL. A worker whose CLI died ends its own group.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from neffbuild.documents.manifest import ModelEntry, Shape
from neffbuild.errors import BuildError, InputError, Interrupted, WorkerKilled
from neffbuild.fs.atomic import write_atomic
from neffbuild.pids import alive
from neffbuild.runner.oomwatch import memory_events_path, oom_kills

# The CLI's pid, set in each worker's environment: a worker outliving it ends itself.
PARENT_PID_ENV = "NEFFBUILD_PARENT_PID"
STOP_GRACE_S = 3.0  # SIGTERM to SIGKILL: a worker's own handler kills its group at once
_POLL_S = 0.2
# What a failed worker leaves that is worth keeping once its scratch dir is deleted.
_KEPT_FILES = ("worker.log", "job.json", "job.result.json", "job.events.jsonl")

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


def _group_result(job_file: Path, code: int) -> WorkerResult | None:
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


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


# -- phase events: the worker appends, the parent polls ----------------------------------------


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


# -- starting and stopping workers -------------------------------------------------------------


class WorkerStopped(Exception):
    """A worker was stopped (or never started) because its build or replay is being interrupted."""


class Workers:
    """Every worker process of one build or replay, each the leader of its own process group."""

    def __init__(self, grace_s: float = STOP_GRACE_S) -> None:
        self.grace_s = grace_s
        self.stopping = False
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        # A signal landing in the main thread between starting a worker and recording it would
        # lose that worker: the handler waits for the record (see `supervised`).
        self.pending_signal: int | None = None
        self.recording = False

    def run(self, command: list[str], env: Mapping[str, str], log: Path, tick: Callable[[], None]) -> int:
        """Run one worker to its end (output to log), calling tick while it runs; its exit code."""
        proc = self._start(command, env, log)
        while not _has_exited(proc.pid):
            tick()
            time.sleep(_POLL_S)
        tick()
        # Not reaped yet, so its pid still names its group: end whatever it left running.
        _signal_group(proc.pid, signal.SIGKILL)
        code = proc.wait()
        with self._lock:
            self._procs.discard(proc)
        if self.stopping:
            raise WorkerStopped
        return code

    def _start(self, command: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
        in_main = threading.current_thread() is threading.main_thread()
        with log.open("ab") as out, self._lock:
            if self.stopping:
                raise WorkerStopped
            self.recording = in_main
            try:
                proc = subprocess.Popen(
                    command,
                    env={**env, PARENT_PID_ENV: str(os.getpid())},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                self._procs.add(proc)
            finally:
                self.recording = False
        if self.pending_signal is not None:
            raise _interrupted(self.pending_signal)
        return proc

    def stop(self) -> None:
        """Stop every running worker group (idempotent): SIGTERM, a grace, then SIGKILL."""
        with self._lock:
            self.stopping = True
            procs = list(self._procs)
        for proc in procs:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()


def _has_exited(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped by stop()
        return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@contextlib.contextmanager
def supervised(cleanup: Callable[[], None] = lambda: None) -> Iterator[Workers]:
    """Workers that SIGINT/SIGTERM stop: the signal raises Interrupted in the main thread (once;
    a second one while stopping is ignored); on the way out, by any exit, every worker group is
    stopped, then cleanup runs (removing scratch), then the previous handlers come back."""
    workers = Workers()

    def handle(signum: int, frame: object) -> None:
        if workers.stopping:
            return
        workers.stopping = True
        if workers.recording:
            workers.pending_signal = signum
            return
        raise _interrupted(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield workers
    finally:
        try:
            workers.stop()
            cleanup()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _interrupted(signum: int) -> Interrupted:
    return Interrupted(signum, f"interrupted by {signal.Signals(signum).name}: every worker stopped")


def run_worker(
    command_for: Callable[[Path], list[str]],
    job: WorkerJob,
    env: Mapping[str, str],
    scratch: Path,
    *,
    workers: Workers | None = None,
    on_phase: OnPhase | None = None,
) -> WorkerResult:
    """Run a job in a fresh process (output to scratch/worker.log, phase events to on_phase);
    raise BuildError (with the worker's traceback as debug_detail) if it fails."""
    scratch.mkdir(parents=True, exist_ok=True)
    job_file = scratch / "job.json"
    job = job.model_copy(update={"events_file": str(scratch / "job.events.jsonl")})
    write_json_atomic(job_file, job)
    log = scratch / "worker.log"
    events = EventReader(Path(job.events_file or ""), on_phase or (lambda unit_id, phase: None))
    memory_events = memory_events_path()
    ooms_before = oom_kills(memory_events)
    if workers is None:
        with supervised() as own:
            code = own.run(command_for(job_file), env, log, events.poll)
    else:
        code = workers.run(command_for(job_file), env, log, events.poll)
    result = _group_result(job_file, code)
    units = ", ".join(job.unit_ids)
    if result is None and not job_file.is_file():  # the parent wrote it and nothing of ours removes it
        raise BuildError(
            f"{units}: its scratch dir {scratch} was removed while its worker ran ({describe_exit(code)}, no result)",
            hint="something else deletes files there, a temp cleaner perhaps; rerun with --work-dir on a dir nothing else cleans",
        )
    if result is None and code < 0:
        ooms_after = oom_kills(memory_events)
        oom = (
            code == -signal.SIGKILL and ooms_before is not None and ooms_after is not None and ooms_after > ooms_before
        )
        how = "killed by the OOM killer (SIGKILL; its cgroup's oom_kill count rose)" if oom else describe_exit(code)
        killed = WorkerKilled(
            f"{units}: worker left no result ({how}): it was killed, not failed by its compile",
            hint="give the unit more memory (or fewer --jobs); a retry may pass"
            if oom
            else "a retry may pass, unless something kills it again",
        )
        killed.how = how
        raise killed
    if result is None:
        raise BuildError(f"{units}: worker left no result ({describe_exit(code)}): it was killed or crashed")
    if result.error or code != 0:
        raise BuildError(
            f"{units}: worker failed: {result.error or describe_exit(code)}", debug_detail=result.traceback
        )
    return result


# -- what a failed worker leaves behind --------------------------------------------------------

# Where failed workers' logs are kept, unless the command says otherwise (`<work dir>/logs`).
DEFAULT_LOGS_DIR = Path(".neffbuild") / "logs"


def logs_dir_for(work_dir: Path | None) -> Path:
    """`<work dir>/logs` with --work-dir, else DEFAULT_LOGS_DIR."""
    return work_dir / "logs" if work_dir else DEFAULT_LOGS_DIR


def run_name() -> str:
    """A dir name for one build's or replay's kept logs: sortable, and unique on this host."""
    return f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def unit_dir_name(unit_id: str) -> str:
    return unit_id.replace("/", "__")


def keep_logs(scratch: Path, dest: Path) -> Path | None:
    """Copy a failed worker's log, job, result and events out of its scratch dir (about to be
    deleted) into dest; the kept log's path, or None if the worker never started."""
    if not (scratch / "worker.log").is_file():
        return None
    dest.mkdir(parents=True, exist_ok=True)
    for name in (*_KEPT_FILES, *(p.name for p in scratch.glob("job.rank*.result.json"))):
        if (scratch / name).is_file():
            shutil.copyfile(scratch / name, dest / name)
    return dest / "worker.log"


def log_tail(log: Path | None, lines: int = 12) -> tuple[str, ...]:
    """The last lines of a log (what a failure prints under its message)."""
    if log is None:
        return ()
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ()
    return tuple(line.rstrip() for line in text.splitlines()[-lines:])


# -- worker side: end with the parent ----------------------------------------------------------


def die_with_parent(env: Mapping[str, str]) -> None:
    """In a worker started by `Workers`: on SIGTERM, or once the neffbuild process that started
    it is gone (SIGKILLed, crashed), kill this worker's whole process group — the compiler's
    subprocess pool and C++ compilers included. A worker run by hand (no PARENT_PID_ENV) is left
    alone, so it never kills a shell's job."""
    parent = env.get(PARENT_PID_ENV)
    if not parent:
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: _kill_own_group())
    _set_parent_death_signal(signal.SIGTERM)
    # The thread acts even while the main thread is inside a long native call; it also covers a
    # parent that died before the prctl, and a torchrun in between (its ranks' parent is torchrun).
    watcher = threading.Thread(target=_watch_parent, args=(int(parent), os.getppid()), daemon=True)
    watcher.start()


def _watch_parent(neffbuild_pid: int, direct_parent: int) -> None:
    while os.getppid() == direct_parent and alive(neffbuild_pid):
        time.sleep(0.5)
    _kill_own_group()


def _kill_own_group() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _set_parent_death_signal(sig: int) -> None:
    """Linux's PR_SET_PDEATHSIG: the kernel signals this process when its parent thread exits."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the watcher thread alone ends the group


# -- scratch space -----------------------------------------------------------------------------


def make_scratch_root(work_dir: Path | None, prefix: str) -> Path:
    """A fresh dir for this run's scratch, in work_dir (created if absent) or the system's temp."""
    try:
        if work_dir is not None:
            work_dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=work_dir))
    except OSError as exc:
        raise InputError(
            f"work dir {work_dir}: cannot make a scratch dir there ({exc.strerror or exc})",
            hint="give --work-dir a writable directory (it is created if absent)",
        ) from None


def remove_tree(path: Path) -> None:
    """Remove a scratch tree, read-only dirs included (a copied cache may have some)."""

    def make_writable_and_retry(function: Callable[[str], object], failed: str, exc_info: object) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), 0o700)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, 0o700)
            function(failed)

    if path.exists():
        shutil.rmtree(path, onerror=make_writable_and_retry)
