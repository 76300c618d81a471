"""Which environment variables a compile actually read: recorded in the worker, judged on a host.

neffbuild's fingerprint lists the variables it knows a compiler keys on; torch reads more, and
some reach a cache key at import (torch 2.13's `torch/_functorch/config.py`:
`error_on_custom_op_aliasing = bool(os.getenv("CI"))`, hashed into the AOTAutograd key). So the
worker wraps `os.environ` before torch is imported and records every name read through it
(`os.getenv` reads `os.environ.get`), from the first import through the last compile. A name is
stored with a digest of the value the process started with (never the value: it may be a
secret), or "" where it was unset. `status` compares exactly those names with the host; only
the names in NOT_KEYED (each with the torch source that shows it reaches no key) are left out.

What a wrapper cannot see, C and C++ reading `getenv` (OMP_NUM_THREADS, ATEN_CPU_CAPABILITY,
MKL_NUM_THREADS) and the variables Inductor's compiler subprocesses read (CXX, CC), stays in
each backend's fingerprint (`inductor._ENV_NAMES`), which names them by hand.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, KeysView, Mapping, MutableMapping
from typing import Any

from neffbuild.hashing import hash_bytes

UNSET = ""  # a recorded read of a variable that was not set

# Names read during a build that reach no cache key, with why. Everything else a build read is
# compared with the host (a difference is a mismatch): a name missing here costs a false "miss",
# never a false "hit".
NOT_KEYED: Mapping[str, str] = {
    # Where caches and scratch live: paths, not keys (Inductor keys content, not where it is stored).
    "TORCHINDUCTOR_CACHE_DIR": "torch/_inductor/runtime/cache_dir_utils.py: the cache's location",
    "TRITON_CACHE_DIR": "triton's cache location (the build sets it per unit)",
    "TORCH_COMPILE_DEBUG_DIR": "torch/_dynamo/config.py debug_dir_root: debug output only",
    "TMPDIR": "tempfile.gettempdir(): scratch location",
    "TEMP": "tempfile.gettempdir(): scratch location",
    "TMP": "tempfile.gettempdir(): scratch location",
    "HOME": "os.path.expanduser: default cache locations, overridden by the cache dir",
    "USER": "getpass.getuser(): the default cache dir's name, overridden by the cache dir",
    "LOGNAME": "getpass.getuser()",
    "LNAME": "getpass.getuser()",
    "USERNAME": "getpass.getuser()",
    "XDG_CACHE_HOME": "default cache locations (huggingface, triton), overridden by the cache dir",
    "PATH": "shutil.which for the compiler: the compiler itself is the fingerprint's cxx field",
    "PWD": "the working directory: not read into any config",
    # How Inductor schedules its C++ compiles, not what they produce: both settings are in
    # torch/_inductor/config.py's _cache_config_ignore_prefix, which its FX graph key leaves out.
    "TORCHINDUCTOR_COMPILE_THREADS": "torch/_inductor/config.py compile_threads: the compile pool's size",
    "TORCHINDUCTOR_WORKER_START": "torch/_inductor/config.py worker_start_method: how the pool starts",
    # Logging and diagnostics: what is printed, not what is compiled.
    "TORCH_LOGS": "torch/_logging/_internal.py: log levels only",
    "TORCH_LOGS_OUT": "torch/_logging/_internal.py: the log file",
    "TORCH_LOGS_FORMAT": "torch/_logging/_internal.py: the log format",
    "TORCH_TRACE": "torch/_logging/_internal.py: structured trace output",
    "TORCH_SHOW_CPP_STACKTRACES": "torch/__init__.py: error messages",
    "TORCH_CPP_LOG_LEVEL": "c10 logging",
    "TORCHDYNAMO_VERBOSE": "torch/_dynamo/config.py verbose: error messages (in _save_config_ignore)",
    "TORCH_DISABLE_ADDR2LINE": "torch/_dynamo/config.py: symbolising stack traces",
    # Libraries' own telemetry, hub access and progress bars.
    "HF_HUB_OFFLINE": "huggingface_hub: network access, the model is read from a local dir",
    "TRANSFORMERS_OFFLINE": "transformers: network access",
    "HF_HUB_DISABLE_TELEMETRY": "huggingface_hub: telemetry",
    "HF_HOME": "huggingface_hub: where downloads go",
    "HF_HUB_CACHE": "huggingface_hub: where downloads go",
    "HF_DATASETS_OFFLINE": "datasets: network access",
    "DIFFUSERS_VERBOSITY": "diffusers: log level",
    "TRANSFORMERS_VERBOSITY": "transformers: log level",
    "TQDM_DISABLE": "progress bars",
    "NO_COLOR": "terminal colours",
    "TERM": "terminal colours",
    "COLUMNS": "terminal width",
    "LINES": "terminal height",
    # neffbuild's own worker plumbing and torchrun's rank variables (the fingerprint keys TP).
    "RANK": "neffbuild.backends.worker.group_rank: which rank reports",
    "WORLD_SIZE": "neffbuild.backends.worker.group_rank; tensor_parallel is in the unit",
    "LOCAL_RANK": "torchrun rank",
}
NOT_KEYED_PREFIXES: tuple[tuple[str, str], ...] = (
    ("NEFFBUILD_", "neffbuild's own settings: read by neffbuild, not by the compiler"),
    ("HF_HUB_", "huggingface_hub: downloads and telemetry"),
    ("LC_", "locale: messages"),
)


def not_keyed(name: str) -> str | None:
    """Why a variable reaches no cache key, or None (it may: compare it)."""
    if name in NOT_KEYED:
        return NOT_KEYED[name]
    return next((why for prefix, why in NOT_KEYED_PREFIXES if name.startswith(prefix)), None)


def value_digest(name: str, value: str | None) -> str:
    """What a recorded read stores: UNSET, or an XXH3-128 of name and value (never the value)."""
    return UNSET if value is None else hash_bytes(f"{name}={value}".encode())


class ReadRecorder(MutableMapping[str, str]):
    """os.environ that notes each name read (get, [], in, pop, setdefault); writes pass through
    to the real mapping (which calls putenv, so child processes see them)."""

    def __init__(self, inner: MutableMapping[str, str]) -> None:
        self._inner = inner
        self._started = dict(inner)  # the values the process was given: what a host is compared with
        self.read: dict[str, None] = {}
        self._copying: list[str] | None = None  # names a copy in progress will read next (reversed)

    def _note(self, name: object) -> None:
        # A copy (dict(os.environ), {**os.environ}, .items()) asks for the names, then reads each
        # in that order: that hands the environment on (to a subprocess), it reads no setting.
        if self._copying is not None:
            if self._copying and self._copying[-1] == name:
                self._copying.pop()
                return
            self._copying = None
        if type(name) is str:  # bytes keys (some libraries try them) are never found in os.environ
            self.read.setdefault(name)

    def keys(self) -> KeysView[str]:
        return KeysView(self)

    def _listed(self) -> list[str]:
        names = list(self._inner)
        self._copying = names[::-1]
        return names

    def __getitem__(self, name: str) -> str:
        self._note(name)
        return self._inner[name]

    def get(self, name: str, default: Any = None) -> Any:
        self._note(name)
        return self._inner.get(name, default)

    def __contains__(self, name: object) -> bool:
        self._note(name)
        return name in self._inner

    def __setitem__(self, name: str, value: str) -> None:
        self._inner[name] = value

    def __delitem__(self, name: str) -> None:
        del self._inner[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._listed())

    def __len__(self) -> int:
        return len(self._inner)

    def copy(self) -> dict[str, str]:
        return dict(self._inner)

    def __getattr__(self, name: str) -> Any:  # os._Environ's own attributes (encodekey, _data)
        return getattr(self._inner, name)

    def recorded(self) -> dict[str, str]:
        """Each name read, with the digest of the value the process started with (or UNSET)."""
        return {name: value_digest(name, self._started.get(name)) for name in sorted(self.read)}


def install() -> ReadRecorder:
    """Wrap os.environ (once per process); returns the recorder."""
    current = os.environ
    if isinstance(current, ReadRecorder):
        return current
    recorder = ReadRecorder(current)
    os.environ = recorder  # type: ignore[assignment]  # noqa: B003 - a wrapper over the same environment, not a replacement
    return recorder


def recorder() -> ReadRecorder | None:
    current = os.environ
    return current if isinstance(current, ReadRecorder) else None


def host_differences(recorded: Mapping[str, str], env: Mapping[str, str]) -> list[tuple[str, str, str | None]]:
    """(name, the build's digest or UNSET, this host's value or None) for each recorded read
    that differs on this host and may reach a key."""
    out = []
    for name, built in sorted(recorded.items()):
        if not_keyed(name) is not None:
            continue
        here = env.get(name)
        if value_digest(name, here) != built:
            out.append((name, built, here))
    return out


# torch._dynamo.config is left out: its get_hash() differs between two processes of one host
# (measured with torch 2.13), so it cannot be compared; its CI-derived settings show as `env.CI`.
# Each config is hashed as its cache key sees it: Inductor's FX graph key hashes the portable view
# (save_config_portable leaves out _cache_config_ignore_prefix: absolute paths such as
# xpu.cutlass_dir, which torch resolves against the working directory, and compile_threads), and
# AOTAutograd's key the functorch config whole (save_config). get_hash() covered the paths too, so
# a build and a host in different directories never agreed. The recorded name says which view.
KEYED_CONFIGS = (("torch._inductor.config", "save_config_portable"), ("torch._functorch.config", "save_config"))


def compiler_config_hashes() -> dict[str, str]:
    """The compiler's own key inputs, as digests, as this process's environment set them at
    import: each config module as its cache key hashes it (above) and torch_key() (torch's own
    sources). Imports torch."""
    import importlib
    import pickle

    out: dict[str, str] = {}
    for module, view in KEYED_CONFIGS:
        try:
            got = getattr(importlib.import_module(module), view)()
            raw = got if isinstance(got, bytes) else pickle.dumps(sorted(got.items()), protocol=4)
        except Exception:  # noqa: BLE001 - an older torch without it, or a setting that cannot be pickled
            continue
        out[f"{module}:{view}"] = hash_bytes(raw)
    try:
        from torch._inductor.codecache import torch_key

        key = torch_key()
        out["torch_key"] = key.hex() if isinstance(key, bytes) else hash_bytes(repr(key).encode())
    except Exception:  # noqa: BLE001
        pass
    return out
