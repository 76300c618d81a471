"""Replace a small file whole or not at all: documents, tags, pull's state, job and env files.

A process-unique temp file beside the target is written and flushed to disk, then renamed (or
linked, for files that must never be replaced) into place, and the directory is flushed so the
new name survives a power cut too. Whatever fails on the way, the temp file is removed and the
target is as it was. Verified blobs of a cache dir land through confined.write_verified
instead (hashed while written, unnamed until verified).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from neffbuild.fs.beneath import opened_dir
from neffbuild.fs.confined import disk_error, temp_name_for, unlink_quietly

Content = bytes | Callable[[BinaryIO], None]  # the bytes, or a function that writes them


def write_atomic(path: Path, content: Content, *, mode: int = 0o644, replace: bool = True) -> bool:
    """Put content at path atomically and durably (see write_atomic_at); DiskError naming path."""
    with opened_dir(path.parent, shown=path) as parent:
        return write_atomic_at(parent, path.name, content, shown=path, mode=mode, replace=replace)


def write_atomic_at(
    dir_fd: int, name: str, content: Content, *, shown: Path, mode: int = 0o644, replace: bool = True
) -> bool:
    """Put content at name in the directory dir_fd: temp file, write, fsync, rename, fsync dir.

    replace=False links instead of renaming, so an existing name is kept: returns False then
    (the local store's If-None-Match). `shown` is the path errors name (DiskError).
    """
    tmp = temp_name_for(name)
    created = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        created = True
        with os.fdopen(fd, "wb") as out:
            if isinstance(content, bytes):
                out.write(content)
            else:
                content(out)
            out.flush()
            os.fsync(out.fileno())
        if replace:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            created = False
        else:
            try:
                os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                return False
        os.fsync(dir_fd)  # the new name itself is durable
        return True
    except OSError as exc:
        raise disk_error(exc, shown) from None
    finally:
        if created:
            unlink_quietly(dir_fd, tmp)
