"""Was a worker killed by the OOM killer? The cgroup's own count says so.

A SIGKILLed worker looks the same whoever sent the signal. Under cgroup v2 (Kubernetes pods,
systemd services, containers) the kernel counts OOM kills in the cgroup's `memory.events`
(`oom_kill N`); a count that rose while the worker ran, with the worker dead by SIGKILL, names the
OOM killer. Under cgroup v1 (older container hosts, e.g. ECS-optimized AMIs running AWS Batch) the
memory controller's `memory.oom_control` carries the same `oom_kill N` line (Linux 4.13 and
later). Without either (another OS) it says "SIGKILL" and no more.
"""

from __future__ import annotations

from pathlib import Path


def memory_events_path(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> Path | None:
    """The file that counts this process's cgroup's OOM kills: cgroup v2's `memory.events`, else
    cgroup v1's `memory.oom_control`; None where there is neither to read."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # v2 first: on a hybrid host the v2 tree may hold no memory controller
        if line.startswith("0::"):
            path = cgroup_root / line[3:].lstrip("/") / "memory.events"
            if path.is_file():
                return path
    for line in lines:
        _, controllers, group = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if "memory" in controllers.split(","):
            path = cgroup_root / "memory" / group.lstrip("/") / "memory.oom_control"
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
