"""The views of a serving host's commands: pull, env, status, doctor, verify (and `verify --store`)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from neffbuild.cli.lines import human_size, pull_summary
from neffbuild.cli.views.console import Console, json_fields, say_err, view, view_as
from neffbuild.printable import printable

if TYPE_CHECKING:
    from neffbuild.host.doctor import DoctorReport
    from neffbuild.host.pull import PullReport
    from neffbuild.host.status import StatusReport
    from neffbuild.host.verify import ReplayReport, UnitFiles, UnitReplay
    from neffbuild.maint.storecheck import StoreCheck
    from neffbuild.serve.warmup import WarmupReport


def pull(console: Console, report: PullReport) -> None:
    """What pull did: first what a journal must show, --json or not; then the report."""
    if report.stale:  # loud on stderr, --json or not: a journal must show the host booted stale
        say_err(
            f"warning: store unreachable ({report.stale_reason}); serving the release already installed, "
            f"{report.tag or report.release_id} ({report.release_id}), installed {report.installed_at}: stale"
        )
    if report.throttled:  # on stderr, --json or not: a journal should show that boot was slowed by the store
        from neffbuild.retry.scope import Counts

        counts = Counts(
            report.retries, report.throttled, report.waited_s, report.paced_to, report.paced_s, report.backoff_s,
            report.in_flight_s,
        )  # fmt: skip  # arguments packed by meaning, not one a line
        say_err(f"note: the store throttled this pull: {counts.summary()}")
    _pulled(console, report)


def _pull_document(report: PullReport) -> object:
    mb_per_s = report.bytes_fetched / report.seconds / 1e6 if report.seconds > 0 else 0.0
    return {
        **asdict(report),
        "files_skipped": report.files_total - report.files_fetched,
        "bytes_skipped": report.bytes_total - report.bytes_fetched,
        "mb_per_s": round(mb_per_s, 3),
    }


@view_as(_pull_document)
def _pulled(console: Console, report: PullReport) -> None:
    if report.state_replaced:
        say_err(
            f"warning: the cache dir's state file was corrupt ({report.state_replaced}): every file was verified, and it was rewritten"
        )
    for warning in report.host_warnings:
        say_err(f"warning: {warning} (informational: kernels are unaffected)")
    if report.signed_by:
        say_err(_signed_line(report.signed_by, report.tag, report.tag_version, report.tag_expires))
    say_err(pull_summary(report))
    exports(console, report.exports)


@view
def exports(console: Console, exports: Mapping[str, str]) -> None:
    from neffbuild.host.exports import shell_lines

    sys.stdout.write(shell_lines(exports))


@view_as(lambda reports: {"ok": all(not r.missed for r in reports), "entries": [r.to_json() for r in reports]})
def warmup(console: Console, reports: Sequence[WarmupReport]) -> None:
    for r in reports:
        console.table(
            f"warm-up of model[{r.entry}] ({r.backend})",
            [("shape", True), ("result", True), ("first call", False), ("compiles", False), ("graphs", False)],
            [(s.shape, "MISS" if s.compiles else "hit", f"{s.seconds:.2f} s", str(s.compiles), _graphs(s.counters))
             for s in r.shapes],
        )  # fmt: skip  # arguments packed by meaning, not one a line
    missed = sum(len(r.missed) for r in reports)
    shapes = sum(len(r.shapes) for r in reports)
    console.out.print(f"{shapes - missed} of {shapes} shapes served from the cache", markup=False)


def _replay_document(report: ReplayReport, trace_to: Path | None = None) -> object:
    return {
        "cache_dir": report.cache_dir,
        "misses": len(report.misses),
        "units": report.units,
        "view": report.view,
        "in_place": report.in_place,
        **({"stopped_at": report.misses[0].unit_id if report.misses else None} if report.fail_fast else {}),
        "not_replayed": report.not_replayed,
        **({"trace": str(trace_to), "opened": report.trace.opened} if trace_to and report.trace else {}),
    }


@view_as(_replay_document)
def replay(console: Console, report: ReplayReport, trace_to: Path | None = None) -> None:
    traced = report.trace is not None
    # The opened column counts the dir's files (what a release bundles), not the compiler's locks.
    cached = report.trace.sizes.keys() if report.trace else set()
    console.table(
        f"replay of {report.cache_dir}",
        [("unit", True), ("result", True), ("first call", False), ("compiles", False), ("would write", False)]
        + [("opened", False)] * traced,
        [
            (
                u.unit_id,
                "hit" if u.hit else "MISS",
                f"{u.first_call_s:.2f} s",
                str(u.compiles),
                _files(len(u.written), u.written_bytes),
                *([f"{len(cached & set(u.opened))} files"] * traced),
            )
            for u in report.units
        ],
    )
    for u in report.misses:
        _would_write(console, u)
    if report.trace is not None:
        _trace_summary(console, report, trace_to)
    if report.fail_fast and report.misses:
        first = report.misses[0]
        console.out.print(
            f"stopped at the first miss (--fail-fast): {first.unit_id} "
            + (
                "at its first compile, before the compiler ran"
                if first.stopped
                else "after its call (no cache miss announced its compile before it ran)"
            )
            + f"; not replayed: {', '.join(report.not_replayed) or 'none'}",
            markup=False,
        )
    if report.in_place:
        console.out.print(
            f"{len(report.units) - len(report.misses)} hits, {len(report.misses)} misses; replayed in place against "
            f"{report.cache_dir}, which this replay could not write (but for the dirs its compiler writes on a hit)",
            markup=False,
        )
        return
    v = report.view
    methods = ", ".join(f"{n} by {m}" for m, n in sorted(v.methods.items())) or "empty"
    console.out.print(
        f"{len(report.units) - len(report.misses)} hits, {len(report.misses)} misses; replayed against a private copy of "
        f"{report.cache_dir} ({v.files} files, {human_size(v.bytes)}, copied in {v.seconds:.2f} s: {methods}), which was only read",
        markup=False,
    )


def _trace_summary(console: Console, report: ReplayReport, trace_to: Path | None) -> None:
    trace = report.trace
    assert trace is not None
    sizes = trace.sizes
    opened = set(trace.opened)
    unread = {p: n for p, n in sizes.items() if p not in opened}
    total = sum(sizes.values())
    console.out.print(
        f"trace{f' written to {trace_to}' if trace_to else ''}: the replay opened {len(opened & sizes.keys())} of the "
        f"{len(sizes)} cache files ({human_size(total - sum(unread.values()))} of {human_size(total)}); "
        f"{len(unread)} files ({human_size(sum(unread.values()))}) no unit opened "
        f"(`neffbuild show REF --unused {trace_to or 'TRACE'}` lists a release's)",
        markup=False,
    )


def _would_write(console: Console, u: UnitReplay, shown: int = 10) -> None:
    if not u.written:
        did = "was stopped at its first compile and" if u.stopped else f"compiled {u.compiles} graph(s) but"
        console.out.print(f"{u.unit_id}: {did} wrote no cache file", markup=False)
        return
    changes = {c: sum(w.change == c for w in u.written) for c in ("new", "modified", "deleted")}
    summary = ", ".join(f"{n} {c}" for c, n in changes.items() if n)
    count = f"{len(u.written)} file{'s' if len(u.written) != 1 else ''}"
    console.out.print(
        f"{u.unit_id} would have written {count}, {human_size(u.written_bytes)} ({summary}):", markup=False
    )
    for w in u.written[:shown]:
        console.out.print(f"  {w.change:8}  {human_size(w.size):>9}  {w.path}", markup=False, soft_wrap=True)
    if len(u.written) > shown:
        console.out.print(f"  ... and {len(u.written) - shown} more (--json lists every file)")


@view
def check(console: Console, results: tuple[UnitFiles, ...]) -> None:
    for r in results:
        state = (
            "ok"
            if r.ok
            else (
                "not built (no bundle in the store)"
                if not r.built
                else f"{len(r.missing)} missing, {len(r.corrupt)} corrupt"
            )
        )
        console.out.print(f"{r.unit_id}: {state}", markup=False)


def _doctor_document(report: DoctorReport) -> object:
    from neffbuild.host.doctor import report_json

    return report_json(report)


@view_as(_doctor_document)
def doctor(console: Console, report: DoctorReport) -> None:
    from rich.text import Text

    colors = {"pass": "green", "fail": "red", "skip": "yellow"}
    console.out.print(f"backend {report.backend}, cache dir {report.cache_dir}")
    for c in report.checks:
        console.out.print(
            Text.assemble((f"{c.status.upper():4}", colors[c.status]), printable(f"  {c.name:10}  {c.detail}"))
        )
        if c.status == "fail" and c.fix:
            console.out.print(f"      {'':10}  fix: {c.fix}")
    failed = sum(c.status == "fail" for c in report.checks)
    if failed:
        console.out.print(f"{failed} check(s) failed")
    elif all(c.status == "skip" for c in report.checks):
        # e.g. --neuron-selfcheck off Trainium: exit 0, but nothing here says the host is ready
        console.out.print("nothing checked: every check was skipped")
    else:
        console.out.print("this host is ready")


def _files(count: int, size: int) -> str:
    return f"{count} file{'s' if count != 1 else ''} ({human_size(size)})" if count else "-"


def _signed_line(signer: str, tag: str | None, version: int | None, expires: str | None) -> str:
    """Who signed a release (and its tag statement), from names a store gave: sanitised."""
    line = f"signed by {printable(signer)}"
    if tag is not None:
        line += f"; tag {printable(tag)} statement version {version}, expires {printable(expires or '?')}"
    return line


@view_as(lambda report: {**json_fields(report), "ok": report.ok})
def status(console: Console, report: StatusReport) -> None:
    """A status report: what the cache dir holds, a row per unit, informational differences."""
    if report.signed is not None:
        s = report.signed
        say_err(f"release {s.release_id} " + _signed_line(s.signed_by, s.tag, s.tag_version, s.tag_expires))
    installed = report.installed_release_id or "unknown"
    if report.installed_release_id == report.release_id:
        installed = f"this release, since {report.installed_at}" if report.installed_at else "this release"
    name = f"{report.tag} ({report.release_id})" if report.tag else report.release_id
    say_err(f"release {name}, read from {report.source}")
    say_err(f"cache dir {report.cache_dir} holds: {installed}")
    rows = [(u.unit_id, u.state, _files(u.files, u.bytes), u.key) for u in report.units]
    console.table(
        f"status of {report.release_name} on this host",
        [("unit", True), ("status", True), ("files", False), ("key", False)],
        rows,
    )
    for u in report.units:  # why each miss, whole lines whatever the width
        if u.state == "mismatch":
            for change in u.changes:
                console.out.print(f"{u.unit_id}: mismatch: {change.line()}", markup=False)
        elif u.state == "missing":
            corrupt = f", {u.corrupt_files} with other bytes" if u.corrupt_files else ""
            console.out.print(
                f"{u.unit_id}: missing: {u.missing_files} of {u.files} files ({human_size(u.missing_bytes)}){corrupt}",
                markup=False,
            )
        elif u.state == "stale":
            console.out.print(
                f"{u.unit_id}: stale: its files are present, the cache dir holds another release", markup=False
            )
        elif u.state == "absent":
            console.out.print(
                f"{u.unit_id}: absent: the manifest declares it, the release does not have it", markup=False
            )
    notes = sorted({c.line() for u in report.units if u.state != "mismatch" for c in u.changes})
    for note in notes:  # informational: the key differs, the compiler's cache still serves
        say_err(f"warning: {note} (informational: kernels are unaffected)")
    checked = "sizes and digests" if report.verified else "sizes"
    console.out.print(
        f"{report.count('hit')} of {len(report.units)} units will hit ({checked} checked); a prediction: verify --replay proves it",
        markup=False,
    )


def store_check(console: Console, check: StoreCheck) -> None:
    if check.orphans:  # on stderr, with --json too
        say_err(
            f"warning: {len(check.orphans)} orphan objects ({human_size(check.orphan_bytes)}) no record names; gc removes them after its grace period"
        )
    _checked(console, check)


@view_as(lambda check: {**json_fields(check), "clean": check.clean})
def _checked(console: Console, check: StoreCheck) -> None:
    hashed = f", {human_size(check.hashed_bytes)} hashed" if check.deep else ""
    console.out.print(
        f"{check.store}: {check.documents} records, {check.blobs} blobs ({human_size(check.bytes)}){hashed}"
    )
    for kind, findings in (("dangling", check.dangling), ("damaged", check.damaged)):
        for f in findings:
            console.out.print(f"{kind}: {f.key}: {f.problem}", markup=False)
    if check.clean:
        console.out.print("clean: every reference resolves")


def _graphs(counters: Mapping[str, int]) -> str:
    """Graphs the listed components received during a call: loaded from the cache, or compiled;
    or, for artifact 'package', the calls their packages served."""
    from neffbuild.backends.artifacts import PACKAGE_GROUP
    from neffbuild.backends.components import GRAPH_PREFIX

    return str(sum(v for k, v in counters.items() if k.startswith((GRAPH_PREFIX, PACKAGE_GROUP + "."))))
