"""What BLAKE3 beside XXH3 costs (issue 24: signed releases bound to a cryptographic digest).

1. The hash-while-write loop alone, over 1 MiB chunks in memory: XXH3, XXH3 + SHA-256 (the
   digest BLAKE3 replaced, kept here as the reason), XXH3 + BLAKE3, and XXH3 + BLAKE3 with
   max_threads=AUTO (its own threads inside one update), in GB/s of wall and of CPU.
2. `pull` from the S3 test server (tests/s3server.py), the pull benchmark's cases
   (a) 2,000 x 64 KiB and (b) 8 x 128 MiB: the same files published twice, as a release of format
   2 (each file checked against its BLAKE3 while written) and of format 1 (XXH3 only); each
   round pulls both into fresh dirs, alternating which goes first; the median of --runs rounds.
   Reported: the BLAKE3 release's time as a ratio to the XXH3-only one (target <= 1.1x).
3. `pull(verify="full")` of a complete cache dir (local store, in-process) against the raw loop
   that reads every file once and hashes it with both digests (the same files, page cache warm):
   small files (10,000 x ~34 KiB) and large (4 x 256 MiB).

Run: .venv/bin/python bench/trust.py [--runs 5] [--cases a,b]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _smoke as smoke
import blake3
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neffbuild.build.publish import move_tag, publish_bundle, publish_release  # noqa: E402
from neffbuild.documents.bundles import BundleRecord, Timings  # noqa: E402
from neffbuild.documents.records import RELEASE_FORMAT_1, FileEntry, Release, ReleaseUnit  # noqa: E402
from neffbuild.hashing import hash_bytes  # noqa: E402
from neffbuild.host.pull import pull  # noqa: E402
from neffbuild.store import open_store  # noqa: E402
from neffbuild.store.local import LocalStore  # noqa: E402
from tests.s3server import S3Server, client_for  # noqa: E402
from tests.storekit import this_host  # noqa: E402

CHUNK = 1 << 20
CASES = {"a": (2000, 64 << 10), "b": (8, 128 << 20)}
SMOKE_CASES = {"a": (20, 4 << 10), "b": (2, 1 << 20)}
VERIFY = (("small", 10_000, 34 << 10), ("large", 4, 256 << 20))
SMOKE_VERIFY = (("small", 20, 4 << 10), ("large", 1, 2 << 20))


def loop_rates(total: int = 1 << 30) -> dict[str, tuple[float, float]]:
    """(wall, CPU) GB/s of each hasher set over total bytes of 1 MiB chunks (what write_verified
    feeds). CPU time too: on a shared machine the wall rate says more about the neighbours."""
    chunk = os.urandom(CHUNK)
    sets = {
        "xxh3": lambda: [xxhash.xxh3_128()],
        "xxh3+sha256": lambda: [xxhash.xxh3_128(), hashlib.sha256()],
        "xxh3+blake3": lambda: [xxhash.xxh3_128(), blake3.blake3()],
        "xxh3+blake3 threads=auto": lambda: [xxhash.xxh3_128(), blake3.blake3(max_threads=blake3.blake3.AUTO)],
    }
    rates = {}
    for name, make in sets.items():
        hashers = make()
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(total // CHUNK):
            for h in hashers:
                h.update(chunk)
        rates[name] = (total / (time.perf_counter() - started) / 1e9, total / (time.process_time() - cpu) / 1e9)
    return rates


def publish_both(store, root: Path, name: str) -> None:
    """The files under root as two releases: format 2 tagged b3-NAME, format 1 tagged xxh3-NAME."""
    sources = _sources(root)
    for tag, with_b3 in (("b3", True), ("xxh3", False)):
        files = tuple(
            FileEntry(s.path.relative_to(root).as_posix(), s.size, s.digest, s.blake3 if with_b3 else "")
            for s in sources
        )
        key = hash_bytes(f"{name}{tag}".encode())
        fp = this_host({"name": name}, {})
        record = BundleRecord(
            key=key, unit_id=f"{name}-{tag}/u", unit={"name": name}, backend="inductor", fingerprint=fp, files=files,
            counters={}, timings=Timings(), created_at="2026-01-01T00:00:00+00:00", neffbuild_version="bench",
            **({} if with_b3 else {"format": "neffbuild.documents.records/1"}),
        )  # fmt: skip
        publish_bundle(store, record, sources, jobs=16)
        release = Release(
            name=f"{name}-{tag}", manifest_digest="0" * 32, backend="inductor", cache_env="TORCHINDUCTOR_CACHE_DIR",
            env={}, fingerprint=fp, units=(ReleaseUnit(record.unit_id, key),), files=files,
            **({} if with_b3 else {"format": RELEASE_FORMAT_1}),
        )  # fmt: skip
        move_tag(store, f"{tag}-{name}", publish_release(store, release))


def _sources(root: Path):
    from neffbuild.hashing import hash_file
    from neffbuild.store.blobs import BlobSource

    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        d = hash_file(path)
        out.append(BlobSource(d.hex, d.size, path, d.blake3))
    return out


def make_files(root: Path, count: int, size: int) -> None:
    rng = os.urandom
    for i in range(count):
        path = root / f"f/{i:05d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng(size))


def pull_ratio(case: str, runs: int, work: Path, cases: dict[str, tuple[int, int]]) -> dict:
    count, size = cases[case]
    src = work / f"src-{case}"
    make_files(src, count, size)
    with S3Server(work / f"s3-{case}") as s3:
        client_for(s3).create_bucket(Bucket="bench")
        env = s3.env()
        store = open_store(f"s3://bench/{case}", create=True, env=env)
        publish_both(store, src, case)
        times: dict[str, list[float]] = {"b3": [], "xxh3": []}
        cpus: dict[str, list[float]] = {"b3": [], "xxh3": []}
        for r in range(runs + 1):  # round 0 warms up
            order = ("b3", "xxh3") if r % 2 else ("xxh3", "b3")
            for tag in order:
                dest = work / f"dest-{case}-{tag}-{r}"
                started, cpu = time.perf_counter(), time.process_time()
                report = pull(open_store(f"s3://bench/{case}", env=env), f"{tag}-{case}", dest, jobs=16)
                took, used = time.perf_counter() - started, time.process_time() - cpu
                assert report.files_fetched == count
                if r:
                    times[tag].append(took)
                    cpus[tag].append(used)
                shutil.rmtree(dest)
    b3, xxh = statistics.median(times["b3"]), statistics.median(times["xxh3"])
    b3_cpu, xxh_cpu = statistics.median(cpus["b3"]), statistics.median(cpus["xxh3"])
    return {
        "case": case, "files": count, "size": size, "b3_s": b3, "xxh3_s": xxh, "ratio": b3 / xxh,
        "b3_cpu": b3_cpu, "xxh3_cpu": xxh_cpu,
    }  # fmt: skip


def verify_full_ratio(name: str, count: int, size: int, runs: int, work: Path) -> dict:
    src = work / f"vsrc-{name}"
    make_files(src, count, size)
    store = LocalStore(work / f"vstore-{name}", create=True)
    publish_both(store, src, name)
    cache = work / f"vcache-{name}"
    pull(store, f"b3-{name}", cache, jobs=16)
    files = [str(cache / p.relative_to(src)) for p in src.rglob("*") if p.is_file()]
    pulls, raws, pull_cpus, raw_cpus = [], [], [], []
    for r in range(runs + 1):
        started, cpu = time.perf_counter(), time.process_time()
        report = pull(store, f"b3-{name}", cache, jobs=16, verify="full")
        took, took_cpu = time.perf_counter() - started, time.process_time() - cpu
        assert report.files_fetched == 0 and report.files_rehashed == count
        started, cpu = time.perf_counter(), time.process_time()
        raw_both(files)
        raw, raw_cpu = time.perf_counter() - started, time.process_time() - cpu
        if r:
            pulls.append(took)
            raws.append(raw)
            pull_cpus.append(took_cpu)
            raw_cpus.append(raw_cpu)
    p, q = statistics.median(pulls), statistics.median(raws)
    pc, qc = statistics.median(pull_cpus), statistics.median(raw_cpus)
    return {"name": name, "files": count, "pull_s": p, "raw_s": q, "x_raw": q / p, "pull_cpu": pc, "raw_cpu": qc}


def raw_both(files: list[str]) -> None:
    """The peer: each file read once into a reused buffer, hashed with XXH3 and BLAKE3."""
    buffer = memoryview(bytearray(4 << 20))
    for f in files:
        with open(f, "rb", buffering=0) as src:
            x, s = xxhash.xxh3_128(), blake3.blake3()
            while n := src.readinto(buffer):
                x.update(buffer[:n])
                s.update(buffer[:n])
            x.hexdigest(), s.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--cases", default="a,b")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: loop, pull, verify")
    args = smoke.parse(p, runs=1)
    skip = set(filter(None, args.skip.split(",")))
    (ROOT / "bench" / ".work").mkdir(parents=True, exist_ok=True)  # ignored by git; the disk pulls land on
    with tempfile.TemporaryDirectory(prefix="trust-", dir=ROOT / "bench" / ".work") as tmp:
        work = Path(tmp)
        if "loop" not in skip:
            for name, (wall, cpu) in loop_rates(16 << 20 if args.smoke else 1 << 30).items():
                print(f"loop {name}: {wall:.2f} GB/s wall, {cpu:.2f} GB/s of CPU", flush=True)
        if "pull" not in skip:
            for case in args.cases.split(","):
                r = pull_ratio(case, args.runs, work, SMOKE_CASES if args.smoke else CASES)
                print(
                    f"pull ({case}) {r['files']} x {r['size'] >> 10} KiB: blake3 {r['b3_s']:.3f} s, "
                    f"xxh3 only {r['xxh3_s']:.3f} s, ratio {r['ratio']:.3f}; pull's CPU {r['b3_cpu']:.2f} s vs "
                    f"{r['xxh3_cpu']:.2f} s",
                    flush=True,
                )
        if "verify" not in skip:
            for name, count, size in SMOKE_VERIFY if args.smoke else VERIFY:
                r = verify_full_ratio(name, count, size, args.runs, work)
                print(
                    f"verify full ({name}) {r['files']} files: pull {r['pull_s']:.3f} s, raw xxh3+blake3 loop "
                    f"{r['raw_s']:.3f} s, {r['x_raw']:.2f}x raw; CPU s {r['pull_cpu']:.3f} vs {r['raw_cpu']:.3f}, "
                    f"{r['raw_cpu'] / r['pull_cpu']:.2f}x raw",
                    flush=True,
                )


if __name__ == "__main__":
    main()
