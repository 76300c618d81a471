"""Publishing order, shared by every store: blobs, then bundle, then release, then tag.

After each record it writes, a publish settles it against a concurrent `neffbuild gc`: it waits
until no gc holds the store's lease, then re-checks (and where it can, repairs) what the record
references. neffbuild/store/lease.py says why that means no publish ends up referencing a deleted blob.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime

from neffbuild.build.sign import sign_release
from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.records import TAG_FORMAT_SIGNED, Release, TagEvent, TagRecord, dump
from neffbuild.documents.refs import read_tag
from neffbuild.documents.signing import Signing, SigningKey, open_envelope, sign_statement, tag_claim, tag_statement
from neffbuild.errors import ConflictError, NotFoundError, TrustError
from neffbuild.hashing import blake3_bytes
from neffbuild.names import check_digest, check_tag
from neffbuild.retry import backoff
from neffbuild.store.base import Store
from neffbuild.store.blobs import BlobSource
from neffbuild.store.lease import wait_for_gc, whoami

TAG_RETRIES = 20
SETTLE_RETRIES = 5  # a gc deleting what a publish just repaired, again and again: give up

log = logging.getLogger(__name__)


def publish_bundle(store: Store, record: BundleRecord, sources: Sequence[BlobSource], jobs: int) -> int:
    """Upload the bundle's missing blobs, then its record; return bytes uploaded."""
    uploaded = store.put_blobs(sources, jobs)
    log.info("bundle %s (%s): %d files, %d bytes uploaded", record.key, record.unit_id, len(record.files), uploaded)
    missing = store.missing_blobs({f.digest for f in record.files})
    if missing:  # never write a record that points at absent bytes
        raise NotFoundError(f"bundle {record.unit_id}: {len(missing)} blobs missing after upload to {store.url}")
    store.put_doc("bundles", record.key, dump(record))
    return uploaded + _settle_bundle(store, record, sources, jobs)


def _settle_bundle(store: Store, record: BundleRecord, sources: Sequence[BlobSource], jobs: int) -> int:
    """After the record: once no gc runs, put back what one deleted meanwhile; bytes uploaded."""
    digests = {f.digest for f in record.files}
    uploaded = 0
    for _ in range(SETTLE_RETRIES):
        wait_for_gc(store)
        missing = store.missing_blobs(digests)
        if store.get_doc("bundles", record.key) is None:  # only a gc run with --grace 0 deletes one in flight
            missing.add("")
        if not missing:
            return uploaded
        uploaded += store.put_blobs([s for s in sources if s.digest in missing], jobs)
        store.put_doc("bundles", record.key, dump(record))
    raise ConflictError(
        f"bundle {record.unit_id}: a gc kept deleting its blobs from {store.url}",
        hint="retry the publish once gc is done",
    )


def publish_release(store: Store, release: Release) -> str:
    for unit in release.units:
        if store.get_doc("bundles", unit.key) is None:
            raise NotFoundError(f"release {release.name}: bundle of {unit.unit_id} ({unit.key}) is not in {store.url}")
    digests = {f.digest for f in release.files}
    for _ in range(SETTLE_RETRIES):
        store.put_locator(release.release_id, digests)  # before the release that it serves
        store.put_doc("releases", release.release_id, dump(release))
        wait_for_gc(store)  # then check that no gc took what the release reuses (store/lease.py)
        if store.get_doc("releases", release.release_id) is not None:
            break
    gone = [u.unit_id for u in release.units if store.get_doc("bundles", u.key) is None]
    missing = store.missing_blobs(digests)
    if gone or missing:
        what = f"the bundles of {', '.join(gone[:3])}" if gone else f"{len(missing)} blobs"
        raise ConflictError(
            f"release {release.name}: a gc deleted {what} it reuses from {store.url} while it was published",
            hint="run the build (or push) again: it rebuilds or re-uploads what is gone",
        )
    return release.release_id


def move_tag(
    store: Store, name: str, release_id: str, *, by: str | None = None, signing: Signing | None = None
) -> TagRecord:
    """Point a tag at a release by compare-and-swap, keeping its history; retry on a lost race.
    With signing, the release is signed too and the tag carries a signed statement (tag,
    release, a version above the last one, the expiry): written even if the tag already points
    there, as a re-sign renews the expiry."""
    check_tag(name)
    check_digest(release_id, "release")
    release_data = store.get_doc("releases", release_id)
    if release_data is None:
        raise NotFoundError(f"release {release_id} is not in {store.url}", hint="publish or push it before tagging")
    if signing is not None:
        sign_release(store, release_id, signing.key)
    event = TagEvent(release=release_id, at=datetime.now(UTC).isoformat(timespec="seconds"), by=by or whoami())
    based = 0  # how often our event was in the history the last swap extended
    for attempt in range(TAG_RETRIES):
        current = read_tag(store, name)
        history: tuple[TagEvent, ...] = ()
        if current is not None:
            old = current[0]
            # A swap reported lost that held after all (swap_tag errs that way only): our event
            # is in the history once more than in the one we extended. Counted, not looked up: a
            # publisher moving back and forth within a second repeats an earlier event exactly.
            if attempt and old.history.count(event) > based:
                return old
            if old.release == release_id and signing is None:
                return old  # already there: an unchanged re-publish writes nothing
            history = old.history
        based = history.count(event)
        record = TagRecord(name=name, release=release_id, history=(*history, event))
        if signing is not None:
            version = next_version(current[0] if current else None, name, signing.key, datetime.now(UTC))
            statement = tag_statement(name, release_id, blake3_bytes(release_data), version, signing.expires)
            record = replace(record, format=TAG_FORMAT_SIGNED, statement=sign_statement(statement, signing.key))
        if store.swap_tag(name, dump(record), current[1] if current else None):
            log.info("tag %s -> %s (was %s)", name, release_id, current[0].release if current else "absent")
            return _settle_tag(store, record, current)
        # Another publisher moved it: re-read and retry. A lost race, not a failing store (the
        # store's own retries are below swap_tag), but the same jitter keeps racers apart.
        time.sleep(backoff(attempt, base=0.05, cap=1.0))
    raise ConflictError(f"tag {name}: lost {TAG_RETRIES} compare-and-swap races", hint="retry the publish")


def next_version(old: TagRecord | None, name: str, key: SigningKey, now: datetime) -> int:
    """The next signed tag statement's version: above the current statement's if that verifies
    with this key and names this tag, and never below the clock (milliseconds since the epoch:
    finer than any two signings of one tag, so a chain of them does not run ahead of it).

    The tag document itself is not evidence: whoever can write tags can reset its history or
    plant any version (Infinity included), so nothing unverified counts. The clock floor keeps a
    version signed after such a reset (or after a key rotation, when the old statement no longer
    verifies) above every version hosts accepted before (docs/security.md, "Policy, tag versions")."""
    floor = int(now.timestamp() * 1000)
    if old is None or old.statement is None:
        return floor
    try:
        statement, _ = open_envelope(old.statement, [key.public], f"tag {name} (its current statement)")
        claim = tag_claim(statement, f"tag {name} (its current statement)")
    except TrustError as exc:
        log.warning("%s: not counted for the next version", exc.message)
        return floor
    return max(claim.version + 1, floor) if claim.tag == name else floor


def _settle_tag(store: Store, record: TagRecord, before: tuple[TagRecord, str] | None) -> TagRecord:
    """Once no gc runs: the release must still be there (a gc that began before the move may have
    taken an old, untagged one); if not, the tag moves back, unless it moved on since."""
    wait_for_gc(store)
    if store.get_doc("releases", record.release) is not None:
        return record
    now = store.read_tag(record.name)
    if before is not None and now is not None and now[0] == dump(record):
        store.swap_tag(record.name, dump(before[0]), now[1])
    raise ConflictError(
        f"tag {record.name}: a gc deleted release {record.release} while the tag moved to it",
        hint="publish the release again (rebuild or push it), then move the tag",
    )
