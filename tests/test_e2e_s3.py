"""The end-to-end promise against S3 (real SeaweedFS): a build pushed to s3:// (and re-published there
by `build --store s3://`) serves a fresh host, which pulls it and replays with zero compiles.

It reuses the session's local build (compiling is the expensive part of the suite); the upload path
is the same one `build --store s3://` takes for new units (publish_bundle -> S3Store.put_blobs)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import BuiltStore, write_manifest
from tests.procs import gone, start_cli, wait_for, wait_until_compiling
from tests.test_e2e import replay

pytestmark = [pytest.mark.slow, pytest.mark.s3]
TAG = "tiny-flux2-klein"


def pull_and_replay(cli, manifest: Path, store: str, env: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "host" / "cache"
    pulled = cli("pull", TAG, "--store", store, "--cache-dir", str(cache), "--json", env=env)
    assert pulled.returncode == 0, pulled.stderr
    report = json.loads(pulled.stdout)
    assert report["files_fetched"] == report["files_total"] > 0
    code, replayed = replay(cli, manifest, cache, tmp_path / "out")
    assert code == 0 and replayed["misses"] == 0, replayed


def test_offline_build_pushed_to_s3_serves_a_fresh_host_with_zero_misses(
    built_store: Path, tiny_manifest: Path, s3_url: str, s3_env: dict[str, str], tmp_path: Path, cli
) -> None:
    pushed = cli("push", TAG, "--from", str(built_store), "--to", s3_url, "--json", env=s3_env)
    assert pushed.returncode == 0, pushed.stderr
    release_id = json.loads(pushed.stdout)["release_id"]
    assert json.loads(pushed.stdout)["bytes_uploaded"] > 0
    # build against the S3 store: every unit is already there, so it publishes the same release
    built = cli("build", str(tiny_manifest), "--store", s3_url, "--json", env=s3_env)
    assert built.returncode == 0, built.stderr
    report = json.loads(built.stdout)
    assert [o["status"] for o in report["outcomes"]] == ["present", "present"]
    assert report["release_id"] == release_id and sum(o["uploaded"] for o in report["outcomes"]) == 0
    pull_and_replay(cli, tiny_manifest, s3_url, s3_env, tmp_path)
    again = cli("push", TAG, "--from", str(built_store), "--to", s3_url, "--json", env=s3_env)
    assert json.loads(again.stdout)["bytes_uploaded"] == 0


def test_fresh_build_publishes_straight_to_s3_and_replays_with_zero_misses(
    tiny_model: Path, s3_url: str, s3_env: dict[str, str], tmp_path: Path, cli
) -> None:
    # One shape, compiled regionally, keeps the compile short: here the S3 publish path of new units is under test.
    manifest = write_manifest(tmp_path / "one-shape.toml", tiny_model, widths=(128,), mode="regional")
    built = cli("build", str(manifest), "--store", s3_url, "--json", env=s3_env)
    assert built.returncode == 0, built.stderr
    (outcome,) = json.loads(built.stdout)["outcomes"]
    assert outcome["status"] == "built" and outcome["uploaded"] > 0 and outcome["compiles"] > 0
    pull_and_replay(cli, manifest, s3_url, s3_env, tmp_path)


def test_concurrent_shards_one_killed_and_rerun_release_what_one_process_built(
    built: BuiltStore, tiny_manifest: Path, s3_url: str, s3_env: dict[str, str], tmp_path: Path, cli
) -> None:
    """A Kubernetes Indexed Job of two completions: each shard takes its index from
    JOB_COMPLETION_INDEX and builds its units into one S3 store, at the same time. Shard 1 is
    SIGKILLed mid-build: release names its unit as missing and moves nothing; shard 1 rerun
    builds just that unit; then release gives the very release id the one-process build gave."""
    shard = {i: {**s3_env, "JOB_COMPLETION_INDEX": str(i), "NEFFBUILD_SHARDS": "2"} for i in (0, 1)}
    args = ("build", str(tiny_manifest), "--store", s3_url)
    report = tmp_path / "shard0.json"
    first = start_cli(*args, "--report", str(report), stderr=tmp_path / "shard0.err", env=shard[0])
    killed = start_cli(*args, stderr=tmp_path / "shard1.err", env=shard[1])
    try:
        running = wait_until_compiling(killed, tmp_path / "shard1.err", "compiling")
        os.killpg(killed.pid, signal.SIGKILL)  # mid-build, while shard 0 builds on
        killed.wait(30)
        assert wait_for(lambda: all(gone(p) for p in running), 10), running
        assert first.wait(900) == 0, (tmp_path / "shard0.err").read_text()
    finally:
        killed.kill()
        first.kill()
    (done,) = json.loads(report.read_text())["units"]
    assert done["status"] == "built"
    release = ("release", str(tiny_manifest), "--store", s3_url, "--json")
    short = cli(*release, env=s3_env)
    assert short.returncode == 14, short.stderr
    (missing,) = json.loads(short.stdout)["missing"]
    assert missing in ("klein/128x128x1", "klein/128x256x1") and missing != done["unit_id"]
    assert f"have no bundle in {s3_url}: {missing}" in short.stderr
    rerun = cli(*args, "--json", env=shard[1])
    assert rerun.returncode == 0, rerun.stderr
    assert [o["status"] for o in json.loads(rerun.stdout)["outcomes"]] == ["built"]
    released = cli(*release, env=s3_env)
    assert released.returncode == 0, released.stderr
    # The one-process build's id: the same bytes, which tests/test_e2e.py pulls and replays.
    assert json.loads(released.stdout)["release_id"] == built.second_build["release_id"]
