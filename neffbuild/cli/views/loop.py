"""The views of the serving loop's commands: suggest (shapes from what serving hosts compiled)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from neffbuild.cli.views.console import Console, json_fields, say_err, view_as
from neffbuild.printable import printable

if TYPE_CHECKING:
    from neffbuild.maint.suggest import FieldChange, Suggestion


def suggestion(console: Console, s: Suggestion) -> None:
    # Malformed lines on stderr, --json or not: a log must show that a host's file was damaged.
    for skipped in s.skipped:
        say_err(f"warning: {skipped.where}: {skipped.why}; skipped")
    _suggested(console, s)


@view_as(lambda s: {**json_fields(s), "changed": s.changed, "diff": s.diff})
def _suggested(console: Console, s: Suggestion) -> None:
    # The diff alone on stdout (`| git apply`, a review); the summary on stderr, as pull does.
    for line in s.diff.splitlines():
        sys.stdout.write(printable(line) + "\n")
    hosts = f"{len(s.hosts)} host{'s' * (len(s.hosts) != 1)}"
    say_err(f"{s.events} events from {hosts} in {s.files} files ({len(s.skipped)} lines skipped)")
    for entry in s.entries:
        say_err(
            f"model[{entry.entry}]: {len(entry.added)} shapes added ({', '.join(entry.added)}) "
            f"from {entry.events} events on {len(entry.hosts)} hosts: {'; '.join(entry.written)}"
        )
        for change in entry.informational:
            say_err(f"  note: {_field(change)} (informational: the cache still serves that host)")
    if s.covered:
        say_err(f"{s.covered} events at listed shapes compiled nothing (served from the cache)")
    for u in s.unexplained:
        where = f"model[{u.entry}]" if u.entry is not None else "(no entry)"
        say_err(f"unexplained: {where}: {u.reason}: {u.events} events on {', '.join(u.hosts)} (first {u.first})")
        for change in u.changes:
            say_err(f"  {_field(change)}{'' if change.breaking else ' (informational)'}")
    if s.written:
        say_err(f"wrote {s.manifest}: build it to cover these shapes")
    elif s.changed:
        say_err(f"nothing written: `neffbuild suggest {s.manifest} ... --write` applies it")
    else:
        say_err("nothing to add: the manifest lists every shape the events explain")


def _field(change: FieldChange) -> str:
    planned = "absent" if change.planned is None else repr(change.planned)
    seen = "absent" if change.event is None else repr(change.event)
    return f"{change.name}: planned {planned}, event {seen}"
