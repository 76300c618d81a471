"""What each backend lets a release put in a serving process's environment.

A release comes from a store, and `pull` prints its environment for a shell to `eval` (or writes
it for systemd): a release may set only its backend's cache variable, which always points at the
pulled dir, and the variables the backend declares here as compiler settings. Anything else
(LD_PRELOAD, PATH, ...) needs the host's consent (`--allow-env NAME`). Pull reads this on every
boot, so the module imports nothing: the backends import it, not the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServingEnv:
    cache_env: str  # the variable that points the compiler at its cache dir
    names: frozenset[str]  # compiler settings a release may set ...
    prefixes: tuple[str, ...]  # ... by name or by prefix
    # Directories inside the cache dir that the serving process writes even when every lookup
    # hits: pull creates them, so that a host serving from a read-only cache dir can mount a
    # writable dir over each (README, "Serving from a read-only cache dir"). All else is only read.
    writable: tuple[str, ...] = ()

    def declares(self, name: str) -> bool:
        return name != self.cache_env and (name in self.names or name.startswith(self.prefixes))


# Measured (torch 2.13, CPU, strace of a serving process that hits every entry): Inductor writes
# nothing in TORCHINDUCTOR_CACHE_DIR but `locks/`, which it makes, then for each kernel it loads an
# empty `locks/<kernel key>.lock`, created and flock'ed (a miss compiles under the same lock). Its
# lock dir is always `<cache dir>/locks`: no setting moves it. Python's tempfile also probes $TMPDIR.
# Inductor's own settings, and the thread counts its kernels are keyed and tuned for. Not CC/CXX
# or TRITON_*: those name programs and libraries to run, which a host must accept explicitly.
INDUCTOR = ServingEnv(
    cache_env="TORCHINDUCTOR_CACHE_DIR",
    names=frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "TORCH_COMPILE_CACHE_KEY_TAG"}),
    prefixes=("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_"),
    writable=("locks",),
)
# TorchNeuron reads a hit's NEFF and writes nothing beside it (entries land by rename, on a miss):
# its locks go to TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR (default: a dir under the system temp dir),
# outside the cache dir, so the NEFF cache may be read-only as a whole (docs/trainium.md).
# TorchNeuron's and neuronx-cc's settings (NEURON_CC_FLAGS, NEURON_LOGICAL_NC_CONFIG, NEURON_RT_*).
NEURON = ServingEnv(
    cache_env="TORCH_NEURONX_NEFF_CACHE_DIR",
    names=frozenset({"OMP_NUM_THREADS"}),
    prefixes=("NEURON_", "TORCH_NEURONX_"),
)
BY_BACKEND: dict[str, ServingEnv] = {"inductor": INDUCTOR, "neuron": NEURON}
