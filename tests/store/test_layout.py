"""The layout layer on a raw store of nothing but the raw protocol: a dict in memory, the whole of
what a new store writes. Every Store method then works on it, with the layout's keys."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO, TypeVar

import pytest

from neffbuild.errors import NotFoundError, StoreError
from neffbuild.fs.confined import BlobTarget
from neffbuild.hashing import hash_bytes
from neffbuild.store.base import MARKER, blob_key
from neffbuild.store.layout import LayoutStore
from neffbuild.store.raw import Content, ObjectInfo
from tests.storekit import write_files

_T = TypeVar("_T")


class DictRaw:
    """A raw store in a dict: versions are counters, writes take a lock."""

    corrupt_hint = "damaged"
    missing_hint = "create it"

    def __init__(self) -> None:
        self.objects_: dict[str, tuple[bytes, int]] = {}
        self._lock = threading.Lock()

    url = "mem://"

    def where(self, key: str) -> str:
        return f"mem://{key}"

    def create(self, marker_key: str, marker: bytes) -> None:
        if self.objects_:
            raise StoreError("not empty", hint="")
        self.put_new(marker_key, marker)

    def get(self, key: str, limit: int) -> bytes | None:
        got = self.get_versioned(key, limit)
        return None if got is None else got[0]

    def get_versioned(self, key: str, limit: int) -> tuple[bytes, str] | None:
        found = self.objects_.get(key)
        return None if found is None else (found[0][: limit + 1], str(found[1]))

    def put_new(self, key: str, content: Content) -> bool:
        if not isinstance(content, bytes):
            out = io.BytesIO()
            content(out)
            content = out.getvalue()
        with self._lock:
            return self.objects_.setdefault(key, (content, 1))[0] is content

    def swap(self, key: str, data: bytes, expected: str | None) -> bool:
        with self._lock:
            current = self.objects_.get(key)
            if (None if current is None else str(current[1])) != expected:
                return False
            self.objects_[key] = (data, 1 + (current[1] if current else 0))
            return True

    def exists(self, key: str) -> bool:
        return key in self.objects_

    def open(self, key: str) -> AbstractContextManager[BinaryIO] | None:
        found = self.objects_.get(key)
        return None if found is None else io.BytesIO(found[0])

    def names(self, folder: str) -> list[str]:
        return [k[len(folder) + 1 :] for k in self.objects_ if k.startswith(f"{folder}/") and k.count("/") == 1]

    def objects(self, prefix: str) -> Iterator[ObjectInfo]:
        yield from (ObjectInfo(k, len(v[0]), 0.0) for k, v in sorted(self.objects_.items()) if k.startswith(prefix))

    def delete(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        for key in keys:
            self.objects_.pop(key, None)
        return []

    def run_all(self, tasks: Sequence[Callable[[], _T]], jobs: int) -> list[_T]:
        return [t() for t in tasks]


def test_a_raw_store_alone_makes_a_whole_store(tmp_path: Path) -> None:
    raw = DictRaw()
    with pytest.raises(StoreError, match="no neffbuild store at mem://"):
        LayoutStore(raw)
    store = LayoutStore(raw, create=True)
    [one] = write_files(tmp_path / "src", {"one.bin": 1000})
    assert store.put_blobs([one, one], jobs=2) == 1000 and store.missing_blobs({one.digest, "0" * 32}) == {"0" * 32}
    assert store.put_doc("releases", "r1", b"{}") and not store.put_doc("releases", "r1", b"other")
    assert store.swap_tag("prod", b"a", None) and not store.swap_tag("prod", b"b", None)
    assert store.read_tag("prod") == (b"a", "1") and store.swap_tag("prod", b"b", "1")
    assert set(raw.objects_) == {MARKER, blob_key(one.digest), "releases/r1.json", "tags/prod.json"}
    assert list(store.list_docs("releases")) == ["r1"] and store.get_doc("tags", "prod") == b"b"
    target = BlobTarget(one.digest, one.size, tmp_path / "out" / "one.bin")
    store.download_blobs([target], jobs=1)
    assert hash_bytes(target.dest.read_bytes()) == one.digest
    store.delete_objects([blob_key(one.digest), "releases/r1.json"])
    assert store.get_doc("releases", "r1") is None
    with pytest.raises(NotFoundError, match=f"blob {one.digest} missing from store mem://"):
        store.open_blob(one.digest)
