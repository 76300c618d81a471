"""Each compiler backend described without importing it: one frozen descriptor per backend.

What the stages above need to know of a backend they do not run lives here, and they read it from
here: the manifest its name and devices (and so the JSON schema), the host its runtime module,
device nodes, default cache and lock dirs and cache switches (doctor), pull and env the variables
a release may export (servingenv.py), the CLI its choices, the fleet the Ray resource a unit
reserves. The code that compiles is the backend's module in backends/, named by `implementation`
and imported only when a backend is asked for. Adding a backend: its module, its descriptor in
BACKENDS, its serving env in servingenv.py (docs/architecture.md). Light on purpose: pull reads
it on every boot.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffbuild import servingenv
from neffbuild.servingenv import ServingEnv


@dataclass(frozen=True, slots=True, kw_only=True)
class HostRuntime:
    """What doctor checks of a backend's runtime on a serving host."""

    module: str  # must be importable by the serving Python
    install_hint: str
    device_pattern: str | None = None  # device nodes under /dev that must exist, as a regex
    device_label: str = ""  # the same, for people
    default_cache_dir: str  # where the compiler caches when its variable is unset ({user} filled in)
    # A dir outside the cache dir that the runtime creates at start-up, hit or miss, and fails
    # without: its variable and default. None: the backend has none.
    lock_dir_env: str | None = None
    default_lock_dir: str = ""
    # Variables that turn the runtime's cache off, and the values that do: a host with one set
    # compiles every graph whatever it pulled.
    cache_switches: tuple[tuple[str, frozenset[str]], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendDescriptor:
    """One backend as the manifest, pull and the host check know it, without importing it."""

    name: str  # the manifest's `backend = "..."`, a release's and a bundle's backend
    implementation: str  # "module:Class" of its `backends.base.Backend`, imported when asked for
    devices: tuple[str, ...]  # the manifest's devices for it, its default first
    serving: ServingEnv  # what a release of it may export (servingenv.py)
    host: HostRuntime
    # Runs wherever torch does: the manifest's default backend, and doctor's where no other
    # backend's runtime is installed. Exactly one backend is.
    portable: bool = False
    tensor_parallel: bool = False  # an entry may shard over several devices (tensor_parallel > 1)
    fleet_resource: str | None = None  # a Ray custom resource a unit reserves, one per tensor-parallel rank
    other_cache_envs: tuple[str, ...] = ()  # cache variables besides its own that neffbuild sets per unit

    @property
    def cache_env(self) -> str:
        return self.serving.cache_env

    @property
    def owned_env(self) -> tuple[str, ...]:
        """Variables neffbuild sets per build unit: a manifest may not."""
        return (self.cache_env, *self.other_cache_envs)


INDUCTOR = BackendDescriptor(
    name="inductor",
    implementation="neffbuild.backends.inductor:InductorBackend",
    devices=("cpu", "cuda"),
    serving=servingenv.INDUCTOR,
    host=HostRuntime(
        module="torch",
        install_hint="install torch into the serving Python",
        default_cache_dir="/tmp/torchinductor_{user}",
    ),
    portable=True,
    other_cache_envs=("TRITON_CACHE_DIR",),  # Triton's kernels (cuda), beside Inductor's
)
NEURON = BackendDescriptor(
    name="neuron",
    implementation="neffbuild.backends.neuron:NeuronBackend",
    devices=("neuron",),
    serving=servingenv.NEURON,
    host=HostRuntime(
        module="torch_neuronx",
        install_hint="install torch-neuronx from the Neuron SDK into the serving Python (see docs/trainium.md)",
        device_pattern=r"neuron\d+",
        device_label="Neuron device nodes (neuron0, neuron1, ...)",
        default_cache_dir="/tmp/neff_cache",
        # torch_neuronx 0.1.0 creates it when its compilation cache starts (CompilationCache.cpp:40-58).
        lock_dir_env="TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR",
        default_lock_dir="/tmp/local_cache",
        # The disk cache: "1" on the C++ path (PersistentCacheBackend.cpp:18, 57), also "true" or
        # "yes" on the Python path (kernels/cache_utils.py:18-20); the Python in-memory caches
        # (utils.py:190-198). Case-insensitive where Python reads it.
        cache_switches=(
            ("TORCH_NEURONX_NEFF_DISABLE_CACHE", frozenset({"1", "true", "yes"})),
            ("TORCH_NEURONX_DISABLE_NEFF_CACHE", frozenset({"1", "true", "yes"})),
        ),
    ),
    tensor_parallel=True,
    fleet_resource="neuron_cores",
)
# The registry, in the order the manifest's schema lists them.
BACKENDS: tuple[BackendDescriptor, ...] = (INDUCTOR, NEURON)
_BY_NAME = {d.name: d for d in BACKENDS}


def find(name: str) -> BackendDescriptor | None:
    """The backend called name, or None: a name from a store or a manifest may be anything."""
    return _BY_NAME.get(name)


def names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def devices() -> tuple[str, ...]:
    """Every device some backend compiles for, each once."""
    return tuple(dict.fromkeys(d for b in BACKENDS for d in b.devices))


def portable() -> BackendDescriptor:
    return next(b for b in BACKENDS if b.portable)


def by_specificity() -> tuple[BackendDescriptor, ...]:
    """Those a host is looked at for, in order: each with its own runtime first, the portable one last."""
    return tuple(sorted(BACKENDS, key=lambda b: b.portable))
