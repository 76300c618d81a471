"""Where a unit compiles: the same path whatever else builds it on this host (a real second process
holds the unit while this one asks for it)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from neffbuild.runner.unitdir import unit_scratch
from tests.procs import wait_for

KEY = "0123456789abcdef0123456789abcdef"
HOLDER = """
import sys, time
from pathlib import Path
from neffbuild.runner.unitdir import unit_scratch
with unit_scratch(Path(sys.argv[1]), sys.argv[2], keep=True) as scratch:
    (scratch / "cache").mkdir(parents=True)
    (scratch / "cache" / "holder").write_text("")
    time.sleep(float(sys.argv[3]))
    Path(sys.argv[4]).write_text("")  # about to let go
"""


def test_a_unit_held_by_another_process_is_waited_for_then_built_at_the_same_path(tmp_path: Path) -> None:
    root = tmp_path / "units"
    done = tmp_path / "holder-done"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), KEY, "1.5", str(done)])
    try:
        assert wait_for(lambda: (root / KEY / "cache" / "holder").exists(), 30)
        waits: list[float] = []
        with unit_scratch(root, KEY, on_wait=lambda: waits.append(time.monotonic())) as scratch:
            assert done.exists()  # entered only once the holder had let go
            assert scratch == root / KEY  # the unit's own path, not a random one: the same bytes
            assert not scratch.exists()  # what the holder left was removed first
            scratch.mkdir()
        assert len(waits) == 1
    finally:
        holder.kill()
        holder.wait()
    assert not root.exists()  # the scratch, the lock file and the emptied root: all removed


def test_a_free_unit_is_entered_at_once(tmp_path: Path) -> None:
    waits: list[bool] = []
    with unit_scratch(tmp_path / "units", KEY, on_wait=lambda: waits.append(True)) as scratch:
        assert scratch == tmp_path / "units" / KEY
    assert waits == [] and not (tmp_path / "units").exists()
