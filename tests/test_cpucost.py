"""tests/cpucost.py: a test's CPU is its own and its children's, and reaches the log's summary
from xdist's workers as from a single process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

TESTS = """
import subprocess, sys, time

def test_busy_child():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"], check=True)

def test_asleep():
    time.sleep(0.6)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_the_summary_ranks_a_test_by_its_childrens_cpu_not_its_wall(tmp_path: Path, workers: str) -> None:
    (tmp_path / "test_costs.py").write_text(TESTS)
    # The outer run's PYTEST_ADDOPTS (a plugin of its own, say) is not this inner run's.
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"} | {"PYTHONPATH": str(ROOT)}
    args = ["-p", "tests.cpucost", "-p", "no:cacheprovider", "-n", workers, "-q", str(tmp_path / "test_costs.py")]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *args], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = re.findall(r"^ +([0-9.]+)s cpu  .*::(\w+)$", result.stdout, re.MULTILINE)
    assert [name for _, name in rows] == ["test_busy_child", "test_asleep"], result.stdout
    busy, asleep = (float(seconds) for seconds, _ in rows)
    assert busy >= 0.5 > asleep, result.stdout  # the child's 0.6 s of CPU is counted; sleeping is not
