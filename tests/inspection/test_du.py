"""`neffbuild du`: every figure equals the sum computed here from the units the store was made of."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neffbuild.hashing import hash_bytes
from neffbuild.inspect.du import Reclaimable, disk_usage
from neffbuild.inspect.read import Snapshot, snapshot
from neffbuild.maint.gc import Policy, plan_gc, reclaimable
from neffbuild.store.base import Store
from tests.conftest import run_cli
from tests.inspectkit import Target, klein_unit, publish_units, target  # noqa: F401  (target: a fixture)


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
    assert [(s.name, s.members, s.bytes) for s in usage.by_entry] == [
        ("klein", 5, sum(everything.values()))
    ]  # 5 distinct bundles
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
    assert doc["bytes"] == disk_usage(target.store).bytes
    assert doc["reclaimable"] == {"objects": 0, "bytes": 0, "policy": "keep 3, grace 24h"}  # all just written: young
    assert {r["release_id"] for r in doc["by_release"]} == set(target.three.units)
    table = run_cli("du", "--store", target.url, env={**target.env, "COLUMNS": "80"})
    assert table.returncode == 0 and "dedup saves" in table.stdout and target.three.v3 in table.stdout


@pytest.mark.parametrize("policy", [(), ("--keep", "0", "--grace", "0"), ("--keep", "1", "--grace", "0")])
def test_reclaimable_equals_what_gc_dry_run_frees(target: Target, policy: tuple[str, ...]) -> None:
    gc = run_cli("gc", "--store", target.url, *policy, "--dry-run", "--json", env=target.env)
    du = run_cli("du", "--store", target.url, *policy, "--json", env=target.env)
    assert gc.returncode == du.returncode == 0, gc.stderr + du.stderr
    plan, reclaimable = json.loads(gc.stdout), json.loads(du.stdout)["reclaimable"]
    assert (reclaimable["objects"], reclaimable["bytes"]) == (plan["delete_objects"], plan["delete_bytes"])
    if policy[1:2] == ("0",):  # keep 0: v1 and v2 go (what v3 and the history share stays)
        assert plan["delete_objects"] > 0 and reclaimable["policy"] == "keep 0, grace 0s"
    table = run_cli("du", "--store", target.url, *policy, env={**target.env, "COLUMNS": "100"})
    assert f"{plan['delete_objects']} objects" in table.stdout.split("reclaimable by gc", 1)[1].splitlines()[0]


def test_reclaimable_reuses_du_reads_and_fetches_the_rest(target: Target, tmp_path: Path) -> None:
    """A release published after du's snapshot is still planned as gc plans it."""
    policy = Policy(keep=0, grace_s=0)
    snap = snapshot(target.store, all_bundles=True)
    late = publish_units(target.store, tmp_path / "late", "late", [klein_unit(512, 512)], tag="late")
    assert late not in snap.releases
    got = reclaimable(policy)(target.store, snap)
    plan = plan_gc(target.store, policy)
    assert (got.objects, got.bytes) == (plan.delete_objects, plan.delete_bytes) and got.objects > 0
