"""`neffbuild.serve.guard`: what compiles in a serving process after warm-up, recorded or refused.

After `warmup`, every graph the manifest lists is loaded, so any compile while serving is a
request at a shape (or with arguments) nobody built: minutes on a live request. The guard hooks
the compiler's own compile events (Dynamo's start/end callbacks, which the neuron backend's
front end fires too) and appends one JSON line per compile to an events file (docs/serving.md,
"Events"); `neffbuild suggest` turns those files into manifest shapes.

Modes: "record" appends the event; "warn" also logs one line; "fail" refuses the compile before
it starts (torch's `fail_on_recompile` stance, set only after warm-up, when every listed graph has
compiled once, so a first compile cannot be mistaken for a recompile) and raises UnlistedShape
naming the call's size and the manifest entry that lacks it.

An entry with artifact 'package' compiles nothing to hook: a call its packages serve is a hit (no
event), and one they do not cover raises UnlistedShape in every mode, recorded as a refused event.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from neffbuild.backends import get_backend
from neffbuild.backends.base import Backend
from neffbuild.backends.components import (
    ComponentCall,
    add_refusal_hook,
    call_size,
    current_call,
    remove_refusal_hook,
    unlisted_hooks,
)
from neffbuild.documents.manifest import LoadedManifest, ModelEntry, load_manifest
from neffbuild.errors import DiskError, InputError, UnlistedShape
from neffbuild.serve.prepare import select_entry

log = logging.getLogger(__name__)

EVENT_FORMAT = 1
Mode = Literal["record", "warn", "fail"]
MODES: tuple[Mode, ...] = ("record", "warn", "fail")
_REFUSED = "fail_on_recompile"  # what torch's refusal says (torch/_dynamo/eval_frame.py)


@dataclass
class _Started:
    at: float
    counters: dict[str, int]
    call: ComponentCall | None
    size: dict[str, int]


@dataclass
class Guard:
    """Install with `install()` (returns self) or use as a context manager."""

    manifest: LoadedManifest
    entry: ModelEntry
    mode: Mode
    events: Path | None
    backend: Backend
    fingerprint: dict[str, str]
    _started: dict[int, _Started] = field(default_factory=dict)  # by thread: compiles nest per thread
    _prior_stance: Any = None
    _installed: bool = False
    _write_failed: bool = False

    def install(self) -> Guard:
        if self._installed:
            return self
        import torch._dynamo

        torch._dynamo.callback_handler.register_start_callback(self._on_start)
        torch._dynamo.callback_handler.register_end_callback(self._on_end)
        unlisted_hooks.append(self._on_unlisted)
        if self.mode == "fail":
            add_refusal_hook(self._refusal)
            self._prior_stance = _set_stance("fail_on_recompile")
        self._installed = True
        return self

    def uninstall(self) -> None:
        if not self._installed:
            return
        import torch._dynamo

        handler = torch._dynamo.callback_handler
        for callbacks, hook in ((handler.start_callbacks, self._on_start), (handler.end_callbacks, self._on_end)):
            if hook in callbacks:
                callbacks.remove(hook)
        if self._on_unlisted in unlisted_hooks:
            unlisted_hooks.remove(self._on_unlisted)
        if self.mode == "fail":
            remove_refusal_hook(self._refusal)
            _restore_stance(self._prior_stance)
        self._installed = False

    def __enter__(self) -> Guard:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- compile events --------------------------------------------------------------------

    def _on_start(self, *_args: Any) -> None:  # torch < 2.6 calls its callbacks without arguments
        self._started[threading.get_ident()] = _Started(
            at=time.perf_counter(), counters=self.backend.counters(), call=current_call(), size=call_size(self.entry)
        )

    def _on_end(self, *_args: Any) -> None:
        started = self._started.pop(threading.get_ident(), None)
        if started is None:
            return
        after = self.backend.counters()
        delta = {k: after.get(k, 0) - started.counters.get(k, 0) for k in sorted(set(after) | set(started.counters))}
        delta = {k: v for k, v in delta.items() if v}
        event = self._event(started.call, started.size, time.perf_counter() - started.at, delta)
        self._append(event)
        if self.mode == "warn":
            log.warning("compiled while serving: %s", describe(event, self.entry))

    def _on_unlisted(self, call: ComponentCall) -> None:
        """A package loader has no package for this call (artifact 'package'): it raises
        UnlistedShape in every mode (there is no compiler to fall back to); recorded as a
        refused event, so `suggest` turns it into a shape as it does a refused compile."""
        event = {**self._event(call, call_size(self.entry), 0.0, {}), "refused": True, "artifact": "package"}
        self._append(event)
        if self.mode == "warn":
            log.warning("no package for a call while serving: %s", describe(event, self.entry))

    def _refusal(self, call: ComponentCall, exc: Exception) -> Exception | None:
        if _REFUSED not in str(exc):
            return None
        event = {**self._event(call, call_size(self.entry), 0.0, {}), "refused": True}
        self._append(event)
        listed = ", ".join(s.label for s in self.entry.expanded_shapes())
        return UnlistedShape(
            f"{describe(event, self.entry)}: refused while serving (guard mode 'fail'); model[{self.entry.id}] "
            f"of {self.manifest.path.name} lists {listed}",
            hint="add the shape to the manifest (guard(mode='record') and `neffbuild suggest EVENTS` write it), "
            "rebuild and pull",
        )

    def _event(self, call: ComponentCall | None, size: dict[str, int], seconds: float, delta: dict[str, int]) -> dict:
        return {
            "neffbuild_event": EVENT_FORMAT,
            "time": datetime.now(UTC).isoformat(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "mode": self.mode,
            "manifest": str(self.manifest.path),
            "manifest_name": self.manifest.manifest.name,
            "entry": self.entry.id,
            "pipeline": self.entry.pipeline,
            "dtype": self.entry.dtype,
            "backend": self.entry.backend,
            "component": call.component if call else None,
            "inputs": list(call.inputs) if call else [],
            "call": size,
            "compile_s": round(seconds, 3),
            "counters": delta,
            "compiles": self.backend.compiles_in(delta),
            "fingerprint": self.fingerprint,
        }

    def _append(self, event: Mapping[str, Any]) -> None:
        if self.events is None:
            return
        line = (json.dumps(event, sort_keys=True) + "\n").encode()
        try:
            append_line(self.events, line)
        except OSError as exc:
            if not self._write_failed:  # serving goes on; say it once
                log.warning("events file %s: %s: compile events are not recorded", self.events, exc.strerror or exc)
            self._write_failed = True


def guard(
    manifest: str | os.PathLike[str] | LoadedManifest,
    entry: str | None = None,
    *,
    mode: Mode = "record",
    events: str | os.PathLike[str] | None = None,
    pipe: Any = None,
) -> Guard:
    """A guard for the manifest entry this process serves (entry: its id; None picks the entry
    whose pipeline is `pipe`'s class, or the manifest's only entry). Not installed yet: call
    `.install()` once warm-up passed, or use it as a context manager. The events file is opened
    now, so a path that cannot be written fails at start-up (DiskError), not on a request."""
    if mode not in MODES:
        raise InputError(f"guard mode {mode!r} is not one of {', '.join(MODES)}", hint="record, warn or fail")
    if mode == "record" and events is None:  # it would record nothing and look installed
        raise InputError("guard mode 'record' needs events=PATH", hint="pass the file to append compile events to")
    loaded = manifest if isinstance(manifest, LoadedManifest) else load_manifest(Path(manifest))
    chosen = _entry(loaded, entry, pipe)
    path = Path(events) if events is not None else None
    if path is not None:
        try:
            append_line(path, b"")
        except OSError as exc:
            raise DiskError(f"events file {path}: {exc.strerror or exc}", hint="make it writable") from None
    backend = get_backend(chosen.backend)
    facts = backend.collect_facts(os.environ, chosen.device)
    fingerprint = backend.fingerprint(facts, os.environ, backend.scope(chosen))
    return Guard(loaded, chosen, mode, path, backend, dict(fingerprint))


def _entry(loaded: LoadedManifest, entry: str | None, pipe: Any) -> ModelEntry:
    if pipe is not None or entry is not None:
        return select_entry(loaded, type(pipe).__name__ if pipe is not None else "", entry)
    if len(loaded.manifest.models) == 1:
        return loaded.manifest.models[0]
    return select_entry(loaded, "", None)  # refuses, listing the entries


def append_line(path: Path, line: bytes) -> None:
    """One write with O_APPEND: lines from many processes (workers of one server) interleave whole."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if line:
            os.write(fd, line)
    finally:
        os.close(fd)


def describe(event: Mapping[str, Any], entry: ModelEntry) -> str:
    size = event.get("call") or {}
    at = "x".join(str(size.get(k, "?")) for k in ("height", "width", "batch")) if size else "an unrecovered size"
    listed = {s.label for s in entry.expanded_shapes()}
    where = f"{event.get('component') or 'a graph'} of model[{entry.id}] at {at}"
    if at in listed:
        where += " (a listed shape: another call argument or the host differs)"
    inputs = event.get("inputs") or []
    return f"{where} [{', '.join(inputs)}]" if inputs else where


def _set_stance(stance: str) -> Any:
    import torch
    import torch._dynamo.eval_frame as eval_frame

    prior = getattr(eval_frame, "_stance", None)
    torch.compiler.set_stance(stance)
    return prior


def _restore_stance(prior: Any) -> None:
    import torch

    if prior is None:
        torch.compiler.set_stance("default")
        return
    torch.compiler.set_stance(
        prior.stance, skip_guard_eval_unsafe=prior.skip_guard_eval_unsafe, force_backend=prior.backend
    )
