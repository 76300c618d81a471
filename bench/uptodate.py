"""Up to date: a no-op `build`, `status MANIFEST` and `plan` of the demo manifest, with the plan
cache off (every run imports torch and diffusers for plan's checks, as before the cache) against
a warm plan cache (units/plancache.py), in the same run, rounds interleaved.

The manifest is scripts/demo.sh's (manifests/tiny-flux2-klein.toml) pointed at --model: the demo's
tiny pipeline when .neffbuild/models/tiny-flux2-klein exists, else a dir of its configs only
(plan reads configs, never weights). The store holds a bundle for every unit of the plan, keyed
by this host's plan (a few small synthetic files each, published through the real publishing
code), so `build` finds every unit present; `status` reads a cache dir pulled from it. Each
figure is the whole process (`python -m neffbuild ...`, interpreter start included), measured
from outside after one warm-up run of each mode, as wall and as CPU time (user + system: on a
shared machine, what a quiet one would see as wall); the ratios are cached / off per round, median.

Run:
    .venv/bin/python bench/uptodate.py [--runs 7] [--commands build,status,plan]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _smoke as smoke

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neffbuild.build.publish import publish_bundle  # noqa: E402
from neffbuild.documents.bundles import BundleRecord, Timings  # noqa: E402
from neffbuild.documents.manifest import load_manifest  # noqa: E402
from neffbuild.documents.records import FileEntry  # noqa: E402
from neffbuild.store import open_store  # noqa: E402
from neffbuild.units.plan import make_plan  # noqa: E402
from tests.conftest import KLEIN_INDEX  # noqa: E402
from tests.storekit import write_files  # noqa: E402

WORK = ROOT / "bench" / ".work" / "uptodate"
DEMO_MODEL = ROOT / ".neffbuild" / "models" / "tiny-flux2-klein"


def model_dir(chosen: Path | None) -> Path:
    if chosen is not None:
        return chosen.resolve()
    if (DEMO_MODEL / "model_index.json").is_file():
        return DEMO_MODEL
    configs = WORK / "model"
    (configs / "transformer").mkdir(parents=True, exist_ok=True)
    (configs / "model_index.json").write_text(json.dumps(KLEIN_INDEX))
    (configs / "transformer" / "config.json").write_text('{"num_layers": 1}')
    return configs


def demo_manifest(model: Path) -> Path:
    text = (ROOT / "manifests" / "tiny-flux2-klein.toml").read_text()
    path = WORK / "tiny-flux2-klein.toml"
    path.write_text(text.replace('"../.neffbuild/models/tiny-flux2-klein"', json.dumps(str(model))))
    return path


def fill_store(manifest: Path, store_dir: Path, env: dict[str, str], plans: Path) -> None:
    """A bundle for every unit this host plans, so a build of the manifest has nothing to do. The
    plan is kept in the `cached` mode's plan cache: the set-up's processes then plan from it
    instead of importing torch again (nothing here is timed)."""
    plan = make_plan(load_manifest(manifest), env, cache=plans)
    store = open_store(str(store_dir), create=True, env={})
    for n, unit in enumerate(plan.units):
        src = WORK / "src" / str(n)
        sources = write_files(src, {f"{n:02x}/k{i}.so": 3000 + i for i in range(3)}, seed=n)
        listed = tuple(
            FileEntry(path=s.path.relative_to(src).as_posix(), size=s.size, digest=s.digest, blake3=s.blake3)
            for s in sources
        )
        record = BundleRecord(
            key=unit.key, unit_id=unit.unit_id, unit=dict(unit.normalized), backend=plan.backend_name,
            fingerprint=dict(unit.fingerprint), files=listed, counters={}, timings=Timings(),
            created_at="2026-01-01T00:00:00+00:00", neffbuild_version="bench",
        )  # fmt: skip
        publish_bundle(store, record, sources, jobs=2)


def run(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one process: on a shared machine the CPU time is what a quiet one
    would see as wall time, the command being one thread."""
    cpu = _children_cpu()
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "neffbuild", *command], capture_output=True, text=True, env=env)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"neffbuild {' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return took, _children_cpu() - cpu


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def imports_torch(command: list[str], env: dict[str, str]) -> bool:
    found = subprocess.run([sys.executable, "-X", "importtime", "-m", "neffbuild", *command],
                           capture_output=True, text=True, env=env, check=True).stderr  # fmt: skip
    return any(line.split("|")[-1].strip() == "torch" for line in found.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="rounds; each runs every command in both modes")
    parser.add_argument("--commands", default="build,status,plan")
    parser.add_argument("--model", type=Path, help="model dir [default: the demo's tiny pipeline, or its configs]")
    args = smoke.parse(parser, runs=1, commands="plan")
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    base = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    base.pop("NEFFBUILD_STORE", None)
    manifest = demo_manifest(model_dir(args.model))
    store, cache = WORK / "store", WORK / "cache"
    plans = WORK / "plans"
    modes = {"off": {**base, "NEFFBUILD_PLAN_CACHE": "off"}, "cached": {**base, "NEFFBUILD_PLAN_CACHE": str(plans)}}
    fill_store(manifest, store, modes["cached"], plans)
    run(["build", str(manifest), "--store", str(store)], modes["cached"])  # the tag
    run(["pull", "tiny-flux2-klein", "--store", str(store), "--cache-dir", str(cache)], base)
    commands = {
        "build": ["build", str(manifest), "--store", str(store)],
        "status": ["status", str(manifest), "--store", str(store), "--cache-dir", str(cache)],
        "plan": ["plan", str(manifest)],
    }
    chosen = [c for c in args.commands.split(",") if c]
    run(commands[chosen[0]], modes["cached"])  # a hit on the cache fill_store filled
    torch = {(c, m): imports_torch(commands[c], env) for c in chosen for m, env in modes.items()}  # warm-ups
    times: dict[tuple[str, str], list[tuple[float, float]]] = {(c, m): [] for c in chosen for m in modes}
    for r in range(args.runs):
        for c in chosen:
            for m in list(modes)[:: 1 if r % 2 == 0 else -1]:
                times[c, m].append(run(commands[c], modes[m]))
    load = os.getloadavg()[0]
    print(f"demo manifest, {args.runs} rounds; load {load:.1f} on {os.cpu_count()} CPUs")
    print(
        "| command | plan cache | wall min s | wall median s | CPU median s | cached / off, wall | cached / off, CPU | imports torch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in chosen:
        pairs = list(zip(times[c, "cached"], times[c, "off"], strict=True))
        wall = statistics.median(a[0] / b[0] for a, b in pairs)
        cpu = statistics.median(a[1] / b[1] for a, b in pairs)
        for m in modes:
            t = [w for w, _ in times[c, m]]
            cpu_t = statistics.median(u for _, u in times[c, m])
            shown = f"**{wall:.2f}** | **{cpu:.2f}**" if m == "cached" else "1.00 | 1.00"
            print(f"| {c} | {m} | {min(t):.2f} | {statistics.median(t):.2f} | {cpu_t:.2f} | {shown} | {torch[c, m]} |")


if __name__ == "__main__":
    main()
