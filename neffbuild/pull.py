"""Materialise a release into a cache dir: only missing files move, every byte is verified.

Each file lands through materialize.write_verified (a temp file, hashed while written, then named),
so a crash or a bad object leaves the previous state, never half a file. A small state file
remembers (size, mtime) of what we wrote, so a complete cache makes pull a no-op without
re-reading gigabytes of NEFFs.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from neffbuild.bundle import FileEntry, Release, TagRecord, parse
from neffbuild.errors import IntegrityError, NotFoundError
from neffbuild.hashing import hash_file, is_digest
from neffbuild.materialize import (
    INCOMPLETE_SUFFIX,
    BlobTarget,
    disk_error,
    sync_filesystem,
)
from neffbuild.store.base import Store

STATE_DIR = ".neffbuild"  # inside the cache dir; compilers ignore unknown top-level dirs
STATE_FILE = "state.json"


@dataclass(frozen=True)
class ResolvedRelease:
    release_id: str
    release: Release
    tag: str | None


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


def resolve(store: Store, ref: str) -> ResolvedRelease:
    """A tag name or a release id → the verified release document."""
    tag = None
    release_id = ref
    if not is_digest(ref):
        current = store.read_tag(ref)
        if current is None:
            known = ", ".join(list(store.list_docs("tags"))[:10]) or "none"
            raise NotFoundError(f"tag {ref!r} not found in {store.url}", hint=f"known tags: {known}")
        tag = ref
        release_id = parse(TagRecord, current[0], f"{store.url}/tags/{ref}.json").release
    data = store.get_doc("releases", release_id)
    if data is None:
        raise NotFoundError(f"release {release_id} not found in {store.url}", hint="build or push it first")
    release = parse(Release, data, f"{store.url}/releases/{release_id}.json")
    if release.release_id != release_id:
        raise IntegrityError(f"{store.url}/releases/{release_id}.json: content does not match its name", hint="the object is corrupt; re-push the release")
    return ResolvedRelease(release_id, release, tag)


def exports_for(release: Release, cache_dir: Path) -> dict[str, str]:
    return {release.cache_env: str(cache_dir), **release.env}


def pull(store: Store, ref: str, cache_dir: Path, *, jobs: int = 16) -> PullReport:
    started = time.perf_counter()
    resolved = resolve(store, ref)
    cache_dir = cache_dir.expanduser().resolve()
    state_dir = cache_dir / STATE_DIR
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise disk_error(exc, state_dir) from None
    # The lock only saves duplicate downloads when two pulls race; rename keeps each file whole anyway.
    with _exclusive(state_dir / "pull.lock"):
        remove_stale_temp_files(cache_dir)
        state = _load_state(state_dir)
        missing = [f for f in resolved.release.files if not _is_present(cache_dir, f, state)]
        targets = [BlobTarget(f.digest, f.size, cache_dir / f.path, fsync=False) for f in missing]
        store.download_blobs(targets, jobs, release=resolved.release_id)
        # One flush for all files, then the state file: the state is the commit point. A file
        # put in place but lost to a power cut before this flush is not in the state, so
        # the next pull re-hashes it and fetches it again.
        if targets:
            sync_filesystem(cache_dir)
        _save_state(state_dir, resolved, cache_dir)
    return PullReport(
        release_id=resolved.release_id,
        tag=resolved.tag,
        cache_dir=cache_dir,
        files_total=len(resolved.release.files),
        files_fetched=len(missing),
        bytes_fetched=sum(f.size for f in missing),
        bytes_total=resolved.release.total_size,
        seconds=time.perf_counter() - started,
        exports=exports_for(resolved.release, cache_dir),
    )


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An advisory lock (flock) held while the block runs; the kernel drops it if we die."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise disk_error(exc, path) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_stale_temp_files(cache_dir: Path) -> int:
    """Delete `*.incomplete` files left by pulls that were killed (their pid is gone)."""
    removed = 0
    for path in cache_dir.rglob(f".*{INCOMPLETE_SUFFIX}"):
        pid = path.name.rsplit(".", 3)[-3] if path.name.count(".") >= 3 else ""
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_present(cache_dir: Path, entry: FileEntry, state: Mapping[str, list]) -> bool:
    path = cache_dir / entry.path
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise disk_error(exc, path) from None
    if st.st_size != entry.size:
        return False
    if state.get(entry.path) == [entry.size, st.st_mtime_ns, entry.digest]:
        return True
    return hash_file(path).hex == entry.digest


def _load_state(state_dir: Path) -> dict[str, list]:
    try:
        data = json.loads((state_dir / STATE_FILE).read_text())
        return data.get("files", {}) if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a lost or broken state only costs re-hashing


def _save_state(state_dir: Path, resolved: ResolvedRelease, cache_dir: Path) -> None:
    files = {}
    for entry in resolved.release.files:
        st = (cache_dir / entry.path).stat()
        files[entry.path] = [entry.size, st.st_mtime_ns, entry.digest]
    payload = {"release": resolved.release_id, "tag": resolved.tag, "files": files}
    tmp = state_dir / f".{STATE_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, state_dir / STATE_FILE)
    except OSError as exc:
        raise disk_error(exc, state_dir / STATE_FILE) from None
    finally:
        tmp.unlink(missing_ok=True)
