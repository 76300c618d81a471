"""`neffbuild du`: what a store holds, by tag, release, model entry and toolchain, and what dedup saves.

Figures come from the documents (every tag, release and bundle record), each blob counted once
per group however many files name it: a group's `bytes` is what the store keeps for it. Blobs
no document names (a publish in flight, leftovers) are not counted here: they are gc's and
`verify --store`'s concern. What `gc` would free is filled by its own plan through `reclaim`:
du only reports it, so the two can never disagree on the policy.

- by_tag: the blobs of every release in the tag's history (what keeping that history holds);
- by_release: the release's files; `unique_bytes` are those no other release names, `shared_bytes`
  the rest (deleting the release alone frees at most its unique bytes);
- by_entry / by_toolchain: every bundle record, grouped by model entry (the unit id before its
  last `/`) or by toolchain summary (see ls.toolchain).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from neffbuild.documents.records import FileEntry
from neffbuild.inspect.ls import toolchain
from neffbuild.inspect.read import DOC_JOBS, Snapshot, snapshot
from neffbuild.store.base import Store


@dataclass(frozen=True)
class Share:
    """One group's blobs, each once."""

    name: str
    members: int  # releases (tags, releases) or bundles (entries, toolchains) in the group
    blobs: int
    bytes: int


@dataclass(frozen=True)
class ReleaseUsage:
    release_id: str
    name: str
    files: int
    bytes: int  # its blobs, each once
    unique_bytes: int  # of those, the blobs no other release names
    shared_bytes: int


@dataclass(frozen=True)
class Reclaimable:
    """What `gc` would delete and free under its current policy (filled by gc's plan)."""

    objects: int
    bytes: int
    policy: str


@dataclass(frozen=True)
class Usage:
    store: str
    blobs: int  # distinct blobs the documents name
    bytes: int  # their bytes, each once: what the store holds for its documents
    logical_bytes: int  # every release's files added up: what the releases would take without dedup
    shared_blobs: int  # blobs two or more releases name
    shared_bytes: int  # their bytes, stored once each
    saved_bytes: int  # logical_bytes minus the releases' distinct bytes: what dedup saves
    by_tag: tuple[Share, ...]
    by_release: tuple[ReleaseUsage, ...]
    by_entry: tuple[Share, ...]
    by_toolchain: tuple[Share, ...]
    reclaimable: Reclaimable | None = None  # None: no gc plan was asked for


Reclaim = Callable[[Store, Snapshot], Reclaimable]  # gc's dry-run plan, given what du already read


def disk_usage(store: Store, *, jobs: int = DOC_JOBS, reclaim: Reclaim | None = None) -> Usage:
    snap = snapshot(store, all_bundles=True, jobs=jobs)
    return usage_of(snap, reclaimable=reclaim(store, snap) if reclaim else None)


def usage_of(snap: Snapshot, reclaimable: Reclaimable | None = None) -> Usage:
    sizes: dict[str, int] = {}
    for files in [*(r.files for r in snap.releases.values()), *(b.files for b in snap.bundles.values())]:
        sizes.update((f.digest, f.size) for f in files)
    named_by = Counter(d for r in snap.releases.values() for d in {f.digest for f in r.files})
    shared = [d for d, n in named_by.items() if n > 1]

    def share(name: str, members: int, files: Iterable[FileEntry]) -> Share:
        digests = {f.digest for f in files}
        return Share(name, members, len(digests), sum(sizes[d] for d in digests))

    by_tag = []
    for tag in snap.tags.values():
        ids = {e.release for e in tag.history} | {tag.release}
        present = [snap.releases[i] for i in ids if i in snap.releases]
        by_tag.append(share(tag.name, len(present), (f for r in present for f in r.files)))
    by_release = []
    for rid, r in snap.releases.items():
        digests = {f.digest for f in r.files}
        total = sum(sizes[d] for d in digests)
        unique = sum(sizes[d] for d in digests if named_by[d] == 1)
        by_release.append(ReleaseUsage(rid, r.name, len(r.files), total, unique, total - unique))
    return Usage(
        store=snap.url,
        blobs=len(sizes),
        bytes=sum(sizes.values()),
        logical_bytes=sum(r.total_size for r in snap.releases.values()),
        shared_blobs=len(shared),
        shared_bytes=sum(sizes[d] for d in shared),
        saved_bytes=sum(r.total_size for r in snap.releases.values()) - sum(sizes[d] for d in named_by),
        by_tag=_largest(by_tag),
        by_release=tuple(sorted(by_release, key=lambda u: (-u.bytes, u.release_id))),
        by_entry=_grouped(snap, lambda unit_id, _: unit_id.rpartition("/")[0] or unit_id, share),
        by_toolchain=_grouped(snap, lambda _, fingerprint: toolchain(fingerprint), share),
        reclaimable=reclaimable,
    )


def _grouped(
    snap: Snapshot, group_of: Callable[[str, Mapping[str, str]], str], share: Callable[..., Share]
) -> tuple[Share, ...]:
    groups: dict[str, list[FileEntry]] = {}
    members: Counter[str] = Counter()
    for record in snap.bundles.values():
        name = group_of(record.unit_id, record.fingerprint)
        groups.setdefault(name, []).extend(record.files)
        members[name] += 1
    return _largest([share(name, members[name], files) for name, files in groups.items()])


def _largest(shares: list[Share]) -> tuple[Share, ...]:
    return tuple(sorted(shares, key=lambda s: (-s.bytes, s.name)))
