"""store/s3/ranged.py: a large blob fetched as concurrent ranged GETs written at their offsets,
against the real S3 server (SeaweedFS), with faults from the proxy and the object replaced mid-way.
Each case runs both ways: parts held in memory to be hashed in order (an O_DIRECT file), and
parts streamed into the file and read back from it (a file in memory: direct=False)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from neffbuild.errors import IntegrityError
from neffbuild.fs.confined import BlobTarget
from neffbuild.store import open_store
from neffbuild.store.base import Store, blob_key
from neffbuild.store.s3 import dataplane, ranged
from neffbuild.store.s3.responses import ObjectChanged
from tests.storekit import s3_client, write_files
from tests.tcpproxy import TcpProxy

pytestmark = pytest.mark.s3
SIZE = ranged.RANGED_MIN + (200 << 10) + 45  # parts of PART_MIN, the last one short (not block-aligned)
DIRECT = pytest.mark.parametrize("direct", [True, False], ids=["in-order", "read-back"])


def _plan(direct: bool, sizes: list[int], jobs: int) -> ranged.Plan:
    return ranged.plan(sizes, jobs) if direct else ranged.back_plan(sizes, jobs)


def test_plan_keeps_parts_aligned_and_buffers_bounded() -> None:
    for sizes, jobs in [([128 << 20] * 8, 16), ([10 << 30], 16), ([SIZE], 1), ([1 << 30] * 2, 64)]:
        split = ranged.plan(sizes, jobs)
        assert split.part % ranged.PART_MIN == 0 and ranged.PART_MIN <= split.part <= ranged.PART_MAX
        assert split.writers == min(len(sizes), jobs) and split.window >= 2
        assert split.writers * split.window * split.part <= max(
            ranged.MEMORY, split.writers * split.window * ranged.PART_MIN
        )
        assert split.requests(sizes) == sum(-(-s // split.part) for s in sizes)
    # A few blobs and many connections: each blob keeps more than one part in flight.
    assert ranged.plan([128 << 20] * 2, 16).window > 8


def test_read_back_parts_are_few_large_and_all_in_flight() -> None:
    for sizes, jobs in [([128 << 20] * 8, 16), ([10 << 30], 16), ([SIZE], 1), ([1 << 30] * 2, 64)]:
        split = ranged.back_plan(sizes, jobs)
        assert split.part % ranged.PART_MIN == 0 and ranged.BACK_PART_MIN <= split.part <= ranged.PART_MAX
        assert split.window == max(-(-s // split.part) for s in sizes)
    # 8 x 128 MiB on 16 connections: two parts per connection, not the in-order path's sixteen.
    assert ranged.back_plan([128 << 20] * 8, 16).requests([128 << 20] * 8) == 32


def _large(s3_url: str, env: dict[str, str], tmp_path: Path) -> tuple[Store, Any]:
    store = open_store(s3_url, create=True, env=env)
    [source] = write_files(tmp_path / "src", {"big.bin": SIZE})
    store.put_blobs([source], jobs=2)
    return store, source


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _ranges(proxy: TcpProxy) -> list[tuple[str, dict[str, str]]]:
    return [(h["range"], h) for m, p, h in proxy.seen if m == "GET" and "/blobs/" in p and "range" in h]


@DIRECT
def test_a_large_blob_lands_whole_from_concurrent_ranges(s3_url, s3_env, s3_server, tmp_path: Path, direct) -> None:
    _, source = _large(s3_url, s3_env, tmp_path)
    with TcpProxy(_port(s3_server.endpoint)) as proxy:
        via_proxy = open_store(s3_url, env={**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint})
        target = BlobTarget(
            source.digest, source.size, tmp_path / "cache" / "big.bin", blake3=source.blake3, direct=direct
        )
        via_proxy.download_blobs([target], jobs=4)
    assert target.dest.read_bytes() == source.path.read_bytes()
    asked = _ranges(proxy)
    part = _plan(direct, [SIZE], 4).part
    assert sorted(r for r, _ in asked) == sorted(f"bytes={s}-{min(s + part, SIZE) - 1}" for s in range(0, SIZE, part))
    assert [p for p in target.dest.parent.iterdir()] == [target.dest]  # no temp file left


@DIRECT
def test_cut_and_throttled_ranges_are_retried_alone(s3_url, s3_env, s3_server, tmp_path: Path, direct) -> None:
    _, source = _large(s3_url, s3_env, tmp_path)
    target = BlobTarget(source.digest, source.size, tmp_path / "cache" / "big.bin", direct=direct)
    with TcpProxy(_port(s3_server.endpoint), mode="cut-gets", paths=("/blobs/",), cuts=2) as proxy:
        open_store(s3_url, env={**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}).download_blobs([target], jobs=4)
    assert proxy.cuts == 0 and target.dest.read_bytes() == source.path.read_bytes()
    part = _plan(direct, [SIZE], 4).part
    starts = [int(r.removeprefix("bytes=").split("-")[0]) for r, _ in _ranges(proxy)]
    assert len([s for s in starts if s % part]) == 2  # each cut range asked again for its rest only
    target.dest.unlink()
    with TcpProxy(_port(s3_server.endpoint), mode="slowdown", paths=("/blobs/",), slowdowns=3) as proxy:
        open_store(s3_url, env={**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}).download_blobs([target], jobs=4)
    assert target.dest.read_bytes() == source.path.read_bytes()


def _replacing(
    monkeypatch: pytest.MonkeyPatch, after: Callable[[int], bytes | None], store_key: str, env: dict[str, str]
) -> list[int]:
    """After each ranged GET of the blob (a part read whole), put after(n) (n: GETs so far) as its
    object, if not None."""
    real = dataplane.DataPlane.get
    done: list[int] = []
    one_at_a_time = threading.Lock()
    bucket, key = store_key.split("/", 1)

    def get(self: dataplane.DataPlane, rel: str, *args: Any, **kwargs: Any) -> memoryview:
        if not rel.startswith("blobs/"):
            return real(self, rel, *args, **kwargs)
        with one_at_a_time:  # a GET and the put after it, before any other GET: no race with the server
            view = real(self, rel, *args, **kwargs)
            done.append(len(view))
            replacement = after(len(done))
            if replacement is not None:
                s3_client(env).put_object(Bucket=bucket, Key=key, Body=replacement)
        return view

    real_resumed = dataplane.DataPlane.resumed

    def resumed(self: dataplane.DataPlane, rel: str, *args: Any, **kwargs: Any) -> Iterator[memoryview]:
        with one_at_a_time:  # a part read to its end and the put after it, before any other part
            got = 0
            for view in real_resumed(self, rel, *args, **kwargs):
                got += len(view)
                yield view
            done.append(got)
            replacement = after(len(done))
            if replacement is not None:
                s3_client(env).put_object(Bucket=bucket, Key=key, Body=replacement)

    monkeypatch.setattr(dataplane.DataPlane, "get", get)
    monkeypatch.setattr(dataplane.DataPlane, "resumed", resumed)
    return done


def _store_key(s3_url: str, digest: str) -> str:
    return f"{s3_url.removeprefix('s3://')}/{blob_key(digest)}"


@DIRECT
def test_an_object_replaced_mid_way_is_fetched_again_from_its_start(
    s3_url, s3_env, s3_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """The store holds a damaged copy that is repaired while the first part is being fetched:
    the next part's If-Match is refused and the blob starts again; no bytes of two versions mix."""
    store, source = _large(s3_url, s3_env, tmp_path)
    good = source.path.read_bytes()
    key = _store_key(s3_url, source.digest)
    bucket, rel = key.split("/", 1)
    s3_client(s3_env).put_object(Bucket=bucket, Key=rel, Body=bytes(SIZE))  # same length, other bytes
    done = _replacing(monkeypatch, lambda n: good if n == 1 else None, key, s3_env)
    target = BlobTarget(source.digest, source.size, tmp_path / "cache" / "big.bin", blake3=source.blake3, direct=direct)
    # Two connections for one blob: ranges (one would stream it). Each connection asks for its
    # next part after the repair, so a part of the new version (or its refusal) always follows.
    store.download_blobs([target], jobs=2)
    assert target.dest.read_bytes() == good
    assert len(done) > _plan(direct, [SIZE], 2).requests([SIZE])  # a stale part or more, then all again


@DIRECT
def test_an_object_that_keeps_changing_fails_and_lands_nothing(
    s3_url, s3_env, s3_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    store, source = _large(s3_url, s3_env, tmp_path)
    versions = iter(range(1, 1000))
    _replacing(monkeypatch, lambda n: bytes([next(versions)]) * SIZE, _store_key(s3_url, source.digest), s3_env)
    target = BlobTarget(source.digest, source.size, tmp_path / "cache" / "big.bin", direct=direct)
    with pytest.raises(ObjectChanged) as err:
        store.download_blobs([target], jobs=2)
    assert blob_key(source.digest) in err.value.message
    assert not list((tmp_path / "cache").iterdir()) if (tmp_path / "cache").exists() else True


@DIRECT
def test_a_part_of_other_bytes_fails_the_hash_and_lands_nothing(
    s3_url, s3_env, s3_server, tmp_path: Path, direct: bool
) -> None:
    """The same length under the same ETag everywhere, but not the release's bytes: the hash in
    order over the parts written in place refuses it."""
    store, source = _large(s3_url, s3_env, tmp_path)
    damaged = bytearray(source.path.read_bytes())
    damaged[SIZE - 5] ^= 1  # in the last part
    bucket, rel = _store_key(s3_url, source.digest).split("/", 1)
    s3_client(s3_env).put_object(Bucket=bucket, Key=rel, Body=bytes(damaged))
    target = BlobTarget(source.digest, source.size, tmp_path / "cache" / "big.bin", blake3=source.blake3, direct=direct)
    with pytest.raises(IntegrityError):
        store.download_blobs([target], jobs=4)
    assert not (tmp_path / "cache" / "big.bin").exists()
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
