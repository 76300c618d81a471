"""The console entry ends a command that imported torch without the interpreter's teardown
(cli/entry.py, pids.exit_now), and still as the same command ends without torch: its exit code,
its output, its exit handlers. Real processes, real torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    from pathlib import Path

    out = Path(sys.argv[1])
    if sys.argv[2] == "torch":
        import torch  # noqa: F401  # as a plan that checked the pipeline, or a serving command

    atexit.register(lambda: (out / "atexit").write_text("ran"))
    sys.argv = ["neffbuild", *sys.argv[3:]]
    from neffbuild.cli.entry import main

    main()
    """
)


@pytest.mark.parametrize("args", [["--version"], ["no-such-command"]])
def test_a_command_that_imported_torch_ends_as_before_less_the_teardown(tmp_path: Path, args: list[str]) -> None:
    ended = {}
    for imports in ("torch", "none"):
        out = tmp_path / imports
        out.mkdir()
        ended[imports] = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(out), imports, *args], capture_output=True, text=True, timeout=300
        )
        assert (out / "atexit").read_text() == "ran"
    assert ended["torch"].returncode == ended["none"].returncode
    assert ended["torch"].stdout == ended["none"].stdout
    assert ended["torch"].stderr.splitlines()[-1:] == ended["none"].stderr.splitlines()[-1:]
