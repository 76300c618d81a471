"""The terminal beside the views: the one error line (with its hint, and the traceback under
--debug), confirmations, and a report printed after a command changed a store or a cache dir."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

import click

from neffbuild.errors import InputError
from neffbuild.printable import printable

DEBUG = {"on": False}  # --debug, set by the group (cli/main.py)


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
            sys.stderr.write(printable(f"warning: {done}, but its report could not be printed: {why}") + "\n")
        except Exception:  # noqa: BLE001, S110 - stderr is gone too: the exit code is all that is left
            pass


def print_traceback() -> None:
    """The traceback being handled, each line sanitised: its messages carry store strings too."""
    sys.stderr.write(sanitised_lines(traceback.format_exc().rstrip()) + "\n")


def print_error(message: str, hint: str | None, details: tuple[str, ...] = (), debug_detail: str | None = None) -> None:
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
