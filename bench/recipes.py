"""What a compile recipe costs and what prebuilding saves, on the tiny FLUX.2-klein pipeline.

Per recipe (one manifest entry each, transformer compiled, `full` unless named): a fresh process
compiles into an empty cache dir (cold: load, prepare, the first call of each shape), then another
fresh process runs against that same cache dir (warm: what a server on a pulled cache pays), then
the steady-state call (median of 3 more calls). Every process applies the recipe with
`neffbuild.serve.prepare`, as a server would. Static vs dynamic compare the same three sizes.

The warm first call is broken down (for `full` and `regional`): process start and imports,
pipeline load, prepare (recipe + torch.compile wrapping), then the first call split by Dynamo's
own timers into tracing (Dynamo and AOTAutograd front end), cache lookup and load (Inductor's
backend call on a hit) and the rest (running the graphs and the eager parts).

Run (the 2-core VM: minutes per cold compile):
    .venv/bin/python bench/recipes.py [--recipes default,autotune,...] [--out bench/recipes.json] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _smoke as smoke

ROOT = Path(__file__).resolve().parent.parent
SIZES = [(128, 128), (128, 256), (128, 384)]
GUIDE_FLAGS = (
    "{ conv_1x1_as_mm = true, coordinate_descent_tuning = true, epilogue_fusion = false, "
    "coordinate_descent_check_all_directions = true }"
)
# name -> (mode, components, sizes, [model.compile] TOML)
RECIPES = {
    "default": ("full", '["transformer"]', SIZES[:1], ""),
    "regional": ("regional", '["transformer"]', SIZES[:1], ""),
    "autotune": ("full", '["transformer"]', SIZES[:1], '[model.compile]\nmode = "max-autotune-no-cudagraphs"\n'),
    "guide-flags": ("full", '["transformer"]', SIZES[:1], f"[model.compile]\ninductor = {GUIDE_FLAGS}\n"),
    "layout": ("full", '["transformer", "vae.decode"]', SIZES[:1],
               '[model.compile.components.transformer]\nfuse_qkv = true\n'
               '[model.compile.components."vae.decode"]\nmemory_format = "channels_last"\n'),
    "static-3": ("full", '["transformer"]', SIZES, ""),
    "dynamic-3": ("full", '["transformer"]', SIZES, "[model.compile]\ndynamic = true\nduck_shape = false\n"),
    # torch's default dynamic: a static graph for the first size, then the automatic-dynamic one.
    "auto-3": ("full", '["transformer"]', SIZES, '[model.compile]\ndynamic = "auto"\n'),
    "int8": ("full", '["transformer"]', SIZES[:1], '[model.compile]\nquantize = "int8-dynamic"\n'),
}  # fmt: skip

# One process: imports, load, prepare, first call per size, steady calls; times as JSON.
PROCESS = """
import time; started = time.perf_counter()
import json, sys, statistics, torch, diffusers, neffbuild.serve
from torch._dynamo.utils import counters, compilation_time_metrics
imported = time.perf_counter()
model, manifest, sizes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
pipe = diffusers.Flux2KleinPipeline.from_pretrained(model, torch_dtype=torch.float32, local_files_only=True)
loaded = time.perf_counter()
neffbuild.serve.prepare(pipe, manifest)
prepared = time.perf_counter()
def call(h, w):
    with torch.inference_mode():
        pipe(prompt="a photo of a cat", num_inference_steps=2, max_sequence_length=64, text_encoder_out_layers=(1,),
             height=h, width=w, output_type="pt")
first = []
for h, w in sizes:
    t = time.perf_counter(); call(h, w); first.append(time.perf_counter() - t)
metrics = {k: sum(v) for k, v in compilation_time_metrics.items()}
steady = []
for h, w in sizes:
    runs = []
    for _ in range(3):
        t = time.perf_counter(); call(h, w); runs.append(time.perf_counter() - t)
    steady.append(statistics.median(runs))
print(json.dumps({"imports": imported - started, "load": loaded - imported, "prepare": prepared - loaded,
                  "first": first, "steady": steady, "metrics": metrics,
                  "misses": counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"],
                  "hits": counters["inductor"]["fxgraph_cache_hit"]}))
"""


def manifest_for(name: str, model: Path, out: Path) -> Path:
    mode, components, sizes, recipe = RECIPES[name]
    widths = ", ".join(str(w) for _, w in sizes)
    out.write_text(
        f'name = "bench-{name}"\n[[model]]\nid = "{name}"\nmodel = "{model}"\npipeline = "Flux2KleinPipeline"\n'
        f'dtype = "float32"\nmode = "{mode}"\ncomponents = {components}\nshapes = {{ height = 128, width = [{widths}] }}\n'
        '[model.call]\nprompt = "a photo of a cat"\nnum_inference_steps = 2\nmax_sequence_length = 64\n'
        'text_encoder_out_layers = [1]\n[model.env]\nOMP_NUM_THREADS = "2"\n' + recipe
    )
    return out


def run_process(model: Path, manifest: Path, cache: Path, sizes: list[tuple[int, int]]) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "2",
           "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0", "PYTHONPATH": str(ROOT)}  # fmt: skip
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", PROCESS, str(model), str(manifest), json.dumps(sizes)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall"] = time.perf_counter() - started
    result["start"] = result["wall"] - result["imports"] - result["load"] - result["prepare"] - sum(result["first"]) - 3 * sum(result["steady"])  # fmt: skip
    return result


def bundle_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and "locks" not in p.parts)


def bench(name: str, model: Path, work: Path) -> dict:
    sizes = RECIPES[name][2]
    manifest = manifest_for(name, model, work / f"{name}.toml")
    cache = work / f"cache-{name}"
    cold = run_process(model, manifest, cache, sizes)
    size = bundle_bytes(cache)
    warm = run_process(model, manifest, cache, sizes)
    return {"recipe": name, "sizes": sizes, "cold": cold, "warm": warm, "bytes": size}


def breakdown(warm: dict) -> dict:
    """The warm first call (first size) split by Dynamo's timers (seconds, summed over the process)."""
    metrics = warm["metrics"]
    front = metrics.get("_compile.compile_inner", 0.0)
    backend = metrics.get("OutputGraph.call_user_compiler", 0.0)
    return {
        "start": warm["start"], "imports": warm["imports"], "load": warm["load"], "prepare": warm["prepare"],
        "tracing": max(0.0, front - backend), "cache lookup+load": backend,
        "run": max(0.0, sum(warm["first"]) - front),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model", type=Path, help="the tiny pipeline's dir (default: made in a temporary dir)")
    # The smoke's recipe: `regional` goes through every path `default` does (the breakdown too), in
    # about 3/4 of its compile; which recipe it measures is not what the smoke checks.
    args = smoke.parse(parser, recipes="regional")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model or work / "tiny-flux2-klein"
        if args.model is None:
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_pipeline.py"), str(model)], check=True,
                           capture_output=True)  # fmt: skip
        rows = []
        for name in args.recipes.split(","):
            row = bench(name, model, work)
            if name in ("default", "regional"):
                row["breakdown"] = breakdown(row["warm"])
            rows.append(row)
            print(table_row(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


def table_row(row: dict) -> str:
    cold, warm = row["cold"], row["warm"]
    first = lambda r: " / ".join(f"{s:.2f}" for s in r["first"])  # noqa: E731
    steady = " / ".join(f"{s * 1000:.0f}" for s in warm["steady"])
    return (
        f"| {row['recipe']} | {len(row['sizes'])} | {sum(cold['first']):.1f} | {row['bytes'] / 1e6:.1f} | "
        f"{first(warm)} | {steady} | {warm['misses']} |"
    )


if __name__ == "__main__":
    main()
