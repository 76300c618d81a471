"""Stale fallback (`pull --allow-stale`): a store that cannot be reached keeps the release installed.

Only an unreachable store falls back (StoreError, exit 3: missing, refused, timed out, past the
deadline). Anything that says the bytes or this host are wrong (IntegrityError, EnvironmentMismatch,
NotFoundError, DiskError, ConflictError) still fails: booting a damaged or mismatched cache is
worse than not booting. "Fully installed" is what the state file records as installed, with every
one of its files in place at the (size, mtime) pull recorded: a cheap check, no hashing, so a file
edited since the pull (its mtime moves) fails closed.
"""

from __future__ import annotations

import stat
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from neffbuild.documents.records import FileEntry
from neffbuild.errors import NeffbuildError, StateCorrupt, StoreError, TrustError
from neffbuild.fs.beneath import Beneath
from neffbuild.host.cachedir import CacheDir
from neffbuild.host.exports import env_file_text, exports_for, serving_env, write_env_file
from neffbuild.host.pull import PullOptions, PullReport, preflight, pull
from neffbuild.host.state import CacheState, Installed
from neffbuild.retry import bounded, operation
from neffbuild.store.base import Store


def pull_or_stale(
    open_store: Callable[[], Store],
    ref: str | None,
    cache_dir: Path,
    options: PullOptions,
    *,
    allow_stale: bool = False,
    allow_expired: bool = False,
) -> PullReport:
    """pull (the store opened inside, so that failing to open it counts as unreachable); with
    allow_stale, a StoreError returns a stale report of the release cache_dir holds, when it is
    REF's (its tag or id) and fully installed; otherwise the StoreError is raised as it was.
    options.timeout (seconds) bounds opening the store and the pull together (pull's deadline):
    past it is a StoreError too (DeadlineExceeded). options.policy: how requests are retried and
    paced, opening the store included (retry.Policy; default retry.DEFAULT).

    With trusted keys, a release installed from a tag boots stale only until the signed statement
    it was accepted under expires (the state records when): past it, or with no expiry recorded,
    it is a TrustError unless allow_expired. Otherwise a network attacker who keeps the store
    unreachable freezes the host on it for good (docs/security.md, "Freshness")."""
    started = time.perf_counter()
    wanted = ref or (options.trust.pin if options.trust else None)  # pull --release: the pinned id
    # One CacheDir for the pull and its fallback: the dir is resolved and opened once.
    with CacheDir.opened(cache_dir) as cache:
        with operation(options.policy, f"pulling {wanted}") as op:
            try:
                with bounded(options.timeout, f"pulling {wanted}"):
                    # The deadline and the operation are this function's: pull runs inside both.
                    return pull(open_store(), ref, cache, replace(options, timeout=None, policy=None))
            except StoreError as exc:
                counts = op.counts()
                failure = exc
        installed = fully_installed(cache, wanted) if allow_stale else None
        if installed is not None and options.trust is not None and installed.tag and not allow_expired:
            _check_fresh(installed.tag, cache.state().expires.get(installed.tag), failure)
    if installed is None:
        raise failure
    # What the state says pull exported is no permission: the exports are made again from the
    # installed release under this host's allow, as a pull would make them.
    exports = exports_for(installed.release, cache.path, str(cache.state_path), options.allow_env)
    # The host check needs no store: a mismatch is never booted, stale or not.
    host_env = options.host_env
    warnings = preflight(installed, serving_env(host_env, exports)) if host_env is not None else ()
    if options.env_file is not None:
        write_env_file(options.env_file, env_file_text(exports))
    release = installed.release
    return PullReport(
        release_id=installed.release_id, tag=installed.tag or None, cache_dir=cache.path,
        files_total=len(release.files), files_fetched=0, bytes_fetched=0, bytes_total=release.total_size,
        seconds=time.perf_counter() - started, exports=exports, host_checked=host_env is not None,
        host_warnings=warnings, stale=True, stale_reason=failure.message, installed_at=installed.installed_at,
        allowed=tuple(options.allow_env),
    ).with_counts(counts)  # fmt: skip  # arguments packed by meaning, not one a line


def _check_fresh(tag: str, expires: str | None, failure: StoreError) -> None:
    """A stale boot under trusted keys: refused once the tag's accepted statement has expired,
    or where no expiry was recorded (a pull by an earlier neffbuild, or without trusted keys)."""
    hint = "reach the store to pull a re-signed statement, or boot it anyway with --allow-expired"
    if expires is None:
        raise TrustError(
            f"store unreachable ({failure.message}), and the cache dir records no signed statement expiry for tag {tag!r}",
            hint=hint,
        )
    if datetime.fromisoformat(expires) <= datetime.now(UTC):
        raise TrustError(
            f"store unreachable ({failure.message}), and the signed statement of tag {tag!r} that the installed"
            f" release was accepted under expired at {expires}",
            hint=hint,
        )


def fully_installed(cache: CacheDir, ref: str | None = None) -> Installed | None:
    """The release the cache dir's state records as installed, if REF names it (tag or id; None:
    any) and every one of its files is a regular file at the size and mtime pull recorded."""
    if not cache.exists:
        return None
    try:
        state = cache.state()
        installed = state.installed
        if installed is None or ref not in (None, installed.release_id, installed.tag):
            return None
        with cache.beneath() as tree:
            return installed if all(_as_recorded(tree, f, state) for f in installed.release.files) else None
    except StateCorrupt:  # said as such, not hidden behind the store's error
        raise
    except (NeffbuildError, OSError):  # a link or an unreadable dir: not fully installed; the store error stands
        return None


def _as_recorded(tree: Beneath, entry: FileEntry, state: CacheState) -> bool:
    st = tree.lstat(entry.path)
    return (
        st is not None
        and stat.S_ISREG(st.st_mode)
        and state.files.get(entry.path) == (entry.size, st.st_mtime_ns, entry.digest)
    )
