"""The state file on disk: `.neffbuild/state.json` opened beneath a cache dir without following a
link, read whole (up to STATE_MAX) or read as empty when missing, foreign or broken; state.py
parses what it holds."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from neffbuild.fs.beneath import open_dir_beneath
from neffbuild.fs.confined import disk_error
from neffbuild.host.state import STATE_FILE, CacheState, corrupt_state, parse_state
from neffbuild.names import STATE_DIR

STATE_MAX = 256 << 20  # a larger state file is not ours: ignored (it only saves re-hashing)


def open_state_dir(root: int, cache_dir: Path, *, create: bool) -> int | None:
    """cache_dir/.neffbuild, made if create, else None when missing; a symlink there is refused
    (state and lock are never read or written outside the cache dir)."""
    try:
        return open_dir_beneath(root, cache_dir, (STATE_DIR,), create=create)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) and not create:
            return None
        raise disk_error(exc, cache_dir / STATE_DIR) from None


def load_state(state_dir: int) -> tuple[bytes | None, CacheState]:
    """(the state file's bytes, its content); a missing, foreign or broken file reads as empty."""
    data = load_state_data(state_dir)
    return (None, data) if isinstance(data, CacheState) else (data, parse_state(data))


def load_state_data(state_dir: int) -> bytes | CacheState:
    """The state file's bytes, unparsed; else what a missing, foreign or broken file reads as."""
    try:
        fd = os.open(STATE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=state_dir)
    except OSError as exc:
        return corrupt_state("a symbolic link") if exc.errno == errno.ELOOP else CacheState()
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            return corrupt_state("not a regular file")
        if info.st_size > STATE_MAX:
            os.close(fd)
            return corrupt_state(f"{info.st_size} bytes, larger than any state neffbuild writes")
        with os.fdopen(fd, "rb") as src:
            return src.read(STATE_MAX + 1)
    except OSError:
        return CacheState()


def read_state(root: int, cache_dir: Path) -> tuple[bytes | None, CacheState]:
    """The state of the cache dir open at root, without making anything."""
    data = read_state_data(root, cache_dir)
    return (None, data) if isinstance(data, CacheState) else (data, parse_state(data))


def read_state_data(root: int, cache_dir: Path) -> bytes | CacheState:
    """load_state_data of the cache dir open at root, without making anything."""
    state_dir = open_state_dir(root, cache_dir, create=False)
    if state_dir is None:
        return CacheState()
    try:
        return load_state_data(state_dir)
    finally:
        os.close(state_dir)


def open_existing(cache_dir: Path) -> int | None:
    """cache_dir open, or None if it does not exist (nothing is made)."""
    try:
        return os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise disk_error(exc, cache_dir) from None


def state_path(cache_dir: Path) -> Path:
    return cache_dir / STATE_DIR / STATE_FILE
