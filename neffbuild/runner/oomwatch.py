"""Was a worker killed by the OOM killer? The cgroup's own count says so.

A SIGKILLed worker looks the same whoever sent the signal. Under cgroup v2 (Kubernetes pods,
systemd services, containers) the kernel counts OOM kills in the cgroup's `memory.events`
(`oom_kill N`); a count that rose while the worker ran, with the worker dead by SIGKILL, names the
OOM killer. Without such a file (cgroup v1, another OS) it says "SIGKILL" and no more.
"""

from __future__ import annotations

from pathlib import Path


def memory_events_path(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> Path | None:
    """This process's cgroup v2 `memory.events`, or None where there is none to read."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            path = cgroup_root / line[3:].lstrip("/") / "memory.events"
            return path if path.is_file() else None
    return None


def oom_kills(events: Path | None) -> int | None:
    """The cgroup's `oom_kill` count (None: unknown)."""
    if events is None:
        return None
    try:
        for line in events.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None
