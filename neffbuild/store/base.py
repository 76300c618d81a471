"""The storage protocol the core uses, built for every store by store/layout.py on its raw part.

The layout below is a contract shared by all stores and asserted by tests:

    neffbuild-store.json        marker: {"format": "neffbuild.store/1"}
    blobs/<d[:2]>/<d>           cache file bytes, named by XXH3-128 hex digest d (immutable)
    bundles/<unit key>.json     BundleRecord (immutable)
    releases/<release id>.json  Release (immutable, id = digest of its canonical JSON)
    signatures/<release id>.<key name>.json
                                a DSSE envelope of an in-toto Statement v1 over the release, signed by
                                that key (documents/signing.py); written after the release (immutable)
    tags/<name>.json            TagRecord (the only object that is ever replaced, by compare-and-swap);
                                a signed one carries its signed tag statement
    locks/                      local store only: lock files that avoid duplicate work
    tags/.<name>.v/<n>          local store only: the versions a tag's compare-and-swap links into
                                place (store/local.py); hidden, never listed
    packs/<p>.pack              S3 store only: small blobs (< 8 MiB) of one upload laid end to end (immutable)
    packs/<p>.idx.json          its index {"format": "neffbuild.pack/1", "size", "entries": [[digest, offset, size]]},
                                written after the pack; p = XXH3-128 of the index bytes (see store/packs.py)
    locators/<release id>.json  S3 store only: where a release's blobs lie, {"format": "neffbuild.locator/1",
                                "release", "packs": {p: [digest, ...]}, "loose": [digest, ...]} (immutable),
                                written after its blobs and before the release; a pull of the release
                                reads the indexes of these packs only (see store/packs.py)
    gc/lease.json               present only while a `neffbuild gc` deletes: {"format": "neffbuild.maint.gc-lease/1",
                                "by", "started", "expires"}; publishes wait for it to go (see neffbuild/store/lease.py)

Objects are listed (list_objects) and deleted (delete_objects) by their key relative to the store
root, for inspection and gc; only the folders above may be deleted, never the marker.

A blob is present if blobs/<d[:2]>/<d> exists or a present pack index lists it; missing_blobs
answers for both. Publishing writes blobs, then bundles, then the locator, then the release, then
the tag, so a reader never finds a document that points at something absent. A release without a
locator (published before locators existed) is found through every pack index, skipping damaged
ones: an index that does not hash to its name only matters to a pull that needs one of its blobs.

Every read is bounded: a blob by its size in the release (one byte more proves it too long), a
document by DOC_MAX, the marker by MARKER_MAX; a local store opens only regular files, and never
blocks opening one (a FIFO is refused, not waited on).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal, Protocol, runtime_checkable

from neffbuild.errors import InputError, StoreError
from neffbuild.formats import FORMATS, writes
from neffbuild.fs.confined import BlobTarget
from neffbuild.names import key_problem
from neffbuild.store.raw import DOC_MAX as DOC_MAX  # defined with the raw part, named here too
from neffbuild.store.raw import ObjectInfo as ObjectInfo

if TYPE_CHECKING:  # store/blobs.py: classes a store's reader does not build
    from neffbuild.store.blobs import BlobSource, PackIndex

DocKind = Literal["bundles", "releases", "tags", "gc", "signatures"]
STORE_FORMAT = writes("store marker")
MARKER = "neffbuild-store.json"
MARKER_MAX = 64 << 10  # the marker is a few dozen bytes; a larger one is not ours
MARKER_HINT = f'not a neffbuild store, or its marker is damaged: it must hold {{"format": "{STORE_FORMAT}"}}'


DELETE_BATCH = 1000  # S3's DeleteObjects takes at most this many keys per request
DELETABLE = ("blobs/", "bundles/", "releases/", "tags/", "packs/", "locators/", "gc/", "signatures/")


def blob_key(digest: str) -> str:
    return f"blobs/{digest[:2]}/{digest}"


def doc_key(kind: DocKind, name: str) -> str:
    # Names come from the command line and from documents; the core checks them too (names.py),
    # and this keeps any that slipped through from addressing a key outside `kind/`.
    if (problem := key_problem(name)) is not None:
        raise InputError(
            f"{kind} key: {problem}", hint="tags are names like `prod`; releases and bundles are 32-hex-digit ids"
        )
    return f"{kind}/{name}.json"


def check_deletable(key: str) -> str:
    """A key delete_objects may remove: one object of the layout's folders, never the marker or
    anything outside the store (a local store joins it into a path)."""
    parts = key.split("/")
    if not key.startswith(DELETABLE) or any(p in ("", ".", "..") for p in parts) or "\\" in key or "\0" in key:
        raise InputError(
            f"cannot delete {shown(key)}: not an object of a store folder",
            hint=f"keys start with one of {', '.join(DELETABLE)}",
        )
    return key


def deletion_failed(url: str, failures: Sequence[tuple[str, str]]) -> StoreError:
    """One StoreError for the keys a delete_objects could not remove: (key, why) pairs."""
    key, why = failures[0]
    more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    return StoreError(
        f"{url}/{key}: cannot delete it ({why}){more}",
        hint="check the store's permissions, then run the deletion again",
    )


def shown(value: object, limit: int = 60) -> str:
    """A value from a store, quoted for a one-line message: escaped (no newline or lone surrogate
    reaches the terminal) and cut short (a hostile value may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def check_marker(data: bytes, where: str) -> None:
    """Accept a store marker's bytes, or refuse them with a StoreError naming it (where)."""
    if len(data) > MARKER_MAX:
        raise StoreError(f"{where}: over {MARKER_MAX} bytes, not a store marker", hint=MARKER_HINT)
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise StoreError(f"{where}: not a JSON store marker ({type(exc).__name__})", hint=MARKER_HINT) from None
    if not isinstance(raw, dict) or "format" not in raw:
        raise StoreError(
            f"{where}: not a store marker (expected an object with a format, got {shown(raw)})", hint=MARKER_HINT
        )
    if raw["format"] not in FORMATS["store marker"].reads:
        raise StoreError(
            f"{where}: store format {shown(raw['format'])}, expected {STORE_FORMAT!r}",
            hint="written by another neffbuild version: use that version, or another store",
        )


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

    def put_locator(self, release_id: str, digests: Collection[str]) -> None:
        """Before a release is written: record where its blobs lie, unless recorded already, so that
        a pull of it reads only what it needs (S3: locators/<release id>.json; a local store has no packs)."""

    def download_blobs(self, targets: Sequence[BlobTarget], jobs: int, *, release: str | None = None) -> None:
        """Bring each blob to its target path through confined.write_verified (atomic, checked).

        `release`: the release the targets belong to, if any; its locator then says where they lie.
        """

    def open_blob(self, digest: str) -> AbstractContextManager[BinaryIO]:
        """A readable stream of the blob; NotFoundError if absent."""

    def put_doc(self, kind: DocKind, name: str, data: bytes) -> bool:
        """Write an immutable document if absent; True if written, False if it already existed."""

    def get_doc(self, kind: DocKind, name: str) -> bytes | None:
        """The document's bytes (IntegrityError past DOC_MAX), or None if absent."""

    def list_docs(self, kind: DocKind) -> Iterator[str]:
        """Names (without .json) of the documents of a kind."""

    def get_docs(self, kind: DocKind, names: Iterable[str], jobs: int) -> dict[str, bytes | None]:
        """get_doc of each name, read up to `jobs` at a time where that is faster (S3): a store with
        1,000 releases is not inspected in 1,000 sequential round trips."""

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key (relative to the store root) starts with prefix, in key order.
        A local store leaves out its locks/ and the hidden temp files of writes in flight."""

    def delete_objects(self, keys: Iterable[str]) -> None:
        """Delete these objects (each check_deletable); an absent one is no error.

        Keys go in the order given, in batches of at most DELETE_BATCH, each batch done before the
        next starts, so a caller that lists records before what they reference deletes them first.
        Every key is tried; then one StoreError names the first that failed and how many did. A
        reader never sees part of an object: it finds the whole object or none.
        """

    def pack_indexes(self) -> tuple[dict[str, PackIndex], dict[str, str]]:
        """Every present pack's index (pack id -> index), and the packs whose index is damaged or
        vanished (pack id -> why), as of now: a pack deleted since the last call is forgotten.
        A store without packs (local) returns two empty maps."""

    def read_tag(self, name: str) -> tuple[bytes, str] | None:
        """The tag's bytes and an opaque version token for swap_tag, or None if absent."""

    def swap_tag(self, name: str, data: bytes, expected: str | None) -> bool:
        """Replace the tag only if its version is still `expected` (None: only if absent)."""
