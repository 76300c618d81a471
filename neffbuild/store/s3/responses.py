"""Reading an S3 response (store/s3/dataplane.py's requests): bodies read into buffers and never
past what was asked or a limit, connections given back only when read to the end, and S3's error
codes turned into typed errors naming the object and what needed it."""

from __future__ import annotations

import http.client
import mmap
import re
import socket
import threading
from collections.abc import Callable

import urllib3

from neffbuild import retry
from neffbuild.errors import IntegrityError, NotFoundError, StoreError
from neffbuild.retry import Transient

ERROR_BODY_MAX = 64 << 10  # an S3 error body is a few hundred bytes; only its <Code> is read
CORRUPT_HINT = "the store object is corrupt: re-push the release; nothing was written"
CREDENTIALS_HINT = (
    "check the AWS credentials (AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and the bucket policy"
)
# A body that stops short: urllib3's errors, http.client's IncompleteRead, socket errors and timeouts.
READ_ERRORS = (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)
_ERROR_CODE = re.compile(rb"<Code>([^<]{1,64})</Code>")
Buffer = bytearray | mmap.mmap  # a reusable receive buffer


class ObjectChanged(StoreError):
    """The object was replaced while its parts were being fetched (412 to If-Match, or another ETag)."""


class Version:
    """The ETag the parts of one object must share: the first answered sets it, later requests
    ask for it (If-Match) and any answer with another is refused, so one download never mixes
    the bytes of two versions of an object (thread-safe)."""

    __slots__ = ("_etag", "_lock", "where")

    def __init__(self, where: str) -> None:
        self.where = where
        self._etag = ""
        self._lock = threading.Lock()

    def condition(self) -> dict[str, str]:
        return {"If-Match": self._etag} if self._etag else {}

    def check(self, etag: str) -> None:
        with self._lock:
            if not self._etag:
                self._etag = etag
                return
        if etag != self._etag:
            raise self.changed()

    def changed(self) -> ObjectChanged:
        return ObjectChanged(
            f"{self.where} was replaced while it was being fetched", hint="pull again once the store is done changing"
        )


def body_socket(response: urllib3.BaseHTTPResponse) -> socket.socket | None:
    """The socket a response's body is read from: http.client's file over it (the connection
    forgets its socket when the server says it will close, but the body still comes through it)."""
    reader = getattr(getattr(response, "_fp", None), "fp", None)  # http.client's buffered socket file
    sock = getattr(getattr(reader, "raw", None), "_sock", None)
    return sock if isinstance(sock, socket.socket) else getattr(getattr(response, "connection", None), "sock", None)


def shut(sock: socket.socket) -> None:
    """End a connection's reads now (a blocked recv returns): close() alone would not wake it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


def unreachable(base: str, rel: str, exc: urllib3.exceptions.HTTPError) -> Transient:
    if isinstance(exc, urllib3.exceptions.NewConnectionError | urllib3.exceptions.ConnectTimeoutError):
        return Transient(f"cannot reach S3 ({exc})", hint="check --endpoint-url / AWS_ENDPOINT_URL and the network")
    return Transient(str(exc))


def error_code(body: bytes) -> str:
    """S3's error code from an XML error body ("" if there is none)."""
    found = _ERROR_CODE.search(body or b"")
    return found.group(1).decode(errors="replace") if found else ""


def read_body(
    response: urllib3.BaseHTTPResponse,
    where: str,
    wanted: int | None,
    into: Buffer | memoryview | None,
    *,
    needed: str | None,
    limit: int,
) -> memoryview:
    """Read a body into one buffer with readinto (no per-chunk bytes objects: this is the hot loop).

    wanted: the length of the range asked for (the server must say it sends exactly that); without
    a range, the body may be at most `limit` bytes, whatever Content-Length says or omits.
    """
    length = content_length(response)
    if wanted is not None and length != wanted:  # the server clipped the range: the object is short
        raise short_range(where, length, wanted, needed)
    if length is None:  # no length given: read to the end, but not past the limit
        data = read_at_most(response, limit)
        if len(data) > limit:
            raise too_long(where, limit, needed)
        return memoryview(data)
    if length > limit and wanted is None:
        raise too_long(where, limit, needed)
    buf = into if into is not None and len(into) >= length else bytearray(length)
    view = memoryview(buf)[:length]
    got = 0
    readinto = direct_readinto(response)
    try:
        while got < length and (n := readinto(view[got:])):
            got += n
    except READ_ERRORS as exc:
        raise Transient(f"read failed after {got} of {length} bytes ({exc})", received=got) from None
    if got != length:
        raise Transient(f"connection closed after {got} of {length} bytes", received=got)
    return view


def read_at_most(response: urllib3.BaseHTTPResponse, limit: int) -> bytes:
    """At most limit + 1 bytes of a body: one byte more than limit proves it too long."""
    data = bytearray()
    try:
        while len(data) <= limit and (chunk := response.read(min(1 << 20, limit + 1 - len(data)))):
            data += chunk
    except READ_ERRORS as exc:
        raise Transient(f"read failed after {len(data)} bytes ({exc})") from None
    return bytes(data)


def read_error_body(response: urllib3.BaseHTTPResponse) -> bytes:
    """The start of an error response's body (its <Code>), or b"" if it cannot be read."""
    try:
        return read_at_most(response, ERROR_BODY_MAX)
    except Transient:
        return b""


def content_length(response: urllib3.BaseHTTPResponse) -> int | None:
    """The Content-Length the server declared, or None if absent or not a plain number."""
    value = response.headers.get("Content-Length", "").strip()
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 19 else None


def needed_for(needed: str | None) -> str:
    return f" (needed for {needed})" if needed else ""


def short_range(where: str, length: int | None, wanted: int, needed: str | None) -> IntegrityError:
    sent = "no length" if length is None else f"{length} bytes"
    return IntegrityError(
        f"{where}: the server sent {sent} for a {wanted}-byte range: the object is not as long as its index or release says"
        f"{needed_for(needed)}",
        hint=CORRUPT_HINT,
    )


def too_long(where: str, limit: int, needed: str | None) -> IntegrityError:
    return IntegrityError(
        f"{where}: longer than {limit} bytes, more than such an object holds{needed_for(needed)}", hint=CORRUPT_HINT
    )


def finish(response: urllib3.BaseHTTPResponse) -> None:
    """Give the connection back for reuse only if its body was read to the end; else close it
    (a half-read body left on a pooled connection would be parsed as the next response)."""
    retry.unwatch(id(response))
    raw = getattr(response, "_fp", None)
    if raw is not None and not (isinstance(raw, http.client.HTTPResponse) and raw.isclosed()):
        response.close()
    response.release_conn()


def direct_readinto(response: urllib3.BaseHTTPResponse) -> Callable[[memoryview], int]:
    """The socket-level readinto under urllib3's response when there is one.

    urllib3's own readinto reads into a new bytes object and copies it: for large bodies that is an
    extra copy plus fresh pages per call. http.client's receives into our buffer directly. Bodies
    here are plain (S3 sends no Content-Encoding for our objects), so nothing is skipped.
    """
    raw = getattr(response, "_fp", None)
    if isinstance(raw, http.client.HTTPResponse) and not response.headers.get("Content-Encoding"):
        return raw.readinto
    return response.readinto


def http_error(base: str, rel: str, status: int, body: bytes, needed: str | None) -> Exception:
    where = f"{base}/{rel}".rstrip("/")
    code = error_code(body)
    if code == "NoSuchBucket":
        bucket = base.removeprefix("s3://").split("/", 1)[0]
        return StoreError(
            f"bucket {bucket!r} does not exist", hint="create it (e.g. aws s3 mb), or publish to it (that creates it)"
        )
    if code in (
        "PermanentRedirect",
        "AuthorizationHeaderMalformed",
        "IllegalLocationConstraintException",
    ) or status in (301, 307):
        return StoreError(
            f"{where}: the bucket is in another region ({code or status})", hint="set AWS_REGION to the bucket's region"
        )
    if status == 404:
        return NotFoundError(f"{where} is missing{needed_for(needed)}", hint="re-push the release to this store")
    if status == 403:
        return StoreError(f"access denied to {where} ({code or status})", hint=CREDENTIALS_HINT)
    if status == 416:
        return IntegrityError(
            f"{where} is shorter than its index or release says{needed_for(needed)}", hint=CORRUPT_HINT
        )
    if status == 412:  # only a Version asks with If-Match
        return ObjectChanged(f"{where} was replaced while it was being fetched{needed_for(needed)}", hint="pull again")
    if status >= 500 or status == 429:  # throttled (503 SlowDown, 429) or failing: worth another try
        shown = code if code.isascii() and code.isalnum() else ""  # the server's words, printed: only a plain code
        return Transient(f"HTTP {status} {shown}".rstrip(), throttled=status in (429, 503))
    return StoreError(f"{where}: HTTP {status}: {body[:200].decode(errors='replace')}")
