"""Land bytes in a directory atomically and verified: the one way any file enters a cache dir.

The bytes go into a file with no name yet (O_TMPFILE) while they are hashed; only a full, matching
copy is linked into place, so a reader never sees half a file and a crash leaves nothing behind.
A file already at the path is unlinked just before the link (linkat never replaces): a kill
between the two leaves the path absent, never a second name where the server reads.
Where the filesystem or platform has no O_TMPFILE, a process-unique `*.incomplete` file next to
the target plays that part and is renamed into place (pull removes those left by killed pulls).

Why unnamed files: creating a named file allocates its inode while holding the directory's lock,
and renaming takes that lock again, so parallel writers into one directory (Inductor's hundreds
of small files) queue on it. An unnamed file is allocated outside the lock and linked with one
short directory operation: measured 2x faster for 2,000 small files on ext4 (bench/RESULTS.md).

Confinement: a target with a `root` (pull's cache dir) lands strictly beneath it. The root is
opened as given (it was resolved once: where it points is the operator's choice); below it every
directory is opened one component at a time, relative to its parent's descriptor, with
O_NOFOLLOW, and the temp file, its link and the final rename all act on that directory's
descriptor. So no symlink at or below the root is ever followed, and swapping a directory for a
link midway changes nothing: the descriptor held is the real directory. A symlink where a
directory is expected is an error naming it (nothing is written); a symlink, or any other
non-file, where a file is expected is replaced by the verified file (unlink and rename act on
the link itself, inside a directory reached without links, so nothing outside changes). The same rules
hold for reading (fs/beneath.py): a link at a release path is never "present".
"""

from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from neffbuild.errors import IntegrityError, StoreError
from neffbuild.fs.beneath import open_dir_beneath
from neffbuild.fs.disk import disk_error as disk_error  # named here too: the fs/ writers raise it
from neffbuild.fs.disk import sync_filesystem as sync_filesystem
from neffbuild.hashing import Hasher
from neffbuild.names import INCOMPLETE_SUFFIX

# Blobs this large are written with O_DIRECT where the filesystem allows: straight from our
# receive buffers to the device. Through the page cache, every byte is copied into freshly
# allocated cache pages and written back later, which measured (bench/RESULTS.md) 2-4x the CPU
# and time of the transfer itself; the pulled NEFFs are read once, when the runtime loads them.
# The price is that this first load reads the disk, not memory: pull + first load together
# (bench/ready.py, "Time to ready") still came out lower with O_DIRECT, the page-cache copy
# costing more than the cold read. It also keeps a pull of many GB from pushing the host's
# working set out of memory for files read once. BlobTarget.direct turns it off per blob.
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
    # The directory dest must land beneath without following any symlink (pull: the cache dir);
    # missing directories below it are made. None: dest's parent is made and used as a path
    # (scratch directories of our own).
    root: Path | None = None
    # Write a blob of DIRECT_MIN bytes or more with O_DIRECT (where the filesystem takes it):
    # see DIRECT_MIN for what that trades.
    direct: bool = True
    # The BLAKE3 the release binds the bytes to (version 2 releases), checked in the same pass
    # as the XXH3; "" checks the XXH3 alone.
    blake3: str = ""


def temp_name_for(name: str) -> str:
    return f".{name}.{os.getpid()}.{os.urandom(5).hex()}{INCOMPLETE_SUFFIX}"


class Parents:
    """The directories blobs land in, each opened once for a whole download (thread-safe).

    Reaching dest's directory costs write_verified the root's open, a walk down and the closes:
    half of its system calls for a small file. Descriptors held are the real directories (see
    the module docstring), so keeping them changes nothing about what lands where.
    """

    def __init__(self) -> None:
        self._fds: dict[tuple[Path | None, str], int] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> Parents:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def of(self, target: BlobTarget) -> int:
        """A descriptor of target.dest's directory (borrowed: closed on exit)."""
        if target.dest.name == "..":  # the walk's check, for a directory already walked
            raise ValueError(f"{target.dest} is not a file beneath {target.root}")
        # The directory as a string: a new Path for it would cost more than the rest of this call.
        key = (target.root, str(target.dest).rpartition("/")[0])
        fd = self._fds.get(key)
        if fd is None:
            opened = _open_parent(target)
            with self._lock:
                fd = self._fds.setdefault(key, opened)
            if fd != opened:  # another thread opened it first
                os.close(opened)
        return fd


def write_verified(
    target: BlobTarget, chunks: Iterable[bytes | memoryview], *, origin: str, parents: Parents | None = None
) -> None:
    """Write chunks to target.dest atomically; IntegrityError (nothing left behind) on mismatch.
    parents: directories kept open across the blobs of one download."""

    def copy(fd: int, direct: bool, hasher: Hasher) -> int:
        size = 0
        for chunk in _bounded(chunks, target, origin):
            hasher.update(chunk)
            direct = _write_all(fd, chunk, direct)
            size += len(chunk)
        return size

    _landed(target, origin, parents, copy)


def write_placed(
    target: BlobTarget,
    place: Callable[[int, bool], Generator[memoryview, None, None]],
    *,
    origin: str,
    parents: Parents | None = None,
) -> None:
    """write_verified for bytes written out of order: place(fd, direct) writes them at their
    offsets itself (write_at, from any threads) and yields them in order once written, to be
    hashed; it must have stopped writing when it returns or is closed. The same checks as
    write_verified hold before the file is linked into place."""

    def copy(fd: int, _direct: bool, hasher: Hasher) -> int:
        size = 0
        placed = place(fd, _direct)
        try:
            for chunk in _bounded(placed, target, origin):
                hasher.update(chunk)
                size += len(chunk)
        finally:
            placed.close()  # its writers have stopped before the file is closed
        return size

    _landed(target, origin, parents, copy)


def _landed(target: BlobTarget, origin: str, parents: Parents | None, copy: Callable[[int, bool, Hasher], int]) -> None:
    """A temp file beside target.dest, filled by copy(fd, direct, hasher) -> size, checked, linked into place."""
    dest = target.dest
    parent = -1  # dest's directory, reached without links (see the module docstring)
    named: str | None = None  # the temp file's name in parent, when it has one
    landed = False
    try:
        parent = _open_parent(target) if parents is None else parents.of(target)
        fd, named, direct = _open_temp(parent, dest.name, direct=target.direct and target.size >= DIRECT_MIN)
        try:
            hasher = Hasher(crypto=bool(target.blake3))
            size = copy(fd, direct, hasher)
            if target.fsync:
                os.fsync(fd)
            _check_written(target, origin, size, hasher)
            _land(fd, named, parent, dest.name)
            landed = True
        finally:
            os.close(fd)
    except OSError as exc:
        raise disk_error(exc, dest) from None
    finally:
        if named is not None and not landed:
            unlink_quietly(parent, named)
        if parent >= 0 and parents is None:
            os.close(parent)


def _check_written(target: BlobTarget, origin: str, size: int, hasher: Hasher) -> None:
    """IntegrityError unless the bytes written are the release's: size, XXH3, then BLAKE3."""
    if size != target.size or hasher.xxh3() != target.digest:
        raise IntegrityError(
            f"{target.dest}: content from {origin} does not match the release "
            f"(got {size} bytes, xxh3 {hasher.xxh3()}; expected {target.size} bytes, {target.digest})",
            hint="the store object is corrupt: rebuild or re-push the release; that file was not written",
        )
    if target.blake3 and hasher.crypto() != target.blake3:
        # The XXH3 matched and the BLAKE3 did not: bytes crafted to collide with the address.
        raise IntegrityError(
            f"{target.dest}: content from {origin} has the release's xxh3 {target.digest} but blake3 "
            f"{hasher.crypto()}, not {target.blake3}",
            hint="the store object was forged to match its address: do not serve this store; that file was not written",
        )


def _bounded(chunks: Iterable[bytes | memoryview], target: BlobTarget, origin: str) -> Iterator[bytes | memoryview]:
    """The chunks, stopped as soon as they exceed the size the release declares: a source that
    never ends (a FIFO, /dev/zero, a body without a length) fails here, not on a full disk."""
    size = 0
    source = iter(chunks)
    while True:
        try:
            chunk = next(source)
        except StopIteration:
            return
        except OSError as exc:  # the source's failure, not the target's: a store read, not the disk
            raise StoreError(
                f"{origin}: read failed ({exc.strerror or exc})", hint="check the store's filesystem or connection"
            ) from None
        size += len(chunk)
        if size > target.size:  # checked before it is written: nothing past the size is kept
            raise IntegrityError(
                f"{target.dest}: content from {origin} is longer than the {target.size} bytes the release expects",
                hint="the store object is corrupt: rebuild or re-push the release; that file was not written",
            )
        yield chunk


def _open_parent(target: BlobTarget) -> int:
    """A descriptor of the directory target.dest lands in (made if missing)."""
    if target.root is None:
        target.dest.parent.mkdir(parents=True, exist_ok=True)
        return os.open(target.dest.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    parts = target.dest.relative_to(target.root).parts
    if not parts or ".." in parts:
        raise ValueError(f"{target.dest} is not a file beneath {target.root}")
    root = os.open(target.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_dir_beneath(root, target.root, parts[:-1], create=True)
    finally:
        os.close(root)


def _open_temp(parent: int, name: str, *, direct: bool) -> tuple[int, str | None, bool]:
    """A file in parent to write name's bytes into: (fd, its name or None if unnamed, whether O_DIRECT).

    O_DIRECT if asked and the filesystem takes it.
    """
    direct = direct and _O_DIRECT != 0
    flags = os.O_WRONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
    if _unnamed_files_possible():
        try:
            return os.open(".", flags | os.O_TMPFILE, 0o666, dir_fd=parent), None, direct
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            if direct and exc.errno == errno.EINVAL:  # perhaps O_DIRECT, not O_TMPFILE, was refused
                return _open_temp(parent, name, direct=False)
    named = temp_name_for(name)
    try:
        return os.open(named, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=parent), named, direct
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        unlink_quietly(parent, named)  # the filesystem refused O_DIRECT, perhaps after creating the file
    return _open_temp(parent, name, direct=False)


def _land(fd: int, named: str | None, parent: int, name: str) -> None:
    """Give the finished file its name in parent, replacing whatever is there (a stale copy, a
    link: unlink and rename act on the entry itself)."""
    if named is not None:
        os.replace(named, name, src_dir_fd=parent, dst_dir_fd=parent)
        return
    # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names an O_TMPFILE file (open(2)); the
    # absolute source ignores its directory, the new name is made in parent. linkat never
    # replaces, and linking beside and renaming over would name a temp file where the server
    # reads (left there by a kill between the two): the stale entry is removed first instead,
    # so a kill leaves the path absent or whole.
    source = f"/proc/self/fd/{fd}"
    while True:  # each turn lost is another writer's link won: with finitely many, this ends
        try:
            os.link(source, name, dst_dir_fd=parent, follow_symlinks=True)
            return
        except FileExistsError:
            try:
                os.unlink(name, dir_fd=parent)
            except FileNotFoundError:
                pass  # another writer removed it first


def unlink_quietly(parent: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=parent)
    except OSError:
        pass


@functools.cache
def _unnamed_files_possible() -> bool:
    """O_TMPFILE exists here and /proc can name its files (both hold on Linux with /proc mounted)."""
    return hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")


def _write_all(fd: int, chunk: bytes | memoryview, direct: bool, offset: int | None = None) -> bool:
    """Write all of chunk (at offset, if given: pwrite); returns whether the fd still writes directly.

    O_DIRECT needs block-aligned memory, lengths and offsets: the aligned buffers of the S3 data
    plane qualify except for a blob's last chunk. The kernel refuses the others (EINVAL, nothing
    written), and the rest of the file then goes through the page cache.
    """
    view = memoryview(chunk)
    while view:
        try:
            written = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
            direct = False
            continue
        view = view[written:]
        if offset is not None:
            offset += written
    return direct


def write_at(fd: int, chunk: bytes | memoryview, offset: int, direct: bool) -> None:
    """All of chunk at offset in a file write_placed lends (safe from several threads at once)."""
    _write_all(fd, chunk, direct, offset)


def aligned_buffer(size: int) -> mmap.mmap:
    """Page-aligned writable memory (what O_DIRECT writes need); reuse it: fresh pages cost."""
    return mmap.mmap(-1, size)
