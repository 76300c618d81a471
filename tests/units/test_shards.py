"""Shards: every unit in exactly one shard, the same partition in every process, balanced by
recorded durations; the index and count from flags or from the fleet engine's environment."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neffbuild.errors import InputError
from neffbuild.hashing import hash_bytes
from neffbuild.units.shards import ShardSpec, assign, parse_shard, shard_from_env
from tests.conftest import ROOT

UNITS = [
    (f"m{e}/{h}x{w}x1", hash_bytes(f"{e}-{h}-{w}".encode()))
    for e in range(3)
    for h in (64, 128, 256)
    for w in (64, 128, 256, 512)
]


@pytest.mark.parametrize("count", range(1, 9))
def test_every_unit_lands_in_exactly_one_shard(count: int) -> None:
    durations = {u: float(i % 7 + 1) for i, (u, _) in enumerate(UNITS[::2])}  # some known, some not
    shards = assign(UNITS, count, durations).shards
    placed = [u for shard in shards for u in shard]
    assert sorted(placed) == sorted(u for u, _ in UNITS) and len(placed) == len(set(placed))
    assert len(shards) == count


def test_the_partition_is_the_same_in_other_processes_and_for_any_input_order() -> None:
    durations = {u: float(len(u)) for u, _ in UNITS[:10]}
    mine = {n: assign(UNITS, n, durations).shards for n in range(1, 9)}
    shuffled = UNITS[:]
    random.Random(7).shuffle(shuffled)
    assert {n: assign(shuffled, n, durations).shards for n in range(1, 9)} == mine
    program = (
        "import json, sys; from neffbuild.units.shards import assign; units, durations = json.load(sys.stdin);"
        "print(json.dumps({n: assign([tuple(u) for u in units], n, durations).shards for n in range(1, 9)}))"
    )
    for seed in ("1", "2"):  # another interpreter, another string hash seed
        out = subprocess.run(
            [sys.executable, "-c", program], input=json.dumps([shuffled, durations]), capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        theirs = {int(n): tuple(tuple(s) for s in shards) for n, shards in json.loads(out.stdout).items()}
        assert theirs == mine


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.5, max_value=3600), min_size=1, max_size=60), st.integers(1, 8))
def test_with_recorded_durations_the_longest_shard_exceeds_the_shortest_by_at_most_one_unit(
    seconds: list[float], count: int
) -> None:
    units = [(f"e/{i}", hash_bytes(str(i).encode())) for i in range(len(seconds))]
    durations = {u: s for (u, _), s in zip(units, seconds, strict=True)}
    result = assign(units, count, durations)
    loads = [sum(durations[u] for u in shard) for shard in result.shards]
    assert max(loads) - min(loads) <= max(seconds) + 1e-6
    assert result.predicted_s == tuple(round(x, 3) for x in loads)
    for shard in result.shards:  # each shard builds its longest units first
        assert [durations[u] for u in shard] == sorted((durations[u] for u in shard), reverse=True)


def test_without_durations_shards_differ_by_at_most_one_unit() -> None:
    for count in range(1, 9):
        sizes = [len(s) for s in assign(UNITS, count, {}).shards]
        assert max(sizes) - min(sizes) <= 1


def test_a_unit_with_no_recorded_duration_counts_as_the_median() -> None:
    units = [("a", "1" * 32), ("b", "2" * 32), ("c", "3" * 32), ("new", "4" * 32)]
    result = assign(units, 2, {"a": 10.0, "b": 20.0, "c": 30.0})
    assert result.known == {"a", "b", "c"}
    # new counts 20 s (the median): c 30 | b 20, then new to the lighter, then a to the lighter
    assert [set(s) for s in result.shards] == [{"c", "a"}, {"b", "new"}] and result.predicted_s == (40.0, 40.0)


def test_shard_flags_and_engine_variables() -> None:
    assert parse_shard("2/5") == ShardSpec(2, 5)
    for bad in ("5/5", "1/0", "x/2", "-1/2", "1 of 2"):
        with pytest.raises(InputError):
            parse_shard(bad)
    assert shard_from_env({}) is None
    assert shard_from_env({"JOB_COMPLETION_INDEX": "3", "NEFFBUILD_SHARDS": "4"}) == ShardSpec(
        3, 4, "JOB_COMPLETION_INDEX"
    )
    assert shard_from_env({"JOB_COMPLETION_INDEX": "1"}, count=2) == ShardSpec(1, 2, "JOB_COMPLETION_INDEX")
    batch = {"AWS_BATCH_JOB_ARRAY_INDEX": "0", "AWS_BATCH_JOB_ARRAY_SIZE": "10"}
    assert shard_from_env(batch) == ShardSpec(0, 10, "AWS_BATCH_JOB_ARRAY_INDEX")
    with pytest.raises(InputError, match="JOB_COMPLETION_INDEX=1 is set but the shard count is not"):
        shard_from_env({"JOB_COMPLETION_INDEX": "1"})
    with pytest.raises(InputError, match="shard index 4 is not below the count 4"):
        shard_from_env({"JOB_COMPLETION_INDEX": "4", "NEFFBUILD_SHARDS": "4"})
    with pytest.raises(InputError, match="'x' is not a whole number"):
        shard_from_env({"AWS_BATCH_JOB_ARRAY_INDEX": "x", "AWS_BATCH_JOB_ARRAY_SIZE": "2"})
