"""The read side of the S3 store: GET, HEAD and listings over a plain urllib3 pool, on presigned URLs.

botocore costs milliseconds of Python per request, and large bodies must not be copied more than
needed, so reads bypass it: the store presigns each request (store/s3/sigv4.py, or botocore when only
it can resolve the credentials or endpoint) and this module moves the bytes, receiving them into
reused buffers and handing them to confined.write_verified as they arrive. Connection failures,
throttling and 5xx are retried under neffbuild/retry/'s policy and deadline (a retried body
continues with a ranged GET from the bytes it has); S3's error codes become typed errors naming the
object and what needed it.
No read trusts the server to end a body: each stops at the size it expects (a blob's, a range's)
or at a limit (documents, indexes, listings, error bodies), whatever Content-Length says.
"""

from __future__ import annotations

import html
import re
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

import urllib3

from neffbuild import retry
from neffbuild.errors import StoreError
from neffbuild.fs.confined import aligned_buffer
from neffbuild.retry import Transient
from neffbuild.store.base import DOC_MAX, ObjectInfo
from neffbuild.store.s3.responses import (
    READ_ERRORS,
    Buffer,
    ObjectChanged,
    Version,
    body_socket,
    content_length,
    direct_readinto,
    error_code,
    finish,
    http_error,
    read_at_most,
    read_body,
    read_error_body,
    short_range,
    shut,
    unreachable,
)

PART = 8 << 20  # a large blob is fetched as parallel ranges of this size
WINDOW = 4  # ranges of one large blob in flight (bounds memory: WINDOW * PART per blob)
LIST_PAGE_MAX = 64 << 20  # a page of 1,000 keys is ~300 KB
_T = TypeVar("_T")

# (HTTP method, key relative to the store, query parameters) -> URL
Presign = Callable[[str, str, Mapping[str, str]], str]
_LIST_ENTRY = re.compile(rb"<Contents>(.*?)</Contents>", re.S)
_LIST_KEY = re.compile(rb"<Key>([^<]*)</Key>")
_LIST_SIZE = re.compile(rb"<Size>([0-9]{1,19})</Size>")
_LIST_MTIME = re.compile(rb"<LastModified>([^<]{1,64})</LastModified>")
_LIST_NEXT = re.compile(rb"<NextContinuationToken>([^<]*)</NextContinuationToken>")


def received(response: urllib3.BaseHTTPResponse, buf: Buffer) -> Iterator[memoryview]:
    """A response body as views of one reused buffer, each valid until the next is requested."""
    view = memoryview(buf)
    readinto = direct_readinto(response)
    length = content_length(response)
    got = 0
    while True:
        try:
            n = readinto(view)
        except READ_ERRORS as exc:
            raise Transient(f"read failed after {got} bytes ({exc})", received=got) from None
        if not n:
            break
        got += n
        yield view[:n]
    if length is not None and length != got:  # http.client reports a connection closed early as a plain end
        raise Transient(f"connection closed after {got} of {length} bytes", received=got)


class Body:
    """Exact reads from a response body of `length` bytes through one reused buffer (a pack range:
    blob after blob). Each receive fills as much of the buffer as the socket has, and small blobs
    are handed out from it: one system call and a few Python calls serve many of them."""

    def __init__(self, response: urllib3.BaseHTTPResponse, buf: Buffer, length: int) -> None:
        self._readinto = direct_readinto(response)
        self._view = memoryview(buf)
        self._pos = self._end = 0  # the received bytes not yet handed out: _view[_pos:_end]
        self._left = length  # bytes of the body not yet received (never read past them)

    def take(self, size: int) -> Iterator[memoryview]:
        """The next size bytes, as views valid until the next is requested; a piece that fits
        the buffer comes as one view."""
        while size > 0:
            if self._end - self._pos < min(size, len(self._view)):
                self._receive(min(size, len(self._view)))
            n = min(size, self._end - self._pos)
            view = self._view[self._pos : self._pos + n]
            self._pos += n
            size -= n
            yield view

    def skip(self, size: int) -> None:
        for _ in self.take(size):
            pass

    def _receive(self, wanted: int) -> None:
        """Receive until wanted bytes are held, the bytes held first moved to the buffer's start."""
        held = self._end - self._pos
        if self._pos:
            self._view[:held] = self._view[self._pos : self._end]
            self._pos, self._end = 0, held
        while self._end < wanted:
            room = self._view[self._end : self._end + min(len(self._view) - self._end, self._left)]
            try:
                n = self._readinto(room) if len(room) else 0
            except READ_ERRORS as exc:
                raise Transient(f"read failed ({exc})") from None
            if not n:
                raise Transient("connection closed before the range ended")
            self._end += n
            self._left -= n


class Buffers:
    """Buffers reused across requests: fresh memory costs page faults (and on a VM, host
    allocations) that cost more than the copy itself; reuse keeps the data plane fast. They are
    page-aligned, so that confined.write_verified can write them to disk with O_DIRECT."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[Buffer] = []
        self._lock = threading.Lock()

    def take(self) -> Buffer:
        with self._lock:
            if self._free:
                return self._free.pop()
        return aligned_buffer(self.size)

    def give(self, buf: Buffer) -> None:
        with self._lock:
            self._free.append(buf)

    @contextmanager
    def lend(self) -> Iterator[Buffer]:
        buf = self.take()
        try:
            yield buf
        finally:
            self.give(buf)


class DataPlane:
    """GET and HEAD of a store's objects (keys relative to its root, `base` its URL for messages)."""

    def __init__(self, presign: Presign, base: str, pool: urllib3.PoolManager) -> None:
        self._presign = presign
        self.base = base
        self.pool = pool

    def where(self, rel: str) -> str:
        return f"{self.base}/{rel}".rstrip("/")

    def get(
        self, rel: str, start: int = 0, end: int | None = None, *, into: Buffer | None = None, needed: str | None = None,
        limit: int = DOC_MAX, version: Version | None = None,
    ) -> memoryview:  # fmt: skip  # parameters packed by meaning, not one a line
        """Bytes [start, end) of an object (all of it, at most `limit` bytes, if end is None),
        retried on transient failures.

        They land in `into` when it is large enough (the caller owns it until done with the view).
        `needed` names what needed the object (a cache file), for the errors; a range read with
        a `version` is of the object's version that answered its other ranges (ObjectChanged if not).
        """

        if end is None:

            def attempt() -> memoryview:
                response = self._get(rel, start, end, needed)
                try:
                    return read_body(response, self.where(rel), None, into, needed=needed, limit=limit)
                finally:
                    finish(response)

            return self.retried(rel, attempt)
        view = memoryview(into if into is not None and len(into) >= end - start else bytearray(end - start))[
            : end - start
        ]
        got = 0  # a retry asks only for the rest of the range

        def rest() -> memoryview:
            nonlocal got
            response = self._get(rel, start + got, end, needed, version)
            try:
                read_body(response, self.where(rel), end - start - got, view[got:], needed=needed, limit=limit)
            except Transient as failure:
                got += failure.received
                raise
            finally:
                finish(response)
            return view

        return self.retried(rel, rest)

    def stream(
        self, rel: str, start: int = 0, end: int | None = None, *, needed: str | None = None,
        version: Version | None = None,
    ) -> urllib3.BaseHTTPResponse:  # fmt: skip  # parameters packed by meaning, not one a line
        """An open response for [start, end) (the whole object if end is None); the caller reads
        what it expects of it and no more, then finish()es it. With a version: of that version
        of the object (ObjectChanged if not)."""
        return self.retried(rel, partial(self.opened, rel, start, end, needed=needed, version=version))

    def opened(
        self, rel: str, start: int = 0, end: int | None = None, *, needed: str | None = None,
        version: Version | None = None,
    ) -> urllib3.BaseHTTPResponse:  # fmt: skip  # parameters packed by meaning, not one a line
        """stream's one try, for a caller whose own retried attempt opens it (a retried inside a
        retried would pace and count one request twice)."""
        response = self._get(rel, start, end, needed, version)
        length = content_length(response)
        if end is not None and length is not None and length != end - start:
            finish(response)
            raise short_range(self.where(rel), length, end - start, needed)
        return response

    def resumed(
        self, rel: str, size: int, buf: Buffer, *, needed: str | None = None, part: tuple[int, Version] | None = None
    ) -> Iterator[memoryview]:
        """An object's `size` bytes in order, as views of buf (see received); with part (start,
        version): its bytes [start, start + size) of that version. A body cut short continues
        with a ranged GET from the bytes already received, under the retry policy; the caller
        still checks what it got as a whole (write_verified hashes every byte)."""
        got = 0
        tries = retry.Tries()
        while True:
            if part is None:
                response = self.stream(rel, got, size if got else None, needed=needed)
            else:
                response = self.stream(rel, part[0] + got, part[0] + size, needed=needed, version=part[1])
            before = got
            try:
                for view in received(response, buf):
                    got += len(view)
                    yield view
                return
            except Transient as failure:
                if got > before:
                    tries.reset()  # it moved on: a drop now and then is not a failing store
                retry.pause(self.where(rel), tries, failure)
            finally:
                finish(response)

    def read(self, rel: str, *, limit: int = DOC_MAX) -> tuple[bytes, str] | None:
        """A small object's bytes and ETag, or None if there is no such key. At most limit + 1
        bytes are read: one more than limit proves the object too long (the caller decides)."""

        def attempt() -> tuple[bytes, str] | None:
            response = self._request("GET", rel, preload_content=False)
            try:
                if response.status == 200:
                    return read_at_most(response, limit), response.headers.get("ETag", "")
                body = read_error_body(response)
            finally:
                finish(response)
            if response.status == 404 and error_code(body) != "NoSuchBucket":
                return None
            raise http_error(self.base, rel, response.status, body, None)

        return self.retried(rel, attempt)

    def list(self, rel_prefix: str, store_prefix: str, *, page_size: int | None = None) -> list[str]:
        """Keys under a prefix (ListObjectsV2, every page), relative to the store root."""
        return [o.key for o in self.objects(rel_prefix, store_prefix, page_size=page_size)]

    def objects(self, rel_prefix: str, store_prefix: str, *, page_size: int | None = None) -> Iterator[ObjectInfo]:
        """The objects under a prefix with their size and time, page after page (ListObjectsV2)."""
        params = {"list-type": "2", "prefix": store_prefix + rel_prefix, "encoding-type": "url"}
        if page_size is not None:  # the server's default (1,000) otherwise
            params["max-keys"] = str(page_size)
        while True:
            page = self.retried(rel_prefix, partial(self._list_page, rel_prefix, dict(params)))
            encoded = b"<EncodingType>url</EncodingType>" in page  # a server may ignore encoding-type
            for entry in _LIST_ENTRY.findall(page):
                yield self._listed(rel_prefix, entry, encoded, len(store_prefix))
            token = _LIST_NEXT.search(page)
            if b"<IsTruncated>true</IsTruncated>" not in page or token is None:
                return
            params["continuation-token"] = html.unescape(token.group(1).decode(errors="replace"))

    def _listed(self, rel_prefix: str, entry: bytes, encoded: bool, cut: int) -> ObjectInfo:
        """One <Contents> entry of a listing page; one without a key, size or time is not S3's."""
        key, size, mtime = _LIST_KEY.search(entry), _LIST_SIZE.search(entry), _LIST_MTIME.search(entry)
        try:
            when = datetime.fromisoformat(mtime.group(1).decode()).timestamp() if mtime else None
        except ValueError:
            when = None
        if key is None or size is None or when is None:
            raise StoreError(
                f"{self.where(rel_prefix)}: a listing entry without a key, size or time",
                hint="the endpoint is not an S3 server",
            )
        name = html.unescape(key.group(1).decode(errors="replace"))
        return ObjectInfo((urllib.parse.unquote(name) if encoded else name)[cut:], int(size.group(1)), when)

    def _list_page(self, rel_prefix: str, params: Mapping[str, str]) -> bytes:
        response = self._request("GET", "", params, named=rel_prefix, preload_content=False)
        try:
            if response.status != 200:
                raise http_error(self.base, rel_prefix, response.status, read_error_body(response), None)
            page = read_at_most(response, LIST_PAGE_MAX)
        finally:
            finish(response)
        if len(page) > LIST_PAGE_MAX:
            raise StoreError(
                f"{self.where(rel_prefix)}: a listing page over {LIST_PAGE_MAX} bytes",
                hint="the endpoint is not an S3 server",
            )
        return page

    def exists(self, rel: str) -> bool:
        def attempt() -> bool:
            response = self._request("HEAD", rel)
            if response.status in (200, 404):
                return response.status == 200
            raise http_error(self.base, rel, response.status, b"", None)

        return self.retried(rel, attempt)

    def _request(
        self, method: str, rel: str, params: Mapping[str, str] | None = None, *, named: str | None = None, **kwargs: Any
    ) -> urllib3.BaseHTTPResponse:
        """One presigned request; a connection failure is Transient (named: what to call it then).

        Its socket timeouts end at the deadline; a response whose body the caller streams is cut
        (its socket shut down) when the deadline passes, until finish() releases it."""
        connect, read = retry.timeouts()
        timeout = urllib3.Timeout(connect=connect, read=read)
        try:
            response = self.pool.request(method, self._presign(method, rel, params or {}), timeout=timeout, **kwargs)
        except urllib3.exceptions.HTTPError as exc:
            raise unreachable(self.base, rel if named is None else named, exc) from None
        if not kwargs.get("preload_content", True) and (sock := body_socket(response)) is not None:
            retry.watch(id(response), lambda: shut(sock))
        return response

    def _get(
        self, rel: str, start: int, end: int | None, needed: str | None, version: Version | None = None
    ) -> urllib3.BaseHTTPResponse:
        headers = {} if end is None else {"Range": f"bytes={start}-{end - 1}"}
        if version is not None:
            headers.update(version.condition())
        response = self._request("GET", rel, headers=headers, preload_content=False)
        if response.status == (200 if end is None else 206):
            if version is not None:
                try:
                    version.check(response.headers.get("ETag", ""))
                except ObjectChanged:
                    finish(response)
                    raise
            return response
        try:
            body = read_error_body(response)
        finally:
            finish(response)
        raise http_error(self.base, rel, response.status, body, needed)

    def retried(self, rel: str, attempt: Callable[[], _T]) -> _T:
        """attempt() under the retry policy (neffbuild/retry/), naming rel's URL when it gives up."""
        return retry.retried(self.where(rel), attempt)


def http_pool(endpoint: str | None, env: Mapping[str, str]) -> urllib3.PoolManager:
    """The data plane's pool; honours AWS_CA_BUNDLE and HTTP(S)_PROXY/NO_PROXY as botocore does."""
    kwargs: dict[str, Any] = {
        "maxsize": 64,
        "retries": False,
        "timeout": urllib3.Timeout(connect=retry.CONNECT_S, read=retry.READ_S),
    }
    if env.get("AWS_CA_BUNDLE"):
        kwargs["ca_certs"] = env["AWS_CA_BUNDLE"]
    scheme, host = "https", "s3.amazonaws.com"
    if endpoint:
        parsed = urllib.parse.urlsplit(endpoint)
        scheme, host = parsed.scheme, parsed.hostname or ""
    proxies = {
        k.lower().removesuffix("_proxy"): v
        for k, v in env.items()
        if k.lower() in ("http_proxy", "https_proxy", "no_proxy")
    }
    proxy = proxies.get(scheme)
    if proxy:
        # 10 ms of imports, for proxied hosts only; undocumented, so not in typeshed
        from urllib.request import proxy_bypass_environment  # type: ignore[attr-defined]

        if not proxy_bypass_environment(host, proxies):
            return urllib3.ProxyManager(proxy, **kwargs)
    return urllib3.PoolManager(**kwargs)


def run_all(tasks: Sequence[Callable[[], _T]], jobs: int) -> list[_T]:
    """Run tasks in a pool, results in order; the first failure cancels what has not started."""
    if not tasks:
        return []
    if len(tasks) == 1:
        return [tasks[0]()]
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(tasks)))) as pool:
        futures = [pool.submit(retry.carried(t)) for t in tasks]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f in done and f.exception() is not None), None)
        if failed is not None:
            for f in futures:
                f.cancel()
            retry.stop()  # the pull has failed: its requests still running stop now, not after their retries
            raise failed.exception()  # type: ignore[misc]
        return [f.result() for f in futures]
