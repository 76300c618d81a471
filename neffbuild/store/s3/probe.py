"""Does the server honour conditional writes? Checked once per store, before its first write.

Atomicity on S3 rests on them: immutable objects are written with `If-None-Match: *` and tags are
swapped with `If-Match: <ETag>`. A server that ignores these would silently lose tag updates, so
a store refuses to write to one, unless NEFFBUILD_S3_ALLOW_UNCONDITIONAL=1 says only one
publisher ever writes there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from neffbuild.errors import StoreError
from neffbuild.store.base import MARKER, MARKER_MAX

ALLOW_UNCONDITIONAL_ENV = "NEFFBUILD_S3_ALLOW_UNCONDITIONAL"
Put = Callable[..., bool]  # put(rel, body, **condition): False if the condition did not hold


class ConditionalProbe:
    def __init__(
        self, url: str, get: Callable[[str, int], bytes | None], put: Put, *, allow_unconditional: bool
    ) -> None:
        self.url = url
        self.allow_unconditional = allow_unconditional
        self._get = get  # get(key, limit): an object's bytes, or None
        self._put = put
        self._lock = threading.Lock()
        self._probed = False

    def ensure(self) -> None:
        """Probe unless done: both probes rewrite the store marker with its own bytes, which is
        harmless on a server that ignores the condition, so they leave nothing behind."""
        with self._lock:
            if self._probed:
                return
            marker = self._get(MARKER, MARKER_MAX) or b""
            try:
                honoured = not self._put(MARKER, marker, IfNoneMatch="*") and not self._put(
                    MARKER, marker, IfMatch='"0"'
                )
            except StoreError as exc:  # some servers refuse the headers outright
                if exc.message.startswith("access denied"):  # the first write of a publish: say which
                    raise StoreError(
                        f"{self.url}: this identity may not write to the store ({exc.message})",
                        hint="publishing (build, release, push, tag) needs CI's writer credentials; "
                        "serving hosts pull with a read-only identity (docs/security.md)",
                    ) from None
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
