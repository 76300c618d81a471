"""Helpers for the gc and verify --store tests: releases whose files are named by their content
(one label, one blob: several releases share blobs), ageing a store, and a store that stops once at
a chosen call so that another real process can act at exactly that point."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.records import Release, parse
from neffbuild.hashing import hash_file
from neffbuild.store.base import Store
from neffbuild.store.blobs import BlobSource
from tests.storekit import publish_release_of

BIG = 9 << 20  # over packs.SMALL_BLOB: a loose object on S3


def sources_of(root: Path, files: dict[str, str]) -> list[BlobSource]:
    """path -> label; a label's bytes are the same wherever it is written (so blobs are shared)."""
    out = []
    for rel, label in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        size = BIG if label.startswith("big") else 1000 + len(label) * 37
        path.write_bytes((f"{label}|".encode() * (size // (len(label) + 1) + 1))[:size])
        d = hash_file(path)
        out.append(BlobSource(d.hex, d.size, path, d.blake3))
    return out


def publish(store: Store, work: Path, name: str, files: dict[str, str], tag: str | None = None) -> str:
    return publish_release_of(store, work / name, sources_of(work / name, files), name=name, tag=tag)


def release(store: Store, release_id: str) -> Release:
    return parse(Release, store.get_doc("releases", release_id) or b"", release_id)


def referenced(store: Store) -> set[str]:
    """Every digest any release or bundle record of the store names."""
    digests = set()
    for rid in store.list_docs("releases"):
        digests |= {f.digest for f in release(store, rid).files}
    for key in store.list_docs("bundles"):
        digests |= {f.digest for f in parse(BundleRecord, store.get_doc("bundles", key) or b"", key).files}
    return digests


def age(store: Store, seconds: float, keys: set[str] | None = None) -> None:
    """Make a local store's objects (or some of them) look written `seconds` ago."""
    root = Path(store.url)
    when = time.time() - seconds
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and (keys is None or rel in keys):
            os.utime(path, (when, when))


class Paused:
    """The real store, stopping once, on the first call of `method`, at a file barrier: it creates
    `<barrier>.reached`, then waits for `<barrier>.go` before making the call."""

    def __init__(self, store: Store, method: str, barrier: Path, kind: str | None = None) -> None:
        self._store, self._method, self._barrier, self._kind = store, method, barrier, kind
        self._stopped = False

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._store, name)
        if name != self._method or self._stopped:
            return real

        def stop_then_call(*args: Any, **kwargs: Any) -> Any:
            if not self._stopped and (self._kind is None or args[0] == self._kind):
                self._stopped = True
                Path(f"{self._barrier}.reached").touch()
                while not Path(f"{self._barrier}.go").exists():
                    time.sleep(0.01)
            return real(*args, **kwargs)

        return stop_then_call
