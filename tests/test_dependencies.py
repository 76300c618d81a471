"""The declared dependency floors work: the CLI runs in .venv-lowest, which scripts/test.sh fills
with exactly the lowest versions pyproject.toml allows (core + s3 extra, no torch).

It runs this checkout's code (PYTHONPATH) on those libraries: local and S3 pushes (botocore's
conditional writes and checksums, awscrt's CRC32C), pulls signed by us and by botocore (urllib3's
data plane), and the manifest schema (pydantic).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from neffbuild.store import open_store
from tests.conftest import ROOT
from tests.storekit import publish_release_of, small_and_large

LOWEST = ROOT / ".venv-lowest" / "bin" / "python"


@pytest.fixture(scope="module")
def lowest() -> Path:
    if not LOWEST.is_file():
        if os.environ.get("CI"):
            pytest.fail("no .venv-lowest in CI: scripts/test.sh runs scripts/setup_lowest.sh")
        pytest.skip("no .venv-lowest: run scripts/setup_lowest.sh (scripts/test.sh does)")
    return LOWEST


def _release(version: str) -> str:
    return re.sub(r"(\.0)+$", "", version)  # 13 == 13.0.0


def run_lowest(python: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [str(python), "-m", "neffbuild", *args], capture_output=True, text=True, env=full, check=False
    )


def test_the_lowest_versions_are_the_declared_floors(lowest: Path) -> None:
    pins = subprocess.run(
        [str(lowest), str(ROOT / "scripts" / "lower_bounds.py")], capture_output=True, text=True, check=True
    )
    names = [line.split("==")[0] for line in pins.stdout.split()]
    core = {"blake3", "click", "cryptography", "pydantic", "rich", "xxhash"}
    assert core | {"botocore", "urllib3", "awscrt"} <= set(names)
    probe = "import sys, importlib.metadata as m; print(' '.join(m.version(n) for n in sys.argv[1:]))"
    got = subprocess.run([str(lowest), "-c", probe, *names], capture_output=True, text=True, check=True).stdout.split()
    wanted = [line.split("==")[1] for line in pins.stdout.split()]
    assert [_release(g) for g in got] == [_release(w) for w in wanted], "pip chose newer versions than the floors"
    torch = subprocess.run([str(lowest), "-c", "import torch"], capture_output=True, check=False)
    assert torch.returncode != 0, "the floors must work without the compile extra"


def test_schema_and_a_local_pull_run_on_the_floors(lowest: Path, tmp_path: Path) -> None:
    schema = run_lowest(lowest, "schema")
    assert schema.returncode == 0, schema.stderr
    assert json.loads(schema.stdout)["title"] == "neffbuild manifest"
    store = open_store(str(tmp_path / "store"), create=True)
    sources = small_and_large(tmp_path / "src", small=10)
    release_id = publish_release_of(store, tmp_path / "src", sources, tag="main")
    # --no-host-check: the floors' Python (another prefix, no torch) is not the host the release was built on.
    pulled = run_lowest(
        lowest,
        "pull",
        "main",
        "--store",
        store.url,
        "--cache-dir",
        str(tmp_path / "cache"),
        "--json",
        "--no-host-check",
    )
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["release_id"] == release_id
    for s in sources:
        assert (tmp_path / "cache" / s.path.relative_to(tmp_path / "src")).read_bytes() == s.path.read_bytes()


@pytest.mark.s3
def test_push_and_pull_through_s3_run_on_the_floors(
    lowest: Path, tmp_path: Path, s3_url: str, s3_env: dict[str, str]
) -> None:
    local = open_store(str(tmp_path / "store"), create=True)
    sources = small_and_large(tmp_path / "src", small=10)
    release_id = publish_release_of(local, tmp_path / "src", sources, tag="main")
    pushed = run_lowest(lowest, "push", "main", "--from", local.url, "--to", s3_url, "--json", env=s3_env)
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["bytes_uploaded"] == sum({s.digest: s.size for s in sources}.values())
    credentials = tmp_path / "credentials"  # a profile: botocore resolves and presigns the reads
    credentials.write_text(
        f"[p]\naws_access_key_id = {s3_env['AWS_ACCESS_KEY_ID']}\naws_secret_access_key = {s3_env['AWS_SECRET_ACCESS_KEY']}\n"
    )
    profile = {**s3_env, "AWS_PROFILE": "p", "AWS_SHARED_CREDENTIALS_FILE": str(credentials)}
    del profile["AWS_ACCESS_KEY_ID"], profile["AWS_SECRET_ACCESS_KEY"]
    for name, env in (("signed-here", s3_env), ("botocore", profile)):
        cache = tmp_path / f"cache-{name}"
        pulled = run_lowest(
            lowest, "pull", "main", "--store", s3_url, "--cache-dir", str(cache), "--json", "--no-host-check", env=env
        )
        assert pulled.returncode == 0, (name, pulled.stderr)
        assert json.loads(pulled.stdout)["release_id"] == release_id
        assert (cache / "large.bin").read_bytes() == (tmp_path / "src" / "large.bin").read_bytes()


def test_a_signed_pull_runs_on_the_floors(lowest: Path, tmp_path: Path) -> None:
    # cryptography at its floor: keygen, signing (in CI's process here) and a host's check.
    from neffbuild.build.publish import move_tag
    from neffbuild.documents.signing import Signing, parse_expiry, read_signing_key

    store = open_store(str(tmp_path / "store"), create=True)
    release_id = publish_release_of(store, tmp_path / "src", small_and_large(tmp_path / "src", small=3))
    made = run_lowest(lowest, "keygen", "ci.example-1", str(tmp_path / "ci.key"))
    assert made.returncode == 0, made.stderr
    move_tag(store, "prod", release_id, signing=Signing(read_signing_key(tmp_path / "ci.key"), parse_expiry("1d")))
    pulled = run_lowest(
        lowest, "pull", "prod", "--store", store.url, "--cache-dir", str(tmp_path / "cache"), "--json",
        "--no-host-check", "--trusted-key", str(tmp_path / "ci.key.pub"),
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["signed_by"] == "ci.example-1"
