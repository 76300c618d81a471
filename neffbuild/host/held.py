"""The state dir of a cache dir whose lock this process holds (host/cachedir.py's `locked`).

A module of its own: a no-op pull takes no lock, so it does not build the class (each frozen
dataclass costs the import that builds it about 0.5-0.8 ms)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from neffbuild.fs.atomic import write_atomic_at
from neffbuild.host.state import STATE_FILE, CacheState
from neffbuild.host.statefile import load_state


@dataclass(frozen=True, slots=True)
class Held:
    """The state dir of a cache dir whose lock this process holds: its state, read and replaced."""

    fd: int  # `.neffbuild/`, open
    shown: Path  # the state file, for messages

    def state(self) -> tuple[bytes | None, CacheState]:
        """(the state file's bytes, what it says); a missing, foreign or broken file reads as empty."""
        return load_state(self.fd)

    def write_state(self, data: bytes) -> None:
        """Replace the state file with data, atomically (a reader sees the old or the new one)."""
        write_atomic_at(self.fd, STATE_FILE, data, shown=self.shown)
