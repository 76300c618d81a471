"""Warmup-compile every unit of a plan in fresh processes and publish what each produced.

Per unit: an empty cache dir, a worker process that loads the pipeline and runs the serving call
at the unit's shape, then the files that call wrote are hashed and published as a bundle. Units
whose bundle the store already holds are skipped. Only when every unit is present does the build
publish a release and move the tag.

A failing unit's worker log, job and result are copied out of its scratch dir (deleted at the
end unless --keep-work) to `<logs dir>/<run>/<unit>/`, and the failure names them. SIGINT or
SIGTERM stops every worker, removes the scratch and raises Interrupted (runner/workers.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from neffbuild.backends import get_backend
from neffbuild.backends.base import Backend, components_without_graphs, no_graph_hint
from neffbuild.backends.components import GRAPH_PREFIX
from neffbuild.build.fanin import planned, release_bundles
from neffbuild.build.fleet import checked_document, select
from neffbuild.build.publish import publish_bundle
from neffbuild.build.report import BuildReport, UnitOutcome, emit, from_build
from neffbuild.build.sizing import unit_shares
from neffbuild.documents.bundles import BundleRecord, Timings
from neffbuild.documents.manifest import Shape, load_manifest
from neffbuild.documents.records import FileEntry
from neffbuild.documents.signing import Signing
from neffbuild.errors import BuildError, Interrupted, NeffbuildError, NotFoundError, PartlyCompiledError, WorkerKilled
from neffbuild.fs.room import require_scratch
from neffbuild.hashing import hash_file
from neffbuild.printable import printable
from neffbuild.runner.jobfiles import Progress, ShapeRun, WorkerJob, no_progress
from neffbuild.runner.memory import MemoryGate, available_memory
from neffbuild.runner.scratch import logs_dir_for
from neffbuild.runner.unitdir import unit_scratch, units_root
from neffbuild.runner.workerrun import WorkerRun, worker_run
from neffbuild.runner.workers import Workers
from neffbuild.store import StoreChoice
from neffbuild.store.base import Store
from neffbuild.store.blobs import BlobSource
from neffbuild.units.plan import BuildUnit, Plan, check_buildable, make_plan
from neffbuild.units.plancache import cache_dir as plan_cache
from neffbuild.units.shards import ShardSpec
from neffbuild.version import __version__

log = logging.getLogger(__name__)

# (unit_id, status) for progress displays: a phase the worker reports ("loading", "compiling"),
# "publishing", then a final status ("built", "present", "failed").
Notify = Callable[[str, str], None]


@dataclass(frozen=True)
class _Run:
    """What every unit of one build shares."""

    backend: Backend
    store: Store
    env: Mapping[str, str]
    worker: WorkerRun  # the scratch root, kept logs, workers and notify of this build
    retries: int = 0
    units_root: Path = Path()  # where each unit compiles at a path of its own (unitdir.py)
    keep_work: bool = False
    gate: MemoryGate = field(default_factory=lambda: MemoryGate(None))
    unit_memory: int | None = None
    shares: Mapping[str, int] = field(default_factory=dict)  # --unit-memory auto: bytes by unit id


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """How units are built: the tag a complete build moves (default: the manifest's name), workers
    in parallel, scratch space (and its logs/ for failed units), tries after a first failure."""

    tag: str | None = None
    jobs: int = 1
    work_dir: Path | None = None
    keep_work: bool = False
    retries: int = 0
    logs_dir: Path | None = None  # None: logs_dir_for(work_dir)
    unit_memory: int | None = None  # bytes one unit's compile needs (None: workers bounded by jobs only)
    memory_auto: bool = False  # --unit-memory auto: each unit's share from recorded peaks (sizing.py)
    memory_budget: int | None = None  # bytes the units may share (None: what is available at the start)
    may_release: bool = True  # False: never release, even having built every unit (a Ray task's driver does)
    signing: Signing | None = None  # --sign-key / --expires: sign the release and its tag statement


@dataclass(frozen=True, kw_only=True)
class FleetChoice:
    """Which units this process builds (a shard, from --shard or the engine's environment, or a
    plan document's), and where its report goes."""

    shard: ShardSpec | None = None
    shard_count: int | None = None
    plan_file: Path | None = None
    report_file: Path | None = None


def build_manifest(
    manifest: Path,
    store: StoreChoice,
    *,
    env: Mapping[str, str],
    options: BuildOptions | None = None,
    fleet: FleetChoice | None = None,
    progress: Progress = no_progress,
) -> BuildReport:
    """`neffbuild build`: plan the manifest (or check --plan's against this host), open (or
    create) its store, build every unit or this shard's.

    A plan that cannot be built is refused before the store is created, so it leaves nothing
    behind; failed units' logs go to --work-dir's logs/ (runner/scratch.py).
    """
    o, f = options or BuildOptions(), fleet or FleetChoice()
    loaded = load_manifest(manifest)
    plan = make_plan(loaded, env, cache=plan_cache(env))
    check_buildable(plan)
    document = checked_document(plan, f.plan_file)
    opened = store.open(env, manifest_default=loaded.manifest.store, create=True)
    chosen = select(plan, opened, env=env, shard=f.shard, shard_count=f.shard_count, document=document, tag=o.tag)
    label = chosen.shard.label if chosen.shard and chosen.shard.count > 1 else None
    with progress(len(chosen.units)) as notify:
        report = build(plan, opened, env=env, options=o, notify=notify, units=chosen.units, shard=label)
    emit(from_build(report), f.report_file, env)
    return report


def build(
    plan: Plan,
    store: Store,
    *,
    env: Mapping[str, str],
    options: BuildOptions | None = None,
    notify: Notify | None = None,
    units: Sequence[BuildUnit] | None = None,
    shard: str | None = None,
) -> BuildReport:
    """Build `units` (default: all of the plan's, in the order given: long ones first pays off),
    each up to 1 + retries times. Only a build of every unit in this one process releases and
    moves the tag; a shard leaves that to `neffbuild release`, which sees every shard's bundles."""
    o = options or BuildOptions()
    check_buildable(plan)
    chosen = tuple(plan.units if units is None else units)
    backend = get_backend(plan.backend_name)
    name = o.tag or plan.loaded.manifest.name
    logs_dir = o.logs_dir or logs_dir_for(o.work_dir)
    with worker_run(
        backend, o.work_dir, "neffbuild-work-", logs_dir=logs_dir, notify=notify, keep=o.keep_work
    ) as worker:
        shares = unit_shares(store, plan.units, chosen, name) if o.memory_auto else {}
        run = _Run(
            backend,
            store,
            env,
            worker,
            retries=o.retries,
            units_root=units_root(o.work_dir),
            keep_work=o.keep_work,
            gate=_gate(o, len(chosen)),
            unit_memory=o.unit_memory,
            shares={unit_id: s.need for unit_id, s in shares.items()},
        )
        outcomes = _in_parallel(lambda u: _unit_outcome(u, run), chosen, o.jobs, worker.workers)
    # Built longest first (fleet.select); reported in the manifest's order, as plan lists them.
    order = {u.unit_id: i for i, u in enumerate(plan.units)}
    outcomes = sorted(outcomes, key=lambda outcome: order.get(outcome.unit_id, len(order)))
    report = BuildReport(plan.loaded.manifest.name, store.url, tuple(outcomes), None, None, shard, len(plan.units))
    if report.failed or not report.complete or not o.may_release:
        return report
    released = release_bundles(store, planned(plan), tag=name, signing=o.signing)
    if released.missing:  # each unit was present or built above
        unit_id, key = next(u for u in released.units if u[0] == released.missing[0])
        raise NotFoundError(
            f"bundle {key} not found in {store.url}", hint=f"{unit_id}: it vanished during the build; rerun it"
        )
    return replace(report, release_id=released.release_id, tag=released.tag)


def _in_parallel(
    do: Callable[[BuildUnit], UnitOutcome], units: Sequence[BuildUnit], jobs: int, workers: Workers
) -> list[UnitOutcome]:
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        futures = [pool.submit(do, u) for u in units]
        return [f.result() for f in futures]
    except BaseException:
        workers.stop()  # first: the pool's threads are waiting for the workers to end
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _unit_outcome(unit: BuildUnit, run: _Run) -> UnitOutcome:
    if run.store.get_doc("bundles", unit.key) is not None:
        run.worker.notify(unit.unit_id, "present")
        return UnitOutcome(unit.unit_id, unit.key, "present")
    queued = time.monotonic()
    with run.gate.share(run.shares.get(unit.unit_id, run.unit_memory)):
        started = time.monotonic()
        for attempt in range(1, run.retries + 2):
            outcome = _attempt(unit, run, started)
            if outcome.status != "failed" or attempt > run.retries:
                if outcome.status == "failed":
                    run.worker.notify(unit.unit_id, "failed")
                phases = {"queue": round(started - queued, 3), **outcome.phases}  # the memory gate's wait
                return replace(outcome, attempts=attempt, phases=phases)
            run.worker.notify(unit.unit_id, f"retrying ({attempt} of {run.retries} retries) after: {outcome.error}")
    raise AssertionError("unreachable: the last attempt returns")


def _gate(o: BuildOptions, units: int) -> MemoryGate:
    """The memory gate of --unit-memory: the budget given, or what is available now."""
    if o.unit_memory is None and not o.memory_auto:
        return MemoryGate(None)
    budget = o.memory_budget if o.memory_budget is not None else available_memory()
    if budget is None:
        log.warning("--unit-memory: the available memory cannot be read here; workers are bounded by --jobs only")
    elif o.unit_memory is None:
        log.info("memory: %s for the units' shares (from their recorded peaks)", _gib(budget))
    else:
        fits = max(1, budget // o.unit_memory)
        log.info(
            "memory: %s for %s per unit: up to %d of %d workers at once",
            _gib(budget),
            _gib(o.unit_memory),
            min(fits, o.jobs),
            o.jobs,
        )
    return MemoryGate(budget)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _attempt(unit: BuildUnit, run: _Run, started: float) -> UnitOutcome:
    # The same dir for the same unit on every build: the compiled bytes name it (unitdir.py).
    waited: list[bool] = []

    def on_wait() -> None:
        waited.append(True)
        run.worker.notify(unit.unit_id, "waiting for another build of it on this host")

    with unit_scratch(run.units_root, unit.key, keep=run.keep_work, on_wait=on_wait) as scratch:
        if waited and run.store.get_doc("bundles", unit.key) is not None:
            run.worker.notify(unit.unit_id, "present")  # the other build published it meanwhile
            return UnitOutcome(unit.unit_id, unit.key, "present")
        try:
            outcome = build_unit(unit, run.backend, run.store, run.env, scratch, run.worker)
        except Interrupted:
            raise
        except (
            NeffbuildError,
            OSError,
        ) as exc:  # an OSError here is this unit's (its scratch, its files), not the build's
            return _failed(unit, run, scratch, exc, started)
    run.worker.notify(unit.unit_id, "built")
    return replace(outcome, seconds=time.monotonic() - started)


def _failed(unit: BuildUnit, run: _Run, scratch: Path, exc: NeffbuildError | OSError, started: float) -> UnitOutcome:
    """The failed unit's outcome, with its worker's log kept (if it can be: that is not worth
    failing the whole build for)."""
    if isinstance(exc, NeffbuildError):
        error, debug = (f"{exc.message} ({exc.hint})" if exc.hint else exc.message), exc.debug_detail
    else:
        error, debug = f"{exc.filename or scratch}: {exc.strerror or exc}", None
    killed = exc.how if isinstance(exc, WorkerKilled) else None
    kept = run.worker.keep_log(scratch, unit.unit_id)
    if kept.failure:
        error += f"; its log could not be kept ({kept.failure})"
    return UnitOutcome(
        unit.unit_id,
        unit.key,
        "failed",
        compiles=getattr(exc, "compiles", 0),  # what the warmup compiled before it failed
        error=error,
        seconds=time.monotonic() - started,
        log=str(kept.path) if kept.path else None,
        log_tail=kept.tail,
        worker_traceback=debug,
        killed=killed,
    )


def build_unit(
    unit: BuildUnit,
    backend: Backend,
    store: Store,
    env: Mapping[str, str],
    scratch: Path,
    worker: WorkerRun,
) -> UnitOutcome:
    """Compile one unit in a fresh process with an empty cache dir (a worker of `worker`'s run);
    publish its bundle."""
    cache_dir = scratch / "cache"
    cache_dir.mkdir(parents=True)
    worker_env = worker.env({**env, **unit.env}, cache_dir, scratch)
    require_scratch(backend.scratch_dirs(scratch, worker_env), backend.scratch_min_free)
    shapes = warmup_shapes(unit)
    job = WorkerJob(
        purpose="build",
        entry=unit.entry,
        model_ref=unit.model_ref,
        unit_ids=tuple(f"{unit.entry.id}/{unit.entry.unit_label(shape)}" for shape in shapes),
        shapes=tuple(shapes),
    )
    result = worker.run(job, worker_env, scratch)
    publishing = time.monotonic()
    worker.notify(unit.unit_id, "publishing")
    _check_fingerprint(unit, result.fingerprint)
    run = _merged(result.runs)
    silent = components_without_graphs(unit.entry, run.counters)
    if silent:
        compiled = sorted(
            {k.removeprefix(GRAPH_PREFIX) for k, v in run.counters.items() if k.startswith(GRAPH_PREFIX) and v > 0}
        )
        also = f" (compiled: {', '.join(compiled)})" if compiled else ""
        raise PartlyCompiledError(
            f"{unit.unit_id}: component {silent[0]!r} produced no graph{also}",
            hint=no_graph_hint(silent[0]),
            compiles=run.compiles,
        )
    unknown = backend.unrecognised_files(cache_dir)
    if unknown:  # another layout: a bundle without it would be reported built and miss when served
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise BuildError(
            f"{unit.unit_id}: the compiler wrote {printable(unknown[0])}{more} in {backend.cache_env}, "
            f"in a layout the {backend.name} backend does not bundle",
            hint=f"the compiler's cache layout changed: teach select_files in neffbuild/backends/{backend.name}.py",
        )
    files = _hash_outputs(backend, cache_dir)
    if not files and (unit.entry.mode != "eager" or backend.caches_eager):
        eager = " (mode eager: every op compiles on its first run)" if unit.entry.mode == "eager" else ""
        raise BuildError(
            f"{unit.unit_id}: the warmup wrote no cache files{eager}", hint=f"is {backend.cache_env} honoured?"
        )
    record = BundleRecord(
        key=unit.key,
        unit_id=unit.unit_id,
        unit=dict(unit.normalized),
        backend=backend.name,
        fingerprint=dict(unit.fingerprint),
        files=tuple(FileEntry(path=p, size=s.size, digest=s.digest, blake3=s.blake3) for p, s in files),
        counters=run.counters,
        inputs=dict(run.inputs),
        env_reads=dict(result.env_reads),
        compiler_keys=dict(result.compiler_keys),
        timings=Timings(load_s=result.load_s, first_call_s=run.first_call_s, total_s=result.load_s + run.first_call_s),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        neffbuild_version=__version__,
        peak_rss=result.peak_rss,
    )
    uploaded = publish_bundle(store, record, [s for _, s in files], jobs=4)
    return UnitOutcome(
        unit.unit_id,
        unit.key,
        "built",
        files=len(files),
        size=sum(s.size for _, s in files),
        uploaded=uploaded,
        first_call_s=run.first_call_s,
        compiles=run.compiles,
        peak_rss=result.peak_rss,
        counters=dict(run.counters),
        phases=_phases(result.load_s, run, time.monotonic() - publishing),
    )


def _phases(load_s: float, run: ShapeRun, publish_s: float) -> dict[str, float]:
    """Seconds by phase of one built unit (UnitOutcome.phases)."""
    rest = max(0.0, run.first_call_s - run.trace_s - run.compile_s)
    seconds = {"load": load_s, "trace": run.trace_s, "compile": run.compile_s, "run": rest, "publish": publish_s}
    return {name: round(s, 3) for name, s in seconds.items()}


def warmup_shapes(unit: BuildUnit) -> list[Shape]:
    """The shapes a unit's worker calls, in order. Static: its own. Dynamic: the entry's shapes up
    to its own, in the manifest's order, as a server warms up: the symbolic graph is the one the
    first shape traces, and each unit's cache is what such a server finds (the recipe's
    specialize_float makes that first call hit: backends/recipe.py)."""
    if not unit.entry.compile.dynamic:
        return [unit.shape]
    shapes = unit.entry.expanded_shapes()
    return shapes[: shapes.index(unit.shape) + 1]


def _merged(runs: Sequence[ShapeRun]) -> ShapeRun:
    """One unit's run from its worker's calls: the counters and compiles of all, the time of its own (the last)."""
    if len(runs) == 1:
        return runs[0]
    counters: dict[str, int] = {}
    for run in runs:
        for name, value in run.counters.items():
            counters[name] = counters.get(name, 0) + value
    inputs = {k: v for run in runs for k, v in run.inputs.items()}
    traced, compiled = sum(r.trace_s for r in runs), sum(r.compile_s for r in runs)
    return runs[-1].model_copy(
        update={
            "counters": counters,
            "compiles": sum(r.compiles for r in runs),
            "inputs": inputs,
            "trace_s": traced,
            "compile_s": compiled,  # every call's compiling (the earlier ones warm the last up)
        }
    )


def _hash_outputs(backend: Backend, cache_dir: Path) -> list[tuple[str, BlobSource]]:
    out = []
    for rel in backend.select_files(cache_dir):
        digest = hash_file(cache_dir / rel)
        out.append((rel, BlobSource(digest.hex, digest.size, cache_dir / rel, digest.blake3)))
    return out


def _check_fingerprint(unit: BuildUnit, seen: Mapping[str, str]) -> None:
    """The worker must have run in the environment the key promises, or the key would lie."""
    differing = sorted(k for k in set(seen) | set(unit.fingerprint) if seen.get(k) != unit.fingerprint.get(k))
    if differing:
        detail = ", ".join(f"{k}: planned {unit.fingerprint.get(k)!r}, worker {seen.get(k)!r}" for k in differing[:4])
        raise BuildError(
            f"{unit.unit_id}: worker environment differs from the plan ({detail})",
            hint="do not change the environment during a build",
        )


def failure(report: BuildReport) -> BuildError:
    """The one error a build with failed units ends with: each unit's error and kept log, and the
    last lines of the first one's log (its --debug detail: that worker's traceback)."""
    failed = report.failed
    first = failed[0]
    details = []
    for o in failed:
        if o is not first:  # the first one's error is the message
            details.append(str(o.error))
        details.append(f"  log: {o.log or '(none kept)'}")
        if o is first and o.log_tail:
            details.extend(f"  | {line}" for line in o.log_tail)
    # Only killed workers: a retry may pass, so the exit code (15) lets a fleet retry this shard.
    kind = WorkerKilled if all(o.killed for o in failed) else BuildError
    return kind(
        f"{len(failed)} of {len(report.outcomes)} units failed; first: {first.error}",
        hint="--debug shows the worker's traceback, --keep-work keeps each unit's scratch dir (cache, job); "
        "units already built are kept, so a rerun builds only the rest",
        details=details,
        debug_detail=first.worker_traceback,
    )
