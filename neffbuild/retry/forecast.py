"""The Forecast: whether an operation under a deadline will end in time (told once, in a log line)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class Remaining(Protocol):
    """What a forecast reads of a deadline (retry.scope.Deadline): the seconds left."""

    def left(self) -> float: ...


class Forecast:
    """Whether an operation under a deadline will end in time at the rate its requests are being
    answered. Told how many requests are to come (expect: a pull's downloads, once planned), it
    times their successes; the first time the requests left, at the rate of the last few, would
    end past the deadline, it says so in one log line with the estimate: a host that will not come
    up in time is known minutes before its deadline, not at it.

    A store that throttles most requests may answer too few successes for a rate before the
    deadline: then, from LEAST answers of any kind, the rate is taken as at most one success more
    than it has had since the downloads were planned (an upper bound, so only a pull late even at
    that rate is told)."""

    SEEN = 8  # the rate is taken over this many successes at most
    LEAST = 4  # and spoken of from this many

    def __init__(self, what: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self._clock = clock
        self._lock = threading.Lock()
        self._expected = 0
        self._done = 0
        self._times: deque[float] = deque(maxlen=self.SEEN)
        self._answers = 0  # since the first expect, successes and throttled answers alike
        self._since: float | None = None  # when the first expect came
        self.told: str | None = None  # the line logged, once

    def expect(self, requests: int) -> None:
        with self._lock:
            self._expected += requests
            if self._since is None:
                self._since = self._clock()

    def answered(self, deadline: Remaining | None, *, ok: bool) -> None:
        """A request was answered (ok: it succeeded; else throttled): log if the rest will be late."""
        now = self._clock()
        with self._lock:
            if not self._expected or self.told is not None or deadline is None:
                return
            self._answers += 1
            if ok:
                self._done += 1
                self._times.append(now)
            rate = self._rate(now)
            if rate is None:
                return
            left = max(self._expected - self._done, 0)
            need, remaining = left / rate, deadline.left()
            if need <= remaining:
                return
            self.told = (
                f"{self.what}: at the {rate:.2g} requests/s the store has been answering lately, the {left} requests "
                f"left need about {need:.0f} s, past the deadline in {remaining:.0f} s: this pull will likely run "
                "out of time (the files it fetched stay in the cache dir for the next try)"
            )
        log.warning("%s", self.told)

    def _rate(self, now: float) -> float | None:
        """Requests/s answered with success lately; None: too few answers yet (the lock held)."""
        if len(self._times) >= self.LEAST and now > self._times[0]:
            return (len(self._times) - 1) / (now - self._times[0])
        if self._answers >= self.LEAST and self._since is not None and now > self._since:
            return (self._done + 1) / (now - self._since)  # mostly throttled: at best one more success now
        return None
