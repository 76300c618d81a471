"""Advisory file locks (flock) that only save duplicate work: correctness never rests on them.

The kernel drops a flock when its holder dies, so a crashed process never blocks the next one; on
filesystems where flock does nothing (some NFS setups) two holders may overlap, which callers
tolerate (unique temp files and rename, content compare before a tag swap).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from neffbuild.errors import ConflictError
from neffbuild.fs.confined import disk_error

_POLL_S = 0.05


@contextmanager
def exclusive(path: Path, *, timeout: float | None = None, what: str = "lock") -> Iterator[None]:
    """Hold an exclusive flock on path while the block runs; ConflictError after timeout seconds."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise disk_error(exc, path) from None
    try:
        acquire(fd, path, timeout, what)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def acquire(
    fd: int,
    path: Path,
    timeout: float | None,
    what: str,
    hint: str = "another neffbuild is working on the same thing; wait for it or retry",
) -> None:
    """Lock fd exclusively (path names it in the error); None waits for ever, 0 tries once."""
    if timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise ConflictError(
                    f"{path}: {what} still held by another process after {timeout:g} s",
                    hint=hint,
                ) from None
            time.sleep(_POLL_S)
