"""The `neuron` backend: TorchNeuron (torch-neuronx) on Trainium, NEFF cache in TORCH_NEURONX_NEFF_CACHE_DIR.

Written to the documented contract (../shared/design/neuron-cache.md and the torch-neuronx
sources it cites); torch-neuronx cannot be installed where this was written, so everything that
touches the compiler is verified only on Trainium. What is checked where is listed in
docs/trainium.md.

Why the fingerprint holds what it holds: TorchNeuron keys a NEFF by its StableHLO, shapes, target,
logical-core config, opt level and compiler flags, but NOT by the neuronx-cc version. A host with
another compiler would load NEFFs built by this one, so our key adds the compiler, torch-neuronx,
torch and diffusers versions.

Seams (read in the worker process; each is also a fingerprint field, so a bundle made through a
seam can never carry the key of a real Neuron build):
- NEFFBUILD_NEURON_COMPILE_BACKEND: torch.compile backend name instead of "neuron". A substitute
  reports its cache counters in `torch._dynamo.utils.counters[<its name>]` under TorchNeuron's
  metric names. Exists for the test double (tests/neuron_double.py) and for future backends.
- NEFFBUILD_NEURON_DEVICE: device instead of "neuron" (the double runs on "cpu").
- NEFFBUILD_NEURON_TARGET: the compile target (trn1, trn2, trn3) when it cannot be detected,
  e.g. when planning keys on a CI host that is not a Trainium instance.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffbuild.backends.base import Backend, Problem, UnitScope, graph_counters
from neffbuild.backends.serving import NEURON

if TYPE_CHECKING:
    from neffbuild.manifest import LoadedManifest, ModelEntry

COMPILE_BACKEND_ENV = "NEFFBUILD_NEURON_COMPILE_BACKEND"
DEVICE_ENV = "NEFFBUILD_NEURON_DEVICE"
TARGET_ENV = "NEFFBUILD_NEURON_TARGET"
ABSENT = "absent"
UNSET = "(unset)"
DMI_PRODUCT_NAME = Path("/sys/devices/virtual/dmi/id/product_name")

# Instance family -> (neuronx-cc target, default logical NeuronCores), as torch-neuronx maps them
# (PlatformUtils.cpp). An inf2 compiles for trn1; trn2u for trn2.
_FAMILIES = {
    "inf1": ("inf1", "1"), "inf2": ("trn1", "1"), "trn1": ("trn1", "1"), "trn1n": ("trn1", "1"),
    "trn2": ("trn2", "2"), "trn2n": ("trn2", "2"), "trn2u": ("trn2", "2"),
    "trn3": ("trn3", "2"), "trn3u": ("trn3", "2"),
}  # fmt: skip
_DEFAULT_LNC = {target: lnc for target, lnc in _FAMILIES.values()}

# TorchNeuron: $DIR/ab/cd/<32 hex>.neff, written to `.tmp.*` then renamed (locks live elsewhere).
_NEFF_ENTRY = re.compile(r"^([0-9a-f]{2})/([0-9a-f]{2})/(\1\2[0-9a-f]{28})\.neff$")
# libneuronxla (torch-xla based): neuronxcc-<ver>/MODULE_<graph hash>+<flags hash>/<file>.
_MODULE_FILE = re.compile(r"^neuronxcc-[^/]+/MODULE_[^/]+/[^/]+$")
_MODULE_KEEP = frozenset(
    {"model.neff", "model.done", "compile_flags.json", "compile_flags.txt", "model.hlo_module.pb", "model.hlo.pb"}
)

# Transformers whose class declares a `_tp_plan` in diffusers 0.42 (a test checks this list
# against the installed diffusers); planning must not import torch, so it is a table.
TP_TRANSFORMERS = frozenset(
    {"FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel", "QwenImage21Transformer2DModel"}
)
_TP_PIPELINES = re.compile(r"^(Flux|Flux2|QwenImage)\w*Pipeline$")

# Variables that change what neuronx-cc produces, and those that only place files or switch
# reporting (set per unit by worker_env, or runtime-only), which must not split keys.
_ENV_PREFIXES = ("TORCH_NEURONX_", "NEURON_")
_ENV_NOT_KEYED = frozenset(
    {
        "TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "TORCH_NEURONX_DEBUG_DIR",
        "TORCH_NEURONX_HLO_CACHE_DIR", "TORCH_NEURONX_NEFF_DISABLE_CACHE", "TORCH_NEURONX_METRICS_ENABLED",
        "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "TORCH_NEURONX_LOG_LEVEL",
        "TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS", "NEURON_COMPILE_CACHE_URL",
        # Named fields below.
        "NEURON_CC_FLAGS", "NEURON_COMPILER_OPT_LEVEL", "NEURON_LOGICAL_NC_CONFIG",
    }
)  # fmt: skip
_ENV_NOT_KEYED_PREFIXES = ("NEURON_RT_",)  # runtime placement and behaviour, not compilation

# TorchNeuron's compilation-cache counters (torch_neuronx.metrics; None until first increment).
TOTAL_COMPILATIONS = "CompilationCache.TotalCompilations"
_NEFF_COUNTERS = (
    TOTAL_COMPILATIONS,
    "CompilationCache.PersistentHits",
    "CompilationCache.PersistentMisses",
    "CompilationCache.InMemoryHits",
    "CompilationCache.InMemoryMisses",
)

# The native key omits the compiler version; these make ours carry it (and the framework's).
_DISTRIBUTIONS = ("torch", "torch-neuronx", "neuronx-cc", "diffusers", "transformers")
_VERSION_FIELDS = (*_DISTRIBUTIONS, "python")
_REQUIRED_FACTS = (*_VERSION_FIELDS, "target")  # what a [toolchain] table must give

VersionOf = Callable[[str], str | None]


def installed_version(distribution: str) -> str | None:
    """A distribution's version from its metadata; importing torch_neuronx would start the runtime."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def instance_family(product_name: str) -> str | None:
    """'trn2.48xlarge' -> 'trn2'; None for anything that is not a known Neuron instance."""
    family = product_name.strip().split(".", 1)[0].lower()
    return family if family in _FAMILIES else None


def compile_target(family: str | None) -> str | None:
    return _FAMILIES[family][0] if family in _FAMILIES else None


class NeuronBackend(Backend):
    name = "neuron"
    cache_env = NEURON.cache_env
    default_device = "neuron"
    fact_names = (*_VERSION_FIELDS, "target", "instance.type")
    # What neuronx-cc produces and how TorchNeuron keys it, plus what the native key leaves out
    # but changes a NEFF: the compiler and torch-neuronx versions.
    breaking_fields = ("backend", "device", "torch", "torch-neuronx", "neuronx-cc", "neuron.*", "env.*")
    # Model code (the NEFF key holds the traced StableHLO itself) and the interpreter's version.
    informational_fields = ("diffusers", "transformers", "python")
    caches_eager = True  # eager mode compiles (and caches) each op on its first run

    def __init__(
        self,
        *,
        version_of: VersionOf = installed_version,
        product_name_file: Path = DMI_PRODUCT_NAME,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._version_of = version_of
        self._product_name_file = product_name_file
        self._env = os.environ if env is None else env  # worker side: the env the parent prepared

    # -- planning side -------------------------------------------------------------------------

    def collect_facts(self, env: Mapping[str, str], device: str) -> dict[str, str]:
        # Versions come from package metadata, so planning works on a CI host without
        # torch-neuronx ("absent"); the instance type from DMI, never from the network (IMDS).
        facts = {dist: self._version_of(dist) or ABSENT for dist in _DISTRIBUTIONS}
        facts["python"] = ".".join(platform.python_version_tuple()[:2])
        facts["instance.type"] = _read_text(self._product_name_file)
        facts["target"] = compile_target(instance_family(facts["instance.type"])) or "unknown"
        return facts

    def fingerprint(self, facts: Mapping[str, str], env: Mapping[str, str], unit: UnitScope) -> dict[str, str]:
        target = _target(facts, env)
        fields = {
            "backend": self.name,
            "device": unit.device,
            **{k: facts.get(k, ABSENT) for k in _VERSION_FIELDS},
            "neuron.target": target,
            "neuron.lnc": env.get("NEURON_LOGICAL_NC_CONFIG") or _DEFAULT_LNC.get(target, "unknown"),
            "neuron.opt_level": env.get("NEURON_COMPILER_OPT_LEVEL") or UNSET,
            "neuron.cc_flags": env.get("NEURON_CC_FLAGS") or UNSET,
            "neuron.tp": str(unit.tensor_parallel),
            "neuron.compile_backend": env.get(COMPILE_BACKEND_ENV) or "neuron",
            "neuron.device": env.get(DEVICE_ENV) or "neuron",
        }
        fields.update(_keyed_env(env, unit))
        return dict(sorted(fields.items()))

    def validate(self, entry: ModelEntry, loaded: LoadedManifest) -> list[Problem]:
        if entry.tensor_parallel == 1:
            return []
        n = entry.tensor_parallel
        config = _transformer_config(loaded, entry)
        class_name = config.get("_class_name")
        problems = []
        if isinstance(class_name, str) and class_name not in TP_TRANSFORMERS:
            problems.append(
                Problem(
                    "tensor_parallel",
                    f"{class_name} has no _tp_plan in diffusers; "
                    f"tensor parallel works for {', '.join(sorted(TP_TRANSFORMERS))}",
                    "use tensor_parallel = 1",
                )
            )
        elif class_name is None and not _TP_PIPELINES.match(entry.pipeline):
            problems.append(
                Problem(
                    "tensor_parallel",
                    f"cannot confirm that {entry.pipeline}'s transformer has a _tp_plan "
                    "(only Flux, Flux2 and QwenImage transformers do)",
                    "use tensor_parallel = 1",
                )
            )
        heads = config.get("num_attention_heads")
        if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 and heads % n:
            divisors = [d for d in range(2, min(heads, 4096) + 1) if heads % d == 0]
            problems.append(
                Problem(
                    "tensor_parallel",
                    f"{n} does not divide the transformer's num_attention_heads ({heads})",
                    f"use one of {divisors or [1]}",
                )
            )
        return problems

    def check_host(self, entry: ModelEntry, env: Mapping[str, str], *, declared: bool) -> list[Problem]:
        if declared or env.get(COMPILE_BACKEND_ENV):
            return []  # planning for the host [toolchain] declares, or a substitute compiles
        if importlib.util.find_spec("torch_neuronx") is None:
            return [
                Problem(
                    "backend",
                    f"'neuron', but torch-neuronx is not importable in {sys.executable}: this host cannot "
                    "compile for Neuron, and keys computed here would name neuronx-cc 'absent'",
                    "plan on the Trainium build host, or declare that host's toolchain in a [toolchain] table "
                    f"({', '.join(_REQUIRED_FACTS)}) to plan for it from here",
                )
            ]
        return []

    def unusable_facts(self, facts: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
        if env.get(COMPILE_BACKEND_ENV):
            return []  # a substitute compiler: its keys carry its name and never match a real build
        missing = [name for name in _DISTRIBUTIONS if facts.get(name, ABSENT) == ABSENT]
        if _target(facts, env) == "unknown":
            missing.append("target")
        return missing

    def worker_env(self, cache_dir: Path, scratch: Path) -> dict[str, str]:
        return {
            self.cache_env: str(cache_dir),
            # Locks, debug output and the HLO cache go to scratch: never bundled, and no state
            # from an earlier build on this host can make this one look warm.
            "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(scratch / "neuron-local"),
            "TORCH_NEURONX_DEBUG_DIR": str(scratch / "neuron-debug"),
            "TORCH_NEURONX_HLO_CACHE_DIR": str(scratch / "neuron-hlo"),
            "TORCH_NEURONX_NEFF_DISABLE_CACHE": "0",
            # The older torch-xla stack (libneuronxla) caches here; its entries land in the same dir.
            "NEURON_COMPILE_CACHE_URL": str(cache_dir),
            # Counters are off by default; a failed compile must fail the build, not run eagerly.
            "TORCH_NEURONX_METRICS_ENABLED": "1",
            "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1",
        }

    def select_files(self, cache_dir: Path) -> list[str]:
        selected = []
        for path in sorted(cache_dir.rglob("*.neff")):
            rel = path.relative_to(cache_dir).as_posix()
            if _NEFF_ENTRY.match(rel) and _is_plain_file(path):
                selected.append(rel)
        selected.extend(_complete_module_files(cache_dir))
        return sorted(selected)

    def is_content_keyed(self, path: str) -> bool:
        # Both layouts name entries by a hash of what they compile: any copy of a path serves.
        return bool(_NEFF_ENTRY.match(path) or _MODULE_FILE.match(path))

    def launch_command(self, entry: ModelEntry, job_file: Path) -> list[str]:
        if entry.tensor_parallel == 1:
            return super().launch_command(entry, job_file)
        # torchrun (torch.distributed.run) with one process per NeuronCore; --standalone picks a
        # free rendezvous port, so several units can build side by side.
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={entry.tensor_parallel}",
            "-m", "neffbuild.backends.worker", str(job_file),
        ]  # fmt: skip

    # -- worker side ---------------------------------------------------------------------------

    @property
    def device(self) -> str:
        return self._env.get(DEVICE_ENV) or "neuron"

    def run_device(self, entry: ModelEntry) -> str:
        return self.device

    def compiler(self) -> Any:
        from torch._dynamo import lookup_backend

        return lookup_backend(self.compile_backend)

    @property
    def compiler_name(self) -> str:
        return self.compile_backend

    @property
    def compile_backend(self) -> str:
        return self._env.get(COMPILE_BACKEND_ENV) or "neuron"

    def prepare_process(self, shape_count: int) -> None:
        import torch._dynamo

        if self.device == "neuron":
            _import_torch_neuronx()
        if self.compile_backend == "neuron":
            import torch_neuronx.metrics

            torch_neuronx.metrics.set_enabled(True)
        # Each static shape is one more recompile of the same code; the default limit (8) makes
        # the ninth shape fail hard under fullgraph=True.
        limit = max(8, 2 * shape_count + 2)
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.config.accumulated_recompile_limit = max(256, 8 * limit)

    def load_pipeline(self, entry: ModelEntry, model_ref: str) -> Any:
        if entry.tensor_parallel == 1:
            return super().load_pipeline(entry, model_ref)
        if importlib.util.find_spec("accelerate") is None:
            # Without it diffusers silently loads on CPU memory, then refuses to shard.
            raise RuntimeError("tensor_parallel > 1 loads through accelerate's meta device: pip install accelerate")
        import diffusers
        import torch

        kwargs: dict[str, Any] = {"torch_dtype": getattr(torch, entry.dtype)}
        if entry.revision:
            kwargs["revision"] = entry.revision
        # from_pretrained with a TP config streams each rank's slice straight into its DTensor.
        config = diffusers.TensorParallelConfig(mesh=_tp_mesh(entry.tensor_parallel, self.device))
        transformer = diffusers.AutoModel.from_pretrained(
            model_ref, subfolder="transformer", parallel_config=config, low_cpu_mem_usage=True, **kwargs
        )
        pipeline_class = getattr(diffusers, entry.pipeline)
        return pipeline_class.from_pretrained(model_ref, transformer=transformer, **kwargs)

    def counters(self) -> dict[str, int]:
        if self.compile_backend != "neuron":
            from torch._dynamo.utils import counters

            values = dict(counters[self.compile_backend])
        else:
            values = _neuron_counters()
        return {**{f"neuron.{k}": int(v) for k, v in values.items()}, **graph_counters()}

    def compiles_in(self, delta: Mapping[str, int]) -> int:
        # neuronx-cc runs; a NEFF loaded from the persistent cache is a hit, not a compile.
        return delta.get(f"neuron.{TOTAL_COMPILATIONS}", 0)


def _target(facts: Mapping[str, str], env: Mapping[str, str]) -> str:
    """The compile target: NEFFBUILD_NEURON_TARGET, else the declared or probed fact, else the
    instance type's family."""
    declared = facts.get("target")
    probed = compile_target(instance_family(facts.get("instance.type", "")))
    return env.get(TARGET_ENV) or (declared if declared and declared != "unknown" else None) or probed or "unknown"


def _keyed_env(env: Mapping[str, str], unit: UnitScope) -> dict[str, str]:
    return {
        f"env.{k}": v
        for k, v in sorted(env.items())
        if k not in _ENV_NOT_KEYED
        and not k.startswith(_ENV_NOT_KEYED_PREFIXES)
        and (k.startswith(_ENV_PREFIXES) or k in unit.env)
    }


def _transformer_config(loaded: LoadedManifest, entry: ModelEntry) -> dict[str, Any]:
    """The local model's transformer/config.json, or {} (hub model, or unreadable)."""
    from neffbuild.manifest import is_local_model

    if not is_local_model(entry.model):
        return {}
    try:
        data = json.loads((Path(loaded.resolve_model(entry)) / "transformer" / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _complete_module_files(cache_dir: Path) -> list[str]:
    """libneuronxla entries that finished: model.done beside model.neff and no *.lock. An entry
    with only model.log is a cached failure (poisoned); one with a lock is still compiling."""
    selected = []
    for entry in sorted(cache_dir.glob("neuronxcc-*/MODULE_*")):
        names = {p.name for p in entry.iterdir()} if entry.is_dir() else set()
        if not {"model.done", "model.neff"} <= names or any(n.endswith(".lock") for n in names):
            continue
        for name in sorted(names & _MODULE_KEEP):
            if _is_plain_file(entry / name):
                selected.append((entry / name).relative_to(cache_dir).as_posix())
    return selected


def _is_plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _import_torch_neuronx() -> None:
    # `import torch` autoloads it unless TORCH_DEVICE_BACKEND_AUTOLOAD=0; importing it again is cheap.
    try:
        import torch_neuronx  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"torch-neuronx is not importable in {sys.executable} ({exc}); the neuron backend needs it "
            "(install the Neuron SDK's torch-neuronx on a Trainium host, see docs/trainium.md)"
        ) from None


def _tp_mesh(degree: int, device: str) -> Any:
    """Join the torchrun group and return a 1-D mesh over its ranks (one per NeuronCore)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group(backend="neuron" if device == "neuron" else "gloo")
    world = dist.get_world_size()
    if world != degree:
        raise RuntimeError(f"tensor_parallel = {degree} but torchrun started {world} processes")
    return DeviceMesh(device, list(range(world)), mesh_dim_names=("tp",))


def _neuron_counters() -> dict[str, int]:
    import torch
    import torch_neuronx.metrics

    # NEFF compiles are submitted asynchronously: let them land before reading the counters.
    synchronize = getattr(getattr(torch, "neuron", None), "synchronize", None)
    if synchronize is not None:
        synchronize()
    return {name: torch_neuronx.metrics.get_counter_value(name) or 0 for name in _NEFF_COUNTERS}
