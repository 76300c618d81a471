"""What a cache dir holds of a release's files (it only reads: one stat per file, a hash where the
state does not vouch for one), and the state table a pull records of them."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from neffbuild.documents.records import FileEntry
from neffbuild.fs.beneath import Beneath, Hashed
from neffbuild.fs.confined import disk_error
from neffbuild.host.cachedir import CacheDir
from neffbuild.host.state import CacheState, Installed, Recorded, encode_state

HASH_RUN = 8 << 20  # bytes a verify thread reads per task: small files are not worth a hand-off each
# Files this large on average are hashed by several threads (their reads and hashes run without
# the GIL). Measured on 2 cores: 10,000 files of 34 KiB, 0.145 s in one thread, 0.17 s in two;
# with BLAKE3 beside XXH3 (which drops the GIL even on 34 KiB), 0.40 s and 0.41 s (load 3.4).
HASH_THREADED_MIN = 1 << 20

State = Mapping[str, tuple[int, int, str]]  # path -> (size, mtime_ns, digest) of what pull wrote


@dataclass(frozen=True)
class Scan:
    """What the cache dir holds of a release's files."""

    # path -> status of a file holding its bytes, else None; empty where recorded is the state:
    # every file is then as it records it (and its table is what a pull records).
    found: dict[str, os.stat_result | None]
    hashed: int = 0  # files read back and hashed (the state did not vouch for them)
    damaged: frozenset[str] = frozenset()  # paths holding a regular file with other bytes
    recorded: State | None = None  # the state scanned, where it vouched for every file and no other


def scan_files(cache: CacheDir, files: Collection[FileEntry], state: State, jobs: int) -> Scan:
    """What the cache already holds of files (only reads). One stat per file; a file of the right
    size the state does not vouch for is read and hashed, in parallel where that pays. With no
    state to vouch for anything (verify="full", a first pull), each file is opened once instead:
    its fstat stands in for the stat. Where the state is a /4 one of these files and every file is
    as it records it, only sizes and mtimes are read (no status kept): the scan of a no-op pull."""
    found: dict[str, os.stat_result | None] = {}
    damaged = set()
    absent = False
    if state:
        unsure = []
        if isinstance(state, Recorded) and state.entries is files and _as_recorded(cache, state):
            return Scan({}, recorded=state)
        paths = [f.path for f in files]  # statted again where not as recorded: that pull has work to do
        stats = _regular_stats(cache, paths)
        found = dict(zip(paths, stats, strict=True))
        for f, st in zip(files, stats, strict=True):
            if st is None:
                absent = True
            elif st.st_size != f.size:
                found[f.path] = None
                damaged.add(f.path)
            elif state.get(f.path) != (f.size, st.st_mtime_ns, f.digest):
                unsure.append(f)
    else:
        unsure = list(files)
    hashed = 0
    for f, look in zip(unsure, _look_all(cache, unsure, jobs), strict=True):
        found[f.path] = None
        if look is None:  # absent, a link, not a regular file
            continue
        st, digests = look
        hashed += st.st_size == f.size  # look reads a file only then
        if digests is not None and digests[0] == f.digest and digests[1] == f.blake3:
            found[f.path] = st
        else:
            damaged.add(f.path)
    # Every file found as the state recorded it, and the state holds no other: it is what this
    # pull would record (state_recorded then needs no second table of 10,000 entries to compare).
    whole = bool(state) and not (absent or unsure or damaged) and len(state) == len(found)
    return Scan(found, hashed, frozenset(damaged), state if whole else None)


def _as_recorded(cache: CacheDir, state: Recorded) -> bool:
    """Whether each file of a /4 state's release is found as the state records it, compared a
    column at a time: the state's table is the release's own (size, mtime, digest) where a mtime
    is recorded, so this is scan_files' per-file check for every file at once (each a regular
    file, of its size, at its recorded mtime; every one recorded)."""
    paths, sizes = state.columns()
    found_sizes: list[int | None] = []
    found_mtimes: list[int | None] = []
    with cache.beneath() as tree:
        try:
            tree.regular_sizes(paths, found_sizes, found_mtimes)
        except OSError as exc:
            raise disk_error(exc, cache.path / paths[len(found_sizes)]) from None
    return None not in found_mtimes and found_mtimes == state.mtimes and found_sizes == sizes


def _regular_stats(cache: CacheDir, paths: list[str]) -> list[os.stat_result | None]:
    with cache.beneath() as tree:
        return regular_stats(tree, paths, cache.path)


def _look_all(cache: CacheDir, files: list[FileEntry], jobs: int) -> list[tuple[os.stat_result, Hashed | None] | None]:
    """Beneath.look of each file, in runs of neighbouring files (their directories stay open)
    spread over up to jobs threads, each with its own Beneath."""

    def looks(run: list[FileEntry]) -> list[tuple[os.stat_result, Hashed | None] | None]:
        done: list[tuple[os.stat_result, Hashed | None] | None] = []
        with cache.beneath() as tree:
            try:
                for f in run:
                    done.append(tree.look(f.path, f.size, crypto=bool(f.blake3)))
            except OSError as exc:
                raise disk_error(exc, cache.path / run[len(done)].path) from None
        return done

    jobs = min(jobs, os.cpu_count() or 1)  # reading from the page cache and hashing is CPU work
    if jobs == 1 or sum(f.size for f in files) < HASH_THREADED_MIN * len(files):
        return looks(files)  # small files cost Python work per file, under the GIL: threads only contend for it
    runs = _runs(files, jobs)
    if len(runs) <= 1:
        return looks(files)
    from concurrent.futures import ThreadPoolExecutor  # only to hash large files: not on a no-op

    with ThreadPoolExecutor(max_workers=min(jobs, len(runs)), thread_name_prefix="neffbuild-verify") as pool:
        return [d for run in pool.map(looks, runs) for d in run]


def _runs(files: list[FileEntry], jobs: int) -> list[list[FileEntry]]:
    """files cut into runs of about HASH_RUN bytes (at least one file), at most 4 per thread
    and never so small that handing one to a thread costs more than reading it."""
    per_run = max(HASH_RUN, sum(f.size for f in files) // (4 * max(jobs, 1)) + 1)
    runs: list[list[FileEntry]] = [[]]
    size = 0
    for f in files:
        if size >= per_run:
            runs.append([])
            size = 0
        runs[-1].append(f)
        size += f.size
    return [r for r in runs if r]


def regular_stats(tree: Beneath, rels: list[str], cache_dir: Path) -> list[os.stat_result | None]:
    """Each rel's status if it is a regular file (a link, a directory, a FIFO... count as absent),
    in one bare loop (Beneath.regular_stats); a disk error names the path it met."""
    stats: list[os.stat_result | None] = []
    try:
        tree.regular_stats(rels, stats)
    except OSError as exc:
        raise disk_error(exc, cache_dir / rels[len(stats)]) from None
    return stats


def regular_stat(tree: Beneath, rel: str, cache_dir: Path) -> os.stat_result | None:
    return regular_stats(tree, [rel], cache_dir)[0]


def state_trusted(state: State, verify: str) -> State:
    """What of the state may stand in for reading the files: nothing with verify="full"."""
    return state if verify == "fast" else {}


def state_bytes(installed: Installed, scan: Scan, accepted: Mapping[str, int], expires: Mapping[str, str]) -> bytes:
    """The state file once scan's files are in: where every file was found as the state records
    it (scan.recorded), that table is what it records."""
    table = state_files(installed, scan.found) if scan.recorded is None else scan.recorded
    return encode_state(installed, table, accepted, expires)


def state_files(installed: Installed, found: Mapping[str, os.stat_result | None]) -> dict[str, tuple[int, int, str]]:
    files = {}
    for entry in installed.release.files:
        st = found.get(entry.path)
        if st is not None:
            files[entry.path] = (entry.size, st.st_mtime_ns, entry.digest)
    return files


def state_recorded(old: CacheState, installed: Installed, scan: Scan) -> bool:
    """Whether the state file already says what this pull would write: compared as data, not
    encoded (0.2 s for a 10,000-file release); equal inputs encode to equal bytes. A scan that
    found every file as the state's table says (scan.recorded) is that table."""
    if old.version != 4 or old.installed != installed:  # an earlier format is rewritten as /4
        return False
    return scan.recorded is old.files or old.files == state_files(installed, scan.found)


def state_size(installed: Installed) -> int:
    """The state file's size once every file is in (an mtime of 19 digits, as in ns today)."""
    return len(encode_state(installed, {f.path: (f.size, 1 << 62, f.digest) for f in installed.release.files}))
