"""Blobs as objects of their own (blobs/<d[:2]>/<d>), on any raw store: the layout's default blob
plane (the local store's). A store with ranged reads may bring a plane of its own (S3: packs)."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

from neffbuild.errors import IntegrityError, NeffbuildError, NotFoundError
from neffbuild.fs.confined import BlobTarget, Parents, write_verified
from neffbuild.hashing import CHUNK, copy_hashing
from neffbuild.store.base import blob_key
from neffbuild.store.raw import NotAnObject, RawStore

if TYPE_CHECKING:  # annotations only: a store's reader builds none of them
    from neffbuild.store.blobs import BlobSource, PackIndex


class BlobPlane(Protocol):
    """How blobs travel to and from a store: the blob half of the Store protocol (store/base.py)."""

    def missing(self, digests: Collection[str]) -> set[str]: ...
    def put(self, digest: str, source: Path) -> int: ...
    def put_all(self, sources: Sequence[BlobSource], jobs: int) -> int: ...
    def put_locator(self, release_id: str, digests: Collection[str]) -> None: ...
    def download(self, targets: Sequence[BlobTarget], jobs: int, release: str | None) -> None: ...
    def open(self, digest: str) -> AbstractContextManager[BinaryIO]: ...
    def pack_indexes(self) -> tuple[dict[str, PackIndex], dict[str, str]]: ...


class LooseBlobs:
    def __init__(self, raw: RawStore) -> None:
        self._raw = raw

    def missing(self, digests: Collection[str]) -> set[str]:
        return {d for d in digests if not self._raw.exists(blob_key(d))}

    def put(self, digest: str, source: Path) -> int:
        key = blob_key(digest)
        if self._raw.exists(key):
            return 0
        copied: list[int] = []

        def copy(dst: BinaryIO) -> None:
            with source.open("rb") as src:
                got = copy_hashing(src, dst)
            if got.hex != digest:
                raise IntegrityError(
                    f"{source}: changed while publishing to {self._raw.where(key)} (digest {got.hex}, expected {digest})",
                    hint="rebuild, then publish",
                )
            copied.append(got.size)

        # Written whole before it is named, and so before any record that points at it.
        return copied[0] if self._raw.put_new(key, copy) else 0

    def put_all(self, sources: Sequence[BlobSource], jobs: int) -> int:
        wanted = self.missing({s.digest for s in sources})
        todo = list({s.digest: s for s in sources if s.digest in wanted}.values())
        from concurrent.futures import ThreadPoolExecutor  # not on a no-op pull's start-up

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return sum(pool.map(lambda s: self.put(s.digest, s.path), todo))

    def put_locator(self, release_id: str, digests: Collection[str]) -> None:
        """Nothing to record: every blob is an object of its own, found by its name."""

    def download(self, targets: Sequence[BlobTarget], jobs: int, release: str | None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with Parents() as parents, ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(partial(self._download_one, parents=parents), targets))

    def _download_one(self, target: BlobTarget, *, parents: Parents) -> None:
        with self.open(target.digest, needed_for=target.dest) as stream:
            origin = self._raw.where(blob_key(target.digest))
            write_verified(target, _chunks(stream, target.size + 1), origin=origin, parents=parents)

    def open(self, digest: str, *, needed_for: Path | None = None) -> AbstractContextManager[BinaryIO]:
        """The blob's stream; each way that fails is a typed error naming it (and the file it was read for)."""
        where = self._raw.where(blob_key(digest))
        need = f" (needed for {needed_for})" if needed_for else ""
        try:
            opened = self._raw.open(blob_key(digest))
        except NotAnObject as exc:
            raise IntegrityError(
                f"{where} is a {exc.kind}, not a regular file{need}", hint=self._raw.corrupt_hint
            ) from None
        except NeffbuildError as exc:
            raise type(exc)(f"{exc.message}{need}", hint=exc.hint) from None
        if opened is None:
            raise NotFoundError(f"blob {digest} missing from store {self._raw.url}{need}", hint="re-push the release")
        return opened

    def pack_indexes(self) -> tuple[dict[str, PackIndex], dict[str, str]]:
        return {}, {}  # every blob is an object of its own


def _chunks(stream: BinaryIO, limit: int) -> Iterator[bytes]:
    """At most limit bytes of stream, in chunks (a file that keeps growing is not read forever);
    a read error is the store's (write_verified says so)."""
    while limit > 0 and (chunk := stream.read(min(CHUNK, limit))):
        limit -= len(chunk)
        yield chunk
