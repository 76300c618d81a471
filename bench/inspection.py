"""Inspection at scale: `neffbuild ls` and `du` on a synthetic store of 1,000 releases, 100 tags and
20,000 blobs, on the local store and on S3 (a SeaweedFS server on loopback, as the tests start it).

The store is written through the real publishing code (bundles, locators, releases, tag moves)
from hand-made cache files and fingerprints: no compiling. Each tag is one model entry whose
history holds releases/tags releases; each release has a base unit shared by every release of
its tag (dedup) and two units of its own. Each command is run as a user runs it (a fresh
`python -m neffbuild ... --json` process, start-up included); the median of --runs is reported.

    .venv/bin/python bench/inspection.py                       # both stores, full size
    .venv/bin/python bench/inspection.py --stores s3 --releases 100 --tags 10 --blobs 2000   # quick

`gc --dry-run` plans with `--grace 0` (the store was just written: under the default 24 h grace
nothing would be garbage) and the default --keep 3. `status` runs on a cache dir pulled from that
store (a release recorded with this host's fingerprint, made by bench/status.py's `publish`,
every unit a hit), with no store named and the store's endpoint and keys left out of its
environment: it reads the cache dir alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _smoke as smoke

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neffbuild.hashing import hash_bytes  # noqa: E402
from neffbuild.store import open_store  # noqa: E402
from neffbuild.store.base import Store  # noqa: E402
from neffbuild.store.blobs import BlobSource  # noqa: E402
from tests.inspectkit import FINGERPRINT, Unit, publish_units, unit_of  # noqa: E402
from tests.s3server import S3Server, client_for  # noqa: E402

BASE_FILES = 20  # files of the unit every release of a tag shares
UNITS_OWN = 2  # units each release has of its own
FILE_BYTES = 1024  # every blob: small, as most of a compiled cache's files are

# name -> the CLI arguments after `neffbuild` (the store is appended).
COMMANDS: dict[str, list[str]] = {
    "ls": ["ls", "--json"],
    "du": ["du", "--json"],
    "gc --dry-run": ["gc", "--dry-run", "--grace", "0", "--json"],
}


def _bench_status() -> Any:
    """bench/status.py, loaded by path (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_status", Path(__file__).with_name("status.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_store(store: Store, work: Path, *, releases: int, tags: int, blobs: int, jobs: int) -> None:
    """releases/tags releases per tag, published in its history's order; tags in parallel."""
    per_tag = releases // tags
    own_files = max(1, (blobs - tags * BASE_FILES) // (releases * UNITS_OWN))

    def files(label: str, count: int) -> dict[str, bytes]:
        return {f"{label}/{i:03d}.bin": (f"{label}/{i} ".encode() * FILE_BYTES)[:FILE_BYTES] for i in range(count)}

    def releases_of(t: int) -> list[list[Unit]]:
        entry = f"m{t:03d}"
        fingerprint = {**FINGERPRINT, "torch": f"2.{13 + t % 3}.0"}
        base = Unit(f"{entry}/64x64x1", unit_of(entry, 64, 64), fingerprint, files(f"{entry}/base", BASE_FILES))
        own = [
            [
                Unit(
                    f"{entry}/{128 * (u + 1)}x128x1",
                    unit_of(entry, 128 * (u + 1), 128, call={"r": r}),
                    fingerprint,
                    files(f"{entry}/r{r}/u{u}", own_files),
                )
                for u in range(UNITS_OWN)
            ]
            for r in range(per_tag)
        ]
        return [[base, *units] for units in own]

    plan = {f"m{t:03d}": releases_of(t) for t in range(tags)}
    # Every blob in one upload first: S3 packs them into a few packs, as one CI build of many units
    # would; publishing unit by unit would make a pack per bundle, which only slows the set-up.
    blobs_dir = work / "blobs"
    blobs_dir.mkdir(parents=True)
    sources = {}
    for units in (u for history in plan.values() for release in history for u in release):
        for data in units.files.values():
            digest = hash_bytes(data)
            if digest not in sources:
                (blobs_dir / digest).write_bytes(data)
                sources[digest] = BlobSource(digest, len(data), blobs_dir / digest)
    store.put_blobs(list(sources.values()), jobs=16)

    def one_tag(entry: str) -> None:
        for units in plan[entry]:
            publish_units(store, work / entry, entry, units, tag=entry, by="bench")

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one_tag, plan))


def time_cli(args: list[str], env: dict[str, str], runs: int) -> tuple[float, float, int]:
    """(median, min) wall seconds of `python -m neffbuild ARGS`, and the bytes it printed."""
    times, size = [], 0
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "neffbuild", *args],
            capture_output=True,
            env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            check=False,
        )
        times.append(time.perf_counter() - started)
        if done.returncode != 0:
            raise SystemExit(f"neffbuild {' '.join(args)} failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
        size = len(done.stdout)
    return statistics.median(times), min(times), size


def bench_store(name: str, url: str, env: dict[str, str], work: Path, args: argparse.Namespace) -> list[str]:
    store = open_store(url, create=True, env=env)
    started = time.perf_counter()
    make_store(store, work, releases=args.releases, tags=args.tags, blobs=args.blobs, jobs=args.jobs)
    made = time.perf_counter() - started
    print(f"{name}: store made in {made:.0f} s", file=sys.stderr)
    rows = []
    for command, cli_args in COMMANDS.items():
        median, best, size = time_cli([*cli_args, "--store", url], env, args.runs)
        rows.append(f"| {name} | `{command}` | {median:.2f} | {best:.2f} | {size:,} |")
        print(rows[-1], file=sys.stderr)
    # status: a this-host release pulled from this store, judged from the cache dir alone.
    _bench_status().publish(store, work / "status-src", args.status_units, args.status_files, tag="status-bench")
    cache = work / "status-cache"
    time_cli(["pull", "status-bench", "--store", url, "--cache-dir", str(cache), "--json"], env, 1)
    time_cli(["status", "--cache-dir", str(cache), "--json"], {}, 1)  # warm-up, as bench/status.py does
    median, best, size = time_cli(["status", "--cache-dir", str(cache), "--json"], {}, args.runs)
    rows.append(
        f"| {name} | `status` (pulled cache dir, no store; {args.status_units} units, {args.status_units * args.status_files:,} files) | {median:.2f} | {best:.2f} | {size:,} |"
    )
    print(rows[-1], file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default="local,s3", help="comma-separated: local, s3 [default: both]")
    parser.add_argument("--releases", type=int, default=1000)
    parser.add_argument("--tags", type=int, default=100)
    parser.add_argument("--blobs", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3, help="runs per command; the median is reported")
    parser.add_argument("--jobs", type=int, default=8, help="tags published at once while making the store")
    parser.add_argument("--work", type=Path, help="scratch dir [default: a temp dir, removed]")
    # The pulled release `status` judges (bench/status.py's defaults and smoke sizes).
    parser.add_argument("--status-units", type=int, default=40, help="units of the release `status` judges")
    parser.add_argument("--status-files", type=int, default=50, help="files per unit of that release")
    args = smoke.parse(parser, runs=1, releases=6, tags=2, blobs=40, status_units=2, status_files=3)
    with tempfile.TemporaryDirectory(prefix="neffbench-", dir=args.work) as tmp:
        work = Path(tmp)
        stores: dict[str, Callable[[], list[str]]] = {
            "local": lambda: bench_store("local", str(work / "store"), {}, work / "src-local", args),
            "s3": lambda: _with_s3(work, args),
        }
        rows = [row for name in args.stores.split(",") for row in stores[name]()]
    print(
        f"{args.releases} releases, {args.tags} tags, {args.blobs} blobs; median and best of {args.runs} runs, start-up included\n"
    )
    print("| store | command | median s | best s | JSON bytes |\n|---|---|---:|---:|---:|")
    print("\n".join(rows))


def _with_s3(work: Path, args: argparse.Namespace) -> list[str]:
    with S3Server(work / "seaweedfs") as settings:
        client_for(settings).create_bucket(Bucket="bench")
        return bench_store("s3", "s3://bench/inspect", settings.env(), work / "src-s3", args)


if __name__ == "__main__":
    main()
