"""The layout layer: every Store method (store/base.py) on top of any raw store (store/raw.py).

It alone knows the layout: the marker, which key a document or tag has, how big a read may be,
what may be deleted and in what batches; blobs go through a blob plane (store/loose.py by
default). A store is a LayoutStore given its raw part (and its own blob plane, if it has one).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from neffbuild.errors import IntegrityError, StoreError
from neffbuild.fs.confined import BlobTarget
from neffbuild.store.base import (
    DELETE_BATCH,
    MARKER,
    MARKER_HINT,
    MARKER_MAX,
    STORE_FORMAT,
    DocKind,
    ObjectInfo,
    check_deletable,
    check_marker,
    deletion_failed,
    doc_key,
)
from neffbuild.store.loose import BlobPlane, LooseBlobs
from neffbuild.store.raw import DOC_MAX, NotAnObject, RawStore

if TYPE_CHECKING:  # annotations only: a store's reader builds none of them
    from neffbuild.store.blobs import BlobSource, PackIndex

MARKER_BYTES = json.dumps({"format": STORE_FORMAT}).encode()


class LayoutStore:
    def __init__(
        self, raw: RawStore, *, blobs: BlobPlane | None = None, create: bool = False, marker: bytes = MARKER_BYTES
    ) -> None:
        self.raw = raw
        self.blobs: BlobPlane = blobs or LooseBlobs(raw)
        data = self._marker()
        if data is None and create:
            raw.create(MARKER, marker)
            data = self._marker()
        if data is None:
            raise StoreError(f"no neffbuild store at {raw.url}", hint=raw.missing_hint)
        check_marker(data, raw.where(MARKER))

    def _marker(self) -> bytes | None:
        try:
            return self.raw.get(MARKER, MARKER_MAX)
        except NotAnObject as exc:
            raise StoreError(f"{exc.where}: a {exc.kind}, not a store marker", hint=MARKER_HINT) from None

    @property
    def url(self) -> str:
        return self.raw.url

    # -- blobs ---------------------------------------------------------------------------------

    def missing_blobs(self, digests: Collection[str]) -> set[str]:
        return self.blobs.missing(digests)

    def put_blob(self, digest: str, source: Path) -> int:
        return self.blobs.put(digest, source)

    def put_blobs(self, sources: Sequence[BlobSource], jobs: int) -> int:
        return self.blobs.put_all(sources, jobs)

    def put_locator(self, release_id: str, digests: Collection[str]) -> None:
        self.blobs.put_locator(release_id, digests)

    def download_blobs(self, targets: Sequence[BlobTarget], jobs: int, *, release: str | None = None) -> None:
        self.blobs.download(targets, jobs, release)

    def open_blob(self, digest: str) -> AbstractContextManager[BinaryIO]:
        return self.blobs.open(digest)

    def pack_indexes(self) -> tuple[dict[str, PackIndex], dict[str, str]]:
        return self.blobs.pack_indexes()

    # -- documents and tags --------------------------------------------------------------------

    def put_doc(self, kind: DocKind, name: str, data: bytes) -> bool:
        return self.raw.put_new(doc_key(kind, name), data)

    def get_doc(self, kind: DocKind, name: str) -> bytes | None:
        if kind == "tags":  # as read_tag reads it (a local store: its highest version)
            current = self.read_tag(name)
            return None if current is None else current[0]
        key = doc_key(kind, name)
        try:
            data = self.raw.get(key, DOC_MAX)
        except NotAnObject as exc:
            raise self._not_a_document(exc) from None
        return None if data is None else self._within_limit(key, data)

    def get_docs(self, kind: DocKind, names: Iterable[str], jobs: int) -> dict[str, bytes | None]:
        unique = sorted(set(names))
        got = self.raw.run_all([partial(self.get_doc, kind, n) for n in unique], jobs)
        return dict(zip(unique, got, strict=True))

    def list_docs(self, kind: DocKind) -> Iterator[str]:
        yield from sorted(n[: -len(".json")] for n in self.raw.names(kind) if n.endswith(".json"))

    def read_tag(self, name: str) -> tuple[bytes, str] | None:
        key = doc_key("tags", name)
        try:
            got = self.raw.get_versioned(key, DOC_MAX)
        except NotAnObject as exc:
            raise self._not_a_document(exc) from None
        return None if got is None else (self._within_limit(key, got[0]), got[1])

    def swap_tag(self, name: str, data: bytes, expected: str | None) -> bool:
        return self.raw.swap(doc_key("tags", name), data, expected)

    def _within_limit(self, key: str, data: bytes) -> bytes:
        if len(data) > DOC_MAX:
            raise IntegrityError(
                f"{self.raw.where(key)}: over {DOC_MAX} bytes, not a document", hint=self.raw.corrupt_hint
            )
        return data

    def _not_a_document(self, exc: NotAnObject) -> IntegrityError:
        return IntegrityError(f"{exc.where} is a {exc.kind}, not a document", hint=self.raw.corrupt_hint)

    # -- any object: listing and deleting ------------------------------------------------------

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.raw.objects(prefix)

    def delete_objects(self, keys: Iterable[str]) -> None:
        todo = [check_deletable(k) for k in keys]
        failures: list[tuple[str, str]] = []
        for start in range(0, len(todo), DELETE_BATCH):
            failures += self.raw.delete(todo[start : start + DELETE_BATCH])
        if failures:
            raise deletion_failed(self.url, failures)
