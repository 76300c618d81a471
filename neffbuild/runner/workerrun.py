"""One build's or replay's worker run, assembled once for both: a fresh scratch root, its workers
supervised (SIGINT/SIGTERM stop them all; the scratch goes on the way out), each job launched with
the backend's command and environment, and a failed worker's log kept under this run's logs dir."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from neffbuild.documents.manifest import ModelEntry
from neffbuild.runner.jobfiles import OnPhase, WorkerJob, WorkerResult
from neffbuild.runner.scratch import keep_logs, log_tail, make_scratch_root, remove_tree, run_name, unit_dir_name
from neffbuild.runner.workers import Workers, run_worker, supervised


class Launcher(Protocol):
    """What a worker run needs of a backend (backends/base.py's Backend is one)."""

    def worker_env(self, cache_dir: Path, scratch: Path) -> dict[str, str]: ...

    def launch_command(self, entry: ModelEntry, job_file: Path) -> list[str]: ...


@dataclass(frozen=True)
class KeptLog:
    """A failed worker's log, kept out of its scratch dir: where (None: the worker never started),
    its last lines, or why it could not be kept (then nothing is)."""

    path: Path | None = None
    tail: tuple[str, ...] = ()
    failure: str | None = None


@dataclass(frozen=True)
class WorkerRun:
    """What every worker of one build or replay shares."""

    launcher: Launcher
    root: Path  # this run's scratch root
    logs_dir: Path  # this run's kept logs: `<logs dir>/<run name>`
    workers: Workers
    notify: OnPhase

    def env(self, env: Mapping[str, str], cache_dir: Path, scratch: Path) -> dict[str, str]:
        """env with the backend's variables for a worker whose cache is cache_dir."""
        return {**env, **self.launcher.worker_env(cache_dir, scratch)}

    def run(self, job: WorkerJob, env: Mapping[str, str], scratch: Path) -> WorkerResult:
        """Run job in a fresh process (runner/workers.py's run_worker), its phases to notify."""
        launch = lambda job_file: self.launcher.launch_command(job.entry, job_file)  # noqa: E731
        return run_worker(launch, job, env, scratch, workers=self.workers, on_phase=self.notify)

    def keep_log(self, scratch: Path, unit_id: str) -> KeptLog:
        """The failed worker's files copied to `<logs dir>/<unit>/` (that failing is said, not raised:
        the unit's own error is what matters)."""
        dest = self.logs_dir / unit_dir_name(unit_id)
        try:
            log = keep_logs(scratch, dest)
        except OSError as exc:
            return KeptLog(failure=f"{exc.filename or dest}: {exc.strerror or exc}")
        return KeptLog(log, log_tail(log))


@contextlib.contextmanager
def worker_run(
    launcher: Launcher,
    work_dir: Path | None,
    prefix: str,
    *,
    logs_dir: Path,
    notify: OnPhase | None = None,
    keep: bool = False,
) -> Iterator[WorkerRun]:
    """A run's scratch root (in work_dir, or the system's temp), named prefix..., removed on the way
    out unless keep; its workers stopped by SIGINT/SIGTERM and on any exit (runner/workers.py)."""
    root = make_scratch_root(work_dir, prefix)
    run_logs = logs_dir.expanduser().resolve() / run_name()
    with supervised(cleanup=(lambda: None) if keep else (lambda: remove_tree(root))) as workers:
        yield WorkerRun(launcher, root, run_logs, workers, notify or (lambda unit_id, status: None))
