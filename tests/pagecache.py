"""Is a file's content in the page cache? (What a buffered or an O_DIRECT landing leaves behind.)"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path


def resident_fraction(path: Path) -> float:
    """The share of path's pages in the page cache (mincore(2) of a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def direct_io_possible(where: Path) -> bool:
    try:
        os.close(os.open(where / "probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600))
    except OSError:
        return False
    return hasattr(os, "O_DIRECT")
