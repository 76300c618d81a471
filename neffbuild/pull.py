"""Materialise a release into a cache dir: only missing files move, every byte is verified.

Each file lands through materialize.write_verified (a temp file, hashed while written, then named),
so a crash or a bad object leaves the previous state, never half a file. A small state file
remembers (size, mtime) of what we wrote, so a complete cache makes pull a no-op without
re-reading gigabytes of NEFFs; a no-op pull writes nothing at all (a full disk does not fail it).

Nothing below the cache dir is reached through a symlink (materialize's module docstring says
how): not the files, not their directories, not the state dir and its lock. A file that is a
link is never "present"; pull replaces it with the verified file.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from neffbuild.bundle import FileEntry
from neffbuild.exports import env_file_text, exports_for, write_env_file
from neffbuild.materialize import (
    BlobTarget,
    Beneath,
    disk_error,
    open_dir_beneath,
    sync_filesystem,
)
from neffbuild.names import STATE_DIR, is_temp_name
from neffbuild.refs import ResolvedRelease, resolve
from neffbuild.store.base import Store

STATE_FILE = "state.json"
LOCK_FILE = "pull.lock"
STATE_MAX = 256 << 20  # a larger state file is not ours: ignored (it only saves re-hashing)

State = Mapping[str, tuple[int, int, str]]  # path -> (size, mtime_ns, digest) of what pull wrote


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


def release_exports(resolved: ResolvedRelease, cache_dir: Path, allow_env: Collection[str] = ()) -> dict[str, str]:
    """What a serving process exports for this release (see neffbuild.exports for what may be)."""
    return exports_for(resolved.release, cache_dir, resolved.where, allow_env)


def serving_env(
    store: Store, ref: str, cache_dir: Path, *, allow_env: Collection[str] = (), env_file: Path | None = None
) -> dict[str, str]:
    """The exports for ref's release served from cache_dir (`neffbuild env`); written to env_file too."""
    exports = release_exports(resolve(store, ref), cache_dir.expanduser().resolve(), allow_env)
    if env_file is not None:
        write_env_file(env_file, env_file_text(exports))
    return exports


def pull(
    store: Store, ref: str, cache_dir: Path, *, jobs: int = 16, allow_env: Collection[str] = (), env_file: Path | None = None
) -> PullReport:
    """Bring the release's files into cache_dir; with env_file, write the exports there last.

    Everything that can refuse (the release, its exports, a link in the cache dir) is checked
    before anything is written; a cache that is complete is only read.
    """
    started = time.perf_counter()
    resolved = resolve(store, ref)
    cache_dir = cache_dir.expanduser().resolve()  # once: where the root points is the operator's choice
    exports = release_exports(resolved, cache_dir, allow_env)
    env_text = env_file_text(exports) if env_file is not None else ""
    with _open_root(cache_dir) as root:
        old_state, state = _read_state(root, cache_dir)
        found = _scan(root, cache_dir, resolved.release.files, state)
        missing = [f for f in resolved.release.files if found[f.path] is None]
        if missing or _state_bytes(resolved, found) != old_state:
            missing = _complete(store, resolved, root, cache_dir, found, jobs)
    if env_file is not None:
        write_env_file(env_file, env_text)
    return PullReport(
        release_id=resolved.release_id,
        tag=resolved.tag,
        cache_dir=cache_dir,
        files_total=len(resolved.release.files),
        files_fetched=len(missing),
        bytes_fetched=sum(f.size for f in missing),
        bytes_total=resolved.release.total_size,
        seconds=time.perf_counter() - started,
        exports=exports,
    )


def _complete(store: Store, resolved: ResolvedRelease, root: int, cache_dir: Path, found: dict[str, os.stat_result | None], jobs: int) -> list[FileEntry]:
    """Fetch what is missing and record the state, under the lock; the files fetched."""
    state_dir = _open_state_dir(root, cache_dir, create=True)
    assert state_dir is not None
    try:
        # The lock only saves duplicate downloads when two pulls race; rename keeps each file whole anyway.
        with _exclusive(state_dir, cache_dir / STATE_DIR / LOCK_FILE):
            old_state, state = _load_state(state_dir)
            # Another pull may have landed some while we waited for the lock.
            missing = [f for f in resolved.release.files if found[f.path] is None]
            found.update(_scan(root, cache_dir, missing, state))
            missing = [f for f in missing if found[f.path] is None]
            if missing:
                remove_stale_temp_files(cache_dir)
                targets = [BlobTarget(f.digest, f.size, cache_dir / f.path, fsync=False, root=cache_dir) for f in missing]
                store.download_blobs(targets, jobs, release=resolved.release_id)
                # One flush for all files, then the state file: the state is the commit point. A file
                # put in place but lost to a power cut before this flush is not in the state, so
                # the next pull re-hashes it and fetches it again.
                sync_filesystem(cache_dir)
                with Beneath(root, cache_dir) as tree:
                    found.update({f.path: _stat(tree, f.path, cache_dir) for f in missing})
            _save_state(state_dir, cache_dir, _state_bytes(resolved, found), old_state)
    finally:
        os.close(state_dir)
    return missing


def _scan(root: int, cache_dir: Path, files: Collection[FileEntry], state: State) -> dict[str, os.stat_result | None]:
    """path -> status of each file the cache already holds, None for the others (only reads)."""
    with Beneath(root, cache_dir) as tree:
        return {f.path: _present(tree, f, state, cache_dir) for f in files}


@contextmanager
def _open_root(cache_dir: Path) -> Iterator[int]:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise disk_error(exc, cache_dir) from None
    try:
        yield fd
    finally:
        os.close(fd)


def _open_state_dir(root: int, cache_dir: Path, *, create: bool) -> int | None:
    """cache_dir/.neffbuild, made if create, else None when missing; a symlink there is refused
    (state and lock are never written outside the cache dir)."""
    try:
        return open_dir_beneath(root, cache_dir, (STATE_DIR,), create=create)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) and not create:
            return None
        raise disk_error(exc, cache_dir / STATE_DIR) from None


def _read_state(root: int, cache_dir: Path) -> tuple[bytes | None, dict[str, tuple[int, int, str]]]:
    """The state as _load_state reads it, without making the state dir."""
    state_dir = _open_state_dir(root, cache_dir, create=False)
    if state_dir is None:
        return None, {}
    try:
        return _load_state(state_dir)
    finally:
        os.close(state_dir)


@contextmanager
def _exclusive(state_dir: int, shown: Path) -> Iterator[None]:
    """An advisory lock (flock) held while the block runs; the kernel drops it if we die."""
    try:
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=state_dir)
    except OSError as exc:
        raise disk_error(exc, shown) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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
    return pid.isascii() and pid.isdigit() and len(pid) <= 10 and not _alive(int(pid))


def _is_regular(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _present(tree: Beneath, entry: FileEntry, state: State, cache_dir: Path) -> os.stat_result | None:
    """The file's status if the cache already holds entry's bytes at its path, else None."""
    st = _stat(tree, entry.path, cache_dir)
    if st is None or st.st_size != entry.size:
        return None
    if state.get(entry.path) == (entry.size, st.st_mtime_ns, entry.digest):
        return st
    try:
        digest = tree.hash_file(entry.path, entry.size)
    except OSError as exc:
        raise disk_error(exc, cache_dir / entry.path) from None
    return st if digest == entry.digest else None


def _stat(tree: Beneath, rel: str, cache_dir: Path) -> os.stat_result | None:
    """rel's status if it is a regular file (a link, a directory, a FIFO... count as absent)."""
    try:
        st = tree.lstat(rel)
    except OSError as exc:
        raise disk_error(exc, cache_dir / rel) from None
    return st if st is not None and stat.S_ISREG(st.st_mode) else None


def parse_state(data: bytes) -> dict[str, tuple[int, int, str]]:
    """The state file's entries; anything malformed is dropped (a lost entry costs one re-hash)."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, dict):
        return {}
    state = {}
    for path, entry in files.items():
        if (
            isinstance(entry, list)
            and len(entry) == 3
            and all(type(v) is int for v in entry[:2])
            and isinstance(entry[2], str)
        ):
            state[path] = (entry[0], entry[1], entry[2])
    return state


def _load_state(state_dir: int) -> tuple[bytes | None, dict[str, tuple[int, int, str]]]:
    """(the state file's bytes, its entries); a missing, foreign or broken file reads as empty."""
    try:
        fd = os.open(STATE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=state_dir)
    except OSError:
        return None, {}
    try:
        with os.fdopen(fd, "rb") as src:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > STATE_MAX:
                return None, {}
            data = src.read(STATE_MAX + 1)
    except OSError:
        return None, {}
    return data, parse_state(data)


def _state_bytes(resolved: ResolvedRelease, found: Mapping[str, os.stat_result | None]) -> bytes:
    files = {}
    for entry in resolved.release.files:
        st = found.get(entry.path)
        if st is not None:
            files[entry.path] = [entry.size, st.st_mtime_ns, entry.digest]
    return json.dumps({"release": resolved.release_id, "tag": resolved.tag, "files": files}).encode()


def _save_state(state_dir: int, cache_dir: Path, data: bytes, old: bytes | None) -> None:
    """Replace the state file with data, unless it already holds exactly that."""
    if data == old:
        return
    shown = cache_dir / STATE_DIR / STATE_FILE
    tmp = f".{STATE_FILE}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=state_dir)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, STATE_FILE, src_dir_fd=state_dir, dst_dir_fd=state_dir)
    except OSError as exc:
        raise disk_error(exc, shown) from None
    finally:
        try:
            os.unlink(tmp, dir_fd=state_dir)
        except OSError:
            pass
