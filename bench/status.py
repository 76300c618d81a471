"""`neffbuild status` from a pulled cache dir with no store: the whole command, interpreter start included.

A synthetic release (--units units of --files files each, recorded with this host's fingerprint,
so every unit is a hit) is published to a local store through the real publishing code and
pulled; the store is then deleted, so status can only read the cache dir. Each figure is the
whole process (`python -m neffbuild status --cache-dir DIR`), measured from outside, after one
warm-up run; min and median of --runs. It also says whether torch was imported on that path.

Run:
    .venv/bin/python bench/status.py [--units 40] [--files 50] [--runs 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _smoke as smoke

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neffbuild.build.publish import move_tag, publish_bundle, publish_release  # noqa: E402
from neffbuild.documents.bundles import BundleRecord, Timings  # noqa: E402
from neffbuild.documents.records import FileEntry, Release, ReleaseUnit, unit_key  # noqa: E402
from neffbuild.store import open_store  # noqa: E402
from neffbuild.store.base import Store  # noqa: E402
from tests.storekit import this_host, write_files  # noqa: E402

ENV = {"OMP_NUM_THREADS": "2"}


def publish(store: Store, src: Path, units: int, files: int, tag: str = "bench") -> None:
    """A release of `units` units recorded with this host's fingerprint (every unit hits here), tagged."""
    refs, entries = [], []
    for n in range(units):
        sources = write_files(src / f"u{n}", {f"{n:02x}/k{i:03d}.so": 2000 + 37 * i for i in range(files)}, seed=n)
        listed = tuple(
            FileEntry(path=s.path.relative_to(src / f"u{n}").as_posix(), size=s.size, digest=s.digest, blake3=s.blake3)
            for s in sources
        )
        unit = {
            "model": {"n": str(n)},
            "device": "cpu",
            "tensor_parallel": 1,
            "env": ENV,
            "shape": {"height": 64, "width": 64 + n, "batch": 1},
        }
        fingerprint = this_host(unit, ENV)
        record = BundleRecord(
            key=unit_key(unit, fingerprint), unit_id=f"m/64x{64 + n}x1", unit=unit, backend="inductor", fingerprint=fingerprint,
            files=listed, counters={}, timings=Timings(), created_at="2026-01-01T00:00:00+00:00", neffbuild_version="bench",
        )  # fmt: skip
        publish_bundle(store, record, sources, jobs=4)
        refs.append(ReleaseUnit(unit_id=record.unit_id, key=record.key))
        entries.extend(listed)
    release = Release(
        name="bench", manifest_digest="0" * 32, backend="inductor", cache_env="TORCHINDUCTOR_CACHE_DIR", env=ENV,
        fingerprint=this_host({}, ENV), units=tuple(refs), files=tuple(sorted(entries, key=lambda e: e.path)),
    )  # fmt: skip
    move_tag(store, tag, publish_release(store, release))


def neffbuild(*args: str) -> list[str]:
    return [sys.executable, "-m", "neffbuild", *args]


def timed(command: list[str], runs: int, env: dict[str, str]) -> list[float]:
    subprocess.run(command, capture_output=True, env=env, check=True)  # warm-up
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(command, capture_output=True, env=env, check=True)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=40)
    parser.add_argument("--files", type=int, default=50, help="files per unit")
    parser.add_argument("--runs", type=int, default=20)
    args = smoke.parse(parser, runs=1, units=2, files=3)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="neffbuild-status-bench-") as tmp:
        work = Path(tmp)
        publish(open_store(str(work / "store"), create=True, env={}), work / "src", args.units, args.files)
        cache = work / "cache"
        subprocess.run(
            neffbuild("pull", "bench", "--store", str(work / "store"), "--cache-dir", str(cache)),
            env=env,
            check=True,
            capture_output=True,
        )
        shutil.rmtree(work / "store")  # status reads the cache dir alone
        imports = subprocess.run([sys.executable, "-X", "importtime", "-m", "neffbuild", "status", "--cache-dir", str(cache)],
                                 env=env, capture_output=True, text=True, check=True).stderr  # fmt: skip
        torch_imported = any(line.split("|")[-1].strip() == "torch" for line in imports.splitlines())
        print(f"{args.units} units, {args.units * args.files} files; store deleted; torch imported: {torch_imported}")
        for label, extra in (("status (table)", ()), ("status --json", ("--json",))):
            times = timed(neffbuild("status", "--cache-dir", str(cache), *extra), args.runs, env)
            print(f"{label:16} min {min(times):.3f} s  median {statistics.median(times):.3f} s  ({args.runs} runs)")


if __name__ == "__main__":
    main()
