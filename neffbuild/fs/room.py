"""Whether a filesystem has room for the files a pull will write: checked before the first byte.

What a pull needs: each missing file rounded up to the filesystem's block (a 1-byte file takes a
block), the state file it rewrites (a new copy beside the old one until the rename), and a margin
of 5% of that, at most 64 MiB, for directories, metadata and what else is written meanwhile. Only
the space an unprivileged writer may use counts (f_bavail: the blocks reserved for root are not
ours). Inodes are not checked: a filesystem out of inodes fails the write mid-pull, cleanly.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from neffbuild.errors import DiskError

MARGIN_FRACTION = 0.05
MARGIN_CAP = 64 << 20


@dataclass(frozen=True, slots=True)
class Room:
    where: Path  # the directory whose filesystem was asked (the cache dir or its nearest existing parent)
    need: int  # bytes, margin included
    free: int  # bytes available to us

    @property
    def fits(self) -> bool:
        return self.need <= self.free


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def room_for(cache_dir: Path, sizes: Iterable[int]) -> Room:
    """What writing files of these sizes into cache_dir needs, and what its filesystem has free."""
    where = nearest_existing(cache_dir)
    try:
        fs = os.statvfs(where)
    except OSError as exc:
        raise DiskError(
            f"{where}: cannot read its free space: {exc.strerror or exc}", hint="check the filesystem"
        ) from None
    block = fs.f_frsize or fs.f_bsize or 4096
    data = sum(-(-size // block) * block for size in sizes)
    return Room(where, data + min(int(data * MARGIN_FRACTION), MARGIN_CAP), fs.f_bavail * block)


def require_room(cache_dir: Path, sizes: Iterable[int], what: str) -> Room:
    """room_for, or DiskError naming the directory, the bytes needed and the bytes free."""
    room = room_for(cache_dir, sizes)
    if not room.fits:
        raise DiskError(
            f"{room.where}: {what} needs {_mib(room.need)} ({room.need} bytes, 5% margin included), "
            f"only {_mib(room.free)} ({room.free} bytes) free",
            hint="free space on that filesystem or choose a larger --cache-dir; nothing was written",
        )
    return room


def require_scratch(dirs: Mapping[str, Path], min_free: int) -> None:
    """Each dir (or, where it does not exist yet, its nearest parent) accepts a new file and has
    min_free bytes free; DiskError naming the first that does not."""
    import tempfile  # with shutil: 5 ms of every pull's start-up, for the build's check only

    for what, path in dirs.items():
        where = nearest_existing(path)
        if not where.is_dir():
            raise DiskError(
                f"{path} ({what}): {where} is not a directory", hint="remove it or point the compiler elsewhere"
            )
        try:
            fd, probe = tempfile.mkstemp(prefix=".neffbuild-probe-", dir=where)
        except OSError as exc:
            raise DiskError(
                f"{path} ({what}): cannot create files in {where}: {exc.strerror or exc}",
                hint="make it writable by the building user; nothing was compiled",
            ) from None
        os.close(fd)
        os.unlink(probe)
        room = room_for(where, [])
        if room.free < min_free:
            raise DiskError(
                f"{path} ({what}): only {_mib(room.free)} free on {where}, a build needs {_mib(min_free)} there",
                hint="free space on that filesystem; nothing was compiled",
            )


def _mib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
