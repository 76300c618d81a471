"""The views of the store's commands: ls, show, diff (and `diff --host`), du, gc (and `gc --cache-dir`)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from neffbuild.cli.lines import human_size
from neffbuild.cli.views.console import Console, json_fields, say_err, view, view_as

if TYPE_CHECKING:
    from neffbuild.host.prune import CachePrune
    from neffbuild.inspect.diff import Diff, HostDiff
    from neffbuild.inspect.du import Usage
    from neffbuild.inspect.ls import Listing, TagHistory
    from neffbuild.inspect.show import BundleView, ReleaseView, UnitView
    from neffbuild.inspect.unused import UnusedReport
    from neffbuild.maint.gc import GcPlan, GcResult


SHOWN_FILES = 20  # a diff's files listed; --json lists every one


def _when(at: str | None) -> str:
    """An ISO time as `2026-12-03 20:58` (UTC): the seconds and zone say little in a table."""
    return at[:16].replace("T", " ") if at else "-"


@view
def listing(console: Console, listing: Listing) -> None:
    console.table(
        f"tags in {listing.store}",
        [("tag", True), ("release", True), ("name", False), ("moved", False), ("by", False), ("moves", False)],
        [
            (t.name, t.release, t.release_name or "(missing)", _when(t.moved_at), t.by, str(t.history))
            for t in listing.tags
        ],
    )
    console.table(
        f"releases in {listing.store}, newest first",
        [("release", True), ("created", False), ("size", False), ("units", False), ("files", False), ("tags", False)]
        + [("name", False), ("backend", False), ("toolchain", False)],
        [
            (
                r.release_id,
                _when(r.created),
                human_size(r.bytes),
                str(r.units),
                str(r.files),
                ",".join(r.tags) or "-",
                r.name,
                r.backend,
                r.toolchain,
            )
            for r in listing.releases
        ],
    )


@view
def tag_history(console: Console, history: TagHistory) -> None:
    console.table(
        f"tag {history.tag} in {history.store}, newest first",
        [("ref", True), ("release", True), ("name", False), ("at", False), ("by", False)],
        [(e.ref, e.release, e.release_name or "(missing)", _when(e.at), e.by) for e in history.events],
    )


@view
def shown_ref(console: Console, view: ReleaseView | BundleView) -> None:
    """`neffbuild show`: a release's units, or a bundle's files."""
    from neffbuild.inspect.ls import toolchain

    if view.kind == "bundle":
        u = view.unit
        _unit_header(console, u, f"bundle {u.key} ({u.unit_id}): {u.files} files, {human_size(u.bytes)}")
        console.out.print(f"  toolchain: {toolchain(u.fingerprint)}", markup=False)
        console.table(
            f"files of {u.unit_id}",
            [("path", True), ("size", False), ("digest", False)],
            [(f.path, human_size(f.size), f.digest) for f in view.files],
        )
        return
    tagged = f" (tag {view.tag})" if view.tag else ""
    console.out.print(
        f"release {view.release_id}{tagged}: {view.name}, {view.backend}, {len(view.units)} units, {view.files} files, {human_size(view.bytes)}",
        markup=False,
    )
    console.out.print(f"  toolchain: {toolchain(view.fingerprint)}", markup=False)
    if view.env:
        console.out.print(f"  env: {' '.join(f'{k}={v}' for k, v in view.env.items())}", markup=False)
    if view.shared:
        console.out.print(
            f"  {len(view.shared)} paths built differently by several units, one kept (content-keyed)", markup=False
        )
    console.table(
        "units",
        [("unit", True), ("key", True), ("build", False), ("size", False), ("files", False), ("first call", False)]
        + [
            ("graphs", False),
            ("mode", False),
            ("dtype", False),
            ("pipeline", False),
            ("components", False),
            ("model", False),
        ],
        [
            (
                u.unit_id,
                u.key,
                f"{u.timings.total_s:.1f} s",
                human_size(u.bytes),
                str(u.files),
                f"{u.timings.first_call_s:.1f} s",
                str(_graphs(u.counters)),
            )
            + (u.mode, u.dtype, u.pipeline, ",".join(u.components) or "-", u.model)
            for u in view.units
        ],
    )
    for u in view.units:
        counted = ", ".join(f"{k}={v}" for k, v in sorted(u.counters.items()) if v)
        console.out.print(f"{u.unit_id}: {counted or 'no compile counters'}", markup=False)


def unused_files(console: Console, report: UnusedReport) -> None:
    """`neffbuild show REF --unused TRACE`: the files no unit opened, largest first."""
    for problem in report.mismatch:  # on stderr, --json or not: the list may not be this release's
        say_err(f"warning: {report.trace} may not be a trace of {report.ref}: {problem}")
    _unused(console, report)


@view
def _unused(console: Console, report: UnusedReport) -> None:
    tagged = f" (tag {report.tag})" if report.tag else ""
    console.table(
        f"files of {report.name}{tagged} that no unit opened in {report.trace}",
        [("path", True), ("size", False)],
        [(f.path, human_size(f.size)) for f in report.unused],
    )
    console.out.print(
        f"{len(report.unused)} of {report.files} files unused, {human_size(report.unused_bytes)} of "
        f"{human_size(report.bytes)}; the replay opened {report.opened} ({human_size(report.opened_bytes)})",
        markup=False,
    )


def _unit_header(console: Console, u: UnitView, title: str) -> None:
    shape = "x".join(str(u.shape.get(k, "?")) for k in ("height", "width", "batch")) if u.shape else "-"
    console.out.print(title, markup=False)
    console.out.print(
        f"  {u.model} {u.pipeline} {u.dtype} mode {u.mode}, shape {shape}, components {','.join(u.components) or '-'}",
        markup=False,
    )
    console.out.print(
        f"  built {_when(u.created_at)}: load {u.timings.load_s:.1f} s, first call {u.timings.first_call_s:.1f} s, {_graphs(u.counters)} graphs",
        markup=False,
    )


def _graphs(counters: Mapping[str, int]) -> int:
    """Graphs the listed components produced (the build's own counter, graphs.<component>)."""
    return sum(v for k, v in counters.items() if k.startswith("graphs."))


@view_as(lambda diff: {**json_fields(diff), "identical": diff.identical})
def differences(console: Console, diff: Diff) -> None:
    """`neffbuild diff`: units added, removed, changed (each field old -> new), then files."""
    say = functools.partial(console.out.print, markup=False, soft_wrap=True)
    files = diff.files_added + diff.files_removed + diff.files_changed
    say(
        f"{diff.kind} {diff.old} -> {diff.new}: {len(diff.changed)} changed, {len(diff.added)} added, {len(diff.removed)} removed, "
        f"{len(diff.unchanged)} unchanged units; {len(files)} files differ"
    )
    if diff.kind == "release" and not (diff.changed or diff.added or diff.removed):
        say("  same graphs: every unit has the key it had (what differs is nothing a compiled graph sees)")
    for change in diff.release:
        say(f"  {change.path} {_change(change.path, change.old, change.new)}")
    for unit in diff.changed:
        renamed = f" (was {unit.old_unit_id})" if unit.old_unit_id != unit.unit_id else ""
        graphs = {True: " (same graphs: every component received the same inputs)", False: "", None: ""}[
            unit.same_graphs
        ]
        say(f"changed  {unit.unit_id}{renamed}: key {unit.old_key} -> {unit.new_key}{graphs}")
        for change in unit.fields:
            say(f"  {change.path} {_change(change.path, change.old, change.new)}")
        if not unit.fields:
            say("  (no field differs: the keys were computed by another neffbuild version)")
    for unit_id in diff.added:
        say(f"added    {unit_id}")
    for unit_id in diff.removed:
        say(f"removed  {unit_id}")
    if not files:
        return
    added, removed = sum(f.new_size or 0 for f in diff.files_added), sum(f.old_size or 0 for f in diff.files_removed)
    say(
        f"files: {len(diff.files_added)} added ({human_size(added)}), {len(diff.files_removed)} removed ({human_size(removed)}), {len(diff.files_changed)} changed"
    )
    for f in files[:SHOWN_FILES]:
        status = "added" if f.old_size is None else "removed" if f.new_size is None else "changed"
        sizes = (
            human_size(f.new_size or 0)
            if status == "added"
            else human_size(f.old_size or 0)
            if status == "removed"
            else f"{human_size(f.old_size or 0)} -> {human_size(f.new_size or 0)}"
        )
        say(f"  {status:8} {sizes:>20}  {f.path}")
    if len(files) > SHOWN_FILES:
        say(f"  ... and {len(files) - SHOWN_FILES} more (--json lists every file)")


@view_as(
    lambda diff: {**json_fields(diff), "identical": diff.identical, "breaking": [d.name for d in diff.host.breaking]}
)
def host_differences(console: Console, diff: HostDiff) -> None:
    """`neffbuild diff --host`: per unit, each field the build and this host differ in, build -> here."""
    say = functools.partial(console.out.print, markup=False, soft_wrap=True)
    name = f"{diff.tag} ({diff.release_id})" if diff.tag else diff.release_id
    units = diff.host.units
    differ = [u for u in units if u.diffs]
    say(
        f"release {name} -> this host: {len(differ)} of {len(units)} units differ; "
        f"{len(diff.host.breaking)} breaking, {len(diff.host.informational)} informational fields"
    )
    for unit in differ:
        verdict = "miss" if unit.breaking else "key differs, kernels do not"
        say(f"differs  {unit.unit_id} ({verdict}): key {unit.key} -> {unit.host_key}")
        for d in unit.diffs:
            say(f"  {'breaking' if d.breaking else 'info':8} {d.name} {_change(d.name, d.built, d.here)}")
    for unit in units:
        if not unit.diffs:
            say(f"same     {unit.unit_id}")


def _change(path: str, old: object, new: object) -> str:
    """`2.13.0 -> 2.14.1`; for flag lists (cpu.isa, space- or comma-separated) only what went and
    came: `-avx512f +amx`."""
    from neffbuild.host.fielddiff import FLAG_LISTS

    if path in FLAG_LISTS and isinstance(old, str) and isinstance(new, str):
        before, after = re.split(r"[\s,]+", old.strip()), re.split(r"[\s,]+", new.strip())
        if len(set(before)) == len(before) > 2 and len(set(after)) == len(after) > 2:
            return " ".join(
                [*(f"-{w}" for w in before if w not in after), *(f"+{w}" for w in after if w not in before)]
            )

    def text(v: object) -> str:
        return "(absent)" if v is None else v if isinstance(v, str) else json.dumps(v)

    return f"{text(old)} -> {text(new)}"


@view
def usage(console: Console, usage: Usage) -> None:
    """`neffbuild du`: totals, then bytes by tag, release, model entry and toolchain."""
    say = functools.partial(console.out.print, markup=False, soft_wrap=True)
    say(
        f"{usage.store}: {usage.blobs} blobs, {human_size(usage.bytes)} stored for {len(usage.by_release)} releases "
        f"({human_size(usage.logical_bytes)} of files: dedup saves {human_size(usage.saved_bytes)}; "
        f"{usage.shared_blobs} blobs, {human_size(usage.shared_bytes)}, shared between releases)"
    )
    r = usage.reclaimable
    say(
        f"reclaimable by gc ({r.policy}): {r.objects} objects, {human_size(r.bytes)}"
        if r
        else "reclaimable by gc: see `neffbuild gc --dry-run`"
    )
    for title, shares in (("tag", usage.by_tag), ("model entry", usage.by_entry), ("toolchain", usage.by_toolchain)):
        members = "releases" if title == "tag" else "bundles"
        console.table(
            f"by {title}",
            [(title, True), ("size", True), ("blobs", False), (members, False)],
            [(s.name, human_size(s.bytes), str(s.blobs), str(s.members)) for s in shares],
        )
    console.table(
        "by release",
        [("release", True), ("size", True), ("unique", False), ("shared", False), ("files", False), ("name", False)],
        [
            (
                u.release_id,
                human_size(u.bytes),
                human_size(u.unique_bytes),
                human_size(u.shared_bytes),
                str(u.files),
                u.name,
            )
            for u in usage.by_release
        ],
    )


@view
def gc_plan(console: Console, plan: GcPlan) -> None:
    """A GcPlan: what a sweep deletes, per kind, and what stays."""
    grace = f"{plan.grace_s / 3600:g} h" if plan.grace_s >= 3600 else f"{plan.grace_s:g} s"
    console.table(
        f"gc {plan.store}: keep {plan.keep} earlier releases per tag, grace {grace}",
        [("delete", True), ("objects", False), ("bytes", False)],
        [(c.kind, str(c.objects), human_size(c.bytes)) for c in plan.by_kind]
        + [("total", str(plan.delete_objects), human_size(plan.delete_bytes))],
    )
    console.out.print(
        f"frees {human_size(plan.delete_bytes)}; keeps {plan.kept_objects} objects ({human_size(plan.kept_bytes)}) of {len(plan.live_releases)} live releases"
    )
    if plan.spared_objects:
        console.out.print(
            f"spared, younger than the grace period: {plan.spared_objects} objects ({human_size(plan.spared_bytes)})"
        )
    if plan.partly_live_packs:
        console.out.print(
            f"kept whole: {plan.partly_live_packs} partly live packs holding {human_size(plan.dead_bytes_in_live_packs)} of garbage"
        )
    for pack_id in plan.damaged_packs:
        say_err(f"warning: pack {pack_id} has a damaged index: kept (run `neffbuild verify --store`)")


def _gc_document(result: GcResult) -> object:
    plan = result.plan
    return {
        "store": plan.store,
        "deleted": len(result.deleted),
        "deleted_bytes": result.deleted_bytes,
        "seconds": result.seconds,
    }


@view_as(_gc_document)
def gc_result(console: Console, result: GcResult) -> None:
    skipped = result.plan.delete_objects - len(result.deleted)
    tail = f"; {skipped} planned objects were no longer garbage and stay" if skipped else ""
    console.out.print(
        f"deleted {len(result.deleted)} objects ({human_size(result.deleted_bytes)}) from {result.plan.store} in {result.seconds:.1f} s{tail}"
    )


@view
def cache_prune(console: Console, prune: CachePrune) -> None:
    verb = "removed" if prune.removed else "would remove"
    console.out.print(
        f"{prune.cache_dir}: release {prune.release_id} lists {prune.kept_files} files (kept); "
        f"{verb} {len(prune.remove)} other files ({human_size(prune.remove_bytes)})"
    )
    for path in prune.remove[:20]:
        console.out.print(f"  {path}", markup=False)
