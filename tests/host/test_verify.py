"""verify: the private copy a replay runs against, the checked dir left byte-identical by real
misses, what a miss reports, signals during a replay, --fail-fast, and the file check's exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neffbuild.host.verify import clone_file, make_view, tree_state
from neffbuild.runner.scratch import remove_tree
from tests.conftest import write_manifest
from tests.procs import assert_all_stopped, start_cli, started_by, tree_hash, wait_for, wait_until_compiling


def make_cache(root: Path) -> Path:
    """A cache-dir-like tree: nested dirs, a read-only file and dir, a symlinked file."""
    (root / "fxgraph" / "ab" / "key").mkdir(parents=True)
    (root / "fxgraph" / "ab" / "key" / "entry").write_bytes(os.urandom(5000))
    (root / "ab").mkdir()
    (root / "ab" / "cab.so").write_bytes(b"\x7fELF" + os.urandom(70000))
    (root / "ab" / "cab.so").chmod(0o444)
    (root / "locked").mkdir()
    (root / "locked" / "f").write_text("read-only dir")
    (root / "locked").chmod(0o555)
    (root / "link.py").symlink_to(root / "ab" / "cab.so")
    return root


def test_the_private_copy_has_the_same_bytes_and_modes_and_shares_nothing_writable(tmp_path: Path) -> None:
    source = make_cache(tmp_path / "cache")
    before = tree_hash(source)
    view = tmp_path / "scratch" / "view"
    view.parent.mkdir()
    copy = make_view(source, view)
    assert copy.files == 4 and copy.bytes == 5000 + 70004 + len("read-only dir") + 70004
    assert sum(copy.methods.values()) == 4 and set(copy.methods) <= {"reflink", "copy_file_range", "copy"}
    for rel in ("fxgraph/ab/key/entry", "ab/cab.so", "locked/f"):
        assert (view / rel).read_bytes() == (source / rel).read_bytes()
        assert (view / rel).stat().st_mode == (source / rel).stat().st_mode
        assert (view / rel).stat().st_ino != (source / rel).stat().st_ino
    assert (view / "locked").stat().st_mode == (source / "locked").stat().st_mode
    # The symlink is followed: the copy holds what a compiler would read, and writing it in place
    # (as a compiler rewriting a file would) reaches neither the file it named nor the original.
    assert (
        not (view / "link.py").is_symlink()
        and (view / "link.py").read_bytes() == (source / "ab" / "cab.so").read_bytes()
    )
    for rel in ("link.py", "fxgraph/ab/key/entry"):
        with (view / rel).open("r+b") as f:
            f.write(b"rewritten in place")
    os.chmod(view / "ab" / "cab.so", 0o644)
    with (view / "ab" / "cab.so").open("r+b") as f:
        f.write(b"rewritten in place")
    assert tree_hash(source) == before
    remove_tree(view)
    assert not view.exists()


def test_clone_file_copies_any_size_exactly(tmp_path: Path) -> None:
    for size in (0, 1, 1 << 20, (1 << 20) + 7):
        data = os.urandom(size)
        (tmp_path / f"src{size}").write_bytes(data)
        clone_file(tmp_path / f"src{size}", tmp_path / f"dst{size}")
        assert (tmp_path / f"dst{size}").read_bytes() == data


def test_tree_state_sees_a_rewrite_by_rename_with_the_same_size_and_mtime(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"12345")
    st = (tmp_path / "f").stat()
    before = tree_state(tmp_path)
    (tmp_path / "g").write_bytes(b"54321")
    os.utime(tmp_path / "g", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp_path / "g", tmp_path / "f")
    os.utime(tmp_path, ns=(tmp_path.stat().st_atime_ns, tmp_path.stat().st_mtime_ns))
    assert tree_state(tmp_path) != before


# -- the file check ----------------------------------------------------------------------------


def test_a_never_built_unit_is_not_found_not_an_integrity_failure(tiny_model: Path, tmp_path: Path, cli) -> None:
    from neffbuild.store import open_store

    open_store(str(tmp_path / "store"), create=True)
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128,))
    (tmp_path / "cache").mkdir()
    result = cli("verify", str(manifest), "--cache-dir", str(tmp_path / "cache"), "--store", str(tmp_path / "store"))
    assert result.returncode == 8, result.stderr
    assert "klein/128x128x1: not built (no bundle in the store)" in result.stdout
    assert "1 of 1 units have no bundle in" in result.stderr and "klein/128x128x1 (key " in result.stderr
    assert "hint: build them" in result.stderr and "pull again" not in result.stderr


def test_replay_refuses_scratch_inside_the_dir_it_checks(tiny_model: Path, tmp_path: Path, cli) -> None:
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128,))
    cache = tmp_path / "cache"
    cache.mkdir()
    before = tree_hash(cache)
    for flag in ("--work-dir", "--outputs"):
        result = cli("verify", str(manifest), "--cache-dir", str(cache), "--replay", flag, str(cache / "inside"))
        assert result.returncode == 2, result.stderr
        assert "inside the checked cache dir" in result.stderr
    assert tree_hash(cache) == before


def test_fail_fast_is_a_replay_option(tiny_model: Path, tmp_path: Path, cli) -> None:
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128,))
    cache = tmp_path / "cache"
    cache.mkdir()
    result = cli("verify", str(manifest), "--cache-dir", str(cache), "--fail-fast")
    assert result.returncode == 2 and "--fail-fast is a --replay option" in result.stderr, result.stderr


# -- real replays ------------------------------------------------------------------------------


@pytest.fixture
def pulled(built_store: Path, tmp_path: Path, cli) -> Path:
    """The shared build pulled into a cache dir of this test's own."""
    cache = tmp_path / "cache"
    assert cli("pull", "tiny-flux2-klein", "--store", str(built_store), "--cache-dir", str(cache)).returncode == 0
    return cache


@pytest.mark.slow
def test_a_replay_that_misses_twice_leaves_the_checked_dir_byte_identical(
    pulled: Path, tiny_model: Path, tmp_path: Path, cli
) -> None:
    cache = pulled
    other_width = write_manifest(
        tmp_path / "other-width.toml", tiny_model, widths=(64,), mode="regional"
    )  # in no bundle
    work = tmp_path / "work"
    before = tree_hash(cache)

    first = cli("verify", str(other_width), "--cache-dir", str(cache), "--replay", "--work-dir", str(work), "--json")
    assert first.returncode == 6, first.stderr
    assert tree_hash(cache) == before
    (unit,) = json.loads(first.stdout)["units"]
    assert unit["unit_id"] == "klein/128x64x1" and unit["compiles"] > 0
    written = unit["written"]
    assert any(w["path"].startswith("fxgraph/") and w["change"] == "new" and w["size"] > 0 for w in written), written
    for w in written:  # what is new to the copy is absent from the checked dir; the rest is in it
        assert (w["change"] == "new") == (not (cache / w["path"]).exists()), w
    assert "nothing was written to it" in first.stderr

    second = cli("verify", str(other_width), "--cache-dir", str(cache), "--replay", "--work-dir", str(work))
    assert second.returncode == 6, second.stderr  # the first miss did not turn into a hit
    assert tree_hash(cache) == before
    assert f"klein/128x64x1 would have written {len(written)} files" in second.stdout
    assert written[0]["path"] in second.stdout
    assert list(work.iterdir()) == []  # the private copies went with the scratch


@pytest.mark.slow
def test_sigterm_to_a_replaying_parent_stops_its_worker_and_removes_the_copy(tiny_model: Path, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128,))
    cache, work, err = tmp_path / "empty-cache", tmp_path / "work", tmp_path / "stderr"
    cache.mkdir()
    proc = start_cli(
        "verify", str(manifest), "--cache-dir", str(cache), "--replay", "--work-dir", str(work), stderr=err
    )
    try:
        running = wait_until_compiling(proc, err, "replaying")
        proc.send_signal(signal.SIGTERM)  # the parent only, as a CI runner's timeout does
        assert_all_stopped(proc, running, time.monotonic(), 143, err, work)
        assert "interrupted by SIGTERM" in err.read_text()
        assert list(cache.iterdir()) == []
    finally:
        proc.kill()


@pytest.mark.slow
def test_fail_fast_stops_a_missing_replay_at_its_first_compile_and_leaves_nothing_running(
    tiny_model: Path, tmp_path: Path
) -> None:
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128, 256))  # one entry, two units
    cache, work = tmp_path / "empty-cache", tmp_path / "work"
    cache.mkdir()
    args = ("verify", str(manifest), "--cache-dir", str(cache), "--replay", "--fail-fast", "--work-dir", str(work))
    proc = subprocess.Popen(
        [sys.executable, "-m", "neffbuild", *args, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 6, err  # a miss, as without --fail-fast
    assert wait_for(lambda: not started_by(proc.pid), 10), started_by(proc.pid)  # the compile pool too
    report = json.loads(out)
    (unit,) = report["units"]  # the first unit's first graph missed: nothing after it ran
    assert unit["unit_id"] == "klein/128x128x1" and unit["stopped"] and unit["compiles"] == 1, unit
    assert unit["written"] == [], unit  # stopped before Inductor compiled: no cache entry written
    assert report["stopped_at"] == "klein/128x128x1" and report["not_replayed"] == ["klein/128x256x1"], report
    assert "stopped at the first miss (--fail-fast): klein/128x128x1 compiled, stopped at its first compile" in err
    assert "1 of 2 units not replayed" in err
    assert list(cache.iterdir()) == [] and list(work.iterdir()) == []


@pytest.mark.slow
def test_fail_fast_on_a_cache_that_serves_every_unit_replays_them_all(pulled: Path, tiny_manifest: Path, cli) -> None:
    result = cli("verify", str(tiny_manifest), "--cache-dir", str(pulled), "--replay", "--fail-fast", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [(u["unit_id"], u["compiles"], u["stopped"]) for u in report["units"]] == [
        ("klein/128x128x1", 0, False),
        ("klein/128x256x1", 0, False),
    ], report
    assert report["stopped_at"] is None and report["not_replayed"] == [] and report["misses"] == 0
