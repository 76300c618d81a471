"""Pull: only missing files move, every byte is verified, nothing lands half-written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neffbuild.bundle import (
    BundleRecord,
    FileEntry,
    Release,
    ReleaseUnit,
    Timings,
    dump,
    parse,
)
from neffbuild.errors import IntegrityError
from neffbuild.hashing import hash_bytes, hash_file
from neffbuild.materialize import INCOMPLETE_SUFFIX
from neffbuild.publish import move_tag, publish_bundle, publish_release
from neffbuild.pull import STATE_DIR, pull, remove_stale_temp_files
from neffbuild.store.base import BlobSource, blob_key
from neffbuild.store.local import LocalStore


def publish_files(store: LocalStore, files: dict[str, bytes], tmp: Path, tag: str = "t") -> str:
    """Publish a one-bundle release of these files through the real publish path."""
    src = tmp / f"src-{hash_bytes(json.dumps(sorted(files)).encode())[:8]}"
    sources, entries = [], []
    for rel, data in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        digest = hash_file(path)
        sources.append(BlobSource(digest.hex, digest.size, path))
        entries.append(FileEntry(path=rel, size=digest.size, digest=digest.hex))
    key = hash_bytes(repr(sorted(files.items())).encode())
    record = BundleRecord(
        key=key, unit_id="m/1x1x1", unit={}, backend="inductor", fingerprint={}, files=tuple(entries),
        counters={}, timings=Timings(), created_at="2026-01-01T00:00:00+00:00", neffbuild_version="test",
    )
    publish_bundle(store, record, sources, jobs=2)
    release = Release(
        name=tag, manifest_digest="0" * 32, backend="inductor", cache_env="TORCHINDUCTOR_CACHE_DIR",
        env={"OMP_NUM_THREADS": "2"}, fingerprint={}, units=(ReleaseUnit(unit_id="m/1x1x1", key=key),),
        files=tuple(sorted(entries, key=lambda e: e.path)),
    )
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
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
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


def test_a_release_cannot_write_outside_the_cache_dir(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, {"ok": b"x"}, tmp_path)
    evil = {
        "format": "neffbuild.release/1", "name": "evil", "manifest_digest": "0" * 32, "backend": "inductor",
        "cache_env": "TORCHINDUCTOR_CACHE_DIR", "env": {}, "fingerprint": {}, "units": [], "shared": [],
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


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A real 256 KiB filesystem (tmpfs), so a pull runs out of space for real."""
    mount_point = tmp_path / "tiny-disk"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_full_disk_is_a_one_line_error_and_leaves_nothing_behind(store: LocalStore, tmp_path: Path, tiny_disk: Path, cli) -> None:
    publish_files(store, {"small": b"s" * 1000, "big/model.neff": os.urandom(1 << 20)}, tmp_path)
    result = cli("pull", "t", "--store", str(store.root), "--cache-dir", str(tiny_disk / "cache"), "--jobs", "1")
    assert result.returncode == 10, result.stderr
    assert "No space left on device" in result.stderr and "model.neff" in result.stderr
    assert "hint: free space" in result.stderr and "Traceback" not in result.stderr
    assert not (tiny_disk / "cache" / "big" / "model.neff").exists()
    assert incomplete_files(tiny_disk) == []
