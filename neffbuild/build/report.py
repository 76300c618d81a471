"""Build reports: what a build returns (BuildReport, one UnitOutcome per unit), the document
`build --report FILE.json` writes of it per build or shard, merged by `release --report`, and a
Markdown summary appended to `$GITHUB_STEP_SUMMARY` when that is set.

A report is a versioned document (its format string, decoded strictly like the store's own) so
that a release job may read what shard jobs uploaded as artifacts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from neffbuild.documents.records import parse, to_json
from neffbuild.errors import InputError, NeffbuildError
from neffbuild.formats import writes
from neffbuild.fs.atomic import write_atomic

log = logging.getLogger(__name__)
REPORT_FORMAT = writes("build report")  # parse reads every report format (neffbuild/formats.py)
SUMMARY_ENV = "GITHUB_STEP_SUMMARY"
MAX_REPORT_BYTES = 64 << 20


@dataclass(frozen=True)
class UnitOutcome:
    unit_id: str
    key: str
    status: str  # "built", "present" or "failed"
    files: int = 0
    size: int = 0
    uploaded: int = 0
    first_call_s: float = 0.0
    compiles: int = 0
    error: str | None = None
    seconds: float = 0.0  # the unit's wall time in this build (load, compile, publish)
    log: str | None = None  # a failed unit's kept worker log
    log_tail: tuple[str, ...] = ()
    worker_traceback: str | None = None
    attempts: int = 1  # 1 + the retries it took (--retries)
    killed: str | None = None  # a failed unit's worker was killed: how ("killed by SIGKILL", the OOM killer)
    peak_rss: int = 0  # bytes, as the worker measured it (0: not measured, e.g. present or killed)
    counters: Mapping[str, int] = field(default_factory=dict)  # the compiler's counters for this unit
    # Seconds by phase: load (worker start to pipeline ready), trace, compile, run (the rest of
    # the first call), publish (hash and upload); queue is the build's (_unit_outcome).
    phases: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class BuildReport:
    name: str
    store: str
    outcomes: tuple[UnitOutcome, ...]
    release_id: str | None
    tag: str | None
    shard: str | None = None  # "I/N" when this build was one shard of a fleet
    units_total: int = 0  # units in the manifest (a shard builds some of them)

    @property
    def complete(self) -> bool:
        """Whether this build covered the whole manifest (and so may release it)."""
        return len(self.outcomes) == self.units_total

    @property
    def failed(self) -> list[UnitOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]


@dataclass(frozen=True, slots=True)
class ReportUnit:
    unit_id: str
    key: str
    status: str  # built, present, failed; "missing" in a merged report: no shard reported it
    shard: str = ""  # "I/N"; "" for a build of the whole manifest
    seconds: float = 0.0
    peak_rss: int = 0  # bytes
    files: int = 0
    bytes: int = 0
    uploaded: int = 0
    compiles: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    killed: str = ""
    error: str = ""
    phases: dict[str, float] = field(default_factory=dict)  # seconds: queue, load, trace, compile, run, publish


@dataclass(frozen=True, slots=True)
class Report:
    name: str
    store: str
    units: tuple[ReportUnit, ...]
    shards: tuple[str, ...] = ()  # the shards whose reports it holds
    release_id: str = ""
    tag: str = ""
    format: str = REPORT_FORMAT


def from_build(build: BuildReport) -> Report:
    """The report of one build (or shard)."""
    shard = build.shard or ""
    return Report(
        name=build.name,
        store=build.store,
        units=tuple(_unit(o, shard) for o in build.outcomes),
        shards=(shard,) if shard else (),
        release_id=build.release_id or "",
        tag=build.tag or "",
    )


def _unit(o: UnitOutcome, shard: str) -> ReportUnit:
    return ReportUnit(
        unit_id=o.unit_id, key=o.key, status=o.status, shard=shard, seconds=round(o.seconds, 3), peak_rss=o.peak_rss,
        files=o.files, bytes=o.size, uploaded=o.uploaded, compiles=o.compiles, counters=dict(o.counters),
        attempts=o.attempts if o.status != "present" else 0, killed=o.killed or "", error=o.error or "",
        phases=dict(o.phases),
    )  # fmt: skip  # arguments packed by meaning, not one a line


def merged(
    reports: Sequence[Report],
    units: Sequence[tuple[str, str]],
    *,
    store: str,
    name: str,
    release_id: str = "",
    tag: str = "",
) -> Report:
    """One report of the manifest's units from the shards' reports: per unit, the report of the
    build that made its bundle (built beats present beats failed: a rerun shard's report wins
    over the one that failed); units no report names are "missing"."""
    rank = {"built": 0, "present": 1, "failed": 2}
    best: dict[str, ReportUnit] = {}
    for report in reports:
        for unit in report.units:
            held = best.get(unit.key)
            if held is None or rank.get(unit.status, 3) < rank.get(held.status, 3):
                best[unit.key] = unit
    rows = tuple(best.get(key) or ReportUnit(unit_id=unit_id, key=key, status="missing") for unit_id, key in units)
    shards = tuple(sorted({s for r in reports for s in r.shards}))
    return Report(name=name, store=store, units=rows, shards=shards, release_id=release_id, tag=tag)


def write_report(path: Path, report: Report) -> None:
    write_atomic(path, (json.dumps(to_json(report), indent=1, sort_keys=True) + "\n").encode())


def read_reports(paths: Iterable[Path]) -> list[Report]:
    out = []
    for path in paths:
        try:
            with path.open("rb") as f:
                data = f.read(MAX_REPORT_BYTES + 1)
        except OSError as exc:
            raise InputError(
                f"--shard-report {path}: cannot read it ({exc.strerror or exc})",
                hint="pass the files `build --report` wrote",
            ) from None
        try:
            out.append(parse(Report, data[:MAX_REPORT_BYTES], f"report {path}"))
        except NeffbuildError as exc:
            raise InputError(exc.message, hint="pass the files `build --report` wrote") from None
    return out


def markdown(report: Report) -> str:
    """The summary a CI page shows: one table row per unit."""
    counts: dict[str, int] = {}
    for u in report.units:
        counts[u.status] = counts.get(u.status, 0) + 1
    head = f"### neffbuild: {_cell(report.name)}"
    if report.shards:
        head += f" (shards {', '.join(report.shards)})"
    lines = [
        head,
        "",
        ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) + f" of {len(report.units)} units",
        "",
    ]
    if report.release_id:
        lines += [f"release `{report.release_id}`, tag `{_cell(report.tag)}`", ""]
    lines += [
        "| unit | status | shard | time | peak memory | files | bytes | compiles | attempts |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for u in report.units:
        status = u.status + (f": {u.killed}" if u.killed else "")
        time = f"{u.seconds:.1f} s" if u.status in ("built", "failed") else "-"
        peak = f"{u.peak_rss / 2**20:.0f} MiB" if u.peak_rss else "-"
        lines.append(
            f"| {_cell(u.unit_id)} | {_cell(status)} | {u.shard or '-'} | {time} | {peak} | {u.files} | {u.bytes} | {u.compiles} | {u.attempts or '-'} |"
        )
    failed = [u for u in report.units if u.error]
    for u in failed[:10]:
        lines.append(f"\n**{_cell(u.unit_id)}**: {_cell(u.error)}")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Data in a Markdown table: one line, no cell breaks, no markup that renders as a link or HTML."""
    from neffbuild.printable import printable

    return printable(text).replace("|", "\\|").replace("<", "&lt;").replace("[", "\\[").replace("`", "'")


def emit(report: Report, report_file: Path | None, env: Mapping[str, str]) -> None:
    """Write the JSON report (if asked) and append the summary to $GITHUB_STEP_SUMMARY (if set).
    Either failing is a warning: the build or release it reports on has happened."""
    if report_file is not None:
        try:
            write_report(report_file, report)
        except NeffbuildError as exc:
            log.warning("the report %s was not written: %s", report_file, exc.message)
    summary = env.get(SUMMARY_ENV)
    if summary:
        try:
            with open(summary, "a", encoding="utf-8") as f:
                f.write(markdown(report) + "\n")
        except OSError as exc:
            log.warning("$%s %s: the summary was not appended (%s)", SUMMARY_ENV, summary, exc.strerror or exc)
