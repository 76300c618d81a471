"""Pulls killed and raced for real against the real S3 server (issue 12's acceptance).

kill -9 of `neffbuild pull` processes at points spread over a whole pull: what each leaves is
checked file by file against both releases (tests/killkit.py says what must hold), then a rerun
must complete and a full verify find nothing to repair. Eight pulls of one tag started together
into one cache dir: all succeed, and a proxy in front of the server counts what they fetched:
each blob once (the lock), plus the documents each pull reads.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from neffbuild.names import STATE_DIR
from neffbuild.pull import pull
from neffbuild.store import open_store
from tests.killkit import HEAD_MAX, Scenario, Traffic, concurrent_pulls, fresh_cache, kill_delays, make_scenario, phases
from tests.s3server import S3Settings
from tests.tcpproxy import TcpProxy

pytestmark = pytest.mark.s3

POINTS = 20
PULLS = 8


@pytest.fixture(scope="module")
def scenario(s3_server: S3Settings, s3_bucket: str, tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    env = {**os.environ, **s3_server.env()}
    store = open_store(f"s3://{s3_bucket}/kill", create=True, env=env)
    return make_scenario(store, env, tmp_path_factory.mktemp("kill"), small=1000, large=2)


def test_a_pull_killed_anywhere_leaves_only_whole_files_and_a_rerun_completes(scenario: Scenario, tmp_path: Path) -> None:
    duration = scenario.pull_seconds(tmp_path / "measured")
    results = [
        scenario.point(tmp_path / f"cache-{i}", delay, from_old=i % 2 == 1)  # every other one upgrades the old release
        for i, delay in enumerate(kill_delays(duration, POINTS, seed=12))
    ]
    print(f"pull {duration:.2f} s; {POINTS} kills: {phases(results, len(scenario.new))}")
    assert sum(code == -9 for code, _ in results) >= POINTS // 2, results  # most died mid-pull, not after it


def test_eight_pulls_racing_into_one_cache_dir_fetch_each_blob_once(scenario: Scenario, s3_server: S3Settings, tmp_path: Path) -> None:
    release_size = sum(f.size for f in scenario.new.values())
    with TcpProxy(int(s3_server.endpoint.rsplit(":", 1)[1])) as proxy:
        env = {**scenario.env, "AWS_ENDPOINT_URL": proxy.endpoint}
        reports = concurrent_pulls(scenario.command(tmp_path / "cache", "--json"), env, PULLS)
        assert proxy.settled()
        traffic = Traffic.of(proxy.exchanges)
    print(f"{PULLS} pulls of {release_size:,} bytes fetched {traffic.total:,} bytes in {traffic.requests} requests: {traffic}")
    assert sum(r["files_fetched"] for r in reports) == len(scenario.new)  # each file landed once
    assert release_size <= traffic.data_bytes <= release_size + HEAD_MAX * traffic.data_requests  # each blob fetched once
    assert traffic.other_bytes <= PULLS * 256 << 10  # documents only: a quarter MiB a pull at most (below: one pull's)
    report = pull(scenario.store, scenario.ref, tmp_path / "cache", verify="full")
    assert report.files_fetched == 0 and report.files_rehashed == len(scenario.new)


# ---- no name but the release's ever appears in the server's tree --------------------------------


def created_names(dirs: list[Path], during: Callable[[], object]) -> list[str]:
    """Every name created or moved into dirs while during() runs, as inotify(7) reports them: the
    kernel's own account, so no name, however briefly it existed, goes unseen."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    try:
        watched = {libc.inotify_add_watch(fd, str(d).encode(), _IN_CREATE | _IN_MOVED_TO): d for d in dirs}
        assert all(wd >= 0 for wd in watched)
        during()
        names, data = [], b""
        while True:
            try:
                data += os.read(fd, 1 << 20)
            except BlockingIOError:
                break
        while data:
            wd, mask, _, size = struct.unpack_from("iIII", data)
            assert not mask & _IN_Q_OVERFLOW, "inotify queue overflowed: events lost"
            names.append((watched[wd] / data[16 : 16 + size].rstrip(b"\0").decode()).as_posix())
            data = data[16 + size :]
        return names
    finally:
        os.close(fd)


_IN_MOVED_TO, _IN_CREATE, _IN_Q_OVERFLOW = 0x80, 0x100, 0x4000


def test_replacing_files_names_nothing_but_them_in_the_servers_tree(scenario: Scenario, tmp_path: Path) -> None:
    """A file of the old release at a path is replaced by the new one's without a temp name
    beside it, even for an instant: a kill there would leave that name visible to the server."""
    cache = tmp_path / "cache"
    fresh_cache(cache, scenario.template)
    dirs = [cache, *(p for p in cache.rglob("*") if p.is_dir() and STATE_DIR not in p.relative_to(cache).parts)]
    names = created_names(dirs, lambda: pull(scenario.store, scenario.ref, cache))
    replaced = [rel for rel in scenario.new if rel in scenario.old]
    assert replaced and {(cache / rel).as_posix() for rel in replaced} <= set(names)
    assert [n for n in names if Path(n).relative_to(cache).as_posix() not in scenario.new and not Path(n).is_dir()] == []
