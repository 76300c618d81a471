"""Stale fallback (`pull --allow-stale`): a store that cannot be reached keeps the release installed.

Only an unreachable store falls back (StoreError, exit 3: missing, refused, timed out, past the
deadline). Anything that says the bytes or this host are wrong (IntegrityError, EnvironmentMismatch,
NotFoundError, DiskError, ConflictError) still fails: booting a damaged or mismatched cache is
worse than not booting. "Fully installed" is what the state file records as installed, with every
one of its files in place at the (size, mtime) pull recorded: a cheap check, no hashing, so a file
edited since the pull (its mtime moves) fails closed.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from neffbuild.documents.records import FileEntry
from neffbuild.errors import NeffbuildError, StateCorrupt, StoreError
from neffbuild.fs.confined import Beneath
from neffbuild.host.exports import env_file_text, exports_for, write_env_file
from neffbuild.host.pull import PullReport, preflight, pull
from neffbuild.host.state import CacheState, Installed, open_existing, read_state, state_path
from neffbuild.retry import Policy, bounded, operation
from neffbuild.store.base import Store


def pull_or_stale(
    open_store: Callable[[], Store],
    ref: str,
    cache_dir: Path,
    *,
    allow_stale: bool = False,
    env_file: Path | None = None,
    host_env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    allow_env: Collection[str] = (),
    policy: Policy | None = None,
    **pull_options: object,
) -> PullReport:
    """pull (the store opened inside, so that failing to open it counts as unreachable); with
    allow_stale, a StoreError returns a stale report of the release cache_dir holds, when it is
    REF's (its tag or id) and fully installed; otherwise the StoreError is raised as it was.
    timeout (seconds) bounds opening the store and the pull together (pull's deadline): past it
    is a StoreError too (DeadlineExceeded). policy: how requests are retried and paced, opening
    the store included (retry.Policy; default retry.DEFAULT)."""
    started = time.perf_counter()
    with operation(policy, f"pulling {ref}") as op:
        try:
            with bounded(timeout, f"pulling {ref}"):
                return pull(
                    open_store(),
                    ref,
                    cache_dir,
                    env_file=env_file,
                    host_env=host_env,
                    allow_env=allow_env,
                    **pull_options,
                )  # type: ignore[arg-type]
        except StoreError as exc:
            counts = op.counts()
            failure = exc
    installed = fully_installed(cache_dir.expanduser().resolve(), ref) if allow_stale else None
    if installed is None:
        raise failure
    reason = failure.message
    # What the state says pull exported is no permission: the exports are made again from the
    # installed release under this host's allow, as a pull would make them.
    cache_dir = cache_dir.expanduser().resolve()
    exports = exports_for(installed.release, cache_dir, str(state_path(cache_dir)), allow_env)
    # The host check needs no store: a mismatch is never booted, stale or not.
    warnings = preflight(installed, {**host_env, **exports}) if host_env is not None else ()
    if env_file is not None:
        write_env_file(env_file, env_file_text(exports))
    release = installed.release
    return PullReport(
        release_id=installed.release_id, tag=installed.tag or None, cache_dir=cache_dir,
        files_total=len(release.files), files_fetched=0, bytes_fetched=0, bytes_total=release.total_size,
        seconds=time.perf_counter() - started, exports=exports, host_checked=host_env is not None,
        host_warnings=warnings, stale=True, stale_reason=reason, installed_at=installed.installed_at, allowed=tuple(allow_env),
    ).with_counts(counts)  # fmt: skip


def fully_installed(cache_dir: Path, ref: str | None = None) -> Installed | None:
    """The release cache_dir's state records as installed, if REF names it (tag or id; None: any)
    and every one of its files is a regular file at the size and mtime pull recorded."""
    root = open_existing(cache_dir)
    if root is None:
        return None
    try:
        state = read_state(root, cache_dir)[1].trusted(state_path(cache_dir))
        installed = state.installed
        if installed is None or ref not in (None, installed.release_id, installed.tag):
            return None
        with Beneath(root, cache_dir) as tree:
            return installed if all(_as_recorded(tree, f, state) for f in installed.release.files) else None
    except StateCorrupt:  # said as such, not hidden behind the store's error
        raise
    except (NeffbuildError, OSError):  # a link or an unreadable dir: not fully installed; the store error stands
        return None
    finally:
        os.close(root)


def _as_recorded(tree: Beneath, entry: FileEntry, state: CacheState) -> bool:
    st = tree.lstat(entry.path)
    return (
        st is not None
        and stat.S_ISREG(st.st_mode)
        and state.files.get(entry.path) == (entry.size, st.st_mtime_ns, entry.digest)
    )
