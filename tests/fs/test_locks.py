"""Advisory locks: a held lock makes a waiter give up after its timeout; a dead holder's does not."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neffbuild.errors import ConflictError, DiskError
from neffbuild.fs.locks import exclusive

HOLD = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"


def holder(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_lock_held_by_a_live_process_times_out_with_a_conflict(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    proc = holder(lock)
    try:
        started = time.monotonic()
        with pytest.raises(ConflictError, match="still held by another process after 0.3 s"):
            with exclusive(lock, timeout=0.3):
                pass
        assert 0.3 <= time.monotonic() - started < 5
    finally:
        proc.kill()
        proc.wait()


def test_a_lock_of_a_killed_holder_does_not_block(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    proc = holder(lock)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with exclusive(lock, timeout=1):
        assert lock.exists()


def test_a_symlinked_lock_file_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (tmp_path / "x.lock").symlink_to(outside)
    with pytest.raises(DiskError, match="x.lock"):
        with exclusive(tmp_path / "x.lock", timeout=1):
            pass
    assert not outside.exists()
