"""What a cache dir records about itself: `.neffbuild/state.json`, written by pull, read by
pull, `status` and `env` without a store.

Format `neffbuild.cache-state/2`:

    {"format": "neffbuild.cache-state/2",
     "installed": {"release_id", "tag" ("" if pulled by id), "store" (its URL), "installed_at",
                   "release" (the release document itself), "exports" (what pull printed),
                   "units": [{"unit_id", "key", "backend", "unit", "fingerprint", "paths"}]  (from the bundles)},
     "files": {path: [size, mtime_ns, digest]}}   (what pull wrote: saves re-hashing)

`installed` answers "which release is this, and what did it set" with no store round trip (a tag
may have moved since); its units carry what a key is made of, so `status` can recompute each
unit's key for this host. `files` is only a cache of hashes and stays lenient: a malformed entry
is dropped and costs one re-hash. `installed` is strict: one malformed field, a release document
that does not match its id, or another format drops all of it, and the cache dir reads as
"installed release unknown" (status and env then need a store and a REF; the next pull rewrites it).

Version 1 (before this format, no `format` field: {"release", "tag", "files"}) is read, not
migrated in place: its files serve as before and its release id is kept (enough to tell a stale
cache from a current one), the release document is unknown. The next pull that changes anything
writes version 2; a pull into a complete v1 cache writes version 2 once (then never again).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neffbuild.bundle import FileEntry, Release, ReleaseUnit, SharedPath, decode_doc, to_json
from neffbuild.errors import InputError, IntegrityError, NotFoundError
from neffbuild.hashing import canonical_json, hash_bytes, is_digest
from neffbuild.materialize import disk_error, open_dir_beneath
from neffbuild.names import STATE_DIR

if TYPE_CHECKING:
    from neffbuild.refs import ResolvedRelease
    from neffbuild.store.base import Store

STATE_FORMAT = "neffbuild.cache-state/2"
STATE_FILE = "state.json"
STATE_MAX = 256 << 20  # a larger state file is not ours: ignored (it only saves re-hashing)

Files = dict[str, tuple[int, int, str]]  # path -> (size, mtime_ns, digest) of what pull wrote


@dataclass(frozen=True, slots=True)
class InstalledUnit:
    """One unit of the installed release, as its bundle recorded it (what its key is made of)."""

    unit_id: str
    key: str
    backend: str
    unit: dict[str, Any]
    fingerprint: dict[str, str]
    paths: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Installed:
    """The release a pull installed, and how."""

    release_id: str
    tag: str  # "" when pulled by release id
    store: str
    installed_at: str
    release: Release
    exports: dict[str, str]
    units: tuple[InstalledUnit, ...]


@dataclass(frozen=True)
class CacheState:
    files: Files = field(default_factory=dict)
    installed: Installed | None = None  # None: unknown (no state, version 1, or damaged)
    release_id: str | None = None  # the installed release's id, known from version 1 too
    tag: str | None = None
    version: int = 0  # 0: no state or unreadable


def parse_state(data: bytes) -> CacheState:
    """The state file's content; never raises (anything malformed reads as unknown)."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return CacheState()
    if not isinstance(raw, dict):
        return CacheState()
    files = _files(raw.get("files"))
    if raw.get("format") == STATE_FORMAT:
        installed = _installed(raw.get("installed"))
        if installed is None:
            return CacheState(files, version=2)
        return CacheState(files, installed, installed.release_id, installed.tag or None, version=2)
    if "format" in raw:  # a newer neffbuild's: its file hashes may mean something else
        return CacheState()
    release, tag = raw.get("release"), raw.get("tag")
    return CacheState(
        files,
        release_id=release if isinstance(release, str) and is_digest(release) else None,
        tag=tag if isinstance(tag, str) and tag else None,
        version=1,
    )


def _files(value: Any) -> Files:
    if not isinstance(value, dict):
        return {}
    files = {}
    for path, entry in value.items():
        if (
            isinstance(entry, list)
            and len(entry) == 3
            and type(entry[0]) is int  # exactly: a bool is no size
            and type(entry[1]) is int
            and isinstance(entry[2], str)
        ):
            files[path] = (entry[0], entry[1], entry[2])
    return files


@dataclass(frozen=True, slots=True)
class _Head:
    """Installed without its release: decoded strictly."""

    release_id: str
    tag: str
    store: str
    installed_at: str
    exports: dict[str, str]
    units: tuple[InstalledUnit, ...]


def _installed(value: Any) -> Installed | None:
    """The installed record, if whole. Its release document is checked by its digest, which is
    its id: the bytes pull parsed strictly from the store, so they are rebuilt without a second
    strict parse (status reads this on every call; a 2,000-file release took 80 ms that way)."""
    if not isinstance(value, dict) or not isinstance(release := value.get("release"), dict):
        return None
    try:
        if hash_bytes(canonical_json(release)) != value.get("release_id"):
            return None  # edited by hand or damaged: its exports cannot be trusted to match
        head = decode_doc(_Head, {k: v for k, v in value.items() if k != "release"}, STATE_FILE)
        return Installed(**{f: getattr(head, f) for f in _Head.__slots__}, release=_release(release))
    except (IntegrityError, TypeError, KeyError, ValueError, RecursionError):
        return None


def _release(raw: dict[str, Any]) -> Release:
    return Release(**{
        **raw,
        "files": tuple(FileEntry(**f) for f in raw["files"]),
        "units": tuple(ReleaseUnit(**u) for u in raw["units"]),
        "shared": tuple(SharedPath(**{**p, "dropped": tuple(p["dropped"])}) for p in raw["shared"]),
    })  # fmt: skip


def encode_state(installed: Installed, files: Mapping[str, tuple[int, int, str]]) -> bytes:
    """The state file's bytes: equal inputs give equal bytes (pull writes only when they change)."""
    doc = {"format": STATE_FORMAT, "installed": to_json(installed), "files": {p: list(v) for p, v in files.items()}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def open_state_dir(root: int, cache_dir: Path, *, create: bool) -> int | None:
    """cache_dir/.neffbuild, made if create, else None when missing; a symlink there is refused
    (state and lock are never read or written outside the cache dir)."""
    try:
        return open_dir_beneath(root, cache_dir, (STATE_DIR,), create=create)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) and not create:
            return None
        raise disk_error(exc, cache_dir / STATE_DIR) from None


def load_state(state_dir: int) -> tuple[bytes | None, CacheState]:
    """(the state file's bytes, its content); a missing, foreign or broken file reads as empty."""
    try:
        fd = os.open(STATE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=state_dir)
    except OSError:
        return None, CacheState()
    try:
        with os.fdopen(fd, "rb") as src:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > STATE_MAX:
                return None, CacheState()
            data = src.read(STATE_MAX + 1)
    except OSError:
        return None, CacheState()
    return data, parse_state(data)


def read_state(root: int, cache_dir: Path) -> tuple[bytes | None, CacheState]:
    """The state of the cache dir open at root, without making anything."""
    state_dir = open_state_dir(root, cache_dir, create=False)
    if state_dir is None:
        return None, CacheState()
    try:
        return load_state(state_dir)
    finally:
        os.close(state_dir)


def open_existing(cache_dir: Path) -> int | None:
    """cache_dir open, or None if it does not exist (nothing is made)."""
    try:
        return os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise disk_error(exc, cache_dir) from None


def read_cache_state(cache_dir: Path) -> tuple[bytes | None, CacheState]:
    """The state of cache_dir (resolved), or an empty state if the dir does not exist; makes nothing."""
    root = open_existing(cache_dir)
    if root is None:
        return None, CacheState()
    try:
        return read_state(root, cache_dir)
    finally:
        os.close(root)


def state_path(cache_dir: Path) -> Path:
    return cache_dir / STATE_DIR / STATE_FILE


@dataclass(frozen=True, slots=True)
class Target:
    """A release named for a cache dir (the installed one, or REF's), with its units' key parts."""

    release_id: str
    release: Release
    tag: str | None
    units: tuple[InstalledUnit, ...]
    source: str


def find_target(
    state: CacheState,
    cache_dir: Path,
    ref: str | None,
    open_store: Callable[[], Store] | None,
    *,
    store_named: bool = False,
    with_units: bool = True,
) -> Target:
    """REF's release (and its units' key parts): from the cache dir's state when it is the
    installed one (a tag only while no store is named: it may have moved), else from the store."""
    installed = state.installed
    if installed is not None and ref in (None, installed.release_id, *(() if store_named else (installed.tag,))):
        return Target(installed.release_id, installed.release, installed.tag or None, installed.units, str(state_path(cache_dir)))
    if ref is None:
        raise NotFoundError(
            f"{cache_dir}: no installed release recorded (never pulled, or pulled by an older neffbuild)",
            hint="pull it (a complete cache fetches nothing and records it), or name the release and its store: TAG --store S",
        )
    if open_store is None:
        raise InputError(f"{ref}: not the release installed in {cache_dir}", hint="pass --store to read it from the store")
    from neffbuild.refs import resolve

    store = open_store()
    resolved = resolve(store, ref)
    if installed is not None and installed.release_id == resolved.release_id:
        return Target(installed.release_id, installed.release, resolved.tag, installed.units, str(state_path(cache_dir)))
    units = release_units(store, resolved, 16) if with_units else ()
    return Target(resolved.release_id, resolved.release, resolved.tag, units, store.url)


def accepted_env(state: CacheState, target: Target) -> tuple[str, ...]:
    """Variables the pull accepted with --allow-env (they are in its exports) stay accepted."""
    installed = state.installed
    return tuple(installed.exports) if installed is not None and installed.release_id == target.release_id else ()


def release_units(store: Store, resolved: ResolvedRelease, jobs: int) -> tuple[InstalledUnit, ...]:
    """Each unit of the release as its bundle records it (read in parallel); a bundle the store
    lacks or that does not match its key is an error: the store is damaged."""
    from concurrent.futures import ThreadPoolExecutor

    from neffbuild.refs import release_bundle
    from neffbuild.retry import carried

    def load(unit: ReleaseUnit) -> InstalledUnit:
        record = release_bundle(store, resolved, unit)
        return InstalledUnit(unit.unit_id, unit.key, record.backend, record.unit, record.fingerprint, tuple(f.path for f in record.files))

    units = resolved.release.units
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(units), 32)), thread_name_prefix="neffbuild-bundles") as pool:
        loads = [pool.submit(carried(lambda u=u: load(u))) for u in units]  # under the pull's deadline
        return tuple(f.result() for f in loads)
