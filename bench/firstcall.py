"""How long a fresh serving process takes to its first image, artifact `cache` against `package`.

The tiny FLUX.2-klein pipeline, transformer and `vae.decode` listed, built once per artifact kind
into a local store and pulled into a cache dir of its own (both kept in --work, so a second run
measures without building). Then, for each of --processes rounds, one fresh process per kind
(the order alternates each round, so drift in the machine's load falls on both alike) applies the
release's exports and times: interpreter start and imports, pipeline load, `prepare` (the
artifact load: Dynamo wrappers for `cache`, the packages for `package`), then per shape the first
call and the median of --steady later calls. The table has each term's median over the processes,
and first minus steady per shape: what a request pays for arriving first.

Run (the first run builds both releases: many minutes on 2 cores):
    .venv/bin/python bench/firstcall.py [--processes 5] [--steady 3] [--work /tmp/neffbuild-bench-firstcall]
--blocks 5,20 makes the larger model: FLUX.2-klein-4B's block counts at the tiny width (use
another --work: the releases kept there are the model's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _smoke as smoke

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("cache", "package")

PROCESS = r"""
import json, os, statistics, sys, time
spawned, exports, manifest, model, steady = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
os.environ.update(json.loads(exports))
import torch, diffusers
import neffbuild.serve as serve
marks = {"start_imports": time.time() - spawned}
t = time.perf_counter()
pipe = diffusers.Flux2KleinPipeline.from_pretrained(model, torch_dtype=torch.float32, local_files_only=True)
pipe.set_progress_bar_config(disable=True)
marks["pipeline_load"] = time.perf_counter() - t
t = time.perf_counter()
pipe = serve.prepare(pipe, manifest)
marks["artifact_load"] = time.perf_counter() - t
def call(width):
    started = time.perf_counter()
    with torch.inference_mode():
        pipe(prompt="a photo of a cat", height=128, width=width, num_inference_steps=2, max_sequence_length=64,
             text_encoder_out_layers=[1], output_type="pt")
    return time.perf_counter() - started
widths = json.loads(sys.argv[6])
shapes = {}
for width in widths:
    first = call(width)
    shapes[f"128x{width}"] = {"first": first, "steady": statistics.median(call(width) for _ in range(steady))}
print("RESULT " + json.dumps({**marks, "shapes": shapes}))
"""


def neffbuild(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "neffbuild", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"neffbuild {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def manifest_for(kind: str, work: Path, model: Path, widths: list[int]) -> Path:
    text = (ROOT / "manifests" / "tiny-flux2-klein.toml").read_text()
    text = text.replace('"../.neffbuild/models/tiny-flux2-klein"', f'"{model}"')
    text = text.replace('components = ["transformer"]', 'components = ["transformer", "vae.decode"]')
    text = text.replace("width = [128, 256]", f"width = [{', '.join(map(str, widths))}]")
    path = work / f"{kind}.toml"
    path.write_text(text + ('\n[model.compile]\nartifact = "package"\n' if kind == "package" else ""))
    return path


def pulled(kind: str, work: Path, model: Path, widths: list[int], store: Path) -> tuple[Path, str]:
    """The kind's manifest and its release's exports, building and pulling once per --work (a
    --store that holds the units already makes the build a lookup)."""
    manifest = manifest_for(kind, work, model, widths)
    cache, exports = work / f"{kind}-cache", work / f"{kind}-exports.json"
    if not exports.exists():
        started = time.perf_counter()
        release = json.loads(neffbuild("build", str(manifest), "--store", str(store), "--json"))["release_id"]
        print(f"built {kind} in {time.perf_counter() - started:.0f} s", flush=True)
        neffbuild("pull", release, "--store", str(store), "--cache-dir", str(cache))
        exports.write_text(neffbuild("env", "--cache-dir", str(cache), "--json"))
    return manifest, exports.read_text()


def one_process(manifest: Path, exports: str, model: Path, steady: int, widths: list[int]) -> dict:
    args = [str(time.time()), exports, str(manifest), str(model), str(steady), json.dumps(widths)]
    done = subprocess.run(
        [sys.executable, "-c", PROCESS, *args], capture_output=True, text=True, cwd=ROOT, env={**os.environ}
    )
    if done.returncode != 0:
        raise SystemExit(f"serving process failed:\n{done.stderr[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def table(runs: dict[str, list[dict]], widths: list[int]) -> list[str]:
    lines = [
        "| artifact | shape | start + imports s | pipeline load s | artifact load s | first call s | steady call s "
        "| first − steady s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, results in runs.items():
        med = {k: statistics.median(r[k] for r in results) for k in ("start_imports", "pipeline_load", "artifact_load")}
        for width in widths:
            shape = f"128x{width}"
            first = statistics.median(r["shapes"][shape]["first"] for r in results)
            steady = statistics.median(r["shapes"][shape]["steady"] for r in results)
            lines.append(
                f"| {kind} | {shape} | {med['start_imports']:.2f} | {med['pipeline_load']:.2f} | "
                f"{med['artifact_load']:.2f} | {first:.3f} | {steady:.3f} | {first - steady:.3f} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--steady", type=int, default=3)
    parser.add_argument("--widths", default="128,256", help="shapes 128xW, built and measured")
    parser.add_argument("--work", type=Path, default=Path("/tmp/neffbuild-bench-firstcall"))
    parser.add_argument("--model", type=Path, help="the tiny pipeline's dir (default: made in --work)")
    parser.add_argument(
        "--blocks", default="2,2", help="the made model's double,single-stream block counts (5,20: FLUX.2-klein-4B's)"
    )
    parser.add_argument("--store", type=Path, help="the local store to build into (default: in --work)")
    args = smoke.parse(parser, processes=1, steady=1, widths="128", work=Path("/tmp/neffbuild-bench-firstcall-smoke"))
    widths = [int(w) for w in args.widths.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.model or args.work / f"tiny-flux2-klein-{args.blocks.replace(',', '-')}"
    if not model.exists():
        script = str(ROOT / "scripts" / "make_tiny_pipeline.py")
        subprocess.run([sys.executable, script, str(model), "--blocks", args.blocks], check=True)
    store = args.store or args.work / "store"
    releases = {kind: pulled(kind, args.work, model, widths, store) for kind in KINDS}
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for r in range(args.processes):
        for kind in KINDS[r % 2 :] + KINDS[: r % 2]:
            manifest, exports = releases[kind]
            runs[kind].append(one_process(manifest, exports, model, args.steady, widths))
    bundle = {k: sum(p.stat().st_size for p in (args.work / f"{k}-cache").rglob("*") if p.is_file()) for k in KINDS}
    print(f"cache dir bytes: {json.dumps(bundle)}; processes per kind: {args.processes}")
    print("\n".join(table(runs, widths)))


if __name__ == "__main__":
    main()
