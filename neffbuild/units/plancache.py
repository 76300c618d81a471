"""The plan-time facts that need torch and diffusers, cached by what they depend on.

`plan` checks a manifest against the installed diffusers (pipeline class, call arguments,
components) and reads what the pipeline's code does with each call argument: that imports torch
and diffusers, seconds before a no-op build can see that every unit is in the store. Those facts
change only when one of their inputs does, so they are kept in a small JSON file named by a digest
of the inputs: the manifest (its decoded content), each model's config files (or a hub model's
cached model_index.json), this host's facts as the backend reads them from files, the installed
versions of torch, diffusers, transformers and the rest (package metadata, not imports), the
Python (executable, version) and where each of those would be imported from, neffbuild's own code, and the environment variables that
reach a compiler's keys (CI and the compiler's prefixes). The variables torch and diffusers read
while the facts were computed (recorded as a worker records them, backends/envreads.py) are kept
in the file and compared on the next lookup: a changed value is a miss.

A miss, an unreadable or corrupt file (logged, then replaced) or a disabled cache computes the
facts as before. A failing check is never cached: only facts of a plan that passed them.

Where: $NEFFBUILD_PLAN_CACHE (a dir, or `off` to disable), else $XDG_CACHE_HOME/neffbuild/plans,
else ~/.cache/neffbuild/plans (docs/building.md, "The plan cache").
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffbuild.backends.envreads import ReadRecorder, not_keyed, value_digest
from neffbuild.errors import NeffbuildError
from neffbuild.formats import FORMATS, writes
from neffbuild.hashing import canonical_json, hash_bytes
from neffbuild.version import installed_version

log = logging.getLogger(__name__)

Compute = Callable[[Mapping[str, str]], "CheckedFacts"]  # the facts, computed in this environment

CACHE_ENV = "NEFFBUILD_PLAN_CACHE"
_OFF = {"off", "0", "false", "no"}
_KIND = "plan cache"
# Distributions whose code the facts come from or whose presence a check looks at.
PACKAGES = (
    "neffbuild", "torch", "diffusers", "transformers", "huggingface_hub", "accelerate", "torchao", "triton",
    "torch-neuronx", "neuronx-cc",
)  # fmt: skip  # a table: its rows packed, not one item a line
# Where each would be imported from (located, not imported): a module earlier on sys.path
# (PYTHONPATH) replaces an installed one without changing its metadata.
MODULES = (
    "neffbuild", "torch", "diffusers", "transformers", "huggingface_hub", "accelerate", "torchao", "triton",
    "torch_neuronx", "neuronxcc",
)  # fmt: skip  # a table: its rows packed, not one item a line
# Variables that reach a compiler's keys whether or not a lookup saw them read (issue 32: torch
# reads CI into AOTAutograd's key at import); every one present is part of the cache key.
KEY_NAMES = ("CI", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "CXX", "CC")
KEY_PREFIXES = ("TORCH", "PYTORCH_", "TRITON_", "NEURON", "XLA_", "DIFFUSERS_", "TRANSFORMERS_")


@dataclass(frozen=True)
class EntryFacts:
    """What an entry's pipeline code says of its call: the arguments keyed (some reduced), those
    left out, why some are held only in part, and whether CFG doubles the batch (None: unknown)."""

    keyed_call: Mapping[str, Any]
    left_out: Mapping[str, Any]
    reduced: Mapping[str, str]
    doubles: bool | None


@dataclass(frozen=True)
class CheckedFacts:
    """The outcome of plan's checks that passed (their notes) and each entry's facts, by entry id."""

    notes: tuple[str, ...]
    entries: Mapping[str, EntryFacts]


def cache_dir(env: Mapping[str, str]) -> Path | None:
    """Where plan facts are cached; None when disabled ($NEFFBUILD_PLAN_CACHE=off) or no home."""
    chosen = env.get(CACHE_ENV, "").strip()
    if chosen.lower() in _OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    xdg = env.get("XDG_CACHE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "neffbuild" / "plans"
    home = env.get("HOME", "")
    return Path(home) / ".cache" / "neffbuild" / "plans" if home else None


def key_inputs(
    models: Mapping[str, Any], host: Mapping[str, Any], source_digest: str, env: Mapping[str, str]
) -> dict[str, Any]:
    """Everything the cached facts depend on that can be read without importing torch."""
    return {
        "format": writes(_KIND),
        "manifest": source_digest,
        "models": dict(models),
        "host": dict(host),
        "packages": {name: installed_version(name) for name in PACKAGES},
        "modules": {name: _origin(name) for name in MODULES},
        "python": {"executable": sys.executable, "version": sys.version},
        "code": code_digest(),
        "env": keyed_env(env),
    }


def keyed_env(env: Mapping[str, str]) -> dict[str, str]:
    """Digests (never values) of the variables that reach a compiler's keys, as set in env."""
    return {
        name: value_digest(name, value)
        for name, value in sorted(env.items())
        if (name in KEY_NAMES or name.startswith(KEY_PREFIXES)) and not_keyed(name) is None
    }


def code_digest() -> str:
    """neffbuild's own code as (path, size, mtime): an edited checkout plans afresh."""
    root = Path(__file__).resolve().parent.parent
    parts = []
    for path in sorted(root.rglob("*.py")):
        with contextlib.suppress(OSError):
            st = path.stat()
            parts.append([path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns])
    return hash_bytes(canonical_json(parts))


def cached_facts(
    directory: Path | None, inputs: Mapping[str, Any], env: Mapping[str, str], compute: Compute
) -> CheckedFacts:
    """The facts for these inputs from the cache, else computed (recording what they read) and kept."""
    if directory is None:
        return compute(env)
    path = directory / f"{hash_bytes(canonical_json(dict(inputs)))}.json"
    found = lookup(path, env)
    if found is not None:
        log.debug("plan cache: hit %s", path)
        return found
    with recording(env) as (observed, reads):
        facts = compute(observed)
    keep(path, facts, reads(), inputs)
    return facts


def lookup(path: Path, env: Mapping[str, str]) -> CheckedFacts | None:
    """The facts kept at path if every variable they read still has its value; None otherwise
    (a corrupt file is logged and ignored)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        log.debug("plan cache: miss %s", path)
        return None
    except OSError as exc:
        log.warning("plan cache: ignoring %s: %s", path, exc.strerror or exc)
        return None
    try:
        document = json.loads(raw)
        if not isinstance(document, dict) or document.get("format") not in FORMATS[_KIND].reads:
            raise ValueError("not a plan cache document")
        reads, facts = document["reads"], decode_facts(document["facts"])
        if not isinstance(reads, dict):
            raise ValueError("reads is not an object")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        log.warning("plan cache: ignoring corrupt %s (%s); planning afresh", path, str(exc).splitlines()[0][:120])
        return None
    changed = next(
        (name for name, digest in sorted(reads.items()) if value_digest(name, env.get(name)) != digest), None
    )
    if changed is not None:
        log.info("plan cache: %s changed since the facts were cached; planning afresh", changed)
        return None
    return facts


def keep(path: Path, facts: CheckedFacts, reads: Mapping[str, str], inputs: Mapping[str, Any]) -> None:
    """Write the facts (atomically); a cache that cannot be written is logged, never an error."""
    from neffbuild.fs.atomic import write_atomic

    try:
        document = {"format": writes(_KIND), "inputs": dict(inputs), "reads": dict(reads), "facts": encode_facts(facts)}
        body = json.dumps(document, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:  # a call argument JSON cannot hold (a TOML date)
        log.debug("plan cache: not kept (%s)", exc)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(path, body, mode=0o600)
    except (OSError, NeffbuildError) as exc:
        log.warning("plan cache: cannot write %s (%s); set %s=off to skip it", path, exc, CACHE_ENV)


@contextlib.contextmanager
def recording(env: Mapping[str, str]) -> Iterator[tuple[Mapping[str, str], Callable[[], dict[str, str]]]]:
    """While the facts are computed, note each variable read through os.environ (torch and
    diffusers read theirs at import) or through env (the backend's checks); yields env observed
    and a function giving the digests of what was read (values as in env)."""
    inner = os.environ
    recorder = None if isinstance(inner, ReadRecorder) else ReadRecorder(inner)
    observed = ReadRecorder(dict(env))
    if recorder is not None:
        os.environ = recorder  # type: ignore[assignment]  # noqa: B003 - the same environment, observed
    try:
        yield (
            observed,
            lambda: {
                name: value_digest(name, env.get(name))
                for name in sorted({*observed.read, *(recorder.read if recorder else ())})
                if not_keyed(name) is None
            },
        )
    finally:
        if recorder is not None:
            os.environ = inner  # noqa: B003 - the wrapper taken off again


def encode_facts(facts: CheckedFacts) -> dict[str, Any]:
    return {
        "notes": list(facts.notes),
        "entries": {
            entry_id: {
                "keyed_call": dict(e.keyed_call),
                "left_out": dict(e.left_out),
                "reduced": dict(e.reduced),
                "doubles": e.doubles,
            }
            for entry_id, e in facts.entries.items()
        },
    }


def decode_facts(raw: Any) -> CheckedFacts:
    """Strict: anything but what encode_facts writes is a ValueError (the file is corrupt)."""
    notes, entries = raw["notes"], raw["entries"]
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes) or not isinstance(entries, dict):
        raise ValueError("notes or entries malformed")
    decoded = {}
    for entry_id, e in entries.items():
        parts = (e["keyed_call"], e["left_out"], e["reduced"])
        if not all(isinstance(p, dict) for p in parts) or not (e["doubles"] is None or isinstance(e["doubles"], bool)):
            raise ValueError(f"entry {entry_id!r} malformed")
        if not all(isinstance(v, str) for v in e["reduced"].values()):
            raise ValueError(f"entry {entry_id!r}: reduced malformed")
        decoded[entry_id] = EntryFacts(e["keyed_call"], e["left_out"], e["reduced"], e["doubles"])
    return CheckedFacts(tuple(notes), decoded)


def _origin(name: str) -> str:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return ""
    return str(spec.origin or "") if spec is not None else ""
