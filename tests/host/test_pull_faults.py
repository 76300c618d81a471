"""Pulls killed and raced for real against the real S3 server (issue 12's acceptance).

kill -9 of `neffbuild pull` processes at points spread over a whole pull: what each leaves is
checked file by file against both releases (tests/killkit.py says what must hold), then a rerun
must complete and a full verify find nothing to repair. Eight pulls of one tag started together
into one cache dir: all succeed, and a proxy in front of the server counts what they fetched:
each blob once (the lock), plus the documents each pull reads.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from neffbuild.fs.confined import BlobTarget, write_verified
from neffbuild.hashing import hash_bytes
from neffbuild.host.pull import pull
from neffbuild.host.state import STATE_FILE
from neffbuild.names import INCOMPLETE_SUFFIX, STATE_DIR
from neffbuild.store import open_store
from tests.killkit import (
    HEAD_MAX,
    Scenario,
    Traffic,
    assert_installed,
    concurrent_pulls,
    fresh_cache,
    kill_delays,
    make_scenario,
    no_flock_env,
    phases,
)
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


def test_a_pull_killed_anywhere_leaves_only_whole_files_and_a_rerun_completes(
    scenario: Scenario, tmp_path: Path
) -> None:
    # Every other point upgrades the old release, which ends sooner than a pull into an empty dir:
    # each kind's points are spread over its own duration, so neither kind's kills land after it.
    durations = {old: scenario.pull_seconds(tmp_path / f"measured-{old}", from_old=old) for old in (False, True)}
    results = [
        scenario.killed_point(tmp_path / f"cache-{i}", delay * durations[i % 2 == 1], from_old=i % 2 == 1)
        for i, delay in enumerate(kill_delays(1.0, POINTS, seed=12))
    ]
    print(
        f"pulls {durations[False]:.2f} s, upgrades {durations[True]:.2f} s; {POINTS} kills: {phases(results, len(scenario.new))}"
    )
    assert all(code == -9 for code, _ in results), results  # each died mid-pull, not after it


def test_eight_pulls_racing_into_one_cache_dir_fetch_each_blob_once(
    scenario: Scenario, s3_server: S3Settings, tmp_path: Path
) -> None:
    release_size = sum(f.size for f in scenario.new.values())
    with TcpProxy(int(s3_server.endpoint.rsplit(":", 1)[1])) as proxy:
        env = {**scenario.env, "AWS_ENDPOINT_URL": proxy.endpoint}
        concurrent_pulls(scenario.command(tmp_path / "alone", "--json"), env, 1)
        assert proxy.settled()
        alone = Traffic.of(proxy.exchanges)
        reports = concurrent_pulls(scenario.command(tmp_path / "cache", "--json"), env, PULLS)
        assert proxy.settled()
        traffic = Traffic.of(proxy.exchanges[alone.requests :])
    print(
        f"{PULLS} pulls of {release_size:,} bytes fetched {traffic.total:,} bytes in {traffic.requests} requests: {traffic}"
    )
    assert sum(r["files_fetched"] for r in reports) == len(scenario.new)  # each file landed once
    assert (
        release_size <= traffic.data_bytes <= release_size + HEAD_MAX * traffic.data_requests
    )  # each blob fetched once
    # The rest is documents: each pull reads at most what one pull alone does (the ones that wait
    # for the lock read no locator or pack index); a head's length varies by a few bytes.
    assert traffic.other_bytes <= PULLS * (alone.other_bytes + 64 * alone.requests)
    report = pull(scenario.store, scenario.ref, tmp_path / "cache", verify="full")
    assert report.files_fetched == 0 and report.files_rehashed == len(scenario.new)


class Watch:
    """Names created or moved into some directories, as inotify(7) reports them: the kernel's own
    account, so no name, however briefly it existed, goes unseen."""

    _IN_MOVED_TO, _IN_CREATE, _IN_Q_OVERFLOW = 0x80, 0x100, 0x4000

    def __init__(self, dirs: list[Path]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.dirs = {
            libc.inotify_add_watch(self.fd, str(d).encode(), self._IN_CREATE | self._IN_MOVED_TO): d for d in dirs
        }
        assert all(wd >= 0 for wd in self.dirs)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def names(self, *, wait: bool) -> list[str]:
        """The names reported so far (if wait, blocks until there is one)."""
        if not wait and not select.select([self.fd], [], [], 0)[0]:
            return []
        data, names = os.read(self.fd, 1 << 20), []
        while data:
            wd, mask, _, size = struct.unpack_from("iIII", data)
            assert not mask & self._IN_Q_OVERFLOW, "inotify queue overflowed: events lost"
            names.append((self.dirs[wd] / data[16 : 16 + size].rstrip(b"\0").decode()).as_posix())
            data = data[16 + size :]
        return names


def test_replacing_files_names_nothing_but_them_in_the_servers_tree(scenario: Scenario, tmp_path: Path) -> None:
    """A file of the old release at a path is replaced by the new one's without a temp name
    beside it, even for an instant: a kill there would leave that name visible to the server."""
    cache = tmp_path / "cache"
    fresh_cache(cache, scenario.template)
    dirs = [cache, *(p for p in cache.rglob("*") if p.is_dir() and STATE_DIR not in p.relative_to(cache).parts)]
    with Watch(dirs) as watch:
        pull(scenario.store, scenario.ref, cache)
        names = [n for batch in iter(lambda: watch.names(wait=False), []) for n in batch]
    replaced = [rel for rel in scenario.new if rel in scenario.old]
    assert replaced and {(cache / rel).as_posix() for rel in replaced} <= set(names)
    assert [
        n for n in names if Path(n).relative_to(cache).as_posix() not in scenario.new and not Path(n).is_dir()
    ] == []


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to kill the pull at its state's rename")
def test_a_pull_killed_while_writing_its_state_leaves_no_temp_file_after_the_next(
    scenario: Scenario, tmp_path: Path
) -> None:
    """Killed as it renames its state's temp file into place (all files in; strace delivers the
    SIGKILL as the rename starts: the first rename a pull makes, files land by link), the next
    pull, which finds nothing missing, still removes that temp file."""
    cache = tmp_path / "cache"
    kill_at_rename = ["strace", "-f", "-qq", "-o", os.devnull, "-e", "trace=rename,renameat,renameat2",
                      "-e", "inject=rename,renameat,renameat2:signal=SIGKILL:when=1"]  # fmt: skip
    env = {**scenario.env, "PYTHONDONTWRITEBYTECODE": "1"}  # no .pyc written (by rename) before it
    killed = subprocess.run(
        [*kill_at_rename, *scenario.command(cache)], env=env, capture_output=True, text=True, check=False
    )
    assert killed.returncode != 0, killed.stderr
    assert [p for p in (cache / STATE_DIR).iterdir() if p.name.endswith(INCOMPLETE_SUFFIX)]
    assert not (cache / STATE_DIR / STATE_FILE).exists()
    rerun = subprocess.run(
        scenario.command(cache, "--json"), env=scenario.env, capture_output=True, text=True, check=False
    )
    assert rerun.returncode == 0 and json.loads(rerun.stdout)["files_fetched"] == 0, rerun.stderr
    assert_installed(cache, scenario.new)  # every file, the state, and no temp file anywhere


def test_writers_replacing_one_path_at_once_without_a_lock_all_land_it_whole(tmp_path: Path) -> None:
    """Landing never rests on pull's lock: writers racing to replace one file (as pulls would
    where flock does nothing) all succeed, and the path ends whole, with no other name beside it."""
    data = os.urandom(100_000)
    cache = tmp_path / "cache"
    dest = cache / "d" / "f.bin"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"stale")
    target = BlobTarget(hash_bytes(data), len(data), dest, fsync=False, root=cache)

    def write(_: int) -> None:
        for _ in range(50):
            write_verified(target, [data], origin="test")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(8)))
    assert dest.read_bytes() == data and os.listdir(dest.parent) == ["f.bin"]


# ---- correctness without the lock: a filesystem where flock does nothing (some NFS setups) ------

_HOLD = "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\nfcntl.flock(fd, fcntl.LOCK_EX)\nprint(flush=True)\ntime.sleep(600)\n"


@pytest.fixture(scope="module")
def no_flock(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = no_flock_env(tmp_path_factory.mktemp("noflock"))
    if env is None:
        pytest.skip("needs a C compiler to build the flock shim")
    return env


def test_eight_pulls_racing_where_flock_does_nothing_still_install_the_release(
    scenario: Scenario, no_flock: dict[str, str], tmp_path: Path
) -> None:
    """An upgrade: the pulls also race to replace the old release's files at the same paths."""
    cache = tmp_path / "cache"
    fresh_cache(cache, scenario.template)
    env = {**scenario.env, **no_flock}
    (cache / STATE_DIR).mkdir(exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(cache / STATE_DIR / "pull.lock")], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"\n"
        # The lock is held for real: with a working flock each of these would exit 9 at once.
        reports = concurrent_pulls(scenario.command(cache, "--json", "--lock-timeout", "0"), env, PULLS)
    finally:
        holder.kill()
        holder.wait()
    fetched = sum(r["files_fetched"] for r in reports)
    print(f"{PULLS} pulls without a lock landed {fetched} files of {len(scenario.new)}")
    assert fetched >= len(scenario.new)
    assert_installed(cache, scenario.new)
    report = pull(scenario.store, scenario.ref, cache, verify="full")
    assert report.files_fetched == 0 and report.files_rehashed == len(scenario.new)
