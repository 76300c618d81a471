"""The storage protocol every store implements (local directory, S3).

The layout below is a contract shared by all stores and asserted by tests:

    neffbuild-store.json        marker: {"format": "neffbuild.store/1"}
    blobs/<d[:2]>/<d>           cache file bytes, named by XXH3-128 hex digest d (immutable)
    bundles/<unit key>.json     BundleRecord (immutable)
    releases/<release id>.json  Release (immutable, id = digest of its canonical JSON)
    tags/<name>.json            TagRecord (the only object that is ever replaced, by compare-and-swap)
    locks/                      local store only: lock files that avoid duplicate work
    packs/<p>.pack              S3 store only: small blobs (< 8 MiB) of one upload laid end to end (immutable)
    packs/<p>.idx.json          its index {"format": "neffbuild.pack/1", "size", "entries": [[digest, offset, size]]},
                                written after the pack; p = XXH3-128 of the index bytes (see store/packs.py)

A blob is present if blobs/<d[:2]>/<d> exists or a present pack index lists it; missing_blobs
answers for both. Publishing writes blobs, then bundles, then the release, then the tag, so a
reader never finds a document that points at something absent.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, Protocol, runtime_checkable

from neffbuild.errors import InputError
from neffbuild.materialize import BlobTarget
from neffbuild.names import key_problem

DocKind = Literal["bundles", "releases", "tags"]
STORE_FORMAT = "neffbuild.store/1"
MARKER = "neffbuild-store.json"


@dataclass(frozen=True, slots=True)
class BlobSource:
    """A local file to publish as a blob, already hashed."""

    digest: str
    size: int
    path: Path


def blob_key(digest: str) -> str:
    return f"blobs/{digest[:2]}/{digest}"


def doc_key(kind: DocKind, name: str) -> str:
    # Names come from the command line and from documents; the core checks them too (names.py),
    # and this keeps any that slipped through from addressing a key outside `kind/`.
    if (problem := key_problem(name)) is not None:
        raise InputError(f"{kind} key: {problem}", hint="tags are names like `prod`; releases and bundles are 32-hex-digit ids")
    return f"{kind}/{name}.json"


@runtime_checkable
class Store(Protocol):
    """What the core needs from storage; nothing else may touch a store's backing medium."""

    @property
    def url(self) -> str: ...

    def missing_blobs(self, digests: Collection[str]) -> set[str]:
        """The subset of digests whose blobs the store does not hold."""

    def put_blob(self, digest: str, source: Path) -> int:
        """Store source's bytes under digest unless present; verify them; return bytes uploaded."""

    def put_blobs(self, sources: Sequence[BlobSource], jobs: int) -> int:
        """Publish the sources the store lacks (in parallel, packed or not); return bytes uploaded."""

    def download_blobs(self, targets: Sequence[BlobTarget], jobs: int) -> None:
        """Bring each blob to its target path through materialize.write_verified (atomic, checked)."""

    def open_blob(self, digest: str) -> AbstractContextManager[BinaryIO]:
        """A readable stream of the blob; NotFoundError if absent."""

    def put_doc(self, kind: DocKind, name: str, data: bytes) -> bool:
        """Write an immutable document if absent; True if written, False if it already existed."""

    def get_doc(self, kind: DocKind, name: str) -> bytes | None:
        """The document's bytes, or None if absent."""

    def list_docs(self, kind: DocKind) -> Iterator[str]:
        """Names (without .json) of the documents of a kind."""

    def read_tag(self, name: str) -> tuple[bytes, str] | None:
        """The tag's bytes and an opaque version token for swap_tag, or None if absent."""

    def swap_tag(self, name: str, data: bytes, expected: str | None) -> bool:
        """Replace the tag only if its version is still `expected` (None: only if absent)."""
