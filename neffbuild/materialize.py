"""Land bytes in a directory atomically and verified: the one way any file enters a cache dir.

A process-unique `*.incomplete` file next to the target receives the bytes while they are hashed;
only a full, matching copy is renamed into place, so a reader (or a crash) never sees half a file.
"""

from __future__ import annotations

import ctypes
import errno
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from neffbuild.errors import DiskError, IntegrityError

INCOMPLETE_SUFFIX = ".incomplete"


@dataclass(frozen=True, slots=True)
class BlobTarget:
    """A blob to bring into the cache dir: its digest and size, and the final path."""

    digest: str
    size: int
    dest: Path
    # fsync before the rename. A caller that syncs the whole filesystem once at the end (pull)
    # turns it off: one syncfs costs far less than a flush per file.
    fsync: bool = True


def temp_path_for(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:10]}{INCOMPLETE_SUFFIX}"


def write_verified(target: BlobTarget, chunks: Iterable[bytes], *, origin: str) -> None:
    """Write chunks to target.dest atomically; IntegrityError (nothing left behind) on mismatch."""
    dest = target.dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise disk_error(exc, dest) from None
    tmp = temp_path_for(dest)
    try:
        hasher = xxhash.xxh3_128()
        size = 0
        with tmp.open("xb") as out:
            for chunk in chunks:
                hasher.update(chunk)
                out.write(chunk)
                size += len(chunk)
            out.flush()
            if target.fsync:
                os.fsync(out.fileno())
        if size != target.size or hasher.hexdigest() != target.digest:
            raise IntegrityError(
                f"{dest}: content from {origin} does not match the release "
                f"(got {size} bytes, xxh3 {hasher.hexdigest()}; expected {target.size} bytes, {target.digest})",
                hint="the store object is corrupt: rebuild or re-push the release; nothing was written",
            )
        os.replace(tmp, dest)
    except OSError as exc:
        raise disk_error(exc, dest) from None
    finally:
        tmp.unlink(missing_ok=True)


def disk_error(exc: OSError, path: Path) -> DiskError:
    hints = {
        errno.ENOSPC: "free space on that filesystem or choose another directory",
        errno.EDQUOT: "the disk quota is exhausted",
        errno.EACCES: "check the directory's permissions",
        errno.EROFS: "the filesystem is read-only",
    }
    return DiskError(f"{path}: {exc.strerror or exc}", hint=hints.get(exc.errno or 0, "check the filesystem"))


def sync_filesystem(path: Path) -> None:
    """Flush the filesystem holding path (Linux syncfs; elsewhere a global sync)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise disk_error(exc, path) from None
    try:
        if not hasattr(libc, "syncfs") or libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)
