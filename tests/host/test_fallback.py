"""pull --allow-stale against the real S3 server: an unreachable store keeps the installed release;
nothing that says the bytes are wrong ever does (issue 12, item 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NoReturn

import pytest

from neffbuild.store import open_store
from tests.s3server import free_ports
from tests.statekit import recorded_files
from tests.storekit import corrupt_blob, publish_release_of, write_files

pytestmark = pytest.mark.s3


@pytest.fixture
def installed(s3_url: str, s3_env: dict[str, str], tmp_path: Path, cli) -> tuple[str, Path, dict[str, str]]:
    """(release id, cache dir, a server-gone env) after a pull of tag `prod` from S3 into the cache dir."""
    store = open_store(s3_url, create=True, env=s3_env)
    sources = write_files(tmp_path / "src", {f"d{i}/f{i}.bin": 2000 + i for i in range(10)})
    release_id = publish_release_of(store, tmp_path / "src", sources, name="prod", tag="prod")
    cache = tmp_path / "cache"
    done = cli("pull", "prod", "--store", s3_url, "--cache-dir", str(cache), env=s3_env)
    assert done.returncode == 0, done.stderr
    gone = {**s3_env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_ports(1)[0]}"}  # nothing listens there
    return release_id, cache, gone


def pull(cli, url: str, cache: Path, env: dict[str, str], *extra: str):
    return cli("pull", "prod", "--store", url, "--cache-dir", str(cache), *extra, env=env)


def test_an_unreachable_store_boots_the_installed_release_only_with_allow_stale(
    installed, s3_url: str, tmp_path: Path, cli
) -> None:
    release_id, cache, gone = installed
    refused = pull(cli, s3_url, cache, gone, "--json")
    assert refused.returncode == 3, refused.stderr
    assert json.loads(refused.stdout)["kind"] == "StoreError"

    env_file = tmp_path / "serving.env"
    stale = pull(cli, s3_url, cache, gone, "--allow-stale", "--json", "--env-file", str(env_file))
    assert stale.returncode == 0, stale.stderr
    report = json.loads(stale.stdout)
    assert report["stale"] is True and report["release_id"] == release_id and report["files_fetched"] == 0
    assert report["exports"] == {"TORCHINDUCTOR_CACHE_DIR": str(cache.resolve())}
    assert env_file.read_text() == f"TORCHINDUCTOR_CACHE_DIR={cache.resolve()}\n"
    warnings = [line for line in stale.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, stale.stderr
    state = json.loads((cache / ".neffbuild" / "state.json").read_text())["installed"]
    assert "store unreachable" in warnings[0] and release_id in warnings[0] and state["installed_at"] in warnings[0]
    assert report["stale_reason"] in warnings[0] and "127.0.0.1" in report["stale_reason"]  # names the store error

    plain = pull(cli, s3_url, cache, gone, "--allow-stale")
    assert plain.returncode == 0 and plain.stdout == f"export TORCHINDUCTOR_CACHE_DIR={cache.resolve()}\n"


def test_a_damaged_installed_file_is_not_booted_stale(installed, s3_url: str, cli) -> None:
    _, cache, gone = installed
    victim = cache / "d3" / "f3.bin"
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    victim.write_bytes(bytes(data))  # same size, other bytes
    failed = pull(cli, s3_url, cache, gone, "--allow-stale")
    assert failed.returncode == 3, failed.stderr
    assert "warning:" not in failed.stderr and failed.stdout == ""


def test_a_corrupt_blob_fails_closed_even_with_allow_stale(installed, s3_url: str, s3_env: dict[str, str], cli) -> None:
    _, cache, _ = installed
    store = open_store(s3_url, env=s3_env)
    digest = recorded_files(json.loads((cache / ".neffbuild" / "state.json").read_text()))["d3/f3.bin"][2]
    corrupt_blob(store, digest, s3_env)
    os.unlink(cache / "d3" / "f3.bin")  # so the pull must fetch the damaged object
    failed = pull(cli, s3_url, cache, s3_env, "--allow-stale", "--json")
    assert failed.returncode == 4, failed.stderr
    assert json.loads(failed.stdout)["kind"] == "IntegrityError" and "warning:" not in failed.stderr


def test_the_fallback_reads_the_dir_the_pull_opened_even_if_its_path_moves_meanwhile(tmp_path: Path) -> None:
    """One CacheDir for the pull and its fallback: the path is resolved once, so a link at it
    repointed while the store is being reached does not change which dir the fallback reads."""
    from neffbuild.errors import StoreError
    from neffbuild.host.fallback import pull_or_stale
    from neffbuild.host.pull import PullOptions
    from neffbuild.host.pull import pull as pull_into

    store = open_store(str(tmp_path / "store"), create=True)
    sources = write_files(tmp_path / "src", {"a/f.bin": 3000, "b/g.bin": 1000})
    release_id = publish_release_of(store, tmp_path / "src", sources, name="prod", tag="prod")
    pull_into(store, "prod", tmp_path / "installed")
    (tmp_path / "empty").mkdir()
    link = tmp_path / "cache"
    link.symlink_to(tmp_path / "installed")

    def unreachable() -> NoReturn:
        link.unlink()
        link.symlink_to(tmp_path / "empty")  # an operator's change, while the store is being reached
        raise StoreError("store unreachable: connection refused")

    report = pull_or_stale(unreachable, "prod", link, PullOptions(), allow_stale=True)
    assert report.stale and report.release_id == release_id
    assert report.cache_dir == tmp_path / "installed" and report.files_total == 2
    assert list((tmp_path / "empty").iterdir()) == []
