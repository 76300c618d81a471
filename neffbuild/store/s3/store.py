"""A store in an S3 bucket (AWS or any S3-compatible server).

Layout as in store/base.py under `s3://bucket/prefix/`, plus packs (store/packs.py): small blobs of
one publish travel together in a pack object so that a pull makes a few large ranged GETs instead
of one request per file.

Two paths to the server. Writes (uploads, conditional puts, deletes, bucket creation) go through
botocore's client (`client`, made on first use: store/s3/client.py), its errors mapped by
store/s3/errors.py. Every read (documents, tags, listings, blobs, packs) goes through `reader`
(store/s3/dataplane.py): presigned requests on a plain urllib3 pool, each blob landed as its bytes
arrive. The URLs are signed by store/s3/sigv4.py when the environment settles credentials and
endpoint, else by botocore; so a pull with static credentials never imports botocore. Only the
store/s3/ modules import botocore, each on first use.

Atomicity rests on conditional writes: immutable objects are written with `If-None-Match: *` (a
412 means someone wrote it first, which is fine: same name, same bytes) and tags are swapped with
`If-Match: <ETag>`; before its first write a store checks that the server honours them
(store/s3/probe.py). Where blobs lie is store/s3/packs.py; how they travel, store/s3/transfer.py.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import urllib3

from neffbuild import retry
from neffbuild.errors import IntegrityError, NotFoundError, StoreError
from neffbuild.fs.confined import BlobTarget
from neffbuild.store import packs
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
from neffbuild.store.s3 import dataplane, sigv4
from neffbuild.store.s3.client import S3Location, botocore_client, bucket_region, endpoint_of
from neffbuild.store.s3.errors import ABSENT_BUCKET, LOST_RACE, client_error, error_code, translated
from neffbuild.store.s3.packs import PackCatalog
from neffbuild.store.s3.probe import ALLOW_UNCONDITIONAL_ENV, ConditionalProbe
from neffbuild.store.s3.transfer import Transfers, crc32c

_T = TypeVar("_T")


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
        self._client_lock = threading.Lock()
        self._signer = signer
        self.reader = dataplane.DataPlane(self._presign, location.url, pool)
        self.catalog = PackCatalog(self.reader, location.prefix)
        self._transfers = Transfers(self.reader, self.catalog, self._put)
        self._probe = ConditionalProbe(
            location.url,
            lambda: self.get_object(MARKER, limit=MARKER_MAX),
            self._put,
            allow_unconditional=allow_unconditional,
        )

    @classmethod
    def from_url(
        cls, url: str, *, env: Mapping[str, str], create: bool = False, endpoint_url: str | None = None
    ) -> S3Store:
        """Open s3://bucket/prefix with the standard AWS credential chain; env is the process environment."""
        location = S3Location.parse(url)
        endpoint = endpoint_of(endpoint_url, env)
        store = cls(
            location, lambda: botocore_client(location, endpoint, env), dataplane.http_pool(endpoint, env),
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
            raise StoreError(
                f"no neffbuild store at {self.url}",
                hint="publish or push into it first (that creates it), or check the URL",
            )
        check_marker(marker, f"{self.url}/{MARKER}")

    def _ensure_bucket(self) -> None:
        def ensure() -> None:
            try:
                self.client.head_bucket(Bucket=self.location.bucket)
            except client_error() as exc:  # evaluated (and botocore imported) only on an error
                if error_code(exc) not in ABSENT_BUCKET:
                    raise
                self.client.create_bucket(Bucket=self.location.bucket, **bucket_region(self.client))

        self._sent("", ensure)

    def _create(self) -> None:
        listed = self._sent(
            "", lambda: self.client.list_objects_v2(Bucket=self.location.bucket, Prefix=self.location.prefix, MaxKeys=1)
        )
        if listed.get("KeyCount", 0):
            raise StoreError(f"{self.url} is not empty and not a neffbuild store", hint="choose an empty or new prefix")
        self._put(MARKER, f'{{"format":"{STORE_FORMAT}"}}'.encode(), IfNoneMatch="*")

    # -- documents and tags --------------------------------------------------------------------

    def put_doc(self, kind: DocKind, name: str, data: bytes) -> bool:
        self._probe.ensure()
        return self._put(doc_key(kind, name), data, IfNoneMatch="*")

    def get_doc(self, kind: DocKind, name: str) -> bytes | None:
        got = self.reader.read(doc_key(kind, name))
        return None if got is None else self._within_limit(doc_key(kind, name), got[0])

    def get_docs(self, kind: DocKind, names: Iterable[str], jobs: int) -> dict[str, bytes | None]:
        unique = sorted(set(names))
        return dict(zip(unique, dataplane.run_all([partial(self.get_doc, kind, n) for n in unique], jobs), strict=True))

    def list_docs(self, kind: DocKind) -> Iterator[str]:
        names = [rel[len(kind) + 1 : -len(".json")] for rel in self._list(f"{kind}/") if rel.endswith(".json")]
        yield from sorted(n for n in names if "/" not in n)

    def read_tag(self, name: str) -> tuple[bytes, str] | None:
        got = self.reader.read(doc_key("tags", name))
        return None if got is None else (self._within_limit(doc_key("tags", name), got[0]), got[1])

    def _within_limit(self, rel: str, data: bytes) -> bytes:
        if len(data) > DOC_MAX:
            raise IntegrityError(
                f"{self.reader.where(rel)}: over {DOC_MAX} bytes, not a document", hint=dataplane.CORRUPT_HINT
            )
        return data

    def swap_tag(self, name: str, data: bytes, expected: str | None) -> bool:
        self._probe.ensure()
        try:
            if expected is None:
                return self._put(doc_key("tags", name), data, IfNoneMatch="*")
            return self._put(doc_key("tags", name), data, IfMatch=expected)
        except NotFoundError:  # AWS answers If-Match on a deleted key with 404: the tag moved too
            return False

    # -- any object: listing and deleting ------------------------------------------------------

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.reader.objects(prefix, self.location.prefix)

    def delete_objects(self, keys: Iterable[str]) -> None:
        todo = [check_deletable(k) for k in keys]
        failures: list[tuple[str, str]] = []
        for start in range(0, len(todo), DELETE_BATCH):
            batch = todo[start : start + DELETE_BATCH]
            delete = {"Objects": [{"Key": self.location.key(k)} for k in batch], "Quiet": True}
            answer = self._sent(batch[0], partial(self._delete_batch, delete))
            for error in answer.get("Errors", ()):
                key = str(error.get("Key", "")).removeprefix(self.location.prefix)
                failures.append((key, f"{error.get('Code', '?')}: {error.get('Message', '')}".rstrip(": ")))
        if failures:
            raise deletion_failed(self.url, failures)

    def pack_indexes(self) -> tuple[dict[str, packs.PackIndex], dict[str, str]]:
        return self.catalog.indexes()

    # -- blobs ---------------------------------------------------------------------------------

    def missing_blobs(self, digests: Collection[str]) -> set[str]:
        return self.catalog.missing(digests)

    def put_blob(self, digest: str, source: Path) -> int:
        self._probe.ensure()
        if not self.missing_blobs({digest}):
            return 0
        return self._transfers.upload_loose(BlobSource(digest, source.stat().st_size, source))

    def put_blobs(self, sources: Sequence[BlobSource], jobs: int) -> int:
        unique = {s.digest: s for s in sources}
        if not unique:
            return 0
        self._probe.ensure()
        return self._transfers.upload([unique[d] for d in sorted(self.missing_blobs(unique))], jobs)

    def put_locator(self, release_id: str, digests: Collection[str]) -> None:
        key = packs.locator_key(release_id)
        if self.reader.exists(key):
            return  # written by an earlier publish of this release: it still holds (packs never change)
        self._probe.ensure()
        self._put(key, self.catalog.locator(release_id, digests), IfNoneMatch="*")

    def download_blobs(self, targets: Sequence[BlobTarget], jobs: int, *, release: str | None = None) -> None:
        self._transfers.download(targets, jobs, release)

    @contextmanager
    def open_blob(self, digest: str) -> Iterator[BinaryIO]:
        self.catalog.refresh()
        where = self.catalog.where(digest)
        if where is None:
            response = self.reader.stream(blob_key(digest), needed=f"blob {digest}")
        else:
            index, entry = where
            response = self.reader.stream(packs.pack_key(index.pack_id), entry.offset, entry.offset + entry.size)
        try:
            yield response  # type: ignore[misc]  # urllib3's response is a readable stream
        finally:
            dataplane.finish(response)

    # -- the wire ------------------------------------------------------------------------------

    def _put(self, rel: str, body: Any, *, crc: int | None = None, length: int | None = None, **condition: str) -> bool:
        """PUT with a CRC32C the server verifies; False if a condition did not hold."""
        if crc is None:
            crc = crc32c(body)

        def put() -> bool:
            if hasattr(body, "seek"):  # a file: a retry sends it from the start
                body.seek(0)
            try:
                self.client.put_object(
                    Bucket=self.location.bucket, Key=self.location.key(rel), Body=body,
                    ContentLength=len(body) if length is None else length,
                    ChecksumCRC32C=base64.b64encode(crc.to_bytes(4, "big")).decode(), **condition,
                )  # fmt: skip
            except client_error() as exc:  # evaluated (and botocore imported) only on an error
                if error_code(exc) in LOST_RACE:
                    return False
                raise
            return True

        # A retried conditional put whose first try landed unseen answers 412: for an immutable
        # object that is "already there"; for a tag, move_tag re-reads it and finds its own record.
        return self._sent(rel, put)

    def _delete_batch(self, delete: dict[str, Any]) -> dict[str, Any]:
        # the client is made inside the call: under _sent's error translation and retries
        return self.client.delete_objects(Bucket=self.location.bucket, Delete=delete)

    def _sent(self, rel: str, call: Callable[[], _T]) -> _T:
        """A botocore call under the retry policy (neffbuild/retry.py); its errors typed."""

        def attempt() -> _T:
            with translated(self.location, rel, transient=True):
                return call()

        return retry.retried(self.reader.where(rel), attempt)

    def get_object(self, rel: str, *, limit: int = DOC_MAX) -> bytes | None:
        """An object's bytes (at most limit + 1), or None if absent."""
        got = self.reader.read(rel, limit=limit)
        return None if got is None else got[0]

    def _list(self, rel_prefix: str) -> list[str]:
        """Keys under a prefix, relative to the store root."""
        return self.reader.list(rel_prefix, self.location.prefix)

    def _presign(self, method: str, rel: str, params: Mapping[str, str]) -> str:
        """A URL for a read: rel "" with params is a listing of the bucket."""
        key = self.location.key(rel) if rel else ""
        if self._signer is not None:
            return self._signer.presign(method, key, params)
        if params:  # the only read with parameters
            operation = "list_objects_v2"
            args: dict[str, str | int] = {"Prefix": params["prefix"], "EncodingType": "url"}
            if "continuation-token" in params:
                args["ContinuationToken"] = params["continuation-token"]
            if "max-keys" in params:
                args["MaxKeys"] = int(params["max-keys"])
        else:
            operation, args = ("head_object" if method == "HEAD" else "get_object"), {"Key": key}
        with translated(self.location, rel):
            return self.client.generate_presigned_url(
                operation, Params={"Bucket": self.location.bucket, **args}, ExpiresIn=3600
            )
