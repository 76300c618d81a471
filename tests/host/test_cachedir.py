"""CacheDir, the one way a command opens a host's cache dir: on the real filesystem, what it makes
(nothing until asked), what it resolves, the state it reads and the lock it holds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neffbuild.errors import ConflictError, NeffbuildError, StateCorrupt
from neffbuild.host.cachedir import LOCK_FILE, CacheDir
from neffbuild.host.state import CacheState
from neffbuild.names import STATE_DIR


def test_opening_a_missing_dir_makes_nothing_and_reads_an_empty_state(tmp_path: Path) -> None:
    path = tmp_path / "a" / "cache"
    with CacheDir.opened(path) as cache:
        assert not cache.exists
        assert cache.read_state() == (None, CacheState())
        assert cache.state() == CacheState()
        assert cache.state_dir(create=False) is None and not cache.has_state_dir()
    assert not (tmp_path / "a").exists()


def test_the_path_is_resolved_once_where_a_link_at_the_root_points(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with CacheDir.opened(tmp_path / "link" / ".." / "link") as cache:
        assert cache.path == tmp_path / "real" and cache.exists
        assert cache.state_path.parent == tmp_path / "real" / STATE_DIR
        assert cache.lock_path == tmp_path / "real" / STATE_DIR / LOCK_FILE


def test_make_makes_the_dir_once_and_close_lets_its_descriptor_go(tmp_path: Path) -> None:
    cache = CacheDir(tmp_path / "x" / "cache")
    fd = cache.make()
    assert (tmp_path / "x" / "cache").is_dir() and cache.exists and cache.make() == fd
    cache.close()
    cache.close()  # twice: nothing left to close
    assert not cache.exists
    with pytest.raises(OSError):
        os.fstat(fd)


def test_the_lock_is_held_while_the_block_runs_and_a_second_holder_waits_in_vain(tmp_path: Path) -> None:
    with CacheDir.opened(tmp_path / "cache") as first, CacheDir.opened(tmp_path / "cache") as second:
        with first.locked(timeout=0):
            assert (tmp_path / "cache" / STATE_DIR / LOCK_FILE).is_file()
            with pytest.raises(ConflictError, match="pull lock still held") as held, second.locked(timeout=0.3):
                pytest.fail("a second holder got the lock")
            assert "another pull into this cache dir" in (held.value.hint or "")
        with second.locked(timeout=0):  # released: the next one gets it at once
            assert second.has_state_dir()


def test_a_corrupt_state_reads_as_nothing_known_for_pull_and_stops_a_command_that_only_reads(tmp_path: Path) -> None:
    (tmp_path / "cache" / STATE_DIR).mkdir(parents=True)
    with CacheDir.opened(tmp_path / "cache") as cache:
        cache.state_path.write_bytes(b"{not json")
        data, state = cache.read_state()
        assert data == b"{not json" and state.installed is None and state.problem == "not valid JSON"
        with pytest.raises(StateCorrupt, match="not valid JSON"):
            cache.state()


def test_a_link_where_the_state_dir_belongs_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / STATE_DIR).symlink_to(tmp_path / "elsewhere")
    with CacheDir.opened(tmp_path / "cache") as cache:
        with pytest.raises(NeffbuildError, match=STATE_DIR):
            cache.has_state_dir()
        with pytest.raises(NeffbuildError, match=STATE_DIR), cache.locked(timeout=0):
            pytest.fail("locked through a link")
    assert list((tmp_path / "elsewhere").iterdir()) == []  # nothing written where the link points
