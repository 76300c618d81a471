"""A store in an S3 bucket (AWS or any S3-compatible server): the layout (store/layout.py) on
S3Medium, the raw part, with a blob plane of its own (S3Blobs).

Two paths to the server. Writes (uploads, conditional puts, deletes, bucket creation) go through
botocore's client (`client`, made on first use: store/s3/client.py), its errors mapped by
store/s3/errors.py. Every read (documents, tags, listings, blobs, packs) goes through `reader`
(store/s3/dataplane.py): presigned requests on a plain urllib3 pool, each blob landed as its bytes
arrive. The URLs are signed by store/s3/sigv4.py when the environment settles credentials and
endpoint, else by botocore; so a pull with static credentials never imports botocore. Only the
store/s3/ modules import botocore, each on first use.

Atomicity rests on conditional writes: new objects are written with `If-None-Match: *` (a 412
means someone wrote it first, which is fine: same name, same bytes) and swapped with
`If-Match: <ETag>`; before its first write a store checks that the server honours them
(store/s3/probe.py).

Packs (store/packs.py): small blobs of one publish travel together in a pack object so that a
pull makes a few large ranged GETs instead of one request per file. Where blobs lie is
store/s3/packs.py; how they travel, store/s3/transfer.py.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import urllib3

from neffbuild import retry
from neffbuild.errors import NotFoundError, StoreError
from neffbuild.fs.confined import BlobTarget
from neffbuild.store import packs
from neffbuild.store.base import STORE_FORMAT, blob_key
from neffbuild.store.blobs import BlobSource
from neffbuild.store.layout import LayoutStore
from neffbuild.store.raw import Content, ObjectInfo
from neffbuild.store.s3 import dataplane, responses, sigv4
from neffbuild.store.s3.client import S3Location, botocore_client, bucket_region, endpoint_of
from neffbuild.store.s3.errors import ABSENT_BUCKET, LOST_RACE, client_error, error_code, translated
from neffbuild.store.s3.packs import PackCatalog
from neffbuild.store.s3.probe import ALLOW_UNCONDITIONAL_ENV, ConditionalProbe
from neffbuild.store.s3.transfer import Transfers, crc32c

_T = TypeVar("_T")
DELETE_BATCH = 1000  # S3's DeleteObjects takes at most this many keys per request


class S3Medium:
    corrupt_hint = responses.CORRUPT_HINT
    missing_hint = "publish or push into it first (that creates it), or check the URL"

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
        self.probe = ConditionalProbe(location.url, self.get, self.put, allow_unconditional=allow_unconditional)

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

    def where(self, key: str) -> str:
        return self.reader.where(key)

    # -- the store as a whole ------------------------------------------------------------------

    def ensure_bucket(self) -> None:
        def ensure() -> None:
            try:
                self.client.head_bucket(Bucket=self.location.bucket)
            except client_error() as exc:  # evaluated (and botocore imported) only on an error
                if error_code(exc) not in ABSENT_BUCKET:
                    raise
                try:
                    self.client.create_bucket(Bucket=self.location.bucket, **bucket_region(self.client))
                except client_error() as made:
                    if error_code(made) != "BucketAlreadyOwnedByYou":  # another of our creators made it meanwhile
                        raise

        self._sent("", ensure)

    def create(self, marker_key: str, marker: bytes) -> None:
        listed = self._sent(
            "", lambda: self.client.list_objects_v2(Bucket=self.location.bucket, Prefix=self.location.prefix, MaxKeys=1)
        )
        if not listed.get("KeyCount", 0):
            self.put(marker_key, marker, IfNoneMatch="*")  # False: another process wrote it first
        elif not self.reader.exists(marker_key):  # a creator writes the marker first, so it is not one
            raise StoreError(f"{self.url} is not empty and not a neffbuild store", hint="choose an empty or new prefix")

    # -- objects -------------------------------------------------------------------------------

    def get(self, key: str, limit: int) -> bytes | None:
        got = self.reader.read(key, limit=limit)
        return None if got is None else got[0]

    def get_versioned(self, key: str, limit: int) -> tuple[bytes, str] | None:
        return self.reader.read(key, limit=limit)

    def put_new(self, key: str, content: Content) -> bool:
        self.probe.ensure()
        return self.put(key, _bytes_of(content), IfNoneMatch="*")

    def swap(self, key: str, data: bytes, expected: str | None) -> bool:
        self.probe.ensure()
        try:
            if expected is None:
                return self.put(key, data, IfNoneMatch="*")
            return self.put(key, data, IfMatch=expected)
        except NotFoundError:  # AWS answers If-Match on a deleted key with 404: it moved too
            return False

    def exists(self, key: str) -> bool:
        return self.reader.exists(key)

    @contextmanager
    def _streamed(self, key: str) -> Iterator[BinaryIO]:
        response = self.reader.stream(key)
        try:
            yield response  # type: ignore[misc]  # urllib3's response is a readable stream
        finally:
            responses.finish(response)

    def open(self, key: str) -> Any:
        return self._streamed(key) if self.reader.exists(key) else None

    def names(self, folder: str) -> list[str]:
        names = [rel[len(folder) + 1 :] for rel in self.reader.list(f"{folder}/", self.location.prefix)]
        return [n for n in names if "/" not in n]

    def objects(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.reader.objects(prefix, self.location.prefix)

    def delete(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        failures: list[tuple[str, str]] = []
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start : start + DELETE_BATCH]
            delete = {"Objects": [{"Key": self.location.key(k)} for k in batch], "Quiet": True}
            answer = self._sent(batch[0], partial(self._delete_batch, delete))
            for error in answer.get("Errors", ()):
                key = str(error.get("Key", "")).removeprefix(self.location.prefix)
                failures.append((key, f"{error.get('Code', '?')}: {error.get('Message', '')}".rstrip(": ")))
        return failures

    def run_all(self, tasks: Sequence[Callable[[], _T]], jobs: int) -> list[_T]:
        return dataplane.run_all(tasks, jobs)

    # -- the wire ------------------------------------------------------------------------------

    def put(self, rel: str, body: Any, *, crc: int | None = None, length: int | None = None, **condition: str) -> bool:
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
                )  # fmt: skip  # arguments packed by meaning, not one a line
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
        """A botocore call under the retry policy (neffbuild/retry/); its errors typed."""

        def attempt() -> _T:
            with translated(self.location, rel, transient=True):
                return call()

        return retry.retried(self.reader.where(rel), attempt)

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


def _bytes_of(content: Content) -> bytes:
    if isinstance(content, bytes):
        return content
    out = io.BytesIO()
    content(out)
    return out.getvalue()


# The marker an S3 store has always been made with (compact JSON): kept, so its layout is unchanged.
S3_MARKER = f'{{"format":"{STORE_FORMAT}"}}'.encode()


class S3Blobs:
    """The blob plane (store/loose.py's BlobPlane) of an S3 store: packed and loose blobs."""

    def __init__(self, medium: S3Medium) -> None:
        self._medium = medium
        self._reader = medium.reader
        self.catalog = PackCatalog(medium.reader, medium.location.prefix)
        self._transfers = Transfers(medium.reader, self.catalog, medium.put)

    def missing(self, digests: Collection[str]) -> set[str]:
        return self.catalog.missing(digests)

    def put(self, digest: str, source: Path) -> int:
        self._medium.probe.ensure()
        if not self.missing({digest}):
            return 0
        return self._transfers.upload_loose(BlobSource(digest, source.stat().st_size, source))

    def put_all(self, sources: Sequence[BlobSource], jobs: int) -> int:
        unique = {s.digest: s for s in sources}
        if not unique:
            return 0
        self._medium.probe.ensure()
        return self._transfers.upload([unique[d] for d in sorted(self.missing(unique))], jobs)

    def put_locator(self, release_id: str, digests: Collection[str]) -> None:
        key = packs.locator_key(release_id)
        if self._reader.exists(key):
            return  # written by an earlier publish of this release: it still holds (packs never change)
        self._medium.probe.ensure()
        self._medium.put(key, self.catalog.locator(release_id, digests), IfNoneMatch="*")

    def download(self, targets: Sequence[BlobTarget], jobs: int, release: str | None) -> None:
        self._transfers.download(targets, jobs, release)

    @contextmanager
    def open(self, digest: str) -> Iterator[BinaryIO]:
        self.catalog.refresh()
        where = self.catalog.where(digest)
        if where is None:
            response = self._reader.stream(blob_key(digest), needed=f"blob {digest}")
        else:
            index, entry = where
            response = self._reader.stream(packs.pack_key(index.pack_id), entry.offset, entry.offset + entry.size)
        try:
            yield response  # type: ignore[misc]  # urllib3's response is a readable stream
        finally:
            responses.finish(response)

    def pack_indexes(self) -> tuple[dict[str, packs.PackIndex], dict[str, str]]:
        return self.catalog.indexes()


class S3Store(LayoutStore):
    def __init__(self, medium: S3Medium, *, create: bool = False) -> None:
        self.medium = medium
        self.location = medium.location
        self.reader = medium.reader
        plane = S3Blobs(medium)
        self.catalog = plane.catalog
        if create:
            medium.ensure_bucket()
        super().__init__(medium, blobs=plane, create=create, marker=S3_MARKER)

    @classmethod
    def from_url(
        cls, url: str, *, env: Mapping[str, str], create: bool = False, endpoint_url: str | None = None
    ) -> S3Store:
        """Open s3://bucket/prefix with the standard AWS credential chain; env is the process environment."""
        location = S3Location.parse(url)
        endpoint = endpoint_of(endpoint_url, env)
        medium = S3Medium(
            location, lambda: botocore_client(location, endpoint, env), dataplane.http_pool(endpoint, env),
            signer=sigv4.signer_from_env(location.bucket, endpoint, env),
            allow_unconditional=env.get(ALLOW_UNCONDITIONAL_ENV) == "1",
        )  # fmt: skip  # arguments packed by meaning, not one a line
        return cls(medium, create=create)

    @property
    def client(self) -> Any:
        """botocore's S3 client, made on first use (writes, or reads it must sign)."""
        return self.medium.client

    def get_object(self, rel: str, *, limit: int) -> bytes | None:
        """An object's bytes (at most limit + 1), or None if absent (maint/storecheck.py reads locators)."""
        return self.medium.get(rel, limit)
