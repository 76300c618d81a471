"""Helpers for the store tests: files to publish, a synthetic release, and out-of-band views of a
store's backing medium (its keys; corrupting an object) that the tests use to check the layout."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from neffbuild.backends import get_backend
from neffbuild.backends.base import Scope
from neffbuild.build.publish import move_tag, publish_bundle, publish_release
from neffbuild.documents.bundles import BundleRecord, Timings
from neffbuild.documents.records import FileEntry, Release, ReleaseUnit
from neffbuild.hashing import hash_bytes, hash_file
from neffbuild.host.hostcheck import host_fingerprint
from neffbuild.store.base import Store, blob_key
from neffbuild.store.blobs import BlobSource
from tests.s3server import ACCESS_KEY, SECRET_KEY


def source_of(path: Path) -> BlobSource:
    """A file as a blob source, with both digests (releases require BLAKE3 since format 2)."""
    d = hash_file(path)
    return BlobSource(d.hex, d.size, path, d.blake3)


def write_files(root: Path, sizes: dict[str, int], *, seed: int = 0) -> list[BlobSource]:
    """Files of pseudo-random bytes under root, as blob sources (same seed, same bytes)."""
    rng = random.Random(seed)
    sources = []
    for rel, size in sizes.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
        sources.append(source_of(path))
    return sources


def small_and_large(root: Path, *, small: int = 40, seed: int = 0) -> list[BlobSource]:
    """Many small files (packed on S3), one empty, one large (a loose object, fetched in ranges)."""
    sizes = {f"small/{i:03d}.bin": 1 + (i * 7919) % 70_000 for i in range(small)}
    sizes["empty.bin"] = 0
    sizes["large.bin"] = 20 << 20
    return write_files(root, sizes, seed=seed)


def this_host(unit: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    """The fingerprint a build of unit on this host records, for a release that exports env: a
    `pull` here (which compares the two first) then finds nothing that differs."""
    scope = Scope.of_unit(unit)
    return host_fingerprint(get_backend("inductor"), scope, {**os.environ, **env, **scope.env})


def publish_release_of(
    store: Store, root: Path, sources: list[BlobSource], *, name: str = "rel", tag: str | None = None, env: dict[str, str] | None = None
) -> str:  # fmt: skip
    """Publish sources as one bundle and one release (as `neffbuild build` would); its id."""
    files = tuple(
        sorted(
            (
                FileEntry(path=s.path.relative_to(root).as_posix(), size=s.size, digest=s.digest, blake3=s.blake3)
                for s in sources
            ),
            key=lambda f: f.path,
        )
    )
    key = hash_bytes(repr((name, files)).encode())
    fingerprint = this_host({"name": name}, {})
    record = BundleRecord(
        key=key, unit_id=f"{name}/unit", unit={"name": name}, backend="inductor", fingerprint=fingerprint,
        files=files, counters={}, timings=Timings(), created_at="2025-01-01T00:00:00+00:00", neffbuild_version="test",
    )  # fmt: skip
    publish_bundle(store, record, sources, jobs=8)
    release = Release(
        name=name, manifest_digest="0" * 32, backend="inductor", cache_env="TORCHINDUCTOR_CACHE_DIR", env=env or {},
        fingerprint=fingerprint, units=(ReleaseUnit(unit_id=record.unit_id, key=key),), files=files,
    )  # fmt: skip
    release_id = publish_release(store, release)
    if tag:
        move_tag(store, tag, release_id)
    return release_id


def s3_client(env: dict[str, str]) -> Any:
    import boto3

    return boto3.client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env.get("AWS_ACCESS_KEY_ID", ACCESS_KEY),
        aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY", SECRET_KEY), region_name=env["AWS_REGION"],
    )  # fmt: skip


def keys_of(store: Store, env: dict[str, str] | None = None) -> set[str]:
    """Every object of the store, relative to its root (local: files other than locks, and other than
    a tag's versions under tags/.<name>.v/: the tag's object is its mirror tags/<name>.json)."""
    if store.url.startswith("s3://"):
        bucket, _, prefix = store.url.removeprefix("s3://").partition("/")
        prefix = f"{prefix}/" if prefix else ""
        pages = s3_client(env or {}).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {o["Key"][len(prefix) :] for page in pages for o in page.get("Contents", ())}
    root = Path(store.url)
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and not p.relative_to(root).as_posix().startswith(("locks/", "tags/."))
    }


def corrupt_blob(store: Store, digest: str, env: dict[str, str] | None = None) -> None:
    """Flip one byte of a stored blob out of band, keeping its size (bit rot, a bad overwrite)."""
    if not store.url.startswith("s3://"):
        path = Path(store.url) / blob_key(digest)
        os.chmod(path, 0o644)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        return
    from neffbuild.store import packs

    client = s3_client(env or {})
    bucket, _, prefix = store.url.removeprefix("s3://").partition("/")
    prefix = f"{prefix}/" if prefix else ""
    key, offset, size = prefix + blob_key(digest), 0, None
    store.catalog.refresh()  # type: ignore[attr-defined]  # find where the S3 store keeps it
    where = store.catalog.where(digest)  # type: ignore[attr-defined]
    if where is not None:
        index, entry = where
        key, offset, size = prefix + packs.pack_key(index.pack_id), entry.offset, entry.size
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[offset + (size if size is not None else len(data) - offset) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
