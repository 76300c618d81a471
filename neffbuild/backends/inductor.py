"""The `inductor` backend: torch.compile with Inductor on CPU or CUDA, cache in TORCHINDUCTOR_CACHE_DIR.

Why each fingerprint field is there (measured, see the design notes): Inductor's own keys cover
the graph, torch's version, its config (incl. CXX) and the thread count, but not the CPU ISA: a
cache built with AVX-512 and loaded with AVX2 reports hits and computes NaN. Kernel keys include
absolute include paths, so a Python environment at another prefix recompiles every kernel.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffbuild.backends.base import (
    Backend,
    UnitScope,
    cpu_isa_flags,
    dynamo_counters,
    relevant_env,
    watch_dynamo_counters,
)
from neffbuild.backends.envreads import NOT_KEYED
from neffbuild.servingenv import INDUCTOR
from neffbuild.version import installed_version

if TYPE_CHECKING:
    from neffbuild.backends.problems import Problem
    from neffbuild.documents.compile_recipe import ResolvedRecipe
    from neffbuild.documents.manifest import LoadedManifest, ModelEntry

# Cache entries whose path is derived from a content hash (graph key, kernel source + command):
# two builds may write the same path with different bytes (e.g. .so files embed their build
# dir), and either copy serves. The patterns here are compiled where first used (re caches them):
# a pull's host check imports this module and needs none of them.
_CONTENT_KEYED = (
    r"^(fxgraph/[^/]+/[^/]+/[^/]+"
    r"|aotautograd/[^/]+/[^/]+"
    r"|[0-9a-z]{2}/[0-9a-zA-Z_]+(\.[a-z]+)*"
    r"|triton/\d+/[^/]+/[^/]+"
    # AOTInductor packages (artifacts.py): named by the digests of what they bake in and of their inputs.
    r"|aoti/[^/]+/[0-9a-f]+/[0-9a-f]+\.(pt2|json))$"
)
_NEVER_BUNDLED = (
    r"^\.neffbuild/|(^|/)(locks|precompiled_headers|torch_compile_debug)(/|$)|\.(lock|tmp)$|(^|/)tmp[^/]*$"
    # AOTInductor's build dirs: what they hold is inside the .pt2 package a server loads.
    r"|^c[0-9a-z]{51}/"
)
_ENV_NAMES = ("OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY", "TORCH_COMPILE_CACHE_KEY_TAG", "CXX", "CC", "MKL_NUM_THREADS")
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_", "TRITON_")
_ENV_SKIP = {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_COMPILE_DEBUG_DIR"}
_MISS_COUNTERS = ("inductor.fxgraph_cache_miss", "aot_autograd.autograd_cache_miss")
# What ATEN_CPU_CAPABILITY takes away from the ISA Inductor picks kernels for (its
# cpu_vec_isa.pick_vec_isa): "default" leaves scalar code, "avx2" everything below AVX-512.
_CAPPED = {
    "default": r"^(avx\w*|amx\w*|fma|f16c|asimd\w*|sve\w*|neon|bf16|i8mm|fp16)$",
    "avx2": r"^(avx512\w*|amx\w*)$",
}


class InductorBackend(Backend):
    name = "inductor"
    cache_env = INDUCTOR.cache_env
    default_device = "cpu"
    fact_names = (
        "torch", "torch.git", "python", "python.prefix", "platform", "cpu.isa", "cpu.capability",
        "threads.default", "cxx.default", "diffusers", "transformers", "triton", "cuda", "cuda.device", "torchao",
    )  # fmt: skip  # arguments packed by meaning, not one a line
    # Kernels and Inductor's keys: torch (version, sources), Triton and the GPU for CUDA kernels,
    # the vector ISA and thread count kernels are generated for, the C++ compiler, the Python
    # (headers and absolute include paths in every kernel's command line), compiler variables.
    breaking_fields = (
        "backend", "device", "torch", "torch.git", "triton", "cuda", "cuda.device", "cpu.isa",
        "cpu.capability", "cxx", "threads", "python", "python.prefix", "platform", "env.*", "torchao",
    )  # fmt: skip  # arguments packed by meaning, not one a line
    # Model code: Inductor keys the traced graph itself, so a new version misses at most where
    # the code it traces changed, and never serves a stale kernel.
    informational_fields = ("diffusers", "transformers")

    def collect_facts(self, env: Mapping[str, str], device: str) -> dict[str, str]:
        # From files: torch's version.py, /proc/cpuinfo, /sys topology, package metadata. Only
        # a CUDA device's name, and the dispatch capability off x86, need torch itself.
        cpuinfo = _read("/proc/cpuinfo")
        torch_version = _torch_version_file()
        isa = cpu_isa_flags(cpuinfo)
        facts = {
            "torch": torch_version.get("__version__", ""),
            "torch.git": torch_version.get("git_version", ""),
            "python": python_fact(),
            "python.prefix": sys.prefix,
            "platform": f"{sys.platform}-{machine()}",
            "cpu.isa": isa,
            "cpu.capability": dispatch_capability(isa, machine()) or _torch_capability(),
            "threads.default": default_threads(env),
            "cxx.default": _compiler_version(env.get("CXX") or "g++"),
        }
        for package in ("diffusers", "transformers", "triton", "torchao"):
            facts[package] = _version(package)
        if device == "cuda":
            facts.update(_cuda_facts())
        return facts

    def worker_facts(self, env: Mapping[str, str], device: str) -> dict[str, str]:
        import torch

        # torch's own answers for what collect_facts derives from files (the worker runs with env).
        facts = self.collect_facts(env, device)
        facts["cpu.capability"] = torch.backends.cpu.get_cpu_capability()
        facts["threads.default"] = str(torch.get_num_threads())
        return facts

    def compiler_keys(self) -> dict[str, str]:
        from neffbuild.backends.envreads import compiler_config_hashes

        return compiler_config_hashes()

    def fingerprint(self, facts: Mapping[str, str], env: Mapping[str, str], unit: UnitScope) -> dict[str, str]:
        fields = {
            "backend": self.name,
            # torchao's kernels and tensor subclasses are the quantized graph: keyed where a unit
            # quantizes, and only there (installing torchao changes no other key).
            **{k: v for k, v in facts.items() if not k.endswith(".default") and v and k != "torchao"},
            **({"torchao": facts.get("torchao") or "absent"} if unit.quantizes else {}),
            # Variables that override a probed default: the value the compile will actually see.
            "threads": env.get("OMP_NUM_THREADS") or facts.get("threads.default", ""),
            "cxx": facts.get("cxx.default", ""),
            "device": unit.device,
        }
        if facts.get("cpu.isa"):
            # The ISA Inductor generates kernels for: ATEN_CPU_CAPABILITY caps what the CPU has.
            fields["cpu.isa"] = effective_isa(facts["cpu.isa"], env.get("ATEN_CPU_CAPABILITY", ""))
        if env.get("ATEN_CPU_CAPABILITY"):
            fields["cpu.capability"] = env["ATEN_CPU_CAPABILITY"].lower()
        # A variable known to reach no key (envreads.NOT_KEYED: logging, paths) is no field either.
        fields.update(relevant_env(env, _ENV_NAMES + tuple(unit.env), _ENV_PREFIXES, _ENV_SKIP | set(NOT_KEYED)))
        return dict(sorted(fields.items()))

    def validate(self, entry: ModelEntry, loaded: LoadedManifest) -> list[Problem]:
        if importlib.util.find_spec("torch") is None:
            return []  # check_host says so
        from neffbuild.backends.recipe_checks import inductor_setting_problems

        return inductor_setting_problems(entry)

    def check_host(self, entry: ModelEntry, env: Mapping[str, str], *, declared: bool) -> list[Problem]:
        from neffbuild.backends.problems import Problem  # a pull's host check finds none

        if importlib.util.find_spec("torch") is None:
            return [
                Problem("backend", f"torch is not importable in {sys.executable}", "pip install 'neffbuild[compile]'")
            ]
        if entry.device == "cuda" and not declared:
            import torch

            if not torch.cuda.is_available():
                built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
                return [
                    Problem(
                        "device",
                        f"'cuda', but this host has no CUDA device (torch {torch.__version__}, {built})",
                        "plan and build on a host with a CUDA GPU, or use device = 'cpu'",
                    )
                ]
        return []

    def prepare_process(self, shape_count: int) -> None:
        super().prepare_process(shape_count)
        from neffbuild.backends.inductor_repro import zero_compile_times

        zero_compile_times()  # entries of the same bytes on every build (inductor_repro.py)
        count_autotuning()

    def worker_env(self, cache_dir: Path, scratch: Path) -> dict[str, str]:
        return {
            self.cache_env: str(cache_dir),
            "TRITON_CACHE_DIR": str(cache_dir / "triton"),
            "TORCH_COMPILE_DEBUG_DIR": str(scratch / "debug"),
        }

    def runtime_env(self) -> dict[str, str]:
        # Precompiled headers live outside the cache dir (a host without them rebuilds them,
        # a compile the cache cannot carry), so they are off at build and at serve time alike.
        return {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}

    def select_files(self, cache_dir: Path) -> list[str]:
        selected = []
        for path in sorted(cache_dir.rglob("*")):
            rel = path.relative_to(cache_dir).as_posix()
            if path.is_file() and not path.is_symlink() and not re.search(_NEVER_BUNDLED, rel):
                selected.append(rel)
        return selected

    def is_content_keyed(self, path: str) -> bool:
        return bool(re.match(_CONTENT_KEYED, path))

    def compiler(self) -> Any:
        import torch

        # What torch.compile(backend="inductor", dynamic=False) builds, so graphs compile (and key)
        # exactly as a server's plain torch.compile does.
        wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        if wrapper is None:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx
        return wrapper(None, None, False)

    def compiler_for(self, recipe: ResolvedRecipe) -> Any:
        import torch

        # What torch.compile(mode=..., options=..., dynamic=...) builds: the wrapper patches
        # Inductor's config only while it compiles a graph, so settings stay with their component.
        wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        if wrapper is None:
            return self.compiler()
        return wrapper(recipe.mode, dict(recipe.inductor) or None, recipe.compile_dynamic)

    def compiler_counters(self) -> dict[str, int]:
        # A package's hits and a package process's compiles (artifacts.py) beside the cache's.
        # Imported here: a pull's host check loads this backend, and needs nothing of artifacts.
        from neffbuild.backends.artifacts import COMPILES_GROUP, PACKAGE_GROUP

        return dynamo_counters("inductor", "aot_autograd", "stats", AUTOTUNE_GROUP, PACKAGE_GROUP, COMPILES_GROUP)

    def compiles_in(self, delta: Mapping[str, int]) -> int:
        return sum(delta.get(name, 0) for name in _MISS_COUNTERS)

    def watch_compiles(self, on_compile: Callable[[str], None]) -> bool:
        # Both misses are counted at the failed cache lookup, before AOTAutograd or Inductor work.
        watch_dynamo_counters(_MISS_COUNTERS, on_compile)
        return True


def count_autotuning() -> None:
    """Count the autotune selections Inductor really runs in this process (`neffbuild.autotune`).
    Its own counters cannot say: an FX-graph cache hit adds the counter deltas the compile had
    recorded, so a replay "shows" the build's select_algorithm_autotune without benchmarking."""
    from torch._dynamo.utils import counters
    from torch._inductor import select_algorithm

    if getattr(select_algorithm, "_neffbuild_counting", False):
        return

    def saw(timings: Any, name: str, *args: Any) -> None:
        counters[AUTOTUNE_GROUP]["selections"] += 1
        counters[AUTOTUNE_GROUP]["choices"] += len(timings)

    select_algorithm.add_feedback_saver(saw)
    select_algorithm._neffbuild_counting = True  # once per process


AUTOTUNE_GROUP = "neffbuild.autotune"


def effective_isa(isa: str, capability: str) -> str:
    """The CPU flags whose kernels Inductor generates under ATEN_CPU_CAPABILITY (unset: all)."""
    capped = _CAPPED.get(capability.lower())
    if capped is None:
        return isa
    return ",".join(f for f in isa.split(",") if f and not re.match(capped, f)) or "none"


def dispatch_capability(isa: str, machine: str) -> str | None:
    """torch.backends.cpu.get_cpu_capability() with ATEN_CPU_CAPABILITY unset, from CPU flags as
    ATen's DispatchStub decides it on x86; None elsewhere (only torch can say)."""
    if machine not in ("x86_64", "AMD64"):
        return None
    flags = set(isa.split(","))
    if {"avx512vl", "avx512bw", "avx512dq", "fma"} <= flags:
        return "AVX512"
    return "AVX2" if {"avx2", "fma"} <= flags else "DEFAULT"


def default_threads(env: Mapping[str, str]) -> str:
    """torch.get_num_threads() when OMP_NUM_THREADS is unset: MKL_NUM_THREADS, else one thread per
    physical core (torch counts cores, not hardware threads, of every CPU the system has)."""
    if (mkl := env.get("MKL_NUM_THREADS", "").strip()).isdigit() and int(mkl) > 0:
        return str(int(mkl))
    cores = set()
    for topology in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        cores.add((_read(str(topology / "physical_package_id")).strip(), _read(str(topology / "core_id")).strip()))
    return str(len(cores) or os.cpu_count() or 1)


def _torch_version_file() -> dict[str, str]:
    """torch/version.py's string assignments, read as text: importing torch takes seconds."""
    try:
        spec = importlib.util.find_spec("torch")  # a top-level package: located, not imported
    except (ImportError, ValueError):
        return {}
    if spec is None or not spec.submodule_search_locations:
        return {}
    text = _read(str(Path(next(iter(spec.submodule_search_locations))) / "version.py"))
    return dict(re.findall(r"^(\w+)(?:\s*:[^=\n]*)?\s*=\s*'([^'\n]*)'", text, re.MULTILINE))


def _torch_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _cuda_facts() -> dict[str, str]:
    import torch  # the device name has no file that orders devices as CUDA does

    if not torch.cuda.is_available():
        return {}
    return {"cuda": str(torch.version.cuda), "cuda.device": torch.cuda.get_device_name(0)}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(package: str) -> str:
    return installed_version(package)


def python_fact() -> str:
    """platform's f"{python_implementation()} {python_version()}", without importing platform
    (its import compiles a dozen patterns: a ms of every pull's host check). CPython's sys.version
    starts with the version platform reads from it; another interpreter is platform's to say."""
    version = sys.version.partition(" ")[0]
    if sys.implementation.name == "cpython" and re.fullmatch(r"[\w.+]+", version) and version.count(".") == 2:
        return f"CPython {version}"
    import platform

    return f"{platform.python_implementation()} {platform.python_version()}"


def machine() -> str:
    """platform.machine(): os.uname's, where it has one (platform asks further only where not)."""
    if found := os.uname().machine:
        return found
    import platform

    return platform.machine()


def _compiler_version(cxx: str, timeout: float = 30.0) -> str:
    exe = which(cxx)
    if exe is None:
        return f"{cxx} (not found)"
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    except (OSError, subprocess.TimeoutExpired):
        return f"{cxx} (unusable)"
    first = out.stdout.splitlines()[0] if out.stdout else "unknown"
    return f"{cxx}: {first}"


def which(command: str) -> str | None:
    """shutil.which's answer on POSIX, without importing shutil (with bz2, lzma and zlib: a few ms
    of every pull's host check, which asks only this)."""
    path = os.environ.get("PATH", os.defpath)
    if os.path.dirname(command):
        candidates = [command]
    elif not path:  # an empty PATH finds nothing (not even in the working directory)
        return None
    else:
        candidates = [os.path.join(d, command) for d in dict.fromkeys(path.split(os.pathsep))]
    return next((c for c in candidates if os.access(c, os.F_OK | os.X_OK) and not os.path.isdir(c)), None)
