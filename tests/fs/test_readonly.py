"""Serving from a read-only cache dir, for real: permissions enforced on root (tests here run as
root) by dropping the capabilities that bypass them (setpriv), as a server run as another user
or on a read-only mount meets them. What Inductor writes on a hit is measured in
neffbuild/servingenv.py: only `locks/` in the cache dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neffbuild.backends import get_backend
from neffbuild.descriptors import BACKENDS, INDUCTOR, NEURON, BackendDescriptor
from neffbuild.host.pull import pull
from neffbuild.host.verify import tree_state
from neffbuild.store import open_store
from tests.conftest import write_manifest
from tests.procs import without_override
from tests.storekit import publish_release_of, write_files


def verify_in_place(manifest: Path, cache: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return without_override(
        [
            sys.executable,
            "-m",
            "neffbuild",
            "verify",
            str(manifest),
            "--cache-dir",
            str(cache),
            "--replay",
            "--in-place",
            *more,
        ]
    )


def read_only_but(cache: Path, *writable: str) -> None:
    """chmod -R a-w cache, but for the named top-level dirs (and what is in them)."""
    for top, dirs, files in os.walk(cache):
        if top == str(cache):
            dirs[:] = [d for d in dirs if d not in writable]
        for name in files:
            Path(top, name).chmod(Path(top, name).stat().st_mode & ~0o222)
        Path(top).chmod(Path(top).stat().st_mode & ~0o222)


def test_pull_makes_the_dir_inductor_writes_on_a_hit_and_a_no_op_pull_makes_it_again(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"), create=True)
    sources = write_files(tmp_path / "src", {"fxgraph/ab/k/e": 3000, "ab/cab.so": 5000})
    publish_release_of(store, tmp_path / "src", sources, tag="t")  # an inductor release
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    assert (cache / "locks").is_dir() and list((cache / "locks").iterdir()) == []
    (cache / "locks").rmdir()  # e.g. by `neffbuild prune`, which removes empty dirs
    assert pull(store, "t", cache).files_fetched == 0
    assert (cache / "locks").is_dir()


@pytest.mark.parametrize("described", BACKENDS, ids=lambda b: b.name)
def test_what_a_server_writes_on_a_hit_is_never_bundled(described: BackendDescriptor, tmp_path: Path) -> None:
    for rel in described.serving.writable:
        (tmp_path / rel).mkdir()
        (tmp_path / rel / "c0ffee.lock").write_bytes(b"")
    assert get_backend(described.name).select_files(tmp_path) == []
    assert INDUCTOR.serving.writable == ("locks",) and NEURON.serving.writable == ()  # locks: elsewhere


def test_in_place_refuses_a_cache_dir_the_replay_could_write(tiny_model: Path, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128,))
    cache = tmp_path / "cache"
    (cache / "locks").mkdir(parents=True)
    (cache / "fxgraph" / "ab").mkdir(parents=True)
    read_only_but(cache, "locks")
    (cache / "fxgraph" / "ab").chmod(0o755)  # one dir left writable deep inside
    result = verify_in_place(manifest, cache)
    assert result.returncode == 2, result.stderr
    assert f"error: --in-place: {cache / 'fxgraph' / 'ab'} is writable by this replay\n" in result.stderr
    assert "a miss would write into the dir it checks" in result.stderr
    assert sorted(p.name for p in cache.rglob("*")) == ["ab", "fxgraph", "locks"]  # the probe left nothing


def test_in_place_refuses_a_lock_dir_the_compiler_cannot_write(tiny_model: Path, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128,))
    cache = tmp_path / "cache"
    cache.mkdir()
    read_only_but(cache)
    missing = verify_in_place(manifest, cache)
    assert missing.returncode == 11, missing.stderr
    assert f"{cache / 'locks'}: no such directory; the inductor compiler writes there even on a hit" in missing.stderr
    cache.chmod(0o755)
    (cache / "locks").mkdir()
    read_only_but(cache)
    locked = verify_in_place(manifest, cache)
    assert locked.returncode == 11, locked.stderr
    assert f"{cache / 'locks'}: not writable, and the inductor compiler writes there even on a hit" in locked.stderr
    assert "mount a writable dir over it" in locked.stderr


@pytest.mark.slow
def test_a_read_only_pulled_cache_serves_in_place_with_a_writable_lock_dir_and_fails_without_one(
    built_store: Path, tiny_manifest: Path, tmp_path: Path, cli
) -> None:
    cache = tmp_path / "ro-cache"
    assert cli("pull", "tiny-flux2-klein", "--store", str(built_store), "--cache-dir", str(cache)).returncode == 0
    read_only_but(cache, "locks")
    before = {p: s for p, s in tree_state(cache).items() if not p.startswith("locks")}

    result = verify_in_place(tiny_manifest, cache, "--work-dir", str(tmp_path / "work"), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["in_place"] is True and report["misses"] == 0
    for unit in report["units"]:
        assert unit["compiles"] == 0 and unit["written"] == [], unit
        assert unit["counters"].get("inductor.fxgraph_cache_hit", 0) > 0, unit
    # What Inductor wrote on those hits: one empty lock file per kernel it loaded, nothing else.
    locks = list((cache / "locks").iterdir())
    assert locks and all(p.suffix == ".lock" and p.stat().st_size == 0 for p in locks)
    assert {p: s for p, s in tree_state(cache).items() if not p.startswith("locks")} == before

    # The failure the contract avoids, from Inductor itself: with the lock dir read-only too (a
    # host that forgot its writable mount), the first compiled call fails on its first lock (of
    # its CPU probe, a hit here), naming it; no setting moves the lock dir elsewhere.
    cache.joinpath("locks").chmod(0o755)
    for lock in locks:
        lock.unlink()
    read_only_but(cache)
    code = "import torch; print(torch.compile(lambda x: x * 2)(torch.ones(4)))"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}
    served = without_override([sys.executable, "-c", code], env)
    assert served.returncode != 0
    assert f"PermissionError: [Errno 13] Permission denied: '{cache / 'locks'}/" in served.stderr, served.stderr[-2000:]
    assert verify_in_place(tiny_manifest, cache).returncode == 11  # refused before any worker starts
