"""Pull: only missing files move, every byte is verified, nothing lands half-written."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from neffbuild.build.publish import move_tag, publish_bundle, publish_release
from neffbuild.documents.bundles import BundleRecord, Timings
from neffbuild.documents.records import FileEntry, Release, ReleaseUnit, dump, parse
from neffbuild.errors import IntegrityError, NotFoundError
from neffbuild.hashing import canonical_json, hash_bytes, hash_file
from neffbuild.host.landing import remove_stale_temp_files
from neffbuild.host.pull import pull
from neffbuild.names import INCOMPLETE_SUFFIX, STATE_DIR
from neffbuild.store.base import blob_key
from neffbuild.store.blobs import BlobSource
from neffbuild.store.local import LocalStore
from tests.procs import wait_for
from tests.storekit import this_host


def publish_files(store: LocalStore, files: dict[str, bytes], tmp: Path, tag: str = "t", **release_fields: Any) -> str:
    """Publish a one-bundle release of these files through the real publish path (release_fields
    replace the release's own, unchecked: a forged release as a hostile store would hold it)."""
    src = tmp / f"src-{hash_bytes(json.dumps(sorted(files)).encode())[:8]}"
    sources, entries = [], []
    for rel, data in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        digest = hash_file(path)
        sources.append(BlobSource(digest.hex, digest.size, path))
        entries.append(FileEntry(path=rel, size=digest.size, digest=digest.hex, blake3=digest.blake3))
    key = hash_bytes(repr(sorted(files.items())).encode())
    fingerprint = this_host(
        {}, release_fields.get("env", {"OMP_NUM_THREADS": "2"})
    )  # built here: pull finds no difference
    record = BundleRecord(
        key=key,
        unit_id="m/1x1x1",
        unit={},
        backend="inductor",
        fingerprint=fingerprint,
        files=tuple(entries),
        counters={},
        timings=Timings(),
        created_at="2026-01-01T00:00:00+00:00",
        neffbuild_version="test",
    )
    publish_bundle(store, record, sources, jobs=2)
    release = Release(
        name=tag,
        manifest_digest="0" * 32,
        backend="inductor",
        cache_env="TORCHINDUCTOR_CACHE_DIR",
        env={"OMP_NUM_THREADS": "2"},
        fingerprint=fingerprint,
        units=(ReleaseUnit(unit_id="m/1x1x1", key=key),),
        files=tuple(sorted(entries, key=lambda e: e.path)),
    )
    release = dataclasses.replace(release, **release_fields)
    release_id = publish_release(store, release)
    move_tag(store, tag, release_id)
    return release_id


FILES = {f"{i:02x}/c{i:04d}.so": os.urandom(1000 + i) for i in range(40)} | {"fxgraph/ab/key/entry": b"graph"}


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store", create=True)


def incomplete_files(root: Path) -> list[Path]:
    return list(root.rglob("*.incomplete"))


def test_pull_materialises_every_file_and_prints_exports(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    result = cli("pull", "t", "--store", str(store.root), "--cache-dir", str(cache))
    assert result.returncode == 0, result.stderr
    for rel, data in FILES.items():
        assert (cache / rel).read_bytes() == data
    assert f"export TORCHINDUCTOR_CACHE_DIR={cache}" in result.stdout
    assert "export OMP_NUM_THREADS=2" in result.stdout


def test_complete_cache_makes_pull_a_no_op(store: LocalStore, tmp_path: Path) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    first = pull(store, "t", cache, jobs=4)
    mtimes = {rel: (cache / rel).stat().st_mtime_ns for rel in FILES}
    second = pull(store, "t", cache, jobs=4)
    assert (first.files_fetched, second.files_fetched, second.bytes_fetched) == (len(FILES), 0, 0)
    assert {rel: (cache / rel).stat().st_mtime_ns for rel in FILES} == mtimes


def test_pull_leaves_garbage_collection_as_it_found_it(store: LocalStore, tmp_path: Path) -> None:
    # A no-op pull decodes and scans with collection paused (host/pull.py _no_collection).
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    try:
        for enabled in (True, False):
            if enabled:
                gc.enable()
            else:
                gc.disable()
            assert pull(store, "t", cache).files_fetched == 0
            assert gc.isenabled() is enabled
            with pytest.raises(NotFoundError):
                pull(store, "no-such-tag", cache)
            assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_damaged_or_deleted_local_files_are_fetched_again(store: LocalStore, tmp_path: Path) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    damaged, deleted = sorted(FILES)[:2]
    data = bytearray((cache / damaged).read_bytes())
    data[10] ^= 0xFF  # same size, different bytes
    (cache / damaged).write_bytes(bytes(data))
    (cache / deleted).unlink()
    report = pull(store, "t", cache)
    assert report.files_fetched == 2
    assert (cache / damaged).read_bytes() == FILES[damaged]
    assert (cache / deleted).read_bytes() == FILES[deleted]


def flip_a_byte_in_place(path: Path, at: int = 7) -> None:
    """Change one byte, keeping the size and putting the mtime back: what (size, mtime) cannot see."""
    before = path.stat()
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_verify_full_repairs_a_byte_flipped_behind_the_states_back(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    victim = sorted(FILES)[5]
    flip_a_byte_in_place(cache / victim)
    fast = pull(store, "t", cache)  # documented: the default trusts the (size, mtime) it recorded
    assert (fast.files_fetched, fast.files_rehashed) == (0, 0)
    assert (cache / victim).read_bytes() != FILES[victim]
    result = cli("pull", "t", "--store", str(store.root), "--cache-dir", str(cache), "--verify", "full", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["files_rehashed"], report["files_repaired"], report["files_fetched"]) == (len(FILES), 1, 1)
    assert (cache / victim).read_bytes() == FILES[victim]
    again = pull(store, "t", cache, verify="full")  # repaired and recorded: nothing left to fetch
    assert (again.files_rehashed, again.files_fetched) == (len(FILES), 0)
    assert incomplete_files(cache) == []


def test_verify_full_hashes_large_files_in_threads_and_repairs_each(store: LocalStore, tmp_path: Path) -> None:
    big = {f"neff/{i}.neff": os.urandom(3 << 20) for i in range(4)}  # large enough to be hashed in threads
    publish_files(store, big, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    for victim in sorted(big)[1:3]:
        flip_a_byte_in_place(cache / victim)
    report = pull(store, "t", cache, jobs=4, verify="full")
    assert (report.files_rehashed, report.files_repaired, report.files_fetched) == (4, 2, 2)
    assert all((cache / rel).read_bytes() == data for rel, data in big.items())


def test_verify_full_finds_every_kind_of_damage_among_many_small_files(store: LocalStore, tmp_path: Path) -> None:
    # Many small files in several directories (read in one pass: each opened once, read in one
    # go): each kind of damage, wherever it sits in that pass, is found and fetched again.
    files = {f"{i % 7:02x}/k{i:04d}.py": os.urandom(100 + i * 13) for i in range(300)} | {"top.txt": b"top-level"}
    publish_files(store, files, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    names = sorted(files)
    flip_a_byte_in_place(cache / names[0])
    flip_a_byte_in_place(cache / names[150], at=files[names[150]].__len__() - 1)  # the last byte
    with (cache / names[151]).open("ab") as f:  # one byte more
        f.write(b"\0")
    os.truncate(cache / names[152], len(files[names[152]]) - 1)  # one byte less
    (cache / names[200]).unlink()
    (tmp_path / "twin").write_bytes(files[names[201]])
    (cache / names[201]).unlink()
    (cache / names[201]).symlink_to(tmp_path / "twin")  # the right bytes, through a link: not present
    (cache / names[202]).unlink()
    os.mkfifo(cache / names[202])
    (cache / "top.txt").write_bytes(b"top-levex")  # same size, new mtime
    report = pull(store, "t", cache, verify="full")
    assert (report.files_fetched, report.files_repaired, report.files_rehashed) == (8, 5, len(files) - 5)
    assert all((cache / rel).read_bytes() == data and not (cache / rel).is_symlink() for rel, data in files.items())
    again = pull(store, "t", cache, verify="full")
    assert (again.files_fetched, again.files_rehashed) == (0, len(files))


@pytest.mark.parametrize("verify", ["fast", "full"])
def test_a_truncated_file_is_repaired_by_either_verify(store: LocalStore, tmp_path: Path, verify: str) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    victim = sorted(FILES)[9]
    before = (cache / victim).stat()
    os.truncate(cache / victim, 100)
    os.utime(cache / victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    report = pull(store, "t", cache, verify=verify)
    assert (report.files_fetched, report.files_repaired) == (1, 1)
    assert (cache / victim).read_bytes() == FILES[victim]


def test_corrupt_store_object_fails_closed_naming_the_file(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, FILES, tmp_path)
    victim = sorted(FILES)[3]
    blob = store.root / blob_key(hash_bytes(FILES[victim]))
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[5] ^= 0x01
    blob.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    result = cli("pull", "t", "--store", str(store.root), "--cache-dir", str(cache), "--jobs", "1")
    assert result.returncode == IntegrityError.exit_code
    assert victim in result.stderr and "does not match" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (cache / victim).exists()
    assert incomplete_files(cache) == []


def files_being_written(pid: int, root: Path) -> list[str]:
    """What the process holds open for writing under root (an unnamed temp file shows as
    `<dir>/#<inode> (deleted)`, a named one as `*.incomplete`)."""
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(root)) and STATE_DIR not in target:
            found.append(target)
    return found


def test_killed_pull_leaves_no_partial_file_and_the_next_pull_completes(store: LocalStore, tmp_path: Path) -> None:
    big = {"big/model.neff": os.urandom(1 << 20) * 384}  # 384 MiB: long enough to be caught mid-copy
    publish_files(store, big, tmp_path)
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-m", "neffbuild", "pull", "t", "--store", str(store.root), "--cache-dir", str(cache)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not files_being_written(proc.pid, cache) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert files_being_written(proc.pid, cache), "the pull finished before it could be killed mid-copy"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p for p in cache.rglob("*") if p.is_file() and STATE_DIR not in p.parts] == []
    report = pull(store, "t", cache)
    assert report.files_fetched == 1
    assert hash_file(cache / "big/model.neff").hex == hash_bytes(big["big/model.neff"])
    assert incomplete_files(cache) == []


def test_temp_files_of_killed_pulls_are_removed(tmp_path: Path) -> None:
    """Where unnamed files are not available, a killed pull leaves named `*.incomplete` files."""
    cache = tmp_path / "cache"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    stale = cache / "a" / f".x.so.{dead.stdout.strip()}.0123456789{INCOMPLETE_SUFFIX}"
    ours = cache / "a" / f".y.so.{os.getpid()}.0123456789{INCOMPLETE_SUFFIX}"  # a live pull's: kept
    for path in (stale, ours):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
    assert remove_stale_temp_files(cache) == 1
    assert not stale.exists() and ours.exists()


def test_unknown_tag_and_missing_store_have_distinct_exit_codes(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, FILES, tmp_path, tag="known")
    unknown = cli("pull", "nope", "--store", str(store.root), "--cache-dir", str(tmp_path / "c"))
    assert unknown.returncode == 8 and "tag 'nope' not found" in unknown.stderr and "known" in unknown.stderr
    missing = cli("pull", "t", "--store", str(tmp_path / "no-store"), "--cache-dir", str(tmp_path / "c"))
    assert missing.returncode == 3 and "no neffbuild store" in missing.stderr


def test_corrupt_release_document_is_rejected(store: LocalStore, tmp_path: Path, cli) -> None:
    release_id = publish_files(store, FILES, tmp_path)
    doc = store.root / "releases" / f"{release_id}.json"
    doc.chmod(0o644)
    doc.write_text(doc.read_text()[:-20])
    result = cli("pull", "t", "--store", str(store.root), "--cache-dir", str(tmp_path / "c"))
    assert result.returncode == 4 and f"releases/{release_id}.json: not valid JSON" in result.stderr


@pytest.mark.parametrize("damage", ["truncate", "reencode", "remove"])
def test_the_installed_release_stands_in_only_for_the_very_bytes_of_its_store_document(
    store: LocalStore, tmp_path: Path, cli, damage: str
) -> None:
    """A no-op pull takes the release from the cache dir's state instead of parsing the store's
    document again, only while the store still holds that document byte for byte."""
    release_id = publish_files(store, FILES, tmp_path)
    cache = tmp_path / "c"
    assert pull(store, "t", cache).files_fetched == len(FILES)
    doc = store.root / "releases" / f"{release_id}.json"
    doc.chmod(0o644)
    if damage == "truncate":
        doc.write_text(doc.read_text()[:-20])
    elif damage == "reencode":  # the same document, other bytes: parsed and checked as before
        doc.write_text(json.dumps(json.loads(doc.read_text()), indent=1))
    else:
        doc.unlink()
    result = cli("pull", "t", "--store", str(store.root), "--cache-dir", str(cache))
    expected = {"truncate": 4, "reencode": 0, "remove": 8}[damage]
    assert result.returncode == expected, result.stderr


def test_a_release_cannot_write_outside_the_cache_dir(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, {"ok": b"x"}, tmp_path)
    evil = {
        "format": "neffbuild.release/1",
        "name": "evil",
        "manifest_digest": "0" * 32,
        "backend": "inductor",
        "cache_env": "TORCHINDUCTOR_CACHE_DIR",
        "env": {},
        "fingerprint": {},
        "units": [],
        "shared": [],
        "files": [{"path": "../escaped", "size": 1, "digest": hash_bytes(b"x")}],
    }
    data = json.dumps(evil, sort_keys=True, separators=(",", ":")).encode()
    release_id = hash_bytes(data)
    store.put_doc("releases", release_id, data)
    result = cli("pull", release_id, "--store", str(store.root), "--cache-dir", str(tmp_path / "c"))
    assert result.returncode == 4 and "unsafe path" in result.stderr
    assert not (tmp_path / "escaped").exists()


def test_release_document_must_match_its_name(store: LocalStore, tmp_path: Path) -> None:
    release_id = publish_files(store, FILES, tmp_path)
    doc = json.loads((store.root / "releases" / f"{release_id}.json").read_text())
    doc["env"]["EXTRA"] = "1"
    other = "f" * 32
    store.put_doc("releases", other, dump(parse(Release, json.dumps(doc).encode(), "test")))
    with pytest.raises(IntegrityError, match="does not match its name"):
        pull(store, other, tmp_path / "c")


@contextmanager
def tmpfs(mount_point: Path, options: str) -> Iterator[Path]:
    """A real tmpfs mounted at mount_point (made), unmounted after; skips where mount is refused."""
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 256 KiB filesystem (tmpfs), so a pull runs out of space for real."""
    with tmpfs(tmp_path / "tiny-disk", "size=256k") as mount_point:
        yield mount_point


def test_a_release_larger_than_the_free_space_is_refused_before_anything_is_written(
    store: LocalStore, tmp_path: Path, cli
) -> None:
    files = {"small.so": b"s" * 1000, "big/model.neff": os.urandom(3 << 20), "big/other.neff": os.urandom(2 << 20)}
    publish_files(store, files, tmp_path)
    with tmpfs(tmp_path / "disk", "size=4m") as disk:
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        result = pull_cli(cli, store, disk / "cache")
        assert result.returncode == 10, result.stderr
        line = result.stderr.splitlines()[0]
        assert (
            line.startswith(f"error: {disk}: pulling 3 files of t needs 5.")
            and f"only 4.0 MiB ({free} bytes) free" in line
        )
        assert "nothing was written" in result.stderr and "Traceback" not in result.stderr and result.stdout == ""
        assert os.listdir(disk) == []  # the cache dir was not even made
        # An existing cache dir holding part of the release: only the rest is needed, and it still does not fit.
        (disk / "cache" / "big").mkdir(parents=True)
        (disk / "cache" / "big" / "model.neff").write_bytes(files["big/model.neff"])
        before = snapshot(disk)
        result = pull_cli(cli, store, disk / "cache")
        assert result.returncode == 10 and f"error: {disk / 'cache'}: pulling 2 files of t needs 2." in result.stderr
        assert snapshot(disk) == before


def test_a_disk_that_fills_mid_pull_is_a_one_line_error_and_leaves_nothing_behind(
    store: LocalStore, tmp_path: Path, cli
) -> None:
    """The room check passes (bytes fit), then the filesystem runs out of inodes while files land."""
    files = {f"d{i:02d}/f{i:02d}.so": os.urandom(2000 + i) for i in range(30)}
    publish_files(store, files, tmp_path)
    with tmpfs(tmp_path / "inodes", "size=4m,nr_inodes=16") as disk:
        result = pull_cli(cli, store, disk / "cache", "--jobs", "1")
        assert result.returncode == 10, result.stderr
        assert "No space left on device" in result.stderr and "hint: free space" in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 2
        assert incomplete_files(disk) == []
        landed = [p for p in (disk / "cache").rglob("*.so")]
        assert 0 < len(landed) < len(files)
        assert all(p.read_bytes() == files[p.relative_to(disk / "cache").as_posix()] for p in landed)


# ---- a hostile cache dir: no symlink below --cache-dir is followed (issue 9) ----------------------

from tests.fs.test_confined import snapshot  # noqa: E402


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the cache dir that a pull must never touch."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "keep.txt").write_bytes(b"not the cache's")
    return path


def pull_cli(cli, store: LocalStore, cache: Path, *extra: str, ref: str = "t"):
    return cli("pull", ref, "--store", str(store.root), "--cache-dir", str(cache), *extra)


@pytest.mark.parametrize("link", ["relative", "absolute", "deeper"])
def test_a_release_path_through_a_symlinked_directory_is_refused(
    store: LocalStore, tmp_path: Path, outside: Path, cli, link: str
) -> None:
    publish_files(store, {"lnk/evil.bin": b"evil", "d/lnk/sub/evil.so": b"deeper", "ok.bin": b"ok"}, tmp_path)
    cache = tmp_path / "cache"
    if link == "deeper":
        (cache / "d").mkdir(parents=True)
        (cache / "d" / "lnk").symlink_to(outside)
        shown = cache / "d" / "lnk"
    else:
        cache.mkdir()
        (cache / "lnk").symlink_to("../outside" if link == "relative" else str(outside))
        shown = cache / "lnk"
    before = (snapshot(cache), snapshot(outside))
    result = pull_cli(cli, store, cache)
    assert result.returncode == 10, result.stderr
    assert f"error: {shown}: is a symbolic link" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""
    assert (snapshot(cache), snapshot(outside)) == before


def test_a_symlinked_state_dir_is_refused(store: LocalStore, tmp_path: Path, outside: Path, cli) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / STATE_DIR).symlink_to("../outside")
    before = (snapshot(cache), snapshot(outside))
    result = pull_cli(cli, store, cache)
    assert result.returncode == 10 and f"{cache / STATE_DIR}: is a symbolic link" in result.stderr
    assert (snapshot(cache), snapshot(outside)) == before


def test_symlinked_state_and_lock_files_are_never_written_through(
    store: LocalStore, tmp_path: Path, outside: Path, cli
) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    (cache / STATE_DIR).mkdir(parents=True)
    (cache / STATE_DIR / "state.json").symlink_to(outside / "keep.txt")
    before = snapshot(outside)
    assert pull_cli(cli, store, cache).returncode == 0
    assert not (cache / STATE_DIR / "state.json").is_symlink()  # replaced, not written through
    (cache / STATE_DIR / "pull.lock").unlink()
    (cache / STATE_DIR / "pull.lock").symlink_to(outside / "lock")
    (cache / sorted(FILES)[0]).unlink()
    result = pull_cli(cli, store, cache)
    assert result.returncode == 10 and f"{cache / STATE_DIR / 'pull.lock'}:" in result.stderr
    assert snapshot(outside) == before


def test_a_file_symlink_at_a_release_path_is_not_present_and_is_replaced(
    store: LocalStore, tmp_path: Path, outside: Path
) -> None:
    name = sorted(FILES)[0]
    publish_files(store, FILES, tmp_path)
    (outside / "same.so").write_bytes(FILES[name])  # the right content, but outside the cache dir
    cache = tmp_path / "cache"
    (cache / name).parent.mkdir(parents=True)
    (cache / name).symlink_to(outside / "same.so")
    pull(store, "t", cache)
    assert not (cache / name).is_symlink() and (cache / name).read_bytes() == FILES[name]
    assert (outside / "same.so").read_bytes() == FILES[name]
    before = snapshot(cache)
    assert pull(store, "t", cache).files_fetched == 0 and snapshot(cache) == before


def test_a_fifo_at_a_release_path_is_replaced_without_blocking(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, {"a/empty.so": b"", "b.so": b"b"}, tmp_path)  # a FIFO's size is 0 too
    cache = tmp_path / "cache"
    (cache / "a").mkdir(parents=True)
    os.mkfifo(cache / "a" / "empty.so")  # opening it to hash it would wait for a writer forever
    result = subprocess.run(
        [sys.executable, "-m", "neffbuild", "pull", "t", "--store", str(store.root), "--cache-dir", str(cache)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (cache / "a" / "empty.so").is_file() and (cache / "a" / "empty.so").read_bytes() == b""


def test_stale_temp_cleanup_follows_no_link(tmp_path: Path, outside: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    shape = f".x.so.{dead.stdout.strip()}.0123456789{INCOMPLETE_SUFFIX}"
    (outside / shape).write_bytes(b"someone else's")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "lnk").symlink_to(outside)
    (cache / "stale-link").mkdir()
    (cache / "stale-link" / shape).symlink_to(outside / shape)  # a link with the shape: not ours either
    assert remove_stale_temp_files(cache) == 0
    assert (outside / shape).read_bytes() == b"someone else's" and (cache / "stale-link" / shape).is_symlink()


@pytest.mark.parametrize(
    "paths",
    [
        [(".neffbuild/state.json", b"x")],
        [(".neffbuild/pull.lock", b"x")],
        [(f"a/.b.so.{os.getpid()}.0123456789{INCOMPLETE_SUFFIX}", b"x")],
        [("a.so", b"x"), ("a.so", b"y")],
        [("a", b"x"), ("a/b", b"y")],
        [("Kernel.so", b"x"), ("kernel.so", b"y")],
    ],
)
def test_a_release_whose_paths_never_settle_is_refused(store: LocalStore, tmp_path: Path, cli, paths: list) -> None:
    publish_files(store, {"ok.so": b"ok"}, tmp_path)
    raw = json.loads(store.get_doc("releases", next(iter(store.list_docs("releases")))))
    for _, data in paths:  # the blobs are there: only the file list is at fault
        (tmp_path / "blob").write_bytes(data)
        store.put_blob(hash_bytes(data), tmp_path / "blob")
    raw["files"] = [{"path": rel, "size": len(data), "digest": hash_bytes(data)} for rel, data in paths]
    data = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    store.put_doc("releases", hash_bytes(data), data)
    cache = tmp_path / "cache"
    result = pull_cli(cli, store, cache, ref=hash_bytes(data))
    assert result.returncode == 4 and "invalid Release at files" in result.stderr and "Traceback" not in result.stderr
    assert not cache.exists()


# ---- a no-op pull writes nothing (issue 9) ------------------------------------------------------


def test_a_no_op_pull_leaves_the_cache_dir_untouched(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    assert pull_cli(cli, store, cache).returncode == 0
    before = snapshot(cache)
    state_inode = (cache / STATE_DIR / "state.json").stat().st_ino
    assert pull_cli(cli, store, cache).returncode == 0
    assert snapshot(cache) == before and (cache / STATE_DIR / "state.json").stat().st_ino == state_inode


def test_a_complete_cache_on_a_full_disk_still_pulls(store: LocalStore, tmp_path: Path, tiny_disk: Path, cli) -> None:
    publish_files(store, {"a/small.so": b"s" * 1000, "b/other.so": os.urandom(20_000)}, tmp_path)
    cache = tiny_disk / "cache"
    assert pull_cli(cli, store, cache).returncode == 0
    filler = os.open(tiny_disk / "filler", os.O_WRONLY | os.O_CREAT)
    with pytest.raises(OSError, match="No space left"):  # fill the filesystem to the last byte
        while True:
            os.write(filler, b"\0" * 4096)
    os.close(filler)
    before = snapshot(cache)
    result = pull_cli(cli, store, cache)
    assert result.returncode == 0, result.stderr
    assert snapshot(cache) == before


# ---- fuzz: a broken state file only costs re-hashing (issue 9, scope 8) --------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from neffbuild.host.state import parse_state  # noqa: E402

_state_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | st.just("files"), inner, max_size=4)
    ),
    max_leaves=10,
)
_state_entry = st.lists(st.integers() | st.text(max_size=4) | st.booleans() | st.none(), max_size=4)


@settings(max_examples=2_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=100) | _state_json.map(lambda v: json.dumps(v).encode())
       | st.dictionaries(st.text(max_size=6), _state_entry | _state_json, max_size=5).map(lambda f: json.dumps({"files": f}).encode())
       | st.integers(1, 5_000).map(lambda depth: b'{"files": ' + b"[" * depth + b"]" * depth + b"}"))  # fmt: skip
def test_fuzz_the_state_loader_never_fails(raw: bytes) -> None:
    # The deep inputs recurse to the limit: a garbage collection there would run other tests'
    # leftovers' finalizers at that depth, whose RecursionError is "unraisable" (pytest fails the
    # test on it, and could not even format it). Collections wait until the stack is shallow.
    gc.disable()
    try:
        state = parse_state(raw)
    finally:
        gc.enable()
    assert all(
        type(size) is int and type(mtime) is int and isinstance(digest, str)
        for size, mtime, digest in state.files.values()
    )


def test_a_broken_state_file_costs_only_a_re_hash(store: LocalStore, tmp_path: Path) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    for broken in (b"", b"null", b"[" * 100_000, b'{"files": {"x": [1, 2]}}', b'{"files": []}', b"\xff\xfe"):
        (cache / STATE_DIR / "state.json").write_bytes(broken)
        assert pull(store, "t", cache).files_fetched == 0
        assert recorded_files(json.loads((cache / STATE_DIR / "state.json").read_bytes())).keys() == FILES.keys()


# ---- the cache dir's state, version 2: which release is installed, and how (issue 11) ------------

from neffbuild.documents.records import to_json  # noqa: E402
from neffbuild.host.state import STATE_FORMAT  # noqa: E402
from tests.statekit import as_v2, recorded_files, unit_paths  # noqa: E402


def read_state_doc(cache: Path) -> dict:
    return json.loads((cache / STATE_DIR / "state.json").read_bytes())


def test_the_state_records_the_installed_release_and_how(store: LocalStore, tmp_path: Path) -> None:
    release_id = publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    report = pull(store, "t", cache)
    doc = read_state_doc(cache)
    installed = doc["installed"]
    assert doc["format"] == STATE_FORMAT == "neffbuild.cache-state/4"
    assert (installed["release_id"], installed["tag"], installed["store"]) == (release_id, "t", str(store.root))
    stored = parse(Release, store.get_doc("releases", release_id), "r")
    assert installed["release"] == json.loads(json.dumps(to_json(stored)))  # the document itself
    assert (
        installed["exports"]
        == dict(report.exports)
        == {"TORCHINDUCTOR_CACHE_DIR": str(cache.resolve()), "OMP_NUM_THREADS": "2"}
    )
    assert installed["installed_at"].endswith("+00:00")
    [unit] = installed["units"]
    assert (unit["unit_id"], sorted(unit_paths(doc, unit))) == ("m/1x1x1", sorted(FILES))
    assert all(type(p) is int for p in unit["paths"])  # each path once: the units name the release's files
    assert recorded_files(doc).keys() == FILES.keys() and "files" not in doc
    assert [m is not None for m in doc["mtimes"]] == [True] * len(FILES)


def test_a_no_op_pull_keeps_the_install_time_and_a_new_release_records_its_own(
    store: LocalStore, tmp_path: Path
) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    first = (cache / STATE_DIR / "state.json").read_bytes()
    time.sleep(1.1)  # install times have one-second resolution
    pull(store, "t", cache)
    assert (cache / STATE_DIR / "state.json").read_bytes() == first
    other = publish_files(store, {"x.so": b"x"}, tmp_path)
    pull(store, "t", cache)
    installed = read_state_doc(cache)["installed"]
    assert (
        installed["release_id"] == other and installed["installed_at"] > json.loads(first)["installed"]["installed_at"]
    )


def test_a_state_recording_a_file_the_release_lacks_is_rewritten_without_it(store: LocalStore, tmp_path: Path) -> None:
    """Every file found as recorded, yet the table holds one more: not what this pull records."""
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    doc = as_v2(read_state_doc(cache))  # format /4 cannot record a file its release lacks; /2 could
    recorded = dict(doc["files"])
    doc["files"] = {**recorded, "zz/gone.so": next(iter(recorded.values()))}
    (cache / STATE_DIR / "state.json").write_text(json.dumps(doc))
    report = pull(store, "t", cache)
    assert report.files_fetched == 0 and report.files_rehashed == 0
    assert recorded_files(read_state_doc(cache)) == recorded


def test_env_reads_the_installed_release_without_the_store_even_after_the_tag_moved(
    store: LocalStore, tmp_path: Path, cli
) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    assert pull_cli(cli, store, cache).returncode == 0
    publish_files(store, {"x.so": b"x"}, tmp_path, env={"OMP_NUM_THREADS": "64"})  # the tag moves on
    gone = tmp_path / "no-store-here"
    for args in ((), ("t",)):
        result = cli("env", *args, "--cache-dir", str(cache), "--store", str(gone))
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"export TORCHINDUCTOR_CACHE_DIR={cache}\nexport OMP_NUM_THREADS=2\n"
    # A cache dir never pulled into: REF is resolved in the store, as before state version 2.
    other = cli("env", "t", "--cache-dir", str(tmp_path / "fresh"), "--store", str(store.root))
    assert other.returncode == 0 and "OMP_NUM_THREADS=64" in other.stdout
    # Another tag is resolved in the store: accepted if it names the installed release, else refused.
    move_tag(store, "next", read_state_doc(cache)["installed"]["release_id"])
    same = cli("env", "next", "--cache-dir", str(cache), "--store", str(store.root))
    assert same.returncode == 0 and "OMP_NUM_THREADS=2" in same.stdout  # another name for the installed release
    move_tag(store, "next", json.loads((store.root / "tags" / "t.json").read_text())["release"])
    moved = cli("env", "next", "--cache-dir", str(cache), "--store", str(store.root))
    assert moved.returncode == 8 and "holds release" in moved.stderr


def test_env_of_a_cache_dir_without_a_recorded_release_says_what_to_do(tmp_path: Path, cli) -> None:
    result = cli("env", "--cache-dir", str(tmp_path / "empty"))
    assert (
        result.returncode == 8 and "no installed release recorded" in result.stderr and "hint: pull it" in result.stderr
    )
    assert not (tmp_path / "empty").exists()


def test_a_version_1_state_is_read_and_replaced_once(store: LocalStore, tmp_path: Path, cli) -> None:
    """A cache dir pulled by neffbuild before state version 2: its hashes still serve, its
    release id still tells a moved tag apart; the first pull rewrites the state, then never again."""
    release_id = publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    v1 = {"release": release_id, "tag": "t", "files": recorded_files(read_state_doc(cache))}
    (cache / STATE_DIR / "state.json").write_text(json.dumps(v1))
    assert cli("env", "--cache-dir", str(cache)).returncode == 8  # release document unknown
    legacy = cli("env", "t", "--cache-dir", str(cache), "--store", str(store.root))
    assert legacy.returncode == 0 and "OMP_NUM_THREADS=2" in legacy.stdout
    publish_files(store, {"x.so": b"x"}, tmp_path)  # the tag moves on
    assert cli("env", "t", "--cache-dir", str(cache), "--store", str(store.root)).returncode == 8
    assert pull(store, release_id, cache).files_fetched == 0  # no re-hash needed either: v1 entries serve
    assert read_state_doc(cache)["format"] == STATE_FORMAT
    before = snapshot(cache)
    assert pull(store, release_id, cache).files_fetched == 0
    assert snapshot(cache) == before


def test_a_state_whose_release_was_edited_is_corrupt_until_a_pull_rewrites_it(
    store: LocalStore, tmp_path: Path, cli
) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    doc = read_state_doc(cache)
    doc["installed"]["release"]["env"] = {"OMP_NUM_THREADS": "1"}  # no longer its release id's document
    (cache / STATE_DIR / "state.json").write_text(json.dumps(doc))
    result = cli("env", "--cache-dir", str(cache))
    assert result.returncode == 13 and result.stdout == ""
    assert (
        f"{cache.resolve()}/.neffbuild/state.json: installed.release does not hash to installed.release_id"
        in result.stderr
    )
    state = parse_state((cache / STATE_DIR / "state.json").read_bytes())
    assert state.problem and state.installed is None and state.files == {}  # nothing of it is believed
    repaired = pull(store, "t", cache)
    assert (
        repaired.files_fetched == 0
        and repaired.files_rehashed == len(FILES)
        and repaired.state_replaced == state.problem
    )
    assert cli("env", "--cache-dir", str(cache)).returncode == 0


def test_a_no_op_pull_trusts_only_the_release_it_recorded_as_the_store_serves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: a state holding the release byte for byte as the store serves it under the tag is
    not decoded entry by entry again; a tampered one (its id recomputed) is, and is replaced."""
    import neffbuild.host.state as state_module

    store = LocalStore(tmp_path / "store", create=True)
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    state_file = cache / STATE_DIR / "state.json"
    clean = state_file.read_bytes()
    decoded: list[type] = []
    decode = state_module.decode_doc
    monkeypatch.setattr(state_module, "decode_doc", lambda kind, *a, **k: decoded.append(kind) or decode(kind, *a, **k))
    again = pull(store, "t", cache)
    assert again.files_fetched == 0 and again.files_rehashed == 0 and again.state_replaced is None
    assert Release not in decoded and state_file.read_bytes() == clean

    doc = json.loads(clean)
    doc["installed"]["release"]["files"][0]["path"] = "../escape.so"
    doc["installed"]["release_id"] = hash_bytes(canonical_json(doc["installed"]["release"]))
    state_file.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")))
    repaired = pull(store, "t", cache)
    assert repaired.state_replaced is not None and "unsafe path" in repaired.state_replaced
    assert Release in decoded and repaired.files_fetched == 0 and repaired.files_rehashed == len(FILES)
    fresh, before = parse_state(state_file.read_bytes()), parse_state(clean)
    assert fresh.installed is not None and before.installed is not None and fresh.problem is None
    assert fresh.installed.release == before.installed.release and fresh.files.keys() == before.files.keys()
    assert not (tmp_path / "escape.so").exists()

    # The release intact but the state corrupt elsewhere: it vouches for nothing, the store's
    # bytes are parsed strictly.
    import neffbuild.documents.refs as refs_module

    checked: list[type] = []
    check = refs_module.checked_doc
    monkeypatch.setattr(refs_module, "checked_doc", lambda kind, *a: checked.append(kind) or check(kind, *a))
    doc = json.loads(state_file.read_bytes())
    doc["installed"]["exports"]["1BAD"] = "x"
    state_file.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")))
    repaired = pull(store, "t", cache)
    assert repaired.state_replaced is not None and "installed.exports" in repaired.state_replaced
    assert Release in checked and repaired.files_fetched == 0


# ---- preflight: the host is compared with the release before any byte moves (issue 11) -----------

from tests.host.test_status import publish_units, without_flag  # noqa: E402


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    if request.param == "s3":
        return request.getfixturevalue("s3_url"), request.getfixturevalue("s3_env")
    return str(tmp_path / "store"), {}


def test_a_breaking_mismatch_refuses_the_pull_before_anything_is_written(any_store, tmp_path: Path, cli) -> None:
    url, env = any_store
    from neffbuild.store import open_store

    store = open_store(url, create=True, env=env)
    publish_units(store, tmp_path / "src", tag="prod", edit=lambda fp: {**fp, "cpu.isa": fp["cpu.isa"] + ",avx10_9"})
    cache = tmp_path / "cache"
    refused = cli("pull", "prod", "--store", url, "--cache-dir", str(cache), env=env)
    assert refused.returncode == 7, refused.stderr
    assert (
        "2 of 2 units of prod would not hit on this host: cpu.isa: build has avx10_9, this host lacks it"
        in refused.stderr
    )
    assert "--no-host-check" in refused.stderr and refused.stdout == ""
    assert not cache.exists()  # nothing made, not even the directory
    cache.mkdir()
    (cache / "keep.txt").write_text("mine")
    before = snapshot(cache)
    assert cli("pull", "prod", "--store", url, "--cache-dir", str(cache), "--json", env=env).returncode == 7
    assert snapshot(cache) == before  # byte-identical: no file, no state, no lock
    forced = cli("pull", "prod", "--store", url, "--cache-dir", str(cache), "--no-host-check", "--json", env=env)
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["host_checked"] is False and (cache / "a/k1.so").exists()


def test_under_aten_cpu_capability_default_pull_exits_7_naming_it(tmp_path: Path, cli) -> None:
    from neffbuild.store import open_store

    url = str(tmp_path / "store")
    publish_units(open_store(url, create=True, env={}), tmp_path / "src", tag="prod", edit=without_flag)
    cache = tmp_path / "cache"
    result = cli("pull", "prod", "--store", url, "--cache-dir", str(cache), env={"ATEN_CPU_CAPABILITY": "default"})
    assert (
        result.returncode == 7
        and "env.ATEN_CPU_CAPABILITY: this host sets 'default', the build did not" in result.stderr
    )
    assert not cache.exists()


# ---- concurrency on one host: the lock times out, a dead holder never blocks (issue 12, item 5) --

_HOLD_LOCK = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_held_lock_times_out_and_a_killed_holders_lock_does_not_block(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    (cache / STATE_DIR).mkdir(parents=True)
    lock = cache / STATE_DIR / "pull.lock"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(lock)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        started = time.monotonic()
        result = pull_cli(cli, store, cache, "--lock-timeout", "1")
        took = time.monotonic() - started
        assert result.returncode == 9, result.stderr
        assert f"error: {lock}: pull lock still held by another process after 1 s" in result.stderr
        assert "--lock-timeout" in result.stderr and "Traceback" not in result.stderr
        # It gave up on its 1 s, not the default 300 s: a bound far from both, whatever the load
        # (4 s, the interpreter's start included, failed at a load average of 51).
        assert 1.0 <= took < 60, took
        assert not (cache / "fxgraph").exists()
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the kernel drops the lock
        holder.wait()
    result = pull_cli(cli, store, cache, "--lock-timeout", "0")
    assert result.returncode == 0, result.stderr
    assert all((cache / rel).read_bytes() == data for rel, data in FILES.items())


def test_concurrent_pulls_into_one_cache_dir_all_succeed_and_fetch_each_file_once(
    store: LocalStore, tmp_path: Path
) -> None:
    files = FILES | {"big/model.neff": os.urandom(16 << 20)}
    publish_files(store, files, tmp_path)
    cache = tmp_path / "cache"
    args = ["pull", "t", "--store", str(store.root), "--cache-dir", str(cache), "--json"]
    procs = [
        subprocess.Popen([sys.executable, "-m", "neffbuild", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err.decode() for _, err in outs]
    reports = [json.loads(out) for out, _ in outs]
    assert sum(r["files_fetched"] for r in reports) == len(files)  # the lock worked: each file once
    assert all((cache / rel).read_bytes() == data for rel, data in files.items())
    assert incomplete_files(cache) == []
    assert read_state_doc(cache)["installed"]["release_id"] == reports[0]["release_id"]
    assert pull(store, "t", cache).files_fetched == 0


def test_short_of_room_while_another_pull_holds_the_lock_waits_for_what_it_lands(
    store: LocalStore, tmp_path: Path
) -> None:
    """Another pull's in-flight bytes fill the disk: the room check fails, but the files that pull
    is landing are not ours to fetch. Waiting for its lock, then looking again, succeeds."""
    files = {"big/model.neff": os.urandom(5 << 19), "small.so": b"s" * 100}  # 2.5 MiB
    publish_files(store, files, tmp_path)
    with tmpfs(tmp_path / "disk", "size=4m") as disk:
        cache = disk / "cache"
        (cache / STATE_DIR).mkdir(parents=True)
        (cache / "big").mkdir()
        inflight = cache / "big" / "inflight"  # the other pull's temp file, written, not yet named
        inflight.write_bytes(files["big/model.neff"])
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLD_LOCK, str(cache / STATE_DIR / "pull.lock")], stdout=subprocess.PIPE
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
            args = [
                "pull",
                "t",
                "--store",
                str(store.root),
                "--cache-dir",
                str(cache),
                "--json",
                "--lock-timeout",
                "60",
            ]
            waiting = subprocess.Popen(
                [sys.executable, "-m", "neffbuild", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            lock = str(cache / STATE_DIR / "pull.lock")

            def opened_the_lock() -> bool:
                assert waiting.poll() is None, waiting.communicate()
                return any(
                    os.readlink(fd) == lock for fd in Path(f"/proc/{waiting.pid}/fd").iterdir() if fd.is_symlink()
                )

            assert wait_for(opened_the_lock, 30)
            inflight.rename(cache / "big" / "model.neff")  # the other pull lands its file...
        finally:
            holder.send_signal(signal.SIGKILL)  # ...and ends
            holder.wait()
        out, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, err.decode()
        assert json.loads(out)["files_fetched"] == 1  # only small.so
        assert all((cache / rel).read_bytes() == data for rel, data in files.items())


# ---- observability: --json says what moved, and how it failed (issue 12, item 11) ---------------


def test_pull_json_reports_what_moved_and_a_journal_gets_plain_lines(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, FILES, tmp_path)
    cache = tmp_path / "cache"
    first = pull_cli(cli, store, cache, "--json")
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    total = sum(len(b) for b in FILES.values())
    assert (doc["files_fetched"], doc["files_skipped"], doc["bytes_fetched"], doc["bytes_skipped"]) == (
        len(FILES),
        0,
        total,
        0,
    )
    assert (
        doc["stale"] is False
        and doc["seconds"] > 0
        and doc["mb_per_s"] == pytest.approx(total / doc["seconds"] / 1e6, abs=1e-3)
    )

    (cache / "00/c0000.so").unlink()
    again = json.loads(pull_cli(cli, store, cache, "--json").stdout)
    assert (again["files_fetched"], again["files_skipped"]) == (1, len(FILES) - 1)
    assert (again["bytes_fetched"], again["bytes_skipped"]) == (1000, total - 1000)

    (cache / "00/c0000.so").unlink()
    plain = pull_cli(cli, store, cache)  # stderr is a pipe here, as under systemd's journal
    assert len(plain.stderr.splitlines()) == 1 and plain.stderr.startswith("pulled t: 1 of 41 files fetched")
    assert "\r" not in plain.stderr and "\x1b" not in plain.stderr  # no bar, no colour


def test_a_failed_pull_with_json_prints_the_failure_as_a_document(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, FILES, tmp_path)
    failed = pull_cli(cli, store, tmp_path / "cache", "--json", ref="nope")
    assert failed.returncode == 8
    doc = json.loads(failed.stdout)
    assert doc["kind"] == "NotFoundError" and doc["exit_code"] == 8 and "nope" in doc["error"] and doc["hint"]
    assert f"error: {doc['error']}" in failed.stderr  # the journal keeps its line
    gone = cli("pull", "t", "--store", str(tmp_path / "no-store"), "--cache-dir", str(tmp_path / "cache"), "--json")
    assert gone.returncode == 3 and json.loads(gone.stdout)["kind"] == "StoreError"


@pytest.mark.parametrize("direct_writes", [True, False])
def test_large_files_pulled_from_s3_land_the_same_bytes_with_or_without_o_direct(
    s3_url: str, s3_env: dict[str, str], tmp_path: Path, direct_writes: bool
) -> None:
    from neffbuild.fs.confined import DIRECT_MIN
    from neffbuild.store import open_store
    from tests.pagecache import direct_io_possible, resident_fraction

    files = {"neff/big.neff": os.urandom(DIRECT_MIN + (3 << 20) + 7), "small.py": b"x = 1\n"}
    store = open_store(s3_url, create=True, env=s3_env)
    publish_files(store, files, tmp_path)
    cache = tmp_path / "cache"
    report = pull(store, "t", cache, direct_writes=direct_writes)
    assert report.files_fetched == 2
    resident = resident_fraction(
        cache / "neff/big.neff"
    )  # before reading it: S3's aligned buffers can go straight to the device
    assert all((cache / rel).read_bytes() == data for rel, data in files.items())
    if not direct_writes:
        assert resident > 0.9  # the server's first load reads memory
    elif direct_io_possible(tmp_path):
        assert resident < 0.5  # all but an unaligned tail went around the page cache


def test_large_files_pulled_into_tmpfs_come_as_ranges_read_back_from_the_file(
    s3_url: str, s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On tmpfs O_DIRECT keeps nothing out of memory: large blobs land buffered, as ranges read
    back from the file to be hashed (store/s3/ranged.py's read_back), byte for byte."""
    import shutil
    import tempfile

    from neffbuild.fs.disk import in_memory
    from neffbuild.store import open_store
    from neffbuild.store.s3 import ranged

    if not in_memory(Path("/dev/shm")):
        pytest.skip("no tmpfs at /dev/shm")
    cache = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="neffbuild-test-"))
    try:
        files = {"neff/big.neff": os.urandom(ranged.RANGED_MIN + 7), "small.py": b"x = 1\n"}
        store = open_store(s3_url, create=True, env=s3_env)
        publish_files(store, files, tmp_path)
        read_back, placed = [], []
        real = ranged.read_back
        monkeypatch.setattr(ranged, "read_back", lambda *a: read_back.append(a[2]) or real(*a))
        monkeypatch.setattr(ranged, "placed", lambda *a: placed.append(a[2]))
        report = pull(store, "t", cache / "c")
        assert report.files_fetched == 2 and not placed
        assert [t.dest.name for t in read_back] == ["big.neff"] and not read_back[0].direct
        assert all((cache / "c" / rel).read_bytes() == data for rel, data in files.items())
    finally:
        shutil.rmtree(cache)


def test_a_corrupt_blob_says_what_the_other_files_left_behind(store: LocalStore, tmp_path: Path, cli) -> None:
    """The files of a release land in parallel: when one blob is corrupt, the others that
    verified are already in the cache dir. The hint says how many, never "nothing was written"."""
    from tests.storekit import corrupt_blob

    files = {f"f/{i:02d}.so": os.urandom(2000 + i) for i in range(48)}
    publish_files(store, files, tmp_path)
    corrupt_blob(store, hash_bytes(files["f/47.so"]))
    cache = tmp_path / "cache"
    result = pull_cli(cli, store, cache, "--jobs", "4")
    assert result.returncode == 4, result.stderr
    landed = [p for p in cache.rglob("*.so") if p.is_file()]
    assert "nothing was written" not in result.stderr
    assert f"{len(landed)} other of the 48 files this pull fetched landed in {cache}" in result.stderr
    assert all(p.read_bytes() == files[p.relative_to(cache).as_posix()] for p in landed)
    assert not (cache / ".neffbuild" / "state.json").exists()
