"""Landing a pull's missing files in the cache dir and recording them: under the cache dir's lock,
fetch each verified into place, flush, then write the state (the commit point: pull.py's docstring
says what a power cut leaves at each step); and the clean-up of killed pulls' temp files."""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from neffbuild.documents.records import FileEntry
from neffbuild.documents.refs import ResolvedRelease
from neffbuild.errors import IntegrityError
from neffbuild.fs.confined import DIRECT_MIN, BlobTarget, disk_error, sync_filesystem
from neffbuild.fs.disk import in_memory
from neffbuild.host.cachedir import CacheDir
from neffbuild.host.pullplan import PullOptions
from neffbuild.host.scan import Scan, regular_stat, scan_files, state_bytes, state_trusted
from neffbuild.host.state import Installed
from neffbuild.names import STATE_DIR, is_temp_name
from neffbuild.pids import alive
from neffbuild.store.base import Store

if TYPE_CHECKING:
    from neffbuild.host.held import Held


def land_missing(
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
        missing = [] if scan.recorded is not None else [f for f in resolved.release.files if found[f.path] is None]
        found.update(scan_files(cache, missing, state_trusted(state.files, o.verify), o.jobs).found)
        missing = [f for f in missing if found[f.path] is None]
        # Killed pulls' temp files: in the whole tree when files move, else only where a
        # state file was being written (all files in: the next pull fetches nothing).
        remove_stale_temp_files(cache.path if missing else cache.path / STATE_DIR)
        if missing:
            root = cache.path
            # O_DIRECT keeps a file out of memory: on tmpfs it is memory (and S3 then reads it back to hash it).
            direct = o.direct_writes and not (any(f.size >= DIRECT_MIN for f in missing) and in_memory(root))
            targets = [
                BlobTarget(f.digest, f.size, root / f.path, fsync=False, root=root, direct=direct, blake3=f.blake3)
                for f in missing
            ]
            try:
                store.download_blobs(targets, o.jobs, release=resolved.release_id)
            except IntegrityError as exc:
                raise _what_landed(exc, cache, missing) from None
            with cache.beneath() as tree:
                found.update({f.path: regular_stat(tree, f.path, root) for f in missing})
        # The tag versions accepted go in with the files: only a pull that passed every check records them.
        _save_state(held, cache.path, state_bytes(installed, scan, *trusted), old_state)
    return missing


def _what_landed(exc: IntegrityError, cache: CacheDir, missing: list[FileEntry]) -> IntegrityError:
    """A corrupt blob stops the pull while others land beside it (in parallel): the hint says
    what the cache dir now holds, not that nothing was written."""
    with cache.beneath() as tree:
        landed = sum(regular_stat(tree, f.path, cache.path) is not None for f in missing)
    if not landed:
        return exc
    return IntegrityError(
        exc.message,
        hint=f"the store object is corrupt: rebuild or re-push the release. {landed} other of the {len(missing)} files"
        f" this pull fetched landed in {cache.path}, each verified against the release; the state is unchanged"
        " (the next pull of a good release keeps or replaces them)",
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


def make_serving_dirs(cache_dir: Path, names: Collection[str]) -> None:
    """Make the dirs the server writes even on a hit, now, while the cache dir is writable: a
    host serving it read-only mounts a writable dir over each (docs/hosts.md, read-only cache dir)."""
    for name in names:
        try:
            (cache_dir / name).mkdir(exist_ok=True)
        except OSError as exc:
            raise disk_error(exc, cache_dir / name) from None
