"""The plan document: `neffbuild plan --out plan.json`, read by `build --plan` and `release --plan`.

Keys depend on the facts of the host that plans them (CPU ISA, compiler, instance type). A fleet
plans once, on the kind of host that builds, and hands the document to every shard and to the
fan-in: a shard checks that its own facts give the planned keys (and fails naming the fields
that differ: its compile would not produce what the key says), the fan-in takes the units and
keys as written and computes nothing, so it may run on any machine.

The document also freezes the durations the shards are balanced by, so every shard computes the
same partition whatever lands in the store meanwhile.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from neffbuild.documents.manifest import LoadedManifest
from neffbuild.documents.records import digest_problem, parse, to_json
from neffbuild.errors import EnvironmentMismatch, InputError, NeffbuildError
from neffbuild.formats import writes
from neffbuild.fs.atomic import write_atomic
from neffbuild.units.plan import BuildUnit, Plan

PLAN_FORMAT = writes("plan")  # parse reads every plan format (neffbuild/formats.py)
MAX_PLAN_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class PlannedUnit:
    unit_id: str
    key: str = field(metadata={"check": digest_problem})
    fingerprint: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlanDocument:
    name: str
    manifest_digest: str = field(metadata={"check": digest_problem})
    backend: str
    env: dict[str, str]  # the release's runtime environment (plan.runtime_env)
    units: tuple[PlannedUnit, ...]
    durations: dict[str, float] = field(default_factory=dict)  # seconds by unit id (shards.assign)
    shards: int = 0  # the shard count `plan --shards` showed; 0: none chosen
    format: str = PLAN_FORMAT

    @property
    def unit_ids(self) -> tuple[str, ...]:
        return tuple(u.unit_id for u in self.units)


def plan_to_document(plan: Plan, durations: Mapping[str, float], shards: int = 0) -> PlanDocument:
    return PlanDocument(
        name=plan.loaded.manifest.name,
        manifest_digest=plan.loaded.source_digest,
        backend=plan.backend_name,
        env=dict(plan.runtime_env),
        units=tuple(PlannedUnit(u.unit_id, u.key, dict(u.fingerprint)) for u in plan.units),
        durations={k: round(v, 3) for k, v in sorted(durations.items())},
        shards=shards,
    )


def write_plan(path: Path, document: PlanDocument) -> None:
    write_atomic(path, (json.dumps(to_json(document), indent=1, sort_keys=True) + "\n").encode())


def read_plan(path: Path) -> PlanDocument:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
    except OSError as exc:
        raise InputError(
            f"--plan {path}: cannot read it ({exc.strerror or exc})", hint="pass the file `neffbuild plan --out` wrote"
        ) from None
    if len(data) > MAX_PLAN_BYTES:
        raise InputError(
            f"--plan {path}: larger than {MAX_PLAN_BYTES >> 20} MiB", hint="pass the file `neffbuild plan --out` wrote"
        )
    try:
        return parse(PlanDocument, data, f"plan {path}")
    except NeffbuildError as exc:  # a bad plan is bad input here, not a damaged store object
        raise InputError(exc.message, hint="write it again with `neffbuild plan MANIFEST --out FILE`") from None


def check_manifest(document: PlanDocument, loaded: LoadedManifest, path: Path) -> None:
    """The plan must be of this manifest, byte for byte: its keys say nothing about another."""
    if document.manifest_digest != loaded.source_digest:
        raise InputError(
            f"--plan {path}: planned from another version of {loaded.path} "
            f"(manifest digest {document.manifest_digest[:12]}, this one {loaded.source_digest[:12]})",
            hint="plan again from this manifest, or use the manifest the plan was written from",
        )


def check_against(document: PlanDocument, plan: Plan, path: Path) -> None:
    """This host's own plan must give the planned units and keys. A fingerprint field that differs
    is this host's environment (exit 7, naming the fields); anything else is the input."""
    ours = {u.unit_id: u for u in plan.units}
    planned_ids = document.unit_ids
    if set(planned_ids) != set(ours):
        only = sorted(set(planned_ids) ^ set(ours))
        raise InputError(
            f"--plan {path}: its units differ from the manifest's ({', '.join(only[:3])}{' ...' if len(only) > 3 else ''})",
            hint="plan again from this manifest",
        )
    fields: dict[str, tuple[str | None, str | None]] = {}
    for planned in document.units:
        here = ours[planned.unit_id].fingerprint
        for name in sorted(set(here) | set(planned.fingerprint)):
            if here.get(name) != planned.fingerprint.get(name):
                fields.setdefault(name, (planned.fingerprint.get(name), here.get(name)))
    if fields:
        shown = ", ".join(f"{k}: planned {p!r}, here {h!r}" for k, (p, h) in sorted(fields.items())[:4])
        raise EnvironmentMismatch(
            f"--plan {path}: this host's facts differ from the plan's ({shown})",
            hint="run the shard on the kind of host the plan was made on, or plan again there",
        )
    differing = [u.unit_id for u in document.units if ours[u.unit_id].key != u.key]
    if differing:
        raise InputError(
            f"--plan {path}: {differing[0]}: its key differs from the plan's although the facts agree "
            "(the model's config files changed since the plan?)",
            hint="plan again from this manifest and model",
        )


def selected(plan: Plan, unit_ids: Sequence[str]) -> tuple[BuildUnit, ...]:
    wanted = set(unit_ids)
    return tuple(u for u in plan.units if u.unit_id in wanted)
