"""The interface between neffbuild's core and a compiler backend.

The core (plan, build, pull, verify) never imports torch. A backend answers two kinds of
questions: on the planning side, which files of its cache dir form a bundle, what in the
environment keys them and whether this host can build them; inside a worker process (a fresh
interpreter per build unit), how to load the pipeline, compile it and count compiles. Only the
worker-side methods may import torch; collect_facts reads files, so that `status` and `pull`
can judge a host in a fraction of a second (it imports torch only for a fact no file holds).
This module imports neither torch nor the manifest's validation library for the same reason.

Every listed component is compiled through a GraphCounter, so a build can prove that each one
actually ran compiled (a VAE compiled as `vae` wraps forward, while pipelines call vae.decode).
"""

from __future__ import annotations

import re
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from neffbuild.documents.manifest import LoadedManifest, ModelEntry, ResolvedRecipe

# torch._dynamo.utils.counters group the GraphCounters write; reported as "graphs.<component>".
GRAPH_GROUP = "neffbuild.graphs"
GRAPH_PREFIX = "graphs."


@dataclass(frozen=True)
class Problem:
    """Something found before any worker starts: the entry's field, what is wrong, how to fix it."""

    field: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


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

            apply_recipe(pipe, entry, self, artifacts)
        return pipe

    def counters(self) -> dict[str, int]:
        """A snapshot of the cumulative counters in this process: the compiler's, and the graphs
        each listed component received."""
        return {**self.compiler_counters(), **graph_counters()}

    @abstractmethod
    def compiler_counters(self) -> dict[str, int]:
        """The compiler's cumulative cache hit/miss counters, by dotted name."""

    @abstractmethod
    def compiles_in(self, delta: Mapping[str, int]) -> int:
        """How many compiles (cache misses) a counter delta shows."""


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


class GraphCounter:
    """A torch.compile backend that counts each graph Dynamo hands it, then compiles it with the
    real compiler: proof that a listed component ran compiled. Compiler caches key on the graph,
    not on the backend object, so what it writes serves a plain torch.compile (measured: a server
    compiling with backend="inductor" hits every entry a build through it wrote)."""

    def __init__(self, component: str, compiler: Any, compiler_name: str) -> None:
        self.component = component
        self.compiler = compiler
        self.compiler_name = compiler_name  # Dynamo reads it as it would the backend's own name

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._dynamo.utils import counters

        counters[GRAPH_GROUP][self.component] += 1
        return self.compiler(gm, example_inputs, **kwargs)


def compile_components(pipe: Any, entry: ModelEntry, backend: Backend, skip: frozenset[str] = frozenset()) -> None:
    """Compile each listed component (but those in `skip`) the way serving must: `name` compiles
    the module's forward (`full`) or its repeated blocks (`regional`); `name.method` compiles that
    bound method. Each with its recipe's compiler settings (backends/recipe.py)."""
    import torch

    from neffbuild.backends.recipe import compile_options, scoped

    for spec, (name, method) in zip(entry.components, entry.components_named(), strict=True):
        component = getattr(pipe, name, None)
        if component is None:
            raise ValueError(f"pipeline {entry.pipeline} has no component {name!r}")
        if spec in skip:
            continue
        recipe = entry.recipe_for(spec)
        counter = GraphCounter(spec, backend.compiler_for(recipe), backend.compiler_name)
        options = {"backend": counter, **compile_options(recipe)}
        if method is not None:
            bound = getattr(component, method, None)
            if not callable(bound):
                raise ValueError(f"{type(component).__name__} has no method {method!r}")
            setattr(component, method, scoped(_recorded(spec, torch.compile(bound, **options)), recipe))
        elif entry.mode == "full":
            # The recipe's torch.compile arguments (dynamic!), not fixed ones: a dynamic entry
            # compiled static graphs here, one per shape, and nothing said so.
            component.compile(backend=counter, **compile_options(recipe))
            # Module.compile keeps the compiled call here; recording outside it keeps the
            # graph whole (a hook would run inside it).
            component._compiled_call_impl = scoped(_recorded(spec, component._compiled_call_impl), recipe)
        elif not getattr(component, "_repeated_blocks", None):
            raise ValueError(f"{type(component).__name__} declares no _repeated_blocks; use mode 'full'")
        else:
            component.compile_repeated_blocks(backend=counter, **compile_options(recipe))
            # The blocks compile inside the component's call: record and scope around it.
            component.forward = scoped(_recorded(spec, component.forward), recipe)


_INPUTS: dict[str, dict[str, None]] = {}  # component -> its distinct input signatures, in call order
_MAX_SIGNATURES = 16  # per component: a pipeline passing a per-step scalar would list every step
_CURRENT = threading.local()  # .call: the listed component this thread is calling, and its inputs


@dataclass(frozen=True, slots=True)
class ComponentCall:
    """A listed component's call in progress. Its inputs are described only when asked (a
    compile event): describing every call's arguments would cost every denoising step."""

    component: str  # the listed spec, e.g. "vae.decode"
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]

    @property
    def inputs(self) -> tuple[str, ...]:
        """describe_input of each argument, keywords as name=..."""
        return signature_parts(self.args, self.kwargs)


# Set by a serving guard (neffbuild.serve.guard): turns an error a compiled call raised (a
# refused recompile) into the guard's own, or returns None to let it pass.
RefusalHook = Callable[[ComponentCall, Exception], Exception | None]
_refusal_hooks: list[RefusalHook] = []
# Set by a build that packages components (backends/artifacts.py): sees each listed component's
# call arguments as the pipeline passes them.
CallHook = Callable[[str, tuple[Any, ...], Mapping[str, Any]], None]
_call_hooks: list[CallHook] = []


def add_call_hook(hook: CallHook) -> None:
    _call_hooks.append(hook)


def remove_call_hook(hook: CallHook) -> None:
    if hook in _call_hooks:
        _call_hooks.remove(hook)


def add_refusal_hook(hook: RefusalHook) -> None:
    _refusal_hooks.append(hook)


def remove_refusal_hook(hook: RefusalHook) -> None:
    if hook in _refusal_hooks:
        _refusal_hooks.remove(hook)


def current_call() -> ComponentCall | None:
    """The listed component this thread is inside (its latest call), for compile events."""
    return getattr(_CURRENT, "call", None)


def _recorded(spec: str, compiled: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        _record(spec, args, kwargs)
        this = ComponentCall(spec, args, kwargs)
        outer = current_call()
        _CURRENT.call = this
        try:
            return compiled(*args, **kwargs)
        except RuntimeError as exc:
            for hook in tuple(_refusal_hooks):
                refusal = hook(this, exc)
                if refusal is not None:
                    raise refusal from exc
            raise
        finally:
            _CURRENT.call = outer

    return call


def _record(spec: str, args: Any, kwargs: Any) -> None:
    for hook in tuple(_call_hooks):
        hook(spec, args, kwargs)
    seen = _INPUTS.setdefault(spec, {})
    if len(seen) < _MAX_SIGNATURES:
        seen.setdefault(", ".join(signature_parts(args, kwargs)), None)


def signature_parts(args: Any, kwargs: Any) -> tuple[str, ...]:
    return tuple([describe_input(a) for a in args] + [f"{k}={describe_input(v)}" for k, v in sorted(kwargs.items())])


def describe_input(value: Any) -> str:
    """What a compiled graph is specialised on: a tensor's shape and dtype (not its values), a
    plain value as itself, containers item by item, anything else by its type."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{list(value.shape)}".replace("torch.", "")
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(describe_input(v) for v in value) + ")"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(f"{k}: {describe_input(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
            + "}"
        )
    return type(value).__name__


def input_signatures() -> dict[str, tuple[str, ...]]:
    """Every listed component's distinct input signatures in this process so far."""
    return {spec: tuple(seen) for spec, seen in sorted(_INPUTS.items())}


def graph_counters() -> dict[str, int]:
    """Graphs handed to each component's GraphCounter in this process, as `graphs.<component>`."""
    from torch._dynamo.utils import counters

    return {f"{GRAPH_PREFIX}{name}": int(n) for name, n in counters[GRAPH_GROUP].items()}


def components_without_graphs(entry: ModelEntry, counters: Mapping[str, int]) -> list[str]:
    """Listed components that produced no graph during a warmup call: compiled, never run."""
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
