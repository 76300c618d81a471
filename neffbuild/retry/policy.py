"""The retry policy's settings and vocabulary: how often and how long requests are retried and
paced (Policy), what is worth another try (Transient), the backoff drawn between tries, the usual
socket timeouts and the hints of a deadline's error."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

CONNECT_S = 10.0  # a connection not made in this long is Transient
READ_S = 120.0  # a socket read waiting this long is Transient
DEADLINE_HINT = "the store is slow or unreachable; raise --timeout, or boot the installed release with --allow-stale"
THROTTLED_HINT = (
    "the store kept throttling this host (503 SlowDown / 429): stagger the fleet's boots, raise --timeout, "
    "or boot the installed release with --allow-stale"
)
SCALE_ENV = "NEFFBUILD_RETRY_SCALE"  # read by the CLI only (see Policy.scaled)


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
        )  # fmt: skip  # arguments packed by meaning, not one a line


DEFAULT = Policy()


class Transient(Exception):
    """A connection or server failure worth another try; `received`: body bytes that made it;
    `throttled`: the store answered, asking us to slow down (503 SlowDown, 429)."""

    def __init__(
        self, message: str, hint: str = "the endpoint keeps failing; retry later", *, received: int = 0, throttled: bool = False
    ) -> None:  # fmt: skip  # parameters packed by meaning, not one a line
        super().__init__(message)
        self.hint = hint
        self.received = received
        self.throttled = throttled


def backoff(tries: int, *, base: float = DEFAULT.base_s, cap: float = DEFAULT.cap_s) -> float:
    """Seconds to wait after `tries` failed tries: full jitter, uniform in [0, min(cap, base * 2**tries)]."""
    import random  # on a first retry only: not on every command's start-up

    return random.uniform(0.0, min(cap, base * 2 ** min(tries, 32)))
