"""Pack objects: many small blobs in one immutable object, so a pull makes a few large requests.

Per-object requests, not bandwidth, limit transfers of small files (Inductor writes hundreds of
~100 KB files): a pack turns 2,000 GETs into a handful of ranged GETs. A pack is the plain
concatenation of its blobs; its index, stored beside it, says where each blob lies:

    packs/<p>.pack       the bytes
    packs/<p>.idx.json   {"format": "neffbuild.pack/1", "size": N, "entries": [[digest, offset, size], ...]}

`p` is the XXH3-128 of the index's canonical JSON, which fixes the pack's bytes too (its entries are
content digests laid end to end), so the pair is content-addressed and never rewritten. The index is
written after the pack: a present index means a complete pack. Every blob read out of a pack is still
checked against its own digest when it lands (confined.write_verified).

A release's locator says which packs hold its blobs (and which blobs are objects of their own):

    locators/<release id>.json   {"format": "neffbuild.locator/1", "release": id,
                                  "packs": {p: [digest, ...]}, "loose": [digest, ...]}

so a pull reads the indexes of those packs only: neither a listing of every pack nor an index of
another release (damaged or not) stands in its way. It is written once, after the release's blobs
and before the release; it can only point at complete packs, and whatever it says is checked
(the indexes against their names, the blobs against their digests).

This module is pure planning and encoding; store/s3/packs.py and store/s3/transfer.py do the I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from neffbuild.errors import IntegrityError
from neffbuild.formats import FORMATS, writes
from neffbuild.fs.confined import BlobTarget
from neffbuild.hashing import canonical_json, hash_bytes, is_digest
from neffbuild.store.base import shown
from neffbuild.store.blobs import BlobSource, PackEntry, PackIndex

PACK_FORMAT = writes("pack index")
LOCATOR_FORMAT = writes("locator")
INDEX_MAX = 128 << 20  # an index is ~80 bytes per blob; no pack holds a million blobs
LOCATOR_MAX = 256 << 20  # ~40 bytes per blob of a release
DAMAGED_HINT = (
    "the store object is damaged: restore it from a copy of the store, or rebuild the release into a new store"
)
SMALL_BLOB = 8 << 20  # blobs below this size travel in packs; larger ones are objects of their own
PACK_TARGET = 64 << 20  # close a pack once it holds this much
RANGE_TARGET = 8 << 20  # one ranged GET of a pack covers at most about this much
RANGE_MIN = 1 << 20  # ... and at least this much: a connection (a thread) costs ~3 ms to start
RANGE_GAP = 1 << 20  # read through holes up to this size rather than start another request


def pack_key(pack_id: str) -> str:
    return f"packs/{pack_id}.pack"


def index_key(pack_id: str) -> str:
    return f"packs/{pack_id}.idx.json"


def pack_id_of_index_key(key: str) -> str | None:
    """The pack id if key (relative to the store root) names a pack index, else None."""
    name = key.removeprefix("packs/")
    if name == key or not name.endswith(".idx.json"):
        return None
    pack_id = name.removesuffix(".idx.json")
    return pack_id if is_digest(pack_id) else None


def group_small(sources: Iterable[BlobSource]) -> list[list[BlobSource]]:
    """Split small blobs into packs of about PACK_TARGET bytes, in digest order (deterministic)."""
    groups: list[list[BlobSource]] = []
    current: list[BlobSource] = []
    filled = 0
    for source in sorted(sources, key=lambda s: s.digest):
        if current and filled + source.size > PACK_TARGET:
            groups.append(current)
            current, filled = [], 0
        current.append(source)
        filled += source.size
    if current:
        groups.append(current)
    return groups


def encode_index(sources: Sequence[BlobSource]) -> tuple[PackIndex, bytes]:
    """The index of a pack holding sources in order, and its stored bytes."""
    entries, offset = [], 0
    for s in sources:
        entries.append(PackEntry(s.digest, offset, s.size))
        offset += s.size
    data = canonical_json(
        {"format": PACK_FORMAT, "size": offset, "entries": [[e.digest, e.offset, e.size] for e in entries]}
    )
    return PackIndex(hash_bytes(data), offset, tuple(entries)), data


def decode_index(pack_id: str, data: bytes, where: str | None = None) -> PackIndex:
    """Parse a stored index strictly; its name is its digest, so any change to it is caught here.

    Whoever writes to the store chooses that name, so the parser still trusts nothing: anything
    but a well-formed index is an IntegrityError naming it (where: its URL), never another error.
    """
    where = where or index_key(pack_id)
    if len(data) > INDEX_MAX:
        raise _damaged(where, f"over {INDEX_MAX} bytes")
    if hash_bytes(data) != pack_id:
        raise _damaged(where, "content does not match its name")
    raw = _json_object(data, where, ("format", "size", "entries"))
    if raw["format"] not in FORMATS["pack index"].reads:
        raise IntegrityError(
            f"{where}: format {shown(raw['format'])}, expected {PACK_FORMAT!r}",
            hint="written by a newer neffbuild: upgrade",
        )
    size, items = raw["size"], raw["entries"]
    if not _is_count(size) or not isinstance(items, list):
        raise _damaged(where, "size must be a count and entries a list")
    entries, end = [], 0
    for i, item in enumerate(items):  # blobs lie end to end, inside the pack
        if not (
            isinstance(item, list)
            and len(item) == 3
            and _is_digest(item[0])
            and _is_count(item[1])
            and item[1] == end
            and _is_count(item[2])
        ):
            raise _damaged(where, f"entry {i} is not [digest, {end}, size]: {shown(item)}")
        entries.append(PackEntry(item[0], end, item[2]))
        end += item[2]
    if end != size:
        raise _damaged(where, f"entries cover {end} bytes, pack has {size}")
    return PackIndex(pack_id, size, tuple(entries))


@dataclass(frozen=True, slots=True)
class Locator:
    """Where a release's blobs lie: packed (pack id -> digests) or as objects of their own."""

    release_id: str
    packs: Mapping[str, frozenset[str]]
    loose: frozenset[str]


def locator_key(release_id: str) -> str:
    return f"locators/{release_id}.json"


def encode_locator(release_id: str, packed: Mapping[str, str], loose: Iterable[str]) -> bytes:
    """The stored bytes of a release's locator; packed maps digest -> pack id."""
    by_pack: dict[str, list[str]] = {}
    for digest, pack_id in sorted(packed.items()):
        by_pack.setdefault(pack_id, []).append(digest)
    return canonical_json({"format": LOCATOR_FORMAT, "release": release_id, "packs": by_pack, "loose": sorted(loose)})


def decode_locator(release_id: str, data: bytes, where: str) -> Locator:
    """Parse a stored locator strictly; IntegrityError (naming it) unless well-formed and for release_id."""
    if len(data) > LOCATOR_MAX:
        raise _damaged(where, f"over {LOCATOR_MAX} bytes")
    raw = _json_object(data, where, ("format", "release", "packs", "loose"))
    if raw["format"] not in FORMATS["locator"].reads:
        raise IntegrityError(
            f"{where}: format {shown(raw['format'])}, expected {LOCATOR_FORMAT!r}",
            hint="written by a newer neffbuild: upgrade",
        )
    if raw["release"] != release_id:
        raise _damaged(where, f"it locates release {shown(raw['release'])}")
    found, loose = raw["packs"], raw["loose"]
    if not isinstance(found, dict) or not all(_is_digest(p) and _are_digests(ds) for p, ds in found.items()):
        raise _damaged(where, "packs must map pack ids to lists of digests")
    if not _are_digests(loose):
        raise _damaged(where, "loose must be a list of digests")
    return Locator(release_id, {p: frozenset(ds) for p, ds in found.items()}, frozenset(loose))


def _json_object(data: bytes, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """data as a JSON object with exactly these keys, or an IntegrityError naming where."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError; nesting: RecursionError
        raise _damaged(where, f"not JSON ({type(exc).__name__})") from None
    if not isinstance(raw, dict) or sorted(raw) != sorted(keys):
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise _damaged(where, f"expected an object with keys {', '.join(keys)}, got {shown(got)}")
    return raw


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0  # not bool, not float: no coercion


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and is_digest(value)


def _are_digests(value: object) -> bool:
    return isinstance(value, list) and all(_is_digest(d) for d in value)


def _damaged(where: str, problem: str) -> IntegrityError:
    return IntegrityError(f"{where}: {problem}", hint=DAMAGED_HINT)


@dataclass(frozen=True, slots=True)
class Piece:
    """A blob to land from a fetched range: where it starts inside the range and its stored size
    (write_verified then checks that against the size the release expects)."""

    target: BlobTarget
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class RangeFetch:
    """One ranged GET of a pack and the blobs it carries."""

    pack_id: str
    start: int
    end: int  # exclusive
    pieces: tuple[Piece, ...]


def range_size(wanted_bytes: int, jobs: int) -> int:
    """Split a pull into about `jobs` ranges (one per connection), within [RANGE_MIN, RANGE_TARGET]."""
    return max(RANGE_MIN, min(RANGE_TARGET, wanted_bytes // max(1, jobs)))


def plan_ranges(index: PackIndex, targets: Sequence[BlobTarget], size: int | None = None) -> list[RangeFetch]:
    """Cover the wanted blobs of one pack with few ranged GETs of about `size` bytes (RANGE_TARGET).

    Neighbouring blobs share a request; a hole smaller than RANGE_GAP is read through (cheaper
    than another request); several targets with one digest share one piece of the range.
    """
    size = size or RANGE_TARGET
    where: Mapping[str, PackEntry] = {e.digest: e for e in index.entries}
    wanted = sorted(targets, key=lambda t: where[t.digest].offset)
    fetches: list[RangeFetch] = []
    pieces: list[Piece] = []
    start = end = 0
    for target in wanted:
        entry = where[target.digest]
        stop = entry.offset + entry.size
        if pieces and (entry.offset - end > RANGE_GAP or stop - start > size):
            fetches.append(RangeFetch(index.pack_id, start, end, tuple(pieces)))
            pieces = []
        if not pieces:
            start, end = entry.offset, stop
        pieces.append(Piece(target, entry.offset - start, entry.size))
        end = max(end, stop)
    if pieces:
        fetches.append(RangeFetch(index.pack_id, start, end, tuple(pieces)))
    return fetches
