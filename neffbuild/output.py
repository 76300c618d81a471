"""How results look: rich tables and progress on a terminal, plain lines in CI, JSON on request."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console as RichConsole

    from neffbuild.build import BuildReport
    from neffbuild.bundle import TagRecord
    from neffbuild.doctor import DoctorReport
    from neffbuild.plan import Plan
    from neffbuild.pull import PullReport
    from neffbuild.transfer import PushResult
    from neffbuild.verify import ReplayReport, UnitFiles


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


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class Console:
    """What commands print. rich is imported only by output that needs it (tables, bars, colour):
    `neffbuild pull` on instance boot prints plain lines and should not pay for it."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.interactive = sys.stderr.isatty() and not os.environ.get("CI")

    @functools.cached_property
    def out(self) -> RichConsole:
        from rich.console import Console as RichConsole

        return RichConsole(highlight=False, soft_wrap=True)

    @functools.cached_property
    def err(self) -> RichConsole:
        from rich.console import Console as RichConsole

        return RichConsole(stderr=True, highlight=False)

    def _json(self, value: Any) -> None:
        sys.stdout.write(json.dumps(jsonable(value), indent=2) + "\n")

    @contextmanager
    def units_progress(self, verb: str, total: int) -> Iterator[Callable[[str, str], None]]:
        """A notify(unit_id, status) callback: a bar on a terminal, one line per finished unit in CI."""
        if self.as_json:
            yield lambda unit_id, status: None
            return
        if not self.interactive:
            yield lambda unit_id, status: status != "compiling" and self.err.print(f"{unit_id}: {status}")
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        columns = (TextColumn(f"{verb} {{task.description}}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.err, transient=True) as progress:
            task = progress.add_task("", total=total)

            def notify(unit_id: str, status: str) -> None:
                if status == "compiling":
                    progress.update(task, description=unit_id)
                else:
                    progress.advance(task)
                    self.err.print(f"{unit_id}: {status}")

            yield notify

    def plan(self, plan: Plan) -> None:
        if self.as_json:
            self._json(
                {
                    "manifest": plan.loaded.path,
                    "name": plan.loaded.manifest.name,
                    "backend": plan.backend_name,
                    "env": plan.runtime_env,
                    "units": [
                        {"unit_id": u.unit_id, "key": u.key, "unit": u.normalized, "fingerprint": u.fingerprint}
                        for u in plan.units
                    ],
                }
            )
            return
        from rich.table import Table

        table = Table(title=f"{plan.loaded.manifest.name}: {len(plan.units)} units ({plan.backend_name})")
        for column in ("unit", "key", "mode", "dtype", "device"):
            table.add_column(column)
        for u in plan.units:
            table.add_row(u.unit_id, u.key, u.entry.mode, u.entry.dtype, u.entry.device)
        self.out.print(table)
        if plan.units:
            self.out.print("fingerprint:")
            for k, v in plan.units[0].fingerprint.items():
                self.out.print(f"  {k} = {v}")

    def build(self, report: BuildReport) -> None:
        if self.as_json:
            self._json(report)
            return
        from rich.table import Table

        table = Table(title=f"{report.name} -> {report.store}")
        for column in ("unit", "status", "files", "size", "uploaded", "first call", "compiles"):
            table.add_column(column)
        for o in report.outcomes:
            first = f"{o.first_call_s:.1f} s" if o.status == "built" else "-"
            table.add_row(o.unit_id, o.status, str(o.files), _size(o.size), _size(o.uploaded), first, str(o.compiles))
        self.out.print(table)
        for o in report.failed:
            self.err.print(f"[red]failed:[/red] {o.error}")
        if report.release_id:
            self.out.print(f"release {report.release_id}; tag {report.tag} -> it")

    def pull(self, report: PullReport) -> None:
        if self.as_json:
            self._json(report)
            return
        print(
            f"pulled {report.tag or report.release_id}: {report.files_fetched} of {report.files_total} files fetched "
            f"({_size(report.bytes_fetched)} of {_size(report.bytes_total)}) in {report.seconds:.2f} s",
            file=sys.stderr,
        )
        self.exports(report.exports)

    def push(self, result: PushResult) -> None:
        if self.as_json:
            self._json(result)
            return
        moved = f"; tag {result.tag} -> it" if result.tag_moved else (f"; tag {result.tag} already there" if result.tag else "")
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
        from neffbuild.exports import shell_lines

        sys.stdout.write(shell_lines(exports))

    def replay(self, report: ReplayReport) -> None:
        if self.as_json:
            self._json({"cache_dir": report.cache_dir, "misses": len(report.misses), "units": report.units})
            return
        from rich.table import Table

        table = Table(title=f"replay against {report.cache_dir}")
        for column in ("unit", "result", "first call", "compiles", "files written"):
            table.add_column(column)
        for u in report.units:
            result = "[green]hit[/green]" if u.hit else "[red]MISS[/red]"
            table.add_row(u.unit_id, result, f"{u.first_call_s:.2f} s", str(u.compiles), str(len(u.written)))
        self.out.print(table)
        self.out.print(f"{len(report.units) - len(report.misses)} hits, {len(report.misses)} misses")

    def check(self, results: tuple[UnitFiles, ...]) -> None:
        if self.as_json:
            self._json(results)
            return
        for r in results:
            state = "ok" if r.ok else ("not built" if not r.built else f"{len(r.missing)} missing, {len(r.corrupt)} corrupt")
            self.out.print(f"{r.unit_id}: {state}")

    def doctor(self, report: DoctorReport) -> None:
        from neffbuild.doctor import report_json

        if self.as_json:
            self._json(report_json(report))
            return
        colors = {"pass": "green", "fail": "red", "skip": "yellow"}
        self.out.print(f"backend {report.backend}, cache dir {report.cache_dir}")
        for c in report.checks:
            self.out.print(f"[{colors[c.status]}]{c.status.upper():4}[/{colors[c.status]}]  {c.name:10}  {c.detail}")
            if c.status == "fail" and c.fix:
                self.out.print(f"      {'':10}  fix: {c.fix}")
        failed = sum(c.status == "fail" for c in report.checks)
        self.out.print("this host is ready" if not failed else f"{failed} check(s) failed")
