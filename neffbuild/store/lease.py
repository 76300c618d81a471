"""The fence between `neffbuild gc` and publishes: gc's lease, and how a publish settles.

The hazard: a publish finds a blob present and skips uploading it; a gc that read the store
before the publish wrote its record then deletes that blob; the record now points at nothing.
No grace period alone closes this (a gc may list an old blob, then delete it hours later, after
any publish has checked it), and S3 has no "delete if still unreferenced". So:

- gc writes `gc/lease.json` (create-if-absent: one gc at a time) BEFORE it lists the store, and
  deletes it after its last delete. It stops deleting LEASE_MARGIN_S before the lease expires.
- a publish, AFTER each record it writes (bundle, release, tag), waits until no unexpired lease
  is present, then re-checks what the record references, and repairs it: a bundle re-uploads its
  missing blobs from its sources (and rewrites itself); a release rewrites its locator and itself
  and checks its bundles and blobs; a tag checks its release. What cannot be repaired (a release
  reusing a bundle that a gc deleted; a tag moved to a release a gc deleted) is a ConflictError,
  and a moved tag is moved back.

Why that suffices (stores are strongly consistent: S3 since 2020, SeaweedFS, a local disk). Take a
record R written at time w and a gc G. If G wrote its lease after w, G lists after w and sees R:
R is younger than the grace period, so G keeps everything R references. If G wrote its lease
before w and is still deleting when the publish reads the lease, the publish waits for it to
finish (or for its lease to expire, when G has stopped deleting). Either way, once the wait ends,
every gc that could have missed R is done, and the re-check finds what they deleted. The grace
period keeps young objects (blobs of a publish in flight) and young records' references, so
repairs are rare; with --grace 0 a gc may delete a record in flight, which the publish then
reports (run gc with --grace 0 only when nothing publishes).

Assumed: clocks of hosts running gc and publishes agree within LEASE_MARGIN_S, and a gc process
is not frozen for longer than that between its clock check and a delete.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from neffbuild.errors import ConflictError, IntegrityError
from neffbuild.formats import FORMATS, writes
from neffbuild.store.base import DocKind, Store, doc_key, shown

LEASE_FORMAT = writes("gc lease")
LEASE_KIND: DocKind = "gc"
LEASE_NAME = "lease"
LEASE_S = 3600.0  # a gc that needs longer stops; running it again continues
LEASE_MARGIN_S = 60.0  # gc stops deleting this long before its lease expires
WAIT_STEP_S = (0.05, 2.0)  # a waiting publish polls the lease from every 50 ms up to every 2 s


@dataclass(frozen=True, slots=True)
class Lease:
    token: str
    by: str
    started: float  # seconds since the epoch
    expires: float

    def ends_soon(self, now: float) -> bool:
        return now >= self.expires - LEASE_MARGIN_S


def lease_key() -> str:
    return doc_key(LEASE_KIND, LEASE_NAME)


def acquire(store: Store, by: str, *, lease_s: float = LEASE_S, clock: Callable[[], float] = time.time) -> Lease:
    """Take the store's gc lease; ConflictError if another gc holds it. An expired lease (its gc
    died) is broken first."""
    for _ in range(2):
        now = clock()
        lease = Lease(uuid.uuid4().hex, by, now, now + lease_s)
        if store.put_doc(LEASE_KIND, LEASE_NAME, _encode(lease)):
            return lease
        held = read_lease(store)
        if held is not None and clock() < held.expires:
            raise ConflictError(
                f"{store.url}: another gc is running (by {shown(held.by)}, lease until {_when(held.expires)})",
                hint=f"wait for it; if it died, its lease expires by itself (or delete {lease_key()} once it is surely gone)",
            )
        store.delete_objects([lease_key()])
    raise ConflictError(f"{store.url}: another gc took the lease first", hint="wait for it to finish")


def release(store: Store, lease: Lease) -> None:
    """Give the lease back, unless it is no longer ours (it expired and another gc took it)."""
    held = read_lease(store)
    if held is not None and held.token == lease.token:
        store.delete_objects([lease_key()])


def read_lease(store: Store) -> Lease | None:
    data = store.get_doc(LEASE_KIND, LEASE_NAME)
    return None if data is None else _decode(data, f"{store.url}/{lease_key()}")


def wait_for_gc(
    store: Store, *, clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep
) -> float:
    """Return once no gc holds an unexpired lease on the store; the seconds waited.

    A lease whose expiry lies further ahead than LEASE_S (a wrong clock, a forged lease) is
    waited on for LEASE_S at most, counted from when this wait first saw it.
    """
    started = clock()
    step = WAIT_STEP_S[0]
    while (held := read_lease(store)) is not None:
        now = clock()
        if now >= min(held.expires, started + LEASE_S):
            break
        sleep(step)
        step = min(step * 2, WAIT_STEP_S[1])
    return clock() - started


def _encode(lease: Lease) -> bytes:
    return json.dumps(
        {
            "format": LEASE_FORMAT,
            "token": lease.token,
            "by": lease.by,
            "started": lease.started,
            "expires": lease.expires,
        },
        sort_keys=True,
    ).encode()


def _decode(data: bytes, where: str) -> Lease:
    try:
        raw = json.loads(data)
        if raw.get("format") not in FORMATS["gc lease"].reads:  # each a publisher may meet
            raise ValueError(f"format {shown(raw.get('format'))}")
        lease = Lease(str(raw["token"]), str(raw["by"]), float(raw["started"]), float(raw["expires"]))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise IntegrityError(
            f"{where}: not a gc lease ({exc})", hint=f"delete {lease_key()} if no gc is running"
        ) from None
    return lease


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def whoami() -> str:
    """user@host: who moved a tag, who holds a lease."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def holder() -> str:
    return f"{whoami()} pid {os.getpid()}"
