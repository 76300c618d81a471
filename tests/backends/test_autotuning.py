"""Autotuning is cached, proven on a CPU: a max-autotune compile that really benchmarks choices
(Inductor's C++ template against ATen for a batched matmul of activations), then a fresh process
against a copy of its cache dir at another path, which benchmarks nothing.

neffbuild's own counter (neffbuild.autotune, InductorBackend.prepare_process) is what replay
checks; Inductor's select_algorithm_autotune is shown here to read the same on the hit, since an
FX-graph cache hit adds the counter deltas its compile recorded: a check on it could not fail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Attention as matmuls (what aten's math SDPA decomposes into): float32, 3-D, each batch
# contiguous, so Inductor's CPU bmm template is a choice besides ATen and max-autotune benchmarks
# both. A Linear is a template candidate only with frozen weights, which no cache keeps.
COMPILE = """
import json, torch
from torch._dynamo.utils import counters
from neffbuild.backends.inductor import InductorBackend
InductorBackend().prepare_process(1)
def attention(q, k, v):
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0]
compiled = torch.compile(attention, mode="max-autotune-no-cudagraphs", fullgraph=True, dynamic=False)
torch.manual_seed(0)
q = torch.randn(1, 2, 128, 16)
with torch.no_grad():
    compiled(q, q.clone(), q.clone())
print(json.dumps({f"{g}.{k}": v for g in ("inductor", "neffbuild.autotune") for k, v in counters[g].items()}))
"""


def compile_in_fresh_process(cache_dir: Path) -> dict[str, int]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    env.update(TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0", OMP_NUM_THREADS="2")
    result = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_build_that_autotunes_counts_it_and_a_hit_from_another_path_benchmarks_nothing(tmp_path: Path) -> None:
    built = compile_in_fresh_process(tmp_path / "a" / "cache")
    assert built.get("inductor.fxgraph_cache_miss") == 1, built
    assert built.get("neffbuild.autotune.selections", 0) > 0 and built.get("neffbuild.autotune.choices", 0) >= 2
    shutil.copytree(tmp_path / "a" / "cache", tmp_path / "b" / "cache")
    replayed = compile_in_fresh_process(tmp_path / "b" / "cache")
    assert replayed.get("inductor.fxgraph_cache_hit") == 1 and "inductor.fxgraph_cache_miss" not in replayed
    assert replayed.get("neffbuild.autotune.selections", 0) == 0, replayed
    # Inductor's own counter replays the build's: it reads the same on a hit that benchmarked nothing.
    assert replayed.get("inductor.select_algorithm_autotune") == built.get("inductor.select_algorithm_autotune")
