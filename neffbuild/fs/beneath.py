"""Looking up and opening paths beneath a directory without following a link: each directory
opened one component at a time relative to its parent's descriptor, with O_NOFOLLOW (the rules
fs/confined.py lands files by, for reading: a link at a release path is never "present")."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from neffbuild.errors import DiskError
from neffbuild.fs.disk import disk_error
from neffbuild.hashing import Hasher, hash_whole

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
HASH_CHUNK = 4 << 20  # reading back to hash: large reads, few system calls

Hashed = tuple[str, str]  # (XXH3-128 hex, BLAKE3 hex or "" where not asked for)


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

    def regular_stats(self, rels: Iterable[str], into: list[os.stat_result | None]) -> None:
        """Append each rel's own status where it is a regular file, else None (absent, a link, a
        directory, a FIFO...): one stat per path, as lstat's, in a loop kept bare (a no-op pull
        checks 10,000s). On an error, len(into) says which rel it was."""
        into.extend(self._regular(rels))

    def regular_sizes(self, rels: Iterable[str], sizes: list[int | None], mtimes: list[int | None]) -> None:
        """regular_stats' answers as two columns: each rel's size and mtime (ns) where it is a
        regular file, else None in both. No status is kept (10,000 of them fault in some 1,300
        fresh pages: ~4 ms of a no-op pull). On an error, len(sizes) says which rel it was."""
        for st in self._regular(rels):
            sizes.append(None if st is None else st.st_size)
            mtimes.append(None if st is None else st.st_mtime_ns)

    def _regular(self, rels: Iterable[str]) -> Iterator[os.stat_result | None]:
        regular = stat.S_ISREG
        last: str | None = None
        parent: int | None = None
        for rel in rels:
            head, _, name = rel.rpartition("/")
            if head != last:
                parent, last = self.parent(rel), head
            if parent is None:
                yield None
                continue
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                yield None
                continue
            yield st if regular(st.st_mode) else None

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
