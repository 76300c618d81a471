"""What one build of a fleet builds: its plan (this host's, or the plan document's, checked
against this host), its shard of the units, and the durations that balance the shards.

Durations come from the tag's current release: the bundle each unit had there (the same unit id,
on this toolchain or an earlier one) recorded how long its load and first call took. Bundles of
this plan's own keys are left out on purpose: shards publish them while others still compute
their partition, and a partition that changed under a running fleet would lose or double units.
A plan document freezes the durations instead (`plan --out --shards`), which is what a fleet
whose tag may move meanwhile should use.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.refs import checked_doc, doc_where, find_doc, read_tag
from neffbuild.errors import NeffbuildError
from neffbuild.store import StoreChoice
from neffbuild.store.base import Store
from neffbuild.units.plan import BuildUnit, Plan
from neffbuild.units.plandoc import (
    PlanDocument,
    check_against,
    check_manifest,
    plan_to_document,
    read_plan,
    write_plan,
)
from neffbuild.units.shards import Assignment, ShardSpec, assign, shard_from_env

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selection:
    units: tuple[BuildUnit, ...]  # what this build builds, longest first
    assignment: Assignment
    shard: ShardSpec | None


def checked_document(plan: Plan, plan_file: Path | None) -> PlanDocument | None:
    """The plan document, checked against this manifest and this host's own plan (fails fast,
    before any worker starts, naming the facts that differ)."""
    if plan_file is None:
        return None
    document = read_plan(plan_file)
    check_manifest(document, plan.loaded, plan_file)
    check_against(document, plan, plan_file)
    return document


def select(
    plan: Plan,
    store: Store | None,
    *,
    env: Mapping[str, str],
    shard: ShardSpec | None,
    shard_count: int | None,
    document: PlanDocument | None,
    tag: str | None,
) -> Selection:
    """This build's units: the shard named by --shard, else by the engine's environment (count
    from --shards, the plan document, or the engine), else every unit."""
    count = shard_count or (document.shards if document and document.shards else None)
    chosen = shard or shard_from_env(env, count)
    if chosen is None and shard_count is not None:
        from neffbuild.errors import InputError

        raise InputError(
            f"--shards {shard_count} without a shard index",
            hint="add --shard I/N, or run where JOB_COMPLETION_INDEX or AWS_BATCH_JOB_ARRAY_INDEX is set",
        )
    if document is not None:
        durations = dict(document.durations)
    elif store is not None:
        durations = recorded_durations(store, plan.units, tag or plan.loaded.manifest.name)
    else:
        durations = {}
    assignment = assign([(u.unit_id, u.key) for u in plan.units], chosen.count if chosen else 1, durations)
    by_id = {u.unit_id: u for u in plan.units}
    ids = assignment.shards[chosen.index if chosen else 0]
    return Selection(tuple(by_id[i] for i in ids), assignment, chosen)


def recorded_durations(store: Store, units: Sequence[BuildUnit], tag: str) -> dict[str, float]:
    """Seconds (load + first call) by unit id, from the bundles of the tag's current release;
    empty when the tag or its release cannot be read (then shards balance by count)."""
    from neffbuild.documents.records import Release

    try:
        found = read_tag(store, tag)
        if found is None:
            return {}
        release = find_doc(store, Release, found[0].release)
        if release is None:
            return {}
        ours = {u.unit_id for u in units}
        current = {u.key for u in units}
        wanted = [(u.unit_id, u.key) for u in release.units if u.unit_id in ours and u.key not in current]
        docs = store.get_docs("bundles", [key for _, key in wanted], jobs=16)
        durations = {}
        for unit_id, key in wanted:
            data = docs.get(key)
            if data is not None:
                record = checked_doc(BundleRecord, data, doc_where(store, BundleRecord, key), key)
                durations[unit_id] = record.timings.total_s
        return durations
    except NeffbuildError as exc:  # a hint for balance only: never worth failing the build for
        log.warning("durations from tag %s not read (%s): shards are balanced by unit count", tag, exc.message)
        return {}


@dataclass(frozen=True)
class FleetPlan:
    """`neffbuild plan` with --out or --shards: the plan, its document, and the shards' assignment."""

    plan: Plan
    document: PlanDocument
    assignment: Assignment | None  # with --shards
    durations_from: str | None  # where the durations came from ("tag NAME in STORE"), None: none recorded


def plan_fleet(
    manifest: Path,
    store: StoreChoice,
    *,
    env: Mapping[str, str],
    shards: int | None,
    out: Path | None,
    tag: str | None = None,
) -> FleetPlan:
    """Plan MANIFEST on this host; with a reachable store, read the durations that balance shards
    (a store that cannot be read only costs the balance, with a warning); write --out."""
    from neffbuild.documents.manifest import load_manifest
    from neffbuild.units.plan import make_plan
    from neffbuild.units.plancache import cache_dir

    plan = make_plan(load_manifest(manifest), env, cache=cache_dir(env))
    durations: dict[str, float] = {}
    source = None
    if store.url or env.get("NEFFBUILD_STORE") or plan.loaded.manifest.store:
        name = tag or plan.loaded.manifest.name
        try:
            opened = store.open(env, manifest_default=plan.loaded.manifest.store)
            durations = recorded_durations(opened, plan.units, name)
            source = f"tag {name} in {opened.url}" if durations else None
        except NeffbuildError as exc:
            log.warning("no durations read (%s): shards are balanced by unit count", exc.message)
    document = plan_to_document(plan, durations, shards or 0)
    if out is not None:
        write_plan(out, document)
    assignment = assign([(u.unit_id, u.key) for u in plan.units], shards, durations) if shards else None
    return FleetPlan(plan, document, assignment, source)
