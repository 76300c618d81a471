"""What a damaged or hostile store can make a pull do: nothing but fail closed, naming what it found.

Real damage in real stores: a FIFO, /dev/zero and a sparse terabyte as local blobs; on the real S3
server, bodies that never end (tests/tcpproxy.py drops Content-Length and keeps sending), objects
cut short, pack indexes and locators that do not hold. Each refused pull leaves the cache dir as it
was (no file outside its .neffbuild/ state dir), and each message names the cache file and the
store object.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from neffbuild.errors import IntegrityError, NeffbuildError, StoreError
from neffbuild.host.pull import pull
from neffbuild.store import open_store, packs
from neffbuild.store.base import Store, blob_key
from neffbuild.store.blobs import BlobSource
from tests.storekit import corrupt_blob, publish_release_of, s3_client, write_files

PROXY_CAP = 1 << 30  # an endless body stops here at the latest; a bounded reader takes far less


def publish(
    store: Store, root: Path, sizes: dict[str, int], *, loose: tuple[str, ...] = (), tag: str = "t", seed: int = 0
) -> tuple[str, list[BlobSource]]:
    """A release of files with these sizes under tag; `loose` ones stored as objects of their own."""
    files = root / f"src-{tag}"
    sources = write_files(files, sizes, seed=seed)
    for s in sources:
        if s.path.name in loose:
            store.put_blob(s.digest, s.path)
    return publish_release_of(store, files, sources, name=f"rel-{tag}", tag=tag), sources


def pull_cli(
    store_url: str, tag: str, cache: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`neffbuild pull` as a host runs it; a pull that blocks fails the test instead of hanging it."""
    return subprocess.run(
        [sys.executable, "-m", "neffbuild", "pull", tag, "--store", store_url, "--cache-dir", str(cache)],
        env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def landed(cache: Path) -> list[Path]:
    """What a pull put in the cache dir besides its own state."""
    return sorted(p for p in cache.rglob("*") if ".neffbuild" not in p.relative_to(cache).parts)


def assert_refused(exc: NeffbuildError, cache: Path, store_object: str) -> None:
    """Exit 4, one printable line that names a cache file and the store object, and nothing landed."""
    assert exc.exit_code == 4 and exc.hint and "\n" not in exc.message, exc.message
    assert f"{cache}/" in exc.message and store_object in exc.message, exc.message
    assert landed(cache) == []


def s3_key(store: Store, rel: str) -> tuple[str, str]:
    bucket, _, prefix = store.url.removeprefix("s3://").partition("/")
    return bucket, f"{prefix}/{rel}" if prefix else rel


def put_object(store: Store, env: dict[str, str], rel: str, data: bytes) -> None:
    bucket, key = s3_key(store, rel)
    s3_client(env).put_object(Bucket=bucket, Key=key, Body=data)


def get_object(store: Store, env: dict[str, str], rel: str) -> bytes:
    bucket, key = s3_key(store, rel)
    return s3_client(env).get_object(Bucket=bucket, Key=key)["Body"].read()


def index_holding(store: Store, env: dict[str, str], digest: str) -> str:
    """The key of the pack index that lists digest."""
    bucket, key = s3_key(store, "packs/")
    for o in s3_client(env).list_objects_v2(Bucket=bucket, Prefix=key)["Contents"]:
        rel = o["Key"][len(key) - len("packs/") :]
        pack_id = packs.pack_id_of_index_key(rel)
        if pack_id and digest in {e.digest for e in packs.decode_index(pack_id, get_object(store, env, rel)).entries}:
            return rel
    raise AssertionError(f"no index lists {digest}")


@contextmanager
def proxied(
    s3_server, s3_env: dict[str, str], store_url: str, paths: tuple[str, ...]
) -> Iterator[tuple[Store, dict[str, str], object]]:
    """The store seen through a proxy that makes GET bodies for `paths` endless."""
    from tests.tcpproxy import TcpProxy

    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    with TcpProxy(port, mode="endless", paths=paths, endless_cap=PROXY_CAP) as proxy:
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        yield open_store(store_url, env=env), env, proxy


# ---- local store: blobs that are not files, or never end ----------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "sparse-terabyte"])
def test_a_local_blob_that_never_ends_fails_the_pull_naming_it(tmp_path: Path, kind: str) -> None:
    store = open_store(str(tmp_path / "store"), create=True)
    _, [src] = publish(store, tmp_path, {"x.bin": 5000})
    blob = Path(store.url) / blob_key(src.digest)
    blob.unlink()
    if kind == "fifo":
        os.mkfifo(blob)  # opening it for reading would wait for a writer that never comes
    elif kind == "dev-zero":
        blob.symlink_to("/dev/zero")
    else:
        with blob.open("wb") as f:
            f.truncate(1 << 40)  # reads as a terabyte of zeros
    cache = tmp_path / "cache"
    done = pull_cli(store.url, "t", cache)
    assert done.returncode == 4, done.stderr
    assert str(cache / "x.bin") in done.stderr and str(blob) in done.stderr
    assert {"fifo": "FIFO", "dev-zero": "character device", "sparse-terabyte": "longer than the 5000 bytes"}[
        kind
    ] in done.stderr
    assert len(done.stderr.strip().splitlines()) == 2  # error and hint, no traceback
    assert landed(cache) == []


def test_a_local_marker_or_document_that_is_not_a_file_is_refused_without_blocking(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"), create=True)
    release_id, _ = publish(store, tmp_path, {"x.bin": 10})
    release = Path(store.url) / "releases" / f"{release_id}.json"
    release.unlink()
    os.mkfifo(release)
    with pytest.raises(IntegrityError, match=f"{release} is a FIFO"):
        pull(open_store(store.url), "t", tmp_path / "cache")
    marker = Path(store.url) / "neffbuild-store.json"
    marker.unlink()
    os.mkfifo(marker)
    with pytest.raises(StoreError, match="a FIFO, not a store marker"):
        open_store(store.url)
    marker.unlink()
    marker.symlink_to(marker.name)  # a symlink loop: the filesystem refuses it
    done = pull_cli(store.url, "t", tmp_path / "cache")
    assert done.returncode == 3 and "neffbuild-store.json: cannot read it" in done.stderr, (
        done.stderr
    )  # the store's fault


def test_a_local_store_that_cannot_hold_a_temp_file_is_a_disk_error(tmp_path: Path) -> None:
    from neffbuild.errors import DiskError

    store = open_store(str(tmp_path / "store"), create=True)
    [src] = write_files(tmp_path / "src", {"x.bin": 10})
    (Path(store.url) / "blobs").mkdir()
    (Path(store.url) / "blobs" / src.digest[:2]).write_bytes(b"a file where a shard directory goes")
    with pytest.raises(DiskError, match=src.digest[:2]):
        store.put_blob(src.digest, src.path)


# ---- S3: bodies without an end, through a real proxy in front of the real server ----------------


@pytest.mark.s3
def test_an_s3_blob_without_an_end_fails_the_pull_naming_it(
    s3_url: str, s3_env: dict[str, str], s3_server, tmp_path: Path
) -> None:
    store = open_store(s3_url, create=True, env=s3_env)
    _, [src] = publish(store, tmp_path, {"x.bin": 5000}, loose=("x.bin",))
    cache = tmp_path / "cache"
    with proxied(s3_server, s3_env, s3_url, ("/blobs/",)) as (_, env, proxy):
        done = pull_cli(s3_url, "t", cache, env)
        assert done.returncode == 4, done.stderr
        assert proxy.extra_sent < 64 << 20  # the reader stopped; the proxy would go on to PROXY_CAP
    assert str(cache / "x.bin") in done.stderr and blob_key(src.digest) in done.stderr and "longer than" in done.stderr
    assert landed(cache) == []


@pytest.mark.s3
def test_the_s3_marker_is_read_only_as_far_as_a_marker_goes(s3_url: str, s3_env: dict[str, str], s3_server) -> None:
    open_store(s3_url, create=True, env=s3_env)
    with pytest.raises(StoreError, match="neffbuild-store.json: over") as err:
        with proxied(s3_server, s3_env, s3_url, ("neffbuild-store.json",)):
            pass
    assert err.value.exit_code == 3


@pytest.mark.s3
def test_a_pack_range_without_an_end_is_read_only_as_far_as_needed(
    s3_url: str, s3_env: dict[str, str], s3_server, tmp_path: Path
) -> None:
    store = open_store(s3_url, create=True, env=s3_env)
    _, sources = publish(store, tmp_path, {f"{i}.bin": 1000 + i for i in range(20)})
    cache = tmp_path / "cache"
    with proxied(s3_server, s3_env, s3_url, (".pack?",)) as (via_proxy, _, proxy):
        pull(via_proxy, "t", cache)
        assert 0 < proxy.extra_sent < 64 << 20  # the body did not end; the reader took its range and left
    for s in sources:
        assert (cache / s.path.name).read_bytes() == s.path.read_bytes()


# ---- S3: pack indexes of other releases are not a pull's concern --------------------------------


@pytest.mark.s3
@pytest.mark.parametrize("locators", ["with-locators", "without-locators"])
def test_a_damaged_pack_index_fails_only_the_pulls_that_need_it(
    s3_url: str, s3_env: dict[str, str], tmp_path: Path, locators: str
) -> None:
    store = open_store(s3_url, create=True, env=s3_env)
    a_id, a = publish(store, tmp_path, {f"a{i}.bin": 1000 + i for i in range(10)}, tag="a", seed=1)
    b_id, b = publish(store, tmp_path, {f"b{i}.bin": 2000 + i for i in range(10)}, tag="b", seed=2)
    if locators == "without-locators":  # as a store written before locators existed
        bucket, _ = s3_key(store, "")
        for release_id in (a_id, b_id):
            s3_client(s3_env).delete_object(Bucket=bucket, Key=s3_key(store, packs.locator_key(release_id))[1])
    damaged = index_holding(store, s3_env, b[0].digest)
    put_object(store, s3_env, damaged, b'{"format": "neffbuild.pack/1", "size": 0, "entries": []}')

    ok = pull_cli(s3_url, "a", tmp_path / "cache-a", s3_env)
    assert ok.returncode == 0, ok.stderr
    assert all((tmp_path / "cache-a" / s.path.name).read_bytes() == s.path.read_bytes() for s in a)

    cache = tmp_path / "cache-b"
    bad = pull_cli(s3_url, "b", cache, s3_env)
    assert bad.returncode == 4, bad.stderr
    assert damaged in bad.stderr and f"{cache}/b" in bad.stderr and len(bad.stderr.strip().splitlines()) == 2
    assert landed(cache) == []


@pytest.mark.s3
def test_publishing_the_blobs_of_a_damaged_index_again_repairs_it(
    s3_url: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    store = open_store(s3_url, create=True, env=s3_env)
    _, b = publish(store, tmp_path, {f"b{i}.bin": 2000 + i for i in range(10)}, tag="b")
    damaged = index_holding(store, s3_env, b[0].digest)
    put_object(store, s3_env, damaged, b"damaged")
    fresh = open_store(s3_url, env=s3_env)
    assert fresh.missing_blobs({s.digest for s in b}) == {s.digest for s in b}  # not an error: missing
    assert fresh.put_blobs(b, jobs=4) == sum(s.size for s in b)  # the same pack, written again
    assert index_holding(store, s3_env, b[0].digest) == damaged
    pull(open_store(s3_url, env=s3_env), "b", tmp_path / "cache")


@pytest.mark.s3
def test_a_damaged_locator_is_passed_over(s3_url: str, s3_env: dict[str, str], tmp_path: Path) -> None:
    store = open_store(s3_url, create=True, env=s3_env)
    release_id, sources = publish(store, tmp_path, {f"{i}.bin": 100 + i for i in range(5)})
    put_object(store, s3_env, packs.locator_key(release_id), b"[" * 100_000)
    pull(open_store(s3_url, env=s3_env), "t", tmp_path / "cache")  # found through the indexes instead
    assert all((tmp_path / "cache" / s.path.name).read_bytes() == s.path.read_bytes() for s in sources)


# ---- every integrity error of a pull names the cache file and the store object ------------------
# Each scenario publishes a release, damages the store, and returns the store to pull from (perhaps
# through a proxy) and the store object the message must name.

SMALL, LARGE = {"x.bin": 5000}, {"big.bin": 17 << 20}  # LARGE: fetched in ranges (ranged.RANGED_MIN)


@contextmanager
def _corrupt_loose(store, env, tmp_path, **_):  # write_verified: bytes do not match
    _, [src] = publish(store, tmp_path, SMALL, loose=("x.bin",))
    corrupt_blob(store, src.digest, env)
    yield store, blob_key(src.digest)


@contextmanager
def _corrupt_packed(store, env, tmp_path, **_):  # write_verified, from a pack range
    _, [src] = publish(store, tmp_path, SMALL)
    corrupt_blob(store, src.digest, env)
    yield store, ".pack at byte"


@contextmanager
def _local_fifo(store, env, tmp_path, **_):  # the local store's non-regular blob
    _, [src] = publish(store, tmp_path, SMALL)
    blob = Path(store.url) / blob_key(src.digest)
    blob.unlink()
    os.mkfifo(blob)
    yield store, str(blob)


@contextmanager
def _local_sparse(store, env, tmp_path, **_):  # write_verified: longer than declared
    _, [src] = publish(store, tmp_path, SMALL)
    blob = Path(store.url) / blob_key(src.digest)
    os.chmod(blob, 0o644)
    with blob.open("ab") as f:
        f.truncate(1 << 40)
    yield store, str(blob)


@contextmanager
def _endless_loose(store, env, tmp_path, s3_server, **_):  # write_verified: longer than declared
    _, [src] = publish(store, tmp_path, SMALL, loose=("x.bin",))
    with proxied(s3_server, env, store.url, ("/blobs/",)) as (via_proxy, _, _proxy):
        yield via_proxy, blob_key(src.digest)


@contextmanager
def _endless_large_stream(store, env, tmp_path, s3_server, monkeypatch, **_):  # one GET per large blob
    from neffbuild.store.s3 import transfer as s3transfer

    monkeypatch.setattr(s3transfer, "STREAM_MIN", 1)
    _, [src] = publish(store, tmp_path, LARGE)
    with proxied(s3_server, env, store.url, ("/blobs/",)) as (via_proxy, _, _proxy):
        yield via_proxy, blob_key(src.digest)


@contextmanager
def _unended_large_ranges(store, env, tmp_path, s3_server, **_):  # a range with no length: short_range
    _, [src] = publish(store, tmp_path, LARGE)
    with proxied(s3_server, env, store.url, ("/blobs/",)) as (via_proxy, _, _proxy):
        yield via_proxy, blob_key(src.digest)


@contextmanager
def _large_cut_short(store, env, tmp_path, **_):  # the object is shorter than the release says
    _, [src] = publish(store, tmp_path, LARGE)
    put_object(store, env, blob_key(src.digest), src.path.read_bytes()[: 6 << 20])
    yield store, blob_key(src.digest)


@contextmanager
def _pack_cut_short(store, env, tmp_path, **_):  # a clipped range of a pack: short_range
    release_id, [_src] = publish(store, tmp_path, SMALL)
    [pack_id] = packs.decode_locator(release_id, get_object(store, env, packs.locator_key(release_id)), "").packs
    put_object(store, env, packs.pack_key(pack_id), b"x" * 100)
    yield store, packs.pack_key(pack_id)


@contextmanager
def _pack_emptied(store, env, tmp_path, **_):  # a range past the end of the pack: HTTP 416
    release_id, [_src] = publish(store, tmp_path, SMALL)
    [pack_id] = packs.decode_locator(release_id, get_object(store, env, packs.locator_key(release_id)), "").packs
    put_object(store, env, packs.pack_key(pack_id), b"")
    yield store, packs.pack_key(pack_id)


@contextmanager
def _index_damaged(store, env, tmp_path, **_):  # decode_index, needed through the locator
    _, [src] = publish(store, tmp_path, SMALL)
    damaged = index_holding(store, env, src.digest)
    put_object(store, env, damaged, b"{}")
    yield store, damaged


@contextmanager
def _index_damaged_no_locator(store, env, tmp_path, **_):  # a skipped index that held the blob
    release_id, [src] = publish(store, tmp_path, SMALL)
    damaged = index_holding(store, env, src.digest)
    put_object(store, env, damaged, b"{}")
    bucket, key = s3_key(store, packs.locator_key(release_id))
    s3_client(env).delete_object(Bucket=bucket, Key=key)
    yield store, damaged


@contextmanager
def _index_endless(store, env, tmp_path, s3_server, monkeypatch, **_):  # an index past INDEX_MAX
    monkeypatch.setattr(packs, "INDEX_MAX", 1 << 20)
    _, [src] = publish(store, tmp_path, SMALL)
    damaged = index_holding(store, env, src.digest)
    with proxied(s3_server, env, store.url, (".idx.json?",)) as (via_proxy, _, _proxy):
        yield via_proxy, damaged


@contextmanager
def _locator_lies(store, env, tmp_path, **_):  # the locator places a blob in a pack that lacks it
    publish(store, tmp_path, {"other.bin": 3000}, tag="other", seed=9)
    release_id, [src] = publish(store, tmp_path, SMALL)
    locator = packs.decode_locator(release_id, get_object(store, env, packs.locator_key(release_id)), "")
    [own] = locator.packs
    other = next(p for p in store.catalog.pack_ids() if p != own)  # type: ignore[attr-defined]
    put_object(store, env, packs.locator_key(release_id), packs.encode_locator(release_id, {src.digest: other}, []))
    yield store, packs.locator_key(release_id)


LOCAL_SCENARIOS = {"corrupt": _corrupt_loose, "fifo": _local_fifo, "sparse-terabyte": _local_sparse}
S3_SCENARIOS = {
    "corrupt-loose": _corrupt_loose, "corrupt-packed": _corrupt_packed, "endless-loose": _endless_loose,
    "endless-large-stream": _endless_large_stream, "unended-large-ranges": _unended_large_ranges,
    "large-cut-short": _large_cut_short, "pack-cut-short": _pack_cut_short, "pack-emptied": _pack_emptied,
    "index-damaged": _index_damaged, "index-damaged-no-locator": _index_damaged_no_locator,
    "index-endless": _index_endless, "locator-lies": _locator_lies,
}  # fmt: skip


@pytest.mark.parametrize(
    "where,scenario",
    [("local", s) for s in LOCAL_SCENARIOS] + [pytest.param("s3", s, marks=pytest.mark.s3) for s in S3_SCENARIOS],
)
def test_every_integrity_error_of_a_pull_names_the_cache_file_and_the_store_object(
    where: str, scenario: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    if where == "local":
        store, env, damage, server = (
            open_store(str(tmp_path / "store"), create=True),
            {},
            LOCAL_SCENARIOS[scenario],
            None,
        )
    else:
        env = request.getfixturevalue("s3_env")
        store, damage = open_store(request.getfixturevalue("s3_url"), create=True, env=env), S3_SCENARIOS[scenario]
        server = request.getfixturevalue("s3_server")
    cache = tmp_path / "cache"
    with damage(store, env, tmp_path, s3_server=server, monkeypatch=monkeypatch) as (reader, store_object):
        # A host pulls in a process of its own, with nothing remembered.
        host = open_store(store.url, env=env) if reader is store else reader
        with pytest.raises(IntegrityError) as err:
            pull(host, "t", cache)
    assert_refused(err.value, cache, store_object)
    assert reader.url in err.value.message or store_object.startswith("/")
