"""Where a unit compiles: the same path for the same unit, build after build, host after host.

Inductor writes the absolute path of its cache dir into what it compiles (each kernel's `.so`
names its `.cpp` and build dir; the graph entries hash those), so a unit compiled under a random
scratch dir gives other bytes every time, and shards, a rerun and a one-process build would
release under different ids. Each unit therefore compiles in `<root>/<unit key>/cache`, the root
being `<work dir>/neffbuild-work-units` (or the system temp dir's): the same on every host of a
fleet that runs one image, and on one host build after build.

Two builds of one unit at once on one host would share that dir: a flock decides, and the one
that loses compiles under a random dir instead (its bytes name that path; the key is the same, and
the store keeps whichever bundle lands first). A dir left by a killed build is removed first.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from neffbuild.runner.jobs import remove_tree

log = logging.getLogger(__name__)
ROOT_NAME = "neffbuild-work-units"


def units_root(work_dir: Path | None, temp_dir: str | None = None) -> Path:
    base = work_dir if work_dir is not None else Path(temp_dir or tempfile.gettempdir())
    return base.expanduser().resolve() / ROOT_NAME


@contextlib.contextmanager
def unit_scratch(root: Path, key: str, fallback: Path, *, keep: bool = False) -> Iterator[Path]:
    """The unit's scratch dir (its cache dir is `cache/` in it): `root/key` when this process can
    claim it, else a fresh dir under fallback. Removed afterwards unless keep."""
    lock_fd = _claim(root, key)
    if lock_fd is None:
        log.warning("unit %s is being built by another process on this host: compiling under a random dir", key)
        yield fallback / f"{key[:16]}-{uuid.uuid4().hex[:6]}"
        return
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


def _claim(root: Path, key: str) -> int | None:
    for _ in range(3):  # another build may remove the (empty) root between our mkdir and open
        root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(root / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd
    return None
