"""`neffbuild release`: the fan-in. Once every unit of a manifest has a bundle in the store,
whoever built it, write the release and move the tag; until then, name the units still missing.

It compiles nothing and, given the plan document, computes no key either: it may run on any
machine that reaches the store (a CI runner without the accelerator or the compiler). Release
ids are content addresses, so the fan-in of shards and a one-process build of the same bundles
give the same release.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from neffbuild.backends import get_backend
from neffbuild.build.publish import move_tag, publish_release
from neffbuild.build.report import emit, merged, read_reports
from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.manifest import load_manifest
from neffbuild.documents.records import RELEASE_FORMAT, RELEASE_FORMAT_1, FileEntry, Release, ReleaseUnit, SharedPath
from neffbuild.documents.refs import checked_doc, doc_where
from neffbuild.documents.signing import Signing
from neffbuild.errors import ConflictError, IncompleteRelease, IntegrityError
from neffbuild.store import StoreChoice
from neffbuild.store.base import Store
from neffbuild.units.plandoc import check_manifest, read_plan

if TYPE_CHECKING:
    from neffbuild.units.plan import Plan

log = logging.getLogger(__name__)
SHOWN_MISSING = 10  # unit ids named in the error; --json lists every one


@dataclass(frozen=True)
class Releasable:
    """What a release is made of, whoever planned it (this host, or a plan document): the
    manifest's name and digest, the runtime environment, the units (id, key) and the backend
    (which of its clashing paths are content keys)."""

    name: str
    manifest_digest: str
    runtime_env: Mapping[str, str]
    units: tuple[tuple[str, str], ...]
    backend: str


@dataclass(frozen=True)
class ReleaseResult:
    name: str
    store: str
    units: tuple[tuple[str, str], ...]  # (unit id, key) of the manifest
    missing: tuple[str, ...]  # unit ids without a bundle: then nothing was released
    release_id: str | None = None
    tag: str | None = None
    planned: bool = False  # the units and keys came from --plan, not from this host


def release_manifest(
    manifest: Path,
    store: StoreChoice,
    *,
    env: Mapping[str, str],
    tag: str | None = None,
    plan_file: Path | None = None,
    signing: Signing | None = None,
) -> ReleaseResult:
    """Release MANIFEST from what the store holds: every unit's bundle, or nothing at all."""
    loaded = load_manifest(manifest)
    if plan_file is not None:
        document = read_plan(plan_file)
        check_manifest(document, loaded, plan_file)
        units = tuple((u.unit_id, u.key) for u in document.units)
        what = Releasable(document.name, loaded.source_digest, dict(document.env), units, document.backend)
    else:
        from neffbuild.units.plan import make_plan

        what = planned(make_plan(loaded, env))
    opened = store.open(env, manifest_default=loaded.manifest.store)
    result = release_bundles(opened, what, tag=tag or what.name, signing=signing)
    if result.release_id is not None:
        log.info("released %s from %d bundles; tag %s", result.release_id, len(what.units), result.tag)
    return replace(result, planned=plan_file is not None)


def planned(plan: Plan) -> Releasable:
    """What a release of this host's plan is made of."""
    units = tuple((u.unit_id, u.key) for u in plan.units)
    loaded = plan.loaded
    return Releasable(loaded.manifest.name, loaded.source_digest, dict(plan.runtime_env), units, plan.backend_name)


def release_bundles(store: Store, what: Releasable, *, tag: str, signing: Signing | None = None) -> ReleaseResult:
    """The one way a release is made, by `release` and by a build of every unit: each unit's
    bundle read (and checked to be that unit's), the files merged, the release published and
    the tag moved; with any bundle missing, nothing is released and the missing are named."""
    found = store.get_docs("bundles", [key for _, key in what.units], jobs=16)
    missing = tuple(unit_id for unit_id, key in what.units if found.get(key) is None)
    if missing:
        return ReleaseResult(what.name, store.url, what.units, missing)
    records = [_record(store, unit_id, key, found[key]) for unit_id, key in what.units]
    release_id = publish_release(store, assemble_release(what, records))
    move_tag(store, tag, release_id, signing=signing)
    return ReleaseResult(what.name, store.url, what.units, (), release_id, tag)


def release_and_report(
    manifest: Path,
    store: StoreChoice,
    *,
    env: Mapping[str, str],
    tag: str | None = None,
    plan_file: Path | None = None,
    shard_reports: Sequence[Path] = (),
    report_file: Path | None = None,
    signing: Signing | None = None,
) -> ReleaseResult:
    """`neffbuild release`: the fan-in, then the shards' reports merged (read first: a bad one is
    refused before anything is released) into --report and $GITHUB_STEP_SUMMARY."""
    reports = read_reports(shard_reports)
    result = release_manifest(manifest, store, env=env, tag=tag, plan_file=plan_file, signing=signing)
    if reports or report_file is not None:
        merged_report = merged(
            reports,
            result.units,
            store=result.store,
            name=result.name,
            release_id=result.release_id or "",
            tag=result.tag or "",
        )
        emit(merged_report, report_file, env)
    return result


def incomplete(result: ReleaseResult) -> IncompleteRelease:
    shown = ", ".join(result.missing[:SHOWN_MISSING])
    more = f" and {len(result.missing) - SHOWN_MISSING} more" if len(result.missing) > SHOWN_MISSING else ""
    return IncompleteRelease(
        f"{len(result.missing)} of {len(result.units)} units of {result.name} have no bundle in {result.store}: {shown}{more}",
        hint="build them (the shard that holds them, or `neffbuild build`), then release again; nothing was released",
    )


def _record(store: Store, unit_id: str, key: str, data: bytes | None) -> BundleRecord:
    assert data is not None
    record = checked_doc(BundleRecord, data, doc_where(store, BundleRecord, key), key)
    if record.unit_id != unit_id:
        raise IntegrityError(
            f"{doc_where(store, BundleRecord, key)}: records unit {record.unit_id}, not {unit_id}",
            hint="two units share one key: the store or the plan is damaged",
        )
    return record


def assemble_release(what: Releasable, records: Sequence[BundleRecord]) -> Release:
    """Merge the bundles' files into one cache-dir listing; clashing paths go to the backend."""
    backend = get_backend(what.backend)
    chosen: dict[str, tuple[FileEntry, str]] = {}
    dropped: dict[str, set[str]] = {}
    for record in sorted(records, key=lambda r: r.key):  # deterministic winner
        for entry in record.files:
            kept = chosen.setdefault(entry.path, (entry, record.unit_id))
            if kept[0].digest == entry.digest:
                continue
            if not backend.is_content_keyed(entry.path):
                raise ConflictError(
                    f"{entry.path}: units {kept[1]} and {record.unit_id} produced different files at one path",
                    hint=f"the {backend.name} backend does not treat this path as a content key; report it",
                )
            dropped.setdefault(entry.path, set()).add(entry.digest)
    files = tuple(entry for entry, _ in sorted(chosen.values(), key=lambda c: c[0].path))
    return Release(
        format=RELEASE_FORMAT if all(f.blake3 for f in files) else RELEASE_FORMAT_1,  # bundles built before BLAKE3
        name=what.name,
        manifest_digest=what.manifest_digest,
        backend=backend.name,
        cache_env=backend.cache_env,
        env=dict(what.runtime_env),
        fingerprint=_common_fields([r.fingerprint for r in records]),
        env_reads=_common_fields([r.env_reads for r in records]),
        compiler_keys=_common_fields([r.compiler_keys for r in records]),
        units=tuple(ReleaseUnit(unit_id=unit_id, key=key) for unit_id, key in what.units),
        files=files,
        shared=tuple(
            SharedPath(path=p, kept=chosen[p][0].digest, dropped=tuple(sorted(d))) for p, d in sorted(dropped.items())
        ),
    )


def _common_fields(fingerprints: Sequence[Mapping[str, str]]) -> dict[str, str]:
    if not fingerprints:
        return {}
    first = fingerprints[0]
    return {k: v for k, v in sorted(first.items()) if all(f.get(k) == v for f in fingerprints)}
