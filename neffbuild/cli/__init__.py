"""The command line: click commands (parse, call one core function) and the views that print results.

The console entry is cli/entry.py's `main`; cli/main.py holds the click group and the full command."""

from __future__ import annotations

from typing import Any

__all__ = ["cli"]


def __getattr__(name: str) -> Any:
    if name == "cli":  # the click group, imported only when asked for
        from neffbuild.cli.main import cli

        return cli
    raise AttributeError(name)
