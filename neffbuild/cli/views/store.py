"""How results look: rich tables and progress on a terminal, plain lines in CI, JSON on request."""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffbuild.printable import printable

if TYPE_CHECKING:
    from rich.console import Console as RichConsole
    from rich.table import Table

    from neffbuild.build.compile import BuildReport
    from neffbuild.build.fanin import ReleaseResult
    from neffbuild.build.fleet import FleetPlan
    from neffbuild.build.push import PushResult
    from neffbuild.documents.records import TagRecord
    from neffbuild.host.doctor import DoctorReport
    from neffbuild.host.prune import CachePrune
    from neffbuild.host.pull import PullReport
    from neffbuild.host.status import StatusReport
    from neffbuild.host.verify import ReplayReport, UnitFiles, UnitReplay
    from neffbuild.inspect.diff import Diff, HostDiff
    from neffbuild.inspect.du import Usage
    from neffbuild.inspect.ls import Listing, TagHistory
    from neffbuild.inspect.show import BundleView, ReleaseView, UnitView
    from neffbuild.maint.gc import GcPlan, GcResult
    from neffbuild.maint.storecheck import StoreCheck
    from neffbuild.units.plan import Plan


def jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return jsonable(asdict(value))
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


# A unit's last status; anything else a notify callback receives is a phase it is in.
FINAL_STATUSES = frozenset({"built", "present", "failed", "hit", "miss"})
HEARTBEAT_S = 60.0  # without a TTY, a line for each unit still in one phase this long


_DOCUMENTS = {"printed": False}  # whether this process wrote a JSON document to stdout


def printed_document() -> bool:
    """Whether a command already wrote its JSON document (a failed build prints its report first):
    then its error goes to stderr only, so that stdout stays one document."""
    return _DOCUMENTS["printed"]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _is_tty(stream: Any) -> bool:
    """Colour and live lines only on a terminal. FORCE_COLOR is not honoured: a log or a pipe
    gets plain text, never an escape sequence (data cannot hide in one either)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


@functools.cache
def _data_console() -> type[RichConsole]:
    """A rich Console that prints data: a str is never read as markup (`[/]` in a release name
    would end the command, `[link=...]` make a hyperlink) and passes the sanitiser first. Styled
    output is built as rich Text from sanitised parts."""
    from rich.console import Console as RichConsole
    from rich.text import Text

    class DataConsole(RichConsole):
        def print(self, *objects: Any, **kwargs: Any) -> None:
            kwargs["markup"] = False
            super().print(*(Text(printable(o)) if isinstance(o, str) else o for o in objects), **kwargs)

    return DataConsole


def say_err(text: str) -> None:
    """One line on stderr (warnings, notes): sanitised, flushed, never styled."""
    sys.stderr.write(printable(text) + "\n")
    sys.stderr.flush()


class Console:
    """What commands print. rich is imported only by output that needs it (tables, bars, colour):
    `neffbuild pull` on instance boot prints plain lines and should not pay for it."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.interactive = sys.stderr.isatty() and not os.environ.get("CI")

    @functools.cached_property
    def out(self) -> RichConsole:
        return _data_console()(highlight=False, soft_wrap=True, force_terminal=_is_tty(sys.stdout))

    @functools.cached_property
    def err(self) -> RichConsole:
        return _data_console()(stderr=True, highlight=False, force_terminal=_is_tty(sys.stderr))

    def _json(self, value: Any) -> None:
        sys.stdout.write(json.dumps(jsonable(value), indent=2) + "\n")
        _DOCUMENTS["printed"] = True

    @contextmanager
    def units_progress(
        self, verb: str, total: int, *, heartbeat_s: float = HEARTBEAT_S, clock: Callable[[], float] = time.monotonic
    ) -> Iterator[Callable[[str, str], None]]:
        """A notify(unit_id, status) callback, on stderr. On a terminal: a live line per running
        unit (its phase and elapsed time) under a done/total count. Without one (CI logs, pipes):
        a plain line per phase change, and one per unit still in a phase every heartbeat_s.
        clock: where elapsed times are read (tests pass their own)."""
        if not self.interactive:  # progress goes to stderr: also with --json, CI is never silent
            with _plain_progress(heartbeat_s, clock) as notify:
                yield notify
        else:
            with self._live_progress(verb, total) as notify:
                yield notify

    @contextmanager
    def _live_progress(self, verb: str, total: int) -> Iterator[Callable[[str, str], None]]:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        columns = (
            SpinnerColumn(),
            TextColumn("{task.description}", markup=False),
            TextColumn("{task.fields[phase]}", style="bold", markup=False),
            TimeElapsedColumn(),
        )
        clock = _UnitClock()
        with Progress(*columns, console=self.err, transient=True) as progress:
            overall = progress.add_task(verb, phase=f"0/{total} done")
            running: dict[str, Any] = {}
            done = 0

            def notify(unit_id: str, status: str) -> None:
                nonlocal done
                elapsed = clock.seen(unit_id)
                with clock.lock:
                    if status in FINAL_STATUSES:
                        done += 1
                        if unit_id in running:
                            progress.remove_task(running.pop(unit_id))
                        progress.update(overall, phase=f"{done}/{total} done")
                        progress.console.print(f"{unit_id}: {status} in {elapsed:.1f} s", markup=False)
                    elif unit_id in running:
                        progress.update(running[unit_id], phase=printable(status))
                    else:
                        running[unit_id] = progress.add_task(printable(unit_id), phase=printable(status))

            yield notify

    def plan(self, plan: Plan) -> None:
        if self.as_json:
            from neffbuild.units.plan import plan_document

            self._json(plan_document(plan))
            return
        for note in plan.notes:
            say_err(f"note: {note}")  # whole lines: CI logs are grepped
        self._table(
            f"{plan.loaded.manifest.name}: {len(plan.units)} units ({plan.backend_name})",
            [("unit", True), ("key", True), ("mode", False), ("dtype", False), ("device", False)],
            [(u.unit_id, u.key, u.entry.mode, u.entry.dtype, u.entry.device) for u in plan.units],
        )
        doubled = [
            u
            for u in plan.units
            if u.graph_batch is not None and u.graph_batch != u.shape.batch * u.entry.prompts_per_call
        ]
        for u in doubled:  # beside the label, which counts images: the graphs see more
            self.out.print(
                f"{u.unit_id}: the graphs see batch {u.graph_batch} (classifier-free guidance doubles it)", markup=False
            )
        if plan.units:
            self.out.print("fingerprint:")
            for k, v in plan.units[0].fingerprint.items():
                self.out.print(f"  {k} = {v}")
            left_out = sorted({name for u in plan.units for name in u.left_out})
            if left_out:
                self.out.print(f"left out of the keys (warmup only): {', '.join(left_out)}")
            reduced = dict(sorted({k: v for u in plan.units for k, v in u.reduced.items()}.items()))
            for name, why in reduced.items():
                self.out.print(
                    f"keyed only as {why}: {name} values with one outcome build the same graphs", markup=False
                )

    def build(self, report: BuildReport) -> None:
        if self.as_json:
            self._json(report)
            return
        columns = [("unit", True), ("status", True), ("time", False), ("compiles", False), ("first call", False)]
        columns += [("files", False), ("size", False), ("uploaded", False)]
        rows = []
        for o in report.outcomes:
            built = o.status == "built"
            first = f"{o.first_call_s:.1f} s" if built else "-"
            took = f"{o.seconds:.1f} s" if o.status != "present" else "-"
            rows.append(
                (o.unit_id, o.status, took, str(o.compiles), first, str(o.files), _size(o.size), _size(o.uploaded))
            )
        # A failed unit's error, log and its last lines are the command's error, printed once.
        self._table(f"{report.name} -> {report.store}", columns, rows)
        if report.release_id:
            self.out.print(f"release {report.release_id}; tag {report.tag} -> it")
        elif not report.complete and not report.failed:
            where = f"shard {report.shard}" if report.shard else "this build"
            self.out.print(
                f"{where}: {len(report.outcomes)} of {report.units_total} units; no release: "
                "`neffbuild release MANIFEST` publishes it once every shard is done"
            )

    def release(self, result: ReleaseResult) -> None:
        if self.as_json:
            self._json(result)
            return
        source = "the plan document" if result.planned else "this host's plan"
        if result.release_id:
            self.out.print(f"{result.name}: {len(result.units)} units from {source}, every bundle in {result.store}")
            self.out.print(f"release {result.release_id}; tag {result.tag} -> it")
        else:
            self.out.print(
                f"{result.name}: {len(result.missing)} of {len(result.units)} units from {source} have no bundle in {result.store}:"
            )
            for unit_id in result.missing:
                self.out.print(f"  missing  {unit_id}")

    def pull(self, report: PullReport) -> None:
        if report.stale:  # loud on stderr, --json or not: a journal must show the host booted stale
            say_err(
                f"warning: store unreachable ({report.stale_reason}); serving the release already installed, "
                f"{report.tag or report.release_id} ({report.release_id}), installed {report.installed_at}: stale"
            )
        if report.throttled:  # on stderr, --json or not: a journal should show that boot was slowed by the store
            from neffbuild.retry import Counts

            counts = Counts(report.retries, report.throttled, report.waited_s, report.paced_to)
            print(f"note: the store throttled this pull: {counts.summary()}", file=sys.stderr)
        if self.as_json:
            mb_per_s = report.bytes_fetched / report.seconds / 1e6 if report.seconds > 0 else 0.0
            self._json({
                **asdict(report),
                "files_skipped": report.files_total - report.files_fetched,
                "bytes_skipped": report.bytes_total - report.bytes_fetched,
                "mb_per_s": round(mb_per_s, 3),
            })  # fmt: skip
            return
        if report.state_replaced:
            say_err(
                f"warning: the cache dir's state file was corrupt ({report.state_replaced}): every file was verified, and it was rewritten"
            )
        for warning in report.host_warnings:
            say_err(f"warning: {warning} (informational: kernels are unaffected)")
        say_err(
            f"{'kept (stale)' if report.stale else 'pulled'} {report.tag or report.release_id}: {report.files_fetched} of {report.files_total} files fetched "
            f"({_size(report.bytes_fetched)} of {_size(report.bytes_total)}) in {report.seconds:.2f} s"
            + (
                f"; {report.files_rehashed} rehashed, {report.files_repaired} repaired"
                if report.files_rehashed or report.files_repaired
                else ""
            )
        )
        self.exports(report.exports)

    def push(self, result: PushResult) -> None:
        if self.as_json:
            self._json(result)
            return
        moved = (
            f"; tag {result.tag} -> it"
            if result.tag_moved
            else (f"; tag {result.tag} already there" if result.tag else "")
        )
        self.out.print(
            f"pushed release {result.release_id} to {result.destination}: {result.bundles_copied} bundles, "
            f"{result.blobs_uploaded} blobs ({_size(result.bytes_uploaded)}) uploaded{moved}"
        )

    def tag(self, record: TagRecord) -> None:
        if self.as_json:
            self._json(record)
            return
        self.out.print(f"tag {record.name} -> {record.release}")
        for event in record.history[-5:]:
            self.out.print(f"  {event.at}  {event.release}  by {event.by}")

    def exports(self, exports: Mapping[str, str]) -> None:
        if self.as_json:
            self._json(exports)
            return
        from neffbuild.host.exports import shell_lines

        sys.stdout.write(shell_lines(exports))

    def replay(self, report: ReplayReport) -> None:
        if self.as_json:
            self._json(
                {
                    "cache_dir": report.cache_dir,
                    "misses": len(report.misses),
                    "units": report.units,
                    "view": report.view,
                    "in_place": report.in_place,
                }
            )
            return
        self._table(
            f"replay of {report.cache_dir}",
            [("unit", True), ("result", True), ("first call", False), ("compiles", False), ("would write", False)],
            [
                (
                    u.unit_id,
                    "hit" if u.hit else "MISS",
                    f"{u.first_call_s:.2f} s",
                    str(u.compiles),
                    _files(len(u.written), u.written_bytes),
                )
                for u in report.units
            ],
        )
        for u in report.misses:
            self._would_write(u)
        if report.in_place:
            self.out.print(
                f"{len(report.units) - len(report.misses)} hits, {len(report.misses)} misses; replayed in place against "
                f"{report.cache_dir}, which this replay could not write (but for the dirs its compiler writes on a hit)",
                markup=False,
            )
            return
        v = report.view
        methods = ", ".join(f"{n} by {m}" for m, n in sorted(v.methods.items())) or "empty"
        self.out.print(
            f"{len(report.units) - len(report.misses)} hits, {len(report.misses)} misses; replayed against a private copy of "
            f"{report.cache_dir} ({v.files} files, {_size(v.bytes)}, copied in {v.seconds:.2f} s: {methods}), which was only read",
            markup=False,
        )

    def _would_write(self, u: UnitReplay, shown: int = 10) -> None:
        if not u.written:
            self.out.print(f"{u.unit_id}: compiled {u.compiles} graph(s) but wrote no cache file", markup=False)
            return
        changes = {c: sum(w.change == c for w in u.written) for c in ("new", "modified", "deleted")}
        summary = ", ".join(f"{n} {c}" for c, n in changes.items() if n)
        count = f"{len(u.written)} file{'s' if len(u.written) != 1 else ''}"
        self.out.print(f"{u.unit_id} would have written {count}, {_size(u.written_bytes)} ({summary}):", markup=False)
        for w in u.written[:shown]:
            self.out.print(f"  {w.change:8}  {_size(w.size):>9}  {w.path}", markup=False, soft_wrap=True)
        if len(u.written) > shown:
            self.out.print(f"  ... and {len(u.written) - shown} more (--json lists every file)")

    def _table(self, title: str, columns: Sequence[tuple[str, bool]], rows: Sequence[Sequence[str]]) -> None:
        """A table that keeps its key columns (unit ids, keys, statuses) whole at any width, leaving
        out other columns that do not fit; if the key columns alone do not fit, one line per row."""
        table = fit_table(title, columns, rows, self.out.width)
        if table is None:
            self.out.print(title, markup=False)
            for row in rows:
                self.out.print("  ".join(row), markup=False, soft_wrap=True)
        else:
            self.out.print(table)

    def check(self, results: tuple[UnitFiles, ...]) -> None:
        if self.as_json:
            self._json(results)
            return
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
            self.out.print(f"{r.unit_id}: {state}", markup=False)

    def doctor(self, report: DoctorReport) -> None:
        from neffbuild.host.doctor import report_json

        if self.as_json:
            self._json(report_json(report))
            return
        from rich.text import Text

        colors = {"pass": "green", "fail": "red", "skip": "yellow"}
        self.out.print(f"backend {report.backend}, cache dir {report.cache_dir}")
        for c in report.checks:
            self.out.print(
                Text.assemble((f"{c.status.upper():4}", colors[c.status]), printable(f"  {c.name:10}  {c.detail}"))
            )
            if c.status == "fail" and c.fix:
                self.out.print(f"      {'':10}  fix: {c.fix}")
        failed = sum(c.status == "fail" for c in report.checks)
        self.out.print("this host is ready" if not failed else f"{failed} check(s) failed")


def _files(count: int, size: int) -> str:
    return f"{count} file{'s' if count != 1 else ''} ({_size(size)})" if count else "-"


def fit_table(
    title: str, columns: Sequence[tuple[str, bool]], rows: Sequence[Sequence[str]], width: int
) -> Table | None:
    """A rich table at most width wide whose cells are never cut or wrapped: the (name, True)
    columns (unit ids, keys, statuses) are always there; the others, in order, while they fit,
    and the table's caption names those left out. None if the kept columns alone do not fit."""
    from rich.table import Table

    def natural(i: int) -> int:
        return max(len(printable(cell)) for cell in [columns[i][0], *(r[i] for r in rows)])

    chosen = [i for i, (_, keep) in enumerate(columns) if keep]
    used = 1 + sum(natural(i) + 3 for i in chosen)  # each column: its cells, padding and a rule
    if used > width:
        return None
    for i, (_, keep) in enumerate(columns):
        if not keep and used + natural(i) + 3 <= width:
            chosen.append(i)
            used += natural(i) + 3
    chosen.sort()
    left_out = [name for i, (name, _) in enumerate(columns) if i not in chosen]
    table = Table(
        title=_cell(title),
        caption=f"left out at {width} columns: {', '.join(left_out)} (--json has all)" if left_out else None,
    )
    for i in chosen:
        table.add_column(_cell(columns[i][0]), no_wrap=True, min_width=natural(i))
    for row in rows:
        table.add_row(*(_cell(row[i]) for i in chosen))
    return table


_STYLES = {"hit": "green", "built": "green", "MISS": "red", "failed": "red"}


def _cell(text: str) -> Any:
    from rich.text import Text

    shown = printable(text)
    return Text(shown, style=_STYLES.get(shown, ""))  # never markup: ids may hold brackets


class _UnitClock:
    """When each unit was first heard of, for the elapsed time shown beside it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.RLock()
        self._started: dict[str, float] = {}

    def seen(self, unit_id: str) -> float:
        """Seconds since unit_id was first seen (0 now if this is the first time)."""
        now = self.clock()
        with self.lock:
            return now - self._started.setdefault(unit_id, now)


@contextmanager
def _plain_progress(heartbeat_s: float, now: Callable[[], float]) -> Iterator[Callable[[str, str], None]]:
    clock = _UnitClock(now)
    phases: dict[str, str] = {}  # units still running, and the phase each is in

    say = say_err

    def notify(unit_id: str, status: str) -> None:
        elapsed = clock.seen(unit_id)
        with clock.lock:
            if status in FINAL_STATUSES:
                phases.pop(unit_id, None)
                say(f"{unit_id}: {status} in {elapsed:.1f} s")
            elif phases.get(unit_id) != status:
                phases[unit_id] = status
                say(f"{unit_id}: {status} (after {elapsed:.1f} s)")

    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(heartbeat_s):
            with clock.lock:
                for unit_id, phase in phases.items():
                    say(f"{unit_id}: still {phase} (after {clock.seen(unit_id):.0f} s)")

    beat = threading.Thread(target=heartbeat, daemon=True, name="neffbuild-heartbeat")
    beat.start()
    try:
        yield notify
    finally:
        stop.set()
        beat.join()


# ---- status ----------------------------------------------------------------------------------


_STYLES.update({"mismatch": "red", "missing": "red", "absent": "red", "stale": "yellow"})


def print_status(self: Console, report: StatusReport) -> None:
    """A status report: what the cache dir holds, a row per unit, informational differences."""
    if self.as_json:
        self._json({**jsonable(report), "ok": report.ok})
        return
    installed = report.installed_release_id or "unknown"
    if report.installed_release_id == report.release_id:
        installed = f"this release, since {report.installed_at}" if report.installed_at else "this release"
    name = f"{report.tag} ({report.release_id})" if report.tag else report.release_id
    say_err(f"release {name}, read from {report.source}")
    say_err(f"cache dir {report.cache_dir} holds: {installed}")
    rows = [(u.unit_id, u.state, _files(u.files, u.bytes), u.key) for u in report.units]
    self._table(
        f"status of {report.release_name} on this host",
        [("unit", True), ("status", True), ("files", False), ("key", False)],
        rows,
    )
    for u in report.units:  # why each miss, whole lines whatever the width
        if u.state == "mismatch":
            for change in u.changes:
                self.out.print(f"{u.unit_id}: mismatch: {change.line()}", markup=False)
        elif u.state == "missing":
            corrupt = f", {u.corrupt_files} with other bytes" if u.corrupt_files else ""
            self.out.print(
                f"{u.unit_id}: missing: {u.missing_files} of {u.files} files ({_size(u.missing_bytes)}){corrupt}",
                markup=False,
            )
        elif u.state == "stale":
            self.out.print(
                f"{u.unit_id}: stale: its files are present, the cache dir holds another release", markup=False
            )
        elif u.state == "absent":
            self.out.print(f"{u.unit_id}: absent: the manifest declares it, the release does not have it", markup=False)
    notes = sorted({c.line() for u in report.units if u.state != "mismatch" for c in u.changes})
    for note in notes:  # informational: the key differs, the compiler's cache still serves
        say_err(f"warning: {note} (informational: kernels are unaffected)")
    checked = "sizes and digests" if report.verified else "sizes"
    self.out.print(
        f"{report.count('hit')} of {len(report.units)} units will hit ({checked} checked); a prediction: verify --replay proves it",
        markup=False,
    )


# ---- inspection: ls, show, diff, du (neffbuild/inspect/) -----------------------------------------


def _when(at: str | None) -> str:
    """An ISO time as `2026-12-03 20:58` (UTC): the seconds and zone say little in a table."""
    return at[:16].replace("T", " ") if at else "-"


def listing(console: Console, listing: Listing) -> None:
    if console.as_json:
        console._json(listing)
        return
    console._table(
        f"tags in {listing.store}",
        [("tag", True), ("release", True), ("name", False), ("moved", False), ("by", False), ("moves", False)],
        [
            (t.name, t.release, t.release_name or "(missing)", _when(t.moved_at), t.by, str(t.history))
            for t in listing.tags
        ],
    )
    console._table(
        f"releases in {listing.store}, newest first",
        [("release", True), ("created", False), ("size", False), ("units", False), ("files", False), ("tags", False)]
        + [("name", False), ("backend", False), ("toolchain", False)],
        [
            (
                r.release_id,
                _when(r.created),
                _size(r.bytes),
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


def tag_history(console: Console, history: TagHistory) -> None:
    if console.as_json:
        console._json(history)
        return
    console._table(
        f"tag {history.tag} in {history.store}, newest first",
        [("ref", True), ("release", True), ("name", False), ("at", False), ("by", False)],
        [(e.ref, e.release, e.release_name or "(missing)", _when(e.at), e.by) for e in history.events],
    )


def shown_ref(console: Console, view: ReleaseView | BundleView) -> None:
    """`neffbuild show`: a release's units, or a bundle's files."""
    if console.as_json:
        console._json(view)
        return
    from neffbuild.inspect.ls import toolchain

    if view.kind == "bundle":
        u = view.unit
        _unit_header(console, u, f"bundle {u.key} ({u.unit_id}): {u.files} files, {_size(u.bytes)}")
        console.out.print(f"  toolchain: {toolchain(u.fingerprint)}", markup=False)
        console._table(
            f"files of {u.unit_id}",
            [("path", True), ("size", False), ("digest", False)],
            [(f.path, _size(f.size), f.digest) for f in view.files],
        )
        return
    tagged = f" (tag {view.tag})" if view.tag else ""
    console.out.print(
        f"release {view.release_id}{tagged}: {view.name}, {view.backend}, {len(view.units)} units, {view.files} files, {_size(view.bytes)}",
        markup=False,
    )
    console.out.print(f"  toolchain: {toolchain(view.fingerprint)}", markup=False)
    if view.env:
        console.out.print(f"  env: {' '.join(f'{k}={v}' for k, v in view.env.items())}", markup=False)
    if view.shared:
        console.out.print(
            f"  {len(view.shared)} paths built differently by several units, one kept (content-keyed)", markup=False
        )
    console._table(
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
                _size(u.bytes),
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


def differences(console: Console, diff: Diff, *, shown: int = 20) -> None:
    """`neffbuild diff`: units added, removed, changed (each field old -> new), then files."""
    if console.as_json:
        console._json({**jsonable(diff), "identical": diff.identical})
        return
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
        f"files: {len(diff.files_added)} added ({_size(added)}), {len(diff.files_removed)} removed ({_size(removed)}), {len(diff.files_changed)} changed"
    )
    for f in files[:shown]:
        status = "added" if f.old_size is None else "removed" if f.new_size is None else "changed"
        sizes = (
            _size(f.new_size or 0)
            if status == "added"
            else _size(f.old_size or 0)
            if status == "removed"
            else f"{_size(f.old_size or 0)} -> {_size(f.new_size or 0)}"
        )
        say(f"  {status:8} {sizes:>20}  {f.path}")
    if len(files) > shown:
        say(f"  ... and {len(files) - shown} more (--json lists every file)")


def host_differences(console: Console, diff: HostDiff) -> None:
    """`neffbuild diff --host`: per unit, each field the build and this host differ in, build -> here."""
    if console.as_json:
        console._json({**jsonable(diff), "identical": diff.identical, "breaking": [d.name for d in diff.host.breaking]})
        return
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


def _change(path: str, old: Any, new: Any) -> str:
    """`2.13.0 -> 2.14.1`; for flag lists (cpu.isa, space- or comma-separated) only what went and
    came: `-avx512f +amx`."""
    from neffbuild.host.hostcheck import FLAG_LISTS

    if path in FLAG_LISTS and isinstance(old, str) and isinstance(new, str):
        before, after = re.split(r"[\s,]+", old.strip()), re.split(r"[\s,]+", new.strip())
        if len(set(before)) == len(before) > 2 and len(set(after)) == len(after) > 2:
            return " ".join(
                [*(f"-{w}" for w in before if w not in after), *(f"+{w}" for w in after if w not in before)]
            )

    def text(v: Any) -> str:
        return "(absent)" if v is None else v if isinstance(v, str) else json.dumps(v)

    return f"{text(old)} -> {text(new)}"


def usage(console: Console, usage: Usage) -> None:
    """`neffbuild du`: totals, then bytes by tag, release, model entry and toolchain."""
    if console.as_json:
        console._json(usage)
        return
    say = functools.partial(console.out.print, markup=False, soft_wrap=True)
    say(
        f"{usage.store}: {usage.blobs} blobs, {_size(usage.bytes)} stored for {len(usage.by_release)} releases "
        f"({_size(usage.logical_bytes)} of files: dedup saves {_size(usage.saved_bytes)}; "
        f"{usage.shared_blobs} blobs, {_size(usage.shared_bytes)}, shared between releases)"
    )
    r = usage.reclaimable
    say(
        f"reclaimable by gc ({r.policy}): {r.objects} objects, {_size(r.bytes)}"
        if r
        else "reclaimable by gc: see `neffbuild gc --dry-run`"
    )
    for title, shares in (("tag", usage.by_tag), ("model entry", usage.by_entry), ("toolchain", usage.by_toolchain)):
        members = "releases" if title == "tag" else "bundles"
        console._table(
            f"by {title}",
            [(title, True), ("size", True), ("blobs", False), (members, False)],
            [(s.name, _size(s.bytes), str(s.blobs), str(s.members)) for s in shares],
        )
    console._table(
        "by release",
        [("release", True), ("size", True), ("unique", False), ("shared", False), ("files", False), ("name", False)],
        [
            (u.release_id, _size(u.bytes), _size(u.unique_bytes), _size(u.shared_bytes), str(u.files), u.name)
            for u in usage.by_release
        ],
    )


# ---- gc and verify --store ----------------------------------------------------------------------


def print_gc_plan(console: Console, plan: GcPlan) -> None:
    """A GcPlan: what a sweep deletes, per kind, and what stays."""
    if console.as_json:
        console._json(plan)
        return
    grace = f"{plan.grace_s / 3600:g} h" if plan.grace_s >= 3600 else f"{plan.grace_s:g} s"
    console._table(
        f"gc {plan.store}: keep {plan.keep} earlier releases per tag, grace {grace}",
        [("delete", True), ("objects", False), ("bytes", False)],
        [(c.kind, str(c.objects), _size(c.bytes)) for c in plan.by_kind]
        + [("total", str(plan.delete_objects), _size(plan.delete_bytes))],
    )
    console.out.print(
        f"frees {_size(plan.delete_bytes)}; keeps {plan.kept_objects} objects ({_size(plan.kept_bytes)}) of {len(plan.live_releases)} live releases"
    )
    if plan.spared_objects:
        console.out.print(
            f"spared, younger than the grace period: {plan.spared_objects} objects ({_size(plan.spared_bytes)})"
        )
    if plan.partly_live_packs:
        console.out.print(
            f"kept whole: {plan.partly_live_packs} partly live packs holding {_size(plan.dead_bytes_in_live_packs)} of garbage"
        )
    for pack_id in plan.damaged_packs:
        say_err(f"warning: pack {pack_id} has a damaged index: kept (run `neffbuild verify --store`)")


def print_gc_result(console: Console, result: GcResult) -> None:
    if console.as_json:
        console._json(
            {
                "store": result.plan.store,
                "deleted": len(result.deleted),
                "deleted_bytes": result.deleted_bytes,
                "seconds": result.seconds,
            }
        )
        return
    skipped = result.plan.delete_objects - len(result.deleted)
    tail = f"; {skipped} planned objects were no longer garbage and stay" if skipped else ""
    console.out.print(
        f"deleted {len(result.deleted)} objects ({_size(result.deleted_bytes)}) from {result.plan.store} in {result.seconds:.1f} s{tail}"
    )


def print_cache_prune(console: Console, prune: CachePrune) -> None:
    if console.as_json:
        console._json(prune)
        return
    verb = "removed" if prune.removed else "would remove"
    console.out.print(
        f"{prune.cache_dir}: release {prune.release_id} lists {prune.kept_files} files (kept); "
        f"{verb} {len(prune.remove)} other files ({_size(prune.remove_bytes)})"
    )
    for path in prune.remove[:20]:
        console.out.print(f"  {path}", markup=False)


def print_store_check(console: Console, check: StoreCheck) -> None:
    if check.orphans:  # on stderr, with --json too
        say_err(
            f"warning: {len(check.orphans)} orphan objects ({_size(check.orphan_bytes)}) no record names; gc removes them after its grace period"
        )
    if console.as_json:
        console._json({**jsonable(check), "clean": check.clean})
        return
    hashed = f", {_size(check.hashed_bytes)} hashed" if check.deep else ""
    console.out.print(f"{check.store}: {check.documents} records, {check.blobs} blobs ({_size(check.bytes)}){hashed}")
    for kind, findings in (("dangling", check.dangling), ("damaged", check.damaged)):
        for f in findings:
            console.out.print(f"{kind}: {f.key}: {f.problem}", markup=False)
    if check.clean:
        console.out.print("clean: every reference resolves")


def print_fleet_plan(console: Console, fleet: FleetPlan) -> None:
    """`plan --out/--shards`: the plan, then each shard's units and predicted time."""
    assignment = fleet.assignment
    if console.as_json:
        from neffbuild.units.plan import plan_document

        doc = plan_document(fleet.plan)
        if assignment is not None:
            doc["shards"] = [
                {"shard": f"{i}/{len(assignment.shards)}", "units": list(ids), "predicted_s": assignment.predicted_s[i]}
                for i, ids in enumerate(assignment.shards)
            ]
        doc["durations"] = dict(fleet.document.durations)
        console._json(doc)
        return
    console.plan(fleet.plan)
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
