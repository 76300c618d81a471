"""`neffbuild.serve.warmup`: a readiness gate for the serving process.

After `prepare`, the pipeline is called once per shape the manifest lists, in this process,
before any traffic: each call loads its graphs from the pulled cache (or compiles, which is the
failure this gate exists to catch before a user's request does). The same call the build and
`verify --replay` make (backends/calls.py), so a warm-up that passes proves what a replay proves,
in the process that will serve.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Collection, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from neffbuild.backends import get_backend
from neffbuild.backends.calls import measured_call
from neffbuild.documents.manifest import LoadedManifest, ModelEntry, load_manifest
from neffbuild.errors import DiskError, NotFoundError, WarmupMiss
from neffbuild.fs.atomic import write_atomic
from neffbuild.host.pull import installed_exports
from neffbuild.serve.prepare import prepare, select_entry

READINESS_FORMAT = 1


@dataclass(frozen=True, slots=True)
class ShapeWarmup:
    shape: str  # the manifest's label, e.g. 128x256x1
    seconds: float
    compiles: int  # compiler-cache misses during the call: 0 on a hit
    counters: dict[str, int]  # the counters that changed (fxgraph_cache_hit, graphs.<component>, ...)


@dataclass(frozen=True, slots=True)
class WarmupReport:
    manifest: str  # the manifest's name
    entry: str
    backend: str
    shapes: tuple[ShapeWarmup, ...]
    seconds: float

    @property
    def missed(self) -> tuple[ShapeWarmup, ...]:
        return tuple(s for s in self.shapes if s.compiles)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": not self.missed}


def warmup(
    pipe: Any,
    manifest: str | os.PathLike[str] | LoadedManifest,
    entry: str | None = None,
    *,
    readiness_file: str | os.PathLike[str] | None = None,
) -> WarmupReport:
    """Call the prepared `pipe` once per listed shape of the entry; raise WarmupMiss (exit 6)
    naming every shape that compiled. With readiness_file: removed first (a restarted server is
    not ready until it has warmed up again), written atomically once every shape hit."""
    loaded = manifest if isinstance(manifest, LoadedManifest) else load_manifest(Path(manifest))
    chosen = select_entry(loaded, type(pipe).__name__, entry)
    ready = Path(readiness_file) if readiness_file is not None else None
    if ready is not None:
        _remove(ready)
    report = run_warmup(pipe, loaded, chosen)
    error = warmup_error([report])
    if error is not None:
        raise error
    if ready is not None:
        write_readiness(ready, report)
    return report


def run_warmup(pipe: Any, loaded: LoadedManifest, entry: ModelEntry) -> WarmupReport:
    backend = get_backend(entry.backend)
    started = time.perf_counter()
    shapes = []
    for shape in entry.expanded_shapes():
        call = measured_call(backend, pipe, entry, shape)
        shapes.append(ShapeWarmup(shape.label, round(call.seconds, 3), call.compiles, call.counters))
    return WarmupReport(
        manifest=loaded.manifest.name,
        entry=entry.id,
        backend=entry.backend,
        shapes=tuple(shapes),
        seconds=round(time.perf_counter() - started, 3),
    )


def miss_message(report: WarmupReport) -> str:
    missed = ", ".join(f"{s.shape} ({s.compiles} compiles, {s.seconds:.1f} s)" for s in report.missed)
    return f"warm-up of model[{report.entry}] compiled at {len(report.missed)} listed shape(s): {missed}"


MISS_HINT = (
    "the cache dir does not hold what the manifest lists for this host: `neffbuild status` against the "
    "release says which units are missing or which host facts differ; pull a release that has them"
)


def write_readiness(path: Path, *reports: WarmupReport) -> None:
    document = {
        "neffbuild_ready": READINESS_FORMAT,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "entries": [r.to_json() for r in reports],
    }
    write_atomic(path, (json.dumps(document, indent=1) + "\n").encode())  # DiskError naming it


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise DiskError(f"readiness file {path}: {exc.strerror or exc}", hint="make its directory writable") from None


def warmup_cache_dir(
    manifest: Path,
    cache_dir: Path,
    *,
    environ: MutableMapping[str, str],
    entry: str | None = None,
    allow_env: Collection[str] = (),
    readiness_file: Path | None = None,
) -> tuple[WarmupReport, ...]:
    """`neffbuild warmup`: in this process, as a server would, export what the cache dir's
    installed release sets (into `environ`, before torch is imported), load each entry's pipeline
    (or `entry`'s), prepare it and warm it up. The readiness file is written once all passed;
    warmup_error says whether they did."""
    loaded = load_manifest(manifest)
    entries = [select_entry(loaded, "", entry)] if entry is not None else list(loaded.manifest.models)
    if readiness_file is not None:
        _remove(readiness_file)
    try:
        exports = installed_exports(cache_dir, allow_env=allow_env)
    except NotFoundError as exc:  # its hint names `env`'s own way out (TAG --store), which warmup has not
        hint = f"pull a release into it first: neffbuild pull TAG --cache-dir {cache_dir}"
        raise NotFoundError(exc.message, hint=hint) from None
    environ.update(exports)
    reports = []
    for chosen in entries:
        backend = get_backend(chosen.backend)
        pipe = backend.load_pipeline(chosen, loaded.resolve_model(chosen))
        pipe = prepare(pipe, loaded, chosen.id)
        reports.append(run_warmup(pipe, loaded, chosen))
    if readiness_file is not None and warmup_error(reports) is None:
        write_readiness(readiness_file, *reports)
    return tuple(reports)


def warmup_error(reports: Sequence[WarmupReport]) -> WarmupMiss | None:
    missed = [r for r in reports if r.missed]
    return WarmupMiss("; ".join(miss_message(r) for r in missed), hint=MISS_HINT) if missed else None
