"""Which units a shard builds: a deterministic partition of a plan's units, balanced by duration.

Every shard of a fleet (a CI matrix, a Kubernetes Indexed Job, an AWS Batch array) computes the
same partition on its own, with nothing but the store between them, so the partition depends on
the unit keys and the durations handed in, never on the order units come in or on the host.

Balancing is greedy longest-first: units sorted by duration (longest first; ties and units of
unknown duration by a stable hash of the key), each to the least loaded shard (ties: the lowest
index). Each step adds one unit to the least loaded shard, so the longest shard never exceeds
the shortest by more than one unit's duration. Units of unknown duration count as the median of
the known ones (1.0 when none is known: then the shards differ by at most one unit in count).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from neffbuild.errors import InputError
from neffbuild.hashing import hash_bytes

MAX_SHARDS = 4096
# Where fleet engines put a worker's index and the fleet's size (NEFFBUILD_SHARDS: ours, for a
# Kubernetes Indexed Job, whose pods are told their index but not the Job's completions).
INDEX_VARIABLES = (
    ("JOB_COMPLETION_INDEX", "NEFFBUILD_SHARDS"),
    ("AWS_BATCH_JOB_ARRAY_INDEX", "AWS_BATCH_JOB_ARRAY_SIZE"),
)
_SPEC = re.compile(r"(\d{1,5})/(\d{1,5})")


@dataclass(frozen=True)
class ShardSpec:
    index: int  # 0-based
    count: int
    source: str = "--shard"  # where the index came from, for messages and reports

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class Assignment:
    """Unit ids per shard (in build order: longest first) and each shard's predicted seconds."""

    shards: tuple[tuple[str, ...], ...]
    predicted_s: tuple[float, ...]
    known: frozenset[str]  # unit ids whose duration was recorded (the rest are estimates)

    def shard_of(self, unit_id: str) -> int:
        return next(i for i, ids in enumerate(self.shards) if unit_id in ids)


def parse_shard(text: str) -> ShardSpec:
    """`--shard I/N`: shard I (0-based) of N."""
    match = _SPEC.fullmatch(text.strip())
    if not match:
        raise InputError(f"--shard {text!r}: not INDEX/COUNT", hint="e.g. --shard 0/4 (indexes run from 0 to COUNT-1)")
    return checked(int(match[1]), int(match[2]), "--shard")


def checked(index: int, count: int, source: str) -> ShardSpec:
    if not 1 <= count <= MAX_SHARDS:
        raise InputError(f"{source}: shard count {count} is out of range", hint=f"give 1 to {MAX_SHARDS} shards")
    if not 0 <= index < count:
        raise InputError(
            f"{source}: shard index {index} is not below the count {count}", hint="indexes run from 0 to COUNT-1"
        )
    return ShardSpec(index, count, source)


def shard_from_env(env: Mapping[str, str], count: int | None = None) -> ShardSpec | None:
    """The shard an engine's environment names, or None when it names none. count (--shards)
    beats the engine's own size variable."""
    for index_name, count_name in INDEX_VARIABLES:
        raw = env.get(index_name)
        if raw is None or raw == "":
            continue
        size = count if count is not None else _int(env.get(count_name), count_name)
        if size is None:
            raise InputError(
                f"{index_name}={raw} is set but the shard count is not",
                hint=f"pass --shards N (or set {count_name}) to the number of shards in the fleet",
            )
        index = _int(raw, index_name)
        assert index is not None
        return checked(index, size, index_name)
    return None


def _int(raw: str | None, name: str) -> int | None:
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise InputError(
            f"{name}={raw!r} is not a whole number", hint=f"check the environment that sets {name}"
        ) from None


def assign(units: Sequence[tuple[str, str]], count: int, durations: Mapping[str, float]) -> Assignment:
    """Partition (unit_id, key) pairs into count shards, balanced by durations (seconds by unit id)."""
    known = {u: s for u, s in durations.items() if s > 0}
    fallback = statistics.median(known.values()) if known else 1.0
    cost = {unit_id: known.get(unit_id, fallback) for unit_id, _ in units}
    order = sorted(units, key=lambda u: (-cost[u[0]], hash_bytes(u[1].encode()), u[0]))
    shards: list[list[str]] = [[] for _ in range(count)]
    load = [0.0] * count
    for unit_id, _ in order:
        lightest = min(range(count), key=lambda i: (load[i], i))
        shards[lightest].append(unit_id)
        load[lightest] += cost[unit_id]
    return Assignment(
        tuple(tuple(s) for s in shards), tuple(round(x, 3) for x in load), frozenset(u for u, _ in units if u in known)
    )
