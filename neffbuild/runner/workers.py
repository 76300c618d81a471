"""Worker processes started, watched and stopped: every worker of a build or replay runs in its
own session, so a terminal's Ctrl-C reaches only the CLI, which then stops every worker's process
group (the worker, the compiler's subprocess pool, the C++ compiler) itself: SIGTERM, a short
grace, SIGKILL. A worker whose CLI died ends its own group (die_with_parent, the worker side).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from neffbuild.errors import BuildError, Interrupted, WorkerKilled
from neffbuild.pids import alive
from neffbuild.runner.jobfiles import EventReader, OnPhase, WorkerJob, WorkerResult, group_result, write_json_atomic
from neffbuild.runner.oomwatch import memory_events_path, oom_kills

# The CLI's pid, set in each worker's environment: a worker outliving it ends itself.
PARENT_PID_ENV = "NEFFBUILD_PARENT_PID"
STOP_GRACE_S = 3.0  # SIGTERM to SIGKILL: a worker's own handler kills its group at once
_POLL_S = 0.2


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


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
                    # Sorted: Inductor writes the TORCHINDUCTOR_* variables, in environ's order, into
                    # its cache entries, whose bytes must not depend on how the parent built env.
                    env=dict(sorted({**env, PARENT_PID_ENV: str(os.getpid())}.items())),
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
    result = group_result(job_file, code)
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
