"""Pack objects: many small blobs in one immutable object, so a pull makes a few large requests.

Per-object requests, not bandwidth, limit transfers of small files (Inductor writes hundreds of
~100 KB files): a pack turns 2,000 GETs into a handful of ranged GETs. A pack is the plain
concatenation of its blobs; its index, stored beside it, says where each blob lies:

    packs/<p>.pack       the bytes
    packs/<p>.idx.json   {"format": "neffbuild.pack/1", "size": N, "entries": [[digest, offset, size], ...]}

`p` is the XXH3-128 of the index's canonical JSON, which fixes the pack's bytes too (its entries are
content digests laid end to end), so the pair is content-addressed and never rewritten. The index is
written after the pack: a present index means a complete pack. Every blob read out of a pack is still
checked against its own digest when it lands (materialize.write_verified).

This module is pure planning and encoding; store/s3.py does the I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from neffbuild.errors import IntegrityError
from neffbuild.hashing import canonical_json, hash_bytes, is_digest
from neffbuild.materialize import BlobTarget
from neffbuild.store.base import BlobSource

PACK_FORMAT = "neffbuild.pack/1"
SMALL_BLOB = 8 << 20  # blobs below this size travel in packs; larger ones are objects of their own
PACK_TARGET = 64 << 20  # close a pack once it holds this much
RANGE_TARGET = 8 << 20  # one ranged GET of a pack covers at most about this much
RANGE_MIN = 1 << 20  # ... and at least this much: a connection (a thread) costs ~3 ms to start
RANGE_GAP = 1 << 20  # read through holes up to this size rather than start another request


@dataclass(frozen=True, slots=True)
class PackEntry:
    digest: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class PackIndex:
    pack_id: str
    size: int
    entries: tuple[PackEntry, ...]


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
    data = canonical_json({"format": PACK_FORMAT, "size": offset, "entries": [[e.digest, e.offset, e.size] for e in entries]})
    return PackIndex(hash_bytes(data), offset, tuple(entries)), data


def decode_index(pack_id: str, data: bytes) -> PackIndex:
    """Parse a stored index; its name is its digest, so any change to it is caught here."""
    where = index_key(pack_id)
    if hash_bytes(data) != pack_id:
        raise IntegrityError(f"{where}: content does not match its name", hint="the pack index is corrupt; re-push the release")
    try:
        raw = json.loads(data)
        if raw.get("format") != PACK_FORMAT:
            raise IntegrityError(f"{where}: format {raw.get('format')!r}, expected {PACK_FORMAT!r}", hint="upgrade neffbuild")
        entries = tuple(PackEntry(str(d), int(o), int(n)) for d, o, n in raw["entries"])
        size = int(raw["size"])
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise IntegrityError(f"{where}: malformed pack index ({exc})", hint="re-push the release") from None
    end = 0
    for e in entries:  # blobs lie end to end, inside the pack
        if e.offset != end or e.size < 0 or not is_digest(e.digest):
            raise IntegrityError(f"{where}: malformed entry for {e.digest}", hint="re-push the release")
        end += e.size
    if end != size:
        raise IntegrityError(f"{where}: entries cover {end} bytes, pack has {size}", hint="re-push the release")
    return PackIndex(pack_id, size, entries)


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
