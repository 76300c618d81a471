"""Building on one machine: `--jobs 1` against `--jobs 2` and two concurrent shards, and where the time goes.

The tiny FLUX.2-klein pipeline (scripts/make_tiny_pipeline.py, random weights, made offline) with
--shapes widths at height 128 is built three ways, each into a fresh local store, one after the
other, every unit really compiled (Inductor, CPU):
- `jobs1`: `neffbuild build --jobs 1`;
- `jobs2`: `neffbuild build --jobs 2`;
- `shards`: `neffbuild build --shard 0/2` and `--shard 1/2` as two processes at once, then
  `neffbuild release` (the fan-in), timed from the first start to the release's end.
Each is the whole process measured from outside. Per unit, six phases: `queue` (from its build
process's start to its worker's start: planning, the store's checks, waiting for a job slot; read
from the live progress lines, each stamped as it arrives), then from the build's `--report`:
`load` (worker start, imports, pipeline load), `trace` (Dynamo turning the call's Python into
graphs), `compile` (the compile backend on those graphs: AOTAutograd, Inductor, the C++
compiler), `run` (the rest of the first call), `publish` (hash and upload); and per build the
`fan-in`: `neffbuild release` for the shards, the time from the last unit's end to the process's
exit for a one-process build (its release and tag move). Peak RSS per unit from the report.
Ratios are against `jobs1` of the same round; the modes rotate their order per round.

Run:
    .venv/bin/python bench/build.py [--shapes 4] [--rounds 1] [--modes jobs1,jobs2,shards] [--model DIR]
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
import threading
import time
from pathlib import Path

import _smoke as smoke

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work" / "build"
NB = [sys.executable, "-m", "neffbuild"]
WIDTHS = (128, 192, 256, 320, 384, 448, 512, 576)
PHASES = ("queue", "load", "trace", "compile", "run", "publish")
_STARTED = re.compile(r"^(?P<unit>\S+): loading \(after [0-9.]+ s\)$")
_ENDED = re.compile(r"^(?P<unit>\S+): built in [0-9.]+ s$")


def manifest(model: Path, shapes: int) -> Path:
    text = (ROOT / "manifests" / "tiny-flux2-klein.toml").read_text()
    text = text.replace('"../.neffbuild/models/tiny-flux2-klein"', f'"{model}"')
    widths = ", ".join(str(w) for w in WIDTHS[:shapes])
    text = re.sub(r"width = \[[^\]]*\]", f"width = [{widths}]", text)
    path = WORK / f"tiny-{shapes}.toml"
    path.write_text(text)
    return path


class Build:
    """A build started in the background, its progress lines stamped with seconds since its start."""

    def __init__(self, m: Path, store: Path, tag: str, *flags: str) -> None:
        self.err, self.report = WORK / f"{tag}.err", WORK / f"{tag}.report.json"
        self.lines: list[tuple[float, str]] = []
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [*NB, "build", str(m), "--store", str(store), "--report", str(self.report), *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with self.err.open("w") as out:
            for line in self.proc.stderr:
                self.lines.append((time.monotonic() - self.started, line.strip()))
                out.write(line)

    def finish(self) -> float:
        """Waits for the build (it must succeed); the seconds from its last unit's end to its exit."""
        if self.proc.wait() != 0:
            self.reader.join()
            sys.exit(f"build failed:\n{self.err.read_text()[-3000:]}")
        ended = time.monotonic() - self.started
        self.reader.join()
        last = max((at for at, line in self.lines if _ENDED.match(line)), default=ended)
        return ended - last

    def units(self) -> dict[str, dict[str, float]]:
        """Seconds per phase, per unit built."""
        queued = {m["unit"]: at for at, line in self.lines if (m := _STARTED.match(line))}
        out = {}
        for u in json.loads(self.report.read_text())["units"]:
            if u["status"] == "built":
                phases = {name: u["phases"].get(name, 0.0) for name in PHASES}
                out[u["unit_id"]] = {**phases, "queue": queued.get(u["unit_id"], 0.0), "peak": u["peak_rss"]}
        return out


def run_mode(mode: str, m: Path, round_: int) -> dict:
    store = WORK / f"store-{mode}-{round_}"
    shutil.rmtree(store, ignore_errors=True)
    started = time.monotonic()
    if mode == "shards":
        builds = [Build(m, store, f"{mode}{i}", "--shard", f"{i}/2") for i in (0, 1)]
        for b in builds:
            b.finish()
        fanin_started = time.monotonic()
        subprocess.run([*NB, "release", str(m), "--store", str(store)], check=True, capture_output=True)
        fanin = time.monotonic() - fanin_started
    else:
        builds = [Build(m, store, mode, "--jobs", mode[-1])]
        fanin = builds[0].finish()
    wall = time.monotonic() - started
    units = {}
    for b in builds:
        units |= b.units()
    return {"wall": wall, "units": units, "fanin": fanin}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=int, default=4, choices=range(1, len(WIDTHS) + 1))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--modes", default="jobs1,jobs2,shards", help="comma-separated, of jobs1, jobs2, shards")
    p.add_argument("--model", type=Path, help="the tiny pipeline's dir (default: made in bench/.work/build)")
    args = smoke.parse(p, shapes=1, modes="jobs1")
    modes = [mode for mode in args.modes.split(",") if mode]
    if not modes or set(modes) - {"jobs1", "jobs2", "shards"}:
        sys.exit(f"--modes: {args.modes!r}: give jobs1, jobs2 and/or shards, comma-separated")
    WORK.mkdir(parents=True, exist_ok=True)
    model = args.model or WORK / "model"
    if not (model / "model_index.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_pipeline.py"), str(model)], check=True)
    m = manifest(model, args.shapes)
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            results[mode].append(run_mode(mode, m, r))
            print(f"round {r + 1}: {mode}: {results[mode][-1]['wall']:.1f} s", file=sys.stderr)
    print(
        f"{args.shapes} shapes, {args.rounds} round(s), {os.cpu_count()} CPUs; "
        f"load average before: {load_before:.1f}, after: {os.getloadavg()[0]:.1f}\n"
    )
    print("| mode | wall s (median) | speed-up vs jobs 1 | fan-in s |")
    print("|---|---|---|---|")
    base = statistics.median(x["wall"] for x in results["jobs1"]) if "jobs1" in results else None
    for mode in modes:
        wall = statistics.median(x["wall"] for x in results[mode])
        fanin = statistics.median(x["fanin"] for x in results[mode])
        ratio = f"{base / wall:.2f}x" if base else "-"
        print(f"| {mode} | {wall:.1f} | {ratio} | {fanin:.1f} |")
    print("\nPer unit, last round (seconds per phase; peak RSS):\n")
    print(f"| mode | unit | {' | '.join(PHASES)} | peak RSS MiB |")
    print("|---|---|" + "---|" * len(PHASES) + "---|")
    shares = []
    for mode in modes:
        last = results[mode][-1]
        for unit, t in sorted(last["units"].items()):
            cells = " | ".join(f"{t[name]:.1f}" for name in PHASES)
            print(f"| {mode} | {unit} | {cells} | {t['peak'] / 2**20:.0f} |")
        total = {name: sum(t[name] for t in last["units"].values()) for name in PHASES}
        summed = sum(total.values()) or 1.0
        shares.append(f"- {mode}: " + ", ".join(f"{name} {100 * total[name] / summed:.0f}%" for name in PHASES))
    print("\nShare of the units' summed time, per phase:\n")
    print("\n".join(shares))


if __name__ == "__main__":
    main()
