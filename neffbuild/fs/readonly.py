"""Is a cache dir read-only to this process, but for the dirs its server must write?

`verify --replay --in-place` replays against the cache dir itself, as a server on a host that
mounts it read-only (or runs as another user) reads it: that is only honest if no miss can write
into the checked dir, and only useful if the compiler can still write where it must on a hit.

Asked for real, by creating a file: root's permission override, a read-only mount, ACLs and
security modules all have their say, which neither the mode bits nor os.access judge alike. The
probe is an unnamed O_TMPFILE file where the filesystem has them (it vanishes on close), else a
named one removed at once.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Collection
from pathlib import Path

from neffbuild.errors import HostNotReady, InputError

_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)  # the filesystem has no O_TMPFILE
README_SECTION = "docs/hosts.md, 'Serving from a read-only cache dir'"


def can_write(directory: Path) -> bool:
    """Whether this process can create a file in directory."""
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in _NO_TMPFILE:
            return False
        try:
            fd, name = tempfile.mkstemp(prefix=".neffbuild-probe-", dir=directory)
        except OSError:
            return False
        os.unlink(name)
    os.close(fd)
    return True


def writable_dirs(cache_dir: Path, allowed: Collection[str]) -> list[Path]:
    """Directories of cache_dir (itself included, links not followed) that this process can
    write, other than the allowed top-level ones and what is below them."""
    found = []
    for top, dirs, _ in os.walk(cache_dir):
        if top == str(cache_dir):
            dirs[:] = [d for d in dirs if d not in allowed]
        if can_write(Path(top)):
            found.append(Path(top))
    return found


def require_read_only(cache_dir: Path, backend: str, writable: Collection[str]) -> None:
    """InputError if this process could write cache_dir outside `writable` (a miss would fill
    the dir it checks); HostNotReady if it cannot write a dir of `writable` (the compiler would
    fail on a hit, as the server would)."""
    open_dirs = writable_dirs(cache_dir, writable)
    if open_dirs:
        more = f" (and {len(open_dirs) - 1} more dirs of {cache_dir})" if len(open_dirs) > 1 else ""
        raise InputError(
            f"--in-place: {open_dirs[0]} is writable by this replay{more}",
            hint="a miss would write into the dir it checks: mount it read-only or run as a user that cannot "
            "write it, as the server will (or drop --in-place to replay a private copy)",
        )
    for name in writable:
        path = cache_dir / name
        if not path.is_dir():
            raise HostNotReady(
                f"{path}: no such directory; the {backend} compiler writes there even on a hit",
                hint="`neffbuild pull` makes it: pull again while the cache dir is writable",
            )
        if not can_write(path):
            raise HostNotReady(
                f"{path}: not writable, and the {backend} compiler writes there even on a hit",
                hint=f"mount a writable dir over it (systemd ReadWritePaths=, a container tmpfs): {README_SECTION}",
            )
