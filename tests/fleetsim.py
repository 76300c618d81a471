"""A fleet of pacers (neffbuild/retry/pacer.py's Pacer, the real class) against a store that serves
`limit` requests a second (a token bucket holding one second's worth, as tests/tcpproxy.py's
"limit" mode), simulated on a virtual clock: each host has `requests` to send, the first
`sequential` one after another (a pull's marker, tag, release, bundle, locator and pack index),
the rest `parallel` at a time (its download threads); hosts start within `spread` seconds of each
other (processes starting together on a busy machine), and each answer comes `latency` seconds
after its request. Each try of a request takes one turn of its host's pacer, as
retry.retried does (a 503 asks again at once: the cut pacer spaces it). What the pacer's constants do to a
fleet, in seconds of CPU instead of minutes of storm (bench/storm.py measures the real one).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from neffbuild import retry
from neffbuild.retry.pacer import Pacer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Fleet:
    hosts: int
    limit: float  # requests/s the store serves
    requests: int = 29  # per host (bench/storm.py's release: 6 one after another, then 23 ranges and blobs)
    parallel: int = 16  # a pull's download threads
    latency: float = 0.02
    sequential: int = 6
    spread: float = 0.05


@dataclass(frozen=True)
class Outcome:
    ends: list[float]  # each host's last answer, seconds from the start (all hosts finish)
    forwarded: int
    slowed: int

    def utilisation(self, limit: float) -> float:
        """Requests served / what the store could serve until the last host was done."""
        return self.forwarded / (limit * max(self.ends))

    @property
    def ratio(self) -> float:
        return self.slowed / max(self.forwarded, 1)


def simulate(fleet: Fleet, policy: retry.Policy, seed: int = 1) -> Outcome:
    clock, rng = Clock(), random.Random(seed)
    pacers = [Pacer(policy, clock, random.Random(rng.random())) for _ in range(fleet.hosts)]
    to_send = [fleet.requests] * fleet.hosts
    to_answer = [fleet.requests] * fleet.hosts
    ends = [0.0] * fleet.hosts
    tokens, filled, forwarded, slowed = fleet.limit, 0.0, 0, 0
    events: list[tuple[float, int, int, str, float]] = []  # (time, order, host, what, ticket or sent at)
    order = 0

    def push(at: float, host: int, what: str, value: float) -> None:
        nonlocal order
        heapq.heappush(events, (at, order, host, what, value))
        order += 1

    def starts(done: int) -> int:
        """Requests to start once a host has `done` answered: the next sequential one, or all its
        threads once the last of those is in, then one per answer (each frees a thread)."""
        return fleet.parallel if done == fleet.sequential else 1

    for host in range(fleet.hosts):
        at = rng.random() * fleet.spread
        for _ in range(min(starts(0), fleet.requests)):
            to_send[host] -= 1
            push(at, host, "ask", pacers[host].join())
    while events:
        clock.now, _, host, what, value = heapq.heappop(events)
        pacer = pacers[host]
        if what == "ask":
            delay = pacer.take(int(value))
            if delay > 0:  # looks again every window, as retry.paced does
                push(clock.now + min(delay, policy.window_s), host, "ask", value)
                continue
            tokens = min(fleet.limit, tokens + (clock.now - filled) * fleet.limit)
            filled = clock.now
            served = tokens >= 1
            tokens -= served
            forwarded += served
            slowed += not served
            push(clock.now + fleet.latency, host, "ok" if served else "503", clock.now)
        elif what == "503":
            pacer.throttled(value)
            push(clock.now, host, "ask", pacer.join())  # retried at once: the pacer spaces it
        else:
            pacer.succeeded()
            to_answer[host] -= 1
            ends[host] = clock.now
            for _ in range(min(starts(fleet.requests - to_answer[host]), to_send[host])):
                to_send[host] -= 1
                push(clock.now, host, "ask", pacer.join())
    return Outcome(ends, forwarded, slowed)
