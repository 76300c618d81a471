"""Boot storms (issue 26): N concurrent `neffbuild pull` processes against one throttled store.

Starts its own SeaweedFS (tests/s3server.py) and publishes one release like the issue's (--small
files of up to 200 KiB, packed, and --large of 9 MiB: 300 files, about 84 MiB by default). For
each N in --hosts, N pulls into N empty cache dirs, all started together, twice: through a proxy
that passes everything (unthrottled), then through one that lets --limit requests a second
through and answers the rest 503 SlowDown with S3's XML body (tests/tcpproxy.py, mode "limit").
Without --limit, the limit is set so the storm lasts --storm seconds: N x (requests per pull,
counted in the unthrottled run) / limit. Every pull runs with --timeout (default 600). Prints,
per run: pulls completed (exit 0) and verified (every file whole), 503s per forwarded request,
p50 / p90 / max of each pull's time from the common start, the utilisation of the throttled
capacity (requests forwarded / (limit x the time to the last pull's end)), and where a pull's
requests spent their time (medians over pulls of its --json paced_s, backoff_s, in_flight_s:
seconds summed over its requests, waiting in the pacer, in backoff, in flight). "first s" is when
the store saw the storm's first request: 64 processes starting at once on a busy machine of two
cores take tens of seconds to import and set up, while the store idles; "from first" are p90 /
storm and the utilisation counted from then (the storm as the store saw it, as a fleet of hosts
that each start on their own CPUs would make it).

--trace DIR writes, per throttled run, a JSON file of each pull's time and --json counts and of
when each request reached the proxy and whether it went through (seconds from the storm's start):
where in a storm the store sat idle, and which hosts were left behind.

--code DIR runs the pulls with another checkout's neffbuild (PYTHONPATH=DIR), e.g. main's code
for the old policy: `git archive main | tar -x -C /tmp/neffbuild-main`.

--client adaptive runs, instead of the pulls, the requests one pull made (recorded through an
unthrottled proxy) with botocore's own adaptive retry mode (bench/_adaptive.py); --client both runs
the pulls, then that, each against the same limit.

Run:
    .venv/bin/python bench/storm.py [--hosts 16,32,64] [--storm 165 | --limit 12] [--timeout 600] [--code DIR] [--client both]
"""

from __future__ import annotations

import argparse
import json
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

from neffbuild.store import open_store  # noqa: E402
from tests.s3server import S3Server, client_for  # noqa: E402
from tests.stormkit import Storm, holds, publish_fleet_release, storm  # noqa: E402
from tests.tcpproxy import TcpProxy  # noqa: E402

WORK = ROOT / "bench" / ".work" / "storm"
SPENT = ("paced_s", "backoff_s", "in_flight_s")  # a pull's --json seconds, each a column (median over pulls)
TRACED = (*SPENT, "throttled", "retries", "paced_to")  # a pull's --json counts in a --trace
BUCKET = "storm"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", default="16,32,64")
    p.add_argument(
        "--storm", type=float, default=165.0, help="seconds the throttled storm should last (sets the limit)"
    )
    p.add_argument("--limit", type=float, default=None, help="requests/s the store serves (instead of --storm)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--small", type=int, default=294)
    p.add_argument("--large", type=int, default=6)
    p.add_argument("--code", type=Path, default=ROOT, help="the neffbuild checkout the pulls run")
    p.add_argument(
        "--no-unthrottled", action="store_true", help="skip the unthrottled run (requests per pull: --per-pull)"
    )
    p.add_argument("--per-pull", type=float, default=None)
    p.add_argument("--trace", type=Path, default=None, help="a dir for a JSON trace of each throttled run")
    p.add_argument(
        "--client", choices=("neffbuild", "adaptive", "both"), default="neffbuild",
        help="adaptive: each host sends a recorded pull's requests with botocore's adaptive retry mode (bench/_adaptive.py)",
    )  # fmt: skip
    args = smoke.parse(p, hosts="2", small=10, large=1, storm=4.0, timeout=60.0)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    with S3Server(WORK / "weed") as server:
        client_for(server).create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/bench"
        env = {**server.env(), "PYTHONPATH": str(args.code.resolve())}
        files = publish_fleet_release(
            open_store(url, create=True, env=server.env()), WORK / "src", small=args.small, large=args.large
        )
        size = sum(len(b) for b in files.values())
        del files
        print(f"release: {args.small + args.large} files, {size / 2**20:.1f} MiB; code: {args.code}; timeout {args.timeout:g} s; "
              f"{os.cpu_count()} CPUs; {uptime()}", flush=True)  # fmt: skip
        print(
            "| client | hosts | limit (req/s) | storm (s) | completed | verified | 503s / forwarded | p50 s | p90 s | max s | p90 / storm "
            "| utilisation | first s | p90 / storm from first | utilisation from first | paced s | backoff s | in flight s |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
        port = int(server.endpoint.rsplit(":", 1)[1])
        for hosts in [int(h) for h in args.hosts.split(",")]:
            per_pull = args.per_pull
            if not args.no_unthrottled:
                with TcpProxy(port, mode="limit", limit=None) as proxy:
                    started = time.monotonic()
                    ran = run(proxy, url, env, hosts, args.timeout)
                per_pull = ran[0].forwarded / hosts
                row(hosts, None, None, ran, first=first_request(proxy, started))
            limit = args.limit or round(hosts * per_pull / args.storm, 2)
            storm_s = hosts * per_pull / limit if per_pull else None
            for client in ("neffbuild", "adaptive") if args.client == "both" else (args.client,):
                command = adaptive_command(port, url, env, args.timeout) if client == "adaptive" else None
                with TcpProxy(port, mode="limit", limit=limit) as proxy:
                    started = time.monotonic()
                    ran = run(proxy, url, env, hosts, args.timeout, command)
                row(hosts, limit, storm_s, ran, client, first=first_request(proxy, started))
                if args.trace:
                    trace(args.trace / f"{client}-{hosts}-{limit:g}.json", ran[0], proxy, started)
    print(f"# {uptime()}")


def adaptive_command(port: int, url: str, env: dict[str, str], timeout: float) -> list[str]:
    """bench/_adaptive.py's command, with the requests of one pull recorded through a passing proxy."""
    shutil.rmtree(WORK / "caches", ignore_errors=True)
    with TcpProxy(port, mode="limit", limit=None) as proxy:
        storm(proxy, url, env, [WORK / "caches" / "record"], timeout=timeout, code=Path(env["PYTHONPATH"]))
    plan = [
        [path, headers.get("range")]
        for method, path, headers in proxy.seen
        if method == "GET" and "list-type=" not in path
    ]
    (WORK / "plan.json").write_text(json.dumps(plan))
    return [sys.executable, str(ROOT / "bench" / "_adaptive.py"), str(WORK / "plan.json"), "--timeout", f"{timeout:g}"]


def run(
    proxy: TcpProxy, url: str, env: dict[str, str], hosts: int, timeout: float, command: list[str] | None = None
) -> tuple[Storm, int]:
    """One storm of `hosts` pulls through proxy (or of command); it and how many verified (every
    file whole; for command: every body whole, which it checks itself)."""
    caches = [WORK / "caches" / f"host{i:02d}" for i in range(hosts)]
    shutil.rmtree(WORK / "caches", ignore_errors=True)
    done = storm(proxy, url, env, caches, timeout=timeout, code=Path(env["PYTHONPATH"]), command=command)
    files = {
        rel.relative_to(WORK / "src").as_posix(): rel.read_bytes() for rel in (WORK / "src").rglob("*") if rel.is_file()
    }
    verified = sum(
        p.code == 0 and (command is not None or holds(c, files)) for p, c in zip(done.pulls, caches, strict=True)
    )
    failures = [p.report.get("error", "")[:160] for p in done.pulls if p.code]
    if failures:
        print(f"#   {len(failures)} failed, e.g.: {failures[0]}", flush=True)
    shutil.rmtree(WORK / "caches", ignore_errors=True)
    return done, verified


def row(
    hosts: int, limit: float | None, storm_s: float | None, ran: tuple[Storm, int], client: str = "neffbuild", *,
    first: float = 0.0,
) -> None:  # fmt: skip
    done, verified = ran
    storm_text = f"{storm_s:.0f}" if storm_s else "-"
    ratio = f"{done.ratio:.2f}" if limit else "-"
    p90 = done.quantile(0.9)
    against = f"{p90 / storm_s:.2f}" if storm_s else "-"
    last = max(p.seconds for p in done.pulls)
    used = f"{done.forwarded / (limit * last):.2f}" if limit else "-"
    since = f"{first:.1f} | " + (f"{(p90 - first) / storm_s:.2f}" if storm_s else "-")
    since += f" | {done.forwarded / (limit * (last - first)):.2f}" if limit and last > first else " | -"
    spent = " | ".join(f"{statistics.median(p.report.get(k, 0.0) for p in done.pulls):.1f}" for k in SPENT)
    print(f"| {client} | {hosts} | {limit if limit else 'none'} | {storm_text} | {done.completed}/{hosts} | {verified}/{hosts} | {ratio} | "
          f"{done.median:.1f} | {p90:.1f} | {last:.1f} | {against} | {used} | {since} | {spent} |", flush=True)  # fmt: skip


def first_request(proxy: TcpProxy, started: float) -> float:
    """Seconds from the storm's start to the first request the store saw."""
    return proxy.decided[0][0] - started if proxy.decided else 0.0


def trace(path: Path, done: Storm, proxy: TcpProxy, started: float) -> None:
    pulls = [
        {"seconds": round(p.seconds, 2), "code": p.code} | {k: p.report.get(k) for k in TRACED} for p in done.pulls
    ]
    decided = [(round(at - started, 3), admitted) for at, admitted in proxy.decided]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pulls": pulls, "decided": decided}))


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


if __name__ == "__main__":
    main()
