"""`neffbuild ls`: a store's tags and releases, newest first; `--tag NAME`: one tag's history.

A release document holds no time (an unchanged rebuild must give the same id), so a release's
creation time is read from elsewhere: the first time any tag named it (tag histories record
when and by whom), else the newest `created_at` of its bundles (the release is written just
after its last unit is built). `created_from` says which.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.records import Release, TagRecord
from neffbuild.errors import NotFoundError
from neffbuild.inspect.read import DOC_JOBS, Snapshot, fetch, snapshot
from neffbuild.names import check_tag
from neffbuild.store.base import Store

# Fingerprint fields that name a toolchain, in the order a summary shows them (both backends').
TOOLCHAIN_FIELDS = ("torch", "torch-neuronx", "neuronx-cc", "neuron.target", "python", "cpu.capability", "cuda")


@dataclass(frozen=True)
class TagRow:
    name: str
    release: str
    release_name: str | None  # None: the release it names is not in the store
    moved_at: str
    by: str
    history: int  # moves recorded


@dataclass(frozen=True)
class ReleaseRow:
    release_id: str
    name: str
    units: int
    files: int
    bytes: int
    backend: str
    toolchain: str
    created: str | None
    created_from: str  # "tag" (first tag event naming it), "bundles" (newest bundle), "unknown"
    tags: tuple[str, ...]  # tags that point at it now


@dataclass(frozen=True)
class Listing:
    store: str
    tags: tuple[TagRow, ...]
    releases: tuple[ReleaseRow, ...]


@dataclass(frozen=True)
class HistoryRow:
    ref: str  # NAME@N: N moves back (NAME@0 is where the tag points now)
    release: str
    release_name: str | None
    at: str
    by: str


@dataclass(frozen=True)
class TagHistory:
    store: str
    tag: str
    release: str
    events: tuple[HistoryRow, ...]  # newest first


def toolchain(fingerprint: Mapping[str, str]) -> str:
    """A short summary of what built it: `torch 2.13.0, CPython 3.11.9, cpu.capability avx512`."""
    shown = []
    for name in TOOLCHAIN_FIELDS:
        value = fingerprint.get(name)
        if value:
            shown.append(value if name == "python" else f"{name} {value}")
    return ", ".join(shown) or "-"


def list_store(store: Store, *, jobs: int = DOC_JOBS) -> Listing:
    """Every tag (most recently moved first) and every release (newest first)."""
    snap = snapshot(store, jobs=jobs)
    created = creation_times(store, snap, jobs)
    pointing: dict[str, list[str]] = {}
    for tag in snap.tags.values():
        pointing.setdefault(tag.release, []).append(tag.name)
    releases = [
        ReleaseRow(
            release_id=rid,
            name=r.name,
            units=len(r.units),
            files=len(r.files),
            bytes=r.total_size,
            backend=r.backend,
            toolchain=toolchain(r.fingerprint),
            created=created[rid][0],
            created_from=created[rid][1],
            tags=tuple(sorted(pointing.get(rid, ()))),
        )
        for rid, r in snap.releases.items()
    ]
    releases.sort(key=lambda row: row.release_id)
    releases.sort(key=lambda row: (row.created or "", created[row.release_id][2]), reverse=True)
    tags = [_tag_row(tag, snap.releases) for tag in snap.tags.values()]
    tags.sort(key=lambda row: row.name)
    tags.sort(key=lambda row: row.moved_at, reverse=True)
    return Listing(store.url, tuple(tags), tuple(releases))


def _tag_row(tag: TagRecord, releases: Mapping[str, Release]) -> TagRow:
    last = tag.history[-1] if tag.history else None
    named = releases.get(tag.release)
    return TagRow(
        name=tag.name,
        release=tag.release,
        release_name=named.name if named else None,
        moved_at=last.at if last else "",
        by=last.by if last else "",
        history=len(tag.history),
    )


def creation_times(store: Store, snap: Snapshot, jobs: int = DOC_JOBS) -> dict[str, tuple[str | None, str, int]]:
    """release id -> (when it was created, where that was read from, rank among equal times);
    bundles are read only for releases no tag has ever named. Tag times have whole seconds, so
    releases a tag named within one second keep the order of its history."""
    first: dict[str, str] = {}
    rank: dict[str, int] = {}  # the latest place it first appears in a history: orders equal times
    for tag in snap.tags.values():
        seen: set[str] = set()
        for i, event in enumerate(tag.history):
            if event.release not in seen:
                seen.add(event.release)
                first[event.release] = min(first.get(event.release, event.at), event.at)
                rank[event.release] = max(rank.get(event.release, i), i)
    times: dict[str, tuple[str | None, str, int]] = {
        rid: (at, "tag", rank[rid]) for rid, at in first.items() if rid in snap.releases
    }
    untagged = [r for rid, r in snap.releases.items() if rid not in times]
    keys = (u.key for r in untagged for u in r.units if u.key not in snap.bundles)
    records = {**snap.bundles, **fetch(store, BundleRecord, keys, jobs)}
    for r in untagged:
        stamps = [records[u.key].created_at for u in r.units if u.key in records]
        times[r.release_id] = (max(stamps), "bundles", 0) if stamps else (None, "unknown", 0)
    return times


def tag_history(store: Store, name: str, *, jobs: int = DOC_JOBS) -> TagHistory:
    """One tag's moves, newest first, each with the NAME@N that names its release."""
    check_tag(name)
    tags = fetch(store, TagRecord, [name], 1)
    if name not in tags:
        known = ", ".join(list(store.list_docs("tags"))[:10]) or "none"
        raise NotFoundError(f"tag {name!r} not found in {store.url}", hint=f"known tags: {known}")
    tag = tags[name]
    releases = fetch(store, Release, {e.release for e in tag.history} | {tag.release}, jobs)
    events = list(reversed(tag.history))
    rows = tuple(
        HistoryRow(
            ref=f"{name}@{n}",
            release=e.release,
            release_name=releases[e.release].name if e.release in releases else None,
            at=e.at,
            by=e.by,
        )
        for n, e in enumerate(events)
    )
    return TagHistory(store.url, name, tag.release, rows)
