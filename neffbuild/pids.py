"""Is a process still running: the one check a worker (is the CLI that started me gone?) and a
pull (is the writer of this temp file gone?) both make."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Is pid a live process (a zombie is not: it will write nothing more)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return False
        try:  # no /proc: signal 0 tells only whether the pid exists
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"
