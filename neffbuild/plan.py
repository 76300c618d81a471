"""Expand a manifest into build units, one per (model entry, shape), each with its cache key.

A unit's key hashes the normalised unit (model identity, pipeline, dtype, mode, shape, call
arguments, environment it sets) together with the environment fingerprint its backend reports.
Two hosts agree on a key exactly when a cache built on one serves the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neffbuild.backends import get_backend
from neffbuild.backends.base import Backend
from neffbuild.errors import ManifestError
from neffbuild.hashing import canonical_json, hash_bytes
from neffbuild.manifest import LoadedManifest, ModelEntry, Shape, is_local_model

UNIT_FORMAT = "neffbuild.unit/1"
# Config-like files that define a local model's graphs; weights only change values, not code.
_MODEL_CONFIG_SUFFIXES = {".json", ".txt", ".model", ".jinja"}
_MODEL_CONFIG_MAX_BYTES = 16 << 20

FactsProvider = Callable[[Backend, Mapping[str, str], str], Mapping[str, str]]


@dataclass(frozen=True)
class BuildUnit:
    unit_id: str
    entry: ModelEntry
    shape: Shape
    model_ref: str
    env: Mapping[str, str]  # what the unit sets for build and serving (backend defaults + manifest)
    normalized: Mapping[str, Any]
    fingerprint: Mapping[str, str]
    key: str


@dataclass(frozen=True)
class Plan:
    loaded: LoadedManifest
    backend_name: str
    units: tuple[BuildUnit, ...]
    runtime_env: Mapping[str, str] = field(default_factory=dict)

    def by_entry(self) -> dict[str, list[BuildUnit]]:
        grouped: dict[str, list[BuildUnit]] = {}
        for unit in self.units:
            grouped.setdefault(unit.entry.id, []).append(unit)
        return grouped


def collect_facts(backend: Backend, env: Mapping[str, str], device: str) -> Mapping[str, str]:
    return backend.collect_facts(env, device)


def make_plan(loaded: LoadedManifest, env: Mapping[str, str], facts_provider: FactsProvider = collect_facts) -> Plan:
    """Expand and key every unit; `env` is the environment the build will run in."""
    backend_name = _single_backend(loaded)
    backend = get_backend(backend_name)
    problems = [f"model[{e.id}]: {p}" for e in loaded.manifest.models for p in backend.validate(e, loaded)]
    if problems:
        raise ManifestError(f"{loaded.path}: " + "; ".join(problems), hint="fix the entries named above")
    facts_cache: dict[str, Mapping[str, str]] = {}
    units: list[BuildUnit] = []
    for entry in loaded.manifest.models:
        unit_env = {**backend.runtime_env(), **entry.env}
        if entry.device not in facts_cache:
            facts_cache[entry.device] = facts_provider(backend, {**env, **unit_env}, entry.device)
        fingerprint = backend.fingerprint(facts_cache[entry.device], {**env, **unit_env}, entry)
        identity = model_identity(loaded, entry)
        for shape in entry.expanded_shapes():
            normalized = normalize_unit(entry, shape, identity, unit_env)
            key = hash_bytes(canonical_json({"format": UNIT_FORMAT, "unit": normalized, "fingerprint": fingerprint}))
            units.append(
                BuildUnit(
                    unit_id=f"{entry.id}/{shape.label}",
                    entry=entry,
                    shape=shape,
                    model_ref=loaded.resolve_model(entry),
                    env=unit_env,
                    normalized=normalized,
                    fingerprint=fingerprint,
                    key=key,
                )
            )
    return Plan(loaded=loaded, backend_name=backend_name, units=tuple(units), runtime_env=_merged_env(loaded, units))


def normalize_unit(entry: ModelEntry, shape: Shape, identity: Mapping[str, str], unit_env: Mapping[str, str]) -> dict[str, Any]:
    """Everything about the unit that changes its compiled result; nothing that does not (its name)."""
    return {
        "model": dict(identity),
        "pipeline": entry.pipeline,
        "dtype": entry.dtype,
        "backend": entry.backend,
        "device": entry.device,
        "mode": entry.mode,
        "components": list(entry.components) if entry.mode != "eager" else [],
        "tensor_parallel": entry.tensor_parallel,
        "shape": shape.model_dump(),
        "call": dict(sorted(entry.call.items())),
        "env": dict(sorted(unit_env.items())),
    }


def model_identity(loaded: LoadedManifest, entry: ModelEntry) -> dict[str, str]:
    """Hub models by id and revision; local models by the digest of their config files (not
    their path, so the same model in another directory keys the same)."""
    if not is_local_model(entry.model):
        return {"hub": entry.model, "revision": entry.revision or ""}
    root = Path(loaded.resolve_model(entry))
    parts = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in _MODEL_CONFIG_SUFFIXES and path.stat().st_size <= _MODEL_CONFIG_MAX_BYTES:
            parts.append({"path": path.relative_to(root).as_posix(), "digest": hash_bytes(path.read_bytes())})
    return {"local_config": hash_bytes(canonical_json(parts))}


def _single_backend(loaded: LoadedManifest) -> str:
    names = sorted({e.backend for e in loaded.manifest.models})
    if len(names) > 1:
        raise ManifestError(
            f"{loaded.path}: entries use several backends ({', '.join(names)})",
            hint="one manifest feeds one cache dir: split it into one manifest per backend",
        )
    return names[0]


def _merged_env(loaded: LoadedManifest, units: list[BuildUnit]) -> dict[str, str]:
    """The environment one serving process needs for all entries; a clash cannot be served."""
    merged: dict[str, str] = {}
    for unit in units:
        for name, value in unit.env.items():
            if merged.setdefault(name, value) != value:
                raise ManifestError(
                    f"{loaded.path}: model[{unit.entry.id}].env.{name}: {value!r} differs from another entry's {merged[name]!r}",
                    hint="one serving process has one environment: make the entries agree",
                )
    return dict(sorted(merged.items()))
