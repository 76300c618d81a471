"""write_verified: files land whole and checked, or not at all, through both temp-file kinds."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import blake3
import pytest
import xxhash

from neffbuild.errors import DiskError, IntegrityError
from neffbuild.fs import confined as materialize
from neffbuild.fs.beneath import HASH_CHUNK, Beneath
from neffbuild.fs.confined import DIRECT_MIN, BlobTarget, Parents, aligned_buffer, write_verified
from tests.pagecache import direct_io_possible, resident_fraction


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


@pytest.mark.parametrize("direct", [True, False])
def test_direct_and_buffered_writes_land_the_same_bytes(tmp_path: Path, temp_kind: str, direct: bool) -> None:
    data = os.urandom(DIRECT_MIN + (1 << 20) + 12_345)
    dest = tmp_path / "big.neff"
    target = dataclasses.replace(target_for(data, dest), direct=direct)
    write_verified(target, aligned_chunks(data), origin="test")
    assert dest.read_bytes() == data and leftovers(tmp_path, dest) == []


def test_buffered_writes_leave_the_file_in_memory_and_direct_ones_do_not(tmp_path: Path) -> None:
    # What the option is for: after a buffered landing the server's first load reads memory;
    # after an O_DIRECT one (where the filesystem takes it) it reads the disk.
    data = os.urandom(DIRECT_MIN)
    for direct in (False, True):
        dest = tmp_path / f"direct-{direct}.neff"
        write_verified(dataclasses.replace(target_for(data, dest), direct=direct), aligned_chunks(data), origin="test")
        resident = resident_fraction(dest)
        if not direct:
            assert resident > 0.9
        elif direct_io_possible(tmp_path):
            assert resident < 0.1
        assert dest.read_bytes() == data


def test_mismatch_leaves_nothing_and_keeps_the_old_file(tmp_path: Path, temp_kind: str) -> None:
    dest = tmp_path / "x.so"
    dest.write_bytes(b"old")
    good = os.urandom(DIRECT_MIN)
    with pytest.raises(IntegrityError, match="does not match"):
        write_verified(
            target_for(good, dest), aligned_chunks(good[:-1] + bytes([good[-1] ^ 1])), origin="s3://b/blobs/x"
        )
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


# ---- confinement: nothing below a target's root is reached through a symlink --------------------


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root, links not followed: kind, bytes or link target, mtime."""
    found: dict[str, tuple] = {".": ("dir", root.lstat().st_mtime_ns)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                found[rel] = ("dir", st.st_mtime_ns)
            else:
                found[rel] = ("file", path.read_bytes(), st.st_mtime_ns)
    return found


@pytest.fixture
def cache_and_outside(tmp_path: Path) -> tuple[Path, Path]:
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir()
    outside.mkdir()
    (outside / "keep.txt").write_bytes(b"outside")
    return cache, outside


def confined(data: bytes, root: Path, rel: str) -> BlobTarget:
    return BlobTarget(xxhash.xxh3_128_hexdigest(data), len(data), root / rel, root=root)


@pytest.mark.parametrize("link", ["relative", "absolute", "deeper"])
def test_a_symlinked_directory_below_the_root_is_refused_and_nothing_changes(
    cache_and_outside, temp_kind: str, link: str
) -> None:
    cache, outside = cache_and_outside
    if link == "deeper":
        (cache / "d").mkdir()
        (cache / "d" / "lnk").symlink_to(outside)
        rel, shown = "d/lnk/new/evil.bin", cache / "d" / "lnk"
    else:
        (cache / "lnk").symlink_to("../outside" if link == "relative" else str(outside))
        rel, shown = "lnk/new/evil.bin", cache / "lnk"
    before = (snapshot(cache), snapshot(outside))
    with pytest.raises(DiskError, match="is a symbolic link") as info:
        write_verified(confined(b"evil", cache, rel), [b"evil"], origin="test")
    assert info.value.message.startswith(f"{shown}:")
    assert (snapshot(cache), snapshot(outside)) == before


def test_a_symlink_where_a_file_lands_is_replaced_not_followed(cache_and_outside, temp_kind: str) -> None:
    cache, outside = cache_and_outside
    (cache / "a").mkdir()
    (cache / "a" / "x.so").symlink_to(outside / "keep.txt")
    before = snapshot(outside)
    write_verified(confined(b"ours", cache, "a/x.so"), [b"ours"], origin="test")
    assert not (cache / "a" / "x.so").is_symlink() and (cache / "a" / "x.so").read_bytes() == b"ours"
    assert snapshot(outside) == before


def test_a_dangling_symlink_where_a_file_lands_is_replaced(cache_and_outside, temp_kind: str) -> None:
    cache, outside = cache_and_outside
    (cache / "x.so").symlink_to(outside / "not-yet")  # following it would create outside/not-yet
    write_verified(confined(b"ours", cache, "x.so"), [b"ours"], origin="test")
    assert (cache / "x.so").read_bytes() == b"ours" and not (outside / "not-yet").exists()


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_directories_kept_open_across_a_download_land_each_file_and_close_at_the_end(
    cache_and_outside, temp_kind: str
) -> None:
    cache, _ = cache_and_outside
    files = {f"d{i % 3}/sub/f{i}.so": os.urandom(100 + i) for i in range(12)}
    before = open_fds()
    with Parents() as parents:
        for rel, data in files.items():
            write_verified(confined(data, cache, rel), [data], origin="test", parents=parents)
        assert len(open_fds() - before) == 3  # one per directory, not one per file
    assert open_fds() == before
    assert {p.relative_to(cache).as_posix(): p.read_bytes() for p in cache.rglob("*.so")} == files


def test_kept_directories_still_refuse_a_link_and_a_name_leaving_them(cache_and_outside, temp_kind: str) -> None:
    cache, outside = cache_and_outside
    (cache / "lnk").symlink_to(outside)
    before = snapshot(outside)
    with Parents() as parents:
        write_verified(confined(b"x", cache, "a/x.so"), [b"x"], origin="test", parents=parents)
        with pytest.raises(DiskError, match="is a symbolic link"):
            write_verified(confined(b"evil", cache, "lnk/evil.bin"), [b"evil"], origin="test", parents=parents)
        with pytest.raises(ValueError, match="not a file beneath"):
            write_verified(confined(b"up", cache, "a/.."), [b"up"], origin="test", parents=parents)
    assert snapshot(outside) == before and not (cache / "a" / "..").is_file()


def test_the_root_itself_may_be_a_symlink(tmp_path: Path, temp_kind: str) -> None:
    """Where --cache-dir points is the operator's choice: only what lies below it is confined."""
    real = tmp_path / "disk" / "cache"
    real.mkdir(parents=True)
    (tmp_path / "cache").symlink_to(real)
    write_verified(confined(b"x", tmp_path / "cache", "a/b.so"), [b"x"], origin="test")
    assert (real / "a" / "b.so").read_bytes() == b"x"


def test_beneath_never_reports_a_link_or_a_fifo_as_a_file(cache_and_outside) -> None:
    cache, outside = cache_and_outside
    (cache / "f.bin").symlink_to(outside / "keep.txt")
    os.mkfifo(cache / "pipe.bin")
    (cache / "real.bin").write_bytes(b"outside")
    (cache / "dir").symlink_to(outside)
    root = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with Beneath(root, cache) as tree:
            assert stat.S_ISLNK(tree.lstat("f.bin").st_mode)
            assert tree.hash_file("f.bin", 100) is None  # not followed, though its target matches
            assert tree.hash_file("pipe.bin", 100) is None  # opened without blocking, not read
            assert tree.hash_file("real.bin", 100) == xxhash.xxh3_128_hexdigest(b"outside")
            assert tree.hash_file("real.bin", 3) is None  # more bytes than expected: not read on
            assert tree.lstat("missing/x") is None
            with pytest.raises(DiskError, match=f"{cache / 'dir'}: is a symbolic link"):
                tree.lstat("dir/keep.txt")
            # look: the status and the digest from one open, the same rules
            assert tree.look("f.bin", 15) is None and tree.look("pipe.bin", 0) is None
            st, digests = tree.look("real.bin", 7)
            assert (st.st_size, digests) == (7, (xxhash.xxh3_128_hexdigest(b"outside"), ""))
            assert tree.look("real.bin", 6)[1] is None  # another size: its status, no digest, not read
            assert tree.look("missing/x", 1) is None
            with pytest.raises(DiskError, match=f"{cache / 'dir'}: is a symbolic link"):
                tree.look("dir/keep.txt", 15)
            # regular_stats: lstat's answer, a regular file's status or None, for many paths at once
            (cache / "sub").mkdir()
            (cache / "sub" / "a.bin").write_bytes(b"ab")
            stats: list[os.stat_result | None] = []
            tree.regular_stats(["f.bin", "pipe.bin", "real.bin", "sub", "sub/a.bin", "sub/no", "missing/x", "real.bin"], stats)  # fmt: skip
            assert [st and st.st_size for st in stats] == [None, None, 7, None, 2, None, None, 7]
            stats = []
            with pytest.raises(DiskError, match=f"{cache / 'dir'}: is a symbolic link"):
                tree.regular_stats(["real.bin", "dir/keep.txt", "sub/a.bin"], stats)
            assert len(stats) == 1  # says which path failed
            # regular_sizes: the same answers as (size, mtime) columns, no status kept
            rels = ["f.bin", "pipe.bin", "real.bin", "sub", "sub/a.bin", "sub/no", "missing/x"]
            sizes: list[int | None] = []
            mtimes: list[int | None] = []
            tree.regular_sizes(rels, sizes, mtimes)
            stats = []
            tree.regular_stats(rels, stats)
            assert sizes == [st and st.st_size for st in stats] and mtimes == [st and st.st_mtime_ns for st in stats]
            sizes, mtimes = [], []
            with pytest.raises(DiskError, match=f"{cache / 'dir'}: is a symbolic link"):
                tree.regular_sizes(["real.bin", "dir/keep.txt", "sub/a.bin"], sizes, mtimes)
            assert len(sizes) == len(mtimes) == 1
    finally:
        os.close(root)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, HASH_CHUNK - 1, HASH_CHUNK, HASH_CHUNK + 1, 2 * HASH_CHUNK + 3])
def test_look_hashes_every_byte_at_each_size_around_the_read_buffer(tmp_path: Path, size: int) -> None:
    # Small files are read in one go (the short read at fstat's size ends it), larger ones in
    # buffer-sized reads: either way a change in the last byte shows.
    data = os.urandom(size)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_bytes(data)
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with Beneath(root, tmp_path) as tree:
            # Both digests from the one read (verify --full and pull's re-hash of version 2 releases).
            whole = (xxhash.xxh3_128_hexdigest(data), blake3.blake3(data).hexdigest())
            assert tree.look("a/f", size, crypto=True)[1] == whole
            assert tree.look("a/f", size)[1] == (whole[0], "")
            if size:
                (tmp_path / "a" / "f").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
                changed = tree.look("a/f", size, crypto=True)[1]
                assert changed is not None and changed[0] != whole[0] and changed[1] != whole[1]
    finally:
        os.close(root)


def _placing(data: bytes, part: int, *, yielded: bytes | None = None):
    """A write_placed `place` that writes the parts last first, then yields them in order
    (`yielded`: other bytes to hand to the hash than those written)."""

    def place(fd: int, direct: bool):
        starts = list(range(0, len(data), part))
        for start in reversed(starts):
            materialize.write_at(fd, data[start : start + part], start, direct)
        shown = data if yielded is None else yielded
        for start in starts:
            yield memoryview(shown)[start : start + part]

    return place


def test_write_placed_lands_parts_written_out_of_order(tmp_path: Path, temp_kind: str) -> None:
    data = os.urandom(3 * 4096 + 77)
    target = target_for(data, tmp_path / "d" / "f.bin")
    materialize.write_placed(target, _placing(data, 4096), origin="parts")
    assert target.dest.read_bytes() == data
    assert os.listdir(target.dest.parent) == ["f.bin"]


def test_write_placed_refuses_what_does_not_hash_to_the_release(tmp_path: Path, temp_kind: str) -> None:
    data = os.urandom(2 * 4096 + 5)
    target = target_for(data, tmp_path / "d" / "f.bin")
    other = bytes(len(data))
    with pytest.raises(IntegrityError):
        materialize.write_placed(target, _placing(other, 4096), origin="parts")
    with pytest.raises(IntegrityError):  # written right, but the bytes hashed are not the release's
        materialize.write_placed(target, _placing(data, 4096, yielded=other), origin="parts")
    assert os.listdir(target.dest.parent) == []
