"""`neffbuild gc`: mark and sweep a store.

Live (kept):
- every tag's current release and the `keep` releases it pointed at before (its history);
- any object younger than the grace period, and everything a record younger than it references
  (a publish in flight has uploaded blobs and written records that no tag reaches yet);
- what a live release reaches: its bundle records, their blobs, its locator; and every pack
  holding a live blob (a partly live pack stays whole: its bytes are one object). A pack whose
  index is damaged stays too: nobody can tell what it holds (`verify --store` names it).
Tags are never deleted. Everything else is garbage.

The sweep deletes records before what they reference, so a reader never meets a record pointing at
nothing: releases, then locators, then bundle records, then pack indexes (an index is what makes
its pack visible), then packs, then loose blobs.

Concurrent publishes: gc holds the store's lease (gc/lease.json) from before it lists the store
until its last delete, and every publish settles each record it writes against it (waits for the
lease to go, then re-checks and repairs). neffbuild/store/lease.py states that protocol and why no
publish then ends up referencing a deleted blob.

Planning is pure (`plan_of` over a `StoreView`); `scan` reads the store, `sweep` deletes. A plan is
shown and confirmed before the sweep; the sweep takes the lease, plans again, and deletes only
what both plans call garbage.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.records import Release, TagRecord, parse
from neffbuild.errors import ConflictError, InputError, IntegrityError
from neffbuild.inspect.du import Reclaimable
from neffbuild.inspect.read import Snapshot
from neffbuild.store import lease
from neffbuild.store.base import DELETE_BATCH, ObjectInfo, Store
from neffbuild.store.packs import PackIndex, pack_id_of_index_key

DEFAULT_KEEP = 3
DEFAULT_GRACE_S = 24 * 3600.0
DOC_JOBS = 32
# Sweep order: records before what they reference; an index before its pack.
KINDS = ("releases", "locators", "bundles", "pack indexes", "packs", "blobs")
_DURATION = re.compile(r"(?P<n>[0-9]+(?:\.[0-9]+)?)(?P<unit>[smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}

log = logging.getLogger(__name__)


def parse_duration(text: str) -> float:
    """`24h`, `30m`, `45s`, `2d`, `0` -> seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise InputError(f"--grace {text!r}: not a duration", hint="e.g. 24h, 30m, 90s, 2d, or 0")
    return float(match["n"]) * _UNIT_S[match["unit"]]


@dataclass(frozen=True, slots=True)
class Policy:
    keep: int = DEFAULT_KEEP  # releases of each tag's history kept besides its current one
    grace_s: float = DEFAULT_GRACE_S


@dataclass(frozen=True, slots=True)
class StoreView:
    """What gc read: every object, every tag, and the records and pack indexes it needed."""

    url: str
    now: float  # when the listing began (gc's clock; mtimes are the store's)
    objects: Mapping[str, ObjectInfo]
    tags: Mapping[str, TagRecord]
    releases: Mapping[str, Release]  # the roots' and the young ones'
    bundles: Mapping[str, BundleRecord]  # those the read releases name, and the young ones
    indexes: Mapping[str, PackIndex]
    damaged_packs: Mapping[str, str]  # pack id -> why its index cannot be read


@dataclass(frozen=True, slots=True)
class KindCount:
    kind: str
    objects: int
    bytes: int


@dataclass(frozen=True, slots=True)
class GcPlan:
    store: str
    keep: int
    grace_s: float
    delete: tuple[str, ...]  # keys, in sweep order
    by_kind: tuple[KindCount, ...]  # what is deleted, per kind (KINDS order)
    delete_objects: int
    delete_bytes: int  # the bytes deleting them frees
    live_releases: tuple[str, ...]
    kept_objects: int
    kept_bytes: int
    spared_objects: int  # garbage but younger than the grace period
    spared_bytes: int
    partly_live_packs: int  # kept whole although some of their blobs are garbage
    dead_bytes_in_live_packs: int  # ... those blobs' bytes, which stay
    damaged_packs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class GcResult:
    plan: GcPlan  # what was shown and confirmed
    deleted: tuple[str, ...]  # keys deleted: the confirmed ones still garbage under the lease
    deleted_bytes: int
    seconds: float


def kind_of(key: str) -> str | None:
    """The sweep kind of a store key; None for what gc never deletes (tags, the marker, the lease)."""
    folder = key.split("/", 1)[0]
    if folder == "packs":
        return "pack indexes" if key.endswith(".idx.json") else "packs" if key.endswith(".pack") else None
    return folder if folder in ("releases", "locators", "bundles", "blobs") else None


def _doc_name(key: str) -> str:
    return key.rsplit("/", 1)[-1].removesuffix(".json")


def roots(tags: Iterable[TagRecord], keep: int) -> set[str]:
    """Each tag's current release and the `keep` distinct releases before it, newest first."""
    live = set()
    for tag in tags:
        live.add(tag.release)
        earlier = [e.release for e in reversed(tag.history) if e.release != tag.release]
        live.update(list(dict.fromkeys(earlier))[:keep])
    return live


def plan_of(view: StoreView, policy: Policy) -> GcPlan:
    """Mark and plan the sweep: pure."""
    young = {k for k, o in view.objects.items() if o.mtime > view.now - policy.grace_s}
    live_releases = roots(view.tags.values(), policy.keep) | {_doc_name(k) for k in young if k.startswith("releases/")}
    live_bundles = {u.key for rid in live_releases if rid in view.releases for u in view.releases[rid].units}
    live_bundles |= {_doc_name(k) for k in young if k.startswith("bundles/")}
    live_blobs = {f.digest for rid in live_releases if rid in view.releases for f in view.releases[rid].files}
    live_blobs |= {f.digest for k in live_bundles if k in view.bundles for f in view.bundles[k].files}
    live_packs = set(view.damaged_packs) | {
        p for p, i in view.indexes.items() if any(e.digest in live_blobs for e in i.entries)
    }

    def live(key: str, kind: str) -> bool:
        name = _doc_name(key)
        if kind in ("releases", "locators"):
            return name in live_releases
        if kind == "bundles":
            return name in live_bundles
        if kind == "blobs":
            return name in live_blobs
        pack_id = pack_id_of_index_key(key) if kind == "pack indexes" else name.removesuffix(".pack")
        return pack_id in live_packs or any(k in young for k in (f"packs/{pack_id}.pack", f"packs/{pack_id}.idx.json"))

    doomed: dict[str, list[ObjectInfo]] = {kind: [] for kind in KINDS}
    kept = spared = 0
    kept_bytes = spared_bytes = 0
    for key, info in sorted(view.objects.items()):
        kind = kind_of(key)
        if kind is None or live(key, kind):
            kept, kept_bytes = kept + 1, kept_bytes + info.size
        elif key in young:
            spared, spared_bytes = spared + 1, spared_bytes + info.size
        else:
            doomed[kind].append(info)
    partly = [
        i for p, i in view.indexes.items() if p in live_packs and not all(e.digest in live_blobs for e in i.entries)
    ]
    by_kind = tuple(KindCount(k, len(doomed[k]), sum(o.size for o in doomed[k])) for k in KINDS)
    return GcPlan(
        store=view.url,
        keep=policy.keep,
        grace_s=policy.grace_s,
        delete=tuple(o.key for k in KINDS for o in doomed[k]),
        by_kind=by_kind,
        delete_objects=sum(c.objects for c in by_kind),
        delete_bytes=sum(c.bytes for c in by_kind),
        live_releases=tuple(sorted(r for r in live_releases if f"releases/{r}.json" in view.objects)),
        kept_objects=kept,
        kept_bytes=kept_bytes,
        spared_objects=spared,
        spared_bytes=spared_bytes,
        partly_live_packs=len(partly),
        dead_bytes_in_live_packs=sum(e.size for i in partly for e in i.entries if e.digest not in live_blobs),
        damaged_packs=tuple(sorted(view.damaged_packs)),
    )


# (folder, names) -> the named documents of that folder that exist, parsed and checked
Reader = Callable[[str, Iterable[str]], Mapping[str, Any]]


def scan(
    store: Store, policy: Policy, *, jobs: int = DOC_JOBS, now: float | None = None, read: Reader | None = None
) -> StoreView:
    """Read what marking needs: every object's key, size and time; the tags; the records that the
    roots and the young records reach; the pack indexes. Old records nothing reaches are not read.
    `read` supplies documents already read (du's snapshot); by default they are fetched."""
    now = time.time() if now is None else now
    objects = {o.key: o for o in store.list_objects("")}
    young = {k for k, o in objects.items() if o.mtime > now - policy.grace_s}
    read = read or (lambda folder, names: _read(store, _KIND_OF[folder], folder, names, jobs))
    tags = read("tags", _names(objects, "tags/"))
    wanted = roots(tags.values(), policy.keep) | {_doc_name(k) for k in young if k.startswith("releases/")}
    releases = read("releases", wanted & _names(objects, "releases/"))
    bundle_keys = {u.key for r in releases.values() for u in r.units} | {
        _doc_name(k) for k in young if k.startswith("bundles/")
    }
    bundles = read("bundles", bundle_keys & _names(objects, "bundles/"))
    indexes, damaged = store.pack_indexes() if any(k.startswith("packs/") for k in objects) else ({}, {})
    return StoreView(store.url, now, objects, tags, releases, bundles, indexes, damaged)


def plan_gc(store: Store, policy: Policy, *, jobs: int = DOC_JOBS) -> GcPlan:
    return plan_of(scan(store, policy, jobs=jobs), policy)


def policy_text(policy: Policy) -> str:
    """`keep 3, grace 24h`: the policy as gc's flags spell it."""
    g = policy.grace_s
    grace = f"{g / 3600:g}h" if g >= 3600 else f"{g / 60:g}m" if g >= 60 else f"{g:g}s"
    return f"keep {policy.keep}, grace {grace}"


def reclaimable(policy: Policy, *, jobs: int = DOC_JOBS) -> Callable[[Store, Snapshot], Reclaimable]:
    """du's `reclaim`: this plan's figures, from the store's listing and the documents du already
    read (a document listed but not in du's snapshot, written since, is fetched)."""

    def plan(store: Store, snap: Snapshot) -> Reclaimable:
        have = {"tags": snap.tags, "releases": snap.releases, "bundles": snap.bundles}

        def read(folder: str, names: Iterable[str]) -> Mapping[str, Any]:
            names = set(names)
            known = {n: have[folder][n] for n in names if n in have[folder]}
            return {**known, **_read(store, _KIND_OF[folder], folder, names - set(known), jobs)}

        p = plan_of(scan(store, policy, jobs=jobs, read=read), policy)
        return Reclaimable(p.delete_objects, p.delete_bytes, policy_text(policy))

    return plan


def sweep(
    store: Store,
    confirmed: GcPlan,
    policy: Policy,
    *,
    jobs: int = DOC_JOBS,
    lease_s: float = lease.LEASE_S,
    clock: Callable[[], float] = time.time,
) -> GcResult:
    """Take the lease, plan again, delete what both plans call garbage (in sweep order); give the
    lease back. Stops, with a ConflictError, when the lease is about to expire."""
    started = clock()
    held = lease.acquire(store, lease.holder(), lease_s=lease_s, clock=clock)
    try:
        view = scan(store, policy, jobs=jobs, now=clock())
        approved = set(confirmed.delete)
        keys = [k for k in plan_of(view, policy).delete if k in approved]
        done: list[str] = []
        for start in range(0, len(keys), DELETE_BATCH):
            if held.ends_soon(clock()):
                raise ConflictError(
                    f"gc of {store.url} stopped after deleting {len(done)} of {len(keys)} objects: its lease ends soon",
                    hint="run gc again to continue (it plans afresh)",
                )
            batch = keys[start : start + DELETE_BATCH]
            store.delete_objects(batch)
            done += batch
    finally:
        lease.release(store, held)
    result = GcResult(confirmed, tuple(done), sum(view.objects[k].size for k in done), clock() - started)
    log.info("gc %s: deleted %d objects, %d bytes", store.url, len(result.deleted), result.deleted_bytes)
    return result


_KIND_OF: dict[str, type] = {"tags": TagRecord, "releases": Release, "bundles": BundleRecord}


def _names(objects: Mapping[str, ObjectInfo], folder: str) -> set[str]:
    return {
        k[len(folder) : -len(".json")]
        for k in objects
        if k.startswith(folder) and k.endswith(".json") and "/" not in k[len(folder) :]
    }


def _read(store: Store, kind: type, folder: str, names: Iterable[str], jobs: int) -> dict:
    """Parse the named documents (those gone since the listing are skipped); a damaged one is an
    IntegrityError: gc cannot know what it references, so it deletes nothing."""
    found = {}
    for name, data in store.get_docs(folder, names, jobs).items():  # type: ignore[arg-type]
        if data is None:
            continue
        where = f"{store.url}/{folder}/{name}.json"
        doc: object = parse(kind, data, where)
        if (isinstance(doc, Release) and doc.release_id != name) or (isinstance(doc, BundleRecord) and doc.key != name):
            raise IntegrityError(
                f"{where}: content does not match its name",
                hint="run `neffbuild verify --store` and repair the store before gc",
            )
        if isinstance(doc, TagRecord) and doc.name != name:
            raise IntegrityError(
                f"{where}: names tag {doc.name!r}", hint="run `neffbuild verify --store` and repair the store before gc"
            )
        found[name] = doc
    return found
