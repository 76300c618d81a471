"""What every view shares: the console that sanitises what it prints, JSON documents (and `view`,
the one --json branch), tables that keep their key columns whole, sizes, and the per-unit progress
callback."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TextIO, TypeAlias, TypeVar, cast

from neffbuild.cli.terminal import JSON_LOGS, say
from neffbuild.cli.views.progress import HEARTBEAT_S, live_progress, plain_progress
from neffbuild.printable import printable

if TYPE_CHECKING:
    from rich.console import Console as RichConsole
    from rich.table import Table
    from rich.text import Text

# What json.dumps writes: what a view hands to Console.document, once made jsonable.
Json: TypeAlias = "bool | int | float | str | list[Json] | dict[str, Json] | None"


def jsonable(value: object) -> Json:
    if is_dataclass(value) and not isinstance(value, type):
        return jsonable(asdict(value))
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "model_dump"):
        return cast("Json", value.model_dump(mode="json"))
    return cast("Json", value)


def json_fields(value: object) -> dict[str, Json]:
    """A dataclass as a JSON object, for a document that adds fields of its own."""
    fields = jsonable(value)
    assert isinstance(fields, dict), value
    return fields


_DOCUMENTS = {"printed": False}  # whether this process wrote a JSON document to stdout


def printed_document() -> bool:
    """Whether a command already wrote its JSON document (a failed build prints its report first):
    then its error goes to stderr only, so that stdout stays one document."""
    return _DOCUMENTS["printed"]


def _is_tty(stream: TextIO) -> bool:
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
        # rich's own print, its keywords passed through as they are
        def print(self, *objects: object, **kwargs: Any) -> None:
            kwargs["markup"] = False
            super().print(*(Text(printable(o)) if isinstance(o, str) else o for o in objects), **kwargs)

    return DataConsole


# One line on stderr (warnings, notes): sanitised, flushed, never styled; a JSON object with
# --log-format json.
say_err = say


class Console:
    """What commands print through. rich is imported only by output that needs it (tables, bars,
    colour): `neffbuild pull` on instance boot prints plain lines and should not pay for it. Each
    command group's views (views/ci.py, views/host.py, views/store.py, views/loop.py) print through
    this."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        # Live lines only on a terminal, and never among --log-format json's objects.
        self.interactive = sys.stderr.isatty() and not os.environ.get("CI") and not JSON_LOGS["on"]

    @functools.cached_property
    def out(self) -> RichConsole:
        return _data_console()(highlight=False, soft_wrap=True, force_terminal=_is_tty(sys.stdout))

    @functools.cached_property
    def err(self) -> RichConsole:
        return _data_console()(stderr=True, highlight=False, force_terminal=_is_tty(sys.stderr))

    def document(self, value: object) -> None:
        """value as the command's one JSON document on stdout."""
        sys.stdout.write(json.dumps(jsonable(value), indent=2) + "\n")
        _DOCUMENTS["printed"] = True

    def table(self, title: str, columns: Sequence[tuple[str, bool]], rows: Sequence[Sequence[str]]) -> None:
        """A table that keeps its key columns (unit ids, keys, statuses) whole at any width, leaving
        out other columns that do not fit; if the key columns alone do not fit, one line per row."""
        table = fit_table(title, columns, rows, self.out.width)
        if table is None:
            self.out.print(title, markup=False)
            for row in rows:
                self.out.print("  ".join(row), markup=False, soft_wrap=True)
        else:
            self.out.print(table)

    @contextmanager
    def units_progress(
        self, verb: str, total: int, *, heartbeat_s: float = HEARTBEAT_S, clock: Callable[[], float] = time.monotonic
    ) -> Iterator[Callable[[str, str], None]]:
        """A notify(unit_id, status) callback, on stderr. On a terminal: a live line per running
        unit (its phase and elapsed time) under a done/total count. Without one (CI logs, pipes):
        a plain line per phase change, and one per unit still in a phase every heartbeat_s.
        clock: where elapsed times are read (tests pass their own)."""
        if not self.interactive:  # progress goes to stderr: also with --json, CI is never silent
            with plain_progress(heartbeat_s, clock, say_err) as notify:
                yield notify
        else:
            with live_progress(self.err, verb, total) as notify:
                yield notify


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


# A cell's style, by its whole text: statuses in tables.
_STYLES = {
    "hit": "green",
    "built": "green",
    "MISS": "red",
    "failed": "red",
    "mismatch": "red",
    "missing": "red",
    "absent": "red",
    "stale": "yellow",
}


def _cell(text: str) -> Text:
    from rich.text import Text

    shown = printable(text)
    return Text(shown, style=_STYLES.get(shown, ""))  # never markup: ids may hold brackets


V = TypeVar("V")
P = ParamSpec("P")
View = Callable[Concatenate[Console, V, P], None]


def view(human: View[V, P]) -> View[V, P]:
    """A view, from a function that prints a command's result for people: with --json it prints
    the result as the command's one JSON document instead. Every view's --json branch is this
    one (`view_as`: a document made of the result)."""
    return _shown(human, None)


def view_as(document: Callable[Concatenate[V, P], object]) -> Callable[[View[V, P]], View[V, P]]:
    """As `view`, the document being what `document` makes of the result (and the view's other
    arguments)."""
    return lambda human: _shown(human, document)


def _shown(human: View[V, P], document: Callable[Concatenate[V, P], object] | None) -> View[V, P]:
    @functools.wraps(human)
    def shown(console: Console, value: V, /, *args: P.args, **kwargs: P.kwargs) -> None:
        if not console.as_json:
            human(console, value, *args, **kwargs)
        elif document is None:
            console.document(value)
        else:
            console.document(document(value, *args, **kwargs))

    return shown
