"""Compile recipes end to end on the tiny pipeline (conftest's, one block of each kind): five recipe entries,
each built, pulled into another path, replayed with 0 compiles, and served by fresh processes that call
neffbuild.serve.prepare (or paste `neffbuild recipe`'s plain Python, or are written by hand from
the diffusers guide) and count 0 compiler-cache misses; a server compiling with the default
recipe misses against the autotune entry's cache.

Each entry is its own release (built once per test run, by the first of its tests), and its tests
are one xdist group: the five builds spread over both workers instead of one build of all five
holding one worker for most of the suite. The entries: (a) max-autotune-no-cudagraphs with the diffusers guide's Inductor
flags, (b) channels_last on vae.decode and fused QKV on the transformer, (c) dynamic shapes
(duck_shape = false) over two sizes, served by one graph, (d) torch's default dynamic ("auto")
with the guide's mode and flags over two sizes, (e) torchao int8 dynamic quantization with a
layer filter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

# Five real builds (eight units: a dynamic entry's units each compile its graphs), one per entry.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# 64 and 128 image tokens (64 text tokens: distinct symbols). Two sizes show one graph serving
# another size; a third was one more unit compiled and asserted nothing new.
DYNAMIC_WIDTHS = [128, 256]
AUTO_WIDTHS = [128, 256]  # "auto": the first a static graph, the second the automatic-dynamic one
GUIDE_FLAGS = (
    "{ conv_1x1_as_mm = true, coordinate_descent_tuning = true, epilogue_fusion = false, "
    "coordinate_descent_check_all_directions = true }"
)
CALL = """
[model.call]
prompt = "a photo of a cat"
num_inference_steps = 2
max_sequence_length = 64
text_encoder_out_layers = [1]

[model.env]
OMP_NUM_THREADS = "2"
"""


def recipe_entry(model: Path, entry_id: str) -> str:
    components, shapes, recipe = {
        "autotune": ('["transformer"]', "{ height = 128, width = 128 }",
                     f'[model.compile]\nmode = "max-autotune-no-cudagraphs"\ninductor = {GUIDE_FLAGS}\n'),
        "layout": ('["transformer", "vae.decode"]', "{ height = 128, width = 128 }",
                   '[model.compile.components.transformer]\nfuse_qkv = true\n'
                   '[model.compile.components."vae.decode"]\nmemory_format = "channels_last"\n'),
        "dynamic": ('["transformer"]', f"{{ height = 128, width = {DYNAMIC_WIDTHS} }}",
                    "[model.compile]\ndynamic = true\nduck_shape = false\n"),
        "auto": ('["transformer"]', f"{{ height = 128, width = {AUTO_WIDTHS} }}",
                 f'[model.compile]\nmode = "max-autotune"\ninductor = {GUIDE_FLAGS}\ndynamic = "auto"\n'),
        "int8": ('["transformer"]', "{ height = 128, width = 128 }",
                 '[model.compile]\nquantize = "int8-dynamic"\nquantize_skip = ["proj_out"]\n'),
    }[entry_id]  # fmt: skip
    return (
        f'\n[[model]]\nid = "{entry_id}"\nmodel = "{model}"\npipeline = "Flux2KleinPipeline"\ndtype = "float32"\n'
        f"components = {components}\nshapes = {shapes}\n{CALL}\n{recipe}"
    )


# The units each entry's build must report, in the manifest's order.
UNITS = {
    "autotune": ["autotune/128x128x1"],
    "layout": ["layout/128x128x1"],
    "dynamic": [f"dynamic/128x{w}x1" for w in DYNAMIC_WIDTHS],
    "auto": [f"auto/128x{w}x1" for w in AUTO_WIDTHS],
    "int8": ["int8/128x128x1"],
}


def grouped(entry: str) -> pytest.MarkDecorator:
    """The entry's tests share its build: one xdist group (scripts/test.sh runs --dist loadgroup)."""
    return pytest.mark.xdist_group(f"recipe-{entry}")


@dataclass(frozen=True)
class Release:
    manifest: Path
    store: Path
    build: dict  # `build --json`
    cache: Path  # pulled into another path
    exports: dict[str, str]


@pytest.fixture(scope="module")
def release_of(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, cli) -> Callable[[str], Release]:
    """`release_of(entry)`: the entry built into a store of its own and pulled into another path,
    once per worker (its tests are one xdist group, so once per run)."""
    made: dict[str, Release] = {}

    def release(entry: str) -> Release:
        if entry not in made:
            root = tmp_path_factory.mktemp(f"recipe-{entry}")
            manifest = root / "recipes.toml"
            manifest.write_text(f'name = "tiny-recipes"\n{recipe_entry(tiny_model, entry)}')
            built = cli("build", str(manifest), "--store", str(root / "store"), "--json")
            assert built.returncode == 0, built.stderr
            cache = root / "host-b" / "cache"
            pulled = cli("pull", "tiny-recipes", "--store", str(root / "store"), "--cache-dir", str(cache), "--json")
            assert pulled.returncode == 0, pulled.stderr
            exports = json.loads(pulled.stdout)["exports"]
            made[entry] = Release(manifest, root / "store", json.loads(built.stdout), cache, exports)
        return made[entry]

    return release


# A serving process: load the pipeline, apply a recipe (prepare, pasted code, or a hand-written
# default compile), run the entry's shapes, print the compiler's counters as JSON.
SERVER = """
import json, sys, torch
from diffusers import Flux2KleinPipeline
from torch._dynamo.utils import counters
model, how, arg, sizes = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
class Missed(BaseException):  # not an Exception: torch would bypass its cache on one, and compile
    pass
pipe = Flux2KleinPipeline.from_pretrained(model, torch_dtype=torch.float32, local_files_only=True)
if how == "prepare":
    import neffbuild.serve
    manifest, _, entry = arg.partition("#")
    neffbuild.serve.prepare(pipe, manifest, entry=entry)
elif how == "code":
    exec(open(arg).read(), {"pipe": pipe})
elif how == "guide":  # the diffusers guide's hand-written server: global flags, torch's defaults
    torch._inductor.config.conv_1x1_as_mm = True
    torch._inductor.config.coordinate_descent_tuning = True
    torch._inductor.config.epilogue_fusion = False
    torch._inductor.config.coordinate_descent_check_all_directions = True
    pipe.transformer = torch.compile(pipe.transformer, mode=arg, fullgraph=True)
else:  # "default": stopped at Inductor's first cache miss, what it asserts (the compile would follow)
    from neffbuild.backends.base import watch_dynamo_counters
    def stop(counter):
        raise Missed(counter)
    watch_dynamo_counters(["inductor.fxgraph_cache_miss"], stop)
    pipe.transformer.compile(fullgraph=True, dynamic=False)
try:
    for height, width in sizes:
        with torch.inference_mode():
            pipe(prompt="a photo of a cat", num_inference_steps=2, max_sequence_length=64,
                 text_encoder_out_layers=(1,), height=height, width=width, output_type="pt")
except Missed:
    pass
groups = ("inductor", "aot_autograd", "neffbuild.graphs", "stats")
print(json.dumps({f"{g}.{k}": v for g in groups for k, v in counters[g].items()}))
"""
MISSES = ("inductor.fxgraph_cache_miss", "aot_autograd.autograd_cache_miss")


def serve(release: Release, model: Path, how: str, arg: str, sizes: list[tuple[int, int]]) -> dict[str, int]:
    env = {**os.environ, **release.exports, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", SERVER, str(model), how, arg, json.dumps(sizes)],
        capture_output=True, text=True, env=env, check=False, cwd=release.cache.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("entry", [pytest.param(e, marks=grouped(e)) for e in UNITS])
def test_each_recipe_entry_builds_and_replays_from_another_path_with_zero_compiles(
    release_of: Callable[[str], Release], entry: str, cli
) -> None:
    release = release_of(entry)
    outcomes = {o["unit_id"]: o for o in release.build["outcomes"]}
    assert sorted(outcomes) == sorted(UNITS[entry])
    assert all(o["status"] == "built" and o["compiles"] > 0 for o in outcomes.values())
    result = cli("verify", str(release.manifest), "--cache-dir", str(release.cache), "--replay", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["misses"] == 0 and sorted(u["unit_id"] for u in report["units"]) == sorted(UNITS[entry])
    for unit in report["units"]:
        assert unit["compiles"] == 0 and unit["written"] == [], unit
        # No benchmark on a hit (Inductor's own select_algorithm_autotune cannot say: a hit adds the
        # deltas its compile recorded). That a build which autotunes counts here: test_autotuning.py.
        assert unit["counters"].get("neffbuild.autotune.selections", 0) == 0, unit
    if entry == "dynamic":
        # (c): replayed in one process in the manifest's order, the first size loads the symbolic
        # graph from the cache and the other size runs it without tracing another.
        graphs = {u["unit_id"]: u["counters"].get("stats.unique_graphs", 0) for u in report["units"]}
        assert [graphs[u] for u in UNITS[entry]] == [1, 0], graphs


@pytest.mark.parametrize(
    ("entry", "sizes"),
    [
        pytest.param("autotune", [(128, 128)], marks=grouped("autotune")),
        pytest.param("layout", [(128, 128)], marks=grouped("layout")),
        pytest.param("dynamic", [(128, w) for w in DYNAMIC_WIDTHS], marks=grouped("dynamic")),
        pytest.param("auto", [(128, w) for w in AUTO_WIDTHS], marks=grouped("auto")),
        pytest.param("int8", [(128, 128)], marks=grouped("int8")),
    ],
)
def test_a_fresh_server_that_calls_prepare_hits_every_graph(
    release_of: Callable[[str], Release], tiny_model: Path, entry: str, sizes: list[tuple[int, int]]
) -> None:
    release = release_of(entry)
    counters = serve(release, tiny_model, "prepare", f"{release.manifest}#{entry}", sizes)
    assert sum(counters.get(name, 0) for name in MISSES) == 0, counters
    assert counters.get("inductor.fxgraph_cache_hit", 0) > 0 and counters.get("neffbuild.graphs.transformer", 0) > 0
    if entry == "layout":
        assert counters.get("neffbuild.graphs.vae.decode", 0) > 0
    if entry == "dynamic":  # the sizes share one symbolic graph, loaded once
        assert counters.get("stats.unique_graphs") == 1 and counters.get("aot_autograd.autograd_cache_hit") == 1, (
            counters
        )


@grouped("auto")
def test_a_server_written_from_the_guide_hits_both_shapes_of_a_dynamic_auto_release(
    release_of: Callable[[str], Release], tiny_model: Path
) -> None:
    # Global flags, torch.compile(..., mode=, fullgraph=True) and no dynamic, the shapes called in
    # the manifest's order: a static graph, then the automatic-dynamic one, both from the cache.
    counters = serve(release_of("auto"), tiny_model, "guide", "max-autotune", [(128, w) for w in AUTO_WIDTHS])
    assert sum(counters.get(name, 0) for name in MISSES) == 0, counters
    assert counters.get("inductor.fxgraph_cache_hit", 0) >= 2, counters


@grouped("autotune")
def test_a_server_compiling_with_the_default_recipe_misses_the_autotune_release(
    release_of: Callable[[str], Release], tiny_model: Path
) -> None:
    # The server stops at Inductor's first cache miss (SERVER): the compile that would follow adds
    # nothing to the verdict, and was ~8 of this test's ~20 CPU-s.
    counters = serve(release_of("autotune"), tiny_model, "default", "", [(128, 128)])
    assert counters.get("inductor.fxgraph_cache_miss", 0) > 0, counters


@grouped("autotune")
def test_the_printed_recipe_serves_with_zero_compiles_in_a_fresh_process(
    release_of: Callable[[str], Release], tiny_model: Path, tmp_path: Path, cli
) -> None:
    release = release_of("autotune")
    printed = cli("recipe", str(release.manifest), "--entry", "autotune")
    assert printed.returncode == 0, printed.stderr
    assert "neffbuild" not in printed.stdout.replace("# neffbuild recipe", "").replace("`neffbuild pull`", "")
    assert "list_mode_options('max-autotune-no-cudagraphs', False)" in printed.stdout
    assert "'conv_1x1_as_mm': True" in printed.stdout
    code = tmp_path / "recipe.py"
    code.write_text(printed.stdout)
    counters = serve(release, tiny_model, "code", str(code), [(128, 128)])
    assert sum(counters.get(name, 0) for name in MISSES) == 0, counters
    assert counters.get("inductor.fxgraph_cache_hit", 0) > 0
