"""One retry and deadline policy for all store I/O: reads, writes, listings and tag swaps.

A failure is retried only when it is Transient: throttling (503 SlowDown, 429), another 5xx, a
dropped or refused connection, a socket timeout. Everything else (another 4xx, a short or wrong
object: IntegrityError) is raised as it is, at once; an integrity failure is never retried into
success. Between tries the policy sleeps with exponential backoff and full jitter (a uniform draw
in [0, min(cap_s, base_s * 2**try)]), so hosts booting together spread out instead of retrying in
step. A failing request gets `attempts` tries, then a StoreError names the object. A throttled
one (the store is up and asks us to slow down) is not failing: under a deadline it keeps backing
off until the deadline, however long the store throttles (a fleet booting at once can be throttled
for minutes); with no deadline it gets `throttled_attempts` tries, as nothing else would bound it.

An Operation (a pull: `operation()`) is what the threads of one pull share: its Policy, its Pacer
(an adaptive token bucket: see Pacer), the counts its report shows (retries, throttled answers,
seconds spent waiting) and a stop switch: when one of its requests fails for good, `stop()` wakes
every other one from its backoff or pacing wait and cuts the responses they are reading, so the
pull ends within a second instead of after their own retries (store/dataplane.py's run_all).

A Deadline (pull --timeout, ensure_cache(timeout=...)) bounds the whole operation, not a request:
it is the current one for everything run under `bounded()` (thread pools carry it: `carried`).
Each request's connect and read timeouts are min(their usual value, time left); no retry starts
after the deadline and no backoff sleeps past it; and when it passes, a watchdog shuts down every
socket still registered with it (`watch`), so a response that stalls or trickles one byte at a time
(each read returning before its own timeout) ends at the deadline too. Past it: DeadlineExceeded
(exit 3), naming the store, what the operation was doing and, if the store throttled it, that.

Why not tenacity, stamina or backoff (all well kept): the loop itself is a dozen lines; what the
policy needs around it is not something they express: one absolute deadline shared by many threads
that also sets each request's socket timeouts and cuts reads in flight, a rate shared by those
threads, typed errors naming the object, and attempts that keep state (a resumed download
continues from the bytes it has). Every boot host would carry one more dependency for that loop.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from typing import TypeVar

from neffbuild.errors import Abandoned, DeadlineExceeded, StoreError

log = logging.getLogger(__name__)

CONNECT_S = 10.0  # a connection not made in this long is Transient
READ_S = 120.0  # a socket read waiting this long is Transient
DEADLINE_HINT = "the store is slow or unreachable; raise --timeout, or boot the installed release with --allow-stale"
THROTTLED_HINT = (
    "the store kept throttling this host (503 SlowDown / 429): stagger the fleet's boots, raise --timeout, "
    "or boot the installed release with --allow-stale"
)
SCALE_ENV = "NEFFBUILD_RETRY_SCALE"  # read by the CLI only (see Policy.scaled)
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Policy:
    """How requests are retried and paced. Defaults: 6 tries of a failing request (1.5 s of backoff
    on average, 3.1 s at most, about what AWS's SDKs wait by default, so a store down at boot fails
    in seconds); throttled requests until the deadline, or 16 tries without one."""

    attempts: int = 6  # tries of a failing request
    throttled_attempts: int = 16  # tries of a throttled request when no deadline bounds it
    base_s: float = 0.1  # the first backoff is drawn from [0, base_s]
    cap_s: float = 8.0  # no single backoff is longer
    # The Pacer (see there for why each):
    min_rate: float = 0.02  # requests/s a throttled pull never goes below
    beta: float = 0.5  # a throttled answer cuts the rate to beta x what was sent
    growth: float = 0.05  # the n-th success in a row since the last cut grows the rate by 1 + growth x n
    jitter: float = 0.5  # each gap between requests is 1 / rate x a uniform draw in [1 - jitter, 1 + jitter]
    probe: float = 0.02  # per second: between answers the rate grows by exp(probe x seconds)
    headroom: float = 4.0  # the rate never grows past headroom x the rate measured being sent
    window_s: float = 0.5  # the sent rate is measured over windows this long

    def scaled(self, factor: float) -> Policy:
        """Every time factor x, every rate / factor (so the dynamics keep their shape): what
        NEFFBUILD_RETRY_SCALE does for tests and benchmarks that cannot wait minutes."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"a retry scale must be a positive number, not {factor!r}")
        return replace(
            self, base_s=self.base_s * factor, cap_s=self.cap_s * factor, min_rate=self.min_rate / factor,
            window_s=self.window_s * factor, probe=self.probe / factor,
        )  # fmt: skip


DEFAULT = Policy()


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
        self._rng = rng or random.Random()
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

    def answered(self, deadline: Deadline | None, *, ok: bool) -> None:
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


@contextmanager
def operation(policy: Policy | None = None, what: str = "the operation") -> Iterator[Operation]:
    """Run the block as one operation (its requests paced and counted together); inside another
    one and with no policy of its own, the block is part of that one."""
    current = _OPERATION.get()
    if current is not None and policy is None:
        yield current
        return
    op = Operation(policy or DEFAULT, what)
    token = _OPERATION.set(op)
    try:
        yield op
    finally:
        _OPERATION.reset(token)


def current() -> Deadline | None:
    return _CURRENT.get()


def current_operation() -> Operation | None:
    return _OPERATION.get()


def stop() -> None:
    """The current operation failed: stop its other requests (nothing without an operation)."""
    op = _OPERATION.get()
    if op is not None:
        op.stop()


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
    """DeadlineExceeded if the current deadline has passed, Abandoned if the operation stopped
    (where: the store, for the message)."""
    deadline = _CURRENT.get()
    if deadline is not None:
        deadline.check(where)
    op = _OPERATION.get()
    if op is not None:
        op.check(where)


def timeouts() -> tuple[float, float]:
    """(connect, read) socket timeouts for a request starting now: the usual ones, or the time left."""
    deadline = _CURRENT.get()
    if deadline is None:
        return CONNECT_S, READ_S
    left = max(deadline.left(), 0.001)
    return min(CONNECT_S, left), min(READ_S, left)


def watch(key: int, cut: Callable[[], None]) -> None:
    """Call cut() (end a read in flight) when the deadline passes or the operation stops."""
    for guard in (_CURRENT.get(), _OPERATION.get()):
        if guard is not None:
            guard.watch(key, cut)


def unwatch(key: int) -> None:
    for guard in (_CURRENT.get(), _OPERATION.get()):
        if guard is not None:
            guard.unwatch(key)


def backoff(tries: int, *, base: float = DEFAULT.base_s, cap: float = DEFAULT.cap_s) -> float:
    """Seconds to wait after `tries` failed tries: full jitter, uniform in [0, min(cap, base * 2**tries)]."""
    return random.uniform(0.0, min(cap, base * 2 ** min(tries, 32)))


class Tries:
    """One request's failures so far: `failed` (count against the policy's attempts) and
    `throttled` (count only with no deadline); both set the backoff."""

    __slots__ = ("failed", "sent_at", "throttled")

    def __init__(self) -> None:
        self.failed = 0
        self.throttled = 0
        self.sent_at = -math.inf  # when the try that failed was sent (the pacer's round)

    def reset(self) -> None:
        """The request moved on (a resumed body received more): a drop now and then is not a failing store."""
        self.failed = self.throttled = 0


def pause(where: str, tries: Tries, failure: Transient) -> None:
    """After a try failed with `failure`: count it, sleep, or raise if no try is left (the
    attempts are spent: StoreError; the deadline passed: DeadlineExceeded; the operation
    stopped: Abandoned)."""
    deadline = _CURRENT.get()
    op = _OPERATION.get()
    policy = op.policy if op is not None else DEFAULT
    if failure.throttled:
        tries.throttled += 1
        if op is not None:
            op.pacer.throttled(tries.sent_at)
            op.forecast.answered(deadline, ok=False)
    else:
        tries.failed += 1
    if op is not None:
        op.count(throttled=failure.throttled)
    check(where)
    if (failure.throttled and deadline is None and tries.throttled >= policy.throttled_attempts) or (
        not failure.throttled and tries.failed >= policy.attempts
    ):
        attempts = tries.failed + tries.throttled
        doing = f", {deadline.what}: {deadline.now()}" if deadline is not None else ""
        raise StoreError(f"{where}: {failure} ({attempts} tries{doing})", hint=failure.hint)
    delay = backoff(tries.failed + tries.throttled - 1, base=policy.base_s, cap=policy.cap_s)
    if failure.throttled and op is not None:
        delay = 0.0  # the pacer, cut by this answer, spaces the retry: a backoff on top would idle the store
    if deadline is not None:
        delay = min(delay, deadline.left())
    _wait(op, delay, "backoff")
    check(where)
    if op is not None:
        op.count(retry=True)


def _wait(op: Operation | None, seconds: float, kind: str) -> None:
    if op is None:
        time.sleep(seconds)
        return
    started = time.monotonic()
    op.wait(seconds)
    op.spent(kind, time.monotonic() - started)


def paced(where: str, tries: Tries) -> None:
    """Wait until the operation's pacer lets this try go (at once before the store first throttles)."""
    op = _OPERATION.get()
    if op is None:
        return
    ticket = op.pacer.join()
    try:
        while (delay := op.pacer.take(ticket)) > 0:
            # Look again every window, even when the turn estimated at today's rate lies past the
            # deadline: the rate may grow and those ahead go or leave sooner, and a request asleep
            # until the deadline would hold up every one queued behind it.
            deadline = _CURRENT.get()
            _wait(op, min(delay, op.policy.window_s, deadline.left() if deadline is not None else math.inf), "paced")
            check(where)
    finally:
        op.pacer.leave(ticket)
    tries.sent_at = op.pacer.now()


def succeeded() -> None:
    op = _OPERATION.get()
    if op is not None:
        op.pacer.succeeded()
        op.forecast.answered(_CURRENT.get(), ok=True)


def expect(requests: int) -> None:
    """The current operation is about to send about this many more requests (for its Forecast)."""
    op = _OPERATION.get()
    if op is not None:
        op.forecast.expect(requests)


_RETRYING: contextvars.ContextVar[bool] = contextvars.ContextVar("neffbuild_retrying", default=False)


def retried(where: str, attempt: Callable[[], _T]) -> _T:
    """attempt() until it returns, retrying Transient failures under the policy."""
    if _RETRYING.get():
        # One request would take two turns of the pacer and count as two answers: a throttled
        # store served at half its rate, and a forecast that thinks the pull done halfway.
        raise RuntimeError(f"{where}: retried inside a retried attempt (call the inner request's one try)")
    token = _RETRYING.set(True)
    try:
        return _retried(where, attempt)
    finally:
        _RETRYING.reset(token)


def _retried(where: str, attempt: Callable[[], _T]) -> _T:
    check(where)
    tries = Tries()
    op = _OPERATION.get()
    while True:
        paced(where, tries)
        sent = time.monotonic()
        try:
            result = attempt()
        except Transient as failure:
            if op is not None:
                op.spent("flight", time.monotonic() - sent)
            pause(where, tries, failure)
            continue
        if op is not None:
            op.spent("flight", time.monotonic() - sent)
        succeeded()
        return result


def carried(task: Callable[[], _T]) -> Callable[[], _T]:
    """task, to be run in a pool thread under the caller's deadline (each call its own context copy)."""
    context = contextvars.copy_context()
    return lambda: context.run(task)
