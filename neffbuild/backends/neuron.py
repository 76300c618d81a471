"""The `neuron` backend: TorchNeuron (torch-neuronx) on Trainium, NEFF cache in TORCH_NEURONX_NEFF_CACHE_DIR.

Written to the documented contract (../shared/design/neuron-cache.md and the torch-neuronx
sources it cites); torch-neuronx cannot be installed where this was written, so everything that
touches the compiler is verified only on Trainium. What is checked where is listed in
docs/trainium.md.

Read against torch_neuronx 0.1.0's source (docs/trainium.md, "What the source says"), TorchNeuron
caches in two layouts in one dir: compiled graphs and asynchronous eager ops at `ab/cd/<32 hex>.neff`
(C++, keyed without the neuronx-cc version), and eager ops in synchronous mode
(NEURON_LAUNCH_BLOCKING=1, a release wheel's default) at `<64 hex>/<64 hex>.neff`
(kernels/compiler_subprocess.py, counted by no CompilationCache counter). Both are bundled; a
compile on either path counts.

Why the fingerprint holds what it holds: the native key omits the compiler version, so ours adds
it (and the neuronx-cc that PATH finds, which is the one that runs). The persistent key hashes
StableHLO bytecode that carries source locations (file paths and lines of the model code), so the
venv, Python and diffusers/transformers versions are breaking here, not informational. Variables
`import torch_neuronx` sets when unset are keyed by their effect: a value equal to the default
keys as unset, so a plan (before the import) and a worker (after it) agree.

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
import os
import platform
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffbuild.backends.base import Backend, UnitScope, dynamo_counters, load_arguments, pipeline_class
from neffbuild.backends.neuron_cache_layout import (
    cache_files,
    is_content_keyed,
    subprocess_entry_count,
    unrecognised_files,
)
from neffbuild.backends.neuron_entry_checks import recipe_refusals, tp_problems
from neffbuild.backends.neuron_toolchain import (
    ABSENT,
    DEFAULT_LNC,
    DMI_PRODUCT_NAME,
    ModuleVersion,
    PackageDir,
    RequiresPython,
    RunVersion,
    VersionOf,
    build_type,
    compile_target,
    compiler_version,
    find_compiler,
    installed_version,
    instance_family,
    module_version,
    package_dir,
    pin_compiler,
    python_excluded,
    requires_python,
)
from neffbuild.backends.problems import Problem
from neffbuild.names import STATE_DIR
from neffbuild.servingenv import NEURON, NEURON_COMPILER

if TYPE_CHECKING:
    from neffbuild.documents.manifest import LoadedManifest, ModelEntry

COMPILE_BACKEND_ENV = "NEFFBUILD_NEURON_COMPILE_BACKEND"
DEVICE_ENV = "NEFFBUILD_NEURON_DEVICE"
TARGET_ENV = "NEFFBUILD_NEURON_TARGET"
UNSET = "(unset)"


# Variables that change what neuronx-cc is given or produces are keyed (serving.NEURON_COMPILER,
# the exact list with the upstream file of each: docs/trainium.md); those named as fields below
# are keyed there. Any other NEURON_*/TORCH_NEURONX_* name is not, unless the entry's own env sets it.
_NAMED_ENV = ("NEURON_CC_FLAGS", "NEURON_COMPILER_OPT_LEVEL", "NEURON_LOGICAL_NC_CONFIG", "NEURON_LAUNCH_BLOCKING")
KEYED_ENV = NEURON_COMPILER - set(_NAMED_ENV)
# Defaults `import torch_neuronx` writes when unset (__init__.py:44-65) that change what is cached;
# the others it writes are run-time only (serving.NEURON_RUNTIME, NEURON_RT_*). Equal to the
# default keys as unset. NEURON_LAUNCH_BLOCKING's default depends on the wheel: `neuron.sync`.
IMPORT_DEFAULTS = {"TORCH_NEURONX_MLIR_ATEN_OPS": "1"}
# _build_config.py: BUILD_TYPE "RELEASE" defaults to synchronous mode, anything else (and a
# missing file: __init__.py:33-38) to asynchronous.
BUILD_FACT = "torch-neuronx.build"
_SYNC_DEFAULT = {"RELEASE": "1"}
# Builds wait this long for another rank's compile of the same graph before breaking its lock
# and compiling too (upstream's default is 1200 s, FileLock.h:16); a large transformer block
# can take longer than that. Serving never waits: a hit takes no lock.
BUILD_LOCK_TIMEOUT_S = 6 * 3600
# What a build needs free in each local dir neuronx-cc writes outside the cache dir.
SCRATCH_MIN_FREE = 2 << 30

# TorchNeuron's compilation-cache counters (torch_neuronx.metrics; None until first increment).
TOTAL_COMPILATIONS = "CompilationCache.TotalCompilations"
_NEFF_COUNTERS = (
    TOTAL_COMPILATIONS,
    "CompilationCache.PersistentHits",
    "CompilationCache.PersistentMisses",
    "CompilationCache.InMemoryHits",
    "CompilationCache.InMemoryMisses",
)

# Our own counter: the Python path's entries in the cache dir. A compile there is a new file.
SUBPROCESS_FILES = "neuron.SubprocessCache.Files"

# The native key omits the compiler version; these make ours carry it (and the framework's).
_DISTRIBUTIONS = ("torch", "torch-neuronx", "neuronx-cc", "diffusers", "transformers")
# What writes the StableHLO both upstream keys hash: Neuron's torch-mlir fork for graphs
# (neuron_dynamo_backend/fx/fx_importer.py) and jax for some eager ops (kernels/xla_kernel.py,
# python_ops/jax/). Found by import name (the fork's distribution name is not ours to guess);
# 'absent' is allowed: not every install has jax.
HLO_MODULES = {"torch-mlir": "torch_mlir", "jax": "jax", "jaxlib": "jaxlib"}
_VERSION_FIELDS = (*_DISTRIBUTIONS, *HLO_MODULES, "python")
# Where the model code lives (source locations are in the key) and which neuronx-cc runs.
_PLACE_FIELDS = ("venv", "neuronx-cc.bin", "neuronx-cc.bin-version")
_REQUIRED_FACTS = (*_VERSION_FIELDS, "target")  # what a [toolchain] table must give


class NeuronBackend(Backend):
    name = "neuron"
    cache_env = NEURON.cache_env
    default_device = "neuron"
    fact_names = (*_VERSION_FIELDS, "target", "instance.type", BUILD_FACT, *_PLACE_FIELDS)
    # What neuronx-cc produces and how TorchNeuron keys it, what the native key leaves out but
    # changes a NEFF (the compiler that runs, torch-neuronx), and what moves the source locations
    # the persistent key hashes (venv path, Python, the model libraries' files and lines).
    breaking_fields = (
        "backend", "device", "torch", "torch-neuronx", "neuronx-cc", "neuronx-cc.bin-version", "neuron.*", "env.*",
        "diffusers", "transformers", "python", "venv", *HLO_MODULES,
    )  # fmt: skip  # arguments packed by meaning, not one a line
    # Another path to the same compiler version compiles the same NEFFs.
    informational_fields = ("neuronx-cc.bin",)
    caches_eager = True  # eager mode compiles (and caches) each op on its first run
    scratch_min_free = SCRATCH_MIN_FREE

    def __init__(
        self,
        *,
        version_of: VersionOf = installed_version,
        product_name_file: Path = DMI_PRODUCT_NAME,
        env: Mapping[str, str] | None = None,
        package_dir: PackageDir = package_dir,
        prefix: str = sys.prefix,
        run_version: RunVersion = compiler_version,
        module_version: ModuleVersion = module_version,
        requires_python: RequiresPython = requires_python,
    ) -> None:
        self._version_of = version_of
        self._product_name_file = product_name_file
        self._env = os.environ if env is None else env  # worker side: the env the parent prepared
        self._package_dir = package_dir
        self._prefix = prefix
        self._run_version = run_version
        self._module_version = module_version
        self._requires_python = requires_python

    def package_dir_of(self, name: str) -> Path | None:
        """Where this backend finds a package (torch_neuronx) without importing it."""
        return self._package_dir(name)

    # -- planning side -------------------------------------------------------------------------

    def collect_facts(self, env: Mapping[str, str], device: str) -> dict[str, str]:
        # Versions come from package metadata, so planning works on a CI host without
        # torch-neuronx ("absent"); the instance type from DMI, never from the network (IMDS).
        facts = {dist: self._version_of(dist) or ABSENT for dist in _DISTRIBUTIONS}
        facts.update({field: self._module_version(module) or ABSENT for field, module in HLO_MODULES.items()})
        facts["python"] = ".".join(platform.python_version_tuple()[:2])
        facts["instance.type"] = _read_text(self._product_name_file)
        facts["target"] = compile_target(instance_family(facts["instance.type"])) or "unknown"
        facts[BUILD_FACT] = build_type(self._package_dir("torch_neuronx"))
        facts["venv"] = self._prefix
        facts.update(self._compiler_on_path(env, facts["neuronx-cc"]))
        return facts

    def _compiler_on_path(self, env: Mapping[str, str], installed: str) -> dict[str, str]:
        """The neuronx-cc that runs (TorchNeuron execs it from PATH) and its version: the installed
        distribution's when it is this venv's, else what it says."""
        found = find_compiler(env)
        if found is None:
            return {"neuronx-cc.bin": ABSENT, "neuronx-cc.bin-version": ABSENT}
        if found.parent == Path(self._prefix) / "bin":
            version = installed
        else:
            version = self._run_version(str(found)) or "unknown"
        return {"neuronx-cc.bin": str(found), "neuronx-cc.bin-version": version}

    def fingerprint(self, facts: Mapping[str, str], env: Mapping[str, str], unit: UnitScope) -> dict[str, str]:
        target = _target(facts, env)
        fields = {
            "backend": self.name,
            "device": unit.device,
            **{k: facts.get(k, ABSENT) for k in (*_VERSION_FIELDS, *_PLACE_FIELDS)},
            "neuron.target": target,
            # Set but empty is not unset: upstream passes "" on (PlatformUtils.cpp:86-88,
            # KernelExecution.cpp:70-82), which changes its key.
            "neuron.lnc": DEFAULT_LNC.get(target, "unknown")
            if (lnc := env.get("NEURON_LOGICAL_NC_CONFIG")) is None
            else lnc,
            "neuron.opt_level": env.get("NEURON_COMPILER_OPT_LEVEL", UNSET),
            "neuron.cc_flags": env.get("NEURON_CC_FLAGS", UNSET),
            "neuron.sync": sync_mode(facts, env),
            "neuron.tp": str(unit.tensor_parallel),
            "neuron.compile_backend": env.get(COMPILE_BACKEND_ENV) or "neuron",
            "neuron.device": env.get(DEVICE_ENV) or "neuron",
        }
        fields.update(_keyed_env(env, unit))
        return dict(sorted(fields.items()))

    def validate(self, entry: ModelEntry, loaded: LoadedManifest) -> list[Problem]:
        return recipe_refusals(entry) or tp_problems(entry, loaded)

    def check_host(self, entry: ModelEntry, env: Mapping[str, str], *, declared: bool) -> list[Problem]:
        if declared or env.get(COMPILE_BACKEND_ENV):
            return []  # planning for the host [toolchain] declares, or a substitute compiles
        if self._package_dir("torch_neuronx") is None:
            return [
                Problem(
                    "backend",
                    f"'neuron', but torch-neuronx is not importable in {sys.executable}: this host cannot "
                    "compile for Neuron, and keys computed here would name neuronx-cc 'absent'",
                    "plan on the Trainium build host, or declare that host's toolchain in a [toolchain] table "
                    f"({', '.join(_REQUIRED_FACTS)}) to plan for it from here",
                )
            ]
        spec = self._requires_python("torch-neuronx")
        here = ".".join(map(str, sys.version_info[:3]))
        if spec and python_excluded(
            spec, sys.version_info[:3]
        ):  # its wheel was installed anyway (--ignore-requires-python)
            return [
                Problem(
                    "backend",
                    f"'neuron', but torch-neuronx {self._version_of('torch-neuronx') or '?'} requires Python {spec} "
                    f"and the workers would run {sys.executable} (Python {here}), which neffbuild needs >= 3.11 for",
                    "use a torch-neuronx release whose Requires-Python includes this Python (docs/trainium.md, "
                    "'Releases and Pythons'), or plan for the build host with a [toolchain] table",
                )
            ]
        if find_compiler(env) is None:  # TorchNeuron runs it by name: every compile would fail
            return [
                Problem(
                    "backend",
                    "'neuron', but no neuronx-cc is on PATH: TorchNeuron runs the compiler it finds there",
                    f"put the venv's bin dir first on PATH (e.g. PATH={Path(self._prefix) / 'bin'}:$PATH)",
                )
            ]
        return []

    def unusable_facts(self, facts: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
        if env.get(COMPILE_BACKEND_ENV):
            return []  # a substitute compiler: its keys carry its name and never match a real build
        missing = [name for name in _DISTRIBUTIONS if facts.get(name, ABSENT) == ABSENT]
        if _target(facts, env) == "unknown":
            missing.append("target")
        if sync_mode(facts, env) == "unknown" and facts.get("torch-neuronx", ABSENT) != ABSENT:
            missing.append(BUILD_FACT)  # which layout eager ops land in (or set NEURON_LAUNCH_BLOCKING)
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
            # Counters are off by default; a failed compile must fail the build, not run on CPU.
            "TORCH_NEURONX_METRICS_ENABLED": "1",
            # A compiled graph's failure (neuron_dynamo_backend/backend.py:237) ...
            "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1",
            # ... and an eager op's: the Python path falls back unless this is "1"
            # (python_ops/base.py:716), the C++ path through ErrorRecovery unless it is not "1"/"true"
            # (csrc/core/utils/ErrorRecovery.cpp:20). Neither fallback counts or writes anything.
            "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS": "1",
            "NEURON_FALLBACK_ENABLED": "0",
            # TP ranks share keys and this lock dir: a rank must wait out another's long compile
            # rather than break its lock and compile the same graph again.
            "TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT": str(BUILD_LOCK_TIMEOUT_S),
        }

    def scratch_dirs(self, scratch: Path, env: Mapping[str, str]) -> dict[str, Path]:
        # neuronx-cc runs in /tmp/neuron_compile_XXXXXX on the C++ path (TempDirectory.h:23) and
        # in tempfile's dir on the Python path (compiler_subprocess.py:295); locks go to scratch.
        return {
            "the compile lock dir": scratch / "neuron-local",
            "neuronx-cc's scratch dir (hard-coded)": Path("/tmp"),
            "neuronx-cc's scratch dir ($TMPDIR)": Path(env.get("TMPDIR") or "/tmp"),
        }

    def select_files(self, cache_dir: Path) -> list[str]:
        return cache_files(cache_dir)

    def unrecognised_files(self, cache_dir: Path) -> list[str]:
        return unrecognised_files(cache_dir, set(self.select_files(cache_dir)), STATE_DIR)

    def is_content_keyed(self, path: str) -> bool:
        return is_content_keyed(path)

    def launch_command(self, entry: ModelEntry, job_file: Path) -> list[str]:
        if entry.tensor_parallel == 1:
            return super().launch_command(entry, job_file)
        # torchrun (torch.distributed.run) with one process per NeuronCore; --standalone picks a
        # free rendezvous port, so several units can build side by side.
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={entry.tensor_parallel}",
            "-m", "neffbuild.backends.worker", str(job_file),
        ]  # fmt: skip  # arguments packed by meaning, not one a line

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
        pin_compiler(os.environ)
        if self.device == "neuron":
            _import_torch_neuronx()
        if self.compile_backend == "neuron":
            import torch_neuronx.metrics

            torch_neuronx.metrics.set_enabled(True)
        super().prepare_process(shape_count)

    def load_pipeline(self, entry: ModelEntry, model_ref: str) -> Any:
        if entry.tensor_parallel == 1:
            return super().load_pipeline(entry, model_ref)
        if importlib.util.find_spec("accelerate") is None:
            # Without it diffusers silently loads on CPU memory, then refuses to shard.
            raise RuntimeError("tensor_parallel > 1 loads through accelerate's meta device: pip install accelerate")
        import diffusers

        kwargs = load_arguments(entry)
        # from_pretrained with a TP config streams each rank's slice straight into its DTensor.
        config = diffusers.TensorParallelConfig(mesh=_tp_mesh(entry.tensor_parallel, self.device))
        transformer = diffusers.AutoModel.from_pretrained(
            model_ref, subfolder="transformer", parallel_config=config, low_cpu_mem_usage=True, **kwargs
        )
        return pipeline_class(entry).from_pretrained(model_ref, transformer=transformer, **kwargs)

    def compiler_counters(self) -> dict[str, int]:
        files = {SUBPROCESS_FILES: self._subprocess_entries()}
        if self.compile_backend != "neuron":  # a substitute counts in Dynamo's counters, by its name
            values = dynamo_counters(self.compile_backend)
            return {**files, **{f"neuron.{k.removeprefix(self.compile_backend + '.')}": v for k, v in values.items()}}
        return {**files, **{f"neuron.{k}": int(v) for k, v in _neuron_counters().items()}}

    def compiles_in(self, delta: Mapping[str, int]) -> int:
        # neuronx-cc runs; a NEFF loaded from the persistent cache is a hit, not a compile. The
        # Python path counts nothing: each compile there leaves one new entry.
        return delta.get(f"neuron.{TOTAL_COMPILATIONS}", 0) + max(0, delta.get(SUBPROCESS_FILES, 0))

    def watch_compiles(self, on_compile: Callable[[str], None]) -> bool:
        # TorchNeuron counts a compile in C++ (torch_neuronx.metrics) once neuronx-cc has run,
        # asynchronously, and the Python path only by the entry it leaves: nothing fires before.
        return False

    def _subprocess_entries(self) -> int:
        raw = self._env.get(self.cache_env)
        return subprocess_entry_count(Path(raw)) if raw else 0


def _target(facts: Mapping[str, str], env: Mapping[str, str]) -> str:
    """The compile target: NEFFBUILD_NEURON_TARGET, else the declared or probed fact, else the
    instance type's family."""
    declared = facts.get("target")
    probed = compile_target(instance_family(facts.get("instance.type", "")))
    return env.get(TARGET_ENV) or (declared if declared and declared != "unknown" else None) or probed or "unknown"


def sync_mode(facts: Mapping[str, str], env: Mapping[str, str]) -> str:
    """'1' when eager ops compile synchronously (the Python path, `<64 hex>/` entries), '0' when
    not, as the worker runs after `import torch_neuronx` has applied the wheel's default."""
    value = env.get("NEURON_LAUNCH_BLOCKING")
    if value is None:
        build = facts.get(BUILD_FACT, ABSENT)
        if build in (ABSENT, "unknown"):
            return "unknown"
        value = _SYNC_DEFAULT.get(build, "0")
    return "1" if value == "1" else "0"  # only "1" selects it (utils.py:110-116, PlatformUtils.cpp:94-99)


def _keyed_env(env: Mapping[str, str], unit: UnitScope) -> dict[str, str]:
    return {
        f"env.{k}": v
        for k, v in sorted(env.items())
        if (k in KEYED_ENV or (k in unit.env and k not in _NAMED_ENV and k != NEURON.cache_env))
        and not NEURON.is_host_only(k)
        and IMPORT_DEFAULTS.get(k) != v
    }


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
