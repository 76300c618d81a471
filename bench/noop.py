"""Pull of a release already in place: the boot of a host whose cache dir survived a reboot.

A 10,000-file release (Inductor-like: 100 two-character directories, sizes 4-64 KiB) is
published to a local store and pulled once into bench/.work/noop/cache. Then:

  (a) no-op: `python -m neffbuild pull TAG --store DIR --cache-dir CACHE` as boot runs it (host
      check included), whole process wall from spawn to exit, interpreter start included.
      Target: <= 0.3 s. With --vs DIR, the same with DIR's neffbuild, into a cache dir of its own
      (CACHE-vs, pulled by it first).
  (b) `--verify full` of the same cache (every file rehashed, nothing to fetch), as a process and
      as pull() inside this one, against the peer: a tight single-threaded loop of
      xxhash.xxh3_128 over the same files (read whole, hashed), in the same run, page cache warm
      for both. Target: >= 0.8x the peer's throughput. A second peer reads into one reused
      buffer (f.read() allocates and faults in fresh memory for every file: large files suffer).
      The process row's fair peer is the same loop as a process (`python -c`, interpreter start
      and `import xxhash` included, the list of files read from a file): column "x its peer".

Each figure is the median of --runs, after one warm-up; the modes are interleaved per round.
Run:
    .venv/bin/python bench/noop.py [--runs 7] [--files 10000]
    .venv/bin/python bench/noop.py --files 8 --size 64     (NEFF-like: 8 files of 64 MiB)
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _smoke as smoke
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORK = ROOT / "bench" / ".work" / "noop"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--jobs", type=int, default=16)
    p.add_argument("--size", type=int, default=0, help="every file this many MiB (NEFF-like) instead of 4-64 KiB")
    p.add_argument("--noop-only", action="store_true", help="only (a) and its parts, not --verify full")
    p.add_argument("--vs", type=Path, help="also time (a) with the neffbuild package of this checkout (a baseline)")
    args = smoke.parse(p, runs=1, files=40)
    store_dir, cache = prepare(args.files, args.size)
    files = sorted(str(p) for p in cache.rglob("*") if p.is_file() and ".neffbuild" not in p.parts)
    command = [sys.executable, "-m", "neffbuild", "pull", "t", "--store", str(store_dir), "--cache-dir", str(cache)]
    # As installed (pip compiles bytecode): the warm-up round writes it if the environment says not to.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPATH": str(ROOT)}
    listing = WORK / f"files-{len(files)}.txt"
    listing.write_text("\n".join(files) + "\n")
    raw_command = [sys.executable, "-c", RAW_LOOP, str(listing)]
    parts = noop_parts(command, env, args.vs)
    timings: dict[str, list[float]] = {k: [] for k in parts}
    full = {
        "full_cli": lambda: run([*command, "--verify", "full", "--jobs", str(args.jobs)], env),
        "full_inproc": lambda: verify_in_process(store_dir, cache, args.jobs),
        "xxh3": lambda: raw_xxh3(files),
        "xxh3_buf": lambda: raw_xxh3_reused_buffer(files),
        "xxh3_cli": lambda: subprocess.run(raw_command, env=env, check=True),
    }
    for round_ in range(1 + args.runs):
        got = {k: process_times(fn) for k, fn in parts.items()}
        if not args.noop_only:
            got |= {k: (timed(fn), 0.0) for k, fn in full.items()}
        print(f"  round {round_}: " + ", ".join(f"{k} {v[0]:.3f}s" for k, v in got.items()), file=sys.stderr)
        if round_:
            for k, v in got.items():
                timings.setdefault(k, []).append(v[0])
                timings.setdefault(f"{k}_cpu", []).append(v[1])
    noop_table(timings, args.runs, len(files))
    if not args.noop_only:
        full_table(timings, files, args)
    print(
        f"\nmachine: {os.cpu_count()} CPUs; uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
    )
    print(f"neffbuild installed: {install_kind()}")


def install_kind() -> str:
    """How this environment has neffbuild installed (every row imports this checkout's, through
    PYTHONPATH): an editable install's `.pth` imports its finder at every interpreter start, with
    pathlib, re and urllib.parse (about 50 M instructions of `python -c pass`'s 90 M here), which a
    wheel's does not; a no-op pull imports those anyway (about 3 M instructions, 0.5%, in all)."""
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    editable = [p for d in dirs if os.path.isdir(d) for p in os.listdir(d) if p.startswith("__editable__.neffbuild-")]
    if editable:
        return f"editable ({editable[0]}: the interpreter start row includes its finder)"
    return "not editable (a wheel, or none: PYTHONPATH only)"


def noop_parts(command: list[str], env: dict[str, str], vs: Path | None) -> dict[str, Callable[[], None]]:
    """(a) and its parts, each a process: the interpreter alone, the imports of the pull path,
    the no-op pull without and with the host check (and the baseline's, with --vs)."""
    py = sys.executable
    parts: dict[str, Callable[[], None]] = {
        "start": lambda: run([py, "-c", "pass"], env, check_fetch=False),
        "imports": lambda: run([py, "-c", IMPORTS], env, check_fetch=False),
        "noop_nohc": lambda: run([*command, "--no-host-check"], env),
        "noop": lambda: run(command, env),
    }
    if vs is not None:
        # A cache dir of its own, pulled by that checkout: one that writes another state format
        # would otherwise rewrite the state in every round (and so would this one), no no-op left.
        base = env | {"PYTHONPATH": str(vs.resolve())}
        vs_command = [*command[:-1], command[-1] + "-vs"]
        run(vs_command, base, check_fetch=False, cwd=vs)
        parts["noop_vs"] = lambda: run(vs_command, base, cwd=vs)
    return parts


# What a no-op `neffbuild pull` imports on its way (the entry, the pull, the store, the host check;
# click and the rest of the command line only where it is not a no-op: cli/quick.py).
IMPORTS = "import neffbuild.cli.quick, neffbuild.host.noop, neffbuild.store.local, neffbuild.host.hostcheck, neffbuild.backends.inductor"


def noop_table(timings: dict[str, list[float]], runs: int, count: int) -> None:
    med = {k: statistics.median(v) for k, v in timings.items()}
    low = {k: min(v) for k, v in timings.items()}
    print(f"\n(a) no-op pull of {count:,} files: median of {runs} runs after 1 warm-up; CPU: user+sys of the process\n")
    print(
        "| what (each a process) | min s | median s | CPU median s | x no-op pull (median wall) | x no-op pull (CPU) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for key, label in (
        ("start", "interpreter start (`python -c pass`)"), ("imports", "imports of the pull path"),
        ("noop_nohc", "no-op `pull --no-host-check`"), ("noop", "(a) no-op `pull` (process, interpreter start included)"),
        ("noop_vs", "(a) with the --vs checkout's neffbuild"),
    ):  # fmt: skip
        if key in med:
            print(
                f"| {label} | {low[key]:.3f} | {med[key]:.3f} | {med[key + '_cpu']:.3f} | {med[key] / med['noop']:.2f}"
                f" | {med[key + '_cpu'] / med['noop_cpu']:.2f} |"
            )


def full_table(timings: dict[str, list[float]], files: list[str], args: argparse.Namespace) -> None:
    size = sum(os.path.getsize(f) for f in files)
    med = {k: statistics.median(v) for k, v in timings.items()}
    mbs = {k: size / med[k] / 1e6 for k in ("full_cli", "full_inproc", "xxh3", "xxh3_buf", "xxh3_cli")}
    print(
        f"\n{len(files):,} files, {size / 1e6:,.0f} MB; median of {args.runs} runs after 1 warm-up; --jobs {args.jobs}\n"
    )
    low = {k: min(v) for k, v in timings.items()}
    print("| what | min s | median s | MB/s (median) | x its peer | x raw XXH3 | x raw XXH3, reused buffer |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    peer_of = {"full_cli": "xxh3_cli", "full_inproc": "xxh3"}
    for key, label in (("full_cli", "(b) `pull --verify full` (process)"), ("full_inproc", "(b) `pull(verify=\"full\")` in-process"),
                       ("xxh3_cli", "raw XXH3 loop as a process (peer of the process row)"),
                       ("xxh3", "raw XXH3 loop (peer, one thread)"), ("xxh3_buf", "raw XXH3 loop, one reused 4 MiB buffer")):  # fmt: skip
        peer = f"{mbs[key] / mbs[peer_of[key]]:.2f}" if key in peer_of else "-"
        print(
            f"| {label} | {low[key]:.3f} | {med[key]:.3f} | {mbs[key]:,.0f} | {peer} | {mbs[key] / mbs['xxh3']:.2f} | {mbs[key] / mbs['xxh3_buf']:.2f} |"
        )


def prepare(count: int, mib: int) -> tuple[Path, Path]:
    """The store and the cache dir with the release in place (made once, reused)."""
    from neffbuild.host.pull import pull
    from neffbuild.store.local import LocalStore
    from tests.storekit import publish_release_of, write_files

    name = f"{count}x{mib}MiB" if mib else f"{count}"
    store_dir, cache = WORK / f"store-{name}", WORK / f"cache-{name}"
    if not (store_dir / "tags").is_dir():
        rng = random.Random(1)
        sizes = {f"{i % 100:02x}/c{i:05d}.bin": (mib << 20) or rng.randrange(4 << 10, 64 << 10) for i in range(count)}
        src = WORK / f"src-{name}"
        sources = write_files(src, sizes)
        publish_release_of(LocalStore(store_dir, create=True), src, sources, tag="t")
    pull(LocalStore(store_dir), "t", cache, jobs=16)
    return store_dir, cache


def run(command: list[str], env: dict[str, str], *, check_fetch: bool = True, cwd: Path | None = None) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, cwd=cwd)
    if done.returncode != 0 or (check_fetch and "0 of" not in done.stderr):
        raise SystemExit(f"{' '.join(command)} failed or fetched something ({done.returncode}):\n{done.stderr[-2000:]}")


def verify_in_process(store_dir: Path, cache: Path, jobs: int) -> None:
    from neffbuild.host.pull import pull
    from neffbuild.store.local import LocalStore

    report = pull(LocalStore(store_dir), "t", cache, jobs=jobs, verify="full")
    assert report.files_fetched == 0 and report.files_rehashed == report.files_total, report


# raw_xxh3 below, as a process: interpreter start and the import are part of its time, as of pull's.
RAW_LOOP = """
import sys, xxhash
for f in open(sys.argv[1]).read().split():
    with open(f, "rb") as src:
        xxhash.xxh3_128(src.read()).hexdigest()
"""


def raw_xxh3(files: list[str]) -> None:
    for f in files:
        with open(f, "rb") as src:
            xxhash.xxh3_128(src.read()).hexdigest()


def raw_xxh3_reused_buffer(files: list[str]) -> None:
    """The peer without a fresh allocation per file (what pull's reader does, in one thread)."""
    buffer = memoryview(bytearray(4 << 20))
    for f in files:
        with open(f, "rb", buffering=0) as src:
            hasher = xxhash.xxh3_128()
            while n := src.readinto(buffer):
                hasher.update(buffer[:n])
            hasher.hexdigest()


def process_times(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall, CPU of the child processes fn ran) in seconds: CPU holds up on a shared machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = timed(fn)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
