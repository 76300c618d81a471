"""Building on one machine: `--jobs 1` against `--jobs 2` and two concurrent shards, and where the time goes.

The tiny FLUX.2-klein pipeline (scripts/make_tiny_pipeline.py, random weights, made offline) with
--shapes widths at height 128 is built three ways, each into a fresh local store, one after the
other, every unit really compiled (Inductor, CPU):
- `jobs1`: `neffbuild build --jobs 1`;
- `jobs2`: `neffbuild build --jobs 2`;
- `shards`: `neffbuild build --shard 0/2` and `--shard 1/2` as two processes at once, then
  `neffbuild release` (the fan-in), timed from the first start to the release's end.
Each is the whole process measured from outside. Per unit, from the build's plain progress lines
(a non-terminal stderr prints one line per phase with the time since the unit started) and its
`--report`: `loading` to `compiling` (worker process start, imports and pipeline load),
`compiling` to `publishing` (trace, compile and the first call), `publishing` to `built` (hash
and publish), and the worker's peak RSS. Ratios are against `jobs1` of the same round;
the modes rotate their order per round.

Run:
    .venv/bin/python bench/build.py [--shapes 4] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _smoke as smoke

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work" / "build"
NB = [sys.executable, "-m", "neffbuild"]
WIDTHS = (128, 192, 256, 320, 384, 448, 512, 576)
PHASES = ("load", "compile", "publish")
_LINE = re.compile(
    r"^(?P<unit>\S+): (?:(?P<phase>loading|compiling|publishing) \(after (?P<at>[0-9.]+) s\)|built in (?P<done>[0-9.]+) s)$"
)


def manifest(model: Path, shapes: int) -> Path:
    text = (ROOT / "manifests" / "tiny-flux2-klein.toml").read_text()
    text = text.replace('"../.neffbuild/models/tiny-flux2-klein"', f'"{model}"')
    widths = ", ".join(str(w) for w in WIDTHS[:shapes])
    text = re.sub(r"width = \[[^\]]*\]", f"width = [{widths}]", text)
    path = WORK / f"tiny-{shapes}.toml"
    path.write_text(text)
    return path


def build(m: Path, store: Path, tag: str, *flags: str) -> tuple[subprocess.Popen[str], Path, Path]:
    """A build started in the background: (process, its stderr file, its report file)."""
    err, report = WORK / f"{tag}.err", WORK / f"{tag}.report.json"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [*NB, "build", str(m), "--store", str(store), "--report", str(report), *flags],
            stdout=subprocess.DEVNULL, stderr=stderr, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
    return proc, err, report


def finished(proc: subprocess.Popen[str], err: Path) -> None:
    if proc.wait() != 0:
        sys.exit(f"build failed:\n{err.read_text()[-3000:]}")


def phases(err: Path) -> dict[str, dict[str, float]]:
    """Seconds per phase, per unit, from the plain progress lines."""
    marks: dict[str, dict[str, float]] = {}
    for line in err.read_text().splitlines():
        match = _LINE.match(line.strip())
        if match:
            at = match["at"] if match["phase"] else match["done"]
            marks.setdefault(match["unit"], {})[match["phase"] or "built"] = float(at)
    out = {}
    for unit, m in marks.items():
        edges = [m.get("loading", 0.0), m.get("compiling", 0.0), m.get("publishing", 0.0), m.get("built", 0.0)]
        out[unit] = {name: round(b - a, 1) for name, a, b in zip(PHASES, edges, edges[1:], strict=False)}
    return out


def peaks(*reports: Path) -> dict[str, int]:
    found = {}
    for r in reports:
        for u in json.loads(r.read_text())["units"]:
            found[u["unit_id"]] = u["peak_rss"]
    return found


def run_mode(mode: str, m: Path, round_: int) -> dict:
    store = WORK / f"store-{mode}-{round_}"
    shutil.rmtree(store, ignore_errors=True)
    started = time.monotonic()
    if mode == "shards":
        runs = [build(m, store, f"{mode}{i}", "--shard", f"{i}/2") for i in (0, 1)]
        for proc, err, _ in runs:
            finished(proc, err)
        subprocess.run([*NB, "release", str(m), "--store", str(store)], check=True, capture_output=True)
    else:
        runs = [build(m, store, mode, "--jobs", mode[-1])]
        finished(*runs[0][:2])
    wall = time.monotonic() - started
    units = {}
    for _, err, _ in runs:
        units |= phases(err)
    return {"wall": wall, "units": units, "peaks": peaks(*(r for _, _, r in runs))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=int, default=4, choices=range(1, len(WIDTHS) + 1))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--modes", default="jobs1,jobs2,shards", help="comma-separated, jobs1 among them (the base)")
    args = smoke.parse(p, shapes=1, modes="jobs1")
    WORK.mkdir(parents=True, exist_ok=True)
    model = WORK / "model"
    if not (model / "model_index.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_pipeline.py"), str(model)], check=True)
    m = manifest(model, args.shapes)
    modes = args.modes.split(",")
    if "jobs1" not in modes or not set(modes) <= {"jobs1", "jobs2", "shards"}:
        p.error("--modes: jobs1, jobs2, shards; jobs1 among them")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            results[mode].append(run_mode(mode, m, r))
            print(f"round {r + 1}: {mode}: {results[mode][-1]['wall']:.1f} s", file=sys.stderr)
    print(
        f"{args.shapes} shapes, {args.rounds} round(s), {os.cpu_count()} CPUs; load average before: {os.getloadavg()[0]:.1f}\n"
    )
    print("| mode | wall s (median) | speed-up vs jobs 1 |")
    print("|---|---|---|")
    base = statistics.median(x["wall"] for x in results["jobs1"])
    for mode in modes:
        wall = statistics.median(x["wall"] for x in results[mode])
        print(f"| {mode} | {wall:.1f} | {base / wall:.2f}x |")
    print(
        "\nPer unit, last round (seconds: worker start, imports and pipeline load / trace+compile+first call / hash+publish; peak RSS):\n"
    )
    print("| mode | unit | load | compile | publish | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    for mode in modes:
        last = results[mode][-1]
        for unit, t in sorted(last["units"].items()):
            peak = last["peaks"].get(unit, 0) / 2**20
            print(f"| {mode} | {unit} | {t['load']} | {t['compile']} | {t['publish']} | {peak:.0f} |")


if __name__ == "__main__":
    main()
