"""The group registers each section's commands by name and imports a section only when one of
its commands runs (or help lists them all)."""

from __future__ import annotations

import importlib
import subprocess
import sys

from click.testing import CliRunner

from neffbuild.cli.main import MODULES, SECTIONS, cli

RUN = """
import sys
from neffbuild.cli.main import cli
try:
    cli.main(args=sys.argv[1:], prog_name="neffbuild", standalone_mode=False)
except SystemExit:
    pass
print(" ".join(sorted(m for m in sys.modules if m.startswith("neffbuild.cli.commands."))))
"""


def _imported(*args: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, check=True)
    return set(done.stdout.split("\n")[-2].split())


def test_every_named_command_is_its_modules_and_every_modules_command_is_named() -> None:
    for module, names in MODULES.items():
        commands = {c.name for c in importlib.import_module(module).COMMANDS}
        assert commands == set(names), module
    assert [names for _, names in SECTIONS] == list(MODULES.values())


def test_a_command_imports_its_own_section_only() -> None:
    assert _imported("pull", "--help") == {"neffbuild.cli.commands.host"}
    assert _imported("ls", "--help") == {"neffbuild.cli.commands.store"}
    assert _imported("--version") == set()


def test_help_and_an_unknown_command_see_every_section() -> None:
    assert _imported("--help") == set(MODULES)
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for _, names in SECTIONS:
        for name in names:
            assert f"\n  {name} " in result.output
    unknown = CliRunner().invoke(cli, ["bogus"])
    assert unknown.exit_code == 2 and "No such command 'bogus'" in unknown.output
