"""A fleet build's failure paths, with real workers: a unit that fails while the others publish
(the exit code, the report, what `release` then says), `--retries`, and a worker killed by a
signal or by a real memory limit, attributed to its unit.

The workers are the cheapest real ones that build: the tiny FLUX.2-klein pipeline through the
neuron backend with tests/neuron_double.py (graphs traced by Dynamo, run eagerly: no Inductor
compile), about 8 s a unit; a unit that fails loads a copy whose weights are cut short."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from neffbuild.runner.oomwatch import memory_events_path, oom_kills
from tests.backends.test_neuron import DOUBLE_ENV, TESTS
from tests.build.test_compile import damaged_model  # noqa: F401  (a fixture)
from tests.procs import descendants, gone, start_cli, wait_for

ENV = {**DOUBLE_ENV, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
ENTRY = """
[[model]]
id = "{id}"
model = "./{model}"
pipeline = "Flux2KleinPipeline"
dtype = "float32"
backend = "neuron"
device = "neuron"
mode = "regional"
shapes = {{ height = 32, width = {width} }}
call = {{ num_inference_steps = 1, max_sequence_length = 64, text_encoder_out_layers = [1] }}
"""


def manifest(root: Path, tiny: Path, damaged: Path | None = None) -> Path:
    """One good unit (good/32x32x1), and with damaged one that fails to load (broken/32x64x1)."""
    (root / "tiny").symlink_to(tiny)
    text = 'name = "faults"\n' + ENTRY.format(id="good", model="tiny", width=32)
    if damaged is not None:
        (root / "damaged").symlink_to(damaged)
        # Another shape: the same architecture at the same shape has the same key (weights are not in it).
        text += ENTRY.format(id="broken", model="damaged", width=64)
    (root / "neffbuild.toml").write_text(text)
    return root / "neffbuild.toml"


def units(report: Path) -> dict[str, dict]:
    return {u["unit_id"]: u for u in json.loads(report.read_text())["units"]}


@pytest.mark.slow  # real workers, tens of seconds
def test_one_unit_fails_the_others_publish_and_release_names_the_missing_one(
    tiny_model: Path,
    damaged_model: Path,  # noqa: F811
    tmp_path: Path,
    cli,
) -> None:
    m = manifest(tmp_path, tiny_model, damaged_model)
    store, report = tmp_path / "store", tmp_path / "report.json"
    built = cli("build", str(m), "--store", str(store), "--retries", "1", "--report", str(report), env=ENV)
    assert built.returncode == 5, built.stderr  # a compile error: deterministic, no retry of the shard helps
    got = units(report)
    assert got["good/32x32x1"]["status"] == "built" and got["good/32x32x1"]["attempts"] == 1
    assert got["good/32x32x1"]["peak_rss"] > 0
    broken = got["broken/32x64x1"]
    assert broken["status"] == "failed" and broken["attempts"] == 2 and not broken["killed"]
    assert "worker failed" in broken["error"]
    assert "broken/32x64x1: retrying (1 of 1 retries) after: broken/32x64x1: worker failed" in built.stderr
    assert "1 of 2 units failed; first: broken/32x64x1" in built.stderr
    # The good unit's bundle is in the store; no release, no tag.
    assert (
        json.loads((store / "bundles" / f"{got['good/32x32x1']['key']}.json").read_text())["unit_id"] == "good/32x32x1"
    )
    assert not (store / "tags").exists() or not list((store / "tags").iterdir())

    released = cli("release", str(m), "--store", str(store), env=ENV)
    assert released.returncode == 14, released.stderr
    assert "broken/32x64x1" in released.stderr and "good/32x32x1" not in released.stderr
    assert not (store / "releases").exists() or not list((store / "releases").iterdir())


def _kill_worker_once_loading(cli_proc: subprocess.Popen[bytes], stderr: Path, unit: str) -> None:
    """SIGKILL the unit's worker (its whole group) once it reports loading."""

    def loading() -> bool:
        assert cli_proc.poll() is None, stderr.read_text()
        return f"{unit}: loading (after" in stderr.read_text() and bool(descendants(cli_proc.pid))

    assert wait_for(loading, 120, step=0.1), stderr.read_text()
    for pid in descendants(cli_proc.pid):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # real workers, tens of seconds
def test_a_killed_worker_is_named_exit_15_and_a_retry_builds_the_unit(tiny_model: Path, tmp_path: Path) -> None:
    m = manifest(tmp_path, tiny_model)
    store = tmp_path / "store"
    # No retries: the unit fails as killed, the build exits 15 (retry the shard).
    err, report = tmp_path / "a.err", tmp_path / "a.json"
    proc = start_cli("build", str(m), "--store", str(store), "--report", str(report), stderr=err, env=ENV)
    _kill_worker_once_loading(proc, err, "good/32x32x1")
    assert proc.wait(120) == 15, err.read_text()
    got = units(report)["good/32x32x1"]
    assert got["status"] == "failed" and got["killed"] == "killed by SIGKILL" and got["attempts"] == 1
    assert "worker left no result (killed by SIGKILL)" in err.read_text()
    # --retries 1: the first attempt is killed, the second builds; the build releases.
    err, report = tmp_path / "b.err", tmp_path / "b.json"
    proc = start_cli(
        "build", str(m), "--store", str(store), "--retries", "1", "--report", str(report), stderr=err, env=ENV
    )
    _kill_worker_once_loading(proc, err, "good/32x32x1")
    assert proc.wait(180) == 0, err.read_text()
    got = units(report)["good/32x32x1"]
    assert got["status"] == "built" and got["attempts"] == 2 and not got["killed"]
    assert "good/32x32x1: retrying (1 of 1 retries) after: good/32x32x1: worker left no result (killed by SIGKILL)" in (
        err.read_text()
    )
    assert json.loads(report.read_text())["release_id"]


# -- a real memory limit: a cgroup of its own ------------------------------------------------------

# Above the CLI's own RSS (about 430 MiB: it imports torch to plan) by less than a worker needs
# to load (its peak: about 520 MiB); tests/oom_first.py makes the worker the kernel's choice.
LIMIT = 384 << 20


def _own_memory_cgroup(tmp_path: Path) -> Iterator[Path]:
    """A child of this process's memory cgroup (v1 or v2) limited to LIMIT, or a skip. Found here
    from /proc/self/cgroup, not by the code under test."""
    v1 = v2 = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, group = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = Path("/sys/fs/cgroup/memory") / group.lstrip("/")
        elif line.startswith("0::") and (Path("/sys/fs/cgroup") / group.lstrip("/") / "memory.max").is_file():
            v2 = Path("/sys/fs/cgroup") / group.lstrip("/")
    parent = v2 or v1
    if parent is None or not parent.is_dir():
        pytest.skip("no cgroup memory controller here")
    child = parent / f"neffbuild-test-{os.getpid()}-{tmp_path.name}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup here ({exc.strerror})")
    try:
        if parent == v1:
            (child / "memory.limit_in_bytes").write_text(str(LIMIT))
            if (child / "memory.memsw.limit_in_bytes").exists():
                (child / "memory.memsw.limit_in_bytes").write_text(str(LIMIT))  # no way out through swap
        else:
            (child / "memory.max").write_text(str(LIMIT))
            if (child / "memory.swap.max").exists():
                (child / "memory.swap.max").write_text("0")
        yield child
    finally:
        wait_for(lambda: not (child / "cgroup.procs").read_text().strip(), 30)
        child.rmdir()


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[Path]:
    yield from _own_memory_cgroup(tmp_path)


@pytest.mark.slow  # real workers, tens of seconds
def test_a_worker_killed_by_its_memory_limit_is_attributed_to_the_oom_killer(
    tiny_model: Path, tmp_path: Path, limited: Path
) -> None:
    m = manifest(tmp_path, tiny_model)
    err, report = tmp_path / "oom.err", tmp_path / "oom.json"
    procs = limited / "cgroup.procs"
    with err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "neffbuild", "build", str(m), "--store", str(tmp_path / "store"), "--report", str(report)],
            stdout=subprocess.DEVNULL, stderr=stderr,
            env={**os.environ, **ENV, "NEFFBUILD_WORKER_IMPORTS": "oom_first, neuron_double"},
            preexec_fn=lambda: procs.write_text(str(os.getpid())),  # the CLI and every worker it starts
        )  # fmt: skip
    assert proc.wait(180) == 15, err.read_text()
    got = units(report)["good/32x32x1"]
    assert got["status"] == "failed" and "OOM killer" in got["killed"], got
    assert "worker left no result (killed by the OOM killer" in err.read_text()
    counts = limited / ("memory.events" if (limited / "memory.events").is_file() else "memory.oom_control")
    assert oom_kills(counts) >= 1  # the kernel's own count, in the test's cgroup
    assert wait_for(lambda: gone(proc.pid), 5)


def test_the_oom_count_is_read_under_cgroup_v1_and_v2(tmp_path: Path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    v1 = tmp_path / "cg/memory/pods/a"
    v1.mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (tmp_path / "proc/self/cgroup").write_text("5:cpu,cpuacct:/pods/a\n4:memory:/pods/a\n0::/\n")
    assert oom_kills(memory_events_path(tmp_path / "proc", tmp_path / "cg")) == 3
    v2 = tmp_path / "cg/pods/b"
    v2.mkdir(parents=True)
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    (tmp_path / "proc/self/cgroup").write_text("4:memory:/pods/a\n0::/pods/b\n")
    assert oom_kills(memory_events_path(tmp_path / "proc", tmp_path / "cg")) == 2  # v2 first
    (tmp_path / "proc/self/cgroup").write_text("0::/pods/c\n")
    assert memory_events_path(tmp_path / "proc", tmp_path / "cg") is None
