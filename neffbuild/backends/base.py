"""The interface between neffbuild's core and a compiler backend.

The core (plan, build, pull, verify) never imports torch. A backend answers two kinds of
questions: on the planning side, which files of its cache dir form a bundle and what in the
environment keys them; inside a worker process (a fresh interpreter per build unit), how to load
the pipeline, compile it and count compiles. Only the worker-side methods may import torch.
"""

from __future__ import annotations

import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from neffbuild.manifest import LoadedManifest, ModelEntry


class Backend(ABC):
    name: ClassVar[str]
    cache_env: ClassVar[str]  # the variable that points the compiler at its cache dir

    # -- planning side: no torch import here except inside collect_facts -----------------------

    @abstractmethod
    def collect_facts(self, env: Mapping[str, str], device: str) -> dict[str, str]:
        """Probe this host (versions, CPU, compiler). Impure; tests pass facts in instead."""

    @abstractmethod
    def fingerprint(self, facts: Mapping[str, str], env: Mapping[str, str], entry: ModelEntry) -> dict[str, str]:
        """Everything outside the unit that changes the artifact or silently breaks a hit. Pure."""

    def validate(self, entry: ModelEntry, loaded: LoadedManifest) -> list[str]:
        """Backend-specific problems with an entry, found before compiling (e.g. TP degree)."""
        return []

    @abstractmethod
    def worker_env(self, cache_dir: Path, scratch: Path) -> dict[str, str]:
        """Variables for a worker: the cache dir, and lock/debug dirs kept out of it."""

    def runtime_env(self) -> dict[str, str]:
        """Variables a serving process needs besides the cache dir for hits to hold."""
        return {}

    @abstractmethod
    def select_files(self, cache_dir: Path) -> list[str]:
        """Relative paths of the cache files to bundle (no locks, temp files or debug output)."""

    @abstractmethod
    def is_content_keyed(self, path: str) -> bool:
        """True if the path is itself a key of the compiler's cache, so any copy of it serves."""

    def launch_command(self, entry: ModelEntry, job_file: Path) -> list[str]:
        """The command that runs one worker job in a fresh process."""
        return [sys.executable, "-m", "neffbuild.backends.worker", str(job_file)]

    # -- worker side: runs in the fresh process, may import torch ------------------------------

    def prepare_process(self, shape_count: int) -> None:
        """Process-wide settings before anything compiles."""

    def load_pipeline(self, entry: ModelEntry, model_ref: str) -> Any:
        """Load the pipeline the way serving does: the ordinary from_pretrained path."""
        import diffusers
        import torch

        pipeline_class = getattr(diffusers, entry.pipeline, None)
        if pipeline_class is None:
            raise ValueError(f"diffusers {diffusers.__version__} has no pipeline class {entry.pipeline!r}")
        kwargs: dict[str, Any] = {"torch_dtype": getattr(torch, entry.dtype)}
        if entry.revision:
            kwargs["revision"] = entry.revision
        return pipeline_class.from_pretrained(model_ref, **kwargs)

    @abstractmethod
    def apply_mode(self, pipe: Any, entry: ModelEntry) -> Any:
        """Move the pipeline to its device and apply the compile mode; return what to call."""

    @abstractmethod
    def counters(self) -> dict[str, int]:
        """A snapshot of the compiler's cumulative hit/miss counters in this process."""

    @abstractmethod
    def compiles_in(self, delta: Mapping[str, int]) -> int:
        """How many compiles (cache misses) a counter delta shows."""


def cpu_isa_flags(cpuinfo: str) -> str:
    """The instruction-set flags that change generated kernels, from /proc/cpuinfo text."""
    relevant = re.compile(r"^(avx\w*|amx\w*|fma|f16c|sse4_[12]|bmi2|asimd\w*|sve\w*|bf16|i8mm|fp16|neon)$")
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return ",".join(sorted({f for f in value.split() if relevant.match(f)}))
    return ""


def relevant_env(env: Mapping[str, str], names: tuple[str, ...], prefixes: tuple[str, ...], skip: set[str]) -> dict[str, str]:
    """`env.NAME` fingerprint fields for the variables that influence a compiler."""
    return {
        f"env.{k}": v
        for k, v in sorted(env.items())
        if k not in skip and (k in names or k.startswith(prefixes))
    }
