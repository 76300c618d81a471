"""The worker run that build and replay share, with real stand-in worker processes (no torch): the
backend's command and variables reach the worker, phases reach notify, a failed worker's log is
kept under the run's logs dir, and the scratch root goes on the way out (unless kept)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neffbuild.documents.manifest import ModelEntry
from neffbuild.errors import BuildError, InputError
from neffbuild.runner.workerrun import worker_run
from tests.runner.test_workers import EVENTS_WORKER, FAILING_WORKER, env, job, python


class StandIn:
    """A Launcher like a backend's: its worker script, and one variable naming the cache dir."""

    def __init__(self, script: str) -> None:
        self.script = script

    def worker_env(self, cache_dir: Path, scratch: Path) -> dict[str, str]:
        return {"STAND_IN_CACHE": str(cache_dir), "STAND_IN_SCRATCH": str(scratch)}

    def launch_command(self, entry: ModelEntry, job_file: Path) -> list[str]:
        return [*python(self.script), str(job_file)]


# Writes the variables the launcher set, where the run reads them back.
ENV_WORKER = EVENTS_WORKER.replace(
    "job = WorkerJob",
    "import os\n    Path(os.environ['STAND_IN_SCRATCH'], 'seen').write_text(os.environ['STAND_IN_CACHE'])\n    job = WorkerJob",
)


def test_a_job_runs_with_the_launchers_command_and_variables_and_reports_its_phases(tmp_path: Path) -> None:
    seen: list[tuple[str, str]] = []
    with worker_run(
        StandIn(ENV_WORKER),
        tmp_path / "work",
        "run-",
        logs_dir=tmp_path / "logs",
        notify=lambda u, p: seen.append((u, p)),
    ) as run:
        scratch = run.root / "m"
        worker_env = run.env(env(), tmp_path / "cache", scratch)
        result = run.run(job(), worker_env, scratch)
        assert (scratch / "seen").read_text() == str(tmp_path / "cache")
        assert run.root.parent == tmp_path / "work" and run.root.name.startswith("run-")
    assert [r.unit_id for r in result.runs] == ["m/32x32x1", "m/32x64x1"]
    assert seen == [("m/32x32x1", "loading"), ("m/32x32x1", "compiling"), ("m/32x64x1", "compiling")]
    assert list((tmp_path / "work").iterdir()) == []  # the scratch root went on the way out


def test_a_failed_workers_log_is_kept_under_the_runs_logs_dir_by_unit(tmp_path: Path) -> None:
    with worker_run(StandIn(FAILING_WORKER), tmp_path / "work", "run-", logs_dir=tmp_path / "logs") as run:
        scratch = run.root / "m"
        with pytest.raises(BuildError, match="worker failed: KeyError"):
            run.run(job(), env(), scratch)
        kept = run.keep_log(scratch, "m/32x32x1")
    assert kept.failure is None and kept.path == run.logs_dir / "m__32x32x1" / "worker.log"
    assert run.logs_dir.parent == (tmp_path / "logs").resolve()
    assert kept.path.is_file() and kept.tail[-1] == "KeyError: 'transformer'"
    assert not run.root.exists()


def test_a_log_that_cannot_be_kept_says_why_and_a_worker_that_never_ran_has_none(tmp_path: Path) -> None:
    (tmp_path / "logs").write_text("a file where the logs dir belongs")
    with worker_run(StandIn(FAILING_WORKER), None, "run-", logs_dir=tmp_path / "logs") as run:
        scratch = run.root / "m"
        assert run.keep_log(scratch, "m/32x32x1").path is None  # never started: nothing to keep
        with pytest.raises(BuildError):
            run.run(job(), env(), scratch)
        kept = run.keep_log(scratch, "m/32x32x1")
    assert kept.path is None and kept.tail == ()
    assert kept.failure is not None and str(tmp_path / "logs") in kept.failure


def test_a_kept_run_leaves_its_scratch_and_an_error_inside_still_removes_an_unkept_one(tmp_path: Path) -> None:
    with worker_run(StandIn(EVENTS_WORKER), tmp_path / "a", "run-", logs_dir=tmp_path / "logs", keep=True) as kept:
        pass
    assert kept.root.is_dir()
    with (
        pytest.raises(InputError),
        worker_run(StandIn(EVENTS_WORKER), tmp_path / "b", "run-", logs_dir=tmp_path) as run,
    ):
        raise InputError("refused inside the run")
    assert not run.root.exists()
