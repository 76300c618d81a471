"""Scratch space of a build or replay, and what a failed worker leaves behind: each run's scratch
root, its removal (read-only dirs included), and the logs kept of failed units."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from neffbuild.errors import InputError

# What a failed worker leaves that is worth keeping once its scratch dir is deleted.
_KEPT_FILES = ("worker.log", "job.json", "job.result.json", "job.events.jsonl")


# Where failed workers' logs are kept, unless the command says otherwise (`<work dir>/logs`).
DEFAULT_LOGS_DIR = Path(".neffbuild") / "logs"


def logs_dir_for(work_dir: Path | None) -> Path:
    """`<work dir>/logs` with --work-dir, else DEFAULT_LOGS_DIR."""
    return work_dir / "logs" if work_dir else DEFAULT_LOGS_DIR


def run_name() -> str:
    """A dir name for one build's or replay's kept logs: sortable, and unique on this host."""
    return f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def unit_dir_name(unit_id: str) -> str:
    return unit_id.replace("/", "__")


def keep_logs(scratch: Path, dest: Path) -> Path | None:
    """Copy a failed worker's log, job, result and events out of its scratch dir (about to be
    deleted) into dest; the kept log's path, or None if the worker never started."""
    if not (scratch / "worker.log").is_file():
        return None
    dest.mkdir(parents=True, exist_ok=True)
    for name in (*_KEPT_FILES, *(p.name for p in scratch.glob("job.rank*.result.json"))):
        if (scratch / name).is_file():
            shutil.copyfile(scratch / name, dest / name)
    return dest / "worker.log"


def log_tail(log: Path | None, lines: int = 12) -> tuple[str, ...]:
    """The last lines of a log (what a failure prints under its message)."""
    if log is None:
        return ()
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ()
    return tuple(line.rstrip() for line in text.splitlines()[-lines:])


def make_scratch_root(work_dir: Path | None, prefix: str) -> Path:
    """A fresh dir for this run's scratch, in work_dir (created if absent) or the system's temp."""
    try:
        if work_dir is not None:
            work_dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=work_dir))
    except OSError as exc:
        raise InputError(
            f"work dir {work_dir}: cannot make a scratch dir there ({exc.strerror or exc})",
            hint="give --work-dir a writable directory (it is created if absent)",
        ) from None


def remove_tree(path: Path) -> None:
    """Remove a scratch tree, read-only dirs included (a copied cache may have some)."""

    def make_writable_and_retry(function: Callable[[str], object], failed: str, exc_info: object) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), 0o700)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, 0o700)
            function(failed)

    if path.exists():
        shutil.rmtree(path, onerror=make_writable_and_retry)
