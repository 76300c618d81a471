"""Per-unit progress on stderr while units build or replay: live lines on a terminal, a plain line
per phase change (and a heartbeat) in CI logs and pipes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from neffbuild.printable import printable

if TYPE_CHECKING:
    from rich.console import Console as RichConsole
    from rich.progress import TaskID

# A unit's last status; anything else a notify callback receives is a phase it is in.
FINAL_STATUSES = frozenset({"built", "present", "failed", "hit", "miss"})
HEARTBEAT_S = 60.0  # without a TTY, a line for each unit still in one phase this long

Notify = Callable[[str, str], None]  # notify(unit_id, status)


class _UnitClock:
    """When each unit was first heard of, for the elapsed time shown beside it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.RLock()
        self._started: dict[str, float] = {}

    def seen(self, unit_id: str) -> float:
        """Seconds since unit_id was first seen (0 now if this is the first time)."""
        now = self.clock()
        with self.lock:
            return now - self._started.setdefault(unit_id, now)


@contextmanager
def live_progress(console: RichConsole, verb: str, total: int) -> Iterator[Notify]:
    """On a terminal: a live line per running unit (its phase, elapsed time) under a done/total count."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        TextColumn("{task.fields[phase]}", style="bold", markup=False),
        TimeElapsedColumn(),
    )
    clock = _UnitClock()
    with Progress(*columns, console=console, transient=True) as progress:
        overall = progress.add_task(verb, phase=f"0/{total} done")
        running: dict[str, TaskID] = {}
        done = 0

        def notify(unit_id: str, status: str) -> None:
            nonlocal done
            elapsed = clock.seen(unit_id)
            with clock.lock:
                if status in FINAL_STATUSES:
                    done += 1
                    if unit_id in running:
                        progress.remove_task(running.pop(unit_id))
                    progress.update(overall, phase=f"{done}/{total} done")
                    progress.console.print(f"{unit_id}: {status} in {elapsed:.1f} s", markup=False)
                elif unit_id in running:
                    progress.update(running[unit_id], phase=printable(status))
                else:
                    running[unit_id] = progress.add_task(printable(unit_id), phase=printable(status))

        yield notify


@contextmanager
def plain_progress(heartbeat_s: float, now: Callable[[], float], say: Callable[[str], None]) -> Iterator[Notify]:
    """Without a terminal: a line per phase change, and one per unit still in a phase every
    heartbeat_s; elapsed times read from now, lines written by say."""
    clock = _UnitClock(now)
    phases: dict[str, str] = {}  # units still running, and the phase each is in

    def notify(unit_id: str, status: str) -> None:
        elapsed = clock.seen(unit_id)
        with clock.lock:
            if status in FINAL_STATUSES:
                phases.pop(unit_id, None)
                say(f"{unit_id}: {status} in {elapsed:.1f} s")
            elif phases.get(unit_id) != status:
                phases[unit_id] = status
                say(f"{unit_id}: {status} (after {elapsed:.1f} s)")

    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(heartbeat_s):
            with clock.lock:
                for unit_id, phase in phases.items():
                    say(f"{unit_id}: still {phase} (after {clock.seen(unit_id):.0f} s)")

    beat = threading.Thread(target=heartbeat, daemon=True, name="neffbuild-heartbeat")
    beat.start()
    try:
        yield notify
    finally:
        stop.set()
        beat.join()
