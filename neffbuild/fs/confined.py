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
hold for reading (see `Beneath`): a link at a release path is never "present".
"""

from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os
import stat
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from neffbuild.errors import DiskError, IntegrityError, StoreError
from neffbuild.fs.disk import disk_error as disk_error  # named here too: the fs/ writers raise it
from neffbuild.fs.disk import sync_filesystem as sync_filesystem
from neffbuild.hashing import Hasher, hash_whole
from neffbuild.names import INCOMPLETE_SUFFIX

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
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
HASH_CHUNK = 4 << 20  # reading back to hash: large reads, few system calls


Hashed = tuple[str, str]  # (XXH3-128 hex, BLAKE3 hex or "" where not asked for)


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
        self._fds: dict[tuple[Path | None, Path], int] = {}
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
        key = (target.root, target.dest.parent)
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
    dest = target.dest
    parent = -1  # dest's directory, reached without links (see the module docstring)
    named: str | None = None  # the temp file's name in parent, when it has one
    landed = False
    try:
        parent = _open_parent(target) if parents is None else parents.of(target)
        fd, named, direct = _open_temp(parent, dest.name, direct=target.direct and target.size >= DIRECT_MIN)
        try:
            hasher = Hasher(crypto=bool(target.blake3))
            size = 0
            for chunk in _bounded(chunks, target, origin):
                hasher.update(chunk)
                direct = _write_all(fd, chunk, direct)
                size += len(chunk)
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


@contextmanager
def opened_dir(path: Path, *, shown: Path | None = None) -> Iterator[int]:
    """A descriptor of the directory path for the block (for the *at calls); DiskError naming
    shown (default: path) if it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise disk_error(exc, shown or path) from None
    try:
        yield fd
    finally:
        os.close(fd)


def open_dir_beneath(start: int, start_path: Path, parts: Sequence[str], *, create: bool) -> int:
    """A new descriptor of start/parts..., opened one component at a time, following no link.

    Missing directories are made if create, else FileNotFoundError; a symlink on the way is a
    DiskError naming it (start_path/...).
    """
    fd = start
    try:
        for i, part in enumerate(parts):
            try:
                child = _open_child_dir(fd, part, create)
            except _LinkFound:
                raise link_refused(start_path.joinpath(*parts[: i + 1])) from None
            if fd != start:
                os.close(fd)
            fd = child
    except BaseException:
        if fd != start:
            os.close(fd)
        raise
    return fd if fd != start else os.dup(start)


class _LinkFound(Exception):
    """A symlink where a directory was to be opened (the caller names it)."""


def _open_child_dir(parent: int, name: str, create: bool) -> int:
    try:
        return _open_dir_at(parent, name)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, 0o777, dir_fd=parent)
    except FileExistsError:
        pass  # made by a parallel writer (or a link put there: the open below refuses it)
    return _open_dir_at(parent, name)


def _open_dir_at(parent: int, name: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        # O_NOFOLLOW | O_DIRECTORY refuses a link with ENOTDIR or ELOOP, as it refuses a file.
        if exc.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(parent, name):
            raise _LinkFound from None
        raise


def _is_link(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def link_refused(path: Path) -> DiskError:
    return DiskError(
        f"{path}: is a symbolic link; pull follows no link inside the cache dir",
        hint="remove it (to keep the cache elsewhere, point --cache-dir itself there)",
    )


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


class Beneath:
    """Looks up paths below a directory the way write_verified lands them: no link followed.

    Keeps the directories of the last lookup open, so paths visited in sorted order (a
    release's) cost one open per new directory. One thread at a time.
    """

    def __init__(self, root: int, root_path: Path) -> None:
        self.root, self.root_path = root, root_path
        self._chain: list[tuple[str, int]] = []  # (name, fd) from the root down
        self._read_buffer = memoryview(bytearray())
        self._last: tuple[str | None, int] = (None, root)  # (directory, fd) of the last lookup

    def __enter__(self) -> Beneath:
        return self

    def __exit__(self, *exc: object) -> None:
        self._trim(0)

    def parent(self, rel: str) -> int | None:
        """The directory holding rel (borrowed: valid until the next call), or None if absent."""
        head = rel.rpartition("/")[0]
        if head == self._last[0]:  # rel's neighbour came before it (a release is sorted)
            return self._last[1]
        parts = head.split("/") if head else []
        keep = 0
        while keep < min(len(parts), len(self._chain)) and self._chain[keep][0] == parts[keep]:
            keep += 1
        self._trim(keep)
        fd = self._chain[-1][1] if self._chain else self.root
        for i in range(keep, len(parts)):
            try:
                fd = _open_dir_at(fd, parts[i])
            except FileNotFoundError:
                return None
            except _LinkFound:
                raise link_refused(self.root_path.joinpath(*parts[: i + 1])) from None
            self._chain.append((parts[i], fd))
        self._last = (head, fd)
        return fd

    def lstat(self, rel: str) -> os.stat_result | None:
        """rel's own status (a link is reported as one, never followed), or None if absent."""
        parent = self.parent(rel)
        if parent is None:
            return None
        try:
            return os.stat(rel.rpartition("/")[2], dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def hash_file(self, rel: str, limit: int) -> str | None:
        """XXH3-128 of the regular file rel if it holds at most limit bytes, else None."""
        fd = self._open_file(rel)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                return None
            found = self._hash_open(fd, limit, st.st_size, crypto=False)
            return None if found is None else found[0]
        finally:
            os.close(fd)

    def look(self, rel: str, size: int, *, crypto: bool = False) -> tuple[os.stat_result, Hashed | None] | None:
        """rel's status and, if it holds size bytes, their (XXH3-128, BLAKE3 if asked, else "")
        (None: another length); None if absent or not a regular file. One open answers both: no
        stat pass before reading, and one read feeds both hashes."""
        fd = self._open_file(rel)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            return st, (self._hash_open(fd, size, st.st_size, crypto=crypto) if st.st_size == size else None)
        finally:
            os.close(fd)

    def _open_file(self, rel: str) -> int | None:
        """rel opened for reading, or None if absent or a link (never counted as present).
        O_NONBLOCK: a FIFO put there opens without waiting for a writer (and fstat tells)."""
        parent = self.parent(rel)
        if parent is None:
            return None
        try:
            return os.open(rel.rpartition("/")[2], _READ_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None
            raise

    def _hash_open(self, fd: int, limit: int, expected: int, *, crypto: bool) -> Hashed | None:
        """(XXH3-128, BLAKE3 or "") of what fd holds if at most limit bytes, else None;
        expected: fstat's size."""
        # Into one reused buffer, read to limit + 1 (one byte more says it is too long): no
        # allocation per chunk, and the read and the hash of a large chunk both drop the GIL.
        view = self._read_buffer
        if len(view) <= limit:
            view = self._buffer(limit + 1)
        asked = min(len(view), limit + 1)
        n = os.readv(fd, [view[:asked]])
        # A regular file reads short only at its end: a file that fit is whole (no read of 0),
        # hashed in one call per digest (most cache files are small: this is verify's per-file cost).
        if n < asked and n == expected:
            return hash_whole(view[:n], crypto=crypto)
        hasher = Hasher(crypto=crypto)
        size = 0
        while n:
            hasher.update(view[:n])
            size += n
            if size > limit or (n < asked and size == expected):
                break
            asked = min(len(view), limit + 1 - size)
            n = os.readv(fd, [view[:asked]])
        return (hasher.xxh3(), hasher.crypto()) if size <= limit else None

    def _buffer(self, wanted: int) -> memoryview:
        """A read buffer of at most HASH_CHUNK bytes, grown as files need it."""
        if len(self._read_buffer) < min(wanted, HASH_CHUNK):
            self._read_buffer = memoryview(bytearray(min(wanted, HASH_CHUNK)))
        return self._read_buffer

    def _trim(self, keep: int) -> None:
        self._last = (None, self.root)
        while len(self._chain) > keep:
            os.close(self._chain.pop()[1])


def aligned_buffer(size: int) -> mmap.mmap:
    """Page-aligned writable memory (what O_DIRECT writes need); reuse it: fresh pages cost."""
    return mmap.mmap(-1, size)
