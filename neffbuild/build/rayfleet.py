"""`neffbuild build --ray [ADDRESS]`: every unit of a manifest as one Ray task, then the fan-in.

Ray provides the machines and the placement; neffbuild keeps no scheduler of its own. The driver
plans the manifest, freezes the plan as a document (units, keys, this host's facts), and submits
one task per unit with the resources a unit's compile takes: CPUs (the unit's OMP_NUM_THREADS,
else 1), memory (--unit-memory) and, for the neuron backend, one Neuron core per tensor-parallel
rank (Ray's `neuron_cores` resource). Each task plans again on its node and builds its one unit
exactly as `neffbuild build` does (fresh worker process, fresh cache dir, publish to the store):
a node whose facts differ from the driver's fails that unit, naming the fields, rather than
publishing bundles under keys nobody will ask for. The store is the only meeting point: when
every task has returned, the driver releases what the store holds (`neffbuild release`), so a
task that failed, or a node that died, leaves the tag where it was and names the units missing.

Nodes need the manifest and model at the same paths as the driver (a shared image or volume),
and their own store credentials (instance role, environment), never sent in task arguments.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from neffbuild import descriptors
from neffbuild.build.compile import BuildOptions, build
from neffbuild.build.fanin import ReleaseResult, release_manifest
from neffbuild.build.fleet import checked_document, recorded_durations
from neffbuild.build.report import Report, emit, from_build, merged
from neffbuild.build.sizing import unit_shares
from neffbuild.documents.manifest import load_manifest
from neffbuild.documents.records import parse, to_json
from neffbuild.errors import InputError
from neffbuild.store import StoreChoice
from neffbuild.units.plan import BuildUnit, Plan, check_buildable, make_plan
from neffbuild.units.plandoc import plan_to_document, read_plan, selected, write_plan

log = logging.getLogger(__name__)
LOCAL = "local"  # `--ray` with no address: start a Ray instance on this machine for the build
RAY_HINT = "install the extra: pip install 'neffbuild[ray]'"
ENV_FACT = "env."  # a fingerprint's facts from the environment: env.NAME


@dataclass(frozen=True)
class RayBuild:
    report: Report  # every unit's row, from the task that built it
    release: ReleaseResult  # the fan-in: released, or the units still missing


def build_on_ray(
    manifest: Path, store: StoreChoice, *, env: Mapping[str, str], options: BuildOptions, address: str,
    report_file: Path | None = None,
) -> RayBuild:  # fmt: skip  # parameters packed by meaning, not one a line
    """Plan MANIFEST here, build each unit as a Ray task on the cluster at address, release."""
    ray = _ray()
    loaded = load_manifest(manifest)
    plan = make_plan(loaded, env)
    check_buildable(plan)
    opened = store.open(env, manifest_default=loaded.manifest.store, create=True)
    tag = options.tag or loaded.manifest.name
    document = plan_to_document(plan, recorded_durations(opened, plan.units, tag))
    with tempfile.TemporaryDirectory(prefix="neffbuild-ray-") as scratch:
        plan_file = Path(scratch) / "plan.json"
        write_plan(plan_file, document)
        started_here = not ray.is_initialized()
        if started_here:
            ray.init(address=None if address == LOCAL else address, include_dashboard=False, log_to_driver=False)
        try:
            shares = unit_shares(opened, plan.units, plan.units, tag) if options.memory_auto else {}
            needs = {unit_id: s.need for unit_id, s in shares.items()}
            reports = _run_tasks(ray, plan, manifest.resolve(), opened.url, plan_file.read_bytes(), options, needs)
        finally:
            if started_here:
                ray.shutdown()
        release = release_manifest(
            manifest, StoreChoice(opened.url), env=env, tag=options.tag, plan_file=plan_file, signing=options.signing
        )
    report = merged(
        reports, release.units, store=release.store, name=release.name,
        release_id=release.release_id or "", tag=release.tag or "",
    )  # fmt: skip  # arguments packed by meaning, not one a line
    emit(report, report_file, env)
    return RayBuild(report, release)


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InputError("--ray: Ray is not installed here", hint=RAY_HINT) from None
    return ray


def _run_tasks(
    ray: Any,
    plan: Plan,
    manifest: Path,
    store_url: str,
    plan_json: bytes,
    options: BuildOptions,
    needs: Mapping[str, int],  # --unit-memory auto: Ray memory by unit id
) -> list[Report]:
    task = ray.remote(max_retries=0)(build_unit_task)  # a retry is the user's --retries, inside the task
    options = replace(options, signing=None, memory_auto=False)  # the driver signs and sizes; no key travels
    pending = {
        task.options(**unit_resources(unit, plan.backend_name, needs.get(unit.unit_id, options.unit_memory))).remote(
            str(manifest), store_url, plan_json, unit.unit_id, options
        ): unit.unit_id
        for unit in plan.units
    }
    log.info("ray: %d units submitted", len(pending))
    reports = []
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        unit_id = pending.pop(done[0])
        try:
            report = parse(Report, ray.get(done[0]), f"ray task of {unit_id}")
        except ray.exceptions.RayError as exc:  # the node or its worker died: the release names it missing
            lines = [line for line in str(exc).splitlines() if line.strip()]
            log.error("ray: %s: the task failed: %s", unit_id, lines[-1] if lines else type(exc).__name__)
            continue
        reports.append(report)
        for row in report.units:
            if row.status == "failed":
                log.error("ray: %s: failed: %s", row.unit_id, row.error or row.killed)
    return reports


def unit_resources(unit: BuildUnit, backend: str, unit_memory: int | None) -> dict[str, Any]:
    """What Ray reserves for one unit's task."""
    threads = unit.env.get("OMP_NUM_THREADS", "")
    resources: dict[str, Any] = {"num_cpus": int(threads) if threads.isdigit() and int(threads) > 0 else 1}
    if unit_memory is not None:
        resources["memory"] = unit_memory
    described = descriptors.find(backend)
    if described is not None and described.fleet_resource:  # one per tensor-parallel rank
        resources["resources"] = {described.fleet_resource: int(unit.normalized.get("tensor_parallel") or 1)}
    return resources


def planned_env(here: Mapping[str, str], planned: Mapping[str, str], found: Mapping[str, str]) -> dict[str, str]:
    """This node's environment with the keyed variables as the driver planned them (planned and
    found: the unit's fingerprint there and here). Ray sets some in its workers (OMP_NUM_THREADS
    to the task's CPUs), which would change the unit's key."""
    env = dict(here)
    for fact in {*planned, *found}:
        if fact.startswith(ENV_FACT):
            name = fact.removeprefix(ENV_FACT)
            if fact in planned:
                env[name] = planned[fact]
            else:
                env.pop(name, None)
    return env


def build_unit_task(manifest: str, store_url: str, plan_json: bytes, unit_id: str, options: BuildOptions) -> bytes:
    """Runs on a Ray node: plan there, check it against the driver's plan, build the one unit;
    its report row as JSON (a build never moves the tag from here: the driver releases)."""
    with tempfile.TemporaryDirectory(prefix="neffbuild-ray-task-") as scratch:
        plan_file = Path(scratch) / "plan.json"
        plan_file.write_bytes(plan_json)
        loaded = load_manifest(Path(manifest))
        planned = next(u for u in read_plan(plan_file).units if u.unit_id == unit_id).fingerprint
        here = next(u for u in make_plan(loaded, os.environ).units if u.unit_id == unit_id).fingerprint
        env = planned_env(os.environ, planned, here)
        plan = make_plan(loaded, env)
        checked_document(plan, plan_file)  # this node's keys are the driver's, or it fails naming why
    store = StoreChoice(store_url).open(env)
    one = replace(options, jobs=1, may_release=False)
    outcome = build(plan, store, env=env, options=one, units=selected(plan, [unit_id]), shard="ray")
    return json.dumps(to_json(from_build(outcome))).encode()
