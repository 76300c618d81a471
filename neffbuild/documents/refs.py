"""What a store's documents are called, and the one way each is loaded.

`find_doc` / `load_doc` fetch a bundle, release or tag and parse it strictly, checking that it is
the document its name says (a copied or forged object is an IntegrityError, not followed).

A reference names a release (or, for `resolve_any`, a bundle) on the command line:

    prod           a tag: the release it points at
    prod@2         the release the tag pointed at two moves ago (its history; prod@0 is prod)
    91b00baa...    a release id, 32 hex digits
    91b00b         a unique prefix of a release id, at least PREFIX_MIN hex digits
    <bundle key>   resolve_any only: a bundle, by its key or a unique prefix of it

A tag of that name wins over a prefix (tags are chosen by people; ids are not typed whole).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from neffbuild.documents.records import Release, ReleaseUnit, TagRecord, parse
from neffbuild.errors import InputError, IntegrityError, NotFoundError
from neffbuild.hashing import DIGEST_LEN, hash_bytes, is_digest
from neffbuild.names import tag_problem
from neffbuild.store.base import DocKind, Store

if TYPE_CHECKING:  # imported where a bundle is read: a pull reads a tag and a release only
    from neffbuild.documents.bundles import BundleRecord, ResolvedBundle

PREFIX_MIN = 6  # hex digits: below this a prefix would match too much to be typed on purpose
BACK_MAX = 10**6  # TAG@N: larger N is a typo, not a history
_REF = re.compile(r"(?P<name>[^@]+)(?:@(?P<back>[0-9]{1,7}))?")
_HEX = re.compile(r"[0-9a-f]+")
# Each kind's place in the store and its name, by class name (so that BundleRecord need not be built).
_KINDS: dict[str, tuple[DocKind, str]] = {
    "BundleRecord": ("bundles", "bundle"), "Release": ("releases", "release"), "TagRecord": ("tags", "tag"),
}  # fmt: skip  # a table: one kind a line would hide it
_REF_HINT = f"give a tag, TAG@N (its N-th previous release), a release id or at least {PREFIX_MIN} of its hex digits"

Doc = TypeVar("Doc", "BundleRecord", Release, TagRecord)


@dataclass(frozen=True)
class ResolvedRelease:
    """A release a ref names, read from the store."""

    release_id: str
    release: Release
    tag: str | None  # the tag that points at it now (None for a release named by id, or TAG@N with N > 0)
    where: str  # the release document, for messages


@dataclass(frozen=True)
class Ref:
    """A reference split into its parts (syntax only; nothing is looked up)."""

    text: str
    name: str  # a tag name, a full id or a hex prefix
    back: int | None  # N of TAG@N

    @property
    def may_be_tag(self) -> bool:
        return tag_problem(self.name) is None

    @property
    def may_be_prefix(self) -> bool:
        return self.back is None and PREFIX_MIN <= len(self.name) < DIGEST_LEN and _HEX.fullmatch(self.name) is not None


def doc_kind(kind: type[Doc]) -> DocKind:
    """Where the store keeps documents of this kind."""
    return _KINDS[kind.__name__][0]


def doc_where(store: Store, kind: type[Doc], name: str) -> str:
    return f"{store.url}/{doc_kind(kind)}/{name}.json"


def find_doc(store: Store, kind: type[Doc], name: str) -> Doc | None:
    """The document `name` of this kind, parsed and checked against its name; None if absent."""
    if kind is TagRecord:
        found = read_tag(store, name)
        return None if found is None else found[0]  # type: ignore[return-value]
    data = store.get_doc(doc_kind(kind), name)
    return None if data is None else checked_doc(kind, data, doc_where(store, kind, name), name)


def load_doc(store: Store, kind: type[Doc], name: str, *, hint: str = "build or push it first") -> Doc:
    """As find_doc, but an absent document is a NotFoundError (exit 8)."""
    doc = find_doc(store, kind, name)
    if doc is None:
        what = _KINDS[kind.__name__][1]
        raise NotFoundError(f"{what} {name} not found in {store.url}", hint=hint)
    return doc


def release_bundle(store: Store, resolved: ResolvedRelease, unit: ReleaseUnit) -> BundleRecord:
    """The bundle a release's unit names. One the store lacks, or one that records another unit,
    means the store is damaged: an IntegrityError (a release is published after its bundles)."""
    from neffbuild.documents.bundles import BundleRecord

    record = find_doc(store, BundleRecord, unit.key)
    if record is None:
        raise IntegrityError(
            f"{resolved.where}: unit {unit.unit_id} names bundle {unit.key}, which the store lacks",
            hint="the store is damaged; rebuild the release or push it again",
        )
    if record.unit_id != unit.unit_id:
        raise IntegrityError(
            f"{doc_where(store, BundleRecord, unit.key)}: records {record.unit_id}, not {unit.unit_id}",
            hint="the object is corrupt; rebuild the release",
        )
    return record


def read_tag(store: Store, name: str) -> tuple[TagRecord, str] | None:
    """The tag and its version token (for swap_tag), or None if absent."""
    current = store.read_tag(name)
    if current is None:
        return None
    return checked_doc(TagRecord, current[0], doc_where(store, TagRecord, name), name), current[1]


def checked_doc(kind: type[Doc], data: bytes, where: str, name: str) -> Doc:
    """Parse a document strictly and check that it is the one its name says."""
    doc = parse(kind, data, where)
    if isinstance(doc, TagRecord) and doc.name != name:
        raise IntegrityError(
            f"{where}: names tag {doc.name!r}", hint="the object is corrupt or was copied; re-tag the release"
        )
    # The stored bytes are the canonical dump when whole: their hash is the id, with no
    # re-encoding of the document (0.14 s for a 10,000-file release); other bytes are re-encoded.
    if isinstance(doc, Release) and hash_bytes(data) != name and doc.release_id != name:
        raise IntegrityError(
            f"{where}: content does not match its name", hint="the object is corrupt; re-push the release"
        )
    if not isinstance(doc, Release | TagRecord) and doc.key != name:  # a BundleRecord
        raise IntegrityError(
            f"{where}: holds the bundle of key {doc.key}", hint="the object is corrupt or was copied; rebuild the unit"
        )
    return doc


def parse_ref(ref: str) -> Ref:
    """Split a reference, or InputError if it can name nothing (checked before any store is read)."""
    match = _REF.fullmatch(ref)
    parsed = Ref(ref, match["name"], int(match["back"]) if match["back"] else None) if match else None
    if parsed is None or not (
        parsed.may_be_tag or (parsed.back is None and (is_digest(parsed.name) or parsed.may_be_prefix))
    ):
        raise InputError(f"{ref!r} is neither a tag name nor a release id", hint=_REF_HINT)
    return parsed


# A release id, and what stands in for parsing the store's bytes of it (bytes that hash to that
# id): the document they are, or None to parse them strictly.
Known = tuple[str, Callable[[bytes], Release | None]]


def resolve(store: Store, ref: str, *, known: Known | None = None) -> ResolvedRelease:
    """A reference to a release → its verified document. known: an id and what stands in for
    parsing the store's bytes of it (a cache dir's installed release): if ref names it and the
    store's bytes hash to that id, they are not parsed again (0.1 s for a 10,000-file release at
    every boot)."""
    found = _resolve(store, parse_ref(ref), ("releases",), known)
    assert isinstance(found, ResolvedRelease)
    return found


def resolve_any(store: Store, ref: str) -> ResolvedRelease | ResolvedBundle:
    """A reference to a release or a bundle (by key or a unique key prefix) → its document."""
    return _resolve(store, parse_ref(ref), ("releases", "bundles"))


def _resolve(
    store: Store, ref: Ref, kinds: tuple[DocKind, ...], known: Known | None = None
) -> ResolvedRelease | ResolvedBundle:
    if is_digest(ref.name):
        for kind in kinds:
            if (found := _by_id(store, kind, ref.name, known)) is not None:
                return found
        raise NotFoundError(f"{_what(kinds)} {ref.name} not found in {store.url}", hint="build or push it first")
    tag = read_tag(store, ref.name) if ref.may_be_tag else None
    if tag is not None:
        return _from_tag(store, tag[0], ref, known)
    if ref.may_be_prefix:
        return _by_prefix(store, ref.name, kinds)
    tags = ", ".join(list(store.list_docs("tags"))[:10]) or "none"
    raise NotFoundError(f"tag {ref.name!r} not found in {store.url}", hint=f"known tags: {tags}")


def _from_tag(store: Store, tag: TagRecord, ref: Ref, known: Known | None) -> ResolvedRelease:
    back = ref.back or 0
    if back == 0:
        return _release(store, tag.release, tag.name, known)
    releases = [e.release for e in tag.history]
    if not releases or releases[-1] != tag.release:  # a history that does not end where the tag points
        releases.append(tag.release)
    if back >= len(releases):
        raise NotFoundError(
            f"tag {tag.name!r} has {len(releases) - 1} earlier releases, not {back}",
            hint=f"`{tag.name}@{len(releases) - 1}` is its oldest" if len(releases) > 1 else "the tag has never moved",
        )
    return _release(store, releases[-1 - back], None, known)


def _by_id(
    store: Store, kind: DocKind, name: str, known: Known | None = None
) -> ResolvedRelease | ResolvedBundle | None:
    if kind == "releases":
        release = _find_release(store, name, known)
        return None if release is None else ResolvedRelease(name, release, None, doc_where(store, Release, name))
    from neffbuild.documents.bundles import BundleRecord, ResolvedBundle

    record = find_doc(store, BundleRecord, name)
    return None if record is None else ResolvedBundle(name, record, doc_where(store, BundleRecord, name))


def _release(store: Store, release_id: str, tag: str | None, known: Known | None) -> ResolvedRelease:
    release = _find_release(store, release_id, known)
    if release is None:
        release = load_doc(store, Release, release_id)  # raises NotFoundError
    return ResolvedRelease(release_id, release, tag, doc_where(store, Release, release_id))


def _find_release(store: Store, release_id: str, known: Known | None) -> Release | None:
    """find_doc, but known stands in for the parse when the stored bytes are its canonical dump.
    (A cache dir's state was parsed strictly by the pull that wrote it, or holds these very bytes;
    whoever can rewrite the state can rewrite the files it vouches for, and every write stays
    confined beneath the dir.)"""
    if known is None or known[0] != release_id:
        return find_doc(store, Release, release_id)
    data = store.get_doc("releases", release_id)
    if data is None:
        return None
    if hash_bytes(data) == release_id and (release := known[1](data)) is not None:
        return release
    return checked_doc(Release, data, doc_where(store, Release, release_id), release_id)


def _by_prefix(store: Store, prefix: str, kinds: tuple[DocKind, ...]) -> ResolvedRelease | ResolvedBundle:
    matches = [(kind, name) for kind in kinds for name in store.list_docs(kind) if name.startswith(prefix)]
    if not matches:
        raise NotFoundError(
            f"no tag, and no {_what(kinds)} id starting with {prefix!r}, in {store.url}",
            hint="check the id (`neffbuild tag` and `build --json` print them), or --store",
        )
    if len(matches) > 1:
        raise InputError(
            f"{prefix!r} is ambiguous: {len(matches)} {_what(kinds)} ids in {store.url} start with it",
            hint="give more hex digits, or the whole id",
        )
    kind, name = matches[0]
    found = _by_id(store, kind, name)
    if found is None:  # listed, then gone (a gc ran in between)
        raise NotFoundError(f"{kind[:-1]} {name} not found in {store.url}", hint="it was removed while being looked up")
    return found


def _what(kinds: tuple[DocKind, ...]) -> str:
    return " or ".join(k[:-1] for k in kinds)
