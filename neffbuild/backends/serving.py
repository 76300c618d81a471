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

    def declares(self, name: str) -> bool:
        return name != self.cache_env and (name in self.names or name.startswith(self.prefixes))


# Inductor's own settings, and the thread counts its kernels are keyed and tuned for. Not CC/CXX
# or TRITON_*: those name programs and libraries to run, which a host must accept explicitly.
INDUCTOR = ServingEnv(
    cache_env="TORCHINDUCTOR_CACHE_DIR",
    names=frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "TORCH_COMPILE_CACHE_KEY_TAG"}),
    prefixes=("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_"),
)
# TorchNeuron's and neuronx-cc's settings (NEURON_CC_FLAGS, NEURON_LOGICAL_NC_CONFIG, NEURON_RT_*).
NEURON = ServingEnv(
    cache_env="TORCH_NEURONX_NEFF_CACHE_DIR",
    names=frozenset({"OMP_NUM_THREADS"}),
    prefixes=("NEURON_", "TORCH_NEURONX_"),
)
BY_BACKEND: dict[str, ServingEnv] = {"inductor": INDUCTOR, "neuron": NEURON}
