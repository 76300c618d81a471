"""TEST DOUBLE — not a Neuron compiler. Never used outside tests.

Registers a torch.compile backend named `neffbuild_neuron_double` that runs every graph eagerly
on CPU and, like TorchNeuron's persistent cache, keeps one file per graph in
`$TORCH_NEURONX_NEFF_CACHE_DIR/ab/cd/<32 hex>.neff` (written to a `.tmp.*` file, then renamed).
The key is derived from the graph code and the input shapes/dtypes, so a second run over the
same cache dir finds its files and writes nothing. It also leaves a lock file under
`$TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR/locks/`, which a bundle must never contain.

The files hold a marker and the graph code, not a NEFF. Hits and misses are counted in
`torch._dynamo.utils.counters["neffbuild_neuron_double"]` under the counter names TorchNeuron's
metrics use, which is where the neuron backend looks when a substitute compile backend is named
(see neffbuild/backends/neuron.py, "Seams").

Imported in worker processes through NEFFBUILD_WORKER_IMPORTS=neuron_double (tests/ on PYTHONPATH).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch._dynamo import register_backend
from torch._dynamo.utils import counters

NAME = "neffbuild_neuron_double"
MARKER = b"NEFFBUILD-TEST-DOUBLE (not a NEFF)\n"
TOTAL, HITS, MISSES = (
    "CompilationCache.TotalCompilations",
    "CompilationCache.PersistentHits",
    "CompilationCache.PersistentMisses",
)


def graph_key(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    signature = [
        (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs
    ]
    return xxhash.xxh3_128_hexdigest(gm.code.encode() + repr(signature).encode())


def neff_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / key[:2] / key[2:4] / f"{key}.neff"


def _store(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=path.parent)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def _lock(key: str) -> None:
    local = os.environ.get("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR")
    if local:
        lock = Path(local) / "locks" / f"{key}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()


@register_backend(name=NAME)
def neuron_double(gm: torch.fx.GraphModule, example_inputs: list[Any], **_: Any):
    cache_dir = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
    if not cache_dir:
        raise RuntimeError("the neuron test double needs TORCH_NEURONX_NEFF_CACHE_DIR")
    key = graph_key(gm, example_inputs)
    path = neff_path(Path(cache_dir), key)
    if path.is_file():
        counters[NAME][HITS] += 1
    else:
        counters[NAME][MISSES] += 1
        counters[NAME][TOTAL] += 1
        _lock(key)
        _store(path, MARKER + gm.code.encode())
    return gm.forward
