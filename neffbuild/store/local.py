"""A store in a local (or network-mounted) directory: the embedded default.

Immutable objects land by hard-linking a process-unique temp file into place, which fails if the
name exists: the local equivalent of S3's If-None-Match.

A tag's compare-and-swap takes no lock (flock does nothing on some network filesystems): each
version of the tag is a new file `tags/.<name>.v/<n>`, linked into place, so of two writers that
read version n only one can create n + 1. The highest version is the tag; `tags/<name>.json`
mirrors it for listings (gc, inspection) and is brought up to the highest version by every
writer after its swap. A tag written by a neffbuild before this (only `tags/<name>.json`) is
read as version 0 and replaced by version 1. Pruning keeps the newest TAG_VERSIONS_KEPT
versions; a link that landed on a pruned name is detected after the link and lost (swap_tag).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, TypeVar

from neffbuild.errors import InputError, IntegrityError, StoreError
from neffbuild.fs.atomic import write_atomic
from neffbuild.fs.confined import disk_error
from neffbuild.hashing import hash_bytes
from neffbuild.names import is_temp_name
from neffbuild.store.layout import LayoutStore
from neffbuild.store.raw import DOC_MAX, Content, NotAnObject, ObjectInfo

TAG_VERSIONS_KEPT = 16  # older versions are deleted: a reader that loses one to that reads again
_T = TypeVar("_T")


class LocalStore(LayoutStore):
    """The layout (store/layout.py) on a directory."""

    def __init__(self, root: Path, *, create: bool = False) -> None:
        self.disk = LocalDisk(root)
        self.root = self.disk.root
        super().__init__(self.disk, create=create)


class LocalDisk:
    """The raw part (store/raw.py) of a local store: files under root."""

    corrupt_hint = "the store is damaged: restore the object, or push the release into a new store"
    missing_hint = "build into it first, or pass --store / set NEFFBUILD_STORE"

    def __init__(self, root: Path) -> None:
        try:
            self.root = root.expanduser().resolve()
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
            raise StoreError(
                f"store {root}: cannot resolve the path ({exc})", hint="check --store / NEFFBUILD_STORE"
            ) from None

    @property
    def url(self) -> str:
        return str(self.root)

    def where(self, key: str) -> str:
        return str(self.root / key)

    def create(self, marker_key: str, marker: bytes) -> None:
        if not _holds_only_a_marker(self.root, marker_key):
            raise StoreError(
                f"{self.root} is not empty and not a neffbuild store",
                hint="choose an empty or new directory for --store",
            )
        _guard(lambda: self.root.mkdir(parents=True, exist_ok=True), self.root)
        self.put_new(marker_key, marker)  # False: another process wrote it first

    def get(self, key: str, limit: int) -> bytes | None:
        return _read_small(self.root / key, limit + 1)

    def put_new(self, key: str, content: Content) -> bool:
        """Linked into place, which fails if the name exists: the local If-None-Match. Flushed
        before it is named; read-only once there, as in dvc's object database."""
        target = self.root / key
        if target.exists():
            return False
        _guard(lambda: target.parent.mkdir(parents=True, exist_ok=True), target)
        return write_atomic(target, content, mode=0o444, replace=False)

    def exists(self, key: str) -> bool:
        return (self.root / key).is_file()

    def open(self, key: str) -> BinaryIO | None:
        """The file, opened (it is its own context manager)."""
        try:
            return _open_regular(self.root / key)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _read_error(self.where(key), exc) from None

    def names(self, folder: str) -> list[str]:
        path = self.root / folder
        try:
            with os.scandir(path) as entries:  # unlike Path.glob, it reports a refusal
                return [e.name for e in entries]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise StoreError(
                f"{path}: cannot list it ({exc.strerror or exc})", hint="check the store's permissions"
            ) from None

    def objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Regular files only; the hidden temp files of writes in flight and locks/ are not objects."""
        folder = self.root / _within(prefix.rpartition("/")[0])
        found = []
        for rel, size, mtime in _walk(folder, self.root):
            if rel.startswith(prefix) and not rel.startswith("locks/"):
                found.append(ObjectInfo(rel, size, mtime))
        yield from sorted(found, key=lambda o: o.key)

    def delete(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """unlink is atomic: a reader that opened the file still reads all of it. Emptied shard
        folders stay: removing one could race a publish that just made it to write into."""
        failures = []
        for key in keys:
            try:
                versions = self._versions(key)  # first: they are the object, where swap made them
                for number in _version_numbers(versions):
                    (versions / str(number)).unlink(missing_ok=True)
                (self.root / key).unlink()
            except (FileNotFoundError, NotADirectoryError):
                pass
            except OSError as exc:
                failures.append((key, exc.strerror or str(exc)))
        return failures

    def run_all(self, tasks: Sequence[Callable[[], _T]], jobs: int) -> list[_T]:
        return [task() for task in tasks]  # a local read is quick: no pool

    # -- compare-and-swap: versions linked into place -------------------------------------------

    def get_versioned(self, key: str, limit: int) -> tuple[bytes, str] | None:
        """The highest version's bytes and "v<n>"; an object from before versions is "v0-<digest>"."""
        versions = self._versions(key)
        for _ in range(100):  # a version deleted between the listing and the read: list again
            found = _highest(versions)
            if found is None:
                legacy = self.get(key, limit)
                return None if legacy is None else (legacy, f"v0-{hash_bytes(legacy)}")
            data = _read_small(versions / str(found), limit + 1)
            if data is not None:
                return data, f"v{found}"
        raise StoreError(f"{versions}: its versions keep vanishing while read", hint="check the store's filesystem")

    def swap(self, key: str, data: bytes, expected: str | None) -> bool:
        """Create version n + 1 where expected is version n: linking it fails if another writer
        created it first (and a version 0 expected must still be the file it was)."""
        versions = self._versions(key)
        current = self._current(key)
        if (current[1] if current else None) != expected:
            return False
        number = 1 if expected is None or expected.startswith("v0-") else int(expected[1:]) + 1
        _guard(lambda: versions.mkdir(parents=True, exist_ok=True), versions)
        if not write_atomic(versions / str(number), data, mode=0o444, replace=False):
            return False  # another writer made this version first: the swap is lost
        # A writer that stalled between its compare and its link (an fsync on NFS) while
        # TAG_VERSIONS_KEPT others moved the tag links a name pruning freed, far below the tag.
        # Versions only grow and pruning needs highest >= number + KEPT: a version not prunable
        # now never was, so it is the first of its number and the swap holds; else it is lost.
        if (_highest(versions) or 0) >= number + TAG_VERSIONS_KEPT:
            (versions / str(number)).unlink(missing_ok=True)
            return False
        self._mirror(key, versions)
        return True

    def _current(self, key: str) -> tuple[bytes, str] | None:
        got = self.get_versioned(key, DOC_MAX)
        if got is not None and len(got[0]) > DOC_MAX:
            raise IntegrityError(f"{self.where(key)}: over {DOC_MAX} bytes, not a document", hint=self.corrupt_hint)
        return got

    def _versions(self, key: str) -> Path:
        """Where swap keeps an object's versions: tags/prod.json's in tags/.prod.v/ (hidden, never listed)."""
        path = self.root / key
        return path.with_name(f".{path.stem}.v")

    def _mirror(self, key: str, versions: Path) -> None:
        """key := the highest version, checked again after each write so that the last writer
        leaves it current; versions far below it are deleted."""
        while (current := self._current(key)) is not None:
            write_atomic(self.root / key, current[0])
            after = self._current(key)
            if after is None or after[1] == current[1]:
                break
        highest = _highest(versions) or 0
        for old in _version_numbers(versions):
            if old <= highest - TAG_VERSIONS_KEPT:
                (versions / str(old)).unlink(missing_ok=True)


def _version_numbers(versions: Path) -> list[int]:
    try:
        with os.scandir(versions) as entries:
            return [int(e.name) for e in entries if e.name.isascii() and e.name.isdigit()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise _read_error(versions, exc) from None


def _highest(versions: Path) -> int | None:
    return max(_version_numbers(versions), default=None)


def _read_error(where: object, exc: OSError) -> StoreError:
    """Reading the store failed: a store error (its permissions), not a local disk one, whatever
    disk the store is on."""
    return StoreError(f"{where}: cannot read it ({exc.strerror or exc})", hint="check the store's permissions")


def _read_small(path: Path, limit: int) -> bytes | None:
    """At most limit bytes of the regular file at path, or None if there is none; something else
    at path (a FIFO, a directory...) is NotAnObject."""
    try:
        with _open_regular(path) as f:
            return f.read(limit)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise _read_error(path, exc) from None


def _open_regular(path: Path) -> BinaryIO:
    """path opened for reading if it is a regular file (symlinks followed), else NotAnObject.

    O_NONBLOCK: opening a FIFO with no writer then returns at once instead of waiting for one
    (and a device is not waited on either); fstat then tells what was opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotAnObject(str(path), _KINDS.get(stat.S_IFMT(mode), "special file"))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


_KINDS = {
    stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device", stat.S_IFSOCK: "socket", stat.S_IFDIR: "directory",
}  # fmt: skip  # a table: its rows packed, not one item a line


def _within(rel: str) -> str:
    """A relative folder that cannot leave the store root (a listing prefix from a caller)."""
    if rel.startswith("/") or any(p in (".", "..") for p in rel.split("/")):
        raise InputError(
            f"listing prefix {rel!r}: not a folder of the store", hint="give a prefix such as blobs/ or releases/"
        )
    return rel


def _walk(folder: Path, root: Path) -> Iterator[tuple[str, int, float]]:
    """(key relative to root, size, mtime) of each regular, non-hidden file below folder. A folder
    that cannot be read is an error: gc and verify must not take unseen objects for absent ones."""

    def fail(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError | NotADirectoryError):  # gone meanwhile, or a file: nothing below
            raise StoreError(
                f"{exc.filename}: cannot list it ({exc.strerror or exc})", hint="check the store's permissions"
            )

    for path, dirs, files in os.walk(folder, onerror=fail):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # a tag's versions: its mirror is the object
        for name in files:
            if name.startswith("."):
                continue
            try:
                st = os.lstat(os.path.join(path, name))
            except FileNotFoundError:  # deleted since the folder was read
                continue
            except OSError as exc:
                raise StoreError(
                    f"{os.path.join(path, name)}: cannot stat it ({exc.strerror or exc})",
                    hint="check the store's permissions",
                ) from None
            if stat.S_ISREG(st.st_mode):
                yield Path(path, name).relative_to(root).as_posix(), st.st_size, st.st_mtime


def _holds_only_a_marker(root: Path, marker_key: str) -> bool:
    """Absent, empty, or holding just the marker (or its temp file) that another process creating
    the same store at this moment has written: the caller reads and checks that marker after."""
    temp = f".{marker_key}."  # fs.atomic's temp files: .<name>.<pid>.<random>.incomplete
    try:
        with os.scandir(root) as entries:
            return all(e.name == marker_key or (e.name.startswith(temp) and is_temp_name(e.name)) for e in entries)
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        raise StoreError(f"{root} is not a directory", hint="choose a directory for --store") from None
    except OSError as exc:
        raise disk_error(exc, root) from None


def _guard(action, path: Path) -> None:
    try:
        action()
    except OSError as exc:
        raise disk_error(exc, path) from None
