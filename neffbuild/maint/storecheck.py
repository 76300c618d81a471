"""`neffbuild verify --store S [--deep]`: does every record's every reference exist?

Every tag, release and bundle record is read. A tag's current release, a release's bundle
records, and every file of a release or bundle must be there: a blob as an object of its own
with the recorded size, or in a pack whose index lists it with that size (with --deep, its bytes
are read and hashed too). A locator's packs must be there. Anything missing is *dangling*; a
record that does not parse or match its name, a damaged pack index, a wrong size or digest is
*damaged*: either one exits 4. *Orphans* (blobs and packs no record names, bundle records no
release names, releases no tag's history names, locators without their release) are a warning:
`gc` removes them once they are older than its grace period.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.records import Release, TagRecord, parse
from neffbuild.errors import IntegrityError, NeffbuildError
from neffbuild.hashing import CHUNK
from neffbuild.store.base import Store, blob_key
from neffbuild.store.packs import LOCATOR_MAX, decode_locator, index_key

DOC_JOBS = 32


@dataclass(frozen=True, slots=True)
class Finding:
    key: str  # the object at fault (the record that dangles, or the damaged object)
    problem: str


@dataclass(frozen=True, slots=True)
class StoreCheck:
    store: str
    deep: bool
    documents: int  # records read
    blobs: int  # distinct blobs the records reference
    bytes: int  # their bytes
    hashed_bytes: int  # read back and hashed (--deep)
    dangling: tuple[Finding, ...]
    damaged: tuple[Finding, ...]
    orphans: tuple[str, ...]  # keys
    orphan_bytes: int

    @property
    def clean(self) -> bool:
        return not self.dangling and not self.damaged


def check_store(store: Store, *, deep: bool = False, jobs: int = DOC_JOBS) -> StoreCheck:
    objects = {o.key: o for o in store.list_objects("")}
    dangling: list[Finding] = []
    damaged: list[Finding] = []

    def read(kind: type, folder: str) -> dict:
        names = {
            k[len(folder) + 1 : -5]
            for k in objects
            if k.startswith(f"{folder}/") and k.endswith(".json") and k.count("/") == 1
        }
        docs = {}
        for name, data in store.get_docs(folder, names, jobs).items():  # type: ignore[arg-type]
            key = f"{folder}/{name}.json"
            if data is None:
                continue
            try:
                doc: object = parse(kind, data, f"{store.url}/{key}")
            except IntegrityError as exc:
                damaged.append(Finding(key, exc.message.removeprefix(f"{store.url}/{key}: ")))
                continue
            if _named(doc) != name:
                damaged.append(Finding(key, "content does not match its name"))
                continue
            docs[name] = doc
        return docs

    tags, releases, bundles = read(TagRecord, "tags"), read(Release, "releases"), read(BundleRecord, "bundles")
    indexes, bad_packs = store.pack_indexes() if any(k.startswith("packs/") for k in objects) else ({}, {})
    damaged += [Finding(index_key(p), why) for p, why in sorted(bad_packs.items())]
    packed = {e.digest: (p, e.size) for p, i in indexes.items() if f"packs/{p}.pack" in objects for e in i.entries}
    for p in sorted(indexes):
        if f"packs/{p}.pack" not in objects:
            dangling.append(Finding(index_key(p), f"its pack packs/{p}.pack is missing"))

    sizes: dict[str, int] = {}
    for tag in tags.values():
        if tag.release not in releases and f"releases/{tag.release}.json" not in objects:
            dangling.append(Finding(f"tags/{tag.name}.json", f"release {tag.release} is missing"))
    for rid, release in releases.items():
        for unit in release.units:
            if f"bundles/{unit.key}.json" not in objects:
                dangling.append(Finding(f"releases/{rid}.json", f"bundle {unit.key} ({unit.unit_id}) is missing"))
        dangling += _missing_files(f"releases/{rid}.json", release.files, objects, packed, damaged, sizes)
        dangling += _locator_packs(store, rid, objects, damaged)
    for key, record in bundles.items():
        dangling += _missing_files(f"bundles/{key}.json", record.files, objects, packed, damaged, sizes)

    hashed = _hash_all(store, sizes, damaged, jobs) if deep else 0
    named_releases = {t.release for t in tags.values()} | {e.release for t in tags.values() for e in t.history}
    named_bundles = {u.key for r in releases.values() for u in r.units}
    live_packs = {packed[d][0] for d in sizes if d in packed}
    orphans = sorted(
        k for k in objects
        if (k.startswith("blobs/") and k.rsplit("/", 1)[-1] not in sizes)
        or (k.startswith("packs/") and k.split("/")[1].split(".")[0] not in live_packs | set(bad_packs))
        or (k.startswith("bundles/") and k[8:-5] not in named_bundles)
        or (k.startswith("releases/") and k[9:-5] not in named_releases)
        or (k.startswith("locators/") and f"releases/{k[9:]}" not in objects)
    )  # fmt: skip  # arguments packed by meaning, not one a line
    return StoreCheck(
        store=store.url, deep=deep, documents=len(tags) + len(releases) + len(bundles), blobs=len(sizes),
        bytes=sum(sizes.values()), hashed_bytes=hashed, dangling=tuple(dangling), damaged=tuple(damaged),
        orphans=tuple(orphans), orphan_bytes=sum(objects[k].size for k in orphans),
    )  # fmt: skip  # arguments packed by meaning, not one a line


def store_error(check: StoreCheck) -> NeffbuildError | None:
    if check.clean:
        return None
    first = (check.dangling or check.damaged)[0]
    return IntegrityError(
        f"{check.store}: {len(check.dangling)} dangling references, {len(check.damaged)} damaged objects; first: {first.key}: {first.problem}",
        hint="re-push or rebuild the releases named, or restore the objects from a copy of the store",
    )


def _named(doc: object) -> str:
    if isinstance(doc, Release):
        return doc.release_id
    return doc.key if isinstance(doc, BundleRecord) else doc.name  # type: ignore[attr-defined]


def _missing_files(
    record: str, files: Iterable, objects: dict, packed: dict, damaged: list[Finding], sizes: dict[str, int]
) -> list[Finding]:
    out = []
    for f in files:
        loose = objects.get(blob_key(f.digest))
        where = packed.get(f.digest)
        if loose is not None:
            stored, holder = loose.size, blob_key(f.digest)
        elif where is not None:
            stored, holder = where[1], f"packs/{where[0]}.pack"
        else:
            out.append(Finding(record, f"blob {f.digest} ({f.path}) is missing"))
            continue
        if stored != f.size and f.digest not in sizes:
            damaged.append(Finding(holder, f"blob {f.digest} holds {stored} bytes, {record} says {f.size}"))
        sizes[f.digest] = f.size
    return out


def _locator_packs(store: Store, release_id: str, objects: dict, damaged: list[Finding]) -> list[Finding]:
    key = f"locators/{release_id}.json"
    if key not in objects:
        return []
    data = _get(store, key)
    if data is None:
        return []
    try:
        locator = decode_locator(release_id, data, f"{store.url}/{key}")
    except IntegrityError as exc:
        damaged.append(Finding(key, exc.message))
        return []
    return [Finding(key, f"pack {p} is missing") for p in sorted(locator.packs) if f"packs/{p}.idx.json" not in objects]


def _get(store: Store, key: str) -> bytes | None:
    get = getattr(store, "get_object", None)  # only stores with locators (S3) have them
    return get(key, limit=LOCATOR_MAX) if get else None


def _hash_all(store: Store, sizes: dict[str, int], damaged: list[Finding], jobs: int) -> int:
    def one(digest: str) -> tuple[int, Finding | None]:
        hasher, size = xxhash.xxh3_128(), 0
        try:
            with store.open_blob(digest) as stream:
                while size <= sizes[digest] and (chunk := stream.read(CHUNK)):
                    hasher.update(chunk)
                    size += len(chunk)
        except NeffbuildError as exc:
            return size, Finding(blob_key(digest), exc.message)
        if size != sizes[digest] or hasher.hexdigest() != digest:
            return size, Finding(
                blob_key(digest), f"its bytes hash to {hasher.hexdigest()} ({size} bytes), not to its name"
            )
        return size, None

    with ThreadPoolExecutor(max_workers=max(1, min(jobs, 16))) as pool:
        results = list(pool.map(one, sorted(sizes)))
    damaged += [f for _, f in results if f is not None]
    return sum(n for n, _ in results)
