"""`neffbuild gc --cache-dir DIR`: prune a host's cache dir to the release pull installed there.

Kept: every path the installed release lists (from pull's state in DIR/.neffbuild/state.json,
which holds the release document; for a state written before it did, --store reads the release
document, so a listed file pull has not recorded is kept too), pull's own state dir, and the temp files of pulls in progress. Everything else goes:
files a compiler wrote at serve time, files of releases installed before. Pruning holds pull's
lock, so no pull lands files while it runs. The walk follows no symlink: a link is removed as
a link, never through it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from neffbuild.documents.refs import resolve
from neffbuild.errors import NotFoundError
from neffbuild.fs.confined import disk_error
from neffbuild.host.cachedir import CacheDir
from neffbuild.names import STATE_DIR, is_temp_name
from neffbuild.store.base import Store


@dataclass(frozen=True, slots=True)
class CachePrune:
    cache_dir: Path
    release_id: str
    kept_files: int
    remove: tuple[str, ...]  # paths below the cache dir
    remove_bytes: int
    removed: bool  # False: a dry run


def prune_cache_dir(cache_dir: Path, *, store: Store | None = None, dry_run: bool = False) -> CachePrune:
    cache_dir = cache_dir.expanduser().resolve()
    not_pulled = NotFoundError(
        f"{cache_dir}: no release installed (no pull state)", hint="pull a release into it first"
    )
    if not cache_dir.is_dir():
        raise not_pulled
    with CacheDir.opened(cache_dir) as cache:
        if not cache.has_state_dir():
            raise not_pulled
        with cache.locked() as held:
            state = held.state()[1].trusted(cache.state_path)
            if state.release_id is None:
                raise not_pulled
            keep = set(state.files)
            if state.installed is not None:
                keep |= {f.path for f in state.installed.release.files}
            if store is not None:
                keep |= {f.path for f in resolve(store, state.release_id).release.files}
            doomed = _unlisted(cache_dir, keep)
            if not dry_run:
                _remove(cache_dir, doomed)
    return CachePrune(cache_dir, state.release_id, len(keep), tuple(sorted(doomed)), sum(doomed.values()), not dry_run)


def _unlisted(cache_dir: Path, keep: set[str]) -> dict[str, int]:
    """path -> bytes of each file (or link) below cache_dir the release does not list."""
    found = {}
    try:
        for top, dirs, names, dir_fd in os.fwalk(cache_dir, follow_symlinks=False):
            rel_top = Path(top).relative_to(cache_dir).as_posix()
            if rel_top == ".":
                dirs[:] = [d for d in dirs if d != STATE_DIR]
            for name in [*names, *(d for d in dirs if _is_link(name=d, dir_fd=dir_fd))]:
                rel = name if rel_top == "." else f"{rel_top}/{name}"
                if rel not in keep and not is_temp_name(name):
                    found[rel] = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
    except OSError as exc:
        raise disk_error(exc, cache_dir) from None
    return found


def _is_link(*, name: str, dir_fd: int) -> bool:
    return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)


def _remove(cache_dir: Path, doomed: dict[str, int]) -> None:
    """Unlink each path through its parent directory's descriptor (no link followed on the way),
    then remove directories left empty."""
    try:
        for top, dirs, names, dir_fd in os.fwalk(cache_dir, topdown=False, follow_symlinks=False):
            rel_top = Path(top).relative_to(cache_dir).as_posix()
            if rel_top == STATE_DIR or rel_top.startswith(f"{STATE_DIR}/"):
                continue
            for name in [*names, *dirs]:
                rel = name if rel_top == "." else f"{rel_top}/{name}"
                if rel in doomed:
                    os.unlink(name, dir_fd=dir_fd)
                elif name in dirs and rel != STATE_DIR and _empty_dir(name, dir_fd):
                    os.rmdir(name, dir_fd=dir_fd)
    except OSError as exc:
        raise disk_error(exc, cache_dir) from None


def _empty_dir(name: str, dir_fd: int) -> bool:
    """name is a directory (not a link to one) with nothing in it."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return not os.listdir(fd)
    finally:
        os.close(fd)
