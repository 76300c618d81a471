"""The raw part of a store: what a medium (a directory, a bucket) must do, and nothing of the layout.

A store is a medium below the layout layer (store/layout.py), which alone knows the layout
(store/base.py: the marker, blobs, documents, tags, what may be deleted) and how blobs travel
(store/loose.py, or a plane of the store's own such as S3's packs). Adding a store means
implementing RawStore and a line in open_store; docs/architecture.md lists the files.

Keys are relative to the store root and come from the layout only ("blobs/ab/ab12...",
"tags/prod.json"). Every read is bounded by the caller's limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO, Protocol, TypeVar

DOC_MAX = 256 << 20  # no document is read past this (a release of a million files is ~150 MB)
Content = bytes | Callable[[BinaryIO], None]  # the bytes, or a function that writes them
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One stored object, as a listing reports it."""

    key: str  # relative to the store root, e.g. blobs/ab/ab12...
    size: int  # bytes
    mtime: float  # last written, seconds since the epoch (UTC): compared with time.time() for gc's grace period


class NotAnObject(Exception):
    """Something at a key that is not a readable object (a FIFO, a directory): the layout says
    what it expected there."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__(f"{where}: {kind}")
        self.where = where
        self.kind = kind


class RawStore(Protocol):
    """The operations a store's medium provides; the layout layer builds every Store method on them."""

    corrupt_hint: str  # the hint of an IntegrityError about one of its objects
    missing_hint: str  # the hint when no store is found at its URL

    @property
    def url(self) -> str: ...

    def where(self, key: str) -> str:
        """The object's URL or path, for messages."""

    def create(self, marker_key: str, marker: bytes) -> None:
        """Make an empty store: refuse (StoreError) a medium that holds anything but a marker, then
        write the marker unless another process creating the same store wrote it first."""

    def get(self, key: str, limit: int) -> bytes | None:
        """At most limit + 1 bytes of an object (one more proves it too long: the caller decides),
        or None if absent; NotAnObject if something else is there."""

    def get_versioned(self, key: str, limit: int) -> tuple[bytes, str] | None:
        """get, and an opaque version token for swap."""

    def put_new(self, key: str, content: Content) -> bool:
        """Write an object unless the key exists (atomically: whole or not at all); False if it did."""

    def swap(self, key: str, data: bytes, expected: str | None) -> bool:
        """Replace the object only if its version is still `expected` (None: only if absent)."""

    def exists(self, key: str) -> bool: ...

    def open(self, key: str) -> AbstractContextManager[BinaryIO] | None:
        """A readable stream of the object, or None if absent; NotAnObject if something else is there."""

    def names(self, folder: str) -> list[str]:
        """The names of the objects directly in folder (no further "/"), in any order."""

    def objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with prefix, in key order (nothing of the medium's own:
        locks, temp files of writes in flight, versions kept for swap)."""

    def delete(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """Delete a batch of objects (with whatever swap kept for them); an absent one is no error.
        The (key, why) of each that could not be deleted."""

    def run_all(self, tasks: Sequence[Callable[[], _T]], jobs: int) -> list[_T]:
        """Run small reads, up to jobs at a time where that is faster (a remote medium), results in order."""
