"""Each fault is reported as what it is, produced for real: a flush the device fails, a store file
this process may not read, a unit whose failure cannot even keep its log, a unit whose scratch dir
is removed while its worker runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from neffbuild.store import open_store
from neffbuild.store.base import MARKER, blob_key
from tests.build.test_compile import damaged_model, start_build  # noqa: F401  (damaged_model: a fixture)
from tests.conftest import write_manifest
from tests.procs import started_by, wait_for, without_override
from tests.storekit import publish_release_of, write_files


def cli_without_override(*args: str) -> subprocess.CompletedProcess[str]:
    """`neffbuild ARGS` subject to file permissions, as a user would meet them."""
    return without_override([sys.executable, "-m", "neffbuild", *args])


@pytest.fixture
def store_with_release(tmp_path: Path) -> tuple[Path, str]:
    store = open_store(str(tmp_path / "store"), create=True)
    sources = write_files(tmp_path / "src", {"a.bin": 3000, "b.bin": 5000})
    return Path(store.url), publish_release_of(store, tmp_path / "src", sources, tag="t")


def test_an_unreadable_store_blob_is_a_store_error(store_with_release: tuple[Path, str], tmp_path: Path) -> None:
    root, _release_id = store_with_release
    blob = next((root / "blobs").glob("*/*"))
    blob.chmod(0o000)
    result = cli_without_override("pull", "t", "--store", str(root), "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 3, result.stderr
    assert f"error: {root}/{blob_key(blob.name)}: cannot read it (Permission denied)" in result.stderr
    assert "hint: check the store's permissions" in result.stderr and "free space" not in result.stderr


def test_an_unreadable_marker_is_a_store_error(store_with_release: tuple[Path, str], tmp_path: Path) -> None:
    root, _ = store_with_release
    (root / MARKER).chmod(0o000)
    result = cli_without_override("pull", "t", "--store", str(root), "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 3, result.stderr
    assert f"error: {root / MARKER}: cannot read it (Permission denied)" in result.stderr
    assert "internal error" not in result.stderr and not (tmp_path / "cache").exists()


def test_an_unlistable_releases_dir_is_a_store_error(store_with_release: tuple[Path, str], tmp_path: Path) -> None:
    root, release_id = store_with_release
    (root / "releases").chmod(0o300)  # enterable, not listable: a lookup by prefix must list it
    result = cli_without_override("pull", release_id[:8], "--store", str(root), "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 3, result.stderr
    assert f"error: {root / 'releases'}: cannot list it (Permission denied)" in result.stderr


# -- a flush the device fails: an ext4 image on a loop device whose backing file cannot grow ------


@pytest.fixture
def failing_disk(tmp_path: Path) -> Iterator[Path]:
    """A mounted filesystem that takes writes into memory and fails them when flushed: ext4 on a
    64 MiB sparse image that lives on a 6 MiB tmpfs (the loop device gets EIO past 6 MiB)."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("losetup", "mkfs.ext4", "mount", "umount")):
        pytest.skip("needs root, losetup and mkfs.ext4 to build a failing disk")
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    undo: list[list[str]] = []

    def run(*cmd: str) -> str:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot build a failing disk here: {' '.join(cmd)}: {done.stderr.strip()}")
        return done.stdout.strip()

    try:
        run("mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(backing))
        undo.append(["umount", str(backing)])
        image = backing / "img"
        with image.open("wb") as f:
            f.truncate(64 << 20)  # sparse: the tmpfs holds only what is written
        loop = run("losetup", "-f", "--show", str(image))
        undo.append(["losetup", "-d", loop])
        # No journal, errors=continue: a write-back that fails before the pull flushes (the
        # kernel's own flusher, under load) must not turn the filesystem read-only under it.
        run("mkfs.ext4", "-q", "-O", "^has_journal", "-E", "lazy_itable_init=1", loop)
        run("mount", "-o", "errors=continue", loop, str(mnt))
        undo.append(["umount", str(mnt)])
        yield mnt
    finally:
        for cmd in reversed(undo):
            subprocess.run(cmd, capture_output=True, check=False)


def test_a_failed_flush_after_a_pull_is_a_disk_error_and_records_nothing(failing_disk: Path, tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"), create=True)
    # 24 MiB in files under 8 MiB (written through the page cache, so their writes succeed)
    sources = write_files(tmp_path / "src", {f"f{i:02d}.bin": 1 << 20 for i in range(24)})
    publish_release_of(store, tmp_path / "src", sources, tag="t")
    cache = failing_disk / "cache"
    result = subprocess.run(
        [sys.executable, "-m", "neffbuild", "pull", "t", "--store", store.url, "--cache-dir", str(cache)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 10, result.stderr
    # The loop device's backing tmpfs fills up: the kernel reports the lost writeback as EIO or,
    # depending on when it notices, ENOSPC. Either way the flush failed and must be said.
    assert re.search(
        rf"error: {re.escape(str(cache))}: flushing its filesystem to disk failed: (Input/output error|No space left on device)\n",
        result.stderr,
    )
    assert "hint: the device reported a write error" in result.stderr
    assert not (cache / ".neffbuild" / "state.json").exists()  # nothing claims the files are durable


def test_files_a_pull_only_rehashes_are_flushed_before_the_state_vouches_for_them(
    failing_disk: Path, tmp_path: Path
) -> None:
    """As after a pull killed before its flush: the files are in place, in the page cache only.
    The next pull fetches nothing, but must flush them before recording them (here it fails)."""
    store = open_store(str(tmp_path / "store"), create=True)
    sources = write_files(tmp_path / "src", {f"f{i:02d}.bin": 1 << 20 for i in range(24)})
    publish_release_of(store, tmp_path / "src", sources, tag="t")
    cache = failing_disk / "cache"
    shutil.copytree(tmp_path / "src", cache)  # 24 MiB, dirty: the device takes only 6 MiB
    result = subprocess.run(
        [sys.executable, "-m", "neffbuild", "pull", "t", "--store", store.url, "--cache-dir", str(cache), "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 10, result.stderr
    # Mostly the flush fails. Under load the kernel's flusher may lose the copy's pages first; then
    # the full device refuses the state itself. Either way nothing vouches for the files.
    flush_failed = f"error: {cache}: flushing its filesystem to disk failed" in result.stderr
    assert flush_failed or f"error: {cache}/.neffbuild/state.json: No space left on device" in result.stderr, (
        result.stderr
    )
    assert not (cache / ".neffbuild" / "state.json").exists()


# -- a unit's own OSError is that unit's failure -------------------------------------------------


def test_a_unit_whose_log_cannot_be_kept_fails_alone_not_the_build(damaged_model: Path, tmp_path: Path, cli) -> None:  # noqa: F811
    manifest = write_manifest(tmp_path / "m.toml", damaged_model, widths=(128,))
    work = tmp_path / "work"
    work.mkdir()
    (work / "logs").write_text("a file where the logs dir goes")
    result = cli("build", str(manifest), "--store", str(tmp_path / "store"), "--work-dir", str(work), "--json")
    assert result.returncode == 5, result.stderr
    assert "internal error" not in result.stderr
    assert "1 of 1 units failed; first: klein/128x128x1: worker failed:" in result.stderr
    assert f"its log could not be kept ({work / 'logs'}" in result.stderr and "log: (none kept)" in result.stderr
    [outcome] = json.loads(result.stdout)["outcomes"]
    assert outcome["status"] == "failed" and "its log could not be kept" in outcome["error"]


def test_a_unit_whose_scratch_dir_is_removed_while_its_worker_runs_fails_saying_so(
    tiny_model: Path, tmp_path: Path
) -> None:
    build, work, stderr = start_build(tiny_model, tmp_path)
    try:
        # The worker is started (its environment names this build) before it can compile anything.
        assert wait_for(lambda: bool(started_by(build.pid)) or build.poll() is not None, 120, step=0.02), (
            stderr.read_text()
        )
        (scratch,) = work.glob("neffbuild-work-*/*/")
        shutil.rmtree(scratch)
        assert build.wait(120) == 5, stderr.read_text()
    finally:
        if build.poll() is None:
            build.kill()
    err = stderr.read_text()
    assert (
        f"error: 1 of 1 units failed; first: klein/128x128x1: its scratch dir {scratch} was removed while its worker ran"
        in err
    )
    assert (
        "a temp cleaner perhaps; rerun with --work-dir on a dir nothing else cleans" in err
        and "log: (none kept)" in err
    )
    assert "Traceback" not in err and "internal error" not in err
    published = open_store(str(tmp_path / "store"))
    assert [list(published.list_docs(kind)) for kind in ("bundles", "releases")] == [[], []]  # nothing for that unit
