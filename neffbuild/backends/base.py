"""The interface between neffbuild's core and a compiler backend.

The core (plan, build, pull, verify) never imports torch. A backend answers two kinds of
questions: on the planning side, which files of its cache dir form a bundle, what in the
environment keys them and whether this host can build them; inside a worker process (a fresh
interpreter per build unit), how to load the pipeline, compile it and count compiles. Only the
worker-side methods may import torch; collect_facts reads files, so that `status` and `pull`
can judge a host in a fraction of a second (it imports torch only for a fact no file holds).
This module imports neither torch nor the manifest's validation library for the same reason.

Every listed component is compiled through a GraphCounter (backends/components.py), so a build
can prove that each one actually ran compiled.
"""

from __future__ import annotations

import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from neffbuild.backends.problems import Problem
    from neffbuild.documents.compile_recipe import ResolvedRecipe
    from neffbuild.documents.manifest import LoadedManifest, ModelEntry


class UnitScope(Protocol):
    """What of a unit its fingerprint depends on: a manifest entry, or a Scope read from a
    bundle's normalised unit (so a host is judged without the manifest)."""

    @property
    def device(self) -> str: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def env(self) -> Mapping[str, str]: ...  # variables the unit sets: keyed whatever their name
    @property
    def quantizes(self) -> bool: ...  # a component quantized (torchao): its version keyed


@dataclass(frozen=True, slots=True)
class Scope:
    """What of a unit its fingerprint depends on: device, parallelism, its own env, quantizing."""

    device: str
    tensor_parallel: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    quantizes: bool = False

    @classmethod
    def of_unit(cls, unit: Mapping[str, Any]) -> Scope:
        """The scope a normalised unit (plan.normalize_unit, as a bundle records it) was keyed in."""
        env = unit.get("env")
        tp = unit.get("tensor_parallel")
        return cls(
            device=str(unit.get("device", "")),
            tensor_parallel=tp if isinstance(tp, int) and not isinstance(tp, bool) else 1,
            env={str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
            quantizes=_quantizes(unit.get("recipe")),
        )


def _quantizes(recipe: Any) -> bool:
    """Whether a normalised unit's recipe document quantizes a component."""
    return isinstance(recipe, dict) and any(isinstance(r, dict) and r.get("quantize") for r in recipe.values())


class Backend(ABC):
    name: ClassVar[str]
    cache_env: ClassVar[str]  # the variable that points the compiler at its cache dir
    default_device: ClassVar[str]
    # Facts a manifest's [toolchain] table may declare, to plan keys for a host other than this one.
    fact_names: ClassVar[tuple[str, ...]]
    caches_eager: ClassVar[bool] = False  # does mode "eager" leave anything in the cache dir?
    # Fingerprint fields (fnmatch patterns) by what a difference does on a host. Breaking: it
    # changes kernels or the compiler's own keys (a miss, or a "hit" that computes garbage).
    # Informational: our key holds it, but the compiler's cache still serves. A field in neither
    # list counts as breaking; a test keeps every field this host reports declared.
    breaking_fields: ClassVar[tuple[str, ...]]
    informational_fields: ClassVar[tuple[str, ...]] = ()

    # -- planning side: no torch import here, except for facts no file holds -------------------

    @abstractmethod
    def collect_facts(self, env: Mapping[str, str], device: str) -> dict[str, str]:
        """Read this host's facts (versions, CPU, compiler) for a process running with `env`.
        Impure; tests pass facts in instead."""

    def worker_facts(self, env: Mapping[str, str], device: str) -> dict[str, str]:
        """The facts as the compiler reports them, inside a worker (torch imported): where one
        that collect_facts derives from files disagrees, the build fails naming it, rather than
        publishing a key built on a wrong guess."""
        return self.collect_facts(env, device)

    def compiler_keys(self) -> dict[str, str]:
        """The compiler's own cache-key inputs as digests (config hashes), in a worker after the
        last compile; {} where the backend cannot name them."""
        return {}

    @abstractmethod
    def fingerprint(self, facts: Mapping[str, str], env: Mapping[str, str], unit: UnitScope) -> dict[str, str]:
        """Everything outside the unit that changes the artifact or silently breaks a hit. Pure."""

    def scope(self, entry: ModelEntry) -> Scope:
        """The scope plan and worker key an entry's units in; what a bundle's unit records."""
        return Scope(
            device=entry.device,
            tensor_parallel=entry.tensor_parallel,
            env={**self.runtime_env(), **entry.env},
            quantizes=entry.mode != "eager" and any(entry.recipe_for(c).quantize for c in entry.components),
        )

    def is_breaking(self, name: str) -> bool:
        if any(fnmatchcase(name, p) for p in self.breaking_fields):
            return True
        return not any(fnmatchcase(name, p) for p in self.informational_fields)

    def validate(self, entry: ModelEntry, loaded: LoadedManifest) -> list[Problem]:
        """Backend-specific problems with an entry, found before compiling (e.g. TP degree). Pure."""
        return []

    def check_host(self, entry: ModelEntry, env: Mapping[str, str], *, declared: bool) -> list[Problem]:
        """Can this host build the entry: its compiler importable, its device present? With
        `declared`, the manifest's [toolchain] describes another host and the compiler check is
        skipped. Cheap: looks modules up, imports at most torch."""
        return []

    def unusable_facts(self, facts: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
        """Facts that would put a lie into every key (e.g. a compiler version 'absent')."""
        return []

    @abstractmethod
    def worker_env(self, cache_dir: Path, scratch: Path) -> dict[str, str]:
        """Variables for a worker: the cache dir, and lock/debug dirs kept out of it."""

    def scratch_dirs(self, scratch: Path, env: Mapping[str, str]) -> dict[str, Path]:
        """Dirs the compiler writes outside the cache dir during a build, by what they are: each
        is checked for room and writability before a worker starts (a worker would fail late)."""
        return {}

    scratch_min_free: ClassVar[int] = 0  # bytes each of those dirs needs free

    def runtime_env(self) -> dict[str, str]:
        """Variables a serving process needs besides the cache dir for hits to hold."""
        return {}

    @abstractmethod
    def select_files(self, cache_dir: Path) -> list[str]:
        """Relative paths of the cache files to bundle (no locks, temp files or debug output)."""

    def unrecognised_files(self, cache_dir: Path) -> list[str]:
        """Files the compiler wrote that select_files neither takes nor knows to leave (temp
        files, locks): another layout, which a build must not publish as if it were complete."""
        return []

    @abstractmethod
    def is_content_keyed(self, path: str) -> bool:
        """True if the path is itself a key of the compiler's cache, so any copy of it serves."""

    def launch_command(self, entry: ModelEntry, job_file: Path) -> list[str]:
        """The command that runs one worker job in a fresh process."""
        return [sys.executable, "-m", "neffbuild.backends.worker", str(job_file)]

    # -- worker side: runs in the fresh process, may import torch ------------------------------

    def prepare_process(self, shape_count: int) -> None:
        """Process-wide settings before anything compiles (a backend adds its runtime's first)."""
        import torch._dynamo

        # Each static shape is one more recompile of the same code; the default limit (8) makes
        # the ninth shape fail hard under fullgraph=True.
        limit = recompile_limit(shape_count)
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.config.accumulated_recompile_limit = max(256, 8 * limit)

    def run_device(self, entry: ModelEntry) -> str:
        """The torch device the worker moves the pipeline to."""
        return entry.device

    @abstractmethod
    def compiler(self) -> Any:
        """The torch.compile backend (a callable) that compiles graphs, as torch.compile would use it."""

    @property
    def compiler_name(self) -> str:
        return self.name

    def load_pipeline(self, entry: ModelEntry, model_ref: str) -> Any:
        """Load the pipeline the way serving does: the ordinary from_pretrained path."""
        return pipeline_class(entry).from_pretrained(model_ref, **load_arguments(entry))

    def compiler_for(self, recipe: ResolvedRecipe) -> Any:
        """The compiler for a component's recipe; a backend that takes no compiler settings
        (plan refuses them) compiles every recipe alike."""
        return self.compiler()

    def apply_mode(self, pipe: Any, entry: ModelEntry, artifacts: Path | None = None) -> Any:
        """Move the pipeline to its device, apply the entry's recipe and compile the listed
        components (backends/recipe.py): what build, replay and serve.prepare all run. With
        `artifacts` (a serving cache dir), a component whose recipe ships a package loads it
        from there instead of compiling (backends/artifacts.py)."""
        pipe = pipe.to(self.run_device(entry))
        if entry.mode != "eager":
            from neffbuild.backends.recipe import apply_recipe

            loaded = frozenset[str]()
            if artifacts is not None:
                from neffbuild.backends.artifacts import install_loaders, packaged

                loaded = packaged(entry)
                if loaded:
                    install_loaders(pipe, entry, artifacts)
            apply_recipe(pipe, entry, self, skip=loaded)
        return pipe

    def counters(self) -> dict[str, int]:
        """A snapshot of the cumulative counters in this process: the compiler's, and the graphs
        each listed component received."""
        from neffbuild.backends.components import graph_counters  # a build's: the host check has no use for it

        return {**self.compiler_counters(), **graph_counters()}

    @abstractmethod
    def compiler_counters(self) -> dict[str, int]:
        """The compiler's cumulative cache hit/miss counters, by dotted name."""

    @abstractmethod
    def compiles_in(self, delta: Mapping[str, int]) -> int:
        """How many compiles (cache misses) a counter delta shows."""

    def watch_compiles(self, on_compile: Callable[[str], None]) -> bool:
        """From now on, call on_compile(the counter's name) the moment this process starts a
        compile, before the compiler does its work (`verify --replay --fail-fast` stops there).
        False where this backend cannot tell a compile before it has run: a replay then stops
        after the call that compiled."""
        return False


def recompile_limit(shape_count: int) -> int:
    """Dynamo's recompile limit for a process that serves `shape_count` static shapes."""
    return max(8, 2 * shape_count + 2)


def pipeline_class(entry: ModelEntry) -> Any:
    import diffusers

    found = getattr(diffusers, entry.pipeline, None)
    if found is None:
        raise ValueError(f"diffusers {diffusers.__version__} has no pipeline class {entry.pipeline!r}")
    return found


def load_arguments(entry: ModelEntry) -> dict[str, Any]:
    """What every from_pretrained of an entry's models takes: its dtype and revision."""
    import torch

    kwargs: dict[str, Any] = {"torch_dtype": getattr(torch, entry.dtype)}
    if entry.revision:
        kwargs["revision"] = entry.revision
    return kwargs


def dynamo_counters(*groups: str) -> dict[str, int]:
    """torch._dynamo.utils.counters of these groups, as `group.name`."""
    from torch._dynamo.utils import counters

    return {f"{group}.{name}": int(value) for group in groups for name, value in counters[group].items()}


def watch_dynamo_counters(names: Collection[str], on_rise: Callable[[str], None]) -> None:
    """Call on_rise(`group.name`) whenever one of these torch._dynamo.utils.counters rises (torch
    counts a cache miss at the lookup that failed, before it compiles). Each named group becomes a
    watching Counter of its own class: a copy torch takes and puts back (its pattern matcher's
    lazy_init does) is of that class too, so it watches on."""
    from collections import Counter

    from torch._dynamo.utils import counters

    def watching(group: str) -> type[Counter[str]]:
        class Watched(Counter[str]):
            def __setitem__(self, key: str, value: int) -> None:
                rose = value > self.get(key, 0)
                super().__setitem__(key, value)
                if rose and f"{group}.{key}" in names:
                    on_rise(f"{group}.{key}")

        return Watched

    for group in {name.split(".", 1)[0] for name in names}:
        counters[group] = watching(group)(counters[group])


def cpu_isa_flags(cpuinfo: str) -> str:
    """The instruction-set flags that change generated kernels, from /proc/cpuinfo text."""
    relevant = re.compile(r"^(avx\w*|amx\w*|fma|f16c|sse4_[12]|bmi2|asimd\w*|sve\w*|bf16|i8mm|fp16|neon)$")
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return ",".join(sorted({f for f in value.split() if relevant.match(f)}))
    return ""


def relevant_env(
    env: Mapping[str, str], names: tuple[str, ...], prefixes: tuple[str, ...], skip: set[str]
) -> dict[str, str]:
    """`env.NAME` fingerprint fields for the variables that influence a compiler."""
    return {f"env.{k}": v for k, v in sorted(env.items()) if k not in skip and (k in names or k.startswith(prefixes))}


def components_without_graphs(entry: ModelEntry, counters: Mapping[str, int]) -> list[str]:
    """Listed components that produced no graph during a warmup call: compiled, never run."""
    from neffbuild.backends.components import GRAPH_PREFIX

    if entry.mode == "eager":
        return []
    return [c for c in entry.components if counters.get(GRAPH_PREFIX + c, 0) <= 0]


def no_graph_hint(component: str) -> str:
    name, _, method = component.partition(".")
    if method:
        return (
            f"the warmup call never called {component}, so nothing of it is cached: list the method the "
            f"pipeline calls on {name}, or remove {component!r}"
        )
    return (
        f"the warmup call never called {name}.forward, so it would run eager when serving: the pipeline "
        f"calls a method of it instead (a VAE's decode, for one): list '{name}.decode' (or the method it calls)"
    )
