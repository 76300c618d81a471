"""Probes `neffbuild doctor --neuron-selfcheck` runs, each in a fresh process: `python -m
neffbuild.backends.neuron_probe COMMAND ...` prints one JSON line.

- `defaults NAME...`: the values of NAMEs after `import torch_neuronx` (run with them unset).
- `fingerprint`: the neuron fingerprint of a tensor-parallel unit as a worker computes it, after
  the import; every torchrun rank prints its own.
- `compile DIR [eager]`: compiles the probe model in DIR/neffbuild_probe_model.py with
  backend="neuron" (with `eager`: runs it uncompiled, so each op compiles on its own) into
  $TORCH_NEURONX_NEFF_CACHE_DIR and prints the compiles counted, the cache files written and any
  file the bundler would not know (another layout).
- `platform`: the runtime's own compile target and logical cores (torch_neuronx.utils).

The backend's seams (NEFFBUILD_NEURON_COMPILE_BACKEND, NEFFBUILD_NEURON_DEVICE, worker imports)
apply as in a worker, so the test double can stand in for the compiler.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from neffbuild.backends.base import Scope
from neffbuild.backends.neuron import NeuronBackend
from neffbuild.backends.worker import import_seams

PROBE_MODULE = "neffbuild_probe_model"
# Identical text at two paths: only the source locations differ between the two compiles.
PROBE_SOURCE = """import torch


class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))
"""


def defaults(names: list[str]) -> dict[str, str | None]:
    import torch_neuronx  # noqa: F401

    return {name: os.environ.get(name) for name in names}


def fingerprint(tensor_parallel: int) -> dict[str, object]:
    backend = NeuronBackend()
    backend.prepare_process(1)  # as the worker does: the import first, then the key
    facts = backend.worker_facts(os.environ, "neuron")
    scope = Scope(device="neuron", tensor_parallel=tensor_parallel)
    return {"rank": int(os.environ.get("RANK", "0")), "fingerprint": backend.fingerprint(facts, os.environ, scope)}


def platform() -> dict[str, str]:
    from torch_neuronx import utils

    return {"target": str(utils.get_platform_target()), "lnc": str(utils.get_lnc_setting())}


def compile_probe(source_dir: Path, eager: bool = False) -> dict[str, object]:
    import torch

    backend = NeuronBackend()
    backend.prepare_process(1)
    sys.path.insert(0, str(source_dir))
    model = importlib.import_module(PROBE_MODULE).Probe().to(backend.device)
    if not eager:
        model.compile(backend=backend.compile_backend, fullgraph=True, dynamic=False)
    cache = Path(os.environ[backend.cache_env])
    before_files = {
        p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in map(cache.joinpath, backend.select_files(cache))
    }
    before = backend.counters()
    torch.manual_seed(0)
    model(torch.randn(4, 16).to(backend.device))
    after = backend.counters()
    after_files = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in map(cache.joinpath, backend.select_files(cache))}
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    written = sorted(str(p.relative_to(cache)) for p, st in after_files.items() if before_files.get(p) != st)
    return {
        "compiles": backend.compiles_in(delta),
        "written": written,
        "files": len(after_files),
        "unrecognised": backend.unrecognised_files(cache),
    }


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    import_seams(os.environ)
    if command == "defaults":
        result: object = defaults(args)
    elif command == "fingerprint":
        result = fingerprint(int(args[0]))
    elif command == "compile":
        result = compile_probe(Path(args[0]), eager=args[1:] == ["eager"])
    elif command == "platform":
        result = platform()
    else:
        sys.stderr.write(f"unknown probe {command!r}\n")
        return 2
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
