"""The disk's failures as neffbuild's errors, and flushing a filesystem: what every write under
fs/ reports and relies on."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from neffbuild.errors import DiskError


def disk_error(exc: OSError, path: Path) -> DiskError:
    hints = {
        errno.ENOSPC: "free space on that filesystem or choose another directory",
        errno.EDQUOT: "the disk quota is exhausted",
        errno.EACCES: "check the directory's permissions",
        errno.EROFS: "the filesystem is read-only",
    }
    return DiskError(f"{path}: {exc.strerror or exc}", hint=hints.get(exc.errno or 0, "check the filesystem"))


def sync_filesystem(path: Path) -> None:
    """Flush the filesystem holding path (Linux syncfs; elsewhere a global sync, which reports
    nothing). A failed flush is a DiskError: what was written may not survive a power cut, so
    nothing may be recorded as durable (pull's state file)."""
    import ctypes  # only where something was written: a no-op pull never flushes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise disk_error(exc, path) from None
    try:
        if not hasattr(libc, "syncfs"):
            os.sync()
        elif libc.syncfs(fd) != 0:
            code = ctypes.get_errno()
            raise DiskError(
                f"{path}: flushing its filesystem to disk failed: {os.strerror(code)}",
                hint="the device reported a write error, so the files just written may be lost: "
                "check the disk (dmesg), then pull again",
            )
    finally:
        os.close(fd)


# Filesystems that keep their files in memory: O_DIRECT there keeps nothing out of memory (tmpfs
# takes the flag since Linux 6.6 and copies into its pages all the same), and a file just
# written reads back at the speed of a copy.
IN_MEMORY = frozenset({"tmpfs", "ramfs"})


def in_memory(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """Whether path's filesystem keeps its files in memory (False where that cannot be told)."""
    try:
        dev = os.stat(path).st_dev
        table = mountinfo.read_text()
    except OSError:
        return False
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    for line in table.splitlines():  # "ID PARENT MAJOR:MINOR ROOT POINT OPTIONS [TAGS] - TYPE SOURCE ..."
        fields = line.split(" ", 3)
        if len(fields) > 2 and fields[2] == wanted:
            return line.partition(" - ")[2].split(" ", 1)[0] in IN_MEMORY
    return False
