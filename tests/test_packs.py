"""Pack planning and index encoding (pure; the S3 tests cover the I/O)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neffbuild.errors import IntegrityError
from neffbuild.hashing import hash_bytes
from neffbuild.materialize import BlobTarget
from neffbuild.store import packs
from neffbuild.store.base import BlobSource


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
    twins = targets_for(index, 1) + [BlobTarget(index.entries[1].digest, 10, Path("/cache/twin"))]
    [fetch] = packs.plan_ranges(index, twins)
    assert (fetch.start, fetch.end) == (10, 20) and [p.start for p in fetch.pieces] == [0, 0]


def test_a_small_pull_is_split_across_connections() -> None:
    assert packs.range_size(64 << 20, jobs=16) == 4 << 20  # 64 MiB over 16 connections
    assert packs.range_size(5 << 20, jobs=16) == packs.RANGE_MIN  # 5 MiB: a few connections, not 16
    assert packs.range_size(1 << 30, jobs=16) == packs.RANGE_TARGET
    assert packs.range_size(100, jobs=16) == packs.RANGE_MIN
    index, _ = packs.encode_index(sources(*[100] * 10))
    assert len(packs.plan_ranges(index, targets_for(index, *range(10)), size=300)) == 4
