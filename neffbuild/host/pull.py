"""Materialise a release into a cache dir: only missing files move, every byte is verified.

Each file lands through materialize.write_verified (a temp file, hashed while written, then named),
so a crash or a bad object never leaves half a file: each path holds its old bytes, its new bytes
or (killed as it replaced them) nothing, and where the filesystem has unnamed files (O_TMPFILE)
no temp name ever appears beside them (tests/host/test_pull_faults.py kills pulls to check). A small state file
remembers (size, mtime) of what we wrote, so a complete cache makes pull a no-op without
re-reading gigabytes of NEFFs; a no-op pull writes nothing at all (a full disk does not fail it).

Nothing below the cache dir is reached through a symlink (materialize's module docstring says
how): not the files, not their directories, not the state dir and its lock. A file that is a
link is never "present"; pull replaces it with the verified file.

A power cut, and what the host sees after it, by the step a pull was at (the state file is the
commit point: it vouches only for bytes already flushed, so "the next pull" below repairs all):

1. Resolving and checking (release, host, room, links): nothing was written; the previous
   install and its state are as they were.
2. Files landing (each unnamed or `*.incomplete` until verified, then linked or renamed into
   place; no flush per file): a landed file may come back whole, empty, absent or, where it
   replaced an older file, as the older one; an unfinished one leaves nothing (a named temp file
   at worst, removed by the next pull). The state is still the previous pull's, which vouches
   for none of these new files (their mtimes differ), so the next pull re-hashes them and
   fetches again any that is wrong.
3. The flush (one syncfs for the filesystem): as in 2 until it returns. If it fails, pull exits
   10 and writes no state.
4. The state file (temp file, fsync, rename, fsync of its directory): either the previous state
   or the new one, never a mix; both vouch only for flushed files. Its (size, mtime) check
   trusts the disk after that: `--verify full` rehashes everything.
5. The env file (--env-file, written the same way, last): the previous one or the new one; a
   server started from the previous one is the reason boot runs pull first.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffbuild import retry
from neffbuild.documents.refs import ResolvedRelease
from neffbuild.errors import DiskError, EnvironmentMismatch, NotFoundError, StateCorrupt
from neffbuild.host.bundleunits import release_units
from neffbuild.host.cachedir import CacheDir, find_target
from neffbuild.host.exports import env_file_text, exports_for, serving_dirs, serving_env, write_env_file
from neffbuild.host.landing import land_missing, make_serving_dirs
from neffbuild.host.pullplan import (
    VERIFY_MODES,
    NotANoop,
    PullOptions,
    installed_record,
    missing_that_fits,
    resolved_with_state,
)
from neffbuild.host.scan import state_recorded
from neffbuild.host.state import CacheState, Installed
from neffbuild.retry.scope import Counts
from neffbuild.store.base import Store

if TYPE_CHECKING:  # host/trust.py is imported only where trusted keys are given
    from neffbuild.host.trust import Verified

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullReport:
    """What a pull did: what the command shows of it."""

    release_id: str
    tag: str | None
    cache_dir: Path
    files_total: int
    files_fetched: int
    bytes_fetched: int
    bytes_total: int
    seconds: float
    exports: Mapping[str, str]
    host_checked: bool = False  # the release was compared with this host before anything moved
    host_warnings: tuple[str, ...] = ()  # informational differences: our key differs, kernels do not
    stale: bool = False  # the store was unreachable: this is the release installed before (--allow-stale)
    stale_reason: str | None = None  # the store error that made it stale
    installed_at: str | None = None  # when a stale release was installed
    files_rehashed: int = 0  # installed files read back and hashed (all of them with verify="full")
    files_repaired: int = 0  # files fetched again because the cache held wrong bytes at their path
    allowed: tuple[str, ...] = ()  # the names this host allowed beyond its backend's (host_allow)
    state_replaced: str | None = (
        None  # why the state file found was corrupt (it was read as nothing known, and rewritten)
    )
    # What the store put this pull through (retry.scope.Counts): tries after a request's first, answers
    # that throttled it (503 SlowDown, 429), seconds its requests waited (backoff and pacing,
    # summed over parallel requests), the rate it was paced down to (None: never throttled), and
    # the waiting split: in the pacer, in backoff, and the seconds its requests were in flight.
    retries: int = 0
    throttled: int = 0
    waited_s: float = 0.0
    paced_to: float | None = None
    paced_s: float = 0.0
    backoff_s: float = 0.0
    in_flight_s: float = 0.0
    signed_by: str | None = None  # with trusted keys: the key whose release signature verified
    tag_signed_by: str | None = None  # ... and the tag statement's (None: pinned by id)
    tag_version: int | None = None
    tag_expires: str | None = None

    def with_counts(self, counts: Counts) -> PullReport:
        return replace(
            self, retries=counts.retries, throttled=counts.throttled, waited_s=counts.waited_s, paced_to=counts.paced_to,
            paced_s=counts.paced_s, backoff_s=counts.backoff_s, in_flight_s=counts.in_flight_s,
        )  # fmt: skip  # arguments packed by meaning, not one a line


def release_exports(resolved: ResolvedRelease, cache_dir: Path, allow_env: Collection[str] = ()) -> dict[str, str]:
    """What a serving process exports for this release (see neffbuild.host.exports for what may be)."""
    return exports_for(resolved.release, cache_dir, resolved.where, allow_env)


def installed_exports(
    cache_dir: Path,
    ref: str | None = None,
    *,
    open_store: Callable[[], Store] | None = None,
    allow_env: Collection[str] = (),
    env_file: Path | None = None,
) -> dict[str, str]:
    """The exports for the release installed in cache_dir (`neffbuild env`); written to env_file too.

    They come from the cache dir's state, with no store round trip: a tag that moved since the
    pull must not hand out another release's settings. REF, if given, must be what is installed
    (its tag or id; another tag is resolved in the store to compare ids). Only a cache dir with
    no recorded release (never pulled, or by a neffbuild before state version 2) resolves REF in
    the store as before, and even then refuses a release other than the one it recorded.
    """
    with CacheDir.opened(cache_dir) as cache:
        state = cache.state()
    cache_dir = cache.path
    target = find_target(state, cache_dir, ref, open_store, with_units=False)
    if state.release_id not in (None, target.release_id):
        raise NotFoundError(
            f"{ref} is release {target.release_id}, but {cache_dir} holds release {state.release_id}",
            hint=f"pull {ref} first, or run `neffbuild env --cache-dir {cache_dir}` for what it holds",
        )
    # The host's allow, now: what the state says was exported is no permission.
    exports = exports_for(target.release, cache_dir, target.source, allow_env)
    if env_file is not None:
        write_env_file(env_file, env_file_text(exports))
    return exports


def pull(
    store: Store, ref: str | None, cache_dir: Path | CacheDir, options: PullOptions | None = None, **changes: Any
) -> PullReport:
    """Bring the release's files into cache_dir (a path, or the caller's open CacheDir); with
    env_file, write the exports there last.
    options: a PullOptions, its fields replaced by changes (`pull(store, ref, dir, verify="full")`).

    Everything that can refuse (the release, its exports, this host, room on the disk, a link in
    the cache dir) is checked before anything is written; a cache that is complete is only read.
    With host_env (the environment the server will run in, before the release's exports), the
    host is compared with every unit's bundle first: a breaking difference is EnvironmentMismatch.
    Another pull into cache_dir holding its lock for lock_timeout seconds is ConflictError.

    timeout (seconds) is a wall-clock deadline on the whole pull (neffbuild/retry/):
    every store request's socket timeouts end at it, a response still streaming is cut when it
    passes (a stalled or trickling server too), no retry starts after it, and it is checked
    between phases: past it, DeadlineExceeded (a StoreError, exit 3) naming the store and the
    step. It also caps the wait for another pull's lock (ConflictError).

    verify="fast" (default) takes a file the state recorded with the same (size, mtime) as
    intact: bytes changed in place with the mtime put back go unnoticed. verify="full" rehashes
    every installed file (in parallel) and fetches again, atomically, any that differ.

    direct_writes: land files of materialize.DIRECT_MIN bytes or more with O_DIRECT (bypassing
    the page cache; see DIRECT_MIN for the trade).

    policy: how requests are retried and paced (retry.Policy; default: the current operation's,
    else retry.DEFAULT). The pull is one retry.Operation: its requests share one adaptive rate,
    the report counts what the store put them through, and the first request to fail for good
    stops the others.

    trust: with trusted keys, REF's tag statement and the release's signature are checked before
    anything is written (TrustError, exit 16, naming what failed), each file's BLAKE3 while it
    lands; the tag's statement version is recorded in the state with the files, so a later pull
    refuses a lower one. trust.pin (`--release ID`) serves that signed release and reads no tag
    (ref is then only a label, and may be None).
    """
    o = replace(options or PullOptions(), **changes)
    if o.verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, not {o.verify!r}")
    label = ref or (o.trust.pin if o.trust else None) or "?"
    with (
        retry.operation(o.policy, f"pulling {label}") as op,
        retry.bounded(o.timeout, f"pulling {label}"),
        CacheDir.held(cache_dir) as cache,  # opened, not made: a refused pull leaves no trace
    ):
        started = time.perf_counter()
        deadline = retry.current()
        retry.doing(f"resolving {label}")
        with _no_collection():
            resolved, verified, old = resolved_with_state(store, ref, cache.read_state_data(), o.trust)
        if o.noop_only and (old.installed is None or old.installed.release_id != resolved.release_id):
            raise NotANoop  # another release: its bundles are read once, by the full pull
        accepted = verified.accepted(old.accepted) if verified else old.accepted
        expires = verified.expires(old.expires) if verified else old.expires
        retry.check(store.url)
        exports = release_exports(resolved, cache.path, o.allow_env)
        env_text = env_file_text(exports) if o.env_file is not None else ""
        retry.doing(f"reading the bundles of release {resolved.release_id}")
        installed = installed_record(store, resolved, exports, old, o.jobs, verified, fresh=o.verify == "full")
        retry.check(store.url)
        lock_timeout = o.lock_timeout
        if deadline is not None:
            lock_timeout = deadline.left() if lock_timeout is None else min(lock_timeout, deadline.left())
        o = replace(o, lock_timeout=lock_timeout)
        retry.doing("checking the cache dir")
        installed, warnings = _host_checked(store, resolved, installed, old, o, exports)
        with _no_collection():
            scan, missing = missing_that_fits(cache, installed, old.files, o)
        to_do = (
            bool(missing)
            or not state_recorded(old, installed, scan)
            or (accepted, expires) != (old.accepted, old.expires)
        )
        if o.noop_only and (to_do or not cache.exists):
            raise NotANoop
        cache.make()
        if to_do:
            retry.check(store.url)
            files = len(installed.release.files)
            retry.doing(f"fetching {len(missing)} of {files} files ({sum(f.size for f in missing)} bytes)")
            log.info("%s: release %s, fetching %d of %d files", label, resolved.release_id, len(missing), files)
            with _repairing(old, cache.state_path):
                missing = land_missing(store, resolved, cache, scan, installed, o, (accepted, expires))
        else:
            log.info("%s: release %s already complete in %s", label, resolved.release_id, cache.path)
        make_serving_dirs(cache.path, serving_dirs(resolved.release.backend))
        if o.env_file is not None:
            write_env_file(o.env_file, env_text)
        return PullReport(
            release_id=resolved.release_id,
            tag=resolved.tag,
            cache_dir=cache.path,
            files_total=len(resolved.release.files),
            files_fetched=len(missing),
            bytes_fetched=sum(f.size for f in missing),
            bytes_total=resolved.release.total_size,
            seconds=time.perf_counter() - started,
            exports=exports,
            host_checked=o.host_env is not None,
            host_warnings=warnings,
            files_rehashed=scan.hashed,
            files_repaired=sum(f.path in scan.damaged for f in missing),
            allowed=tuple(o.allow_env),
            state_replaced=old.problem,
            **_signed(verified),
        ).with_counts(op.counts())


@contextmanager
def _no_collection() -> Iterator[None]:
    """Decoding the state and the release and scanning the files build tens of thousands of
    objects and no cycle: collections during them would scan all of them for nothing. Collection
    resumes after, as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _signed(verified: Verified | None) -> dict[str, Any]:
    """What the report says of the signatures checked (nothing without trusted keys)."""
    if verified is None:
        return {}
    tag = verified.tag
    return {
        "signed_by": verified.signer,
        "tag_signed_by": verified.tag_signer,
        "tag_version": tag.version if tag else None,
        "tag_expires": tag.expires.isoformat() if tag else None,
    }


@contextmanager
def _repairing(old: CacheState, shown: Path) -> Iterator[None]:
    """A corrupt state is read as nothing known and rewritten; where the cache dir cannot be
    written (a read-only mount), say that the state is what is wrong, not only the disk."""
    try:
        yield
    except DiskError as exc:
        if old.problem is None:
            raise
        raise StateCorrupt(
            f"{shown}: {old.problem}; it cannot be rewritten: {exc.message}",
            hint="pull into this dir where it is writable (every file is re-verified), or remove the state file there",
        ) from None


def preflight(installed: Installed, serving: Mapping[str, str]) -> tuple[str, ...]:
    """Compare this host, as the server will run (serving), with each unit's bundle: breaking
    differences refuse the pull (before any byte moves); informational ones are returned."""
    if not installed.units:
        return ()
    from neffbuild.host.hostcheck import check_host

    report = check_host(installed.units, serving)
    if report.breaking:
        units = sum(u.breaking for u in report.units)
        raise EnvironmentMismatch(
            f"{units} of {len(report.units)} units of {installed.release.name} would not hit on this host: "
            + "; ".join(d.line() for d in report.breaking),
            hint="serve it where the build's environment is (or rebuild it here); `neffbuild status` shows each unit; --no-host-check pulls anyway",
        )
    return tuple(d.line() for d in report.informational)


def _host_checked(
    store: Store,
    resolved: ResolvedRelease,
    installed: Installed,
    old: CacheState,
    o: PullOptions,
    exports: Mapping[str, str],
) -> tuple[Installed, tuple[str, ...]]:
    """preflight; where it refuses units the state supplied, they are read again from the store's
    bundles first. Nothing binds a state's unit fingerprints to their keys (a bundle's key is not
    always recomputable from its parts), so an edited fingerprint would otherwise refuse every pull
    for good; the store's bundles are what the release's keys name."""
    if o.host_env is None:
        return installed, ()
    serving = serving_env(o.host_env, exports)
    try:
        return installed, preflight(installed, serving)
    except EnvironmentMismatch:
        if old.installed is None or installed.units is not old.installed.units:
            raise
    log.warning("%s: the state's unit fingerprints refuse this host; reading them from the bundles", resolved.where)
    installed = replace(installed, units=release_units(store, resolved, o.jobs))
    return installed, preflight(installed, serving)
