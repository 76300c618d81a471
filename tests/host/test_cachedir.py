"""CacheDir, the one way a command opens a host's cache dir: on the real filesystem, what it makes
(nothing until asked), what it resolves, the state it reads and the lock it holds."""

from __future__ import annotations

import ast
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


def test_the_state_is_read_and_replaced_under_the_lock_through_what_locked_yields(tmp_path: Path) -> None:
    with CacheDir.opened(tmp_path / "cache") as cache, cache.locked(timeout=0) as held:
        assert held.state() == (None, CacheState())
        held.write_state(b"{not json")  # bytes as given: the codec is host/state.py's
        data, state = held.state()
        assert data == cache.state_path.read_bytes() == b"{not json" and state.problem == "not valid JSON"
        assert cache.read_state() == (data, state)  # what a reader without the lock sees
        assert sorted(p.name for p in cache.state_path.parent.iterdir()) == sorted([LOCK_FILE, "state.json"])


def test_waiting_for_another_pull_returns_at_once_when_none_holds_the_lock(tmp_path: Path) -> None:
    with CacheDir.opened(tmp_path / "cache") as cache:
        assert not cache.wait_for_other_pull(timeout=0)  # no dir: nothing made
        assert not (tmp_path / "cache").exists()
        with cache.locked(timeout=0):
            pass
        assert not cache.wait_for_other_pull(timeout=0)  # a lock file no one holds


def test_waiting_for_another_pull_gives_up_after_its_timeout_while_the_holder_holds_on(tmp_path: Path) -> None:
    with CacheDir.opened(tmp_path / "cache") as first, first.locked(timeout=0):
        with CacheDir.opened(tmp_path / "cache") as second:
            with pytest.raises(ConflictError, match="pull lock still held"):
                second.wait_for_other_pull(timeout=0)
    with CacheDir.opened(tmp_path / "cache") as second:
        assert not second.wait_for_other_pull(timeout=0)  # released: nothing to wait for


# What opens a cache dir's state or lock, or the dir itself: CacheDir (host/cachedir.py, with the
# lock holder's view it yields, host/held.py) over host/state.py's codec and host/statefile.py's
# reader, and fs/ below them. Anything else goes through CacheDir.
_OWNERS = {
    "neffbuild/host/cachedir.py", "neffbuild/host/held.py", "neffbuild/host/state.py", "neffbuild/host/statefile.py",
}  # fmt: skip
_INTERNALS = {
    "open_existing", "open_state_dir", "read_state", "read_state_data", "load_state", "load_state_data",
    "lock_in", "LOCK_FILE", "STATE_FILE", "state_path",
}  # fmt: skip


def cache_dir_openers(root: Path) -> list[str]:
    """Each place outside CacheDir that reaches a cache dir's state or lock, or opens a
    directory itself: `module:line what`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if rel in _OWNERS or rel.startswith("neffbuild/fs/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.ImportFrom) and node.module in (
                "neffbuild.host.state",
                "neffbuild.host.statefile",
                "neffbuild.host.cachedir",
            ):
                found += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names if a.name in _INTERNALS]
            elif isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name == "Beneath":
                    found.append(f"{rel}:{node.lineno} opens a Beneath of its own")
                # In host/ (the stage that owns cache dirs) a path is opened only below an open dir.
                elif (
                    name == "os.open"
                    and rel.startswith("neffbuild/host/")
                    and not any(k.arg == "dir_fd" for k in node.keywords)
                ):
                    found.append(f"{rel}:{node.lineno} os.open of a path")
    return found


def test_cachedir_is_the_only_opener_of_a_cache_dir() -> None:
    assert cache_dir_openers(Path(__file__).resolve().parents[2] / "neffbuild") == []


def test_the_opener_check_finds_a_planted_opener(tmp_path: Path) -> None:
    (tmp_path / "neffbuild" / "host").mkdir(parents=True)
    (tmp_path / "neffbuild" / "host" / "status.py").write_text(
        "import os\nfrom neffbuild.host.state import STATE_FILE, CacheState\n"
        "from neffbuild.fs.beneath import Beneath\n"
        "def look(p):\n    root = os.open(p, os.O_RDONLY)\n    return Beneath(root, p)\n"
    )
    assert cache_dir_openers(tmp_path / "neffbuild") == [
        "neffbuild/host/status.py:2 imports STATE_FILE",
        "neffbuild/host/status.py:5 os.open of a path",
        "neffbuild/host/status.py:6 opens a Beneath of its own",
    ]
