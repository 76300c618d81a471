"""Print `name==floor` for every dependency neffbuild declares for pulling and publishing
(core + the s3 extra), read from pyproject.toml: the oldest set a user may end up with.

scripts/test.sh installs exactly these into .venv-lowest, where tests/test_dependencies.py runs
the CLI, so a floor that is too low fails CI instead of a user's boot.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

_FLOOR = re.compile(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][A-Za-z0-9.]*)$")


def floors(pyproject: Path, extras: tuple[str, ...] = ("s3",)) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    declared = list(project["dependencies"])
    for extra in extras:
        declared += project["optional-dependencies"][extra]
    pins = []
    for requirement in declared:
        found = _FLOOR.match(requirement.strip())
        if found is None:
            raise SystemExit(f"{pyproject}: {requirement!r} has no plain `>=` floor to test")
        pins.append(f"{found.group(1)}=={found.group(2)}")
    return pins


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    print("\n".join(floors(root / "pyproject.toml")))
    sys.exit(0)
