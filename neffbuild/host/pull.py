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
import os
import stat
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffbuild import retry
from neffbuild.documents.records import FileEntry, Release, trusted_release
from neffbuild.documents.refs import ResolvedRelease, resolve
from neffbuild.errors import DiskError, EnvironmentMismatch, IntegrityError, NotFoundError, StateCorrupt
from neffbuild.fs.confined import (
    Beneath,
    BlobTarget,
    Hashed,
    disk_error,
    sync_filesystem,
)
from neffbuild.fs.room import require_room, room_for
from neffbuild.host.cachedir import CacheDir, Held
from neffbuild.host.exports import env_file_text, exports_for, serving_dirs, serving_env, write_env_file
from neffbuild.host.state import (
    CacheState,
    Installed,
    Vouched,
    encode_state,
    find_target,
    installed_unit,
    parse_state,
    release_in,
    release_units,
)
from neffbuild.names import STATE_DIR, is_temp_name
from neffbuild.pids import alive
from neffbuild.retry.scope import Counts
from neffbuild.store.base import Store

if TYPE_CHECKING:  # host/trust.py is imported only where trusted keys are given
    from neffbuild.host.trust import Trust, Verified

HASH_RUN = 8 << 20  # bytes a verify thread reads per task: small files are not worth a hand-off each
# Files this large on average are hashed by several threads (their reads and hashes run without
# the GIL). Measured on 2 cores: 10,000 files of 34 KiB, 0.145 s in one thread, 0.17 s in two;
# with BLAKE3 beside XXH3 (which drops the GIL even on 34 KiB), 0.40 s and 0.41 s (load 3.4).
HASH_THREADED_MIN = 1 << 20
LOCK_TIMEOUT_S = 300.0  # a pull waiting longer for another is stuck behind a stuck one: boot should fail and say so

State = Mapping[str, tuple[int, int, str]]  # path -> (size, mtime_ns, digest) of what pull wrote
VERIFY_MODES = ("fast", "full")  # fast: trust (size, mtime) the state recorded; full: rehash every file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullReport:
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
        )  # fmt: skip


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


@dataclass(frozen=True, kw_only=True)
class PullOptions:
    """How a pull runs (each field is documented at `pull`); the CLI and ensure_cache fill it."""

    jobs: int = 16
    allow_env: tuple[str, ...] = ()
    env_file: Path | None = None
    host_env: Mapping[str, str] | None = None
    lock_timeout: float | None = LOCK_TIMEOUT_S
    timeout: float | None = None
    verify: str = "fast"
    direct_writes: bool = True
    policy: retry.Policy | None = None
    trust: Trust | None = None  # trusted keys (and a --release pin): host/trust.py says what they require


def pull(
    store: Store, ref: str | None, cache_dir: Path, options: PullOptions | None = None, **changes: Any
) -> PullReport:
    """Bring the release's files into cache_dir; with env_file, write the exports there last.
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
        CacheDir.opened(cache_dir) as cache,  # opened, not made: a refused pull leaves no trace
    ):
        started = time.perf_counter()
        deadline = retry.current()
        retry.doing(f"resolving {label}")
        with _no_collection():
            resolved, verified, old = _resolved(store, ref, cache.read_state_data(), o.trust)
        accepted = verified.accepted(old.accepted) if verified else old.accepted
        expires = verified.expires(old.expires) if verified else old.expires
        retry.check(store.url)
        exports = release_exports(resolved, cache.path, o.allow_env)
        env_text = env_file_text(exports) if o.env_file is not None else ""
        retry.doing(f"reading the bundles of release {resolved.release_id}")
        installed = _installed(store, resolved, exports, old, o.jobs, verified, fresh=o.verify == "full")
        retry.check(store.url)
        lock_timeout = o.lock_timeout
        if deadline is not None:
            lock_timeout = deadline.left() if lock_timeout is None else min(lock_timeout, deadline.left())
        o = replace(o, lock_timeout=lock_timeout)
        retry.doing("checking the cache dir")
        installed, warnings = _host_checked(store, resolved, installed, old, o, exports)
        with _no_collection():
            scan, missing = _missing_that_fits(cache, installed, old.files, o)
        cache.make()
        if missing or not _recorded(old, installed, scan) or (accepted, expires) != (old.accepted, old.expires):
            retry.check(store.url)
            files = len(installed.release.files)
            retry.doing(f"fetching {len(missing)} of {files} files ({sum(f.size for f in missing)} bytes)")
            log.info("%s: release %s, fetching %d of %d files", label, resolved.release_id, len(missing), files)
            with _repairing(old, cache.state_path):
                missing = _complete(store, resolved, cache, scan, installed, o, (accepted, expires))
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


def _resolved(
    store: Store, ref: str | None, data: bytes | CacheState, trust: Trust | None
) -> tuple[ResolvedRelease, Verified | None, CacheState]:
    """(REF's release, its check against the trusted keys, the cache dir's state from data).
    With trusted keys the release is read from the bytes that were checked, never from the
    state. Without, where the state holds the release exactly as the store serves it under REF
    (the bytes a pull parsed strictly and recorded), neither is decoded entry by entry again."""
    if trust is not None:
        from neffbuild.host.trust import verify_release

        old = data if isinstance(data, CacheState) else parse_state(data)
        verified = verify_release(store, ref, trust, old.accepted)
        return verified.resolved, verified, old
    if ref is None:
        raise ValueError("pull needs a ref unless trust pins a release")
    if isinstance(data, CacheState) or (found := release_in(data)) is None:
        old = data if isinstance(data, CacheState) else parse_state(data)
        installed = old.installed
        known = None if installed is None else (installed.release_id, lambda _: installed.release)
        return resolve(store, ref, known=known), None, old
    served: list[Release] = []  # the release decoded from the store's bytes, where they are the state's

    def as_recorded(got: bytes) -> Release | None:
        release = trusted_release(got) if got == found[1] else None
        served.extend(() if release is None else (release,))
        return release

    resolved = resolve(store, ref, known=(found[0], as_recorded))
    vouched = Vouched(found[0], found[1], resolved.release) if served and resolved.release is served[0] else None
    old = parse_state(data, vouched)
    if vouched is not None and (old.installed is None or old.installed.release is not vouched.release):
        resolved = resolve(store, ref)  # a state corrupt elsewhere vouches for nothing: the store's bytes, strictly
    return resolved, None, old


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


def _trusted(state: State, verify: str) -> State:
    """What of the state may stand in for reading the files: nothing with verify="full"."""
    return state if verify == "fast" else {}


def _missing_that_fits(
    cache: CacheDir, installed: Installed, state: State, o: PullOptions
) -> tuple[Scan, list[FileEntry]]:
    """(what the cache holds, the files to fetch), once its filesystem has room for them: else
    DiskError, with nothing written. Short of room while another pull holds the lock, whatever
    that pull is landing is not ours to fetch: wait for it (lock_timeout) and look again."""
    scan, missing, sizes = _missing(cache, installed, _trusted(state, o.verify), o.jobs)
    if missing and cache.exists and not room_for(cache.path, sizes).fits and cache.wait_for_other_pull(o.lock_timeout):
        fresh = cache.read_state()[1].files
        scan, missing, sizes = _missing(cache, installed, _trusted(fresh, o.verify), o.jobs)
    if missing:
        require_room(cache.path, sizes, f"pulling {len(missing)} files of {installed.release.name}")
    return scan, missing


def _missing(cache: CacheDir, installed: Installed, state: State, jobs: int) -> tuple[Scan, list[FileEntry], list[int]]:
    """(what the cache holds, the files to fetch, the sizes to make room for: theirs and the state file's)."""
    files = installed.release.files
    scan = _scan(cache, files, state, jobs) if cache.exists else Scan(dict.fromkeys(f.path for f in files))
    missing = [f for f in files if scan.found[f.path] is None]
    sizes = [*(f.size for f in missing), _state_size(installed)] if missing else []  # a no-op pull encodes nothing
    return scan, missing, sizes


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


def _complete(
    store: Store,
    resolved: ResolvedRelease,
    cache: CacheDir,
    scan: Scan,
    installed: Installed,
    o: PullOptions,
    trusted: tuple[Mapping[str, int], Mapping[str, str]],
) -> list[FileEntry]:
    """Fetch what is missing and record the state, under the lock; the files fetched."""
    # The lock only saves duplicate downloads when two pulls race; rename keeps each file whole anyway.
    with cache.locked(o.lock_timeout) as held:
        old_state, state = held.state()
        found = scan.found
        # Another pull may have landed some while we waited for the lock.
        missing = [f for f in resolved.release.files if found[f.path] is None]
        found.update(_scan(cache, missing, _trusted(state.files, o.verify), o.jobs).found)
        missing = [f for f in missing if found[f.path] is None]
        # Killed pulls' temp files: in the whole tree when files move, else only where a
        # state file was being written (all files in: the next pull fetches nothing).
        remove_stale_temp_files(cache.path if missing else cache.path / STATE_DIR)
        if missing:
            root = cache.path
            targets = [
                BlobTarget(
                    f.digest, f.size, root / f.path, fsync=False, root=root, direct=o.direct_writes, blake3=f.blake3
                )
                for f in missing
            ]
            try:
                store.download_blobs(targets, o.jobs, release=resolved.release_id)
            except IntegrityError as exc:
                raise _what_landed(exc, cache, missing) from None
            with cache.beneath() as tree:
                found.update({f.path: _stat(tree, f.path, root) for f in missing})
        # The tag versions accepted go in with the files: only a pull that passed every check records them.
        _save_state(held, cache.path, _state_bytes(installed, found, *trusted), old_state)
    return missing


@dataclass(frozen=True)
class Scan:
    """What the cache dir holds of a release's files."""

    found: dict[str, os.stat_result | None]  # path -> status of a file holding its bytes, else None
    hashed: int = 0  # files read back and hashed (the state did not vouch for them)
    damaged: frozenset[str] = frozenset()  # paths holding a regular file with other bytes
    recorded: State | None = None  # the state scanned, where it vouched for every file and no other


def _scan(cache: CacheDir, files: Collection[FileEntry], state: State, jobs: int) -> Scan:
    """What the cache already holds of files (only reads). One stat per file; a file of the right
    size the state does not vouch for is read and hashed, in parallel where that pays. With no
    state to vouch for anything (verify="full", a first pull), each file is opened once instead:
    its fstat stands in for the stat."""
    found: dict[str, os.stat_result | None] = {}
    damaged = set()
    absent = False
    if state:
        unsure = []
        with cache.beneath() as tree:
            for f in files:
                st = found[f.path] = _stat(tree, f.path, cache.path)
                if st is None:
                    absent = True
                    continue
                if st.st_size != f.size:
                    found[f.path] = None
                    damaged.add(f.path)
                elif state.get(f.path) != (f.size, st.st_mtime_ns, f.digest):
                    unsure.append(f)
    else:
        unsure = list(files)
    hashed = 0
    for f, look in zip(unsure, _look_all(cache, unsure, jobs), strict=True):
        found[f.path] = None
        if look is None:  # absent, a link, not a regular file
            continue
        st, digests = look
        hashed += st.st_size == f.size  # look reads a file only then
        if digests is not None and digests[0] == f.digest and digests[1] == f.blake3:
            found[f.path] = st
        else:
            damaged.add(f.path)
    # Every file found as the state recorded it, and the state holds no other: it is what this
    # pull would record (_recorded then needs no second table of 10,000 entries to compare).
    whole = bool(state) and not (absent or unsure or damaged) and len(state) == len(found)
    return Scan(found, hashed, frozenset(damaged), state if whole else None)


def _look_all(cache: CacheDir, files: list[FileEntry], jobs: int) -> list[tuple[os.stat_result, Hashed | None] | None]:
    """Beneath.look of each file, in runs of neighbouring files (their directories stay open)
    spread over up to jobs threads, each with its own Beneath."""

    def looks(run: list[FileEntry]) -> list[tuple[os.stat_result, Hashed | None] | None]:
        done: list[tuple[os.stat_result, Hashed | None] | None] = []
        with cache.beneath() as tree:
            try:
                for f in run:
                    done.append(tree.look(f.path, f.size, crypto=bool(f.blake3)))
            except OSError as exc:
                raise disk_error(exc, cache.path / run[len(done)].path) from None
        return done

    jobs = min(jobs, os.cpu_count() or 1)  # reading from the page cache and hashing is CPU work
    if jobs == 1 or sum(f.size for f in files) < HASH_THREADED_MIN * len(files):
        return looks(files)  # small files cost Python work per file, under the GIL: threads only contend for it
    runs = _runs(files, jobs)
    if len(runs) <= 1:
        return looks(files)
    with ThreadPoolExecutor(max_workers=min(jobs, len(runs)), thread_name_prefix="neffbuild-verify") as pool:
        return [d for run in pool.map(looks, runs) for d in run]


def _runs(files: list[FileEntry], jobs: int) -> list[list[FileEntry]]:
    """files cut into runs of about HASH_RUN bytes (at least one file), at most 4 per thread
    and never so small that handing one to a thread costs more than reading it."""
    per_run = max(HASH_RUN, sum(f.size for f in files) // (4 * max(jobs, 1)) + 1)
    runs: list[list[FileEntry]] = [[]]
    size = 0
    for f in files:
        if size >= per_run:
            runs.append([])
            size = 0
        runs[-1].append(f)
        size += f.size
    return [r for r in runs if r]


def make_serving_dirs(cache_dir: Path, names: Collection[str]) -> None:
    """Make the dirs the server writes even on a hit, now, while the cache dir is writable: a
    host serving it read-only mounts a writable dir over each (docs/hosts.md, read-only cache dir)."""
    for name in names:
        try:
            (cache_dir / name).mkdir(exist_ok=True)
        except OSError as exc:
            raise disk_error(exc, cache_dir / name) from None


def remove_stale_temp_files(cache_dir: Path) -> int:
    """Delete `*.incomplete` files left by pulls that were killed (their pid is gone).

    os.fwalk descends into no symlinked directory and names every file relative to its
    directory's descriptor, so a link can neither lead the walk outside nor redirect a delete.
    """
    removed = 0
    try:
        for _, _, names, dir_fd in os.fwalk(cache_dir, follow_symlinks=False):
            for name in names:
                if is_temp_name(name) and _is_stale(name) and _is_regular(name, dir_fd):
                    os.unlink(name, dir_fd=dir_fd)
                    removed += 1
    except OSError as exc:
        raise disk_error(exc, cache_dir) from None
    return removed


def _is_stale(name: str) -> bool:
    """`.<name>.<pid>.<random>.incomplete` whose pid is not running."""
    parts = name.rsplit(".", 3)
    pid = parts[1] if len(parts) == 4 else ""
    return pid.isascii() and pid.isdigit() and len(pid) <= 10 and not alive(int(pid))


def _is_regular(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _stat(tree: Beneath, rel: str, cache_dir: Path) -> os.stat_result | None:
    """rel's status if it is a regular file (a link, a directory, a FIFO... count as absent)."""
    try:
        st = tree.lstat(rel)
    except OSError as exc:
        raise disk_error(exc, cache_dir / rel) from None
    return st if st is not None and stat.S_ISREG(st.st_mode) else None


def _what_landed(exc: IntegrityError, cache: CacheDir, missing: list[FileEntry]) -> IntegrityError:
    """A corrupt blob stops the pull while others land beside it (in parallel): the hint says
    what the cache dir now holds, not that nothing was written."""
    with cache.beneath() as tree:
        landed = sum(_stat(tree, f.path, cache.path) is not None for f in missing)
    if not landed:
        return exc
    return IntegrityError(
        exc.message,
        hint=f"the store object is corrupt: rebuild or re-push the release. {landed} other of the {len(missing)} files"
        f" this pull fetched landed in {cache.path}, each verified against the release; the state is unchanged"
        " (the next pull of a good release keeps or replaces them)",
    )


def _state_bytes(
    installed: Installed,
    found: Mapping[str, os.stat_result | None],
    accepted: Mapping[str, int],
    expires: Mapping[str, str],
) -> bytes:
    return encode_state(installed, _state_files(installed, found), accepted, expires)


def _state_files(installed: Installed, found: Mapping[str, os.stat_result | None]) -> dict[str, tuple[int, int, str]]:
    files = {}
    for entry in installed.release.files:
        st = found.get(entry.path)
        if st is not None:
            files[entry.path] = (entry.size, st.st_mtime_ns, entry.digest)
    return files


def _recorded(old: CacheState, installed: Installed, scan: Scan) -> bool:
    """Whether the state file already says what this pull would write: compared as data, not
    encoded (0.2 s for a 10,000-file release); equal inputs encode to equal bytes. A scan that
    found every file as the state's table says (scan.recorded) is that table."""
    if old.version != 2 or old.installed != installed:
        return False
    return scan.recorded is old.files or old.files == _state_files(installed, scan.found)


def _state_size(installed: Installed) -> int:
    """The state file's size once every file is in (an mtime of 19 digits, as in ns today)."""
    return len(encode_state(installed, {f.path: (f.size, 1 << 62, f.digest) for f in installed.release.files}))


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


def _installed(
    store: Store,
    resolved: ResolvedRelease,
    exports: Mapping[str, str],
    old: CacheState,
    jobs: int,
    verified: Verified | None = None,
    *,
    fresh: bool = False,
) -> Installed:
    """What the state will record for this pull. The units and the install time carry over from
    the state when it already holds this release, so a no-op pull reads no bundle and writes
    nothing (fresh, as `--verify full` asks: the units are read from the bundles again); a
    verified release's units come from the bundles its check read."""
    same = old.installed if old.installed and old.installed.release_id == resolved.release_id else None
    if verified is not None:
        units = tuple(installed_unit(u, b) for u, b in zip(resolved.release.units, verified.bundles, strict=True))
    else:
        units = same.units if same and not fresh else release_units(store, resolved, jobs)
    return Installed(
        release_id=resolved.release_id,
        tag=resolved.tag or "",
        store=store.url,
        installed_at=same.installed_at if same else datetime.now(UTC).isoformat(timespec="seconds"),
        release=resolved.release,
        exports=dict(exports),
        units=units,
    )


def _save_state(held: Held, cache_dir: Path, data: bytes, old: bytes | None) -> None:
    """Replace the state file with data, unless it already holds exactly that; first flush the
    filesystem (one syncfs for all files), as the state is the commit point: it may vouch only
    for durable bytes. Also for files this pull only re-hashed: a killed pull may have landed
    them without its flush. A file lost to a power cut before the flush is not in the state, so
    the next pull re-hashes it and fetches it again."""
    if data == old:
        return
    sync_filesystem(cache_dir)
    held.write_state(data)
