"""`neffbuild du`: every figure equals the sum computed here from the units the store was made of."""

from __future__ import annotations

import json

from neffbuild.hashing import hash_bytes
from neffbuild.inspect.du import Reclaimable, disk_usage
from neffbuild.inspect.read import Snapshot
from neffbuild.store.base import Store
from tests.conftest import run_cli
from tests.inspectkit import Target, target  # noqa: F401  (target: a fixture)


def _blobs(files: dict[str, bytes]) -> dict[str, int]:
    return {hash_bytes(d): len(d) for d in files.values()}


def test_figures_equal_sums_from_the_documents(target: Target) -> None:
    three = target.three
    per_release = {rid: {p: d for u in units for p, d in u.files.items()} for rid, units in three.units.items()}
    blobs = {rid: _blobs(files) for rid, files in per_release.items()}
    everything = {d: s for b in blobs.values() for d, s in b.items()}
    in_two = {d for d in everything if sum(d in b for b in blobs.values()) > 1}
    usage = disk_usage(target.store)
    assert (usage.blobs, usage.bytes) == (len(everything), sum(everything.values()))
    assert usage.logical_bytes == sum(len(d) for files in per_release.values() for d in files.values())
    assert (usage.shared_blobs, usage.shared_bytes) == (len(in_two), sum(everything[d] for d in in_two))
    assert usage.saved_bytes == usage.logical_bytes - usage.bytes and usage.saved_bytes > 0  # v1 and v2 share
    for row in usage.by_release:
        mine = blobs[row.release_id]
        assert (row.bytes, row.files) == (sum(mine.values()), len(per_release[row.release_id]))
        assert row.unique_bytes == sum(s for d, s in mine.items() if d not in in_two)
        assert row.shared_bytes == row.bytes - row.unique_bytes
    tags = {s.name: s for s in usage.by_tag}
    assert (tags["klein"].members, tags["klein"].bytes) == (3, sum(everything.values()))  # its history holds all three
    assert (tags["canary"].members, tags["canary"].bytes) == (1, sum(blobs[three.v3].values()))
    assert [(s.name, s.members, s.bytes) for s in usage.by_entry] == [("klein", 5, sum(everything.values()))]  # 5 distinct bundles
    old = {d: s for rid in (three.v1, three.v2) for d, s in blobs[rid].items()}
    toolchains = {s.name.split(",")[0]: (s.members, s.bytes) for s in usage.by_toolchain}
    assert toolchains == {"torch 2.13.0": (3, sum(old.values())), "torch 2.14.1": (2, sum(blobs[three.v3].values()))}
    assert usage.reclaimable is None


def test_gc_fills_reclaimable_through_its_seam(target: Target) -> None:
    seen: list[Snapshot] = []

    def plan(store: Store, snap: Snapshot) -> Reclaimable:  # what i11-gc's dry run plugs in
        seen.append(snap)
        return Reclaimable(objects=2, bytes=640, policy="keep 3, grace 24h")

    usage = disk_usage(target.store, reclaim=plan)
    assert usage.reclaimable == Reclaimable(2, 640, "keep 3, grace 24h")
    assert set(seen[0].releases) == set(target.three.units) and len(seen[0].bundles) == 5  # du's reads, reused


def test_cli_json_and_table(target: Target) -> None:
    result = run_cli("du", "--store", target.url, "--json", env=target.env)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["bytes"] == disk_usage(target.store).bytes and doc["reclaimable"] is None
    assert {r["release_id"] for r in doc["by_release"]} == set(target.three.units)
    table = run_cli("du", "--store", target.url, env={**target.env, "COLUMNS": "80"})
    assert table.returncode == 0 and "dedup saves" in table.stdout and target.three.v3 in table.stdout
