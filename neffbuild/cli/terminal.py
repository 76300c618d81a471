"""The terminal beside the views: the one error line (with its hint, and the traceback under
--debug), the other lines on stderr (each a JSON object with --log-format json), confirmations, and
a report printed after a command changed a store or a cache dir."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from itertools import pairwise

import click

from neffbuild.errors import InputError
from neffbuild.printable import printable

DEBUG = {"on": False}  # --debug, set by the group (cli/main.py)
JSON_LOGS = {"on": False}  # --log-format json (cli/main.py): every line on stderr is a JSON object
_LEVELS = {"warning": "warning", "note": "info", "error": "error"}  # a plain line's prefix: its level


def json_line(level: str, logger: str, message: str, created: float, **fields: object) -> str:
    """One stderr line as --log-format json writes it (log records too): time, level, logger,
    message, then fields; the strings exact (JSON escapes what a terminal acts on)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(created)) + f".{int((created % 1) * 1000):03d}"
    doc = {"time": stamp, "level": level, "logger": logger, "message": message}
    return json.dumps({**doc, **{k: v for k, v in fields.items() if v is not None}})


def json_logs_asked(args: list[str]) -> bool:
    """Whether a command line asks for --log-format json (read before click parses it, so that
    a usage error is said as asked too)."""
    return any(a == "--log-format=json" or (a, b) == ("--log-format", "json") for a, b in pairwise([*args, ""]))


def say(text: str, level: str | None = None) -> None:
    """One line on stderr (a warning, a note, a summary, progress): sanitised, flushed, never
    styled; with --log-format json, a JSON object whose level is level, else the line's
    `warning:`/`note:` prefix (else info)."""
    if JSON_LOGS["on"]:
        prefix, _, rest = text.partition(": ")
        known = _LEVELS.get(prefix) if level is None else None
        sys.stderr.write(
            json_line(level or known or "info", "neffbuild.cli", rest if known else text, time.time()) + "\n"
        )
    else:
        sys.stderr.write(printable(text) + "\n")
    sys.stderr.flush()


def confirmed(yes: bool, question: str) -> bool:
    """--yes, or a yes typed at a terminal; without a terminal and without --yes: bad input (2)."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise InputError(
            "refusing to delete without confirmation: no terminal to ask on",
            hint="pass --yes, or --dry-run to see the plan",
        )
    return click.confirm(printable(question), default=False, err=True)


def _stdout_to_devnull() -> None:
    """What is left in stdout's buffer goes nowhere: flushing it into a closed pipe at exit
    would make Python itself exit 120."""
    if sys.stdout is None:  # started with fd 1 closed: Python has no stdout at all
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def sanitised_lines(text: str) -> str:
    """Multi-line text (a traceback, a log record) with each line sanitised."""
    return "\n".join(printable(line) for line in text.splitlines())


class _StdoutClosed(Exception):
    """The process started with no stdout (fd 1 closed)."""


def report_after_change(show: Callable[[], None], done: str) -> None:
    """Print a command's report after it changed a store or a cache dir: a failure to print
    (a closed pipe, an encoding) is said on stderr and the command still exits 0, since the
    exit code says what happened to the data, and that happened."""
    try:
        if sys.stdout is None:
            raise _StdoutClosed
        show()
        sys.stdout.flush()  # here, not at exit: a closed pipe is this command's to report
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a printing failure (rich exits 1 on a closed pipe)
        if DEBUG["on"] and not isinstance(exc, _StdoutClosed):
            print_traceback()
        _stdout_to_devnull()
        try:
            why = (
                "BrokenPipeError: stdout was closed"
                if isinstance(exc, SystemExit)
                else "stdout is closed"
                if isinstance(exc, _StdoutClosed)
                else f"{type(exc).__name__}: {exc}"
            )
            say(f"warning: {done}, but its report could not be printed: {why}")
        except Exception:  # noqa: BLE001, S110 - stderr is gone too: the exit code is all that is left
            pass


def print_traceback() -> None:
    """The traceback being handled, each line sanitised: its messages carry store strings too."""
    text = traceback.format_exc().rstrip()
    if JSON_LOGS["on"]:
        sys.stderr.write(json_line("debug", "neffbuild.cli", text.splitlines()[-1], time.time(), traceback=text) + "\n")
    else:
        sys.stderr.write(sanitised_lines(text) + "\n")


def print_error(
    message: str,
    hint: str | None,
    details: tuple[str, ...] = (),
    debug_detail: str | None = None,
    *,
    kind: str | None = None,
    exit_code: int | None = None,
) -> None:
    """The one error line, its details and hint (with --debug: the traceback, and the worker's);
    with --log-format json, all of that as one JSON object (kind and exit_code added)."""
    if JSON_LOGS["on"]:
        fields: dict[str, object] = {"hint": hint, "details": [line.strip() for line in details] or None}
        fields |= {"kind": kind, "exit_code": exit_code}
        if DEBUG["on"]:
            fields |= {"traceback": traceback.format_exc().rstrip(), "worker_traceback": debug_detail}
        sys.stderr.write(json_line("error", "neffbuild.cli", message, time.time(), **fields) + "\n")
        return
    if DEBUG["on"]:
        print_traceback()
        if debug_detail:
            click.echo(f"the worker's traceback:\n{sanitised_lines(debug_detail.rstrip())}", err=True)
    # Messages carry names from stores, state files and paths: each line passes the sanitiser.
    click.secho(f"error: {printable(message)}", fg="red", err=True)
    for line in details:
        click.echo(printable(line), err=True)
    if hint:
        click.echo(f"hint: {printable(hint)}", err=True)
