"""The documents inspection reads: fetched in parallel, parsed strictly, checked against their names.

A document listed and then gone by the time it is read (a gc ran in between) is left out, not
an error: a listing is a moment's view. A document that is there but malformed, or not the one
its name says, is an IntegrityError naming it, as for `pull`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from neffbuild.bundle import BundleRecord, Release, TagRecord, parse
from neffbuild.errors import IntegrityError
from neffbuild.pull import ResolvedRelease
from neffbuild.store.base import DocKind, Store

DOC_JOBS = 32  # documents read at once: S3 round trips overlap; a local store barely cares
KINDS: dict[type, DocKind] = {BundleRecord: "bundles", Release: "releases", TagRecord: "tags"}

Doc = TypeVar("Doc", BundleRecord, Release, TagRecord)


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
    """The named documents of one kind that exist, parsed; in the order of names."""
    wanted = list(dict.fromkeys(names))
    raw = get_docs(store, KINDS[kind], wanted, jobs)
    return {name: named(store, kind, name, data) for name, data in raw.items() if data is not None}


def get_docs(store: Store, kind: DocKind, names: list[str], jobs: int) -> dict[str, bytes | None]:
    """Each name's bytes (None if absent), read concurrently."""
    if len(names) <= 1 or jobs <= 1:
        return {name: store.get_doc(kind, name) for name in names}
    with ThreadPoolExecutor(min(jobs, len(names)), thread_name_prefix="neffbuild-docs") as pool:
        return dict(zip(names, pool.map(lambda name: store.get_doc(kind, name), names), strict=True))


def named(store: Store, kind: type[Doc], name: str, data: bytes) -> Doc:
    """Parse a document and check that it is the one its name says (a copied object is not followed)."""
    where = f"{store.url}/{KINDS[kind]}/{name}.json"
    doc = parse(kind, data, where)
    if isinstance(doc, Release) and doc.release_id != name:
        raise IntegrityError(f"{where}: content does not match its name", hint="the object is corrupt; re-push the release")
    if isinstance(doc, BundleRecord) and doc.key != name:
        raise IntegrityError(f"{where}: holds the bundle of key {doc.key}", hint="the object is corrupt or was copied; rebuild the unit")
    if isinstance(doc, TagRecord) and doc.name != name:
        raise IntegrityError(f"{where}: names tag {doc.name!r}", hint="the object is corrupt or was copied; re-tag the release")
    return doc


@dataclass(frozen=True)
class ResolvedBundle:
    key: str
    record: BundleRecord
    where: str


def resolve_any(store: Store, ref: str) -> ResolvedRelease | ResolvedBundle:
    """REF (a tag, a release id, a bundle key) -> its document. The one place inspection resolves
    references: neffbuild.refs takes it over (TAG@N, id prefixes) once merged."""
    from neffbuild.hashing import is_digest
    from neffbuild.pull import resolve

    if is_digest(ref) and store.get_doc("releases", ref) is None:
        data = store.get_doc("bundles", ref)
        if data is not None:
            return ResolvedBundle(ref, named(store, BundleRecord, ref, data), f"{store.url}/bundles/{ref}.json")
    return resolve(store, ref)
