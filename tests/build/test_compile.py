"""build: a unit that really fails keeps its log and says so once; --work-dir; real signals
during a real compile end everything (workers, the C++ compilers they run, scratch)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import write_manifest
from tests.procs import assert_all_stopped, start_cli, wait_until_compiling


@pytest.fixture(scope="module")
def damaged_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline with its transformer's weights cut short: it fails to load in the worker
    (configs intact, so it plans like the real one)."""
    model = tmp_path_factory.mktemp("damaged") / "tiny"
    shutil.copytree(tiny_model, model)
    weights = next((model / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    return model


def test_a_failing_unit_keeps_its_log_and_prints_its_last_lines_once(damaged_model: Path, tmp_path: Path, cli) -> None:
    manifest = write_manifest(tmp_path / "m.toml", damaged_model, widths=(128,))
    work = tmp_path / "not" / "yet" / "there"  # created
    result = cli("build", str(manifest), "--store", str(tmp_path / "store"), "--work-dir", str(work))
    assert result.returncode == 5, result.stderr
    err = result.stderr
    assert err.count("error: ") == 1 and err.count("Unable to load weights") == 2  # the message, the log's last line
    (kept,) = work.glob("logs/*/klein__128x128x1/worker.log")
    assert f"  log: {kept}" in err
    last_lines = [line.rstrip() for line in kept.read_text().splitlines()[-12:]]
    assert "\n".join(f"  | {line}" for line in last_lines) in err
    assert {p.name for p in kept.parent.iterdir()} >= {"worker.log", "job.json", "job.result.json", "job.events.jsonl"}
    assert "--keep-work" in err and "--debug" in err
    assert [p.name for p in work.iterdir()] == ["logs"]  # the scratch dir itself is gone
    assert "klein/128x128x1: loading (after" in err and "klein/128x128x1: failed in" in err
    assert "the worker's traceback:" not in err  # that is --debug's


def test_debug_shows_the_workers_own_traceback(damaged_model: Path, tmp_path: Path, cli) -> None:
    manifest = write_manifest(tmp_path / "m.toml", damaged_model, widths=(128,))
    result = cli(
        "--debug", "build", str(manifest), "--store", str(tmp_path / "store"), "--work-dir", str(tmp_path / "w")
    )
    assert result.returncode == 5
    trace = result.stderr.split("the worker's traceback:\n", 1)[1]
    assert trace.startswith("Traceback (most recent call last):")
    assert "neffbuild/backends/worker.py" in trace and "in load_pipeline" in trace  # frames of the worker process


def test_an_unusable_work_dir_is_bad_input(tiny_model: Path, tmp_path: Path, cli) -> None:
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128,))
    (tmp_path / "a-file").write_text("")
    result = cli(
        "build", str(manifest), "--store", str(tmp_path / "store"), "--work-dir", str(tmp_path / "a-file" / "sub")
    )
    assert result.returncode == 2, result.stderr
    assert f"work dir {tmp_path / 'a-file' / 'sub'}: cannot make a scratch dir there" in result.stderr
    assert "internal error" not in result.stderr


# -- real signals during a real compile --------------------------------------------------------


def start_build(model: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """`neffbuild build` of one shape of model started in the background, into tmp_path/store with
    its scratch in tmp_path/work: (the process, the work dir, the file its stderr goes to)."""
    manifest = write_manifest(tmp_path / "m.toml", model, widths=(128,))
    work, err = tmp_path / "work", tmp_path / "stderr"
    return (
        start_cli("build", str(manifest), "--store", str(tmp_path / "store"), "--work-dir", str(work), stderr=err),
        work,
        err,
    )


@pytest.mark.slow
def test_sigint_to_the_building_process_group_ends_everything_within_10_s(tiny_model: Path, tmp_path: Path) -> None:
    proc, work, err = start_build(tiny_model, tmp_path)
    try:
        running = wait_until_compiling(proc, err, "compiling")
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the foreground group
        assert_all_stopped(proc, running, started, 130, err, work)
        assert "interrupted by SIGINT" in err.read_text()
    finally:
        proc.kill()


@pytest.mark.slow
def test_sigterm_to_the_parent_only_leaves_no_worker_and_no_scratch(tiny_model: Path, tmp_path: Path) -> None:
    proc, work, err = start_build(tiny_model, tmp_path)
    try:
        running = wait_until_compiling(proc, err, "compiling")
        proc.send_signal(signal.SIGTERM)  # the parent only, as a CI runner's timeout does
        assert_all_stopped(proc, running, time.monotonic(), 143, err, work)
        assert not (tmp_path / "store" / "tags").exists() or not list((tmp_path / "store" / "tags").iterdir())
    finally:
        proc.kill()
