"""The retry and deadline policy (neffbuild/retry/): the policy itself, then against the real S3
server with faults made for real by a proxy (tests/tcpproxy.py) or by killing the server."""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from neffbuild import retry
from neffbuild.api import ensure_cache
from neffbuild.documents.refs import resolve
from neffbuild.errors import DeadlineExceeded, IntegrityError, NotFoundError, StoreError
from neffbuild.fs.confined import BlobTarget
from neffbuild.retry.forecast import Forecast
from neffbuild.retry.pacer import Pacer
from neffbuild.retry.policy import SCALE_ENV, THROTTLED_HINT
from neffbuild.store import open_store
from neffbuild.store.base import blob_key
from neffbuild.store.s3 import ranged
from neffbuild.store.s3.dataplane import PART
from neffbuild.store.s3.responses import http_error
from tests.fleetsim import Fleet, simulate
from tests.s3server import S3Server, client_for
from tests.storekit import publish_release_of, write_files
from tests.tcpproxy import TcpProxy

# ---- the policy ------------------------------------------------------------------------------


FAST = retry.DEFAULT.scaled(0.0001)  # the policy's shape, at test speed
EVEN = replace(retry.DEFAULT, jitter=0.0, probe=0.0)  # gaps of exactly 1 / rate, no growth in time


def test_backoff_is_full_jitter_within_its_exponential_bound() -> None:
    policy = retry.DEFAULT
    for tries in range(12):
        bound = min(policy.cap_s, policy.base_s * 2**tries)
        waits = [retry.backoff(tries) for _ in range(400)]
        assert all(0 <= w <= bound for w in waits)
        # Full jitter: the draws cover [0, bound], not a band near it (nor a fixed value).
        assert min(waits) < 0.1 * bound and max(waits) > 0.9 * bound


def test_a_scaled_policy_keeps_its_shape() -> None:
    scaled = retry.DEFAULT.scaled(0.1)
    assert (scaled.base_s, scaled.cap_s, scaled.window_s) == pytest.approx((0.01, 0.8, 0.05))
    assert scaled.min_rate == pytest.approx(10 * retry.DEFAULT.min_rate) and scaled.probe == pytest.approx(
        10 * retry.DEFAULT.probe
    )
    assert (scaled.attempts, scaled.throttled_attempts, scaled.beta, scaled.growth) == (
        6, 16, retry.DEFAULT.beta, retry.DEFAULT.growth,
    )  # fmt: skip
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            retry.DEFAULT.scaled(bad)


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (503, b"<Error><Code>SlowDown</Code></Error>", retry.Transient),
        (429, b"", retry.Transient),
        (500, b"<Error><Code>InternalError</Code></Error>", retry.Transient),
        (502, b"", retry.Transient),
        (404, b"<Error><Code>NoSuchKey</Code></Error>", NotFoundError),
        (403, b"<Error><Code>AccessDenied</Code></Error>", StoreError),
        (400, b"<Error><Code>InvalidRequest</Code></Error>", StoreError),
        (416, b"", IntegrityError),
    ],
)
def test_only_throttling_and_5xx_are_worth_another_try(status: int, body: bytes, kind: type) -> None:
    answer = http_error("s3://b/p", "blobs/ab/cd", status, body, None)
    assert type(answer) is kind


def test_transient_failures_are_retried_and_others_are_not() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise retry.Transient("HTTP 503 SlowDown")
        return "ok"

    with retry.operation(FAST):
        assert retry.retried("s3://b/k", flaky) == "ok" and len(calls) == 3

        def corrupt() -> None:
            calls.append(2)
            raise IntegrityError("s3://b/k: the object is short")

        with pytest.raises(IntegrityError):
            retry.retried("s3://b/k", corrupt)
        assert calls.count(2) == 1  # an integrity failure is never tried again

        def failing() -> None:
            calls.append(3)
            raise retry.Transient("connection refused")

        with pytest.raises(StoreError) as err:
            retry.retried("s3://b/k", failing)
    assert (
        calls.count(3) == FAST.attempts
        and "s3://b/k" in err.value.message
        and not isinstance(err.value, DeadlineExceeded)
    )


def _failing(counts: dict[bool, int], throttled: bool) -> None:
    counts[throttled] += 1
    raise retry.Transient("HTTP 503 SlowDown" if throttled else "HTTP 500", throttled=throttled)


def test_without_a_deadline_a_throttling_store_gets_more_tries_than_one_that_fails() -> None:
    counts = {True: 0, False: 0}
    with retry.operation(FAST):
        for throttled in (True, False):
            with pytest.raises(StoreError) as err:
                retry.retried("s3://b/k", lambda t=throttled: _failing(counts, t))
            assert f"({counts[throttled]} tries" in err.value.message
    assert counts == {True: FAST.throttled_attempts, False: FAST.attempts} and FAST.throttled_attempts > FAST.attempts


def test_under_a_deadline_throttling_is_backed_off_until_the_deadline_and_named_there() -> None:
    counts = {True: 0, False: 0}
    with retry.operation(FAST) as op:
        with retry.bounded(1.0, "pulling prod"), pytest.raises(DeadlineExceeded) as err:
            retry.retried("s3://b/k", lambda: _failing(counts, True))
        with (
            retry.bounded(60, "pulling prod"),
            pytest.raises(StoreError) as failed,
        ):  # a failing store still gets its tries
            retry.retried("s3://b/k", lambda: _failing(counts, False))
    assert (
        counts[True] > 4 * FAST.throttled_attempts
        and counts[False] == FAST.attempts
        and not isinstance(failed.value, DeadlineExceeded)
    )
    assert (
        "the store throttled it: " in err.value.message
        and f"{counts[True]} answers 503 SlowDown or 429" in err.value.message
    )
    assert err.value.hint == THROTTLED_HINT and op.counts().throttled == counts[True] + 0


def test_throttled_tries_do_not_spend_the_tries_of_a_failure() -> None:
    """A request throttled many times, then failing: it still gets all its failure tries."""
    seen: list[str] = []

    def attempt() -> None:
        kind = "throttled" if len(seen) < 20 else "failed"
        seen.append(kind)
        raise retry.Transient(kind, throttled=kind == "throttled")

    with (
        retry.operation(retry.DEFAULT.scaled(0.0001)),
        retry.bounded(30, "pulling prod"),
        pytest.raises(StoreError) as err,
    ):
        retry.retried("s3://b/k", attempt)
    assert (
        seen.count("throttled") == 20
        and seen.count("failed") == FAST.attempts
        and not isinstance(err.value, DeadlineExceeded)
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _take(pacer: Pacer) -> float:
    """One request asking once, alone in the queue: 0 if it went, else the seconds to wait."""
    ticket = pacer.join()
    delay = pacer.take(ticket)
    pacer.leave(ticket)
    return delay


def _send(pacer: Pacer, clock: Clock, *, throttled: bool) -> None:
    """One request through the pacer once it may go (the clock moves there), then its answer."""
    ticket = pacer.join()
    while (delay := pacer.take(ticket)) > 0:
        clock.now += delay
    sent = clock.now
    clock.now += 0.001
    if throttled:
        pacer.throttled(sent)
    else:
        pacer.succeeded()


def test_the_pacer_shrinks_when_throttled_and_grows_back_on_success() -> None:
    clock = Clock()
    pacer = Pacer(EVEN, clock)
    for _ in range(200):  # unthrottled: no limit at all
        assert _take(pacer) == 0
        clock.now += 0.01
    assert not pacer.enabled
    _send(pacer, clock, throttled=True)
    first = pacer.rate
    assert pacer.enabled and 50 < first < 100  # beta x the ~100 requests/s it was sending
    rates = [first]
    for _ in range(8):
        _send(pacer, clock, throttled=True)
        rates.append(pacer.rate)
    assert all(b < a for a, b in itertools.pairwise(rates)) and rates[-1] >= retry.DEFAULT.min_rate
    # No burst: the next request waits 1 / rate.
    assert _take(pacer) == pytest.approx(1 / pacer.rate, rel=0.01)
    low = pacer.rate
    for _ in range(30):
        _send(pacer, clock, throttled=False)
    assert pacer.rate > 4 * low


def test_a_pacer_never_goes_below_its_floor_and_cuts_once_per_round() -> None:
    clock = Clock()
    pacer = Pacer(EVEN, clock)
    for _ in range(100):  # sending about 100 requests/s
        _take(pacer)
        clock.now += 0.01
    sent = clock.now
    for _ in range(16):  # sixteen requests in flight together...
        _take(pacer)
    clock.now += 0.1
    for _ in range(16):  # ...all answered 503: one cut
        pacer.throttled(sent)
    once = pacer.rate
    assert 50 < once < 100
    for _ in range(100):
        _send(pacer, clock, throttled=True)
    assert pacer.rate == retry.DEFAULT.min_rate < once


def test_a_throttled_pacer_lets_requests_go_in_the_order_they_asked() -> None:
    """A retry asking again after its backoff goes behind a request that has waited since before
    it: however often retries look first, the first request goes first (no starvation)."""
    clock = Clock()
    pacer = Pacer(EVEN, clock)
    for _ in range(10):
        _take(pacer)
        clock.now += 0.1
    pacer.throttled(clock.now)  # now paced at about 5 requests/s
    gap = 1 / pacer.rate
    first, second = pacer.join(), pacer.join()
    clock.now += gap
    retried = pacer.join()
    for _ in range(5):  # the later ones look first, and again, and are told to wait their turn
        assert pacer.take(retried) == pytest.approx(2 * gap)
        assert pacer.take(second) == pytest.approx(gap)
    assert pacer.take(first) == 0
    assert pacer.take(retried) == pytest.approx(2 * gap)  # two slots away: second's, then its own
    clock.now += gap
    pacer.leave(second)  # second gave up (its operation stopped): retried moves up
    assert pacer.take(retried) == 0
    assert pacer.take(pacer.join()) == pytest.approx(gap)


def test_a_throttled_request_is_spaced_by_the_pacer_not_backed_off_on_top() -> None:
    """Throttled: the retry waits its turn in the pacer (cut by the 503), with no backoff sleep on
    top (a sleeping request leaves the store idle); failing (500): it backs off as before."""
    answers = iter([True] * 5 + [False] * 3)

    def attempt() -> str:
        throttled = next(answers, None)
        if throttled is None:
            return "done"
        raise retry.Transient("HTTP 503 SlowDown" if throttled else "HTTP 500", throttled=throttled)

    policy = replace(retry.DEFAULT.scaled(0.01), base_s=0.02, cap_s=0.02)
    with retry.operation(policy) as op, retry.bounded(60, "pulling prod"):
        assert retry.retried("s3://b/k", attempt) == "done"
        counts = op.counts()
    assert (counts.throttled, counts.retries) == (5, 8)
    assert counts.paced_s > 0 and counts.backoff_s > 0 and counts.in_flight_s >= 0
    assert counts.waited_s == pytest.approx(counts.paced_s + counts.backoff_s, abs=0.002)
    # Only the three failures slept in backoff: each sleep at most cap_s.
    assert counts.backoff_s <= 3 * policy.cap_s + 0.05


def test_a_pacer_grows_faster_with_each_success_in_a_row() -> None:
    """Once 503s stop, each success grows the rate by more than the one before (quick probing
    back), up to headroom x what was measured being sent; a 503 starts the run over."""
    clock = Clock()
    pacer = Pacer(EVEN, clock)
    for _ in range(20):
        _send(pacer, clock, throttled=False)
        clock.now += 0.1
    for _ in range(6):
        _send(pacer, clock, throttled=True)
    rates = [pacer.rate]
    for _ in range(6):
        _send(pacer, clock, throttled=False)
        rates.append(pacer.rate)
    steps = [b / a for a, b in itertools.pairwise(rates)]
    assert all(later > earlier > 1 for earlier, later in itertools.pairwise(steps)), steps
    assert rates[-1] > 2.5 * rates[0]
    _send(pacer, clock, throttled=True)
    cut = pacer.rate
    _send(pacer, clock, throttled=False)
    assert pacer.rate / cut == pytest.approx(1 + EVEN.growth)  # the run starts over


def test_a_pacer_cut_far_down_climbs_back_while_it_waits() -> None:
    """Between answers the rate grows in time (probe): a host cut to its floor does not crawl at
    one request per 1 / floor seconds to the end of a storm; and never past headroom x measured."""
    policy = replace(retry.DEFAULT, jitter=0.0)
    clock = Clock()
    pacer = Pacer(policy, clock)
    for _ in range(40):
        _send(pacer, clock, throttled=False)
        clock.now += 0.5  # about 2 requests/s
    while pacer.rate > policy.min_rate:
        _send(pacer, clock, throttled=True)
    floor_gap = 1 / policy.min_rate
    waits = []
    for _ in range(5):
        ticket = pacer.join()
        waited = 0.0
        while (delay := pacer.take(ticket)) > 0:
            clock.now += min(delay, policy.window_s)
            waited += min(delay, policy.window_s)
        waits.append(waited)
        pacer.succeeded()
    assert waits[0] < floor_gap and all(b < a for a, b in itertools.pairwise(waits)), waits
    clock.now += 10_000  # a long silence, then an answer: the rate stops at headroom x what was measured
    pacer.succeeded()
    assert pacer.rate == pytest.approx(policy.headroom * pacer.measured())


def test_a_pacers_gaps_are_jittered() -> None:
    """Hosts cut by the same burst of 503s do not come back in step: gaps vary around 1 / rate."""
    clock = Clock()
    pacer = Pacer(replace(retry.DEFAULT, probe=0.0), clock, random.Random(39))
    for _ in range(10):
        _send(pacer, clock, throttled=False)
    pacer.throttled(clock.now)
    rate, gaps = pacer.rate, []
    for _ in range(40):
        started = clock.now
        _send(pacer, clock, throttled=False)
        gaps.append((clock.now - started) * rate)
        pacer.rate = rate  # keep the rate, to look at the gaps alone
    assert 0.5 - 0.01 <= min(gaps) < 0.7 and 1.3 < max(gaps) <= 1.5 + 0.01, (min(gaps), max(gaps))


@pytest.mark.parametrize(("hosts", "limit"), [(64, 6.5), (64, 13.0), (256, 25.6)])
def test_a_fleet_of_pacers_keeps_a_throttling_store_busy(hosts: int, limit: float) -> None:
    """The pacers of a fleet together use most of what a throttling store serves while it
    throttles, spending at most one 503 per request it serves, at fair shares of 0.1 and 0.2
    requests/s per host (a virtual clock: tests/fleetsim.py; bench/storm.py measures real pulls).
    With the floor at the fair share and a backoff on top (the old policy) this was 45 %."""
    fleet = Fleet(hosts, limit)
    outcome = simulate(fleet, retry.DEFAULT)
    assert len(outcome.ends) == hosts and outcome.forwarded == hosts * fleet.requests
    assert outcome.utilisation(limit) >= 0.8 and outcome.ratio <= 1.0, (outcome.utilisation(limit), outcome.ratio)


@pytest.mark.parametrize(("expected", "late"), [(200, True), (50, False)])
def test_a_pull_that_will_not_make_its_deadline_says_so_once_with_the_estimate(
    expected: int, late: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """At one request a second, 192 requests left need about 192 s: past a deadline 100 s away,
    said once, early (after a handful of answers), naming the estimate; 42 left fit, nothing said."""
    clock = Clock()
    forecast = Forecast("pulling prod", clock)
    deadline = retry.Deadline(100, "pulling prod")
    forecast.answered(deadline, ok=True)  # before the downloads are planned: not counted
    forecast.expect(expected)
    with caplog.at_level(logging.WARNING, logger="neffbuild.retry"):
        for _ in range(8):
            clock.now += 1.0
            forecast.answered(deadline, ok=True)
        for _ in range(4):
            clock.now += 1.0
            forecast.answered(deadline, ok=False)
    said = [r.getMessage() for r in caplog.records if "out of time" in r.getMessage()]
    if not late:
        assert said == [] and forecast.told is None
        return
    assert said == [forecast.told] and "the 196 requests left need about 19" in said[0], said
    assert "deadline in 100 s" in said[0] and "stay in the cache dir for the next try" in said[0]


@pytest.mark.parametrize(("expected", "late"), [(16, True), (4, False)])
def test_a_pull_throttled_too_often_for_a_rate_of_successes_still_says_so_before_its_deadline(
    expected: int, late: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A store answering 503 to most requests: one success among the first four answers, over 8 s,
    is too few successes for a rate; but even at one more success then (0.25 requests/s) the 15
    requests left need about 60 s, past a 20 s deadline: said, once. 3 left fit: nothing said."""
    clock = Clock()
    forecast = Forecast("pulling prod", clock)
    deadline = retry.Deadline(20, "pulling prod")
    forecast.expect(expected)
    with caplog.at_level(logging.WARNING, logger="neffbuild.retry"):
        for ok in (False, True, False, False, False, False):
            clock.now += 2.0
            forecast.answered(deadline, ok=ok)
    said = [r.getMessage() for r in caplog.records if "out of time" in r.getMessage()]
    if not late:
        assert said == [] and forecast.told is None
        return
    assert said == [forecast.told], said
    assert "the 15 requests left need about 60 s" in said[0] and "0.25 requests/s" in said[0], said[0]


def test_a_request_whose_turn_looks_past_the_deadline_still_goes_when_it_comes_sooner() -> None:
    """At the current rate a request's turn, behind 20 others, lies past the deadline; but those
    ahead leave (or the rate grows): it goes then. It does not sleep to the deadline holding up the
    queue behind it (each request waits its turn in order, so one asleep would stop them all)."""
    with retry.operation(retry.Policy(min_rate=5.0)) as op, retry.bounded(3.0, "pulling prod"):
        op.pacer.throttled(op.pacer.now())  # paced at its floor: a request every 0.2 s
        ahead = [op.pacer.join() for _ in range(20)]  # the turn after theirs: 4 s away, past the deadline
        went: list[float] = []
        task = retry.carried(lambda: (retry.paced("s3://b/k", retry.Tries()), went.append(time.monotonic())))
        thread = threading.Thread(target=task, daemon=True)
        thread.start()
        while len(op.pacer._waiting) < len(ahead) + 1:  # it has asked, and been told to wait
            time.sleep(0.01)
        time.sleep(0.2)
        left_at = time.monotonic()
        for ticket in ahead:  # they gave up (their operation stopped): it is next
            op.pacer.leave(ticket)
        thread.join(timeout=10)
    assert went and went[0] - left_at < 1.0, (went, left_at)


def test_a_stopped_operation_wakes_its_waits_and_raises_abandoned() -> None:
    from neffbuild.errors import Abandoned

    def throttled() -> None:
        raise retry.Transient("HTTP 503 SlowDown", throttled=True)

    errors: list[BaseException] = []
    with retry.operation(retry.Policy(base_s=30, cap_s=30)) as op, retry.bounded(600, "pulling prod"):
        task = retry.carried(lambda: retry.retried("s3://b/k", throttled))

        def run() -> None:
            try:
                task()
            except BaseException as exc:  # noqa: BLE001 - what the thread ended with is the point
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        while not op.counts().throttled:  # in its first backoff (up to 30 s)
            time.sleep(0.01)
        op.stop()
        thread.join(timeout=10)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], Abandoned), errors


@pytest.mark.parametrize(
    ("status", "code", "throttled"), [(503, b"SlowDown", True), (429, b"", True), (500, b"InternalError", False)]
)
def test_throttling_is_told_apart_from_failing(status: int, code: bytes, throttled: bool) -> None:
    answer = http_error("s3://b/p", "blobs/ab/cd", status, b"<Error><Code>" + code + b"</Code></Error>", None)
    assert isinstance(answer, retry.Transient) and answer.throttled is throttled


def test_the_deadline_bounds_retries_and_socket_timeouts() -> None:
    assert retry.timeouts() == (retry.CONNECT_S, retry.READ_S)
    started = time.monotonic()
    with retry.bounded(0.5, "pulling prod") as deadline:
        assert deadline is not None and retry.current() is deadline
        connect, read = retry.timeouts()
        assert 0 < connect <= 0.5 and 0 < read <= 0.5
        retry.doing("fetching 3 of 4 files")
        with pytest.raises(DeadlineExceeded) as err:
            retry.retried("s3://b/p", lambda: (_ for _ in ()).throw(retry.Transient("HTTP 503 SlowDown")))
    assert time.monotonic() - started < 1.5
    assert err.value.exit_code == 3
    assert err.value.message == "s3://b/p: pulling prod went past its 0.5 s deadline while fetching 3 of 4 files"
    assert retry.current() is None


def test_the_deadline_cuts_a_read_blocked_in_flight() -> None:
    """A socket read waiting on a peer that sends nothing returns when the deadline passes."""
    ours, peer = socket.socketpair()
    got: list[bytes] = []
    with ours, peer, retry.bounded(0.3, "pulling prod") as deadline:
        assert deadline is not None
        deadline.watch(1, lambda: ours.shutdown(socket.SHUT_RDWR))
        reader = threading.Thread(target=lambda: got.append(ours.recv(10)))  # no timeout on the socket
        started = time.monotonic()
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive() and got == [b""] and time.monotonic() - started < 1.5


def test_pool_threads_carry_the_deadline() -> None:
    from neffbuild.store.s3.dataplane import run_all

    with retry.bounded(5, "pulling prod") as deadline:
        seen = run_all([retry.current, retry.current], jobs=2)
    assert seen == [deadline, deadline]


# ---- against the real S3 server ------------------------------------------------------------------


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _published(s3_url: str, env: dict[str, str], root: Path, sizes: dict[str, int]) -> tuple[str, dict[str, bytes]]:
    store = open_store(s3_url, create=True, env=env)
    sources = write_files(root, sizes)
    release_id = publish_release_of(store, root, sources, name="prod", tag="prod")
    return release_id, {rel: (root / rel).read_bytes() for rel in sizes}


def _assert_cache_holds(cache: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert (cache / rel).read_bytes() == data, rel


@pytest.mark.s3
def test_a_throttling_store_is_backed_off_and_the_pull_succeeds(s3_url, s3_env, s3_server, tmp_path: Path, cli) -> None:
    _, files = _published(
        s3_url, s3_env, tmp_path / "src", {f"f{i}.bin": 3000 + i for i in range(6)} | {"big.bin": 9 << 20}
    )
    with TcpProxy(
        _port(s3_server.endpoint), mode="slowdown", paths=("/",), slowdowns=retry.DEFAULT.attempts - 1
    ) as proxy:
        # The policy's timings a tenth of a real pull's (its shape unchanged): at full scale, five 503s
        # in a row pace a pull down to a request every ~9 s, a minute of waiting that a busy machine
        # stretched past the deadline.
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint, SCALE_ENV: "0.1"}
        done = cli(
            "pull",
            "prod",
            "--store",
            s3_url,
            "--cache-dir",
            str(tmp_path / "cache"),
            "--json",
            "--timeout",
            "60",
            env=env,
        )
    assert done.returncode == 0, done.stderr
    assert len(proxy.slowed) == retry.DEFAULT.attempts - 1  # every 503 was answered and retried past
    report = json.loads(done.stdout)
    assert report["files_fetched"] == len(files)
    _assert_cache_holds(tmp_path / "cache", files)
    # What the store put it through is counted, and said in one line on stderr.
    throttles = retry.DEFAULT.attempts - 1
    assert (
        (report["throttled"], report["retries"]) == (throttles, throttles)
        and report["waited_s"] > 0
        and report["paced_to"] > 0
    )
    (note,) = [line for line in done.stderr.splitlines() if "throttled" in line]
    assert note.startswith(
        f"note: the store throttled this pull: {throttles} answers 503 SlowDown or 429, {throttles} retries, "
    )
    # A human run says it in the same one line, beside its usual summary; stdout keeps only the exports.
    with TcpProxy(_port(s3_server.endpoint), mode="slowdown", paths=("/",), slowdowns=2) as proxy:
        human = cli(
            "pull", "prod", "--store", s3_url, "--cache-dir", str(tmp_path / "human"), "--timeout", "60",
            env={**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint, SCALE_ENV: "0.1"},
        )  # fmt: skip
    assert human.returncode == 0, human.stderr
    (note,) = [line for line in human.stderr.splitlines() if "throttled" in line]
    assert note.startswith("note: the store throttled this pull: 2 answers 503 SlowDown or 429, 2 retries, ")
    assert "throttled" not in human.stdout
    quiet = cli("pull", "prod", "--store", s3_url, "--cache-dir", str(tmp_path / "again"), "--json", env=s3_env)
    again = json.loads(quiet.stdout)
    assert (again["throttled"], again["retries"], again["waited_s"], again["paced_to"]) == (0, 0, 0.0, None)
    assert "throttled" not in quiet.stderr


@pytest.mark.s3
def test_throttling_that_outlasts_the_tries_of_a_failure_is_still_backed_off(
    s3_url, s3_env, s3_server, tmp_path: Path
) -> None:  # fmt: skip
    _, files = _published(s3_url, s3_env, tmp_path / "src", {f"f{i}.bin": 3000 + i for i in range(6)})
    slowdowns = retry.DEFAULT.attempts + 4  # more 503s in a row than a failing store gets tries
    with TcpProxy(_port(s3_server.endpoint), mode="slowdown", paths=("/",), slowdowns=slowdowns) as proxy:
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        report = ensure_cache(
            "prod",
            store=s3_url,
            cache_dir=tmp_path / "cache",
            env=env,
            host_check=False,
            timeout=60,
            policy=retry.DEFAULT.scaled(0.05),
        )
    assert len(proxy.slowed) == slowdowns and report.files_fetched == len(files)
    assert report.throttled == slowdowns and report.retries == slowdowns and report.waited_s > 0
    _assert_cache_holds(tmp_path / "cache", files)


@pytest.mark.s3
def test_a_pull_that_will_not_make_its_deadline_says_so_before_it_and_keeps_what_it_fetched(
    s3_url, s3_env, s3_server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the pull reaches the release's packs, the store serves 0.5 request/s: about 16 ranged
    GETs, over 30 s of them, with a 20 s deadline. The pull says, once and before its deadline,
    that it will not make it; it fails at the deadline; what it fetched stays, and the next pull
    fetches only the rest."""
    sizes = {f"f{i:03d}.bin": 300_000 + i for i in range(120)}  # packed: about 16 ranges
    _, files = _published(s3_url, s3_env, tmp_path / "src", sizes)
    cache = tmp_path / "cache"
    failed: list[BaseException] = []

    def pull() -> None:
        try:
            ensure_cache("prod", store=s3_url, cache_dir=cache, env=env, host_check=False, timeout=20)
        except DeadlineExceeded as e:
            failed.append(e)

    with TcpProxy(_port(s3_server.endpoint), mode="limit", limit=None) as proxy:
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        with caplog.at_level(logging.WARNING, logger="neffbuild.retry"):
            thread = threading.Thread(target=retry.carried(pull))
            thread.start()
            while thread.is_alive() and not any("/packs/" in path for _, path, _ in list(proxy.seen)):
                time.sleep(0.01)
            proxy.limit = 0.5
            thread.join(timeout=60)
    said = [r for r in caplog.records if "will likely run out of time" in r.getMessage()]
    assert len(failed) == 1 and len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "requests left need about" in said[0].getMessage() and "past the deadline in " in said[0].getMessage()
    landed = [rel for rel in sizes if (cache / rel).exists()]
    assert landed and len(landed) < len(sizes)
    report = ensure_cache("prod", store=s3_url, cache_dir=cache, env=s3_env, host_check=False, timeout=60)
    assert report.files_fetched == len(sizes) - len(landed)  # only what was missing
    _assert_cache_holds(cache, files)


@pytest.mark.s3
def test_a_fatal_error_stops_the_pulls_other_requests_and_keeps_what_landed(
    s3_url, s3_env, s3_server, tmp_path: Path
) -> None:
    """One file's blob is gone (404: fatal) while the store throttles the others, whose backoff
    would last minutes (and, under a deadline, goes on until it): the pull fails on the 404
    without waiting for them, and the files already landed stay."""
    large = {f"large{i}.bin": PART + i for i in range(4)}  # loose blobs, one streamed GET each
    small = {f"small{i}.bin": 2000 + i for i in range(5)}  # one pack
    _, files = _published(s3_url, s3_env, tmp_path / "src", large | small)
    store = open_store(s3_url, env=s3_env)
    digests = {f.path: f.digest for f in resolve(store, "prod").release.files}
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    client_for(s3_server).delete_object(Bucket=bucket, Key=f"{prefix}/{blob_key(digests['large0.bin'])}")
    throttled = [blob_key(digests[rel]) for rel in large if rel != "large0.bin"]
    with TcpProxy(
        _port(s3_server.endpoint), mode="slowdown", paths=throttled, methods=("GET",), slowdowns=1_000_000
    ) as proxy:
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        slow = retry.DEFAULT.scaled(100)  # a throttled request would back off for up to 10 s, then 20, 40...
        with pytest.raises(NotFoundError) as err:
            ensure_cache(
                "prod", store=s3_url, cache_dir=tmp_path / "cache", env=env, host_check=False, timeout=600, policy=slow
            )
    assert "large0.bin" in err.value.message
    sent = [(m, p) for m, p, _ in proxy.seen]
    # A throttled request may have come back once before the 404 (its first backoff is drawn from
    # [0, 10 s]); after it, none is tried again: each was woken from its wait and given up. (On a
    # loaded machine the 404 can come before any throttled GET was sent: then none is sent at all.)
    assert all(sent.count(request) <= 2 for request in proxy.slowed), sent
    assert all(sent.count(("GET", p)) <= 2 for p in {p for _, p in sent if any(t in p for t in throttled)}), sent
    # What landed before the failure is kept, whole; nothing else is there (no temp file, no large file).
    landed = {p.name for p in (tmp_path / "cache").iterdir() if p.is_file()}
    assert landed <= small.keys()
    _assert_cache_holds(tmp_path / "cache", {rel: files[rel] for rel in landed})


@pytest.mark.s3
def test_a_fatal_error_cuts_the_pulls_reads_in_flight_within_a_second(
    s3_url, s3_env, s3_server, tmp_path: Path
) -> None:
    """Fail fast for requests reading a body (issue 26, scope 3): two large files' ranged GETs
    stall after their heads (each read would wait READ_S, and the deadline is 600 s) while the
    third's blob is gone (404): the pull fails within a second of the 404, its stalled reads cut."""
    large = {f"large{i}.bin": ranged.RANGED_MIN + i for i in range(3)}  # fewer than --jobs: fetched as ranges
    _published(s3_url, s3_env, tmp_path / "src", large)
    digests = {f.path: f.digest for f in resolve(open_store(s3_url, env=s3_env), "prod").release.files}
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    gone = blob_key(digests["large0.bin"])
    client_for(s3_server).delete_object(Bucket=bucket, Key=f"{prefix}/{gone}")
    stalled = [blob_key(digests[rel]) for rel in large if rel != "large0.bin"]
    with TcpProxy(_port(s3_server.endpoint), mode="stall", paths=stalled) as proxy:
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        with pytest.raises(NotFoundError) as err:
            ensure_cache("prod", store=s3_url, cache_dir=tmp_path / "cache", env=env, host_check=False, timeout=600)
        failed_at = time.monotonic()
        asked = list(zip(proxy.seen, proxy.seen_at, strict=True))
    assert "large0.bin" in err.value.message
    the_404 = max(at for (method, path, _), at in asked if method == "GET" and gone in path)
    reading = [at for (method, path, _), at in asked if method == "GET" and any(s in path for s in stalled)]
    # A stalled read never ends by itself: any that was sent, before the 404 or just after, had to be cut.
    assert reading, asked
    assert failed_at - the_404 < 1.0, failed_at - the_404
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and ".neffbuild" not in p.parts]


@pytest.mark.s3
def test_throttled_writes_are_retried_too(s3_url, s3_env, s3_server, tmp_path: Path) -> None:
    sources = write_files(tmp_path / "src", {"a.bin": 9 << 20, "b.bin": 5000})
    open_store(s3_url, create=True, env=s3_env)
    with TcpProxy(
        _port(s3_server.endpoint), mode="slowdown", paths=("/blobs/", "/packs/"), methods=("PUT",), slowdowns=3
    ) as proxy:
        store = open_store(s3_url, env={**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint})
        store.put_blobs(sources, jobs=2)
    assert len(proxy.slowed) == 3
    puts = [path for method, path, _ in proxy.seen if method == "PUT" and ("/blobs/" in path or "/packs/" in path)]
    for method, path in proxy.slowed:  # each request throttled was sent again
        assert [(m, p) for m, p, _ in proxy.seen].count((method, path)) >= 2, (method, path)
    assert len(set(puts)) == 3  # the big blob, the pack and its index
    assert open_store(s3_url, env=s3_env).missing_blobs({s.digest for s in sources}) == set()


@pytest.mark.s3
def test_missing_and_denied_objects_are_not_retried(s3_url, s3_env, s3_server, tmp_path: Path) -> None:
    open_store(s3_url, create=True, env=s3_env)
    with TcpProxy(_port(s3_server.endpoint)) as proxy:
        store = open_store(s3_url, env={**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint})
        digest = "0" * 32
        with pytest.raises(NotFoundError):
            store.download_blobs([BlobTarget(digest, PART + 1, tmp_path / "x")], jobs=1)
        gets = [
            (path, h.get("range")) for method, path, h in proxy.seen if method == "GET" and blob_key(digest) in path
        ]
        assert gets and len(set(gets)) == len(gets), gets  # a 404 is an answer, not a failure: each range asked once
        proxy.seen.clear()
        with pytest.raises(StoreError) as err:
            open_store(s3_url, env={**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_SECRET_ACCESS_KEY": "wrong"})
        assert "access denied" in err.value.message and len(proxy.seen) == 1  # a 403 neither


@pytest.mark.s3
@pytest.mark.parametrize("mode", ["trickle", "stall"])
def test_a_trickling_or_stalled_body_ends_at_the_deadline(mode: str, s3_url, s3_env, s3_server, tmp_path: Path) -> None:
    _published(s3_url, s3_env, tmp_path / "src", {"big.bin": 9 << 20, "small.bin": 4000})
    with TcpProxy(_port(s3_server.endpoint), mode=mode, paths=("/blobs/", "/packs/"), trickle=(1, 0.5)) as proxy:
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as err:
            ensure_cache("prod", store=s3_url, cache_dir=tmp_path / "cache", timeout=4, env=env, host_check=False)
        took = time.monotonic() - started
    assert took <= 4 + 2, took
    message = err.value.message
    assert (
        err.value.exit_code == 3
        and message.startswith(f"{s3_url}")
        and "4 s deadline while fetching 2 of 2 files" in message
    )
    assert not [
        p for p in (tmp_path / "cache").rglob("*") if p.is_file() and ".neffbuild" not in p.parts
    ]  # nothing half-landed


@pytest.mark.s3
def test_allow_stale_boots_the_installed_release_when_the_store_stalls(
    s3_url, s3_env, s3_server, tmp_path: Path, cli
) -> None:
    release_id, _ = _published(s3_url, s3_env, tmp_path / "src", {"a.bin": 4000})
    cache = tmp_path / "cache"
    assert cli("pull", "prod", "--store", s3_url, "--cache-dir", str(cache), env=s3_env).returncode == 0
    with TcpProxy(_port(s3_server.endpoint), mode="stall", paths=("/",)) as proxy:
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        refused = cli("pull", "prod", "--store", s3_url, "--cache-dir", str(cache), "--timeout", "2", "--json", env=env)
        stale = cli(
            "pull",
            "prod",
            "--store",
            s3_url,
            "--cache-dir",
            str(cache),
            "--timeout",
            "2",
            "--json",
            "--allow-stale",
            env=env,
        )
    assert refused.returncode == 3 and json.loads(refused.stdout)["kind"] == "DeadlineExceeded", refused.stderr
    assert stale.returncode == 0, stale.stderr
    report = json.loads(stale.stdout)
    assert report["stale"] is True and report["release_id"] == release_id and "deadline" in report["stale_reason"]


@pytest.mark.s3
@pytest.mark.parametrize("large", [1, 4], ids=["ranges", "streamed"])
def test_a_cut_large_download_resumes_from_the_bytes_received(
    large: int, s3_url, s3_env, s3_server, tmp_path: Path
) -> None:
    # Every GET (a blob's last range included) answers more than the 64 KiB the proxy lets through,
    # so the one it cuts is cut whichever of the concurrent GETs it is.
    sizes = {f"big{i}.bin": ranged.RANGED_MIN + (128 << 10) + i for i in range(large)}
    store = open_store(s3_url, create=True, env=s3_env)
    sources = write_files(tmp_path / "src", sizes)
    store.put_blobs(sources, jobs=4)
    with TcpProxy(_port(s3_server.endpoint), mode="cut-gets", paths=("/blobs/",), cuts=1) as proxy:
        via_proxy = open_store(s3_url, env={**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint})
        targets = [BlobTarget(s.digest, s.size, tmp_path / "cache" / s.path.name) for s in sources]
        via_proxy.download_blobs(targets, jobs=4)
    assert proxy.cuts == 0
    for s, t in zip(sources, targets, strict=True):
        assert t.dest.read_bytes() == s.path.read_bytes(), t.dest
    starts = [
        int(h["range"].removeprefix("bytes=").split("-")[0])
        for m, p, h in proxy.seen
        if m == "GET" and "/blobs/" in p and "range" in h
    ]
    # The proxy cut the body after 64 KiB of response (head included): the retry asks for the rest.
    part = ranged.plan([s.size for s in sources], 4).part
    resumed = [s % part for s in starts if s % part]
    assert len(resumed) == 1 and 64 * 1024 - 2048 < resumed[0] < 64 * 1024, starts
    gets = [p for m, p, _ in proxy.seen if m == "GET" and "/blobs/" in p]
    per_blob = large if large > 1 else -(-sizes["big0.bin"] // part)  # one GET per blob, or one per range
    assert len(gets) == per_blob + 1  # and the resumed one


# ---- a server killed mid-pull -------------------------------------------------------------------


@pytest.mark.s3
def test_a_server_killed_mid_pull_fails_within_the_deadline_and_the_next_pull_fetches_the_rest(
    tmp_path: Path, cli
) -> None:
    server = S3Server(tmp_path / "weed")
    settings = server.start()
    try:
        client_for(settings).create_bucket(Bucket="killed")
        url = "s3://killed/store"
        sizes = {f"f{i:02d}.bin": (9 << 20) + i for i in range(8)}
        _, files = _published(url, settings.env(), tmp_path / "src", sizes)
        cache = tmp_path / "cache"
        timeout = 30
        # Slowed to about 2.5 MB/s, the 72 MiB take ~30 s: the kill lands mid-pull.
        with TcpProxy(_port(settings.endpoint), mode="trickle", paths=("/blobs/",), trickle=(256 << 10, 0.1)) as proxy:
            env = {**os.environ, **settings.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
            started = time.monotonic()
            pulling = subprocess.Popen(
                [sys.executable, "-m", "neffbuild", "pull", "prod", "--store", url, "--cache-dir", str(cache), "--timeout", str(timeout), "--jobs", "2"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            while not [rel for rel in sizes if (cache / rel).exists()] and time.monotonic() - started < timeout:
                time.sleep(0.05)
            assert server.proc is not None
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
            killed_at = time.monotonic()
            _, stderr = pulling.communicate(timeout=timeout + 10)
            took = time.monotonic() - started
        assert pulling.returncode == 3, stderr
        assert took <= timeout + 2 and url in stderr and "pulling prod: fetching 8 of 8 files" in stderr, (took, stderr)
        landed = [rel for rel in sizes if (cache / rel).exists()]
        assert 1 <= len(landed) < len(sizes), landed
        print(
            f"killed after {killed_at - started:.1f} s; pull exited 3 {time.monotonic() - killed_at:.1f} s later: {stderr.strip()}"
        )

        settings = server.start()  # the same data dir
        done = cli("pull", "prod", "--store", url, "--cache-dir", str(cache), "--json", env=settings.env())
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["files_fetched"] == len(sizes) - len(landed)  # only what was missing
        assert report["bytes_fetched"] == sum(sizes[rel] for rel in sizes if rel not in landed)
        _assert_cache_holds(cache, files)
    finally:
        server.stop()


def test_a_retried_call_inside_a_retried_attempt_is_refused() -> None:
    """One request retried at two levels would take two turns of the pacer and count as two
    answers (a pull's forecast then thought itself done halfway, and a throttled store was sent
    half its rate): the inner call must be the request's one try."""
    with retry.operation(retry.Policy()), pytest.raises(RuntimeError, match="retried inside a retried"):
        retry.retried("s3://b/outer", lambda: retry.retried("s3://b/inner", lambda: 1))
    assert retry.retried("s3://b/after", lambda: 2) == 2  # the flag does not outlive the call
