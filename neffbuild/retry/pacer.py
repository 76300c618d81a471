"""The Pacer: one operation's adaptive token bucket (the rate its requests may be sent at)."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING

from neffbuild.retry.policy import Policy

if TYPE_CHECKING:
    import random

log = logging.getLogger(__name__)


class Pacer:
    """An adaptive token bucket: the rate at which one operation's requests may be sent.

    The model is the AWS SDKs' "adaptive" retry mode (botocore/retries/adaptive.py): no limit
    until the store first throttles; then each throttled answer cuts the rate to beta x the rate
    measured being sent, and successes let it grow back, never past twice the measured rate.
    Every host of a fleet does the same, so together they keep the store near its rate. Where this
    one differs, and why (bench/RESULTS.md, "Boot storms", has the runs):
    - it paces one operation (a pull, all its threads and both its read and write paths), not one
      botocore client;
    - a throttled request is not also backed off (pause): the cut rate spaces its retry. Backoff
      sleeps on top of the pacer's own wait left the store idle while whole fleets slept (45 % of
      a throttled store's capacity used, issue 39);
    - it grows two ways instead of along a CUBIC curve: per success (the n-th success in a row
      since the last cut multiplies the rate by 1 + growth x n: quick once 503s stop, so the last
      hosts of a storm take up the rate the others left) and in time (x exp(probe x seconds): a
      host cut far below the others climbs back while it waits, where growth per success alone
      left it crawling at a request every 30 s to the end of the storm, the tail of a fleet);
      neither past headroom x the rate measured being sent (AWS: 2; 4 lets a host that was cut
      low catch up in fewer requests);
    - its floor is 0.02 requests/s, well below the share of any fleet the store can serve in a
      deadline: a floor at the fair share (64 hosts at 0.1 against 6.5 requests/s) kept every host
      at it, answered 503 half the time;
    - gaps between requests are jittered (x [0.5, 1.5]), so hosts cut by the same burst of 503s do
      not come back in step;
    - a throttled answer to a request sent before the last cut does not cut again (TCP's one
      reduction per round trip): sixteen requests in flight answered 503 together are one signal,
      not sixteen, and would otherwise drop the rate to the floor at once;
    - there is no burst: a request goes once its gap has passed since the previous one (at the
      rate as it is now: a rate that grew shortens the wait already begun); a waiting request
      looks again every window_s and wakes for the operation's stop and its deadline;
    - requests go in the order they asked (a ticket queue), and a retry asks again behind those
      already waiting: without it, requests retried over and over could starve one that had never
      been sent (a 404 among throttled blobs then waited for the deadline instead of failing);
    - before a window of sending has been measured, the rate is estimated from the requests sent
      since the start (over at least a tenth of a window): AWS takes 0 then, and falls to its
      floor at the first 503;
    - its timings scale with the policy (Policy.scaled), for tests.
    `clock` and `rng` are injectable so the rates can be checked without sleeping.
    """

    def __init__(
        self, policy: Policy, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._rng = rng  # made when first drawn from: random is not on every command's start-up
        self._lock = threading.Lock()
        self.enabled = False
        self.rate = math.inf  # requests/s while enabled
        self._streak = 0  # successes since the last cut
        self._grown_at = clock()
        self._cut_at = -math.inf
        self._last = -math.inf  # when the last request went (or the last cut)
        self._draw = 1.0  # the jitter of the gap after it
        self._start = clock()
        self._measured: float | None = None  # requests/s sent, smoothed over windows (None: no window yet)
        self._window = math.floor(self._start / policy.window_s) * policy.window_s
        self._in_window = 0
        self._tickets = itertools.count()
        self._waiting: deque[int] = deque()  # tickets not yet let go, in the order they asked

    def join(self) -> int:
        """A ticket: this request's place in the queue (give it to take, and to leave if it gives up)."""
        with self._lock:
            ticket = next(self._tickets)
            self._waiting.append(ticket)
            return ticket

    def leave(self, ticket: int) -> None:
        """The request gave up waiting (stopped, past the deadline): those behind it move up."""
        with self._lock, suppress(ValueError):
            self._waiting.remove(ticket)

    def _probed(self, now: float) -> None:
        """Grow the rate for the time since it last changed (the lock held)."""
        if self.enabled and self.policy.probe and now > self._grown_at:
            ceiling = max(self.rate, self.policy.headroom * self.measured())
            self.rate = min(ceiling, self.rate * math.exp(self.policy.probe * (now - self._grown_at)))
        self._grown_at = now

    def take(self, ticket: int) -> float:
        """0 if the request holding ticket may go now (it is counted as sent and leaves the
        queue), else about the seconds to wait first (its turn, at the current rate)."""
        with self._lock:
            now = self._clock()
            self._probed(now)
            if self.enabled:
                ahead = self._waiting.index(ticket)
                due = self._last + self._draw / self.rate
                if ahead or now < due:
                    return max(due - now, 0.0) + ahead / self.rate
                self._went(now)
            self._waiting.remove(ticket)
            window = math.floor(now / self.policy.window_s) * self.policy.window_s
            self._in_window += 1
            if window > self._window:
                current = self._in_window / (window - self._window)
                self._measured = current if self._measured is None else 0.8 * current + 0.2 * self._measured
                self._window, self._in_window = window, 0
            return 0.0

    def _went(self, now: float) -> None:
        """A request went (or the rate was cut) at now: the next gap starts here, with its jitter."""
        self._last = now
        if self._rng is None:
            import random

            self._rng = random.Random()
        self._draw = 1.0 + self.policy.jitter * (2.0 * self._rng.random() - 1.0)

    def measured(self) -> float:
        """The rate requests were sent at lately (the lock held)."""
        if self._measured is not None:
            return self._measured
        return self._in_window / max(self._clock() - self._start, self.policy.window_s / 10)

    def throttled(self, sent_at: float) -> None:
        """A request sent at sent_at (clock time) was throttled."""
        with self._lock:
            if sent_at < self._cut_at:
                return  # sent at the old rate: already answered by that cut
            now = self._clock()
            self._probed(now)
            self.rate = max(self.policy.min_rate, min(self.measured(), self.rate) * self.policy.beta)
            self._streak = 0
            self._cut_at = now
            self.enabled = True
            self._went(now)
        log.debug("throttled: sending at most %.3g requests/s", self.rate)

    def succeeded(self) -> None:
        with self._lock:
            if not self.enabled:
                return
            self._probed(self._clock())
            self._streak += 1
            grown = self.rate * (1.0 + self.policy.growth * self._streak)
            self.rate = max(self.policy.min_rate, min(grown, self.policy.headroom * self.measured()))

    def now(self) -> float:
        return self._clock()
