"""What the requests of one operation share: its Deadline (a wall-clock limit, with a watchdog
that cuts reads in flight when it passes), its Operation (policy, pacer, forecast, counts and a
stop switch) and the context variables that make both the current ones for a block and its threads."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from neffbuild.errors import Abandoned, DeadlineExceeded
from neffbuild.retry.forecast import Forecast
from neffbuild.retry.pacer import Pacer
from neffbuild.retry.policy import DEADLINE_HINT, DEFAULT, THROTTLED_HINT, Policy


class _Cuts:
    """Callbacks that end reads in flight (a socket shutdown each), fired once, when a deadline
    passes or an operation stops; one registered after that is fired at once."""

    def __init__(self) -> None:
        self._cuts: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self.fired = False

    def watch(self, key: int, cut: Callable[[], None]) -> None:
        with self._lock:
            if not self.fired:
                self._cuts[key] = cut
                return
        cut()

    def unwatch(self, key: int) -> None:
        with self._lock:
            self._cuts.pop(key, None)

    def fire(self) -> None:
        with self._lock:  # held while cutting: an unwatched socket may already serve another request
            self.fired = True
            for cut in self._cuts.values():
                cut()
            self._cuts.clear()


class Deadline:
    """A wall-clock limit on one operation (`what`, e.g. "pulling prod"), shared by its threads."""

    def __init__(self, timeout: float, what: str) -> None:
        self.timeout = timeout
        self.what = what
        self.step = "opening the store"  # what the operation is doing now, for the error
        self.at = time.monotonic() + timeout
        self._landed = 0
        self._cuts = _Cuts()
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout, self._cuts.fire)
        self._timer.daemon = True

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return self._cuts.fired or time.monotonic() >= self.at

    def doing(self, step: str) -> None:
        self.step = step

    def landed(self) -> None:
        with self._lock:
            self._landed += 1

    def now(self) -> str:
        """What the operation is doing, e.g. "fetching 12 of 40 files (...), 3 landed"."""
        return f"{self.step}, {self._landed} landed" if self._landed else self.step

    def error(self, where: str) -> DeadlineExceeded:
        message = f"{where}: {self.what} went past its {self.timeout:g} s deadline while {self.now()}"
        op = _OPERATION.get()
        if op is None or not op.throttled:
            return DeadlineExceeded(message, hint=DEADLINE_HINT)
        return DeadlineExceeded(f"{message}; the store throttled it: {op.counts().summary()}", hint=THROTTLED_HINT)

    def check(self, where: str) -> None:
        if self.passed():
            raise self.error(where)

    def watch(self, key: int, cut: Callable[[], None]) -> None:
        """Call cut() when the deadline passes, unless unwatch(key) came first."""
        self._cuts.watch(key, cut)

    def unwatch(self, key: int) -> None:
        self._cuts.unwatch(key)

    def start(self) -> None:
        """Arm the watchdog (a timer thread) that cuts what is watched when the deadline passes."""
        self._timer.start()

    def stop(self) -> None:
        self._timer.cancel()


@dataclass(frozen=True, slots=True)
class Counts:
    """What an operation's requests went through: tries after the first (retries), answers that
    throttled them, and seconds summed over its requests (in parallel, so a sum may exceed the
    operation's own time): waiting their turn in the pacer (paced_s), sleeping in backoff after a
    failure (backoff_s), and inside a try, from sending to its answer handled (in_flight_s)."""

    retries: int = 0
    throttled: int = 0
    waited_s: float = 0.0  # paced_s + backoff_s
    paced_to: float | None = None  # requests/s the pacer allowed at the end; None: never throttled
    paced_s: float = 0.0
    backoff_s: float = 0.0
    in_flight_s: float = 0.0

    def summary(self) -> str:
        rate = f", paced down to {self.paced_to:.2g} requests/s" if self.paced_to is not None else ""
        return (
            f"{self.throttled} answers 503 SlowDown or 429, {self.retries} retries, {self.waited_s:.1f} s waiting "
            f"({self.paced_s:.1f} s paced, {self.backoff_s:.1f} s in backoff){rate}"
        )


class Operation:
    """What the threads of one operation (a pull) share: policy, pacer, counts, a stop switch and
    a forecast against its deadline (Forecast)."""

    def __init__(self, policy: Policy = DEFAULT, what: str = "the operation") -> None:
        self.policy = policy
        self.what = what
        self.pacer = Pacer(policy)
        self.forecast = Forecast(what)
        self.retries = 0
        self.throttled = 0
        self._seconds = {"paced": 0.0, "backoff": 0.0, "flight": 0.0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._cuts = _Cuts()

    def counts(self) -> Counts:
        with self._lock:
            paced = self.pacer.rate if self.pacer.enabled else None
            s = {k: round(v, 3) for k, v in self._seconds.items()}
            waited = round(self._seconds["paced"] + self._seconds["backoff"], 3)
            return Counts(self.retries, self.throttled, waited, paced, s["paced"], s["backoff"], s["flight"])

    def count(self, *, retry: bool = False, throttled: bool = False) -> None:
        with self._lock:
            self.retries += retry
            self.throttled += throttled

    def spent(self, kind: str, seconds: float) -> None:
        """seconds of one request's time, kind: "paced", "backoff" or "flight"."""
        with self._lock:
            self._seconds[kind] += seconds

    def stop(self) -> None:
        """One request failed for good: wake the others from their waits and cut their reads."""
        self._stop.set()
        self._cuts.fire()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def check(self, where: str) -> None:
        if self._stop.is_set():
            raise Abandoned(f"{where}: abandoned: another request of {self.what} failed")

    def wait(self, seconds: float) -> None:
        """Sleep, unless stopped first."""
        if seconds > 0:
            self._stop.wait(seconds)

    def watch(self, key: int, cut: Callable[[], None]) -> None:
        self._cuts.watch(key, cut)

    def unwatch(self, key: int) -> None:
        self._cuts.unwatch(key)


_CURRENT: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("neffbuild_deadline", default=None)
_OPERATION: contextvars.ContextVar[Operation | None] = contextvars.ContextVar("neffbuild_operation", default=None)
