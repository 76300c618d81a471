"""The command line: click commands (parse, call one core function) and the views that print results.

`main` first offers the command line to the no-op pull's entry (cli/quick.py), which answers a
host's boot without importing click; every other command line goes to cli/main.py's `main`."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["cli", "main"]


def main(argv: list[str] | None = None) -> None:
    from neffbuild.cli.quick import quick_pull

    code = quick_pull(sys.argv[1:] if argv is None else argv, os.environ)
    if code is not None:
        sys.exit(code)
    from neffbuild.cli.main import main as full

    full(argv)


def __getattr__(name: str) -> Any:
    if name == "cli":  # the click group, imported only when asked for
        from neffbuild.cli.main import cli

        return cli
    raise AttributeError(name)
