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
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from neffbuild.errors import StoreError
from neffbuild.retry.policy import CONNECT_S, DEFAULT, READ_S, Policy, Transient, backoff
from neffbuild.retry.scope import _CURRENT, _OPERATION, Deadline, Operation

_T = TypeVar("_T")


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
