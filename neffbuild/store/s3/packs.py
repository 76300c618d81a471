"""Where an S3 store's blobs lie: in a pack (which, at what offset) or as objects of their own.

What this process has learnt is kept: pack indexes (they never change once written), packs whose
index is damaged, and blobs seen stored on their own. A pull of a release asks its locator which
packs to read (store/packs.py), so it reads only their indexes; a release published before locators
existed is found through every index, and a damaged one only fails the pulls that need one of its
blobs. The formats and the planning are in store/packs.py; this module does the reading.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence
from functools import partial
from pathlib import Path

from neffbuild.errors import IntegrityError, NeffbuildError, NotFoundError
from neffbuild.fs.confined import BlobTarget
from neffbuild.store import packs
from neffbuild.store.base import blob_key
from neffbuild.store.s3 import dataplane, responses

HEAD_LIMIT = 256  # up to this many blobs to check: HEAD each; more: list their shards
Where = tuple[packs.PackIndex, packs.PackEntry]  # where a packed blob lies


class PackCatalog:
    def __init__(self, reader: dataplane.DataPlane, store_prefix: str) -> None:
        self._reader = reader
        self._store_prefix = store_prefix
        self._lock = threading.Lock()
        self._packs: dict[str, packs.PackIndex] = {}
        self._packed: dict[str, Where] = {}
        self._damaged: dict[str, NeffbuildError] = {}  # pack id -> why its index cannot be used
        self._loose: set[str] = set()  # digests seen stored as objects of their own

    def where(self, digest: str) -> Where | None:
        """The pack holding digest, among the indexes read so far (refresh() first to see all)."""
        return self._packed.get(digest)

    def pack_ids(self) -> list[str]:
        """The packs whose index has been read."""
        return sorted(self._packs)

    def indexes(self) -> tuple[dict[str, packs.PackIndex], dict[str, str]]:
        """Every readable pack index (as of a fresh listing), and why each other one is damaged."""
        self.refresh()
        with self._lock:
            return dict(self._packs), {p: exc.message for p, exc in self._damaged.items()}

    def is_damaged(self, pack_id: str) -> bool:
        return pack_id in self._damaged

    def missing(self, digests: Collection[str]) -> set[str]:
        """The digests in no pack and not stored on their own."""
        wanted = set(digests)
        if not wanted:
            return set()
        self.refresh()
        return self._absent_loose(wanted - self._packed.keys())

    def added_pack(self, index: packs.PackIndex) -> None:
        """A pack this process has just written (whole, its index after it)."""
        with self._lock:
            self._damaged.pop(index.pack_id, None)
            self._remember(index)

    def added_loose(self, digest: str) -> None:
        with self._lock:
            self._loose.add(digest)

    def locator(self, release_id: str, digests: Collection[str]) -> bytes:
        """The locator of a release whose blobs are all stored."""
        self.refresh()
        packed = {d: self._packed[d][0].pack_id for d in digests if d in self._packed}
        unpacked = set(digests) - packed.keys()
        # A blob that is neither packed nor loose (absent, or only in a damaged pack) is left out:
        # a pull then looks for it through every index, and fails naming what it found damaged.
        loose = unpacked - self._absent_loose(unpacked - self._loose)
        return packs.encode_locator(release_id, packed, loose)

    def refresh(self) -> None:
        """Load the indexes of packs written since we last looked (they never change).

        A damaged or vanished index is set aside, not raised: it concerns only whoever needs one
        of its blobs (missing() then reports them missing, a pull names it: _check_not_hidden).
        """
        listed = self._reader.list("packs/", self._store_prefix)
        ids = {i for i in map(packs.pack_id_of_index_key, listed) if i is not None}
        with self._lock:  # a pack deleted since (by gc) no longer answers for its blobs
            if gone := [i for i in self._packs if i not in ids]:
                for pack_id in gone:
                    del self._packs[pack_id]
                self._packed = {}
                for index in self._packs.values():
                    self._remember(index)
            for pack_id in [i for i in self._damaged if i not in ids]:
                del self._damaged[pack_id]
        new = sorted(i for i in ids if i not in self._packs and i not in self._damaged)
        loaded = dataplane.run_all([partial(self._try_index, i) for i in new], 16)
        with self._lock:
            for pack_id, got in zip(new, loaded, strict=True):
                if isinstance(got, packs.PackIndex):
                    self._remember(got)
                else:
                    self._damaged[pack_id] = got

    def locate(self, targets: Sequence[BlobTarget], release: str | None) -> dict[str, Where]:
        """Where the targets' blobs lie in packs (a target not found: an object of its own).

        Through the release's locator when it has one: only the indexes of packs holding targets
        are read, and one of them damaged fails the pull, naming it and the file that needed it.
        Targets it does not cover are looked up in every index, skipping damaged ones.
        """
        wanted = {t.digest: t for t in targets}
        found: dict[str, Where] = {}
        unknown = set(wanted)
        locator = self._read_locator(release) if release else None
        if locator is not None:
            found = self._through_locator(locator, wanted)
            unknown -= found.keys() | locator.loose
        if unknown:
            self.refresh()
            found |= {d: self._packed[d] for d in unknown if d in self._packed}
            self._check_not_hidden([wanted[d] for d in sorted(unknown - found.keys())])
        return found

    def _read_locator(self, release_id: str) -> packs.Locator | None:
        """The release's locator; None if there is none or it is damaged (it is only a shortcut:
        without it, the pull looks through every index, as for releases published before locators)."""
        key = packs.locator_key(release_id)
        got = self._reader.read(key, limit=packs.LOCATOR_MAX)
        if got is None:
            return None
        try:
            return packs.decode_locator(release_id, got[0], self._reader.where(key))
        except IntegrityError:
            return None

    def _through_locator(self, locator: packs.Locator, wanted: Mapping[str, BlobTarget]) -> dict[str, Where]:
        needed = {p: sorted(ds & wanted.keys()) for p, ds in locator.packs.items() if ds & wanted.keys()}
        ids = sorted(needed)
        indexes = dataplane.run_all([partial(self._index, p, wanted[needed[p][0]].dest) for p in ids], 16)
        found = {}
        for index in indexes:
            entries = {e.digest: e for e in index.entries}
            for digest in needed[index.pack_id]:
                if digest not in entries:
                    raise IntegrityError(
                        f"{wanted[digest].dest}: {self._reader.where(packs.locator_key(locator.release_id))} places its blob "
                        f"{digest} in {self._reader.where(packs.index_key(index.pack_id))}, which does not list it",
                        hint=packs.DAMAGED_HINT,
                    )
                found[digest] = (index, entries[digest])
        return found

    def _index(self, pack_id: str, needed: Path) -> packs.PackIndex:
        """A pack's index, read and checked once; a damaged one names the file that needed it."""
        with self._lock:
            if pack_id in self._packs:
                return self._packs[pack_id]
        key = packs.index_key(pack_id)
        data = self._reader.get(key, needed=str(needed), limit=packs.INDEX_MAX)
        try:
            index = packs.decode_index(pack_id, bytes(data), self._reader.where(key))
        except IntegrityError as exc:
            raise IntegrityError(f"{exc.message}{responses.needed_for(str(needed))}", hint=exc.hint) from None
        with self._lock:
            self._remember(index)
        return index

    def _check_not_hidden(self, targets: Sequence[BlobTarget]) -> None:
        """Targets found in no readable index are expected as objects of their own; when an index
        was skipped as damaged, check that they are, or fail naming it (it may hold them)."""
        if not targets or not self._damaged:
            return
        present = dataplane.run_all([partial(self._reader.exists, blob_key(t.digest)) for t in targets], 16)
        hidden = [t for t, ok in zip(targets, present, strict=True) if not ok]
        if hidden:
            problem = self._damaged[min(self._damaged)]
            more = f" (and {len(self._damaged) - 1} more damaged)" if len(self._damaged) > 1 else ""
            raise IntegrityError(
                f"{hidden[0].dest}: blob {hidden[0].digest} is in no readable pack index of {self._reader.base} and not stored on its own; "
                f"damaged: {problem}{more}",
                hint=packs.DAMAGED_HINT,
            )

    def _try_index(self, pack_id: str) -> packs.PackIndex | NeffbuildError:
        key = packs.index_key(pack_id)
        try:
            data = self._reader.get(key, limit=packs.INDEX_MAX)
            return packs.decode_index(pack_id, bytes(data), self._reader.where(key))
        except (IntegrityError, NotFoundError) as exc:
            return exc

    def _remember(self, index: packs.PackIndex) -> None:
        self._packs[index.pack_id] = index
        for entry in index.entries:
            self._packed.setdefault(entry.digest, (index, entry))

    def _absent_loose(self, digests: set[str]) -> set[str]:
        """Blobs not stored as objects of their own: HEAD a few, list the shards of many."""
        if len(digests) <= HEAD_LIMIT:
            present = dataplane.run_all([partial(self._reader.exists, blob_key(d)) for d in sorted(digests)], 16)
            have = {d for d, ok in zip(sorted(digests), present, strict=True) if ok}
        else:
            shards = sorted({d[:2] for d in digests})
            listed = dataplane.run_all(
                [partial(self._reader.list, f"blobs/{s}/", self._store_prefix) for s in shards], 16
            )
            have = {rel.rsplit("/", 1)[-1] for keys in listed for rel in keys} & digests
        with self._lock:
            self._loose |= have
            self._loose -= digests - have  # deleted since (by gc)
        return digests - have
