"""A worker process ends without the interpreter's teardown (backends/worker.py's exit_now), and
still as it would have ended: its exit code, buffered output, exit handlers and the work a thread
pool still had. Real processes, no torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from neffbuild.backends.worker import exit_now

    out = Path(sys.argv[1])

    def late() -> None:
        time.sleep(0.3)
        (out / "pool").write_text("done")

    ThreadPoolExecutor(1).submit(late)
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    sys.stdout.write("buffered, no newline")
    exit_now(3)
    """
)


def test_a_worker_exits_with_its_code_its_output_its_exit_handlers_and_its_pools_work(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline"
    assert (tmp_path / "pool").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"
