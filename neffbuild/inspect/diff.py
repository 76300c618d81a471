"""`neffbuild diff A B`: what changed between two releases (or two bundles), and exactly why.

Units pair by identity without the key: the model entry (the unit id before its last `/`) and
the shape. A unit whose key is the same on both sides is unchanged; a paired unit whose key
differs is changed, and its changes are the fields that differ between the two normalised units
(`unit.shape.height`, `unit.env.OMP_NUM_THREADS`) and the two fingerprints (`torch`, `cpu.isa`,
`env.OMP_NUM_THREADS`: the fingerprint's own field names): nothing else enters a key, so these
are every reason a key moved. A unit whose shape changed is another unit (one removed, one
added); `diff KEY_A KEY_B` compares any two bundles field by field (`unit.shape.height 1024 -> 768`).

Release fields that are not derived from units (name, backend, cache variable, manifest digest,
served environment) are compared as `release.<field>`; files by path (added, removed, changed).

`diff --host REF` compares a release with this host instead: each unit's bundle fingerprint with
the fingerprint this host gives that unit, run as the server will (this environment with the
release's exports over it), through the host check `status` and `pull` use (neffbuild.host.hostcheck):
each differing field marked breaking or informational by the backend's own lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from neffbuild.documents.bundles import BundleRecord, ResolvedBundle
from neffbuild.documents.records import FileEntry, Release
from neffbuild.documents.refs import ResolvedRelease, resolve, resolve_any
from neffbuild.errors import InputError
from neffbuild.hashing import canonical_json
from neffbuild.host.exports import serving_env
from neffbuild.host.hostcheck import Facts, HostReport, check_host, read_facts
from neffbuild.inspect.read import DOC_JOBS
from neffbuild.inspect.show import release_bundles
from neffbuild.store.base import Store

ABSENT = None  # a field one side lacks


@dataclass(frozen=True)
class FieldChange:
    path: str
    old: Any  # None: absent on that side
    new: Any


@dataclass(frozen=True)
class UnitChange:
    unit_id: str  # B's
    old_unit_id: str  # A's: another only when two bundles are compared
    old_key: str
    new_key: str
    fields: tuple[FieldChange, ...]  # empty only if the key formula itself changed
    # Both builds recorded what each component received, and it was the same: the key moved
    # for something no graph sees (True), the graphs differ (False), or unknown (None).
    same_graphs: bool | None = None


@dataclass(frozen=True)
class FileChange:
    path: str
    old_size: int | None  # None: added
    new_size: int | None  # None: removed
    old_digest: str | None
    new_digest: str | None


@dataclass(frozen=True)
class Diff:
    kind: str  # "release" or "bundle"
    old: str  # release id or bundle key
    new: str
    release: tuple[FieldChange, ...]
    added: tuple[str, ...]  # unit ids only in new
    removed: tuple[str, ...]  # unit ids only in old
    unchanged: tuple[str, ...]
    changed: tuple[UnitChange, ...]
    files_added: tuple[FileChange, ...]
    files_removed: tuple[FileChange, ...]
    files_changed: tuple[FileChange, ...]

    @property
    def identical(self) -> bool:
        return not (
            self.release
            or self.added
            or self.removed
            or self.changed
            or self.files_added
            or self.files_removed
            or self.files_changed
        )


@dataclass(frozen=True)
class HostDiff:
    """A release against this host: per unit, the fields that differ (old: the build's, new: here)."""

    release_id: str
    name: str
    tag: str | None
    host: HostReport  # units: key built under, key this host gives it, differing fields

    @property
    def identical(self) -> bool:
        return not self.host.diffs


def diff_host(
    store: Store, ref: str, env: Mapping[str, str], *, facts: Facts = read_facts, jobs: int = DOC_JOBS
) -> HostDiff:
    """REF's release (TAG, TAG@N, release id or prefix) against this host as the server will run
    it: env with the release's exports over it. Nothing is compiled."""
    resolved = resolve(store, ref)
    records = release_bundles(store, resolved.release_id, resolved.release, jobs)
    units = [records[u.key] for u in resolved.release.units]
    if not units:  # nothing was built: nothing to compare
        return HostDiff(
            resolved.release_id, resolved.release.name, resolved.tag, HostReport(resolved.release.backend, (), ())
        )
    report = check_host(units, serving_env(env, resolved.release.env), facts=facts)
    return HostDiff(resolved.release_id, resolved.release.name, resolved.tag, report)


def diff(store: Store, old_ref: str, new_ref: str, *, jobs: int = DOC_JOBS) -> Diff:
    old, new = resolve_any(store, old_ref), resolve_any(store, new_ref)
    if isinstance(old, ResolvedBundle) and isinstance(new, ResolvedBundle):
        return _diff_bundles(old.record, new.record)
    if isinstance(old, ResolvedRelease) and isinstance(new, ResolvedRelease):
        return _diff_releases(store, old, new, jobs)
    raise InputError(
        f"{old_ref!r} and {new_ref!r}: one is a release, the other a bundle",
        hint="diff two releases, or two bundle keys",
    )


def _diff_bundles(old: BundleRecord, new: BundleRecord) -> Diff:
    change = _unit_change(old, new)
    same = old.key == new.key
    return Diff(
        "bundle", old.key, new.key, (), (), (),
        (new.unit_id,) if same else (), () if same else (change,), *file_changes(old.files, new.files),
    )  # fmt: skip  # arguments packed by meaning, not one a line


def _diff_releases(store: Store, old: ResolvedRelease, new: ResolvedRelease, jobs: int) -> Diff:
    records = {
        **release_bundles(store, old.release_id, old.release, jobs),
        **release_bundles(store, new.release_id, new.release, jobs),
    }
    olds = [records[u.key] for u in old.release.units]
    news = [records[u.key] for u in new.release.units]
    pairs, removed, added = pair_units(olds, news)
    unchanged = tuple(n.unit_id for o, n in pairs if o.key == n.key)
    changed = tuple(_unit_change(o, n) for o, n in pairs if o.key != n.key)
    return Diff(
        "release", old.release_id, new.release_id, release_changes(old.release, new.release),
        tuple(r.unit_id for r in added), tuple(r.unit_id for r in removed), unchanged, changed,
        *file_changes(old.release.files, new.release.files),
    )  # fmt: skip  # arguments packed by meaning, not one a line


def pair_units(
    olds: Sequence[BundleRecord], news: Sequence[BundleRecord]
) -> tuple[list[tuple[BundleRecord, BundleRecord]], list[BundleRecord], list[BundleRecord]]:
    """(paired, only in olds, only in news), in each side's order."""
    by_identity = {identity(r): r for r in olds}
    pairs, added = [], []
    for record in news:
        match = by_identity.pop(identity(record), None)
        if match is not None:
            pairs.append((match, record))
        else:
            added.append(record)
    removed = [r for r in olds if identity(r) in by_identity]
    return pairs, removed, added


def identity(record: BundleRecord) -> tuple[str, str]:
    """A unit without its key: its model entry and its shape (the unit id, if it records none)."""
    shape = record.unit.get("shape")
    entry = record.unit_id.rpartition("/")[0] or record.unit_id
    return entry, canonical_json(shape).decode() if isinstance(shape, dict) else record.unit_id


def _unit_change(old: BundleRecord, new: BundleRecord) -> UnitChange:
    fields = field_changes(flatten(old.unit, "unit."), flatten(new.unit, "unit."))
    fields += field_changes(dict(old.fingerprint), dict(new.fingerprint))
    same = old.inputs == new.inputs if old.inputs and new.inputs else None
    return UnitChange(new.unit_id, old.unit_id, old.key, new.key, tuple(fields), same)


def release_changes(old: Release, new: Release) -> tuple[FieldChange, ...]:
    """Release fields that no unit carries (the fingerprint is the units' common part: not here)."""

    def own(r: Release) -> dict[str, Any]:
        return flatten(
            {
                "name": r.name,
                "backend": r.backend,
                "cache_env": r.cache_env,
                "manifest_digest": r.manifest_digest,
                "env": r.env,
            },
            "release.",
        )

    return tuple(field_changes(own(old), own(new)))


def flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested objects as dotted paths to their leaves (lists are leaves: they are compared whole)."""
    out: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, Mapping) and item:
            out.update(flatten(item, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = item
    return out


def field_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[FieldChange]:
    return [
        FieldChange(p, old.get(p, ABSENT), new.get(p, ABSENT))
        for p in sorted(old.keys() | new.keys())
        if old.get(p, ABSENT) != new.get(p, ABSENT)
    ]


def file_changes(
    old: Sequence[FileEntry], new: Sequence[FileEntry]
) -> tuple[tuple[FileChange, ...], tuple[FileChange, ...], tuple[FileChange, ...]]:
    """(added, removed, changed) by path."""
    before, after = {f.path: f for f in old}, {f.path: f for f in new}
    added = tuple(FileChange(p, None, f.size, None, f.digest) for p, f in after.items() if p not in before)
    removed = tuple(FileChange(p, f.size, None, f.digest, None) for p, f in before.items() if p not in after)
    changed = tuple(
        FileChange(p, f.size, after[p].size, f.digest, after[p].digest)
        for p, f in before.items()
        if p in after and after[p].digest != f.digest
    )
    return added, removed, changed
