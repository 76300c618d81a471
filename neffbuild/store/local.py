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

import json
import os
import stat
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import BinaryIO

from neffbuild.errors import InputError, IntegrityError, NeffbuildError, NotFoundError, StoreError
from neffbuild.fs.atomic import write_atomic
from neffbuild.fs.confined import BlobTarget, Parents, disk_error, write_verified
from neffbuild.hashing import CHUNK, copy_hashing, hash_bytes
from neffbuild.store.base import (
    DOC_MAX,
    MARKER,
    MARKER_HINT,
    MARKER_MAX,
    STORE_FORMAT,
    BlobSource,
    DocKind,
    ObjectInfo,
    blob_key,
    check_deletable,
    check_marker,
    deletion_failed,
    doc_key,
)

TAG_VERSIONS_KEPT = 16  # older versions are deleted: a reader that loses one to that reads again


class LocalStore:
    def __init__(self, root: Path, *, create: bool = False) -> None:
        try:
            self.root = root.expanduser().resolve()
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
            raise StoreError(
                f"store {root}: cannot resolve the path ({exc})", hint="check --store / NEFFBUILD_STORE"
            ) from None
        marker = self.root / MARKER
        data = self._read_marker(marker)
        if data is not None:
            check_marker(data, str(marker))
            return
        if not create:
            raise StoreError(
                f"no neffbuild store at {self.root}", hint="build into it first, or pass --store / set NEFFBUILD_STORE"
            )
        if not _is_empty_or_absent(self.root):
            raise StoreError(
                f"{self.root} is not empty and not a neffbuild store",
                hint="choose an empty or new directory for --store",
            )
        _guard(lambda: self.root.mkdir(parents=True, exist_ok=True), self.root)
        self._write_new(MARKER, json.dumps({"format": STORE_FORMAT}).encode())

    @staticmethod
    def _read_marker(marker: Path) -> bytes | None:
        """The marker's bytes (at most MARKER_MAX + 1), or None if there is none."""
        return _read_small(
            marker,
            MARKER_MAX + 1,
            lambda found: StoreError(f"{marker}: a {found}, not a store marker", hint=MARKER_HINT),
        )

    @property
    def url(self) -> str:
        return str(self.root)

    def missing_blobs(self, digests: Collection[str]) -> set[str]:
        return {d for d in digests if not (self.root / blob_key(d)).is_file()}

    def put_blob(self, digest: str, source: Path) -> int:
        target = self.root / blob_key(digest)
        if target.is_file():
            return 0
        _guard(lambda: target.parent.mkdir(parents=True, exist_ok=True), target)
        copied: list[int] = []

        def copy(dst: BinaryIO) -> None:
            with source.open("rb") as src:
                got = copy_hashing(src, dst)
            if got.hex != digest:
                raise IntegrityError(
                    f"{source}: changed while publishing to {target} (digest {got.hex}, expected {digest})",
                    hint="rebuild, then publish",
                )
            copied.append(got.size)

        # Flushed before it is named, and so before any record that points at it can be written.
        # Verified objects are read-only, as in dvc's object database.
        landed = write_atomic(target, copy, mode=0o444, replace=False)
        return copied[0] if landed else 0

    def put_blobs(self, sources: Sequence[BlobSource], jobs: int) -> int:
        wanted = self.missing_blobs({s.digest for s in sources})
        todo = list({s.digest: s for s in sources if s.digest in wanted}.values())
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return sum(pool.map(lambda s: self.put_blob(s.digest, s.path), todo))

    def put_locator(self, release_id: str, digests: Collection[str]) -> None:
        """Nothing to record: every blob is a file of its own, found by its name."""

    def download_blobs(self, targets: Sequence[BlobTarget], jobs: int, *, release: str | None = None) -> None:
        with Parents() as parents, ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(partial(self._download_one, parents=parents), targets))

    def _download_one(self, target: BlobTarget, *, parents: Parents) -> None:
        with self.open_blob(target.digest, needed_for=target.dest) as stream:
            origin = f"{self.url}/{blob_key(target.digest)}"
            write_verified(target, _chunks(stream, target.size + 1), origin=origin, parents=parents)

    def open_blob(self, digest: str, *, needed_for: Path | None = None) -> BinaryIO:
        """The blob's file, opened (it is its own context manager); each way that fails is a typed
        error naming it (and the file it was read for)."""
        where = f"{self.url}/{blob_key(digest)}"
        need = f" (needed for {needed_for})" if needed_for else ""
        try:
            return _open_regular(self.root / blob_key(digest))
        except FileNotFoundError:
            raise NotFoundError(
                f"blob {digest} missing from store {self.url}{need}", hint="re-push the release"
            ) from None
        except _NotRegular as exc:
            raise IntegrityError(f"{where} is a {exc.kind}, not a regular file{need}", hint=CORRUPT_HINT) from None
        except OSError as exc:
            raise _read_error(where, exc, need) from None

    def put_doc(self, kind: DocKind, name: str, data: bytes) -> bool:
        return self._write_new(doc_key(kind, name), data)

    def get_doc(self, kind: DocKind, name: str) -> bytes | None:
        if kind == "tags":  # its highest version, not the mirror (which may lag a swap in flight)
            current = self.read_tag(name)
            return None if current is None else current[0]
        return self._read_doc(doc_key(kind, name))

    def list_docs(self, kind: DocKind) -> Iterator[str]:
        folder = self.root / kind
        try:
            with os.scandir(folder) as entries:  # unlike Path.glob, it reports a refusal
                names = sorted(e.name[: -len(".json")] for e in entries if e.name.endswith(".json"))
        except (FileNotFoundError, NotADirectoryError):
            names = []
        except OSError as exc:
            raise StoreError(
                f"{folder}: cannot list it ({exc.strerror or exc})", hint="check the store's permissions"
            ) from None
        yield from names

    def get_docs(self, kind: DocKind, names: Iterable[str], jobs: int) -> dict[str, bytes | None]:
        return {n: self.get_doc(kind, n) for n in sorted(set(names))}  # a local read is quick: no pool

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Regular files only; the hidden temp files of writes in flight and locks/ are not objects."""
        folder = self.root / _within(prefix.rpartition("/")[0])
        found = []
        for rel, size, mtime in _walk(folder, self.root):
            if rel.startswith(prefix) and not rel.startswith("locks/"):
                found.append(ObjectInfo(rel, size, mtime))
        yield from sorted(found, key=lambda o: o.key)

    def delete_objects(self, keys: Iterable[str]) -> None:
        """unlink is atomic: a reader that opened the file still reads all of it. Emptied shard
        folders stay: removing one could race a publish that just made it to write into."""
        failures = []
        for key in [check_deletable(k) for k in keys]:
            try:
                if key.startswith("tags/") and key.endswith(".json"):  # its versions first: they are the tag
                    versions = self.root / "tags" / f".{key[5:-5]}.v"
                    for number in _version_numbers(versions):
                        (versions / str(number)).unlink(missing_ok=True)
                (self.root / key).unlink()
            except (FileNotFoundError, NotADirectoryError):
                pass
            except OSError as exc:
                failures.append((key, exc.strerror or str(exc)))
        if failures:
            raise deletion_failed(self.url, failures)

    def pack_indexes(self) -> tuple[dict, dict[str, str]]:
        return {}, {}  # every blob is a file of its own

    def read_tag(self, name: str) -> tuple[bytes, str] | None:
        """The highest version's bytes and "v<n>"; a tag from before versions is "v0-<digest>"."""
        versions = self._tag_versions(name)
        for _ in range(100):  # a version deleted between the listing and the read: list again
            found = _highest(versions)
            if found is None:
                legacy = self._read_doc(doc_key("tags", name))
                return None if legacy is None else (legacy, f"v0-{hash_bytes(legacy)}")
            data = self._read_doc(f"{versions.relative_to(self.root).as_posix()}/{found}")
            if data is not None:
                return data, f"v{found}"
        raise StoreError(f"{versions}: its versions keep vanishing while read", hint="check the store's filesystem")

    def swap_tag(self, name: str, data: bytes, expected: str | None) -> bool:
        """Create version n + 1 where expected is version n: linking it fails if another writer
        created it first (and a version 0 expected must still be the file it was)."""
        versions = self._tag_versions(name)
        current = self.read_tag(name)
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
        self._mirror_tag(name, versions)
        return True

    def _tag_versions(self, name: str) -> Path:
        doc_key("tags", name)  # checks the name
        return self.root / "tags" / f".{name}.v"

    def _mirror_tag(self, name: str, versions: Path) -> None:
        """tags/<name>.json := the highest version, checked again after each write so that the
        last writer leaves it current; versions far below it are deleted."""
        while (current := self.read_tag(name)) is not None:
            write_atomic(self.root / doc_key("tags", name), current[0])
            after = self.read_tag(name)
            if after is None or after[1] == current[1]:
                break
        highest = _highest(versions) or 0
        for old in _version_numbers(versions):
            if old <= highest - TAG_VERSIONS_KEPT:
                (versions / str(old)).unlink(missing_ok=True)

    def _read_doc(self, key: str) -> bytes | None:
        path = self.root / key
        data = _read_small(
            path, DOC_MAX + 1, lambda found: IntegrityError(f"{path} is a {found}, not a document", hint=CORRUPT_HINT)
        )
        if data is not None and len(data) > DOC_MAX:
            raise IntegrityError(f"{path}: over {DOC_MAX} bytes, not a document", hint=CORRUPT_HINT)
        return data

    def _write_new(self, key: str, data: bytes) -> bool:
        target = self.root / key
        if target.exists():
            return False
        _guard(lambda: target.parent.mkdir(parents=True, exist_ok=True), target)
        return write_atomic(target, data, mode=0o444, replace=False)


CORRUPT_HINT = "the store is damaged: restore the object, or push the release into a new store"


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


class _NotRegular(Exception):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def _read_error(where: object, exc: OSError, context: str = "") -> StoreError:
    """Reading the store failed: a store error (its permissions), not a local disk one, whatever
    disk the store is on."""
    return StoreError(f"{where}: cannot read it ({exc.strerror or exc}){context}", hint="check the store's permissions")


def _read_small(path: Path, limit: int, not_regular: Callable[[str], NeffbuildError]) -> bytes | None:
    """At most limit bytes of the regular file at path, or None if there is none; something else
    at path (a FIFO, a directory...) is not_regular(its kind)."""
    try:
        with _open_regular(path) as f:
            return f.read(limit)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except _NotRegular as exc:
        raise not_regular(exc.kind) from None
    except OSError as exc:
        raise _read_error(path, exc) from None


def _open_regular(path: Path) -> BinaryIO:
    """path opened for reading if it is a regular file (symlinks followed), else _NotRegular.

    O_NONBLOCK: opening a FIFO with no writer then returns at once instead of waiting for one
    (and a device is not waited on either); fstat then tells what was opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _NotRegular(_KINDS.get(stat.S_IFMT(mode), "special file"))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


_KINDS = {
    stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device", stat.S_IFSOCK: "socket", stat.S_IFDIR: "directory",
}  # fmt: skip


def _chunks(stream: BinaryIO, limit: int) -> Iterator[bytes]:
    """At most limit bytes of stream, in chunks (a file that keeps growing is not read forever);
    a read error is the store's (write_verified says so)."""
    while limit > 0 and (chunk := stream.read(min(CHUNK, limit))):
        limit -= len(chunk)
        yield chunk


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


def _is_empty_or_absent(root: Path) -> bool:
    try:
        with os.scandir(root) as entries:
            return next(entries, None) is None
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
