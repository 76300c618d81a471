"""Publishing order, shared by every store: blobs, then bundle, then release, then tag."""

from __future__ import annotations

import getpass
import socket
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from neffbuild.bundle import BundleRecord, Release, TagEvent, TagRecord, dump
from neffbuild.errors import ConflictError, NotFoundError
from neffbuild.names import check_digest, check_tag
from neffbuild.refs import read_tag
from neffbuild.store.base import BlobSource, Store

TAG_RETRIES = 20


def publish_bundle(store: Store, record: BundleRecord, sources: Sequence[BlobSource], jobs: int) -> int:
    """Upload the bundle's missing blobs, then its record; return bytes uploaded."""
    uploaded = store.put_blobs(sources, jobs)
    missing = store.missing_blobs({f.digest for f in record.files})
    if missing:  # never write a record that points at absent bytes
        raise NotFoundError(f"bundle {record.unit_id}: {len(missing)} blobs missing after upload to {store.url}")
    store.put_doc("bundles", record.key, dump(record))
    return uploaded


def publish_release(store: Store, release: Release) -> str:
    for unit in release.units:
        if store.get_doc("bundles", unit.key) is None:
            raise NotFoundError(f"release {release.name}: bundle of {unit.unit_id} ({unit.key}) is not in {store.url}")
    store.put_locator(release.release_id, {f.digest for f in release.files})  # before the release that it serves
    store.put_doc("releases", release.release_id, dump(release))
    return release.release_id


def move_tag(store: Store, name: str, release_id: str, *, by: str | None = None) -> TagRecord:
    """Point a tag at a release by compare-and-swap, keeping its history; retry on a lost race."""
    check_tag(name)
    check_digest(release_id, "release")
    if store.get_doc("releases", release_id) is None:
        raise NotFoundError(f"release {release_id} is not in {store.url}", hint="publish or push it before tagging")
    event = TagEvent(release=release_id, at=datetime.now(UTC).isoformat(timespec="seconds"), by=by or whoami())
    for attempt in range(TAG_RETRIES):
        current = read_tag(store, name)
        history: tuple[TagEvent, ...] = ()
        if current is not None:
            old = current[0]
            if old.release == release_id:
                return old  # already there: an unchanged re-publish writes nothing
            history = old.history
        record = TagRecord(name=name, release=release_id, history=(*history, event))
        if store.swap_tag(name, dump(record), current[1] if current else None):
            return record
        time.sleep(min(0.05 * 2**attempt, 1.0))  # another publisher moved it: re-read and retry
    raise ConflictError(f"tag {name}: lost {TAG_RETRIES} compare-and-swap races", hint="retry the publish")


def whoami() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
