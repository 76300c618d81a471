"""What a pull decides before it writes: its options, the release it serves (read against the
cache dir's state), what the state will record of it, and the files to fetch, with room for them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from neffbuild import retry
from neffbuild.documents.records import FileEntry, Release, trusted_release
from neffbuild.documents.refs import ResolvedRelease, resolve
from neffbuild.host.bundleunits import installed_unit, release_units
from neffbuild.host.cachedir import CacheDir
from neffbuild.host.scan import Scan, State, scan_files, state_size, state_trusted
from neffbuild.host.state import CacheState, Installed, Vouched, holds_release, parse_state, release_in
from neffbuild.store.base import Store

if TYPE_CHECKING:  # host/trust.py is imported only where trusted keys are given
    from neffbuild.host.trust import Trust, Verified

LOCK_TIMEOUT_S = 300.0  # a pull waiting longer for another is stuck behind a stuck one: boot should fail and say so
VERIFY_MODES = ("fast", "full")  # fast: trust (size, mtime) the state recorded; full: rehash every file


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
    # The no-op entry's (host/noop.py): NotANoop, before anything is written, unless the cache
    # dir holds the release its state records, every file as recorded (nothing to fetch or record).
    noop_only: bool = False


class NotANoop(Exception):  # noqa: N818 - not an error: the pull has work to do, which the full path does
    """A pull with noop_only found something to do (nothing was written)."""


def resolved_with_state(
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
    served: list[tuple[bytes, Release]] = []  # the store's bytes, where they are the state's, and their release

    def as_recorded(got: bytes) -> Release | None:
        release = trusted_release(got) if holds_release(data, found, found[0], got) else None
        served.extend(() if release is None else ((got, release),))
        return release

    resolved = resolve(store, ref, known=(found[0], as_recorded))
    vouched = Vouched(found[0], *served[0]) if served and resolved.release is served[0][1] else None
    old = parse_state(data, vouched)
    if vouched is not None and (old.installed is None or old.installed.release is not vouched.release):
        resolved = resolve(store, ref)  # a state corrupt elsewhere vouches for nothing: the store's bytes, strictly
    return resolved, None, old


def missing_that_fits(
    cache: CacheDir, installed: Installed, state: State, o: PullOptions
) -> tuple[Scan, list[FileEntry]]:
    """(what the cache holds, the files to fetch), once its filesystem has room for them: else
    DiskError, with nothing written. Short of room while another pull holds the lock, whatever
    that pull is landing is not ours to fetch: wait for it (lock_timeout) and look again."""
    scan, missing, sizes = _missing(cache, installed, state_trusted(state, o.verify), o.jobs)
    if not missing:
        return scan, missing  # a no-op: no room to ask for
    from neffbuild.fs.room import require_room, room_for

    if cache.exists and not room_for(cache.path, sizes).fits and cache.wait_for_other_pull(o.lock_timeout):
        fresh = cache.read_state()[1].files
        scan, missing, sizes = _missing(cache, installed, state_trusted(fresh, o.verify), o.jobs)
    if missing:
        require_room(cache.path, sizes, f"pulling {len(missing)} files of {installed.release.name}")
    return scan, missing


def _missing(cache: CacheDir, installed: Installed, state: State, jobs: int) -> tuple[Scan, list[FileEntry], list[int]]:
    """(what the cache holds, the files to fetch, the sizes to make room for: theirs and the state file's)."""
    files = installed.release.files
    scan = scan_files(cache, files, state, jobs) if cache.exists else Scan(dict.fromkeys(f.path for f in files))
    missing = [] if scan.recorded is not None else [f for f in files if scan.found[f.path] is None]
    sizes = [*(f.size for f in missing), state_size(installed)] if missing else []  # a no-op pull encodes nothing
    return scan, missing, sizes


def installed_record(
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
