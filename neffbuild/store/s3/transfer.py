"""How blobs travel to and from an S3 store (measured in bench/RESULTS.md).

Up: blobs under packs.SMALL_BLOB go together in packs of about packs.PACK_TARGET, built in memory
a few at a time; larger ones are objects of their own. Every upload carries a CRC32C that the
server checks, so bytes corrupted in transit are rejected there, and every file is checked to
still hash to the digest it is published under.

Down: small blobs by streaming ranged GETs of their packs, split across about `jobs` connections;
many large blobs by one streaming GET each; a few (fewer than STREAM_MIN) by concurrent ranges
written at their offsets (store/s3/ranged.py), so that one big NEFF still gets several connections;
into a file in memory (tmpfs), every large blob as a few large ranges, read back to be hashed. Each blob is landed as its bytes arrive and checked against its XXH3-128 (and BLAKE3) before
it is linked into place (confined.write_verified, write_placed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import xxhash

from neffbuild import retry
from neffbuild.errors import IntegrityError, StoreError
from neffbuild.fs.confined import BlobTarget, Parents, write_placed, write_verified
from neffbuild.hashing import CHUNK
from neffbuild.store import packs
from neffbuild.store.base import blob_key
from neffbuild.store.blobs import BlobSource
from neffbuild.store.s3 import dataplane, ranged, responses
from neffbuild.store.s3.packs import PackCatalog, Where

logger = logging.getLogger(__name__)
STREAM_MIN = 4  # with this many large blobs or more (or --jobs, if fewer), stream each with one GET instead of ranges
STREAM_CHUNK = 4 << 20  # receive buffer of a streamed blob
PACK_UPLOADS = 4  # packs built in memory at once (each up to packs.PACK_TARGET)
SINGLE_PUT_MAX = 5 << 30  # S3's limit for one PUT
Put = Callable[..., bool]  # put(rel, body, *, crc=None, length=None, **condition): False if a condition did not hold


class Transfers:
    """Moves a store's blobs: reads through `reader`, writes through `put`, and keeps `catalog`
    up to date with what it uploads."""

    def __init__(self, reader: dataplane.DataPlane, catalog: PackCatalog, put: Put) -> None:
        self._reader = reader
        self._catalog = catalog
        self._put = put

    # -- up ------------------------------------------------------------------------------------

    def upload(self, sources: Sequence[BlobSource], jobs: int) -> int:
        """Upload the sources (distinct, all missing from the store); return bytes uploaded."""
        small = [s for s in sources if s.size < packs.SMALL_BLOB]
        large = [s for s in sources if s.size >= packs.SMALL_BLOB]
        building = threading.BoundedSemaphore(PACK_UPLOADS)

        def upload_pack(group: list[BlobSource]) -> int:
            with building:
                return self._upload_pack(group)

        tasks: list[Callable[[], int]] = [partial(upload_pack, g) for g in packs.group_small(small)]
        tasks += [partial(self.upload_loose, s) for s in large]
        return sum(dataplane.run_all(tasks, jobs))

    def upload_loose(self, source: BlobSource) -> int:
        """One blob as an object of its own."""
        if source.size > SINGLE_PUT_MAX:
            raise StoreError(
                f"{source.path}: {source.size} bytes is over S3's single-upload limit",
                hint="files over 5 GiB are not supported yet",
            )
        key = blob_key(source.digest)
        crc = _crc32c_of_file(
            source, self._reader.where(key)
        )  # also checks the file still has the digest we publish it under
        with source.path.open("rb") as body:
            written = self._put(key, body, IfNoneMatch="*", crc=crc, length=source.size)
        self._catalog.added_loose(source.digest)
        return source.size if written else 0

    def _upload_pack(self, group: list[BlobSource]) -> int:
        index, index_bytes = packs.encode_index(group)
        body = bytearray(index.size)
        view = memoryview(body)
        for source, entry in zip(group, index.entries, strict=True):
            _read_exact(
                source,
                view[entry.offset : entry.offset + entry.size],
                self._reader.where(packs.pack_key(index.pack_id)),
            )
        # A pack whose index was found damaged is written again: its name fixes its bytes, so
        # replacing it with them is safe, and a conditional write would keep the damage.
        condition = {} if self._catalog.is_damaged(index.pack_id) else {"IfNoneMatch": "*"}
        written = self._put(packs.pack_key(index.pack_id), body, **condition)
        self._put(
            packs.index_key(index.pack_id), index_bytes, **condition
        )  # after the pack: an index means a whole pack
        self._catalog.added_pack(index)
        return index.size if written else 0

    # -- down ----------------------------------------------------------------------------------

    def download(self, targets: Sequence[BlobTarget], jobs: int, release: str | None) -> None:
        if not targets:
            return
        jobs = max(1, jobs)
        unique, copies = _split_duplicates(targets)
        packed = self._catalog.locate([t for t in unique if t.size], release)
        with Parents() as parents:
            self._fetch(unique, packed, jobs, parents)
            for first, twin in copies:  # one blob at several paths: fetched once, landed again locally
                with first.dest.open("rb") as landed:
                    write_verified(twin, iter(lambda: landed.read(CHUNK), b""), origin=str(first.dest), parents=parents)

    def _fetch(self, unique: list[BlobTarget], packed: dict[str, Where], jobs: int, parents: Parents) -> None:
        chunks = dataplane.Buffers(STREAM_CHUNK)
        tasks: list[Callable[[], None]] = []
        by_pack: dict[str, list[BlobTarget]] = {}
        large: list[BlobTarget] = []
        for t in unique:
            if t.size == 0:  # nothing to fetch; write_verified still checks the digest
                tasks.append(
                    partial(write_verified, t, [], origin=f"{self._reader.base} (empty blob)", parents=parents)
                )
            elif t.digest in packed:
                by_pack.setdefault(packed[t.digest][0].pack_id, []).append(t)
            elif t.size <= dataplane.PART:
                tasks.append(partial(self._stream_loose, t, chunks, parents))
            else:
                large.append(t)
        size = packs.range_size(sum(t.size for ts in by_pack.values() for t in ts), jobs)
        for wanted in by_pack.values():
            fetches = packs.plan_ranges(packed[wanted[0].digest][0], wanted, size)
            tasks += [partial(self._stream_range, f, chunks, parents) for f in fetches]
        # A file in memory (tmpfs, not O_DIRECT) is read back to be hashed, so its parts need no
        # buffers and can all be in flight: ranges for every large blob (ranged.read_back).
        back = [t for t in large if not t.direct and t.size >= ranged.RANGED_MIN]
        large = [t for t in large if t.direct or t.size < ranged.RANGED_MIN]
        # Enough blobs to keep the connections busy, or small ones: one GET each, received into a
        # small buffer and written in order (no reordering, no big buffers).
        # (A/B on 8 x 128 MiB, bench/RESULTS.md: streams cost 0.4 s less CPU per GiB than ranges
        # held in memory and the CLI was not faster with those there.)
        many = len(large) >= min(STREAM_MIN, jobs)
        tasks += [partial(self._stream_loose, t, chunks, parents) for t in large if many or t.size < ranged.RANGED_MIN]
        large = [t for t in large if not many and t.size >= ranged.RANGED_MIN]
        split = ranged.plan([t.size for t in large], jobs)
        ranges = [_Ranges(t, ranged.placed, split, dataplane.Buffers(split.part)) for t in large]
        if back:
            split = ranged.back_plan([t.size for t in back], jobs)
            received = dataplane.Buffers(ranged.BACK_BUFFER)
            ranges += [_Ranges(t, ranged.read_back, split, received) for t in back]
        retry.expect(len(tasks) + sum(r.plan.requests([r.target.size]) for r in ranges))  # one GET each, a range each
        self._run_with_ranges(ranges, tasks, jobs, parents)

    def _run_with_ranges(
        self, ranges: list[_Ranges], tasks: list[Callable[[], None]], jobs: int, parents: Parents
    ) -> None:
        """Run tasks, and fetch some large blobs as concurrent ranges (store/s3/ranged.py). Each
        writer waits on its ranges, fetched by a pool of their own (a task never waits on its own
        pool); the semaphore bounds memory to writers * window * part (ranges held in memory)."""
        if not ranges:
            dataplane.run_all(tasks, jobs)
            return
        writers = threading.BoundedSemaphore(max(r.plan.writers for r in ranges))
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="neffbuild-s3-part") as parts:

            def write_large(r: _Ranges) -> None:
                key = blob_key(r.target.digest)
                with writers:
                    for tries_left in reversed(range(ranged.CHANGED_TRIES)):
                        try:
                            place = r.how(self._reader, key, r.target, r.plan, parts, r.buffers)
                            write_placed(r.target, place, origin=self._reader.where(key), parents=parents)
                            break
                        except responses.ObjectChanged:
                            if not tries_left:
                                raise
                            logger.info("%s was replaced mid-way: fetching it again", self._reader.where(key))
                retry.landed()

            dataplane.run_all([partial(write_large, r) for r in ranges] + tasks, jobs)

    def _stream_loose(self, target: BlobTarget, chunks: dataplane.Buffers, parents: Parents) -> None:
        """One GET of a blob's own object, received into a small buffer and landed as it comes
        (a dropped connection continues from the bytes received: DataPlane.resumed)."""
        key = blob_key(target.digest)
        with chunks.lend() as buf:
            write_verified(
                target,
                self._reader.resumed(key, target.size, buf, needed=str(target.dest)),
                origin=self._reader.where(key),
                parents=parents,
            )
        retry.landed()

    def _stream_range(self, fetch: packs.RangeFetch, chunks: dataplane.Buffers, parents: Parents) -> None:
        """One ranged GET of a pack; each blob in it is landed as its bytes arrive."""
        key = packs.pack_key(fetch.pack_id)
        landed = 0  # a retry resumes after the blobs already landed

        def attempt() -> None:
            nonlocal landed
            pieces = fetch.pieces[landed:]
            pos = fetch.start + pieces[0].start
            response = self._reader.opened(key, pos, fetch.end, needed=str(pieces[0].target.dest))
            try:
                with chunks.lend() as buf:
                    body = dataplane.Body(response, buf, fetch.end - pos)
                    for piece in pieces:
                        at = fetch.start + piece.start
                        body.skip(at - pos)
                        write_verified(
                            piece.target,
                            body.take(piece.size),
                            origin=f"{self._reader.where(key)} at byte {at}",
                            parents=parents,
                        )
                        pos = at + piece.size
                        landed += 1
                        retry.landed()
            finally:
                responses.finish(response)

        self._reader.retried(key, attempt)


@dataclass(frozen=True, slots=True)
class _Ranges:
    """A large blob fetched as ranges: how its parts are placed (ranged.placed or read_back),
    their plan, and the buffers they are received into."""

    target: BlobTarget
    how: Callable[..., Callable[[int, bool], Generator[memoryview, None, None]]]
    plan: ranged.Plan
    buffers: dataplane.Buffers


def crc32c(data: Any, crc: int = 0) -> int:
    from awscrt import checksums  # only uploads need it

    return checksums.crc32c(data, crc)


def _read_exact(source: BlobSource, into: memoryview, where: str) -> None:
    """Read a source file into a slice of a pack (where: its URL), checking it is still what we publish."""
    with source.path.open("rb") as f:
        got = 0
        while got < len(into) and (n := f.readinto(into[got:])):
            got += n
        grew = f.read(1)
    if got != source.size or grew or xxhash.xxh3_128_hexdigest(into) != source.digest:
        raise _changed(source, where)


def _changed(source: BlobSource, where: str) -> IntegrityError:
    return IntegrityError(
        f"{source.path}: changed while publishing to {where} (expected {source.size} bytes, {source.digest})",
        hint="rebuild, then publish",
    )


def _crc32c_of_file(source: BlobSource, where: str) -> int:
    hasher, crc, size = xxhash.xxh3_128(), 0, 0
    with source.path.open("rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
            crc = crc32c(chunk, crc)
            size += len(chunk)
    if size != source.size or hasher.hexdigest() != source.digest:
        raise _changed(source, where)
    return crc


def _split_duplicates(targets: Sequence[BlobTarget]) -> tuple[list[BlobTarget], list[tuple[BlobTarget, BlobTarget]]]:
    """Targets with distinct digests, and (first, twin) pairs for the same bytes at another path."""
    first: dict[str, BlobTarget] = {}
    twins = []
    for t in targets:
        if t.digest in first:
            twins.append((first[t.digest], t))
        else:
            first[t.digest] = t
    return list(first.values()), twins
