"""The documents inspection reads: fetched in parallel, parsed strictly, checked against their names.

A document listed and then gone by the time it is read (a gc ran in between) is left out, not
an error: a listing is a moment's view. A document that is there but malformed, or not the one
its name says, is an IntegrityError naming it, as for `pull`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.records import Release, TagRecord, parse
from neffbuild.documents.refs import Doc, checked_doc, doc_kind, doc_where
from neffbuild.hashing import hash_bytes
from neffbuild.store.base import DocKind, Store

DOC_JOBS = 32  # documents read at once: S3 round trips overlap; a local store barely cares


@dataclass(frozen=True)
class Snapshot:
    """Every tag and release of a store (and the bundles asked for), as read at one moment."""

    url: str
    tags: Mapping[str, TagRecord]
    releases: Mapping[str, Release]
    bundles: Mapping[str, BundleRecord]


def snapshot(store: Store, *, all_bundles: bool = False, jobs: int = DOC_JOBS) -> Snapshot:
    """Tags and releases; with all_bundles, every bundle record in the store too."""
    tags = fetch(store, TagRecord, store.list_docs("tags"), jobs)
    releases = fetch(store, Release, store.list_docs("releases"), jobs)
    bundles = fetch(store, BundleRecord, store.list_docs("bundles"), jobs) if all_bundles else {}
    return Snapshot(store.url, tags, releases, bundles)


def fetch(store: Store, kind: type[Doc], names: Iterable[str], jobs: int = DOC_JOBS) -> dict[str, Doc]:
    """The named documents of one kind that exist, parsed, by name."""
    raw = get_docs(store, doc_kind(kind), list(names), jobs)
    return {name: named(store, kind, name, data) for name, data in raw.items() if data is not None}


def get_docs(store: Store, kind: DocKind, names: list[str], jobs: int) -> dict[str, bytes | None]:
    """Each name's bytes (None if absent): the store reads them as fast as it can (S3: in parallel)."""
    return store.get_docs(kind, names, jobs) if names else {}


def named(store: Store, kind: type[Doc], name: str, data: bytes) -> Doc:
    """Parse a document and check that it is the one its name says (a copied object is not followed)."""
    where = doc_where(store, kind, name)
    if kind is Release and hash_bytes(data) == name:
        # Stored as published (canonical bytes): its id is their digest. Skipping the re-dump that
        # proves it otherwise halves the cost of listing 1,000 releases.
        return parse(kind, data, where)
    return checked_doc(kind, data, where, name)
