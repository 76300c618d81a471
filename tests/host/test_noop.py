"""noop_pull: the pull itself, answering only where it is a clean no-op and writing nothing else."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from neffbuild.host.noop import noop_pull
from neffbuild.host.pull import PullOptions, pull
from neffbuild.store.local import LocalStore
from tests.storekit import publish_release_of, write_files


@pytest.fixture
def installed(tmp_path: Path) -> tuple[LocalStore, Path]:
    store = LocalStore(tmp_path / "store", create=True)
    src = tmp_path / "src"
    publish_release_of(store, src, write_files(src, {f"d/f{i}.bin": 50 + i for i in range(12)}), tag="t")
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    return store, cache


def _tree(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every path below root with its size, mtime and bytes: what a write would change."""
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
        for p in sorted(root.rglob("*"))
    }


def test_a_complete_cache_dir_is_answered_as_pull_answers_it(installed: tuple[LocalStore, Path]) -> None:
    store, cache = installed
    before = _tree(cache)
    report = noop_pull(lambda: store, "t", cache, PullOptions(host_env=dict(os.environ)))
    assert report is not None and report.files_fetched == 0 and report.files_total == 12 and report.host_checked
    full = pull(store, "t", cache, host_env=dict(os.environ))
    assert (report.release_id, report.exports, report.bytes_total) == (full.release_id, full.exports, full.bytes_total)
    assert _tree(cache) == before


@pytest.mark.parametrize("change", ["missing", "mtime", "moved_tag", "no_dir", "refused_host", "no_store"])
def test_anything_to_do_or_to_say_is_none_and_writes_nothing(
    installed: tuple[LocalStore, Path], tmp_path: Path, change: str
) -> None:
    store, cache = installed
    host_env = dict(os.environ)
    if change == "missing":
        (cache / "d" / "f3.bin").unlink()
    elif change == "mtime":
        os.utime(cache / "d" / "f4.bin", ns=(0, 1))
    elif change == "moved_tag":
        src = tmp_path / "src2"
        publish_release_of(store, src, write_files(src, {"x.bin": 3}), name="other", tag="t")
    elif change == "no_dir":
        cache = tmp_path / "elsewhere"
    elif change == "refused_host":
        host_env["OMP_NUM_THREADS"] = "7"  # a field the build recorded otherwise
    before = _tree(tmp_path)

    def opened() -> LocalStore:
        return LocalStore(tmp_path / "nowhere") if change == "no_store" else store

    assert noop_pull(opened, "t", cache, PullOptions(host_env=host_env)) is None
    assert _tree(tmp_path) == before


def test_a_warning_logged_on_the_way_is_left_to_the_full_pull(installed: tuple[LocalStore, Path]) -> None:
    store, cache = installed

    def warn_then_open() -> LocalStore:
        logging.getLogger("neffbuild.test").warning("something to say")
        return store

    assert noop_pull(warn_then_open, "t", cache, PullOptions()) is None  # shown nowhere: the full pull logs it
    assert noop_pull(lambda: store, "t", cache, PullOptions()) is not None
