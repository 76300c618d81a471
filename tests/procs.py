"""Looking at real processes through /proc, for the tests that send real signals."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from neffbuild.runner.workers import PARENT_PID_ENV


def wait_for(predicate: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie nobody reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it exited between the open and the read
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


def _parents() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parents


def descendants(pid: int) -> set[int]:
    parents = _parents()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {p for p in found if not gone(p)}


def started_by(neffbuild_pid: int) -> set[int]:
    """Live processes whose environment says this neffbuild process started them (workers and
    everything they start), wherever they were reparented to."""
    marker = f"{PARENT_PID_ENV}={neffbuild_pid}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0") and not gone(int(entry.name)):
                found.add(int(entry.name))
    return found


def start_cli(
    *args: str, stderr: Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`neffbuild ARGS` in its own process group, as a shell starts a job; stderr to a file; env
    is added to this process's environment."""
    with stderr.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "neffbuild", *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )


def wait_until_compiling(cli: subprocess.Popen[bytes], stderr: Path, phase: str, timeout: float = 240) -> set[int]:
    """Wait for the worker's phase event (printed as progress) and for the worker to run the C++
    compiler (a child of its own): then it is really compiling. The processes under the CLI."""

    def compiling() -> bool:
        assert cli.poll() is None, stderr.read_text()
        if f": {phase} (after" not in stderr.read_text():
            return False
        return any(descendants(p) for p in descendants(cli.pid))

    assert wait_for(compiling, timeout, step=0.2), stderr.read_text()
    return descendants(cli.pid)


def assert_all_stopped(
    cli: subprocess.Popen[bytes], running: set[int], signalled_at: float, code: int, stderr: Path, work: Path
) -> None:
    """After a stopping signal: the CLI exits with code within 10 s, every process it ran (running,
    from wait_until_compiling) is gone, and its scratch in work is removed."""
    assert cli.wait(30) == code, stderr.read_text()
    assert time.monotonic() - signalled_at < 10
    assert wait_for(lambda: all(gone(p) for p in running), 5), running
    assert not started_by(cli.pid) and not descendants(cli.pid)
    assert list(work.iterdir()) == []


def tree_hash(root: Path) -> str:
    """Every path under root with its kind, bytes, mode and mtime: equal hashes, untouched trees."""
    h = hashlib.sha256()
    st = root.stat()
    h.update(f"{st.st_mode}\0{st.st_mtime_ns}\0".encode())
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = Path(dirpath, name)
            st = path.lstat()
            h.update(f"{path.relative_to(root)}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            if path.is_symlink():
                h.update(os.readlink(path).encode())
            elif path.is_file():
                h.update(path.read_bytes())
    return h.hexdigest()


def without_override(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """command subject to file permissions: as root (tests here run as root), with the
    capabilities that bypass them dropped from the process's bounding set."""
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to drop root's permission override")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    return subprocess.run(command, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})})
