"""The memory gate of `build --unit-memory`: sizes, the budget read from /proc and the cgroup,
and real threads admitted only while their shares fit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from neffbuild.errors import InputError
from neffbuild.runner.memory import MemoryGate, available_memory, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("6GiB", 6 << 30),
        ("6G", 6 * 10**9),
        ("512 MiB", 512 << 20),
        ("1.5gib", 3 << 29),
        ("4096", 4096),
        ("2TB", 2 * 10**12),
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text, "--unit-memory") == size


@pytest.mark.parametrize("text", ["", "GiB", "6 GiBs", "-1G", "0", "1e9", "6 GB extra"])
def test_what_is_no_size_is_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(InputError, match=r"^--unit-memory: .* is not a size"):
        parse_size(text, "--unit-memory")


def _host(root: Path, available_kib: int | None, limit: str | None = None, used: int = 0) -> Path:
    (root / "proc").mkdir(parents=True)
    if available_kib is not None:
        (root / "proc" / "meminfo").write_text(f"MemTotal:  99999999 kB\nMemAvailable: {available_kib:>10} kB\n")
    if limit is not None:
        (root / "sys/fs/cgroup").mkdir(parents=True)
        (root / "sys/fs/cgroup/memory.max").write_text(limit + "\n")
        (root / "sys/fs/cgroup/memory.current").write_text(f"{used}\n")
    return root


def test_the_budget_is_what_the_kernel_and_the_cgroup_both_leave(tmp_path: Path) -> None:
    assert available_memory(_host(tmp_path / "a", 8 << 20)) == 8 << 30  # MemAvailable alone
    assert available_memory(_host(tmp_path / "b", 8 << 20, "max")) == 8 << 30  # a cgroup with no limit
    assert available_memory(_host(tmp_path / "c", 8 << 20, str(6 << 30), used=1 << 30)) == 5 << 30
    assert available_memory(_host(tmp_path / "d", None, str(3 << 30))) == 3 << 30
    assert available_memory(_host(tmp_path / "e", None)) is None
    assert available_memory() is not None  # this host's own /proc


def _run_units(gate: MemoryGate, needs: list[int]) -> None:
    """Each need as a unit on its own thread, holding its share until all have tried to enter."""
    go = threading.Event()

    def unit(need: int) -> None:
        with gate.share(need):
            go.wait(10)

    threads = [threading.Thread(target=unit, args=(n,)) for n in needs]
    for t in threads:
        t.start()
    time.sleep(0.2)  # every thread has reached the gate: those admitted hold, the rest wait
    go.set()
    for t in threads:
        t.join(10)
    assert gate.held == 0


def test_units_start_only_while_their_shares_fit() -> None:
    gate = MemoryGate(10)
    _run_units(gate, [4, 4, 4, 4])
    assert gate.peak == 8  # two at a time, never three (12)


def test_a_unit_over_the_whole_budget_still_builds_alone() -> None:
    gate = MemoryGate(10)
    _run_units(gate, [20, 4])
    assert gate.peak == 20  # alone: the 4 waited for it


def test_no_budget_admits_everything() -> None:
    gate = MemoryGate(None)
    _run_units(gate, [4, 4, 4])
    assert gate.peak == 0  # nothing counted: bounded by --jobs only


def test_bad_memory_flags_exit_2_before_building(tmp_path: Path, cli) -> None:
    store = str(tmp_path / "store")
    for flags, culprit in (
        (["--unit-memory", "12XB"], "--unit-memory: '12XB' is not a size"),
        (["--memory-budget", "8GiB"], "--memory-budget: it bounds --unit-memory's shares"),
    ):
        result = cli("build", str(tmp_path / "absent.toml"), "--store", store, *flags)
        assert result.returncode == 2 and culprit in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) <= 2  # the error and its hint
    assert not (tmp_path / "store").exists()
