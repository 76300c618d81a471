"""TEST DOUBLE — not a Neuron compiler. Never used outside tests.

Registers a torch.compile backend named `neffbuild_neuron_double` that runs every graph eagerly
on CPU and, like TorchNeuron's persistent cache, keeps one file per graph in
`$TORCH_NEURONX_NEFF_CACHE_DIR/ab/cd/<32 hex>.neff` (written to a `.tmp.*` file, then renamed).
The key is derived from the graph code and the input shapes/dtypes, so a second run over the
same cache dir finds its files and writes nothing. It also leaves a lock file under
`$TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR/locks/`, which a bundle must never contain.

In synchronous mode (NEURON_LAUNCH_BLOCKING=1, read at each call as TorchNeuron reads it) it
also stands in for TorchNeuron's Python compiler path, which compiles each eager op: every module
that runs outside a compiled graph keeps one file in `$TORCH_NEURONX_NEFF_CACHE_DIR/<64 hex>/<64
hex>.neff` (keyed by sha256 over the module class, its input and output shapes and dtypes and a
compiler version; written to a `tmp*.tmp` file beside it, then renamed), takes its lock at
`$TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR/<hash>/locks/compile.lock`, and, like that path, counts
nothing: a compile there shows only as a new file.

The files hold a marker and the graph code, not a NEFF. Hits and misses are counted in
`torch._dynamo.utils.counters["neffbuild_neuron_double"]` under the counter names TorchNeuron's
metrics use, which is where the neuron backend looks when a substitute compile backend is named
(see neffbuild/backends/neuron.py, "Seams").

Imported in worker processes through NEFFBUILD_WORKER_IMPORTS=neuron_double (tests/ on PYTHONPATH).
"""

from __future__ import annotations

import hashlib
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
COMPILER_VERSION = "double-1"
TOTAL, HITS, MISSES = (
    "CompilationCache.TotalCompilations",
    "CompilationCache.PersistentHits",
    "CompilationCache.PersistentMisses",
)


def graph_key(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    signature = [(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs]
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


def _specs(value: Any) -> list[tuple[tuple[int, ...], str]]:
    if isinstance(value, torch.Tensor):
        return [(tuple(value.shape), str(value.dtype))]
    if isinstance(value, (list, tuple)):
        return [spec for item in value for spec in _specs(item)]
    if isinstance(value, dict):
        return [spec for item in value.values() for spec in _specs(item)]
    return (
        [spec for item in vars(value).values() for spec in _specs(item)]
        if hasattr(value, "__dataclass_fields__")
        else []
    )


def eager_op(module: torch.nn.Module, args: tuple, output: Any) -> None:
    """A module run eagerly in synchronous mode: find or 'compile' its entry in the second layout."""
    if torch.compiler.is_compiling() or os.environ.get("NEURON_LAUNCH_BLOCKING") != "1":
        return None  # inside a compiled graph (the first layout's), or asynchronous mode
    cache_dir = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
    if not cache_dir:
        raise RuntimeError("the neuron test double needs TORCH_NEURONX_NEFF_CACHE_DIR")
    described = repr((type(module).__qualname__, _specs(args), _specs(output), "-O1", COMPILER_VERSION))
    key = hashlib.sha256(described.encode()).hexdigest()
    path = Path(cache_dir) / key / f"{key}.neff"
    if path.is_file():
        path.read_bytes()  # a hit only reads
        return None
    local = os.environ.get("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR")
    if local:
        lock = Path(local) / key / "locks" / "compile.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as out:
        out.write(MARKER + described.encode())
    os.replace(out.name, path)
    return None


torch.nn.modules.module.register_module_forward_hook(eager_op)


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
