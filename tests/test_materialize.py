"""write_verified: files land whole and checked, or not at all, through both temp-file kinds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from neffbuild import materialize
from neffbuild.errors import DiskError, IntegrityError
from neffbuild.materialize import DIRECT_MIN, BlobTarget, aligned_buffer, write_verified


@pytest.fixture(params=["unnamed", "named"])
def temp_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a file is staged: O_TMPFILE (Linux) and the portable `*.incomplete` file."""
    if request.param == "named":
        monkeypatch.setattr(materialize, "_unnamed_files_possible", lambda: False)
    elif not materialize._unnamed_files_possible():
        pytest.skip("no O_TMPFILE here")
    return request.param


def target_for(data: bytes, dest: Path) -> BlobTarget:
    return BlobTarget(xxhash.xxh3_128_hexdigest(data), len(data), dest)


def aligned_chunks(data: bytes, size: int = 1 << 20) -> list[memoryview]:
    """Chunks as the S3 data plane hands them over: views of page-aligned buffers."""
    chunks = []
    for start in range(0, len(data), size):
        buf = aligned_buffer(size)
        piece = data[start : start + size]
        buf[: len(piece)] = piece
        chunks.append(memoryview(buf)[: len(piece)])
    return chunks


def leftovers(root: Path, keep: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p != keep]


def test_small_file_lands_in_new_directories(tmp_path: Path, temp_kind: str) -> None:
    data = os.urandom(70_000)
    dest = tmp_path / "a" / "b" / "c.so"
    write_verified(target_for(data, dest), [data[:1000], data[1000:]], origin="test")
    assert dest.read_bytes() == data and leftovers(tmp_path, dest) == []


def test_large_file_with_an_unaligned_tail_lands_whole(tmp_path: Path, temp_kind: str) -> None:
    # Larger than DIRECT_MIN: written with O_DIRECT where the filesystem takes it, the last
    # 12,345 bytes (not a whole block) through the page cache.
    data = os.urandom(DIRECT_MIN + 12_345)
    dest = tmp_path / "big.neff"
    write_verified(target_for(data, dest), aligned_chunks(data), origin="test")
    assert dest.read_bytes() == data and leftovers(tmp_path, dest) == []


def test_unaligned_chunks_of_a_large_file_still_land(tmp_path: Path, temp_kind: str) -> None:
    data = os.urandom(DIRECT_MIN + 1)
    dest = tmp_path / "big.neff"
    write_verified(target_for(data, dest), [data[:5], data[5:]], origin="test")  # bytes objects: unaligned
    assert dest.read_bytes() == data


def test_mismatch_leaves_nothing_and_keeps_the_old_file(tmp_path: Path, temp_kind: str) -> None:
    dest = tmp_path / "x.so"
    dest.write_bytes(b"old")
    good = os.urandom(DIRECT_MIN)
    with pytest.raises(IntegrityError, match="does not match"):
        write_verified(target_for(good, dest), aligned_chunks(good[:-1] + bytes([good[-1] ^ 1])), origin="s3://b/blobs/x")
    assert dest.read_bytes() == b"old" and leftovers(tmp_path, dest) == []


def test_an_existing_file_is_replaced(tmp_path: Path, temp_kind: str) -> None:
    dest = tmp_path / "x.so"
    dest.write_bytes(b"stale or corrupt")
    data = os.urandom(1000)
    write_verified(target_for(data, dest), [data], origin="test")
    assert dest.read_bytes() == data and leftovers(tmp_path, dest) == []


def test_a_failing_source_leaves_nothing(tmp_path: Path, temp_kind: str) -> None:
    def chunks():
        yield b"x" * 100
        raise RuntimeError("cut")

    dest = tmp_path / "d" / "x.so"
    with pytest.raises(RuntimeError):
        write_verified(BlobTarget("0" * 32, 200, dest), chunks(), origin="test")
    assert leftovers(tmp_path, dest) == [] and not dest.exists()


def test_unwritable_directory_is_a_disk_error(tmp_path: Path, temp_kind: str) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(DiskError):
        write_verified(target_for(b"x", locked / "x"), [b"x"], origin="test")


def test_a_source_that_never_ends_stops_one_chunk_past_the_declared_size(tmp_path: Path, temp_kind: str) -> None:
    data = os.urandom(10_000)
    dest = tmp_path / "d" / "x.so"
    pulled = []

    def endless():  # the right bytes, then zeros for ever (a body without an end)
        yield data
        while True:
            pulled.append(1)
            yield bytes(4096)

    with pytest.raises(IntegrityError, match="longer than the 10000 bytes") as err:
        write_verified(target_for(data, dest), endless(), origin="s3://b/blobs/x")
    assert str(dest) in err.value.message and "s3://b/blobs/x" in err.value.message
    assert len(pulled) == 1  # one chunk more proved it too long
    assert leftovers(tmp_path, dest) == [] and not dest.exists()
