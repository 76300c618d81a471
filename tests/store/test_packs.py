"""Pack planning, index and locator encoding and their strict decoders (pure; the S3 tests cover the I/O)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neffbuild.errors import IntegrityError
from neffbuild.fs.confined import BlobTarget
from neffbuild.hashing import hash_bytes, is_digest
from neffbuild.store import packs
from neffbuild.store.blobs import BlobSource


def sources(*sizes: int) -> list[BlobSource]:
    return [BlobSource(hash_bytes(str(i).encode()), size, Path(f"/src/{i}")) for i, size in enumerate(sizes)]


def targets_for(index: packs.PackIndex, *positions: int) -> list[BlobTarget]:
    return [BlobTarget(index.entries[i].digest, index.entries[i].size, Path(f"/cache/{i}")) for i in positions]


def test_index_round_trip_and_content_address() -> None:
    index, data = packs.encode_index(sources(10, 0, 5))
    assert index.pack_id == hash_bytes(data) and index.size == 15
    assert [(e.offset, e.size) for e in index.entries] == [(0, 10), (10, 0), (10, 5)]
    assert packs.decode_index(index.pack_id, data) == index
    assert packs.pack_id_of_index_key(packs.index_key(index.pack_id)) == index.pack_id
    assert packs.pack_id_of_index_key(packs.pack_key(index.pack_id)) is None


def test_a_changed_index_is_rejected() -> None:
    index, data = packs.encode_index(sources(10, 5))
    with pytest.raises(IntegrityError, match="does not match its name"):
        packs.decode_index(index.pack_id, data.replace(b"10", b"11"))


def test_small_blobs_group_into_packs_of_bounded_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packs, "PACK_TARGET", 100)
    groups = packs.group_small(sources(60, 30, 30, 50, 100))
    assert all(sum(s.size for s in g) <= 100 or len(g) == 1 for g in groups)
    assert sorted(s.digest for g in groups for s in g) == sorted(s.digest for s in sources(60, 30, 30, 50, 100))
    assert packs.group_small(list(reversed(sources(60, 30)))) == packs.group_small(sources(60, 30))  # deterministic


def test_ranges_join_neighbours_and_skip_big_holes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packs, "RANGE_GAP", 20)
    monkeypatch.setattr(packs, "RANGE_TARGET", 100)
    index, _ = packs.encode_index(sources(10, 10, 50, 10, 10, 10))  # offsets 0 10 20 70 80 90
    fetches = packs.plan_ranges(index, targets_for(index, 0, 1, 3, 4))
    assert [(f.start, f.end) for f in fetches] == [(0, 20), (70, 90)]  # the 50-byte hole is not read
    assert [p.start for p in fetches[1].pieces] == [0, 10]
    one = packs.plan_ranges(index, targets_for(index, 3, 5))
    assert [(f.start, f.end) for f in one] == [(70, 100)]  # a 10-byte hole is read through


def test_ranges_stay_near_the_target_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packs, "RANGE_TARGET", 25)
    index, _ = packs.encode_index(sources(*[10] * 6))
    fetches = packs.plan_ranges(index, targets_for(index, *range(6)))
    assert [(f.start, f.end) for f in fetches] == [(0, 20), (20, 40), (40, 60)]


def test_two_targets_with_one_digest_share_a_piece() -> None:
    index, _ = packs.encode_index(sources(10, 10))
    twins = [*targets_for(index, 1), BlobTarget(index.entries[1].digest, 10, Path("/cache/twin"))]
    [fetch] = packs.plan_ranges(index, twins)
    assert (fetch.start, fetch.end) == (10, 20) and [p.start for p in fetch.pieces] == [0, 0]


def test_a_small_pull_is_split_across_connections() -> None:
    assert packs.range_size(64 << 20, jobs=16) == 4 << 20  # 64 MiB over 16 connections
    assert packs.range_size(5 << 20, jobs=16) == packs.RANGE_MIN  # 5 MiB: a few connections, not 16
    assert packs.range_size(1 << 30, jobs=16) == packs.RANGE_TARGET
    assert packs.range_size(100, jobs=16) == packs.RANGE_MIN
    index, _ = packs.encode_index(sources(*[100] * 10))
    assert len(packs.plan_ranges(index, targets_for(index, *range(10)), size=300)) == 4


# ---- decoding what a store holds: strict, typed, never a crash -------------------------------------

WHERE = "s3://bucket/p/packs/x.idx.json"


def assert_integrity_error_naming(exc: IntegrityError, where: str) -> None:
    """A refusal as the CLI prints it: exit 4, one printable line naming the object, a hint."""
    assert exc.exit_code == 4 and where in exc.message and exc.hint
    assert "\n" not in exc.message and len(exc.message) < 600
    exc.message.encode("utf-8")  # no lone surrogate reaches the terminal


def named(data: bytes) -> tuple[str, bytes]:
    """An index under the name an attacker gives it: its own digest, so the parser is reached."""
    return hash_bytes(data), data


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"null",
        b"[]",
        b"3",
        b"garbage",
        b"\x1f\x8b\x08\x00gzip",
        b"[" * 100_000,
        b'{"a":' * 50_000,
        b'{"format": "\\ud800", "size": 0, "entries": []}',
        b'{"format": "neffbuild.pack/1", "size": 0, "entries": [], "extra": 1}',
        b'{"format": "neffbuild.pack/1", "size": "0", "entries": []}',
        b'{"format": "neffbuild.pack/1", "size": 0.0, "entries": []}',
        b'{"format": "neffbuild.pack/1", "size": true, "entries": []}',
        b'{"format": "neffbuild.pack/1", "size": 1e400, "entries": []}',
        b'{"format": "neffbuild.pack/1", "size": 1, "entries": [["' + b"a" * 32 + b'", 0, true]]}',
        b'{"format": "neffbuild.pack/1", "size": 1, "entries": [["' + b"a" * 32 + b'", 0.0, 1]]}',
        b'{"format": "neffbuild.pack/1", "size": 1, "entries": [["' + b"A" * 32 + b'", 0, 1]]}',
        b'{"format": "neffbuild.pack/1", "size": 1, "entries": [["\\ud800' + b"a" * 31 + b'", 0, 1]]}',
        b'{"format": "neffbuild.pack/1", "size": 2, "entries": [["' + b"a" * 32 + b'", 1, 1]]}',
        b'{"format": "neffbuild.pack/1", "size": 1, "entries": {"' + b"a" * 32 + b'": [0, 1]}}',
        b'{"format": "neffbuild.pack/1", "size": 1, "entries": [["' + b"a" * 32 + b'", 0, 1, 2]]}',
        b'{"format": "neffbuild.pack/1", "size": 5, "entries": [["' + b"a" * 32 + b'", 0, 1]]}',
        b'{"format": "neffbuild.pack/1", "size": Infinity, "entries": []}',
        '{"format": "neffbuild.pack/1\udc80", "size": 0, "entries": []}'.encode("utf-8", "surrogatepass"),
    ],
    ids=lambda d: repr(d[:40]),
)
def test_a_malformed_index_is_an_integrity_error_naming_it(data: bytes) -> None:
    pack_id, data = named(data)
    with pytest.raises(IntegrityError) as err:
        packs.decode_index(pack_id, data, WHERE)
    assert_integrity_error_naming(err.value, WHERE)


def test_an_index_is_read_strictly_and_refused_when_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    index, data = packs.encode_index(sources(3, 4))
    assert packs.decode_index(index.pack_id, data, WHERE) == index
    monkeypatch.setattr(packs, "INDEX_MAX", len(data) - 1)
    with pytest.raises(IntegrityError, match="over"):
        packs.decode_index(index.pack_id, data, WHERE)


def test_a_locator_round_trips_and_must_name_its_release() -> None:
    a, b, c = (hash_bytes(x) for x in (b"a", b"b", b"c"))
    pack = hash_bytes(b"pack")
    release = hash_bytes(b"release")
    data = packs.encode_locator(release, {a: pack, b: pack}, [c])
    assert packs.decode_locator(release, data, "loc") == packs.Locator(
        release, {pack: frozenset({a, b})}, frozenset({c})
    )
    with pytest.raises(IntegrityError, match="locates release") as err:
        packs.decode_locator(hash_bytes(b"other"), data, "s3://b/locators/x.json")
    assert_integrity_error_naming(err.value, "s3://b/locators/x.json")


# ---- property tests: no input gets past the decoders as anything but a typed refusal ------------
# 2,000 examples each, in CI; together about FUZZ_SECONDS on this suite's 2-core machine.

_text = st.text(st.characters(codec=None), max_size=8)  # lone surrogates included
_scalars = st.none() | st.booleans() | st.integers() | st.floats() | _text
_json = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3), max_leaves=6
)
_digests = st.sampled_from([hash_bytes(bytes([i])) for i in range(4)]) | st.text(
    "0123456789abcdefABCDEF", min_size=31, max_size=33
)


def _dumped(value: object, raw: bool) -> bytes:
    """JSON as a store might hold it: escaped, or with raw (even lone-surrogate) UTF-8."""
    return json.dumps(value, ensure_ascii=not raw).encode("utf-8", "surrogatepass")


_entries = st.lists(st.tuples(_digests, st.integers(-1, 70), st.integers(-1, 70)).map(list) | _json, max_size=5)
_index_like = st.fixed_dictionaries(
    {"format": st.just(packs.PACK_FORMAT) | _json, "size": st.integers(-1, 200) | _json, "entries": _entries | _json},
    optional={"extra": _json},
)
_consistent_index = st.lists(st.integers(0, 50), max_size=6).map(lambda sizes: packs.encode_index(sources(*sizes))[1])
_deep = st.tuples(st.sampled_from([b"[", b'{"a":', b'{"entries":[']), st.integers(1, 3_000)).map(lambda t: t[0] * t[1])
INDEX_INPUTS = st.one_of(
    st.binary(max_size=300),
    _deep,
    st.tuples(_json | _index_like, st.booleans()).map(lambda t: _dumped(*t)),
    st.tuples(_index_like, st.booleans()).map(lambda t: _dumped(*t)),
    _consistent_index,
    st.tuples(_consistent_index, st.integers(0, 10_000), st.integers(0, 255)).map(
        lambda t: t[0][: t[1] % (len(t[0]) + 1)] + bytes([t[2]]) + t[0][t[1] % (len(t[0]) + 1) + 1 :]
    ),  # one byte changed
)
FUZZ = settings(max_examples=2000, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(INDEX_INPUTS)
def test_fuzz_pack_index_decoder(data: bytes) -> None:
    pack_id, data = named(data)
    try:
        index = packs.decode_index(pack_id, data, WHERE)
    except IntegrityError as exc:
        assert_integrity_error_naming(exc, WHERE)
        return
    assert index.pack_id == pack_id and all(is_digest(e.digest) for e in index.entries)
    assert [e.offset for e in index.entries] == [
        sum(e.size for e in index.entries[:i]) for i in range(len(index.entries))
    ]
    assert index.size == sum(e.size for e in index.entries)


_locator_like = st.fixed_dictionaries(
    {
        "format": st.just(packs.LOCATOR_FORMAT) | _json,
        "release": st.just(hash_bytes(b"r")) | _json,
        "packs": st.dictionaries(_digests, st.lists(_digests, max_size=3) | _json, max_size=3) | _json,
        "loose": st.lists(_digests, max_size=3) | _json,
    },
    optional={"extra": _json},
)


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=200), _deep, st.tuples(_locator_like | _json, st.booleans()).map(lambda t: _dumped(*t))
    )
)
def test_fuzz_locator_decoder(data: bytes) -> None:
    where = "s3://bucket/p/locators/r.json"
    try:
        locator = packs.decode_locator(hash_bytes(b"r"), data, where)
    except IntegrityError as exc:
        assert_integrity_error_naming(exc, where)
        return
    assert all(is_digest(p) and all(is_digest(d) for d in ds) for p, ds in locator.packs.items())
    assert all(is_digest(d) for d in locator.loose)
