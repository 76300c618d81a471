"""How many compiles fit in memory at once: a budget, each unit's share of it, and a gate.

A compile's peak memory (the worker and the C++ compilers it starts) is often several times the
model's size, so `--jobs 4` on a host with room for two ends with the OOM killer taking a worker
mid-compile. With `--unit-memory`, a worker starts only while the shares of those running plus
its own fit in the budget: `--memory-budget`, or the memory available when the build starts (the
kernel's MemAvailable, lowered to the cgroup's limit less its usage inside a container). A unit
whose share exceeds the whole budget still builds, alone: refusing it would fail a build that a
machine with swap, or an estimate that was too high, would have finished.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from neffbuild.errors import InputError

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20}
_UNITS |= {"g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)")
SIZE_HINT = "give a size such as 6GiB, 6G (10^9 bytes), 512MiB or a number of bytes"


def parse_size(text: str, what: str) -> int:
    """Bytes from a size such as `6GiB`, `1.5G` or `512000000` (what: the flag, for the message)."""
    match = _SIZE.fullmatch(text.strip().lower())
    if not match or match.group(2) not in _UNITS:
        raise InputError(f"{what}: {text!r} is not a size", hint=SIZE_HINT)
    size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size <= 0:
        raise InputError(f"{what}: {text!r} is not a size above zero", hint=SIZE_HINT)
    return size


def available_memory(root: Path = Path("/")) -> int | None:
    """Bytes this process could still use: MemAvailable, lowered to what the cgroup (v2) leaves;
    None where neither can be read."""
    found = [n for n in (_mem_available(root / "proc/meminfo"), _cgroup_left(root / "sys/fs/cgroup")) if n is not None]
    return min(found) if found else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+([0-9]+) kB$", text, re.M)
    return int(match.group(1)) * 1024 if match else None


def _cgroup_left(cgroup: Path) -> int | None:
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = int((cgroup / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    if not limit.isdigit():  # "max": no limit of its own
        return None
    return max(int(limit) - used, 0)


class MemoryGate:
    """Lets a unit start while the shares of the units running plus its own fit in the budget
    (any unit when none runs); None as the budget admits everything."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.held = 0
        self.peak = 0  # the most held at once: what the build needed by its own estimates
        self._turns = threading.Condition()

    @contextmanager
    def share(self, need: int | None) -> Iterator[None]:
        budget = self.budget
        if budget is None or need is None:
            yield
            return
        with self._turns:
            self._turns.wait_for(lambda: self.held == 0 or self.held + need <= budget)
            self.held += need
            self.peak = max(self.peak, self.held)
        try:
            yield
        finally:
            with self._turns:
                self.held -= need
                self._turns.notify_all()
