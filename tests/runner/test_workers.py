"""Worker processes with real processes and signals (no torch here: stand-in worker scripts).

What must hold: phase events reach the parent while the worker runs; stopping ends every process
of every worker's group; a worker whose neffbuild parent is SIGKILLed ends its own group; a
failed worker's log is kept and its traceback handed back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from neffbuild.documents.manifest import ModelEntry, Shape
from neffbuild.errors import BuildError
from neffbuild.runner.jobfiles import WorkerJob
from neffbuild.runner.scratch import keep_logs, log_tail, remove_tree
from neffbuild.runner.workers import PARENT_PID_ENV, Workers, WorkerStopped, run_worker
from tests.procs import gone, wait_for

ROOT = Path(__file__).resolve().parents[2]


def entry() -> ModelEntry:
    return ModelEntry(
        id="m", model="/nonexistent", pipeline="Flux2KleinPipeline", shapes={"height": 32, "width": [32, 64]}
    )


def job(purpose: str = "build") -> WorkerJob:
    shapes = (Shape(height=32, width=32), Shape(height=32, width=64))
    return WorkerJob(
        purpose=purpose, entry=entry(), model_ref="/nonexistent", unit_ids=("m/32x32x1", "m/32x64x1"), shapes=shapes
    )


def python(script: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(script)]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


# A stand-in worker: reads its job, reports each unit's phase with the real event writer, sleeps
# a little per unit (so the parent polls while it runs), writes a result.
EVENTS_WORKER = """
    import json, sys, time
    from pathlib import Path
    from neffbuild.runner.jobfiles import WorkerJob, WorkerResult, ShapeRun, append_event, write_json_atomic
    job_file = Path(sys.argv[1])
    job = WorkerJob.model_validate_json(job_file.read_text())
    append_event(job.events_file, "loading", job.unit_ids[0])
    runs = []
    for unit in job.unit_ids:
        time.sleep(0.5)
        append_event(job.events_file, "compiling", unit)
        runs.append(ShapeRun(unit_id=unit, first_call_s=0.5, counters={}, compiles=1))
    time.sleep(0.5)
    write_json_atomic(job_file.with_name("job.result.json"), WorkerResult(fingerprint={}, load_s=0.0, runs=tuple(runs)))
"""


def test_phase_events_reach_the_parent_while_the_worker_runs(tmp_path: Path) -> None:
    seen: list[tuple[float, str, str]] = []
    started = time.monotonic()
    result = run_worker(
        lambda job_file: [*python(EVENTS_WORKER), str(job_file)],
        job(),
        env(),
        tmp_path / "scratch",
        on_phase=lambda unit, phase: seen.append((time.monotonic() - started, unit, phase)),
    )
    assert [(u, p) for _, u, p in seen] == [
        ("m/32x32x1", "loading"),
        ("m/32x32x1", "compiling"),
        ("m/32x64x1", "compiling"),
    ]
    took = time.monotonic() - started
    assert seen[1][0] < took - 0.5  # heard while the worker was still running, not after it
    assert [r.unit_id for r in result.runs] == ["m/32x32x1", "m/32x64x1"]


FAILING_WORKER = """
    import sys, traceback
    from pathlib import Path
    from neffbuild.runner.jobfiles import WorkerResult, write_json_atomic
    job_file = Path(sys.argv[1])
    print("loading the model")
    try:
        {}["transformer"]
    except KeyError as exc:
        trace = traceback.format_exc()
        sys.stderr.write(trace)
        result = WorkerResult(fingerprint={}, load_s=0.0, runs=(), error=f"KeyError: {exc}", traceback=trace)
    write_json_atomic(job_file.with_name("job.result.json"), result)
    sys.exit(1)
"""


def test_a_failed_worker_hands_back_its_traceback_and_its_log_can_be_kept(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    with pytest.raises(BuildError, match=r"m/32x32x1, m/32x64x1: worker failed: KeyError: 'transformer'") as caught:
        run_worker(lambda job_file: [*python(FAILING_WORKER), str(job_file)], job(), env(), scratch)
    assert "Traceback (most recent call last)" in caught.value.debug_detail
    kept = keep_logs(scratch, tmp_path / "logs" / "m__32x32x1")
    remove_tree(scratch)
    assert kept is not None and kept.is_file()
    assert {p.name for p in kept.parent.iterdir()} >= {"worker.log", "job.json", "job.result.json"}
    tail = log_tail(kept, lines=3)
    assert len(tail) == 3 and tail[-1] == "KeyError: 'transformer'"
    assert log_tail(kept, lines=100)[0] == "loading the model"


def test_a_worker_sees_its_environment_in_one_order_however_the_parent_built_it(tmp_path: Path) -> None:
    """Inductor writes its variables into cache entries in environ's order: a unit built after
    another (whose exports the parent's env already held) gave other bytes and another release id."""
    seen = []
    for i, names in enumerate((("TORCHINDUCTOR_B", "TORCHINDUCTOR_A"), ("TORCHINDUCTOR_A", "TORCHINDUCTOR_B"))):
        out = tmp_path / f"order-{i}"
        script = f"import os; open({str(out)!r}, 'w').write(' '.join(n for n in os.environ if n.startswith('TORCHINDUCTOR_')))"
        built = {**{name: "1" for name in names}, **os.environ}
        assert Workers().run(python(script), built, tmp_path / f"order-{i}.log", lambda: None) == 0
        seen.append(out.read_text())
    assert seen[0] == seen[1] and seen[0].split() == sorted(seen[0].split())


def test_a_worker_that_dies_without_a_result_is_named_with_its_signal(tmp_path: Path) -> None:
    crash = python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(BuildError, match="left no result \\(killed by SIGKILL\\)"):
        run_worker(lambda job_file: crash, job(), env(), tmp_path / "scratch")


# A stand-in worker with a child of its own (as the compiler's C++ compiles are): both pids go
# to a file; the worker ignores SIGTERM, so only the group SIGKILL after the grace can end it.
STUBBORN_WORKER = """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "300"])
    open(sys.argv[1] + ".tmp", "w").write(f"{os.getpid()} {child.pid}")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
"""


def test_stop_ends_every_process_of_every_worker_group(tmp_path: Path) -> None:
    workers = Workers(grace_s=1.0)
    pid_files = [tmp_path / f"pids-{i}" for i in range(2)]
    threads = [
        threading.Thread(
            target=lambda f=f: pytest.raises(  # noqa: RUF061 - a thread's target: the call form
                WorkerStopped,
                workers.run,
                [*python(STUBBORN_WORKER), str(f)],
                env(),
                tmp_path / f"{f.name}.log",
                lambda: None,
            )
        )
        for f in pid_files
    ]
    for t in threads:
        t.start()
    assert wait_for(lambda: all(f.exists() for f in pid_files), 30)
    pids = [int(p) for f in pid_files for p in f.read_text().split()]
    started = time.monotonic()
    workers.stop()
    assert time.monotonic() - started < 5
    # SIGKILL is sent when stop() returns, not necessarily delivered: allow the kernel a moment.
    assert wait_for(lambda: all(gone(pid) for pid in pids), 5), [pid for pid in pids if not gone(pid)]
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    with pytest.raises(WorkerStopped):  # nothing starts once stopping
        workers.run(["true"], env(), tmp_path / "late.log", lambda: None)


# The CLI's stand-in: starts one worker through Workers (which sets PARENT_PID_ENV), and waits.
PARENT = """
    import os, sys
    from pathlib import Path
    from neffbuild.runner.workers import Workers
    Workers().run([sys.executable, "-c", sys.argv[1], sys.argv[2]], os.environ, Path(sys.argv[2] + ".log"), lambda: None)
"""
ORPHANED_WORKER = """
    import os, subprocess, sys, time
    from neffbuild.runner.workers import die_with_parent
    die_with_parent(os.environ)
    child = subprocess.Popen(["sleep", "300"])
    open(sys.argv[1] + ".tmp", "w").write(f"{os.getpid()} {child.pid}")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
"""


def test_a_worker_whose_parent_is_killed_ends_its_whole_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    parent = subprocess.Popen([*python(PARENT), textwrap.dedent(ORPHANED_WORKER), str(pid_file)], env=env())
    try:
        assert wait_for(pid_file.exists, 30)
        worker, child = (int(p) for p in pid_file.read_text().split())
        assert PARENT_PID_ENV in Path(f"/proc/{worker}/environ").read_bytes().decode(errors="replace")
        parent.kill()  # SIGKILL: nothing in the parent can clean up
        parent.wait()
        assert wait_for(lambda: gone(worker) and gone(child), 5), "the orphaned worker group lives on"
    finally:
        parent.kill()


def test_a_worker_run_by_hand_keeps_default_signal_handling(tmp_path: Path) -> None:
    # Without PARENT_PID_ENV (not started by neffbuild) die_with_parent changes nothing.
    script = "import os, signal; from neffbuild.runner.workers import die_with_parent; die_with_parent({}); print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    out = subprocess.run([*python(script)], env=env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_stop_signal_handlers_come_back_after_a_supervised_run(tmp_path: Path) -> None:
    from neffbuild.runner.workers import supervised

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with supervised() as workers:
        assert signal.getsignal(signal.SIGTERM) not in before
        assert workers.run(["true"], env(), tmp_path / "log", lambda: None) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
