"""Kill real pulls and look at what they leave: shared by tests/host/test_pull_faults.py and
bench/killpull.py.

A point is one `neffbuild pull` process, SIGKILLed after a delay, into a cache dir that was empty
or held an older release (an upgrade at boot). What it leaves must hold to the contract in
pull.py's docstring: a file at a release path is whole (either release's bytes, never a mix or a
prefix), nothing else is named in the tree the server reads, and the state file is the old one
or the new one and never vouches (same size and mtime) for bytes it does not describe. Then a
plain rerun completes, and a `--verify full` after it finds nothing to repair.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from neffbuild.documents.records import FileEntry
from neffbuild.hashing import hash_file
from neffbuild.host.pull import pull
from neffbuild.host.state import STATE_FILE, STATE_FORMAT
from neffbuild.names import INCOMPLETE_SUFFIX, STATE_DIR
from neffbuild.store.base import Store
from tests.statekit import recorded_files

Files = Mapping[str, FileEntry]  # a release's files by path
HEAD_MAX = 1024  # bytes of one HTTP response head (SeaweedFS sends about 400): the allowance per request


def files_of(entries: Iterable[FileEntry]) -> dict[str, FileEntry]:
    return {f.path: f for f in entries}


def kill_delays(duration: float, count: int, seed: int) -> list[float]:
    """count delays spread over [0, duration]: one drawn in each of count equal slices (a plain
    uniform draw may leave a phase of the pull without a single point)."""
    rng = random.Random(seed)
    return [(i + rng.random()) * duration / count for i in range(count)]


def pull_command(ref: str, store_url: str, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "neffbuild", "pull", ref, "--store", store_url, "--cache-dir", str(cache), *extra]


def timed_run(command: Sequence[str], env: Mapping[str, str]) -> float:
    """Seconds from spawning command to its exit (it must succeed)."""
    started = time.monotonic()
    done = subprocess.run(command, env=dict(env), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return time.monotonic() - started


def kill_after(command: Sequence[str], env: Mapping[str, str], delay: float) -> int:
    """Start command, SIGKILL it delay seconds after the spawn; its exit status (-9 if killed,
    0 if it finished first)."""
    proc = subprocess.Popen(command, env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        return proc.wait(timeout=30)


@dataclass(frozen=True)
class Aftermath:
    """What a killed pull left: how many of the new release's files are in, and which state."""

    new_files: int  # files holding the new release's bytes at their path
    state: str  # "none", "old" (the state before the pull) or "new" (the pull's, complete)
    temp_in_state_dir: int  # `*.incomplete` files left in .neffbuild (where no server reads)

    def phase(self, total: int) -> str:
        """Where the pull was when it died, as far as its traces tell."""
        if self.state == "new":
            return "state written"
        if self.new_files == total:
            return "files in, state not yet written"
        return "fetching (some files in)" if self.new_files else "before any file landed"


def look(cache: Path, new: Files, old: Files, old_state: bytes | None, new_release_id: str) -> Aftermath:
    """Check what a killed pull of release `new` left in cache (which held `old`'s files and the
    state old_state before it); AssertionError naming the first thing that breaks the contract."""
    new_files = 0
    digests: dict[str, str] = {}
    for path, rel in _tree(cache):
        allowed = [f for f in (new.get(rel), old.get(rel)) if f is not None]
        assert allowed, f"{path}: visible in the cache dir but no release's file (a temp or stray file)"
        st = path.lstat()
        assert stat.S_ISREG(st.st_mode), f"{path}: not a regular file ({stat.filemode(st.st_mode)})"
        digest = digests[rel] = hash_file(path).hex
        match = [f for f in allowed if (f.size, f.digest) == (st.st_size, digest)]
        assert match, f"{path}: {st.st_size} bytes, xxh3 {digest}: neither release's bytes (a partial or mixed file)"
        new_files += rel in new and match[0] is new[rel]
    state = _state(cache, new, old_state, new_release_id, digests)
    temps = (
        [p for p in (cache / STATE_DIR).glob("*") if p.name.endswith(INCOMPLETE_SUFFIX)]
        if (cache / STATE_DIR).is_dir()
        else []
    )
    return Aftermath(new_files, state, len(temps))


def _tree(cache: Path) -> Iterable[tuple[Path, str]]:
    """Every non-directory below cache outside the state dir, with its path relative to cache."""
    for dirpath, dirnames, filenames in os.walk(cache):
        if Path(dirpath) == cache and STATE_DIR in dirnames:
            dirnames.remove(STATE_DIR)
        for name in [*filenames, *(d for d in dirnames if Path(dirpath, d).is_symlink())]:
            path = Path(dirpath, name)
            yield path, path.relative_to(cache).as_posix()


def _state(cache: Path, new: Files, old_state: bytes | None, new_release_id: str, digests: Mapping[str, str]) -> str:
    path = cache / STATE_DIR / STATE_FILE
    if not path.exists():
        assert old_state is None, f"{path}: the state before the pull is gone and no new one took its place"
        return "none"
    data = path.read_bytes()
    doc = json.loads(data)  # a torn state file fails here
    assert doc["format"] == STATE_FORMAT, doc.get("format")
    # Whatever the state records with the size and mtime a file has now must be that file's bytes:
    # a pull trusts (size, mtime) and would never look at them again.
    for rel, (size, mtime_ns, digest) in recorded_files(doc).items():
        st = os.lstat(cache / rel) if (cache / rel).exists() else None
        if st is not None and (st.st_size, st.st_mtime_ns) == (size, mtime_ns):
            assert digests.get(rel) == digest, f"{path} vouches for {rel} ({digest}) but it holds {digests.get(rel)}"
    if data == old_state:
        return "old"
    assert doc["installed"]["release_id"] == new_release_id, f"{path}: neither the old state nor the new release's"
    assert set(recorded_files(doc)) == set(new), f"{path}: the new state does not record every file of the release"
    for rel, (size, mtime_ns, digest) in recorded_files(doc).items():  # the commit point: every file is in
        st = os.lstat(cache / rel)
        assert (st.st_size, st.st_mtime_ns, digests.get(rel)) == (size, mtime_ns, digest), (
            f"{path} points at {rel}, which changed"
        )
    return "new"


def assert_installed(cache: Path, release: Files) -> None:
    """Every file of release in place with its bytes, the state complete, no temp file anywhere."""
    for rel, entry in release.items():
        got = hash_file(cache / rel)
        assert (got.size, got.hex) == (entry.size, entry.digest), f"{cache / rel}: not the release's bytes"
    doc = json.loads((cache / STATE_DIR / STATE_FILE).read_bytes())
    assert set(recorded_files(doc)) == set(release)
    temps = [p for p in cache.rglob(f"*{INCOMPLETE_SUFFIX}")]
    assert temps == [], temps


def fresh_cache(cache: Path, template: Path | None) -> None:
    """A new cache dir at cache: empty, or a copy of template (a cache dir holding the old release;
    copy2 keeps mtimes to the nanosecond, so the copied state still vouches for the copied files).
    Never a deleted one's path reused: ext4 without a journal makes creates slow for a minute
    after many deletes (see bench/pull.py), which would shift every later point's timing."""
    if template is None:
        cache.mkdir(parents=True)
    else:
        shutil.copytree(template, cache, symlinks=True)


@dataclass(frozen=True)
class Scenario:
    """Pulls of `ref` (release new) from a store, into cache dirs that are empty or hold old."""

    store: Store
    env: Mapping[str, str]  # what a neffbuild process needs to reach the store
    ref: str
    new: Files
    new_release_id: str
    old: Files
    template: Path  # a cache dir holding old, pulled there (copied for each point that starts from it)

    def command(self, cache: Path, *extra: str) -> list[str]:
        return pull_command(self.ref, self.store.url, cache, *extra)

    def point(self, cache: Path, delay: float, *, from_old: bool) -> tuple[int, Aftermath]:
        """Kill a pull into cache after delay and check what it left; then a rerun (a process, as
        boot runs it) must complete, and a full verify after it must find nothing to fetch.
        (exit status of the killed pull, what it left)."""
        fresh_cache(cache, self.template if from_old else None)
        state = cache / STATE_DIR / STATE_FILE
        old_state = state.read_bytes() if state.exists() else None
        code = kill_after(self.command(cache), self.env, delay)
        left = look(cache, self.new, self.old if from_old else {}, old_state, self.new_release_id)
        rerun = subprocess.run(
            self.command(cache), env=dict(self.env), capture_output=True, text=True, timeout=300, check=False
        )
        assert rerun.returncode == 0, f"the rerun after a kill at {delay:.3f} s failed: {rerun.stderr}"
        assert_installed(cache, self.new)
        report = pull(self.store, self.ref, cache, verify="full")
        assert report.files_fetched == 0 and report.files_rehashed == len(self.new), report
        return code, left

    def killed_point(self, cache: Path, delay: float, *, from_old: bool, tries: int = 4) -> tuple[int, Aftermath]:
        """point(), again at half the delay while the pull finished before its kill: the pull's
        duration was measured beforehand and a busier machine may make it shorter than measured,
        so a point is moved earlier until it lands inside a pull (each try checked all the same)."""
        for attempt in range(tries):
            code, left = self.point(cache.with_name(f"{cache.name}-{attempt}"), delay, from_old=from_old)
            if code != 0:
                break
            delay /= 2
        return code, left

    def pull_seconds(self, cache: Path, runs: int = 3, *, from_old: bool = False) -> float:
        """The median wall time of a whole pull process into an empty cache dir (or, from_old,
        one holding the old release: an upgrade, which fetches less and ends sooner)."""
        times = []
        for i in range(runs):
            fresh_cache(cache / str(i), self.template if from_old else None)
            times.append(timed_run(self.command(cache / str(i)), self.env))
        return sorted(times)[runs // 2]


def make_scenario(store: Store, env: Mapping[str, str], root: Path, *, small: int, large: int) -> Scenario:
    """Publish an old and a new release (tags "old", "new") and pull old into a template cache dir.

    New: `small` files of 1 B-64 KiB (packed on S3), `large` of 9 MiB (objects of their own,
    written with O_DIRECT) and an empty one. Old: three quarters of the small paths and the first
    large one, with other bytes: an upgrade replaces those files and adds the rest.
    """
    from neffbuild.documents.refs import resolve
    from tests.storekit import publish_release_of, write_files

    def sizes(count_small: int, count_large: int) -> dict[str, int]:
        return {f"small/{i // 100:02d}/{i:04d}.bin": 1 + (i * 7919) % 65536 for i in range(count_small)} | {
            f"large/{j}.neff": 9 << 20 for j in range(count_large)
        }

    releases = {}
    for tag, files, seed in (("old", sizes(small * 3 // 4, 1), 1), ("new", sizes(small, large) | {"empty.bin": 0}, 2)):
        src = root / f"src-{tag}"
        publish_release_of(store, src, write_files(src, files, seed=seed), name=tag, tag=tag)
        releases[tag] = resolve(store, tag)
    template = root / "template-old"
    pull(store, "old", template)
    new = releases["new"]
    return Scenario(
        store,
        env,
        "new",
        files_of(new.release.files),
        new.release_id,
        files_of(releases["old"].release.files),
        template,
    )


def phases(aftermaths: Iterable[tuple[int, Aftermath]], total: int) -> str:
    """A one-line count of where the pulls died (exit status 0: it had finished)."""
    counts = Counter("finished before the kill" if code == 0 else a.phase(total) for code, a in aftermaths)
    return ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))


def concurrent_pulls(command: Sequence[str], env: Mapping[str, str], count: int) -> list[dict]:
    """count copies of command (a `pull ... --json`) started together; their reports (all must succeed)."""
    procs = [
        subprocess.Popen(command, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(count)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * count, [err.decode()[-2000:] for _, err in outs]
    return [json.loads(out) for out, _ in outs]


@dataclass(frozen=True)
class Traffic:
    """What the server sent back through a TcpProxy, split into blob data and the rest."""

    data_bytes: int  # GETs of packs and loose blobs: the release's bytes, plus a head per response
    data_requests: int
    other_bytes: int  # documents (tag, release, bundles, locator, pack indexes), listings, marker
    requests: int

    @property
    def total(self) -> int:
        return self.data_bytes + self.other_bytes

    @classmethod
    def of(cls, exchanges: Iterable[tuple[str, str, int]]) -> Traffic:
        data = [sent for method, path, sent in exchanges if method == "GET" and _is_data(path)]
        other = [sent for method, path, sent in exchanges if not (method == "GET" and _is_data(path))]
        return cls(sum(data), len(data), sum(other), len(data) + len(other))


def _is_data(path: str) -> bool:
    key = path.split("?", 1)[0]
    return key.endswith(".pack") or "/blobs/" in key


_NO_FLOCK = "int flock(int fd, int operation) { (void)fd; (void)operation; return 0; }\n"


def no_flock_env(where: Path) -> dict[str, str] | None:
    """The environment that makes a process's flock(2) succeed without locking anything, as on a
    filesystem that ignores it (some NFS setups): a libc shim built in where and loaded first
    (LD_PRELOAD); the product is unchanged. None without a C compiler."""
    cc = shutil.which("cc")
    if cc is None:
        return None
    (where / "noflock.c").write_text(_NO_FLOCK)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(where / "noflock.so"), str(where / "noflock.c")], check=True)
    return {"LD_PRELOAD": str(where / "noflock.so")}
