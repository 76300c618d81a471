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

In asynchronous mode an eager op goes, as upstream's C++ path does, to the first layout and is
counted like a graph. Upstream behaviours a test can switch on (variables read at each call):
- NEFFBUILD_DOUBLE_FAIL_OP=<module class>: that module's eager op fails to compile and, as
  upstream, runs on CPU without a file or a count, unless fallback is off: on the synchronous
  path only TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS=1 turns it off (python_ops/base.py),
  on the asynchronous one also NEURON_FALLBACK_ENABLED other than 1/true (ErrorRecovery.cpp);
  then it raises naming the op, as upstream does.
- NEFFBUILD_DOUBLE_LAYOUT=flat: every entry lands at `$DIR/<key>.neff` (a third layout, as a
  changed wheel might write); =none: nowhere (a wheel that caches elsewhere).
- NEFFBUILD_DOUBLE_TOUCH_ON_HIT=1: a hit writes `<entry>.hit` beside its entry.
- NEFFBUILD_DOUBLE_UNCOUNTED=1: no counter counts anything.
- NEFFBUILD_DOUBLE_LOCAL_DEFAULT=tmpdir: with TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR unset (or
  empty) the lock dir is `$TMPDIR/local_cache`, not upstream's literal `/tmp/local_cache`;
  NEFFBUILD_DOUBLE_LOCAL_OPTIONAL=1: a lock dir that cannot be made does not stop start-up.
The lock (local) dir is made at the first compile call, as upstream's runtime makes it at
start-up (CompilationCache.cpp:40-58): one that cannot be made raises.

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


def neff_path(cache_dir: Path, key: str) -> Path | None:
    layout = os.environ.get("NEFFBUILD_DOUBLE_LAYOUT", "")
    if layout == "none":
        return None
    if layout == "flat":
        return cache_dir / f"{key}.neff"
    return cache_dir / key[:2] / key[2:4] / f"{key}.neff"


def _store(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=path.parent)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


_started: list[Path] = []


def local_dir() -> Path:
    """The lock dir, made once per process (upstream: at runtime start-up)."""
    raw = os.environ.get("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR")
    if not raw:
        tmp = os.environ.get("TMPDIR") or "/tmp"
        raw = (
            f"{tmp}/local_cache" if os.environ.get("NEFFBUILD_DOUBLE_LOCAL_DEFAULT") == "tmpdir" else "/tmp/local_cache"
        )
    if not _started:
        try:
            Path(raw).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if os.environ.get("NEFFBUILD_DOUBLE_LOCAL_OPTIONAL") != "1":
                raise RuntimeError(f"Failed to create local cache directory {raw}: {exc}") from None
        _started.append(Path(raw))
    return Path(raw)


def _lock(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass  # the optional-lock-dir variant


def _count(name: str) -> None:
    if os.environ.get("NEFFBUILD_DOUBLE_UNCOUNTED") != "1":
        counters[NAME][name] += 1


def _hit(path: Path) -> None:
    path.read_bytes()  # a hit only reads ...
    if os.environ.get("NEFFBUILD_DOUBLE_TOUCH_ON_HIT") == "1":
        path.with_name(path.name + ".hit").write_bytes(b"")  # ... unless this variant says otherwise


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


def _falls_back(sync: bool) -> bool:
    """Whether upstream runs a failed eager op on CPU (silently) rather than raising."""
    if os.environ.get("TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS") == "1":
        return False
    if sync:
        return True
    enabled = os.environ.get("NEURON_FALLBACK_ENABLED")
    return enabled is None or enabled in ("1", "true")


def eager_op(module: torch.nn.Module, args: tuple, output: Any) -> None:
    """A module run eagerly: find or 'compile' its entry (synchronous: the second layout, counted
    by nothing; asynchronous: the first, counted)."""
    if torch.compiler.is_compiling():
        return None  # inside a compiled graph (the first layout's)
    cache_dir = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
    if not cache_dir:
        raise RuntimeError("the neuron test double needs TORCH_NEURONX_NEFF_CACHE_DIR")
    sync = os.environ.get("NEURON_LAUNCH_BLOCKING") == "1"
    op = type(module).__qualname__
    if op == os.environ.get("NEFFBUILD_DOUBLE_FAIL_OP"):
        if _falls_back(sync):
            return None  # ran on CPU: no file, no count, nothing said
        raise RuntimeError(f"Operation {op} failed to execute on Neuron (CPU fallback disabled)")
    described = repr((op, _specs(args), _specs(output), "-O1", COMPILER_VERSION))
    local = local_dir()
    if not sync:
        key = xxhash.xxh3_128_hexdigest(described.encode())
        path = neff_path(Path(cache_dir), key)
        if path is not None and path.is_file():
            _count(HITS)
            _hit(path)
            return None
        _count(MISSES)
        _count(TOTAL)
        _lock(local / "locks" / f"{key}.lock")
        if path is not None:
            _store(path, MARKER + described.encode())
        return None
    key = hashlib.sha256(described.encode()).hexdigest()
    layout = os.environ.get("NEFFBUILD_DOUBLE_LAYOUT", "")
    path = None if layout == "none" else Path(cache_dir) / (f"{key}.neff" if layout == "flat" else f"{key}/{key}.neff")
    if path is not None and path.is_file():
        _hit(path)
        return None
    _lock(local / key / "locks" / "compile.lock")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as out:
            out.write(MARKER + described.encode())
        os.replace(out.name, path)
    return None


# Every module's forward in this process: a test that imports the double into pytest's own
# process removes it after (EAGER_HOOK.remove()), or later tests' eager modules would come here.
EAGER_HOOK = torch.nn.modules.module.register_module_forward_hook(eager_op)


@register_backend(name=NAME)
def neuron_double(gm: torch.fx.GraphModule, example_inputs: list[Any], **_: Any):
    cache_dir = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
    if not cache_dir:
        raise RuntimeError("the neuron test double needs TORCH_NEURONX_NEFF_CACHE_DIR")
    local = local_dir()
    key = graph_key(gm, example_inputs)
    path = neff_path(Path(cache_dir), key)
    if path is not None and path.is_file():
        _count(HITS)
        _hit(path)
    else:
        _count(MISSES)
        _count(TOTAL)
        _lock(local / "locks" / f"{key}.lock")
        if path is not None:
            _store(path, MARKER + gm.code.encode())
    return gm.forward
