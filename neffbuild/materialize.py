"""Land bytes in a directory atomically and verified: the one way any file enters a cache dir.

The bytes go into a file with no name yet (O_TMPFILE) while they are hashed; only a full, matching
copy is linked into place, so a reader never sees half a file and a crash leaves nothing behind.
Where the filesystem or platform has no O_TMPFILE, a process-unique `*.incomplete` file next to
the target plays that part and is renamed into place (pull removes those left by killed pulls).

Why unnamed files: creating a named file allocates its inode while holding the directory's lock,
and renaming takes that lock again, so parallel writers into one directory (Inductor's hundreds
of small files) queue on it. An unnamed file is allocated outside the lock and linked with one
short directory operation: measured 2x faster for 2,000 small files on ext4 (bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import mmap
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from neffbuild.errors import DiskError, IntegrityError

INCOMPLETE_SUFFIX = ".incomplete"
# Blobs this large are written with O_DIRECT where the filesystem allows: straight from our
# receive buffers to the device. Through the page cache, every byte is copied into freshly
# allocated cache pages and written back later, which measured (bench/RESULTS.md) 2-4x the CPU
# and time of the transfer itself; the pulled NEFFs are read once, when the runtime loads them.
DIRECT_MIN = 8 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)


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


def write_verified(target: BlobTarget, chunks: Iterable[bytes | memoryview], *, origin: str) -> None:
    """Write chunks to target.dest atomically; IntegrityError (nothing left behind) on mismatch."""
    dest = target.dest
    named: Path | None = None  # the temp file's name, when it has one
    landed = False
    try:
        fd, named, direct = _open_temp(dest, direct=target.size >= DIRECT_MIN)
        try:
            hasher = xxhash.xxh3_128()
            size = 0
            for chunk in _bounded(chunks, target, origin):
                hasher.update(chunk)
                direct = _write_all(fd, chunk, direct)
                size += len(chunk)
            if target.fsync:
                os.fsync(fd)
            if size != target.size or hasher.hexdigest() != target.digest:
                raise IntegrityError(
                    f"{dest}: content from {origin} does not match the release "
                    f"(got {size} bytes, xxh3 {hasher.hexdigest()}; expected {target.size} bytes, {target.digest})",
                    hint="the store object is corrupt: rebuild or re-push the release; nothing was written",
                )
            _land(fd, named, dest)
            landed = True
        finally:
            os.close(fd)
    except OSError as exc:
        raise disk_error(exc, dest) from None
    finally:
        if named is not None and not landed:
            named.unlink(missing_ok=True)


def _bounded(chunks: Iterable[bytes | memoryview], target: BlobTarget, origin: str) -> Iterator[bytes | memoryview]:
    """The chunks, stopped as soon as they exceed the size the release declares: a source that
    never ends (a FIFO, /dev/zero, a body without a length) fails here, not on a full disk."""
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > target.size:  # checked before it is written: nothing past the size is kept
            raise IntegrityError(
                f"{target.dest}: content from {origin} is longer than the {target.size} bytes the release expects",
                hint="the store object is corrupt: rebuild or re-push the release; nothing was written",
            )
        yield chunk


def _open_temp(dest: Path, *, direct: bool) -> tuple[int, Path | None, bool]:
    """A file to write dest's bytes into: (fd, its name or None if unnamed, whether O_DIRECT).

    O_DIRECT if asked and the filesystem takes it; the parent directories are made on demand.
    """
    direct = direct and _O_DIRECT != 0
    flags = os.O_WRONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
    if _unnamed_files_possible():
        try:
            return os.open(dest.parent, flags | os.O_TMPFILE, 0o666), None, direct
        except FileNotFoundError:
            dest.parent.mkdir(parents=True, exist_ok=True)
            return _open_temp(dest, direct=direct)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            if direct and exc.errno == errno.EINVAL:  # perhaps O_DIRECT, not O_TMPFILE, was refused
                return _open_temp(dest, direct=False)
    named = temp_path_for(dest)
    try:
        return os.open(named, flags | os.O_CREAT | os.O_EXCL, 0o666), named, direct
    except FileNotFoundError:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        named.unlink(missing_ok=True)  # the filesystem refused O_DIRECT, perhaps after creating the file
        direct = False
    return _open_temp(dest, direct=direct)


def _land(fd: int, named: Path | None, dest: Path) -> None:
    """Give the finished file dest's name, replacing any file there, in one atomic step."""
    if named is not None:
        os.replace(named, dest)
        return
    # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names an O_TMPFILE file (open(2)); passing
    # src_dir_fd makes Python call linkat rather than link (the absolute path ignores it).
    source = f"/proc/self/fd/{fd}"
    try:
        os.link(source, dest, src_dir_fd=fd, follow_symlinks=True)
    except FileExistsError:  # a stale or corrupt copy is there: link beside it, then swap
        beside = temp_path_for(dest)
        os.link(source, beside, src_dir_fd=fd, follow_symlinks=True)
        try:
            os.replace(beside, dest)
        except BaseException:
            beside.unlink(missing_ok=True)
            raise


@functools.cache
def _unnamed_files_possible() -> bool:
    """O_TMPFILE exists here and /proc can name its files (both hold on Linux with /proc mounted)."""
    return hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")


def _write_all(fd: int, chunk: bytes | memoryview, direct: bool) -> bool:
    """Write all of chunk; returns whether the fd still writes directly.

    O_DIRECT needs block-aligned memory and lengths: the aligned buffers of the S3 data plane
    qualify except for a blob's last chunk. The kernel refuses the others (EINVAL, nothing
    written), and the rest of the file then goes through the page cache.
    """
    view = memoryview(chunk)
    while view:
        try:
            written = os.write(fd, view)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
            direct = False
            continue
        view = view[written:]
    return direct


def aligned_buffer(size: int) -> mmap.mmap:
    """Page-aligned writable memory (what O_DIRECT writes need); reuse it: fresh pages cost."""
    return mmap.mmap(-1, size)


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
