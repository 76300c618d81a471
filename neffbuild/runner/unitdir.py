"""Where a unit compiles: the same path for the same unit, build after build, host after host.

Inductor writes the absolute path of its cache dir into what it compiles (each kernel's `.so`
names its `.cpp` and build dir; the graph entries hash those), so a unit compiled under a random
scratch dir gives other bytes every time, and shards, a rerun and a one-process build would
release under different ids. Each unit therefore compiles in `<root>/<unit key>/cache`, the root
being `<work dir>/neffbuild-work-units` (or the system temp dir's): the same on every host of a
fleet that runs one image, and on one host build after build.

Two builds of one unit at once on one host would share that dir: a flock decides, and the one
that loses waits for the other, then builds at the same path (or finds the bundle already in the
store, having compiled nothing). It used to compile under a random dir instead: those bytes named
that dir, so the unit's bundle, and every release holding it, differed from a build that did not
meet another (a test building a unit while another test built it found another release id). A
dir left by a killed build is removed first.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from neffbuild.runner.scratch import remove_tree

log = logging.getLogger(__name__)
ROOT_NAME = "neffbuild-work-units"


def units_root(work_dir: Path | None, temp_dir: str | None = None) -> Path:
    base = work_dir if work_dir is not None else Path(temp_dir or tempfile.gettempdir())
    return base.expanduser().resolve() / ROOT_NAME


@contextlib.contextmanager
def unit_scratch(
    root: Path, key: str, *, keep: bool = False, on_wait: Callable[[], None] = lambda: None
) -> Iterator[Path]:
    """The unit's scratch dir (its cache dir is `cache/` in it): `root/key`, once this process has
    claimed it; on_wait is called first if another process holds it (then this one waits for it).
    Removed afterwards unless keep."""
    lock_fd = _claim(root, key, on_wait)
    scratch = root / key
    try:
        remove_tree(scratch)  # left by a build that was killed
        yield scratch
    finally:
        try:
            if not keep:
                remove_tree(scratch)
                with contextlib.suppress(OSError):
                    (root / f"{key}.lock").unlink()
        finally:
            os.close(lock_fd)
        with contextlib.suppress(OSError):
            root.rmdir()  # only when empty: another build may use it


def _claim(root: Path, key: str, on_wait: Callable[[], None]) -> int:
    """The unit's lock, held: waits while another process holds it."""
    path = root / f"{key}.lock"
    told = False
    while True:
        root.mkdir(parents=True, exist_ok=True)  # another build may remove the (empty) root meanwhile
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not told:
                log.warning("unit %s is being built by another process on this host: waiting for it", key)
                on_wait()
                told = True
            fcntl.flock(fd, fcntl.LOCK_EX)
        if _still_there(fd, path):
            return fd
        os.close(fd)  # the holder removed that file as it finished: a lock on it guards nothing


def _still_there(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return os.path.samestat(st, os.fstat(fd))
