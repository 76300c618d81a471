"""A store in a local (or network-mounted) directory: the embedded default.

Immutable objects land by hard-linking a process-unique temp file into place, which fails if the
name exists: the local equivalent of S3's If-None-Match. Tags are swapped under a file lock with a
compare of their content digest; correctness does not rest on the lock alone (see tags below).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from neffbuild.errors import IntegrityError, NotFoundError, StoreError
from neffbuild.locks import exclusive
from neffbuild.materialize import BlobTarget, disk_error, write_verified
from neffbuild.hashing import CHUNK, copy_hashing, hash_bytes
from neffbuild.store.base import MARKER, STORE_FORMAT, BlobSource, DocKind, blob_key, doc_key

TAG_LOCK_TIMEOUT_S = 60


class LocalStore:
    def __init__(self, root: Path, *, create: bool = False) -> None:
        self.root = root.expanduser().resolve()
        marker = self.root / MARKER
        if not marker.is_file():
            if not create:
                raise StoreError(
                    f"no neffbuild store at {self.root}",
                    hint="build into it first, or pass --store / set NEFFBUILD_STORE",
                )
            if self.root.exists() and any(self.root.iterdir()):
                raise StoreError(
                    f"{self.root} is not empty and not a neffbuild store",
                    hint="choose an empty or new directory for --store",
                )
            _guard(lambda: self.root.mkdir(parents=True, exist_ok=True), self.root)
            self._write_new(MARKER, json.dumps({"format": STORE_FORMAT}).encode())
        else:
            found = json.loads(marker.read_bytes()).get("format")
            if found != STORE_FORMAT:
                raise StoreError(f"{self.root}: store format {found!r}, expected {STORE_FORMAT!r}")

    @property
    def url(self) -> str:
        return str(self.root)

    def missing_blobs(self, digests: Collection[str]) -> set[str]:
        return {d for d in digests if not (self.root / blob_key(d)).is_file()}

    def put_blob(self, digest: str, source: Path) -> int:
        target = self.root / blob_key(digest)
        if target.is_file():
            return 0
        tmp = self._tmp_path(target)
        try:
            with source.open("rb") as src, tmp.open("xb") as dst:
                got = copy_hashing(src, dst)
            if got.hex != digest:
                raise IntegrityError(f"{source}: changed while publishing (digest {got.hex}, expected {digest})")
            tmp.chmod(0o444)  # verified objects are read-only, as in dvc's object database
            self._link_new(tmp, target)
            return got.size
        except OSError as exc:
            raise disk_error(exc, target) from None
        finally:
            tmp.unlink(missing_ok=True)

    def put_blobs(self, sources: Sequence[BlobSource], jobs: int) -> int:
        wanted = self.missing_blobs({s.digest for s in sources})
        todo = list({s.digest: s for s in sources if s.digest in wanted}.values())
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return sum(pool.map(lambda s: self.put_blob(s.digest, s.path), todo))

    def download_blobs(self, targets: Sequence[BlobTarget], jobs: int) -> None:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(self._download_one, targets))

    def _download_one(self, target: BlobTarget) -> None:
        with self.open_blob(target.digest) as stream:
            write_verified(target, iter(lambda: stream.read(CHUNK), b""), origin=f"{self.url}/{blob_key(target.digest)}")

    @contextmanager
    def open_blob(self, digest: str) -> Iterator[BinaryIO]:
        try:
            stream = (self.root / blob_key(digest)).open("rb")
        except FileNotFoundError:
            raise NotFoundError(f"blob {digest} missing from store {self.url}", hint="re-push the release") from None
        with stream:
            yield stream

    def put_doc(self, kind: DocKind, name: str, data: bytes) -> bool:
        return self._write_new(doc_key(kind, name), data)

    def get_doc(self, kind: DocKind, name: str) -> bytes | None:
        try:
            return (self.root / doc_key(kind, name)).read_bytes()
        except FileNotFoundError:
            return None

    def list_docs(self, kind: DocKind) -> Iterator[str]:
        folder = self.root / kind
        if folder.is_dir():
            yield from sorted(p.stem for p in folder.glob("*.json"))

    def read_tag(self, name: str) -> tuple[bytes, str] | None:
        data = self.get_doc("tags", name)
        return None if data is None else (data, hash_bytes(data))

    def swap_tag(self, name: str, data: bytes, expected: str | None) -> bool:
        target = self.root / doc_key("tags", name)
        _guard(lambda: target.parent.mkdir(parents=True, exist_ok=True), target)
        # The lock serialises writers on one host (and on NFS where flock works); the content
        # compare below is what makes the swap conditional.
        lock_dir = self.root / "locks"
        _guard(lambda: lock_dir.mkdir(exist_ok=True), lock_dir)
        with exclusive(lock_dir / f"tag-{name}.lock", timeout=TAG_LOCK_TIMEOUT_S, what=f"tag {name}'s lock"):
            current = self.read_tag(name)
            if (current[1] if current else None) != expected:
                return False
            tmp = self._tmp_path(target)
            try:
                tmp.write_bytes(data)
                os.replace(tmp, target)
            except OSError as exc:
                raise disk_error(exc, target) from None
            finally:
                tmp.unlink(missing_ok=True)
        return True

    def _write_new(self, key: str, data: bytes) -> bool:
        target = self.root / key
        if target.exists():
            return False
        _guard(lambda: target.parent.mkdir(parents=True, exist_ok=True), target)
        tmp = self._tmp_path(target)
        try:
            tmp.write_bytes(data)
            tmp.chmod(0o444)
            return self._link_new(tmp, target)
        except OSError as exc:
            raise disk_error(exc, target) from None
        finally:
            tmp.unlink(missing_ok=True)

    def _link_new(self, tmp: Path, target: Path) -> bool:
        _guard(lambda: target.parent.mkdir(parents=True, exist_ok=True), target)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        return True

    def _tmp_path(self, target: Path) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        return target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.incomplete"


def _guard(action, path: Path) -> None:
    try:
        action()
    except OSError as exc:
        raise disk_error(exc, path) from None


