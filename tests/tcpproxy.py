"""A loopback TCP proxy in front of the test S3 server that misbehaves on purpose.

Modes:
- "pass": forward bytes unchanged.
- "flip-body": flip the first body byte of PUTs whose path contains one of `paths` (a corrupting
  network path; the server must reject the upload by its checksum).
- "cut-gets": end the first `cuts` GET responses for `paths` after 64 KiB of body (a dropped
  connection; the client must retry and resume).
- "ignore-preconditions": answer a 412 with an empty 200 (a server that ignores If-None-Match /
  If-Match; the real server still did not write, which the tests do not rely on).
- "endless": successful GET responses for `paths` lose their Content-Length and, after the real
  body, go on with zero bytes until the client hangs up (or `endless_cap` bytes): a body that
  never ends. `extra_sent` counts the bytes sent past the real bodies.
- "slowdown": answer the first `slowdowns` requests for `paths` (and `methods`, if given) with
  S3's 503 SlowDown (an XML error body), without forwarding them (a throttling server).
- "limit": a store with a request rate: let `limit` requests a second through (a token bucket
  holding one second's worth, refilled continuously) and answer the rest 503 SlowDown, as S3
  answers a burst. `forwarded` counts the requests let through, `slowed` the others, `decided`
  holds when each came and whether it went through; `limit` may be changed while it serves
  (None: no limit).
- "trickle": successful GET responses for `paths` forward their headers, then the body
  `trickle[0]` bytes every `trickle[1]` seconds (a server that never stops, never finishes).
- "stall": successful GET responses for `paths` forward their headers, then nothing until the
  client hangs up or the proxy stops (a frozen server).

`seen` records every request as (method, path, headers with lower-case names), in arrival order;
`seen_at` the time.monotonic() of each.

The proxy counts what it forwards back to clients: `bytes_down` (response heads and bodies as the
server sent them; what a fault mode makes up or cuts off is not counted), `requests`, and
`exchanges`, one (method, path, bytes forwarded) per request; read them after settled().

Each request is forwarded with `Connection: close`, so a connection carries one exchange and the
proxy needs no HTTP framing beyond the request's Content-Length. It serves until stop().
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

SLOWDOWN_BODY = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>'
SLOWDOWN = b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (
    len(SLOWDOWN_BODY), SLOWDOWN_BODY,
)  # fmt: skip
MISBEHAVING = ("slowdown", "limit", "trickle", "stall")  # modes served by TcpProxy._misbehave


class TcpProxy:
    def __init__(
        self, upstream_port: int, mode: str = "pass", paths: Sequence[str] = ("/",), cuts: int = 0, endless_cap: int = 1 << 30,
        *, slowdowns: int = 0, methods: Sequence[str] = (), trickle: tuple[int, float] = (1, 1.0), limit: float | None = None,
    ) -> None:  # fmt: skip
        self.upstream = ("127.0.0.1", upstream_port)
        self.mode = mode
        self.paths = tuple(p.encode() for p in paths)
        self.corrupted = 0
        self.cuts = cuts
        self._cuts_lock = threading.Lock()
        self.endless_cap = endless_cap
        self.extra_sent = 0
        self.slowdowns = slowdowns
        self.methods = tuple(m.encode() for m in methods)
        self.slowed: list[tuple[str, str]] = []  # (method, path) of each request answered 503 SlowDown
        self.trickle = trickle
        self.limit = limit
        self.forwarded = 0
        self.decided: list[tuple[float, bool]] = []  # "limit": (time.monotonic(), let through) of each request
        self._tokens = 0.0 if limit is None else max(1.0, limit)
        self._filled = time.monotonic()
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.seen_at: list[float] = []  # time.monotonic() of each request in seen
        self.bytes_down = 0
        self.requests = 0
        self.exchanges: list[tuple[str, str, int]] = []
        self._counting = threading.Lock()
        self._asked: dict[socket.socket, tuple[str, str]] = {}  # upstream connection -> its request
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self._listener.close()

    def settled(self, timeout: float = 5.0) -> bool:
        """Whether every request forwarded so far has had its answer counted (waits up to timeout:
        a client may have read its last bytes before the proxy's thread counted them)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._counting:
                if len(self.exchanges) == self.requests:
                    return True
            time.sleep(0.01)
        return False

    def _serve(self) -> None:
        self._listener.settimeout(0.1)  # closing a listening socket does not wake accept(): poll
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        if self.mode in MISBEHAVING:
            self._misbehave(client)
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=30)
        except OSError:
            client.close()
            return
        cut = threading.Event()  # set by the request side: cut this exchange's response short
        endless = threading.Event()  # set by the request side: make this exchange's body endless
        threading.Thread(target=self._responses, args=(upstream, client, cut, endless), daemon=True).start()
        try:
            self._request(client, upstream, cut, endless)
        except OSError:
            upstream.close()
            client.close()

    def _request(
        self, client: socket.socket, upstream: socket.socket, cut: threading.Event, endless: threading.Event
    ) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = client.recv(65536)
            if not chunk:
                upstream.close()
                return
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        first, *headers = head.split(b"\r\n")
        headers = [h for h in headers if not h.lower().startswith(b"connection:")] + [b"Connection: close"]
        length = next((int(h.split(b":", 1)[1]) for h in headers if h.lower().startswith(b"content-length:")), 0)
        method, path = first.split(b" ")[:2]
        self._saw(method, path, headers)
        matches = any(p in path for p in self.paths)
        flip = self.mode == "flip-body" and method == b"PUT" and length > 0 and matches
        if self.mode == "cut-gets" and method == b"GET" and matches:
            with self._cuts_lock:
                if self.cuts > 0:
                    self.cuts -= 1
                    cut.set()
        if self.mode == "endless" and method == b"GET" and matches:
            endless.set()
        with self._counting:
            self.requests += 1
            self._asked[upstream] = (method.decode(), path.decode())  # before it is sent: then answered
        upstream.sendall(b"\r\n".join([first, *headers]) + b"\r\n\r\n")
        remaining = length
        while remaining > 0:
            if not body:
                body = client.recv(65536)
                if not body:
                    return
            part, body = body[:remaining], body[remaining:]
            if flip:
                part, flip = bytes([part[0] ^ 0x01]) + part[1:], False
                self.corrupted += 1
            upstream.sendall(part)
            remaining -= len(part)

    def _responses(
        self, upstream: socket.socket, client: socket.socket, cut: threading.Event, endless: threading.Event
    ) -> None:
        sent = 0
        try:
            chunk = upstream.recv(65536)  # the response starts after the request was read: events are set
            if endless.is_set():
                self._endless(upstream, client, chunk)
                return
            while chunk:
                if cut.is_set() and sent + len(chunk) > 65536:
                    client.sendall(chunk[: max(0, 65536 - sent)])
                    break  # closing both ends mid-body, as a dropped connection would
                if self.mode == "ignore-preconditions" and chunk.startswith(b"HTTP/1.1 412 "):
                    # What a server without conditional writes answers: a plain success, no body.
                    client.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    break
                client.sendall(chunk)
                sent += len(chunk)
                chunk = upstream.recv(65536)
        except OSError:
            pass
        finally:
            upstream.close()
            client.close()
            self._answered(upstream, sent)

    def _answered(self, upstream: socket.socket, sent: int) -> None:
        with self._counting:
            method, path = self._asked.pop(upstream, ("", ""))
            self.bytes_down += sent
            self.exchanges.append((method, path, sent))

    def _endless(self, upstream: socket.socket, client: socket.socket, data: bytes) -> None:
        """Forward one response without its Content-Length, then keep the body going (a 2xx only)."""
        while b"\r\n\r\n" not in data:
            chunk = upstream.recv(65536)
            if not chunk:
                return
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        first, *headers = head.split(b"\r\n")
        if not first.split(b" ")[1].startswith(b"2"):
            client.sendall(data)
            while chunk := upstream.recv(65536):
                client.sendall(chunk)
            return
        headers = [h for h in headers if not h.lower().startswith(b"content-length:")]
        client.sendall(b"\r\n".join([first, *headers]) + b"\r\n\r\n" + body)
        while chunk := upstream.recv(65536):
            client.sendall(chunk)
        filler = bytes(65536)
        while self.extra_sent < self.endless_cap:  # until the client hangs up: sendall raises
            client.sendall(filler)
            with self._cuts_lock:
                self.extra_sent += len(filler)

    def _saw(self, method: bytes, path: bytes, headers: Sequence[bytes]) -> None:
        fields = dict(h.decode(errors="replace").split(":", 1) for h in headers if b":" in h)
        with self._cuts_lock:
            self.seen_at.append(time.monotonic())
            self.seen.append(
                (
                    method.decode(),
                    path.decode(errors="replace"),
                    {k.strip().lower(): v.strip() for k, v in fields.items()},
                )
            )

    def _misbehave(self, client: socket.socket) -> None:
        """One exchange in the modes of MISBEHAVING, request and response in this thread."""
        upstream = None
        try:
            head, body = _head(client)
            if not head:
                return
            first, *headers = head.split(b"\r\n")
            method, path = first.split(b" ")[:2]
            self._saw(method, path, headers)
            matches = any(p in path for p in self.paths)
            if (self.mode == "slowdown" and matches and self._slow_down(method, path)) or (
                self.mode == "limit" and not self._admit(method, path)
            ):
                client.sendall(SLOWDOWN)
                return
            upstream = socket.create_connection(self.upstream, timeout=30)
            headers = [h for h in headers if not h.lower().startswith(b"connection:")] + [b"Connection: close"]
            length = next((int(h.split(b":", 1)[1]) for h in headers if h.lower().startswith(b"content-length:")), 0)
            upstream.sendall(b"\r\n".join([first, *headers]) + b"\r\n\r\n" + body)
            remaining = length - len(body)
            while remaining > 0 and (chunk := client.recv(min(65536, remaining))):
                upstream.sendall(chunk)
                remaining -= len(chunk)
            self._answer(upstream, client, slow=self.mode not in ("slowdown", "limit") and method == b"GET" and matches)
        except OSError:
            pass
        finally:
            if upstream is not None:
                upstream.close()
            client.close()

    def _slow_down(self, method: bytes, path: bytes) -> bool:
        with self._cuts_lock:
            if self.slowdowns <= 0 or (self.methods and method not in self.methods):
                return False
            self.slowdowns -= 1
            self.slowed.append((method.decode(), path.decode(errors="replace")))
            return True

    def _admit(self, method: bytes, path: bytes) -> bool:
        """Whether the rate limit lets this request through now (else it is counted as slowed)."""
        with self._cuts_lock:
            now = time.monotonic()
            if self.limit is not None:
                self._tokens = min(max(1.0, self.limit), self._tokens + (now - self._filled) * self.limit)
            self._filled = now
            admitted = self.limit is None or self._tokens >= 1
            self.decided.append((now, admitted))
            if admitted:
                self._tokens -= self.limit is not None
                self.forwarded += 1
                return True
            self.slowed.append((method.decode(), path.decode(errors="replace")))
            return False

    def _answer(self, upstream: socket.socket, client: socket.socket, *, slow: bool) -> None:
        """Forward the response; if slow and a 2xx: its head, then the body trickled or stalled."""
        head, body = _head(upstream)
        status = [*head.split(b" ", 2), b""][1]  # b"" if the server answered no head
        if not slow or not status.startswith(b"2"):
            client.sendall(head + b"\r\n\r\n" + body if head else body)
            while chunk := upstream.recv(65536):
                client.sendall(chunk)
            return
        client.sendall(head + b"\r\n\r\n")
        if self.mode == "stall":
            while not self._stopped.wait(0.1):
                pass
            return
        size, every = self.trickle
        while not self._stopped.is_set():
            while len(body) < size and (chunk := upstream.recv(65536)):
                body += chunk
            if not body:
                return
            client.sendall(body[:size])
            body = body[size:]
            time.sleep(every)


def _head(sock: socket.socket) -> tuple[bytes, bytes]:
    """(a message's head, the bytes after it) read from sock; (b"", what came) if it ended first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b"", data
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    return head, rest
