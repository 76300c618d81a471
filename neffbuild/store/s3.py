"""A store in an S3 bucket (AWS or any S3-compatible server): the only module that imports boto3's
botocore (and awscrt, for CRC32C), both on first use.

Layout as in store/base.py under `s3://bucket/prefix/`, plus packs (store/packs.py): small blobs of
one publish travel together in a pack object so that a pull makes a few large ranged GETs instead
of one request per file.

Atomicity rests on conditional writes: immutable objects are written with `If-None-Match: *` (a
412 means someone wrote it first, which is fine: same name, same bytes) and tags are swapped with
`If-Match: <ETag>`. A server that ignores these would silently lose tag updates, so before its
first write a store checks that the server honours them and refuses otherwise, unless
NEFFBUILD_S3_ALLOW_UNCONDITIONAL=1. Every upload carries a CRC32C the server checks, so bytes
corrupted in transit are rejected there; every blob read is checked against its XXH3-128 when it
lands (materialize.write_verified).

botocore writes (uploads, conditional puts, bucket creation) and is imported on first use only.
Every read (documents, tags, listings, blobs, packs) goes through store/dataplane.py: presigned
requests on a plain urllib3 pool, each blob landed as its bytes arrive. The URLs are signed by
store/sigv4.py when the environment settles credentials and endpoint, else by botocore; so a pull
with static credentials never imports botocore.
How a pull is fetched (measured in bench/RESULTS.md): small blobs by streaming ranged GETs of their
packs, split across about `jobs` connections; many large blobs by one streaming GET each; a few
large blobs by parallel ranges, so a single big NEFF still gets several connections. Which packs
hold a release's blobs comes from its locator (store/packs.py), so a pull reads only their
indexes; a release published before locators existed is found through every index, and a
damaged one only fails the pulls that need one of its blobs.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import urllib3
import xxhash

from neffbuild.errors import IntegrityError, NeffbuildError, NotFoundError, StoreError
from neffbuild.hashing import CHUNK
from neffbuild.materialize import BlobTarget, write_verified
from neffbuild.store import dataplane, packs, sigv4
from neffbuild.store.base import (
    DELETE_BATCH,
    DOC_MAX,
    MARKER,
    MARKER_MAX,
    STORE_FORMAT,
    BlobSource,
    DocKind,
    ObjectInfo,
    blob_key,
    check_deletable,
    check_marker,
    deletion_failed,
    doc_key,
)

ALLOW_UNCONDITIONAL_ENV = "NEFFBUILD_S3_ALLOW_UNCONDITIONAL"
STREAM_MIN = 4  # with this many large blobs or more, stream each with one GET instead of ranges
STREAM_CHUNK = 4 << 20  # receive buffer of a streamed blob
PACK_UPLOADS = 4  # packs built in memory at once (each up to packs.PACK_TARGET)
HEAD_LIMIT = 256  # up to this many blobs to check: HEAD each; more: list their shards
SINGLE_PUT_MAX = 5 << 30  # S3's limit for one PUT
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403"}
_CORRUPT = {"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "XAmzContentSHA256Mismatch"}
_LOST_RACE = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
Where = tuple[packs.PackIndex, packs.PackEntry]  # where a packed blob lies


@dataclass(frozen=True, slots=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> S3Location:
        rest = url.removeprefix("s3://")
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not bucket or url == rest:
            raise StoreError(f"store {url!r}: expected s3://bucket[/prefix]", hint="e.g. s3://my-bucket/neffbuild")
        return cls(bucket, f"{prefix}/" if prefix else "")

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, rel: str) -> str:
        return self.prefix + rel


class S3Store:
    def __init__(
        self,
        location: S3Location,
        make_client: Callable[[], Any],
        pool: urllib3.PoolManager,
        *,
        signer: sigv4.Signer | None = None,
        allow_unconditional: bool = False,
    ) -> None:
        self.location = location
        self._make_client = make_client
        self._client: Any = None
        self._signer = signer
        self.data = dataplane.DataPlane(self._presign, location.url, pool)
        self.allow_unconditional = allow_unconditional
        self._lock = threading.Lock()
        self._client_lock = threading.Lock()  # apart: _lock is held around writes that need the client
        self._probed = False
        self._packs: dict[str, packs.PackIndex] = {}
        self._packed: dict[str, Where] = {}
        self._damaged: dict[str, NeffbuildError] = {}  # pack id -> why its index cannot be used
        self._loose: set[str] = set()  # digests seen stored as objects of their own

    @classmethod
    def from_url(
        cls, url: str, *, env: Mapping[str, str], create: bool = False, endpoint_url: str | None = None
    ) -> S3Store:
        """Open s3://bucket/prefix with the standard AWS credential chain; env is the process environment."""
        location = S3Location.parse(url)
        endpoint = endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
        store = cls(
            location, lambda: _botocore_client(location, endpoint, env), dataplane.http_pool(endpoint, env),
            signer=sigv4.signer_from_env(location.bucket, endpoint, env),
            allow_unconditional=env.get(ALLOW_UNCONDITIONAL_ENV) == "1",
        )  # fmt: skip
        store._open(create)
        return store

    @property
    def client(self) -> Any:
        """botocore's S3 client, made on first use (writes, or reads it must sign)."""
        with self._client_lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    @property
    def url(self) -> str:
        return self.location.url

    # -- opening -----------------------------------------------------------------------------

    def _open(self, create: bool) -> None:
        if create:
            self._ensure_bucket()
        marker = self.get_object(MARKER, limit=MARKER_MAX)
        if marker is None and create:
            self._create()
            marker = self.get_object(MARKER, limit=MARKER_MAX)
        if marker is None:
            raise StoreError(f"no neffbuild store at {self.url}", hint="publish or push into it first (that creates it), or check the URL")
        check_marker(marker, f"{self.url}/{MARKER}")

    def _ensure_bucket(self) -> None:
        with _translated(self.location, ""):
            try:
                self.client.head_bucket(Bucket=self.location.bucket)
            except _client_error() as exc:  # evaluated (and botocore imported) only on an error
                if _code(exc) not in ("404", "NoSuchBucket", "NotFound"):
                    raise
                self.client.create_bucket(Bucket=self.location.bucket, **_bucket_region(self.client))

    def _create(self) -> None:
        with _translated(self.location, ""):
            listed = self.client.list_objects_v2(Bucket=self.location.bucket, Prefix=self.location.prefix, MaxKeys=1)
        if listed.get("KeyCount", 0):
            raise StoreError(f"{self.url} is not empty and not a neffbuild store", hint="choose an empty or new prefix")
        self._put_new(MARKER, f'{{"format":"{STORE_FORMAT}"}}'.encode())

    def _ensure_conditional(self) -> None:
        """Before the first write: check that the server honours If-None-Match and If-Match.

        Both probes rewrite the store marker with its own bytes, which is harmless on a server
        that ignores the condition, so the probe leaves nothing behind.
        """
        with self._lock:
            if self._probed:
                return
            marker = self.get_object(MARKER, limit=MARKER_MAX) or b""
            try:
                honoured = not self._put(MARKER, marker, IfNoneMatch="*") and not self._put(MARKER, marker, IfMatch='"0"')
            except StoreError as exc:  # some servers refuse the headers outright
                if "NotImplemented" not in exc.message:
                    raise
                honoured = False
            if not honoured and not self.allow_unconditional:
                raise StoreError(
                    f"{self.url}: the server ignores conditional writes (If-None-Match / If-Match), "
                    "so concurrent publishes could silently overwrite each other",
                    hint=f"use a server that supports them (AWS S3, SeaweedFS), or set {ALLOW_UNCONDITIONAL_ENV}=1 "
                    "if only one publisher ever writes to this store",
                )
            self._probed = True

    # -- documents and tags --------------------------------------------------------------------

    def put_doc(self, kind: DocKind, name: str, data: bytes) -> bool:
        self._ensure_conditional()
        return self._put_new(doc_key(kind, name), data)

    def get_doc(self, kind: DocKind, name: str) -> bytes | None:
        got = self.data.read(doc_key(kind, name))
        return None if got is None else self._within_limit(doc_key(kind, name), got[0])

    def list_docs(self, kind: DocKind) -> Iterator[str]:
        names = [rel[len(kind) + 1 : -len(".json")] for rel in self._list(f"{kind}/") if rel.endswith(".json")]
        yield from sorted(n for n in names if "/" not in n)

    def get_docs(self, kind: DocKind, names: Iterable[str], jobs: int) -> dict[str, bytes | None]:
        unique = sorted(set(names))
        return dict(zip(unique, dataplane.run_all([lambda n=n: self.get_doc(kind, n) for n in unique], jobs), strict=True))

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.data.objects(prefix, self.location.prefix)

    def delete_objects(self, keys: Iterable[str]) -> None:
        todo = [check_deletable(k) for k in keys]
        failures: list[tuple[str, str]] = []
        for start in range(0, len(todo), DELETE_BATCH):
            batch = todo[start : start + DELETE_BATCH]
            with _translated(self.location, batch[0]):
                answer = self.client.delete_objects(
                    Bucket=self.location.bucket, Delete={"Objects": [{"Key": self.location.key(k)} for k in batch], "Quiet": True}
                )
            for error in answer.get("Errors", ()):
                key = str(error.get("Key", "")).removeprefix(self.location.prefix)
                failures.append((key, f"{error.get('Code', '?')}: {error.get('Message', '')}".rstrip(": ")))
        if failures:
            raise deletion_failed(self.url, failures)

    def pack_indexes(self) -> tuple[dict[str, packs.PackIndex], dict[str, str]]:
        self._refresh_packs()
        with self._lock:
            return dict(self._packs), {p: exc.message for p, exc in self._damaged.items()}

    def read_tag(self, name: str) -> tuple[bytes, str] | None:
        got = self.data.read(doc_key("tags", name))
        return None if got is None else (self._within_limit(doc_key("tags", name), got[0]), got[1])

    def _within_limit(self, rel: str, data: bytes) -> bytes:
        if len(data) > DOC_MAX:
            raise IntegrityError(f"{self.data.where(rel)}: over {DOC_MAX} bytes, not a document", hint=dataplane.CORRUPT_HINT)
        return data

    def swap_tag(self, name: str, data: bytes, expected: str | None) -> bool:
        self._ensure_conditional()
        condition = {"IfMatch": expected} if expected is not None else {"IfNoneMatch": "*"}
        try:
            return self._put(doc_key("tags", name), data, **condition)
        except NotFoundError:  # AWS answers If-Match on a deleted key with 404: the tag moved too
            return False

    # -- blobs ---------------------------------------------------------------------------------

    def missing_blobs(self, digests: Collection[str]) -> set[str]:
        wanted = set(digests)
        if not wanted:
            return set()
        self._refresh_packs()
        loose = wanted - self._packed.keys()
        return self._absent_loose(loose)

    def put_blob(self, digest: str, source: Path) -> int:
        self._ensure_conditional()
        if not self.missing_blobs({digest}):
            return 0
        return self._upload_loose(BlobSource(digest, source.stat().st_size, source))

    def put_blobs(self, sources: Sequence[BlobSource], jobs: int) -> int:
        unique = {s.digest: s for s in sources}
        if not unique:
            return 0
        self._ensure_conditional()
        todo = [unique[d] for d in sorted(self.missing_blobs(unique))]
        small = [s for s in todo if s.size < packs.SMALL_BLOB]
        large = [s for s in todo if s.size >= packs.SMALL_BLOB]
        building = threading.BoundedSemaphore(PACK_UPLOADS)

        def upload_pack(group: list[BlobSource]) -> int:
            with building:
                return self._upload_pack(group)

        tasks: list[Callable[[], int]] = [lambda g=g: upload_pack(g) for g in packs.group_small(small)]
        tasks += [lambda s=s: self._upload_loose(s) for s in large]
        return sum(dataplane.run_all(tasks, jobs))

    def put_locator(self, release_id: str, digests: Collection[str]) -> None:
        key = packs.locator_key(release_id)
        if self.data.exists(key):
            return  # written by an earlier publish of this release: it still holds (packs never change)
        self._ensure_conditional()
        self._refresh_packs()
        packed = {d: self._packed[d][0].pack_id for d in digests if d in self._packed}
        unpacked = set(digests) - packed.keys()
        # A blob that is neither packed nor loose (absent, or only in a damaged pack) is left out:
        # a pull then looks for it through every index, and fails naming what it found damaged.
        loose = unpacked - self._absent_loose(unpacked - self._loose)
        self._put_new(key, packs.encode_locator(release_id, packed, loose))

    def download_blobs(self, targets: Sequence[BlobTarget], jobs: int, *, release: str | None = None) -> None:
        if not targets:
            return
        jobs = max(1, jobs)
        unique, copies = _split_duplicates(targets)
        packed = self._locate([t for t in unique if t.size], release)
        chunks = dataplane.Buffers(STREAM_CHUNK)
        tasks: list[Callable[[], None]] = []
        by_pack: dict[str, list[BlobTarget]] = {}
        large: list[BlobTarget] = []
        for t in unique:
            if t.size == 0:  # nothing to fetch; write_verified still checks the digest
                tasks.append(lambda t=t: write_verified(t, [], origin=f"{self.url} (empty blob)"))
            elif t.digest in packed:
                by_pack.setdefault(packed[t.digest][0].pack_id, []).append(t)
            elif t.size <= dataplane.PART:
                tasks.append(lambda t=t: self._stream_loose(t, chunks))
            else:
                large.append(t)
        size = packs.range_size(sum(t.size for ts in by_pack.values() for t in ts), jobs)
        for pack_id, wanted in by_pack.items():
            fetches = packs.plan_ranges(packed[wanted[0].digest][0], wanted, size)
            tasks += [lambda f=f: self._stream_range(f, chunks) for f in fetches]
        if len(large) >= STREAM_MIN:
            # Enough blobs to keep the connections busy: one GET each, received into a small buffer
            # and written in order (measured faster than ranges: no reordering, no big buffers).
            tasks += [lambda t=t: self._stream_loose(t, chunks) for t in large]
            large = []
        self._run_with_ranges(large, tasks, jobs)
        for first, twin in copies:  # one blob at several paths: fetched once, landed again locally
            with first.dest.open("rb") as landed:
                write_verified(twin, iter(lambda: landed.read(CHUNK), b""), origin=str(first.dest))

    def _locate(self, targets: Sequence[BlobTarget], release: str | None) -> dict[str, Where]:
        """Where the targets' blobs lie in packs (a target not found: an object of its own).

        Through the release's locator when it has one: only the indexes of packs holding targets
        are read, and one of them damaged fails the pull, naming it and the file that needed it.
        Targets it does not cover are looked up in every index, skipping damaged ones.
        """
        wanted = {t.digest: t for t in targets}
        found: dict[str, Where] = {}
        unknown = set(wanted)
        locator = self._locator(release) if release else None
        if locator is not None:
            found = self._through_locator(locator, wanted)
            unknown -= found.keys() | locator.loose
        if unknown:
            self._refresh_packs()
            found |= {d: self._packed[d] for d in unknown if d in self._packed}
            self._check_not_hidden([wanted[d] for d in sorted(unknown - found.keys())])
        return found

    def _locator(self, release_id: str) -> packs.Locator | None:
        """The release's locator; None if there is none or it is damaged (it is only a shortcut:
        without it, the pull looks through every index, as for releases published before locators)."""
        key = packs.locator_key(release_id)
        got = self.data.read(key, limit=packs.LOCATOR_MAX)
        if got is None:
            return None
        try:
            return packs.decode_locator(release_id, got[0], self.data.where(key))
        except IntegrityError:
            return None

    def _through_locator(self, locator: packs.Locator, wanted: Mapping[str, BlobTarget]) -> dict[str, Where]:
        needed = {p: sorted(ds & wanted.keys()) for p, ds in locator.packs.items() if ds & wanted.keys()}
        ids = sorted(needed)
        indexes = dataplane.run_all([lambda p=p: self._index(p, wanted[needed[p][0]].dest) for p in ids], 16)
        found = {}
        for index in indexes:
            entries = {e.digest: e for e in index.entries}
            for digest in needed[index.pack_id]:
                if digest not in entries:
                    raise IntegrityError(
                        f"{wanted[digest].dest}: {self.data.where(packs.locator_key(locator.release_id))} places its blob "
                        f"{digest} in {self.data.where(packs.index_key(index.pack_id))}, which does not list it",
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
        data = self.data.get(key, needed=str(needed), limit=packs.INDEX_MAX)
        try:
            index = packs.decode_index(pack_id, bytes(data), self.data.where(key))
        except IntegrityError as exc:
            raise IntegrityError(f"{exc.message}{dataplane.needed_for(str(needed))}", hint=exc.hint) from None
        with self._lock:
            self._remember(index)
        return index

    def _check_not_hidden(self, targets: Sequence[BlobTarget]) -> None:
        """Targets found in no readable index are expected as objects of their own; when an index
        was skipped as damaged, check that they are, or fail naming it (it may hold them)."""
        if not targets or not self._damaged:
            return
        present = dataplane.run_all([lambda t=t: self.data.exists(blob_key(t.digest)) for t in targets], 16)
        hidden = [t for t, ok in zip(targets, present, strict=True) if not ok]
        if hidden:
            problem = self._damaged[min(self._damaged)]
            more = f" (and {len(self._damaged) - 1} more damaged)" if len(self._damaged) > 1 else ""
            raise IntegrityError(
                f"{hidden[0].dest}: blob {hidden[0].digest} is in no readable pack index of {self.url} and not stored on its own; "
                f"damaged: {problem}{more}",
                hint=packs.DAMAGED_HINT,
            )

    def _run_with_ranges(self, large: list[BlobTarget], tasks: list[Callable[[], None]], jobs: int) -> None:
        """Run tasks, and fetch a few large blobs as parallel ranges so one big file still gets
        several connections. Each writer waits on its ranges, fetched by a pool of their own (a task
        never waits on its own pool); the semaphore bounds memory to writers * WINDOW * PART."""
        if not large:
            dataplane.run_all(tasks, jobs)
            return
        buffers = dataplane.Buffers(dataplane.PART)
        writers = threading.BoundedSemaphore(max(1, jobs // dataplane.WINDOW))
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="neffbuild-s3-part") as parts:

            def write_large(target: BlobTarget) -> None:
                with writers:
                    key = blob_key(target.digest)
                    chunks = dataplane.ranges_in_order(self.data, key, target, parts, buffers)
                    write_verified(target, chunks, origin=f"{self.url}/{key}")

            dataplane.run_all([lambda t=t: write_large(t) for t in large] + tasks, jobs)

    @contextmanager
    def open_blob(self, digest: str) -> Iterator[BinaryIO]:
        self._refresh_packs()
        where = self._packed.get(digest)
        if where is None:
            response = self.data.stream(blob_key(digest), needed=f"blob {digest}")
        else:
            index, entry = where
            response = self.data.stream(packs.pack_key(index.pack_id), entry.offset, entry.offset + entry.size)
        try:
            yield response  # type: ignore[misc]  # urllib3's response is a readable stream
        finally:
            dataplane.finish(response)

    # -- uploads -------------------------------------------------------------------------------

    def _upload_pack(self, group: list[BlobSource]) -> int:
        index, index_bytes = packs.encode_index(group)
        body = bytearray(index.size)
        view = memoryview(body)
        for source, entry in zip(group, index.entries, strict=True):
            _read_exact(source, view[entry.offset : entry.offset + entry.size], self.data.where(packs.pack_key(index.pack_id)))
        # A pack whose index was found damaged is written again: its name fixes its bytes, so
        # replacing it with them is safe, and a conditional write would keep the damage.
        condition = {} if index.pack_id in self._damaged else {"IfNoneMatch": "*"}
        written = self._put(packs.pack_key(index.pack_id), body, **condition)
        self._put(packs.index_key(index.pack_id), index_bytes, **condition)  # after the pack: an index means a whole pack
        with self._lock:
            self._damaged.pop(index.pack_id, None)
            self._remember(index)
        return index.size if written else 0

    def _upload_loose(self, source: BlobSource) -> int:
        if source.size > SINGLE_PUT_MAX:
            raise StoreError(f"{source.path}: {source.size} bytes is over S3's single-upload limit", hint="files over 5 GiB are not supported yet")
        key = blob_key(source.digest)
        crc = _crc32c_of_file(source, self.data.where(key))  # also checks the file still has the digest we publish it under
        with source.path.open("rb") as body:
            written = self._put(key, body, IfNoneMatch="*", crc=crc, length=source.size)
        with self._lock:
            self._loose.add(source.digest)
        return source.size if written else 0

    def _put_new(self, rel: str, data: bytes | bytearray) -> bool:
        return self._put(rel, data, IfNoneMatch="*")

    def _put(self, rel: str, body: Any, *, crc: int | None = None, length: int | None = None, **condition: str) -> bool:
        """PUT with a CRC32C the server verifies; False if a condition did not hold."""
        if crc is None:
            crc = _crc32c(body)
        with _translated(self.location, rel):
            try:
                self.client.put_object(
                    Bucket=self.location.bucket, Key=self.location.key(rel), Body=body,
                    ContentLength=len(body) if length is None else length,
                    ChecksumCRC32C=base64.b64encode(crc.to_bytes(4, "big")).decode(), **condition,
                )  # fmt: skip
            except _client_error() as exc:  # evaluated (and botocore imported) only on an error
                if _code(exc) in _LOST_RACE:
                    return False
                raise
        return True

    # -- reads ---------------------------------------------------------------------------------

    def get_object(self, rel: str, *, limit: int = DOC_MAX) -> bytes | None:
        """An object's bytes (at most limit + 1), or None if absent."""
        got = self.data.read(rel, limit=limit)
        return None if got is None else got[0]

    def _list(self, rel_prefix: str) -> list[str]:
        """Keys under a prefix, relative to the store root."""
        return self.data.list(rel_prefix, self.location.prefix)

    def _presign(self, method: str, rel: str, params: Mapping[str, str]) -> str:
        """A URL for a read: rel "" with params is a listing of the bucket."""
        key = self.location.key(rel) if rel else ""
        if self._signer is not None:
            return self._signer.presign(method, key, params)
        if params:  # the only read with parameters
            operation, args = "list_objects_v2", {"Prefix": params["prefix"], "EncodingType": "url"}
            if "continuation-token" in params:
                args["ContinuationToken"] = params["continuation-token"]
            if "max-keys" in params:
                args["MaxKeys"] = int(params["max-keys"])
        else:
            operation, args = ("head_object" if method == "HEAD" else "get_object"), {"Key": key}
        with _translated(self.location, rel):
            return self.client.generate_presigned_url(operation, Params={"Bucket": self.location.bucket, **args}, ExpiresIn=3600)

    def _refresh_packs(self) -> None:
        """Load the indexes of packs written since we last looked (they never change).

        A damaged or vanished index is set aside, not raised: it concerns only whoever needs one
        of its blobs (missing_blobs then reports them missing, a pull names it: _check_not_hidden).
        """
        ids = {packs.pack_id_of_index_key(rel) for rel in self._list("packs/")} - {None}
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
        loaded = dataplane.run_all([lambda i=i: self._try_index(i) for i in new], 16)
        with self._lock:
            for pack_id, got in zip(new, loaded, strict=True):
                if isinstance(got, packs.PackIndex):
                    self._remember(got)
                else:
                    self._damaged[pack_id] = got

    def _try_index(self, pack_id: str) -> packs.PackIndex | NeffbuildError:
        key = packs.index_key(pack_id)
        try:
            data = self.data.get(key, limit=packs.INDEX_MAX)
            return packs.decode_index(pack_id, bytes(data), self.data.where(key))
        except (IntegrityError, NotFoundError) as exc:
            return exc

    def _remember(self, index: packs.PackIndex) -> None:
        self._packs[index.pack_id] = index
        for entry in index.entries:
            self._packed.setdefault(entry.digest, (index, entry))

    def _absent_loose(self, digests: set[str]) -> set[str]:
        """Blobs not stored as objects of their own: HEAD a few, list the shards of many."""
        if len(digests) <= HEAD_LIMIT:
            present = dataplane.run_all([lambda d=d: self.data.exists(blob_key(d)) for d in sorted(digests)], 16)
            have = {d for d, ok in zip(sorted(digests), present, strict=True) if ok}
        else:
            shards = sorted({d[:2] for d in digests})
            listed = dataplane.run_all([lambda s=s: self._list(f"blobs/{s}/") for s in shards], 16)
            have = {rel.rsplit("/", 1)[-1] for keys in listed for rel in keys} & digests
        with self._lock:
            self._loose |= have
            self._loose -= digests - have  # deleted since (by gc)
        return digests - have

    def _stream_loose(self, target: BlobTarget, chunks: dataplane.Buffers) -> None:
        """One GET of a blob's own object, received into a small buffer and landed as it comes."""
        key = blob_key(target.digest)

        def attempt() -> None:  # write_verified leaves nothing behind when a try fails
            response = self.data.stream(key, needed=str(target.dest))
            try:
                with chunks.lend() as buf:
                    write_verified(target, dataplane.received(response, buf), origin=f"{self.url}/{key}")
            finally:
                dataplane.finish(response)

        self.data.retried(key, attempt)

    def _stream_range(self, fetch: packs.RangeFetch, chunks: dataplane.Buffers) -> None:
        """One ranged GET of a pack; each blob in it is landed as its bytes arrive."""
        key = packs.pack_key(fetch.pack_id)
        landed = 0  # a retry resumes after the blobs already landed

        def attempt() -> None:
            nonlocal landed
            pieces = fetch.pieces[landed:]
            pos = fetch.start + pieces[0].start
            response = self.data.stream(key, pos, fetch.end, needed=str(pieces[0].target.dest))
            try:
                with chunks.lend() as buf:
                    body = dataplane.Body(response, buf)
                    for piece in pieces:
                        at = fetch.start + piece.start
                        body.skip(at - pos)
                        write_verified(piece.target, body.take(piece.size), origin=f"{self.url}/{key} at byte {at}")
                        pos = at + piece.size
                        landed += 1
            finally:
                dataplane.finish(response)

        self.data.retried(key, attempt)


def _botocore_client(location: S3Location, endpoint: str | None, env: Mapping[str, str]) -> Any:
    """An S3 client on botocore's session: boto3's credential chain (env, config files, SSO,
    instance role) without boto3's import cost."""
    import botocore.session

    with _translated(location, ""):
        session = botocore.session.Session(profile=None if env.get("AWS_ACCESS_KEY_ID") else env.get("AWS_PROFILE"))
        for variable, name in (("config_file", "AWS_CONFIG_FILE"), ("credentials_file", "AWS_SHARED_CREDENTIALS_FILE")):
            if env.get(name):  # botocore reads os.environ; the env we were given wins
                session.set_config_variable(variable, env[name])
        return session.create_client(
            "s3",
            region_name=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
            endpoint_url=endpoint,
            aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
            aws_session_token=env.get("AWS_SESSION_TOKEN"),
            config=_client_config(endpoint),
        )


@contextmanager
def _translated(location: S3Location, rel: str) -> Iterator[None]:
    """botocore's exceptions become our typed errors, one line each, naming the object."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        NoCredentialsError,
        PartialCredentialsError,
        ProfileNotFound,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    where = f"{location.url}/{rel}".rstrip("/")
    try:
        yield
    except NeffbuildError:
        raise
    except ClientError as exc:
        code = _code(exc)
        message = exc.response.get("Error", {}).get("Message", "")
        if code == "NoSuchBucket":
            raise StoreError(
                f"bucket {location.bucket!r} does not exist",
                hint="create it (e.g. aws s3 mb), or open the store with create=True as publishing commands do",
            ) from None
        if code in _DENIED:
            raise StoreError(f"access denied to {where} ({code})", hint=dataplane.CREDENTIALS_HINT) from None
        if code in _CORRUPT:
            raise IntegrityError(
                f"upload of {where} was rejected by the server: its checksum did not match ({code})",
                hint="the bytes were corrupted in transit; retry, and check proxies on the way to the endpoint",
            ) from None
        if code in ("NoSuchKey", "404"):
            raise NotFoundError(f"{where} not found") from None
        raise StoreError(f"{where}: {code}: {message}".rstrip(": ")) from None
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise StoreError(f"no AWS credentials for {location.url} ({exc})", hint=dataplane.CREDENTIALS_HINT) from None
    except ProfileNotFound as exc:
        raise StoreError(str(exc), hint="check AWS_PROFILE and ~/.aws/config") from None
    except BotoConnectionError as exc:
        raise StoreError(f"cannot reach S3 for {where}: {exc}", hint="check --endpoint-url / AWS_ENDPOINT_URL and the network") from None
    except BotoCoreError as exc:
        raise StoreError(f"{where}: {exc}") from None


def _code(exc: Any) -> str:  # a botocore ClientError
    return str(exc.response.get("Error", {}).get("Code", ""))


def _client_config(endpoint: str | None) -> Any:
    from botocore.config import Config

    return Config(
        signature_version="s3v4",
        retries={"mode": "standard", "max_attempts": 5},
        max_pool_connections=64,
        # We send our own CRC32C and verify XXH3 on read: skip botocore's extra checksums and the
        # SHA-256 of every payload it would compute on plain-http endpoints.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"payload_signing_enabled": False, **({"addressing_style": "path"} if endpoint else {})},
    )


def _bucket_region(client: Any) -> dict[str, Any]:
    region = client.meta.region_name
    return {} if region in (None, "us-east-1") else {"CreateBucketConfiguration": {"LocationConstraint": region}}


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
        f"{source.path}: changed while publishing to {where} (expected {source.size} bytes, {source.digest})", hint="rebuild, then publish"
    )


def _crc32c_of_file(source: BlobSource, where: str) -> int:
    hasher, crc, size = xxhash.xxh3_128(), 0, 0
    with source.path.open("rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
            crc = _crc32c(chunk, crc)
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


def _client_error() -> type[Exception]:
    from botocore.exceptions import ClientError

    return ClientError


def _crc32c(data: Any, crc: int = 0) -> int:
    from awscrt import checksums  # only uploads need it

    return checksums.crc32c(data, crc)
