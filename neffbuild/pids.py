"""Processes: is one still running, the one check a worker (is the CLI that started me gone?) and a
pull (is the writer of this temp file gone?) both make; and ending this one without the
interpreter's teardown, where that teardown would only free what torch built."""

from __future__ import annotations

import contextlib
import os
import sys
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


def exit_now(code: int) -> None:
    """Exit as the interpreter would, less its teardown: threads joined as at exit (a thread pool's
    shutdown first), the exit handlers run (logging flushed), the standard streams flushed, then
    os._exit. Freeing what torch, Dynamo and diffusers built was ~1.6 of a replay worker's ~17 CPU-s,
    ~2 of a CLI's ~8 that imported torch and diffusers to plan (bench/RESULTS.md)."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or a reader gone: as at exit
            stream.flush()
    os._exit(code)
