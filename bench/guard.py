"""What `neffbuild.serve.guard` costs a warm request, on the tiny FLUX.2-klein pipeline.

One serving process (as the README's server: prepare, warm up, then requests at a listed shape):
requests with no guard, under guard(mode="record") and under guard(mode="fail") are interleaved
in rounds (the order rotates each round, so drift in the machine's load falls on every arm
alike); each arm's median request time is compared with the no-guard arm's. A request that hits
runs no compile callback, so what is measured is the guard's standing cost: the recorded call
wrapper is there in every arm, the fail arm adds torch's fail_on_recompile stance.

Run (the first run compiles the shape once into --work's cache dir, minutes on 2 cores; a cache
dir that holds it already, such as a release of the same unit pulled there, is used as it is):
    .venv/bin/python bench/guard.py [--rounds 200] [--calls 2] [--work /tmp/neffbuild-bench-guard] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import _smoke as smoke

ROOT = Path(__file__).resolve().parent.parent

PROCESS = r"""
import json, os, statistics, sys, time
manifest, model, events, rounds, calls = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
import torch, diffusers
import neffbuild.serve as serve
pipe = diffusers.Flux2KleinPipeline.from_pretrained(model, torch_dtype=torch.float32, local_files_only=True)
pipe.set_progress_bar_config(disable=True)
pipe = serve.prepare(pipe, manifest)
from neffbuild.errors import WarmupMiss
try:
    warm = serve.warmup(pipe, manifest)
except WarmupMiss:  # the setting-up run: it compiles into the cache dir, which is all it is for
    sys.exit(0)
def request():
    started = time.perf_counter()
    with torch.inference_mode():
        pipe(prompt="a photo of a cat", height=128, width=128, num_inference_steps=2, max_sequence_length=64,
             text_encoder_out_layers=[1], output_type="pt")
    return time.perf_counter() - started
guards = {mode: serve.guard(manifest, mode=mode, events=events, pipe=pipe) for mode in ("record", "fail")}
def block(arm):  # a server makes its guard once, at start-up; installing it is what the arm measures
    if arm == "none":
        return [request() for _ in range(calls)]
    with guards[arm]:
        return [request() for _ in range(calls)]
arms = ["none", "record", "fail"]
times = {a: [] for a in arms}
for r in range(rounds):
    for arm in arms[r % 3:] + arms[:r % 3]:
        times[arm].extend(block(arm))
lines = sum(1 for line in open(events) if line.strip()) if os.path.exists(events) else 0
print("RESULT " + json.dumps({"warmup_compiles": sum(s.compiles for s in warm.shapes), "times": times, "events": lines}))
"""

MANIFEST = """name = "bench-guard"
[[model]]
id = "klein"
model = "{model}"
pipeline = "Flux2KleinPipeline"
dtype = "float32"
backend = "inductor"
device = "cpu"
mode = "full"
components = ["transformer"]
shapes = {{ height = 128, width = 128, batch = 1 }}
[model.call]
prompt = "a photo of a cat"
num_inference_steps = 2
max_sequence_length = 64
text_encoder_out_layers = [1]
[model.env]
OMP_NUM_THREADS = "2"
"""


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def run(work: Path, rounds: int, calls: int, model: Path | None) -> dict:
    model = model or work / "tiny-flux2-klein"
    if not (model / "model_index.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_pipeline.py"), str(model)], check=True)
    manifest = work / "guard.toml"
    manifest.write_text(MANIFEST.format(model=model))
    events = work / "events.jsonl"
    events.unlink(missing_ok=True)
    cache = work / "cache"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "2"}
    if not cache.exists():  # compile once, so the measured process warms up from the cache as a server does
        setup = [sys.executable, "-c", PROCESS, str(manifest), str(model), str(events), "0", "0"]
        subprocess.run(setup, env=env, check=True, cwd=ROOT)
    done = subprocess.run(
        [sys.executable, "-c", PROCESS, str(manifest), str(model), str(events), str(rounds), str(calls)],
        env=env, capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:  # its warm-up compiled: the cache dir does not hold this unit (keys or settings differ)
        sys.exit(f"the serving process missed {cache} at warm-up and measured nothing:\n{done.stderr[-3000:]}")
    result = json.loads(line[7:])
    base = median(result["times"]["none"])
    result["median_s"] = {arm: round(median(t), 4) for arm, t in result["times"].items()}
    result["ratio"] = {arm: round(median(t) / base, 4) for arm, t in result["times"].items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=2, help="requests per arm per round")
    parser.add_argument("--work", type=Path, default=Path("/tmp/neffbuild-bench-guard"))
    parser.add_argument("--model", type=Path, help="the tiny pipeline's dir (default: made in --work)")
    args = smoke.parse(parser, rounds=1, calls=1)
    args.work.mkdir(parents=True, exist_ok=True)
    result = run(args.work, args.rounds, args.calls, args.model)
    n = len(result["times"]["none"])
    print(f"warm-up compiles: {result['warmup_compiles']}; events written: {result['events']}; {n} requests per arm")
    print("| arm | median request | vs no guard |\n|---|---:|---:|")
    for arm in ("none", "record", "fail"):
        print(f"| {arm} | {result['median_s'][arm] * 1000:.1f} ms | {result['ratio'][arm]:.3f}x |")


if __name__ == "__main__":
    main()
