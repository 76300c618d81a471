"""The views of CI's commands: plan, build, release, push, tag."""

from __future__ import annotations

from typing import TYPE_CHECKING

from neffbuild.cli.lines import human_size
from neffbuild.cli.views.console import Console, say_err, view, view_as

if TYPE_CHECKING:
    from neffbuild.build.fanin import ReleaseResult
    from neffbuild.build.fleet import FleetPlan
    from neffbuild.build.push import PushResult
    from neffbuild.build.report import BuildReport
    from neffbuild.documents.records import TagRecord
    from neffbuild.units.plan import Plan


def _plan_document(plan: Plan) -> object:
    from neffbuild.units.plan import plan_document

    return plan_document(plan)


@view_as(_plan_document)
def plan(console: Console, plan: Plan) -> None:
    for note in plan.notes:
        say_err(f"note: {note}")  # whole lines: CI logs are grepped
    console.table(
        f"{plan.loaded.manifest.name}: {len(plan.units)} units ({plan.backend_name})",
        [("unit", True), ("key", True), ("mode", False), ("dtype", False), ("device", False)],
        [(u.unit_id, u.key, u.entry.mode, u.entry.dtype, u.entry.device) for u in plan.units],
    )
    doubled = [
        u for u in plan.units if u.graph_batch is not None and u.graph_batch != u.shape.batch * u.entry.prompts_per_call
    ]
    for u in doubled:  # beside the label, which counts images: the graphs see more
        console.out.print(
            f"{u.unit_id}: the graphs see batch {u.graph_batch} (classifier-free guidance doubles it)", markup=False
        )
    if plan.units:
        console.out.print("fingerprint:")
        for k, v in plan.units[0].fingerprint.items():
            console.out.print(f"  {k} = {v}")
        # An argument keyed as a comparison's outcome is not warmup only: its own line says so.
        left_out = sorted({name for u in plan.units for name in u.left_out if name not in u.reduced})
        if left_out:
            console.out.print(f"left out of the keys (warmup only): {', '.join(left_out)}")
        reduced = dict(sorted({k: v for u in plan.units for k, v in u.reduced.items()}.items()))
        for name, why in reduced.items():
            console.out.print(
                f"keyed only as {why}: {name} values with one outcome build the same graphs", markup=False
            )


@view
def build(console: Console, report: BuildReport) -> None:
    columns = [("unit", True), ("status", True), ("time", False), ("compiles", False), ("first call", False)]
    columns += [("files", False), ("size", False), ("uploaded", False)]
    rows = []
    for o in report.outcomes:
        built = o.status == "built"
        first = f"{o.first_call_s:.1f} s" if built else "-"
        took = f"{o.seconds:.1f} s" if o.status != "present" else "-"
        rows.append(
            (
                o.unit_id,
                o.status,
                took,
                str(o.compiles),
                first,
                str(o.files),
                human_size(o.size),
                human_size(o.uploaded),
            )
        )
    # A failed unit's error, log and its last lines are the command's error, printed once.
    console.table(f"{report.name} -> {report.store}", columns, rows)
    if report.release_id:
        console.out.print(f"release {report.release_id}; tag {report.tag} -> it")
    elif not report.complete and not report.failed:
        where = f"shard {report.shard}" if report.shard else "this build"
        console.out.print(
            f"{where}: {len(report.outcomes)} of {report.units_total} units; no release: "
            "`neffbuild release MANIFEST` publishes it once every shard is done"
        )


@view
def release(console: Console, result: ReleaseResult) -> None:
    source = "the plan document" if result.planned else "this host's plan"
    if result.release_id:
        console.out.print(f"{result.name}: {len(result.units)} units from {source}, every bundle in {result.store}")
        console.out.print(f"release {result.release_id}; tag {result.tag} -> it")
    else:
        console.out.print(
            f"{result.name}: {len(result.missing)} of {len(result.units)} units from {source} have no bundle in {result.store}:"
        )
        for unit_id in result.missing:
            console.out.print(f"  missing  {unit_id}")


@view
def push(console: Console, result: PushResult) -> None:
    moved = (
        f"; tag {result.tag} -> it" if result.tag_moved else (f"; tag {result.tag} already there" if result.tag else "")
    )
    console.out.print(
        f"pushed release {result.release_id} to {result.destination}: {result.bundles_copied} bundles, "
        f"{result.blobs_uploaded} blobs ({human_size(result.bytes_uploaded)}) uploaded{moved}"
    )


@view
def tag(console: Console, record: TagRecord) -> None:
    console.out.print(f"tag {record.name} -> {record.release}")
    for event in record.history[-5:]:
        console.out.print(f"  {event.at}  {event.release}  by {event.by}")


def _fleet_document(fleet: FleetPlan) -> object:
    from neffbuild.units.plan import plan_document

    doc = plan_document(fleet.plan)
    assignment = fleet.assignment
    if assignment is not None:
        doc["shards"] = [
            {"shard": f"{i}/{len(assignment.shards)}", "units": list(ids), "predicted_s": assignment.predicted_s[i]}
            for i, ids in enumerate(assignment.shards)
        ]
    doc["durations"] = dict(fleet.document.durations)
    return doc


@view_as(_fleet_document)
def fleet_plan(console: Console, fleet: FleetPlan) -> None:
    """`plan --out/--shards`: the plan, then each shard's units and predicted time."""
    assignment = fleet.assignment
    plan(console, fleet.plan)
    if assignment is None:
        return
    known = len(assignment.known)
    source = (
        f"durations of {known} of {len(fleet.plan.units)} units from {fleet.durations_from}"
        if known
        else "no durations recorded: balanced by unit count"
    )
    console.out.print(f"{len(assignment.shards)} shards ({source}):")
    for i, ids in enumerate(assignment.shards):
        predicted = f"{assignment.predicted_s[i]:.0f} s" if known else f"{len(ids)} units"
        console.out.print(f"  shard {i}/{len(assignment.shards)}: {predicted}: {', '.join(ids) or '(nothing)'}")
