"""The console entry (`neffbuild`, `python -m neffbuild`): the command line is first offered to the
no-op pull's entry (cli/quick.py), which answers a host's boot without importing click; every
other command line goes to cli/main.py's `main`. A module of its own: a function named `main` in
the package would be replaced by the submodule cli/main.py as soon as that is imported."""

from __future__ import annotations

import gc
import os
import sys


def main(argv: list[str] | None = None) -> None:
    # No garbage collection while the no-op is tried: its start-up allocates what lives as long as
    # the process (modules, classes), which a no-op's 23 collections scanned for 4-8 ms of CPU to
    # free 330 objects, and the pull pauses collection where it allocates most anyway (decode,
    # scan). The full command collects as before.
    gc.disable()
    try:
        from neffbuild.cli.quick import quick_pull

        code = quick_pull(sys.argv[1:] if argv is None else argv, os.environ)
    finally:
        gc.enable()
    if code is not None:
        sys.exit(code)
    from neffbuild.cli.main import main as full

    full(argv)
