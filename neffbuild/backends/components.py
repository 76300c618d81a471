"""A pipeline's listed components as they run compiled: each graph Dynamo hands a component is
counted (GraphCounter), so a build can prove that each one actually ran compiled (a VAE compiled
as `vae` wraps forward, while pipelines call vae.decode), and each call is recorded: the distinct
input signatures the worker reports, and the call in progress a serving guard names in a compile
event or turns a refused recompile into its own error through.

Imports torch only inside the functions that run in a worker or a serving process.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from neffbuild.documents.manifest import ModelEntry

# torch._dynamo.utils.counters group the GraphCounters write; reported as "graphs.<component>".
GRAPH_GROUP = "neffbuild.graphs"
GRAPH_PREFIX = "graphs."


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


# Told by a package loader (backends/artifacts.py) of a call no package covers, before it raises:
# a serving guard records it as an event (neffbuild.serve.guard).
unlisted_hooks: list[Callable[[ComponentCall], None]] = []


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


def recorded(spec: str, compiled: Any) -> Any:
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


def call_size(entry: ModelEntry) -> dict[str, int]:
    """The pipeline call's resolved height, width and images per prompt, read from the frame of
    the pipeline's __call__ this compile happens under (diffusers resolves defaults into locals)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "__call__" else None
        if owner is not None and type(owner).__name__ == entry.pipeline:
            found = {k: frame.f_locals.get(k) for k in ("height", "width", "num_images_per_prompt")}
            size = {k: v for k, v in found.items() if isinstance(v, int) and not isinstance(v, bool)}
            if "num_images_per_prompt" in size:
                size["batch"] = size.pop("num_images_per_prompt")
            return size
        frame = frame.f_back
    return {}
