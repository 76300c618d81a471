"""The end-to-end promise against S3 (real SeaweedFS): build publishes straight to s3://, a fresh
host pulls from there and replays with zero compiles; an offline build pushed to S3 serves too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_build_publishes_to_s3_and_a_fresh_host_replays_with_zero_misses(
    tiny_manifest: Path, s3_url: str, s3_env: dict[str, str], tmp_path: Path, cli
) -> None:
    built = cli("build", str(tiny_manifest), "--store", s3_url, "--json", env=s3_env)
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["release_id"]
    pull_and_replay(cli, tiny_manifest, s3_url, s3_env, tmp_path)
    again = cli("build", str(tiny_manifest), "--store", s3_url, "--json", env=s3_env)
    assert again.returncode == 0, again.stderr
    assert sum(o["uploaded"] for o in json.loads(again.stdout)["outcomes"]) == 0  # unchanged: 0 bytes


def test_offline_build_pushed_to_s3_replays_with_zero_misses(
    built_store: Path, tiny_manifest: Path, s3_url: str, s3_env: dict[str, str], tmp_path: Path, cli
) -> None:
    pushed = cli("push", TAG, "--from", str(built_store), "--to", s3_url, "--json", env=s3_env)
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["bytes_uploaded"] > 0
    pull_and_replay(cli, tiny_manifest, s3_url, s3_env, tmp_path)
    again = cli("push", TAG, "--from", str(built_store), "--to", s3_url, "--json", env=s3_env)
    assert json.loads(again.stdout)["bytes_uploaded"] == 0
