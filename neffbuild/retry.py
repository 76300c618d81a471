"""One retry and deadline policy for all store I/O: reads, writes, listings and tag swaps.

A failure is retried only when it is Transient: throttling (503 SlowDown, 429), another 5xx, a
dropped or refused connection, a socket timeout. Everything else (another 4xx, a short or wrong
object: IntegrityError) is raised as it is, at once; an integrity failure is never retried into
success. Between tries the policy sleeps with exponential backoff and full jitter (a uniform draw
in [0, min(CAP_S, BASE_S * 2**try)]), so hosts booting together spread out instead of retrying in
step; after ATTEMPTS tries of one request it gives up with a StoreError naming the object. A
throttled request (the store is up and asks us to slow down) gets THROTTLED_ATTEMPTS: hosts booting
together can be throttled for tens of seconds, and the deadline still bounds the whole.

A Deadline (pull --timeout, ensure_cache(timeout=...)) bounds the whole operation, not a request:
it is the current one for everything run under `bounded()` (thread pools carry it: `carried`).
Each request's connect and read timeouts are min(their usual value, time left); no retry starts
after the deadline and no backoff sleeps past it; and when it passes, a watchdog shuts down every
socket still registered with it (`watch`), so a response that stalls or trickles one byte at a time
(each read returning before its own timeout) ends at the deadline too. Past it: DeadlineExceeded
(exit 3), naming the store and what the operation was doing.

Why not tenacity, stamina or backoff (all well kept): the loop itself is a dozen lines; what the
policy needs around it is not something they express: one absolute deadline shared by many threads
that also sets each request's socket timeouts and cuts reads in flight, typed errors naming the
object, and attempts that keep state (a resumed download continues from the bytes it has). The
data plane would wrap every request in a library object to save those dozen lines, and every boot
host would carry one more dependency.
"""

from __future__ import annotations

import contextvars
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from neffbuild.errors import DeadlineExceeded, StoreError

# Tries of one request: with the backoff below, 1.5 s of sleep in all on average, 3.1 s at most,
# about what AWS's SDKs wait by default; a store down at boot fails in seconds (or --allow-stale).
ATTEMPTS = 6
# Tries of one request while the store keeps throttling it: about 40 s of backoff on average.
THROTTLED_ATTEMPTS = 16
BASE_S = 0.1  # the first backoff is drawn from [0, BASE_S]
CAP_S = 8.0  # no single backoff is longer
CONNECT_S = 10.0  # a connection not made in this long is Transient
READ_S = 120.0  # a socket read waiting this long is Transient
DEADLINE_HINT = "the store is slow or unreachable; raise --timeout, or boot the installed release with --allow-stale"
_T = TypeVar("_T")


class Transient(Exception):
    """A connection or server failure worth another try; `received`: body bytes that made it;
    `throttled`: the store answered, asking us to slow down (503 SlowDown, 429)."""

    def __init__(
        self, message: str, hint: str = "the endpoint keeps failing; retry later", *, received: int = 0, throttled: bool = False
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.hint = hint
        self.received = received
        self.throttled = throttled


class Deadline:
    """A wall-clock limit on one operation (`what`, e.g. "pulling prod"), shared by its threads."""

    def __init__(self, timeout: float, what: str) -> None:
        self.timeout = timeout
        self.what = what
        self.step = "opening the store"  # what the operation is doing now, for the error
        self.at = time.monotonic() + timeout
        self._landed = 0
        self._cuts: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._passed = False
        self._timer = threading.Timer(timeout, self._pass)
        self._timer.daemon = True

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return self._passed or time.monotonic() >= self.at

    def doing(self, step: str) -> None:
        self.step = step

    def landed(self) -> None:
        with self._lock:
            self._landed += 1

    def now(self) -> str:
        """What the operation is doing, e.g. "fetching 12 of 40 files (...), 3 landed"."""
        return f"{self.step}, {self._landed} landed" if self._landed else self.step

    def error(self, where: str) -> DeadlineExceeded:
        return DeadlineExceeded(f"{where}: {self.what} went past its {self.timeout:g} s deadline while {self.now()}", hint=DEADLINE_HINT)

    def check(self, where: str) -> None:
        if self.passed():
            raise self.error(where)

    def watch(self, key: int, cut: Callable[[], None]) -> None:
        """Call cut() when the deadline passes, unless unwatch(key) came first."""
        with self._lock:
            if not self._passed:
                self._cuts[key] = cut
                return
        cut()

    def unwatch(self, key: int) -> None:
        with self._lock:
            self._cuts.pop(key, None)

    def start(self) -> None:
        """Arm the watchdog (a timer thread) that cuts what is watched when the deadline passes."""
        self._timer.start()

    def stop(self) -> None:
        self._timer.cancel()

    def _pass(self) -> None:
        with self._lock:  # held while cutting: an unwatched socket may already serve another request
            self._passed = True
            for cut in self._cuts.values():
                cut()
            self._cuts.clear()


_CURRENT: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("neffbuild_deadline", default=None)


@contextmanager
def bounded(timeout: float | None, what: str) -> Iterator[Deadline | None]:
    """Run the block under a deadline of timeout seconds (None: under the current one, if any)."""
    if timeout is None:
        yield _CURRENT.get()
        return
    deadline = Deadline(timeout, what)
    token = _CURRENT.set(deadline)
    deadline.start()
    try:
        yield deadline
    finally:
        deadline.stop()
        _CURRENT.reset(token)


def current() -> Deadline | None:
    return _CURRENT.get()


def doing(step: str) -> None:
    """Say what the operation under the current deadline is doing now (for its error)."""
    deadline = _CURRENT.get()
    if deadline is not None:
        deadline.doing(step)


def landed() -> None:
    """Count one more file landed by the operation under the current deadline (for its error)."""
    deadline = _CURRENT.get()
    if deadline is not None:
        deadline.landed()


def check(where: str) -> None:
    """DeadlineExceeded if the current deadline has passed (where: the store, for the message)."""
    deadline = _CURRENT.get()
    if deadline is not None:
        deadline.check(where)


def timeouts() -> tuple[float, float]:
    """(connect, read) socket timeouts for a request starting now: the usual ones, or the time left."""
    deadline = _CURRENT.get()
    if deadline is None:
        return CONNECT_S, READ_S
    left = max(deadline.left(), 0.001)
    return min(CONNECT_S, left), min(READ_S, left)


def backoff(tries: int, *, base: float | None = None, cap: float | None = None) -> float:
    """Seconds to wait after `tries` failed tries: full jitter, uniform in [0, min(cap, base * 2**tries)]
    (default BASE_S and CAP_S)."""
    base, cap = BASE_S if base is None else base, CAP_S if cap is None else cap
    return random.uniform(0.0, min(cap, base * 2 ** min(tries, 32)))


def pause(where: str, tries: int, failure: Transient) -> None:
    """After try number `tries` (counted from 0) failed: sleep, or raise if no try is left (the
    attempts are spent: StoreError; the deadline passed: DeadlineExceeded)."""
    deadline = _CURRENT.get()
    if deadline is not None:
        deadline.check(where)
    attempts = THROTTLED_ATTEMPTS if failure.throttled else ATTEMPTS
    if tries + 1 >= attempts:
        doing = f", {deadline.what}: {deadline.now()}" if deadline is not None else ""
        raise StoreError(f"{where}: {failure} ({tries + 1} tries{doing})", hint=failure.hint)
    delay = backoff(tries)
    if deadline is not None:
        delay = min(delay, deadline.left())
    time.sleep(delay)
    if deadline is not None:
        deadline.check(where)


def retried(where: str, attempt: Callable[[], _T]) -> _T:
    """attempt() until it returns, retrying Transient failures under the policy."""
    check(where)
    tries = 0
    while True:
        try:
            return attempt()
        except Transient as failure:
            pause(where, tries, failure)
            tries += 1


def carried(task: Callable[[], _T]) -> Callable[[], _T]:
    """task, to be run in a pool thread under the caller's deadline (each call its own context copy)."""
    context = contextvars.copy_context()
    return lambda: context.run(task)
