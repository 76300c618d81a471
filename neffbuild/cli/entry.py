"""The console entry (`neffbuild`, `python -m neffbuild`): the command line is first offered to the
no-op pull's entry (cli/quick.py), which answers a host's boot without importing click; every
other command line goes to cli/main.py's `main`. A module of its own: a function named `main` in
the package would be replaced by the submodule cli/main.py as soon as that is imported."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    from neffbuild.cli.quick import quick_pull

    code = quick_pull(sys.argv[1:] if argv is None else argv, os.environ)
    if code is not None:
        sys.exit(code)
    from neffbuild.cli.main import main as full

    full(argv)
