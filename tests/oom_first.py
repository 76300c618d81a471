"""TEST SEAM, imported in a worker through NEFFBUILD_WORKER_IMPORTS (before the backend's imports):
makes this worker the OOM killer's first choice in its cgroup. In a real build the compiling
worker is by far the largest process; in tests/build/test_faults.py the CLI (which imports torch
to plan) is larger than a worker that has only begun loading, and the kernel kills the largest.
Raising one's own oom_score_adj needs no privilege."""

from pathlib import Path

Path("/proc/self/oom_score_adj").write_text("1000\n")
