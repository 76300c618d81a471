"""`neffbuild show REF`: a release's units (what each compiled, for which shape, what it cost) or
one bundle's files. REF is anything neffbuild.documents.refs resolves: TAG, TAG@N, a release id or a unique
prefix of one, a bundle key.

A bundle's `unit` is the normalised unit its key hashed; its parts are read defensively (a
document from an older neffbuild may lack some), shown as "-" when absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from neffbuild.documents.bundles import BundleRecord, ResolvedBundle, Timings
from neffbuild.documents.records import FileEntry, Release, SharedPath
from neffbuild.documents.refs import resolve_any
from neffbuild.errors import NotFoundError
from neffbuild.inspect.read import DOC_JOBS, fetch
from neffbuild.store.base import Store


@dataclass(frozen=True)
class UnitView:
    unit_id: str
    key: str
    model: str  # hub id@revision, or the digest of a local model's config files
    pipeline: str
    dtype: str
    mode: str
    components: tuple[str, ...]
    shape: Mapping[str, Any]
    files: int
    bytes: int
    timings: Timings
    counters: Mapping[str, int]
    created_at: str
    fingerprint: Mapping[str, str]


@dataclass(frozen=True)
class ReleaseView:
    release_id: str
    name: str
    tag: str | None  # the tag REF named, when it named one
    backend: str
    files: int
    bytes: int
    env: Mapping[str, str]
    fingerprint: Mapping[str, str]  # the fields every unit shares
    shared: tuple[SharedPath, ...]
    units: tuple[UnitView, ...]
    kind: Literal["release"] = "release"


@dataclass(frozen=True)
class BundleView:
    unit: UnitView
    files: tuple[FileEntry, ...]
    kind: Literal["bundle"] = "bundle"


def show(store: Store, ref: str, *, jobs: int = DOC_JOBS) -> ReleaseView | BundleView:
    found = resolve_any(store, ref)
    if isinstance(found, ResolvedBundle):
        return BundleView(unit_view(found.record), found.record.files)
    release = found.release
    records = release_bundles(store, found.release_id, release, jobs)
    return ReleaseView(
        release_id=found.release_id,
        name=release.name,
        tag=found.tag,
        backend=release.backend,
        files=len(release.files),
        bytes=release.total_size,
        env=release.env,
        fingerprint=release.fingerprint,
        shared=release.shared,
        units=tuple(unit_view(records[u.key]) for u in release.units),
    )


def release_bundles(store: Store, release_id: str, release: Release, jobs: int = DOC_JOBS) -> dict[str, BundleRecord]:
    """The bundle record of every unit of a release (a release is written only after them all)."""
    records = fetch(store, BundleRecord, (u.key for u in release.units), jobs)
    for unit in release.units:
        if unit.key not in records:
            raise NotFoundError(
                f"release {release_id}: the bundle of {unit.unit_id} ({unit.key}) is not in {store.url}",
                hint="the store lost a document a release needs: push the release again from a complete store",
            )
    return records


def unit_view(record: BundleRecord) -> UnitView:
    unit = record.unit
    shape = unit.get("shape")
    components = unit.get("components")
    return UnitView(
        unit_id=record.unit_id,
        key=record.key,
        model=model_name(unit.get("model")),
        pipeline=_text(unit.get("pipeline")),
        dtype=_text(unit.get("dtype")),
        mode=_text(unit.get("mode")),
        components=tuple(str(c) for c in components) if isinstance(components, list) else (),
        shape=shape if isinstance(shape, dict) else {},
        files=len(record.files),
        bytes=sum(f.size for f in record.files),
        timings=record.timings,
        counters=record.counters,
        created_at=record.created_at,
        fingerprint=record.fingerprint,
    )


def model_name(model: Any) -> str:
    """`hub-id@revision`, or `local:<config digest>` (a local model is keyed by its config files)."""
    if not isinstance(model, dict):
        return "-"
    if "hub" in model:
        return f"{model['hub']}@{model.get('revision') or 'main'}"
    if "local_config" in model:
        return f"local:{model['local_config']}"
    return "-"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "-"
