"""Boot storms (issue 26): a fleet of real `neffbuild pull` processes booting at once against one
store that serves a fixed number of requests a second and answers the rest 503 SlowDown (a
TcpProxy in "limit" mode in front of the real S3 test server).

The policy's timings are scaled down (NEFFBUILD_RETRY_SCALE, read by the CLI) so a storm of
minutes runs in seconds; its shape (backoff, the pacer's curve) is the same. How fast the fleet
comes up is measured by bench/storm.py, not asserted here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from neffbuild import retry
from neffbuild.retry.policy import SCALE_ENV, THROTTLED_HINT
from neffbuild.store import open_store
from tests.stormkit import holds, partial_files, publish_fleet_release, storm
from tests.tcpproxy import TcpProxy

SCALE = 0.1  # every backoff and pacing time x 0.1, every rate x 10
HOSTS = 8
PER_PULL = 12  # requests one pull of the release below makes (marker, tag, release, bundle, locator, index, ranges)


def _old_budget(scale: float) -> float:
    """Mean seconds of backoff the old policy gave a throttled request before giving up: 16 tries,
    full jitter (a mean of half the bound each)."""
    policy = retry.DEFAULT.scaled(scale)
    return sum(min(policy.cap_s, policy.base_s * 2**t) / 2 for t in range(policy.throttled_attempts - 1))


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


@pytest.fixture
def fleet(s3_url, s3_env, tmp_path: Path) -> dict[str, bytes]:
    return publish_fleet_release(open_store(s3_url, create=True, env=s3_env), tmp_path / "src", small=60, large=0)


@pytest.mark.s3
def test_a_fleet_throttled_longer_than_the_old_try_budget_comes_up_whole(
    fleet, s3_url, s3_env, s3_server, tmp_path: Path
) -> None:
    limit = 5.0  # requests/s the store serves: the fleet's requests take about HOSTS * PER_PULL / limit = 19 s
    assert HOSTS * PER_PULL / limit > 3 * _old_budget(
        SCALE
    )  # the storm outlasts what one request used to get, three times
    caches = [tmp_path / f"host{i}" for i in range(HOSTS)]
    with TcpProxy(_port(s3_server.endpoint), mode="limit", limit=limit) as proxy:
        done = storm(proxy, s3_url, {**s3_env, SCALE_ENV: str(SCALE)}, caches, timeout=600)
    assert [p.code for p in done.pulls] == [0] * HOSTS, [p.stderr[-500:] for p in done.pulls if p.code]
    assert all(holds(c, fleet) for c in caches)
    assert done.forwarded >= HOSTS * PER_PULL and done.slowed > 0  # the store did throttle
    reports = [p.report for p in done.pulls]
    assert all(r["files_fetched"] == len(fleet) for r in reports)
    # What each pull went through is in its report, and it said so in one line on stderr.
    assert sum(r["throttled"] for r in reports) == done.slowed
    for pull in done.pulls:
        if pull.report["throttled"]:
            assert pull.report["retries"] >= pull.report["throttled"] and pull.report["waited_s"] > 0
            assert [
                line for line in pull.stderr.splitlines() if line.startswith("note: the store throttled this pull: ")
            ]
    print(
        f"{HOSTS} pulls, {done.forwarded} requests forwarded, {done.slowed} 503s ({done.ratio:.2f} per forwarded), {done.seconds:.1f} s"
    )


@pytest.mark.s3
def test_a_storm_past_the_deadline_fails_every_pull_naming_it_and_a_rerun_completes(
    fleet, s3_url, s3_env, s3_server, tmp_path: Path
) -> None:
    caches = [tmp_path / f"host{i}" for i in range(HOSTS)]
    env = {**s3_env, SCALE_ENV: str(SCALE)}
    # 1 request/s: the fleet's requests would take over a minute; the deadline is 4 s.
    with TcpProxy(_port(s3_server.endpoint), mode="limit", limit=1.0) as proxy:
        failed = storm(proxy, s3_url, env, caches, timeout=4)
        assert [p.code for p in failed.pulls] == [3] * HOSTS, [p.stderr[-500:] for p in failed.pulls]
        for pull in failed.pulls:
            assert pull.report["kind"] == "DeadlineExceeded" and "went past its 4 s deadline" in pull.report["error"]
            assert "the store throttled it: " in pull.report["error"] and pull.report["hint"] == THROTTLED_HINT
        assert not [
            partial_files(c, fleet) for c in caches if c.exists() and partial_files(c, fleet)
        ]  # nothing half-written
        landed = [sum((c / rel).is_file() for rel in fleet) for c in caches]
        proxy.limit = None  # the storm is over
        again = storm(proxy, s3_url, env, caches, timeout=600)
    assert [p.code for p in again.pulls] == [0] * HOSTS, [p.stderr[-500:] for p in again.pulls if p.code]
    assert all(holds(c, fleet) for c in caches)
    assert [p.report["files_fetched"] for p in again.pulls] == [len(fleet) - n for n in landed]  # only what was missing
