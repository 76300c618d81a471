"""Prove a cache dir serves a manifest: check its files, or replay every unit and count compiles.

Compile counters alone can lie (a reported hit can still rebuild every kernel), so a replay also
counts any cache file the serving call creates, modifies or deletes as a compile.

A replay never runs against the checked dir itself: a miss would write into it and the next
replay would turn red into green. Each worker gets a private copy of it in the replay's scratch
(reflinked where the filesystem can, so nearly free on XFS or btrfs; copied otherwise), the
checked dir is only ever opened read-only, and what a miss wrote into the copy is reported as
what the replay would have written.

In place (`--in-place`), a replay runs against the checked dir itself, as a server that reads it
read-only does: refused unless this process cannot write the dir, but for the dirs the backend's
server writes even on a hit (servingenv.py), which it must be able to write. A miss then
fails as the server's would, naming the file the compiler could not write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from neffbuild.backends import get_backend
from neffbuild.backends.base import Backend
from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.manifest import LoadedManifest, load_manifest
from neffbuild.documents.refs import find_doc
from neffbuild.errors import (
    BuildError,
    DiskError,
    InputError,
    IntegrityError,
    Interrupted,
    NeffbuildError,
    NotFoundError,
    ReplayMissError,
)
from neffbuild.hashing import hash_file
from neffbuild.host.cachedir import CacheDir
from neffbuild.host.exports import serving_dirs
from neffbuild.host.trace import ReplayTrace, TracedFile, UnitTrace, write_trace
from neffbuild.host.trust import Trust, verify_release
from neffbuild.runner.jobfiles import OnPhase, Progress, WorkerJob, WrittenFile, no_progress
from neffbuild.runner.scratch import DEFAULT_LOGS_DIR, logs_dir_for, remove_tree
from neffbuild.runner.workerrun import KeptLog, WorkerRun, worker_run
from neffbuild.store import StoreChoice
from neffbuild.store.base import Store
from neffbuild.units.plan import BuildUnit, Plan, make_plan
from neffbuild.units.plancache import cache_dir as plan_cache

_ELSEWHERE = "a replay never writes into the dir it checks: give --work-dir / --outputs / --trace another place"
FICLONE = 0x40049409  # linux/fs.h: share the source's extents (a reflink), copy-on-write


@dataclass(frozen=True)
class UnitReplay:
    unit_id: str
    first_call_s: float
    compiles: int
    written: tuple[WrittenFile, ...]  # what the call wrote into the private copy
    counters: Mapping[str, int]
    output: str | None = None
    opened: tuple[str, ...] = ()  # with trace: cache files its call opened (host/trace.py)
    stopped: bool = False  # fail-fast: its call was stopped at its first compile

    @property
    def hit(self) -> bool:
        return self.compiles == 0 and not self.written

    @property
    def written_bytes(self) -> int:
        return sum(w.size for w in self.written)


@dataclass(frozen=True)
class ViewCopy:
    """What making the replay's private copies of the checked dir cost."""

    copies: int = 0  # one, plus one per model entry after an entry that wrote into its copy
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    methods: Mapping[str, int] = field(default_factory=dict)  # files per method: reflink, copy_file_range, copy


@dataclass(frozen=True)
class ReplayReport:
    cache_dir: Path
    units: tuple[UnitReplay, ...]
    view: ViewCopy = ViewCopy()
    in_place: bool = False  # against cache_dir itself, read-only to the replay (no copy)
    trace: ReplayTrace | None = None  # asked for: which cache files the replay opened
    fail_fast: bool = False  # stopped at the first miss: the units after it are not_replayed
    not_replayed: tuple[str, ...] = ()

    @property
    def misses(self) -> list[UnitReplay]:
        return [u for u in self.units if not u.hit]


@dataclass(frozen=True)
class _Replay:
    """What every model entry of one replay shares."""

    worker: WorkerRun  # the scratch root, kept logs, workers and notify of this replay
    view: Path
    env: Mapping[str, str]  # the caller's environment with the manifest's runtime env
    outputs_dir: Path | None
    trace: bool
    fail_fast: bool


@dataclass(frozen=True, slots=True)
class ReplayHow:
    """How a replay runs: in place (against the checked dir itself, which it must not be able to
    write) rather than a private copy; traced (each worker records which cache files it opened);
    fail-fast (stopped at the first miss, at its first compile where the backend can tell: no later unit replayed)."""

    in_place: bool = False
    trace: bool = False
    fail_fast: bool = False


def verify_replay(
    manifest: Path,
    cache_dir: Path,
    *,
    env: Mapping[str, str],
    work_dir: Path | None = None,
    outputs_dir: Path | None = None,
    progress: Progress = no_progress,
    how: ReplayHow = ReplayHow(),
    trace_to: Path | None = None,
) -> ReplayReport:
    """`neffbuild verify --replay [--in-place] [--fail-fast] [--trace PATH]`: replay the manifest
    against cache_dir (see replay); with trace_to, traced, the trace document written there (host/trace.py)."""
    plan = _plan_for(manifest, cache_dir, env)[1]
    if trace_to is not None:
        _check_trace_path(trace_to, cache_dir)
    with progress(len(plan.units)) as notify:
        report = replay(
            plan,
            cache_dir,
            env=env,
            work_dir=work_dir,
            outputs_dir=outputs_dir,
            logs_dir=logs_dir_for(work_dir),
            notify=notify,
            how=dataclasses.replace(how, trace=trace_to is not None),
        )
    if trace_to is not None and report.trace is not None:
        write_trace(trace_to, report.trace)
    return report


def _check_trace_path(path: Path, cache_dir: Path) -> None:
    """Before minutes of replay: the trace can be written, and not into the checked dir."""
    full = path.expanduser().resolve()
    if full.is_relative_to(cache_dir.expanduser().resolve()):
        raise InputError(f"--trace {path} is inside the checked cache dir {cache_dir}", hint=_ELSEWHERE)
    if not full.parent.is_dir() or full.is_dir():
        raise InputError(
            f"--trace {path}: {'a directory' if full.is_dir() else 'its directory does not exist'}",
            hint="give --trace a file path in an existing directory",
        )


@dataclass(frozen=True)
class FilesCheck:
    cache_dir: Path
    store_url: str
    units: tuple[UnitFiles, ...]


def verify_files(
    manifest: Path, cache_dir: Path, store: StoreChoice, *, env: Mapping[str, str], trust: Trust | None = None
) -> FilesCheck:
    """`neffbuild verify`: is every file of the manifest's bundles in cache_dir (see check_files)?
    With trusted keys, the manifest's tag (its name) must be signed, fresh and not rolled back
    (host/trust.py) before any file is looked at."""
    loaded, plan = _plan_for(manifest, cache_dir, env)
    opened = store.open(env, manifest_default=loaded.manifest.store)
    with CacheDir.opened(cache_dir) as cache:
        if trust is not None:
            verify_release(opened, loaded.manifest.name, trust, cache.read_state()[1].accepted)
        return FilesCheck(cache_dir, opened.url, check_files(plan, opened, cache.path))


def _plan_for(manifest: Path, cache_dir: Path, env: Mapping[str, str]) -> tuple[LoadedManifest, Plan]:
    loaded = load_manifest(manifest)
    plan = make_plan(loaded, env, cache=plan_cache(env))
    if not cache_dir.is_dir():
        raise InputError(f"--cache-dir {cache_dir}: no such directory", hint="pull into it first")
    return loaded, plan


def replay(
    plan: Plan,
    cache_dir: Path,
    *,
    env: Mapping[str, str],
    work_dir: Path | None = None,
    outputs_dir: Path | None = None,
    logs_dir: Path = DEFAULT_LOGS_DIR,
    notify: OnPhase | None = None,
    how: ReplayHow = ReplayHow(),
) -> ReplayReport:
    """Run every unit's warmup against a private copy of cache_dir (in_place: against cache_dir,
    which this process must not be able to write), one fresh process per model entry (as
    serving does); cache_dir itself is only read (in place: but for the backend's lock dir).
    With trace, each worker also records which cache files it opened (report.trace)."""
    in_place, trace = how.in_place, how.trace
    backend = get_backend(plan.backend_name)
    with CacheDir.opened(cache_dir) as cache:  # resolved once; in place, its read-only check
        cache_dir = cache.path
        for flag, path in (("--outputs", outputs_dir), ("--work-dir", work_dir)):
            if path and path.expanduser().resolve().is_relative_to(cache_dir):
                raise InputError(f"{flag} {path} is inside the checked cache dir {cache_dir}", hint=_ELSEWHERE)
        if outputs_dir:
            try:
                outputs_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise InputError(f"--outputs {outputs_dir}: cannot create it ({exc.strerror or exc})") from None
        if in_place:
            cache.require_read_only(plan.backend_name, serving_dirs(plan.backend_name))
        state = cache.read_state()[1] if trace else None
    results: list[UnitReplay] = []
    loading: set[str] = set()
    copy = ViewCopy()
    with worker_run(backend, work_dir, "neffbuild-replay-", logs_dir=logs_dir, notify=notify) as worker:
        if worker.root.resolve().is_relative_to(cache_dir):  # the system's temp dir is (removed on the way out)
            raise InputError(
                f"replay scratch {worker.root} is inside the checked cache dir {cache_dir}", hint=_ELSEWHERE
            )
        view = cache_dir if in_place else worker.root / "view"
        run = _Replay(worker, view, {**env, **plan.runtime_env}, outputs_dir, trace, how.fail_fast)
        dirty = not in_place
        for units in plan.by_entry().values():
            if how.fail_fast and any(not r.hit for r in results):
                break
            if dirty:  # every entry starts from the checked dir's bytes, not another entry's writes
                remove_tree(run.view)
                copy = _add(copy, make_view(cache_dir, run.view))
            before = {} if in_place else tree_state(run.view)
            replays, opened_loading = _replay_entry(units, run)
            results.extend(replays)
            loading.update(opened_loading)
            dirty = not in_place and tree_state(run.view) != before
    traced = None
    if trace:
        traced = trace_of(
            backend, cache_dir, results, loading, state.release_id if state else None, state.tag if state else None
        )
    skipped = tuple(u.unit_id for u in plan.units if u.unit_id not in {r.unit_id for r in results})
    return ReplayReport(cache_dir, tuple(results), copy, in_place, traced, how.fail_fast, skipped)


def trace_of(
    backend: Backend,
    cache_dir: Path,
    units: list[UnitReplay],
    loading: set[str],
    release_id: str | None,
    tag: str | None,
) -> ReplayTrace:
    """The trace document of a replay: what each unit opened, against what the dir holds (the
    files the backend would bundle from it; the checked dir is only read)."""
    files = tuple(TracedFile(rel, (cache_dir / rel).stat().st_size) for rel in backend.select_files(cache_dir))
    opened = set(loading).union(*(u.opened for u in units))
    return ReplayTrace(
        cache_dir=str(cache_dir),
        backend=backend.name,
        release_id=release_id,
        tag=tag,
        files=files,
        loading=tuple(sorted(loading)),
        units=tuple(UnitTrace(u.unit_id, u.opened) for u in units),
        opened=tuple(sorted(opened)),
    )


def _replay_entry(units: list[BuildUnit], run: _Replay) -> tuple[list[UnitReplay], tuple[str, ...]]:
    """The entry's replays, and the files its worker opened while loading (with run.trace)."""
    entry = units[0].entry
    scratch = run.worker.root / entry.id
    # Every variable the compiler writes through points into scratch: its cache at the private
    # copy, locks and debug output beside it.
    worker_env = run.worker.env(run.env, run.view, scratch)
    job = WorkerJob(
        purpose="replay",
        entry=entry,
        model_ref=units[0].model_ref,
        unit_ids=tuple(u.unit_id for u in units),
        shapes=tuple(u.shape for u in units),
        outputs_dir=str(run.outputs_dir) if run.outputs_dir else None,
        watch_dir=str(run.view),
        trace=run.trace,
        fail_fast=run.fail_fast,
    )
    try:
        result = run.worker.run(job, worker_env, scratch)
    except Interrupted:
        raise
    except NeffbuildError as exc:
        for u in units:
            run.worker.notify(u.unit_id, "failed")
        raise _with_kept_log(exc, run.worker.keep_log(scratch, units[0].unit_id)) from None
    replays = [
        UnitReplay(r.unit_id, r.first_call_s, r.compiles, r.written, r.counters, r.output, r.opened, r.stopped)
        for r in result.runs
    ]
    for r in replays:
        run.worker.notify(r.unit_id, "hit" if r.hit else "miss")
    return replays, result.opened_loading


def _with_kept_log(exc: NeffbuildError, kept: KeptLog) -> BuildError:
    if kept.failure:  # the replay's error is what matters; say why its log is not there
        details = [f"  log: not kept ({kept.failure})"]
    else:
        details = [f"  log: {kept.path}", *(f"  | {line}" for line in kept.tail)] if kept.path else []
    return BuildError(
        exc.message, hint="--debug shows the worker's traceback", details=details, debug_detail=exc.debug_detail
    )


def miss_error(report: ReplayReport) -> ReplayMissError | None:
    if not report.misses:
        return None
    first, total = report.misses[0], len(report.units) + len(report.not_replayed)
    message = (
        f"replay stopped at the first miss (--fail-fast): {first.unit_id} compiled, stopped "
        f"{'at its first compile' if first.stopped else 'after its call'}; {len(report.not_replayed)} of {total} "
        "units not replayed"
        if report.fail_fast
        else f"{len(report.misses)} of {total} units compiled during replay: "
        + ", ".join(u.unit_id for u in report.misses)
    )
    return ReplayMissError(
        message,
        hint="the cache does not cover them (nothing was written to it): rebuild, "
        "or compare `neffbuild plan --json` with the build host's",
    )


# -- the private copy ---------------------------------------------------------------------------


def make_view(source: Path, dest: Path) -> ViewCopy:
    """Copy source to dest (which must not exist) as cheaply as the filesystem allows. Symlinks
    are followed: the copy holds what a compiler reading source would read. Source is only read."""
    started = time.perf_counter()
    methods: Counter[str] = Counter()
    try:
        size = _copy_tree(source, dest, methods, frozenset({os.path.realpath(source)}))
    except OSError as exc:
        raise DiskError(
            f"replay: cannot copy {exc.filename or source} into its private copy at {dest}: {exc.strerror or exc}",
            hint="give --work-dir room for a copy of the cache dir (on the cache dir's filesystem, "
            "reflinks make it nearly free where supported)",
        ) from None
    return ViewCopy(1, sum(methods.values()), size, time.perf_counter() - started, dict(methods))


def _copy_tree(src: Path, dst: Path, methods: Counter[str], seen: frozenset[str]) -> int:
    dst.mkdir()
    size = 0
    with os.scandir(src) as entries:
        for entry in entries:
            target = dst / entry.name
            if entry.is_dir():
                real = os.path.realpath(entry.path)
                if real not in seen:  # a symlink loop is copied once
                    size += _copy_tree(Path(entry.path), target, methods, seen | {real})
            elif entry.is_file():
                methods[clone_file(Path(entry.path), target)] += 1
                size += target.stat().st_size
    shutil.copystat(src, dst)  # its mode (read-only stays read-only) once its files are in
    return size


def clone_file(src: Path, dst: Path) -> str:
    """Copy one file, sharing its extents where the filesystem can; the method used."""
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        method = _clone(fin.fileno(), fout.fileno())
    shutil.copystat(src, dst)
    return method


def _clone(src: int, dst: int) -> str:
    with contextlib.suppress(OSError):
        fcntl.ioctl(dst, FICLONE, src)
        return "reflink"
    size = os.fstat(src).st_size
    try:
        done = 0
        while done < size:  # in-kernel; may itself share extents (XFS, btrfs, NFS 4.2)
            n = os.copy_file_range(src, dst, size - done, done, done)
            if n == 0:
                break
            done += n
        return "copy_file_range"
    except OSError:
        os.ftruncate(dst, 0)
        with open(src, "rb", closefd=False) as fin, open(dst, "wb", closefd=False) as fout:
            fin.seek(0)
            shutil.copyfileobj(fin, fout, 1 << 20)
        return "copy"


def tree_state(root: Path) -> dict[str, tuple[int, int, int, int]]:
    """(size, mtime, inode, mode) of everything under root: equal before and after means untouched."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            state[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode)
    return state


def _add(a: ViewCopy, b: ViewCopy) -> ViewCopy:
    methods = dict(Counter(a.methods) + Counter(b.methods))
    return ViewCopy(a.copies + b.copies, a.files + b.files, a.bytes + b.bytes, a.seconds + b.seconds, methods)


@dataclass(frozen=True)
class UnitFiles:
    unit_id: str
    key: str
    built: bool
    missing: tuple[str, ...] = ()
    corrupt: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.built and not self.missing and not self.corrupt


def check_files(plan: Plan, store: Store, cache_dir: Path) -> tuple[UnitFiles, ...]:
    """Is every file of every unit's bundle in cache_dir with its recorded bytes?

    A path two units share may hold either unit's copy (the release kept one), so a file counts
    as corrupt only if it matches no bundle that lists that path.
    """
    records: dict[str, BundleRecord | None] = {}
    allowed: dict[str, set[str]] = {}
    for unit in plan.units:
        record = find_doc(store, BundleRecord, unit.key)
        records[unit.unit_id] = record
        for entry in record.files if record else ():
            allowed.setdefault(entry.path, set()).add(entry.digest)
    digests: dict[str, str | None] = {}
    results = []
    for unit in plan.units:
        record = records[unit.unit_id]
        if record is None:
            results.append(UnitFiles(unit.unit_id, unit.key, built=False))
            continue
        missing, corrupt = [], []
        for entry in record.files:
            if entry.path not in digests:
                path = cache_dir / entry.path
                digests[entry.path] = hash_file(path, crypto=False).hex if path.is_file() else None
            found = digests[entry.path]
            if found is None:
                missing.append(entry.path)
            elif found not in allowed[entry.path]:
                corrupt.append(entry.path)
        results.append(UnitFiles(unit.unit_id, unit.key, True, tuple(missing), tuple(corrupt)))
    return tuple(results)


def files_error(check: FilesCheck) -> NeffbuildError | None:
    """Units the store has no bundle for are not built (8): pulling cannot help. Otherwise missing
    or changed files are an integrity failure (4): pull again."""
    results = check.units
    not_built = [r for r in results if not r.built]
    if not_built:
        return NotFoundError(
            f"{len(not_built)} of {len(results)} units have no bundle in {check.store_url}: "
            + ", ".join(f"{r.unit_id} (key {r.key})" for r in not_built),
            hint="build them (`neffbuild build MANIFEST`), then pull",
        )
    bad = [r for r in results if not r.ok]
    if bad:
        return IntegrityError(
            f"{len(bad)} of {len(results)} units are not fully in {check.cache_dir}: "
            + ", ".join(r.unit_id for r in bad),
            hint="run `neffbuild pull` again",
        )
    return None
