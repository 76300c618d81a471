"""What each backend lets a release put in a serving process's environment.

A release comes from a store, and `pull` prints its environment for a shell to `eval` (or writes
it for systemd): a release may set only its backend's cache variable, which always points at the
pulled dir, and the variables the backend declares here as compiler settings. Anything else
(LD_PRELOAD, PATH, ...) needs the host's consent (`--allow-env NAME`), and so do the names a
backend marks `host_only` inside its own prefixes: paths its runtime writes into or deletes,
switches that turn its cache off, and runtime-only settings that belong to the host. Pull reads this on every
boot, so the module imports nothing. Each backend's descriptor (descriptors.py) holds its table,
which every stage reads from there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServingEnv:
    """What a release of one backend may export and what its server writes in the cache dir."""

    cache_env: str  # the variable that points the compiler at its cache dir
    names: frozenset[str]  # compiler settings a release may set ...
    prefixes: tuple[str, ...]  # ... by name or by prefix
    # Directories inside the cache dir that the serving process writes even when every lookup
    # hits: pull creates them, so that a host serving from a read-only cache dir can mount a
    # writable dir over each (docs/hosts.md, "Serving from a read-only cache dir"). All else is only read.
    writable: tuple[str, ...] = ()
    # Names inside `prefixes` that only the host may set (by --allow-env): see the module docstring.
    host_only: frozenset[str] = frozenset()
    host_only_prefixes: tuple[str, ...] = ()

    def declares(self, name: str) -> bool:
        if name == self.cache_env or self.is_host_only(name):
            return False
        return name in self.names or name.startswith(self.prefixes)

    def is_host_only(self, name: str) -> bool:
        return name in self.host_only or name.startswith(self.host_only_prefixes)


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
# its locks go to TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR (default: the literal /tmp/local_cache),
# outside the cache dir, so the NEFF cache may be read-only as a whole (docs/trainium.md).
# Every NEURON_*/TORCH_NEURONX_* name torch_neuronx 0.1.0 reads is in exactly one list below, with
# the file that reads it in docs/trainium.md ("Every variable TorchNeuron reads"; a test compares).
# A release exports, and a key holds, only what changes what neuronx-cc is given or produces:
NEURON_COMPILER = frozenset(
    {
        # Flags, opt level, logical cores (KernelExecution.cpp, PlatformUtils.cpp), sync eager
        # ops = the Python path and its layout (utils.py, PlatformUtils.cpp).
        "NEURON_CC_FLAGS", "NEURON_COMPILER_OPT_LEVEL", "NEURON_LOGICAL_NC_CONFIG", "NEURON_LAUNCH_BLOCKING",
        # Lowering and decomposition: which HLO reaches the compiler (utils.py, decompositions.py,
        # argument_processor.py, NeuronCompiler.cpp).
        "TORCH_NEURONX_MLIR_ATEN_OPS", "TORCH_NEURONX_ENABLE_STABLEHLO", "TORCH_NEURONX_ENABLE_NKI_SDPA",
        "TORCH_NEURONX_ATEN_GMM_ALIGN", "TORCH_NEURONX_SKIP_OP_PRECONDITIONS", "TORCH_NEURONX_ENABLE_PROLOGUE",
        # Op concatenation: which eager ops are fused into one compiled unit (csrc/core/concatenation/).
        "TORCH_NEURONX_ENABLE_CONCATENATION", "TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT",
        "TORCH_NEURONX_CONCATENATION_QUEUE_LOW_THRESHOLD", "TORCH_NEURONX_APPLY_SKIP_INTERMEDIATE",
        # Which collective ops a tensor-parallel rank runs (distributed/backend.py).
        "NEURON_USE_SPLIT_ALLGATHER", "NEURON_USE_SPLIT_REDUCE_SCATTER",
    }
)  # fmt: skip  # a table: its rows packed, not one item a line
# The rest only the host may set (by --allow-env), and no key holds them:
NEURON_PATHS = frozenset(
    {
        # Written into or deleted by the runtime: the debug dir is rmtree'd after every graph
        # (neuron_dynamo_backend/config.py:149-164), the lock dir is created at start-up.
        "TORCH_NEURONX_DEBUG_DIR", "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "TORCH_NEURONX_LOG_FILE",
        "TORCH_NEURONX_METRICS_DIR", "TORCH_NEURONX_DUMP", "NEURON_ERROR_DUMP_DIR",
    }
)  # fmt: skip  # a table: its rows packed, not one item a line
# Not read by 0.1.0; other Neuron stacks write caches there (not in the table).
NEURON_OTHER_STACKS = frozenset({"TORCH_NEURONX_HLO_CACHE_DIR", "NEURON_COMPILE_CACHE_URL"})
NEURON_SWITCHES = frozenset({"TORCH_NEURONX_NEFF_DISABLE_CACHE", "TORCH_NEURONX_DISABLE_NEFF_CACHE"})
# Change no artifact: in-memory limits, the lock timeout, logging, metrics, debug dumps, error
# handling, CPU fallback, resource slots and execution behaviour.
NEURON_RUNTIME = frozenset(
    {
        "NEURON_COMPILATION_CACHE_MAX_SIZE_MB", "NEURON_COMPILATION_CACHE_MAX_ENTRIES",
        "TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT", "TORCH_NEURONX_LOG_LEVEL", "TORCH_NEURONX_METRICS_ENABLED",
        "TORCH_NEURONX_ENABLED_METRIC_TABLES", "TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS",
        "TORCH_NEURONX_DUMP_HLO_PB", "NEURON_DUMP_EXECUTION_ON_ERROR", "NEURON_ENHANCED_ERROR_HANDLING",
        "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS",
        "NEURON_FALLBACK_ENABLED", "NEURON_MAX_RESOURCE_SLOTS", "TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY",
        "TORCH_NEURONX_RETAIN_DEVICE_MODE", "TORCH_NEURONX_ENABLE_ASYNC_NRT", "TORCH_NEURONX_ENABLE_STACK_TRACE",
        # Runtime placement and collectives set-up (the NEURON_RT_ prefix below covers any other).
        "NEURON_RT_ALLOW_LEGACY_NEFF", "NEURON_RT_DBG_ZEROCOPY", "NEURON_RT_ENABLE_HOST_CC",
        "NEURON_RT_VISIBLE_CORES", "NEURON_RT_ROOT_COMM_ID",
    }
)  # fmt: skip  # a table: its rows packed, not one item a line
NEURON = ServingEnv(
    cache_env="TORCH_NEURONX_NEFF_CACHE_DIR",
    names=NEURON_COMPILER | {"OMP_NUM_THREADS"},
    prefixes=(),  # exact: a name 0.1.0 does not read shapes nothing, and a host need not take it
    host_only=NEURON_PATHS | NEURON_OTHER_STACKS | NEURON_SWITCHES | NEURON_RUNTIME,
    host_only_prefixes=("NEURON_RT_",),  # runtime placement: the host's own business
)
