"""Expand a manifest into build units, one per (model entry, shape), each with its cache key.

A unit's key hashes the normalised unit (model identity, pipeline, dtype, mode, components, shape,
the call arguments that change a graph, environment it sets) together with the environment
fingerprint its backend reports. Two hosts agree on a key exactly when a cache built on one
serves the other. Call arguments that only change how often graphs run (the number of steps,
prompt texts a pipeline pads to a fixed length) are left out of the key, and shown as such.

Before any key is computed, the plan is checked against this host and the pipeline: a mistake
found here costs a second, found by a worker it costs a minute of loading first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffbuild.backends import get_backend
from neffbuild.backends.base import Backend
from neffbuild.documents.manifest import LoadedManifest, ModelEntry, Shape
from neffbuild.documents.manifest_messages import join_problems
from neffbuild.documents.manifest_types import is_local_model
from neffbuild.documents.records import unit_key
from neffbuild.errors import EnvironmentMismatch, InputError, ManifestError
from neffbuild.hashing import canonical_json, hash_bytes
from neffbuild.units.plancache import CheckedFacts, EntryFacts, cached_facts, key_inputs
from neffbuild.units.weights import bakes_weights, weights_digest

if TYPE_CHECKING:
    from neffbuild.backends.pipecode import CallFacts

TEXT = "<text>"  # a prompt text left out of the key: its place (and count) stays in
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
    left_out: Mapping[str, Any] = field(default_factory=dict)  # call arguments not in the key
    # Call arguments the key holds only in part, and why (guidance_scale: "> 1 (do_classifier_free_guidance)").
    reduced: Mapping[str, str] = field(default_factory=dict)
    graph_batch: int | None = None  # the batch the compiled graphs see (after CFG); None: unknown here


@dataclass(frozen=True)
class Plan:
    loaded: LoadedManifest
    backend_name: str
    units: tuple[BuildUnit, ...]
    runtime_env: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what a user must know: another host, nothing cached, unchecked
    # [toolchain] facts that differ from this host's: (declared, here). Empty: plan for this host.
    other_host: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    def by_entry(self) -> dict[str, list[BuildUnit]]:
        grouped: dict[str, list[BuildUnit]] = {}
        for unit in self.units:
            grouped.setdefault(unit.entry.id, []).append(unit)
        return grouped


def collect_facts(backend: Backend, env: Mapping[str, str], device: str) -> Mapping[str, str]:
    return backend.collect_facts(env, device)


def make_plan(
    loaded: LoadedManifest,
    env: Mapping[str, str],
    facts_provider: FactsProvider = collect_facts,
    cache: Path | None = None,
) -> Plan:
    """Check, expand and key every unit; `env` is the environment the build will run in. With
    `cache` (plancache.cache_dir), the checks' outcome and the pipeline facts come from there when
    nothing they depend on changed: no torch import."""
    backend_name = _single_backend(loaded)
    backend = get_backend(backend_name)
    models = loaded.manifest.models
    if cache is None:
        checked = checked_facts(loaded, backend, env)
        probed = _probe(loaded, backend, env, facts_provider)
    else:
        probed = _probe(loaded, backend, env, facts_provider)
        inputs = key_inputs({e.id: _model_input(loaded, e, cache) for e in models}, probed, loaded.source_digest, env)
        checked = cached_facts(cache, inputs, env, lambda observed: checked_facts(loaded, backend, observed))
    declared = dict(loaded.manifest.toolchain or {})
    other_host = {k: (v, p.get(k, "")) for p in probed.values() for k, v in declared.items() if p.get(k) != v}
    usable = {
        device: _usable_facts(
            loaded, backend, {**p, **declared}, {**env, **backend.scope(_first_on(loaded, device)).env}
        )
        for device, p in probed.items()
    }
    units: list[BuildUnit] = []
    for entry in models:
        scope = backend.scope(entry)
        unit_env = dict(scope.env)
        fingerprint = backend.fingerprint(usable[entry.device], {**env, **unit_env}, scope)
        identity = model_identity(loaded, entry, cache)
        facts = checked.entries[entry.id]
        doubles = facts.doubles
        for shape in entry.expanded_shapes():
            normalized = normalize_unit(entry, shape, identity, unit_env, facts.keyed_call)
            units.append(
                BuildUnit(
                    unit_id=f"{entry.id}/{entry.unit_label(shape)}",
                    entry=entry,
                    shape=shape,
                    model_ref=loaded.resolve_model(entry),
                    env=unit_env,
                    normalized=normalized,
                    fingerprint=fingerprint,
                    key=unit_key(normalized, fingerprint),
                    left_out=facts.left_out,
                    reduced=facts.reduced,
                    graph_batch=None
                    if doubles is None
                    else shape.batch * entry.prompts_per_call * (2 if doubles else 1),
                )
            )
    notes = list(checked.notes)
    if other_host:
        differing = ", ".join(f"{k} {d!r} (here {h or 'absent'!r})" for k, (d, h) in sorted(other_host.items()))
        notes = [f"planning for another host: keys use the facts [toolchain] declares: {differing}", *notes]
    return Plan(
        loaded=loaded,
        backend_name=backend_name,
        units=tuple(units),
        runtime_env=_merged_env(loaded, units),
        notes=tuple(notes),
        other_host=other_host,
    )


def checked_facts(loaded: LoadedManifest, backend: Backend, env: Mapping[str, str]) -> CheckedFacts:
    """What plan learns from torch and diffusers: its checks' notes (or one ManifestError), and
    what each entry's pipeline code does with its call arguments."""
    notes = check_entries(loaded, backend, env)
    return CheckedFacts(tuple(notes), {entry.id: entry_facts(loaded, entry) for entry in loaded.manifest.models})


def entry_facts(loaded: LoadedManifest, entry: ModelEntry) -> EntryFacts:
    from neffbuild.backends.pipelines import guidance_doubles, pipeline_facts

    facts = pipeline_facts(entry)
    keyed_call, left_out, reduced = split_call(entry, facts)
    doubles = guidance_doubles(entry, loaded.resolve_model(entry), is_local_model(entry.model))
    if "guidance_scale" in keyed_call and facts and doubles is not None:
        # The comparison's outcome matters only through CFG doubling the batch; this model's
        # configs may rule CFG out either way (a distilled FLUX.2-klein: `and not is_distilled`).
        default = facts.defaults.get("guidance_scale")
        if guidance_doubles(entry, loaded.resolve_model(entry), True, default) == doubles:
            keyed_call = {k: v for k, v in keyed_call.items() if k != "guidance_scale"}
    return EntryFacts(keyed_call, left_out, reduced, doubles)


def _probe(
    loaded: LoadedManifest, backend: Backend, env: Mapping[str, str], facts_provider: FactsProvider
) -> dict[str, Mapping[str, str]]:
    """This host's facts per device, probed in the environment of the first entry on it."""
    probed: dict[str, Mapping[str, str]] = {}
    for entry in loaded.manifest.models:
        if entry.device not in probed:
            probed[entry.device] = facts_provider(backend, {**env, **backend.scope(entry).env}, entry.device)
    return probed


def _first_on(loaded: LoadedManifest, device: str) -> ModelEntry:
    return next(e for e in loaded.manifest.models if e.device == device)


def _model_input(loaded: LoadedManifest, entry: ModelEntry, memo: Path) -> dict[str, Any]:
    """What of a model the checks read: a local model's config files; a hub model's cached
    model_index.json (the components checked against it)."""
    identity = model_identity(loaded, entry, memo)
    if is_local_model(entry.model):
        return identity
    from neffbuild.backends.pipelines import model_index

    index = model_index(entry.model, entry.revision, False)
    return {**identity, "model_index": hash_bytes(canonical_json(index)) if index is not None else ""}


def check_entries(loaded: LoadedManifest, backend: Backend, env: Mapping[str, str]) -> list[str]:
    """Every check that needs no compile, before any worker starts: the toolchain table, this
    host's compiler and device, the pipeline class, call arguments and components. Raises one
    ManifestError (exit 2) with every problem; returns notes (what could not be checked, or
    what a user must know)."""
    from neffbuild.backends.pipelines import check_pipeline, model_index

    declared = loaded.manifest.toolchain is not None
    problems = _toolchain_problems(loaded, backend)
    notes: list[str] = []
    for entry in loaded.manifest.models:
        found = [*backend.validate(entry, loaded), *backend.check_host(entry, env, declared=declared)]
        if not any(p.field == "backend" for p in found):
            index = model_index(loaded.resolve_model(entry), entry.revision, is_local_model(entry.model))
            try:
                pipeline_problems, unchecked = check_pipeline(entry, index)
            except ImportError as exc:
                if not declared:
                    raise InputError(
                        f"diffusers is not importable here ({exc}): cannot plan {loaded.path}",
                        hint="pip install 'neffbuild[compile]'",
                    ) from None
                pipeline_problems, unchecked = [], ["its pipeline, call arguments and components (no diffusers here)"]
            found += pipeline_problems
            notes += [f"model[{entry.id}]: not checked before building: {what}" for what in unchecked]
        if entry.compile.dynamic == "auto":
            notes.append(auto_dynamic_note(entry))
        elif entry.compile.dynamic:
            notes.append(dynamic_note(entry))
        if entry.mode == "eager" and not backend.caches_eager:
            notes.append(
                f"model[{entry.id}]: mode 'eager' on the {backend.name} backend compiles nothing, so nothing is "
                "cached: `build` refuses it; it serves as a reference (`verify --replay --outputs`)"
            )
        problems += [(f"model[{entry.id}].{p}", p.hint) for p in found]
    if problems:
        hint = problems[0][1] if len(problems) == 1 else "fix the entries named above"
        message, details = join_problems(loaded.path, [p for p, _ in problems])
        raise ManifestError(message, hint=hint or "fix the entry named above", details=details)
    return notes


def graph_groups(entry: ModelEntry) -> list[list[str]]:
    """A dynamic entry's shapes by the graph they share: Inductor specialises sizes 0 and 1, so a
    batch of one (and a side of one) is its own graph; the others share one symbolic graph.
    Divisibility guards come from the model's code and are known only once traced (the tiny
    FLUX.2-klein transformer has none): `verify --replay` counts each shape's new graphs."""
    groups: dict[tuple[bool, bool, bool], list[str]] = {}
    for shape in entry.expanded_shapes():
        images = shape.batch * entry.prompts_per_call
        groups.setdefault((images == 1, shape.height == 1, shape.width == 1), []).append(entry.unit_label(shape))
    return list(groups.values())


def dynamic_note(entry: ModelEntry) -> str:
    groups = "; ".join(", ".join(g) for g in graph_groups(entry))
    duck = "" if not entry.compile.duck_shape else " (duck shaping may specialise sizes that happen to be equal)"
    return (
        f"model[{entry.id}]: dynamic: shapes that share a graph: {groups}{duck}; a divisibility guard in the "
        "model's code would split them further (`verify --replay` counts each shape's new graphs)"
    )


def auto_dynamic_note(entry: ModelEntry) -> str:
    from neffbuild.backends.recipecode import call_order

    return (
        f"model[{entry.id}]: dynamic 'auto' (torch.compile's default): a server must make its first calls at "
        f"{call_order(entry)}, in this order: the first shape compiles a static graph, the second the "
        "automatic-dynamic one the others share; the build compiled these, in this order"
    )


def check_buildable(plan: Plan) -> None:
    """Refuse, before any worker starts, a build that would publish nothing or lie about its keys."""
    backend = get_backend(plan.backend_name)
    if plan.other_host:
        name, (declared, here) = sorted(plan.other_host.items())[0]
        raise EnvironmentMismatch(
            f"{plan.loaded.path}: [toolchain] plans for another host ({name} {declared!r}, here {here or 'absent'!r}); "
            "this host cannot build those keys",
            hint="build on the host the [toolchain] table describes (`neffbuild plan` works from anywhere)",
        )
    eager = [e.id for e in plan.loaded.manifest.models if e.mode == "eager" and not backend.caches_eager]
    if eager:
        raise InputError(
            f"{plan.loaded.path}: model[{eager[0]}]: mode 'eager' on the {backend.name} backend compiles nothing, "
            "so there is nothing to cache or publish",
            hint="use mode = 'full' or 'regional'; an eager entry serves only as a reference for `verify --replay`",
        )


def split_call(entry: ModelEntry, facts: CallFacts | None) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """(the call arguments the key holds, those left out of it, why some are held only in part),
    from what the pipeline's own code does with them (backends/pipecode.py): warmup-only ones
    out; prompt texts the pipeline pads to a fixed length out, the prompts' number kept as <text>
    places (the other prompt-like arguments, negative or second, not even their presence); an argument the graphs see only as a comparison (guidance_scale > 1: classifier-free
    guidance on or off) keyed as that comparison's outcome, and left out where the outcome is the
    default's. Without the pipeline's code (no diffusers here) every argument is keyed as written."""
    from neffbuild.backends.pipelines import WARMUP_ONLY

    keyed: dict[str, Any] = {}
    left_out: dict[str, Any] = {}
    reduced: dict[str, str] = {}
    for name, value in sorted(entry.call_arguments().items()):
        predicate = facts.predicates.get(name) if facts else None
        outcome = predicate.holds(value) if predicate else None
        if name in WARMUP_ONLY:
            left_out[name] = value
        elif facts and name in facts.padded_prompts:
            # What reaches the components is embeddings padded to a fixed length: their shapes
            # depend on how many prompts a call makes (the batch), never on the text or on
            # whether a negative or second prompt is given (absent, the pipeline encodes "" or
            # zeros_like the prompt's, padded alike; a list must match the prompts, manifest.py).
            left_out[name] = value
            if name == "prompt":
                keyed[name] = [TEXT] * len(value) if isinstance(value, list) and len(value) > 1 else TEXT
        elif predicate and outcome is not None:
            left_out[name] = value
            default = predicate.holds(facts.defaults.get(name)) if facts else None
            reduced[name] = f"{name} {predicate.label} ({predicate.source})"
            if outcome != default:
                keyed[name] = {predicate.label: outcome}
        else:
            keyed[name] = value
    return keyed, left_out, reduced


def normalize_unit(
    entry: ModelEntry,
    shape: Shape,
    identity: Mapping[str, str],
    unit_env: Mapping[str, str],
    keyed_call: Mapping[str, Any],
) -> dict[str, Any]:
    """Everything about the unit that changes its compiled result; nothing that does not (its name,
    warmup-only call arguments). The recipe only where it is not the default, so a manifest
    without one keys as it did before recipes existed."""
    normalized = {
        "model": dict(identity),
        "pipeline": entry.pipeline,
        "dtype": entry.dtype,
        "backend": entry.backend,
        "device": entry.device,
        "mode": entry.mode,
        "components": list(entry.components) if entry.mode != "eager" else [],
        "tensor_parallel": entry.tensor_parallel,
        "shape": shape.model_dump(),
        "call": dict(keyed_call),
        "env": dict(sorted(unit_env.items())),
    }
    recipe = entry.recipe_document()
    if recipe is not None:
        normalized["recipe"] = recipe
    return normalized


def model_identity(loaded: LoadedManifest, entry: ModelEntry, memo: Path | None = None) -> dict[str, str]:
    """Hub models by id and revision; local models by the digest of their config files (not
    their path, so the same model in another directory keys the same), and of their weights too
    where the entry's compiled result holds them (units/weights.py; memo: where their digests
    are remembered, the plan cache dir)."""
    if not is_local_model(entry.model):
        return {"hub": entry.model, "revision": entry.revision or ""}
    root = Path(loaded.resolve_model(entry))
    try:
        parts = [
            {"path": path.relative_to(root).as_posix(), "digest": hash_bytes(path.read_bytes())}
            for path in sorted(root.rglob("*"))
            if _is_model_config(path)
        ]
        identity = {"local_config": hash_bytes(canonical_json(parts))}
        if entry.mode != "eager" and bakes_weights([entry.recipe_for(spec) for spec in entry.components]):
            identity["local_weights"] = weights_digest(root, _is_model_config, memo)
    except OSError as exc:
        raise ManifestError(
            f"{loaded.path}: model[{entry.id}].model: cannot read {exc.filename or root}: {exc.strerror or exc}",
            hint="the model directory must be readable by the user who plans and builds",
        ) from None
    return identity


def _is_model_config(path: Path) -> bool:
    return path.suffix in _MODEL_CONFIG_SUFFIXES and path.is_file() and path.stat().st_size <= _MODEL_CONFIG_MAX_BYTES


def plan_document(plan: Plan) -> dict[str, Any]:
    """`neffbuild plan --json`: units, keys, what each key holds and which call arguments it leaves out."""
    return {
        "manifest": str(plan.loaded.path),
        "name": plan.loaded.manifest.name,
        "backend": plan.backend_name,
        "host": "declared by [toolchain]" if plan.other_host else "this host",
        "notes": list(plan.notes),
        "env": dict(plan.runtime_env),
        "units": [
            {
                "unit_id": u.unit_id,
                "key": u.key,
                "unit": u.normalized,
                "left_out_of_key": dict(u.left_out),
                "reduced_in_key": dict(u.reduced),
                "graph_batch": u.graph_batch,
                "fingerprint": u.fingerprint,
            }
            for u in plan.units
        ],
    }


def _toolchain_problems(loaded: LoadedManifest, backend: Backend) -> list[tuple[str, str]]:
    import difflib

    problems = []
    for name in loaded.manifest.toolchain or {}:
        if name not in backend.fact_names:
            close = difflib.get_close_matches(name, backend.fact_names, n=1, cutoff=0.6)
            problems.append(
                (
                    f"toolchain.{name}: not a fact of the {backend.name} backend"
                    + (f"; did you mean {close[0]!r}?" if close else ""),
                    f"it takes {', '.join(backend.fact_names)}",
                )
            )
    return problems


def _usable_facts(
    loaded: LoadedManifest, backend: Backend, facts: Mapping[str, str], env: Mapping[str, str]
) -> Mapping[str, str]:
    unusable = backend.unusable_facts(facts, env)
    if unusable:
        source = "[toolchain] declares" if loaded.manifest.toolchain else "this host has"
        raise ManifestError(
            f"{loaded.path}: toolchain: {source} no {', '.join(unusable)}: keys would not name what builds them",
            hint=f'declare them in the manifest\'s [toolchain] table (e.g. {unusable[0]} = "..."), '
            "or plan on the build host",
        )
    return facts


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


def recipe_code(path: Path, entry_id: str | None, env: Mapping[str, str]) -> str:
    """`neffbuild recipe`: the entry's recipe as plain Python, after the plan's checks (exit 2)."""
    from neffbuild.backends.base import recompile_limit
    from neffbuild.backends.recipecode import recipe_source
    from neffbuild.documents.manifest import load_manifest

    loaded = load_manifest(path)
    entries = loaded.manifest.models
    if entry_id is None and len(entries) > 1:
        raise InputError(
            f"{path}: {len(entries)} entries", hint=f"pass --entry, one of {', '.join(e.id for e in entries)}"
        )
    entry = next((e for e in entries if entry_id in (None, e.id)), None)
    if entry is None:
        raise InputError(f"{path}: no entry {entry_id!r}", hint=f"its entries: {', '.join(e.id for e in entries)}")
    backend = get_backend(entry.backend)
    check_entries(loaded, backend, env)
    return recipe_source(entry, backend.run_device(entry), recompile_limit(len(entry.expanded_shapes())))
