"""verify --store [--deep] on the local store and the real S3 server: clean after publishing and
after gc; a deleted blob dangles (exit 4, named); an orphan is a warning (exit 0); a corrupted
blob of the right size is found by --deep only; a damaged record is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neffbuild.store import open_store
from neffbuild.store.base import Store, blob_key
from tests.conftest import run_cli
from tests.gckit import publish, release
from tests.storekit import corrupt_blob, s3_client


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    if request.param == "s3":
        return request.getfixturevalue("s3_url"), request.getfixturevalue("s3_env")
    return str(tmp_path / "store"), {}


def two_releases(store: Store, work: Path) -> tuple[str, str]:
    one = publish(store, work, "one", {"a.bin": "a", "b.bin": "b", "big.bin": "big1"}, tag="prod")
    two = publish(store, work, "two", {"a.bin": "a", "c.bin": "c"}, tag="prod")
    return one, two


def verify(url: str, env: dict[str, str], *extra: str) -> tuple[int, dict, str]:
    done = run_cli("verify", "--store", url, "--json", *extra, env=env)
    return done.returncode, json.loads(done.stdout or "{}"), done.stderr


def remove_object(store: Store, key: str, env: dict[str, str]) -> None:
    if store.url.startswith("s3://"):
        bucket, _, prefix = store.url.removeprefix("s3://").partition("/")
        s3_client(env).delete_object(Bucket=bucket, Key=f"{prefix}/{key}")
    else:
        (Path(store.url) / key).unlink()


def test_clean_store_then_gc_then_still_clean(target: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    two_releases(store, tmp_path)
    code, check, _ = verify(url, env, "--deep")
    assert code == 0 and check["clean"] and check["blobs"] == 4 and check["hashed_bytes"] == check["bytes"]
    assert run_cli("gc", "--store", url, "--keep", "0", "--grace", "0", "--yes", env=env).returncode == 0
    code, check, _ = verify(url, env, "--deep")
    assert code == 0 and check["clean"] and check["orphans"] == [] and check["blobs"] == 2


def test_a_deleted_blob_dangles_and_an_orphan_warns(target: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    one, _ = two_releases(store, tmp_path)
    publish(store, tmp_path, "stray", {"s.bin": "s"})  # a release no tag names: an orphan
    code, check, err = verify(url, env)
    assert code == 0 and "orphan" in err and any(k.startswith("releases/") for k in check["orphans"])
    big = next(f.digest for f in release(store, one).files if f.path == "big.bin")
    remove_object(store, blob_key(big), env)  # a loose object on both stores (9 MiB)
    code, check, err = verify(url, env)
    assert code == 4 and big in err
    assert {f["key"] for f in check["dangling"]} == {
        f"releases/{one}.json",
        *(f"bundles/{u.key}.json" for u in release(store, one).units),
    }


def test_deep_finds_a_corrupted_blob(target: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    _, two = two_releases(store, tmp_path)
    c = next(f.digest for f in release(store, two).files if f.path == "c.bin")
    corrupt_blob(store, c, env)  # same size, one byte flipped
    code, check, _ = verify(url, env)
    assert code == 0 and check["clean"]  # sizes match: only reading the bytes can tell
    code, check, err = verify(url, env, "--deep")
    assert code == 4 and [f["key"] for f in check["damaged"]] == [blob_key(c)] and "hash" in err + json.dumps(check)


def test_a_damaged_record_is_named(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"), create=True)
    one, _ = two_releases(store, tmp_path)
    path = tmp_path / "store" / "releases" / f"{one}.json"
    path.chmod(0o644)
    path.write_bytes(b"{not json")
    code, check, _err = verify(str(tmp_path / "store"), {})
    assert code == 4 and check["damaged"][0]["key"] == f"releases/{one}.json"
