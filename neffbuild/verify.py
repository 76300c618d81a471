"""Prove a cache dir serves a manifest: check its files, or replay every unit and count compiles.

Compile counters alone can lie (a reported hit can still rebuild every kernel), so a replay also
counts any cache file the serving call creates or modifies as a compile.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from neffbuild.backends import get_backend
from neffbuild.bundle import BundleRecord, parse
from neffbuild.hashing import hash_file
from neffbuild.jobs import WorkerJob, run_worker
from neffbuild.plan import Plan
from neffbuild.store.base import Store


@dataclass(frozen=True)
class UnitReplay:
    unit_id: str
    first_call_s: float
    compiles: int
    written: tuple[str, ...]
    counters: Mapping[str, int]
    output: str | None = None

    @property
    def hit(self) -> bool:
        return self.compiles == 0 and not self.written


@dataclass(frozen=True)
class ReplayReport:
    cache_dir: Path
    units: tuple[UnitReplay, ...]

    @property
    def misses(self) -> list[UnitReplay]:
        return [u for u in self.units if not u.hit]


def replay(
    plan: Plan,
    cache_dir: Path,
    *,
    env: Mapping[str, str],
    work_dir: Path | None = None,
    outputs_dir: Path | None = None,
) -> ReplayReport:
    """Run every unit's warmup against cache_dir, one fresh process per model entry (as serving does)."""
    backend = get_backend(plan.backend_name)
    cache_dir = cache_dir.expanduser().resolve()
    scratch_root = Path(tempfile.mkdtemp(prefix="neffbuild-replay-", dir=work_dir))
    results: list[UnitReplay] = []
    try:
        for entry_id, units in plan.by_entry().items():
            scratch = scratch_root / entry_id
            worker_env = {**env, **plan.runtime_env, **backend.worker_env(cache_dir, scratch)}
            job = WorkerJob(
                purpose="replay",
                entry=units[0].entry,
                model_ref=units[0].model_ref,
                unit_ids=tuple(u.unit_id for u in units),
                shapes=tuple(u.shape for u in units),
                outputs_dir=str(outputs_dir) if outputs_dir else None,
                watch_dir=str(cache_dir),
            )
            result = run_worker(lambda f, e=units[0].entry: backend.launch_command(e, f), job, worker_env, scratch)
            results.extend(
                UnitReplay(r.unit_id, r.first_call_s, r.compiles, r.written, r.counters, r.output) for r in result.runs
            )
    finally:
        shutil.rmtree(scratch_root, ignore_errors=True)
    return ReplayReport(cache_dir, tuple(results))


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
        data = store.get_doc("bundles", unit.key)
        record = parse(BundleRecord, data, f"{store.url}/bundles/{unit.key}.json") if data else None
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
                digests[entry.path] = hash_file(path).hex if path.is_file() else None
            found = digests[entry.path]
            if found is None:
                missing.append(entry.path)
            elif found not in allowed[entry.path]:
                corrupt.append(entry.path)
        results.append(UnitFiles(unit.unit_id, unit.key, True, tuple(missing), tuple(corrupt)))
    return tuple(results)
