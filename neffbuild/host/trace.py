"""The trace document `verify --replay --trace PATH` writes and `show REF --unused PATH` reads:
which cache files each unit's replay opened, and which files the cache dir held.

Format `neffbuild.replay-trace/1` (JSON):

    {"format": "neffbuild.replay-trace/1",
     "cache_dir": the checked dir, "backend": its backend,
     "release_id": the release a pull installed there, or null (no or an unreadable state),
     "tag": the tag it was pulled by, or null,
     "files": [{"path", "size"}],            every bundle-worthy file of the cache dir, by path
     "loading": [path],                      opened while a worker loaded its pipeline, before any call
     "units": [{"unit_id", "opened": [path]}],  opened during that unit's warmup call
     "opened": [path]}                       the union: every file the replay read

Paths are relative to the cache dir, sorted. A unit's list holds what its own call opened: a
kernel an earlier unit of the same worker process already loaded is not opened again, so only
the union answers "was this file ever read". The file is input when read back (it may come from
another host, edited or truncated): decoded strictly, any flaw an InputError naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from neffbuild.documents.records import checked, digest_problem, parse, path_problem, to_json
from neffbuild.errors import InputError, IntegrityError
from neffbuild.formats import FORMATS, writes
from neffbuild.fs.atomic import write_atomic

TRACE_FORMAT = writes("replay trace")
TRACE_MAX = 256 << 20  # a larger file is no trace of ours


def _paths_problem(paths: tuple[str, ...]) -> str | None:
    return next((p for p in map(path_problem, paths) if p), None)


def _size_problem(size: int) -> str | None:
    return None if 0 <= size < 1 << 63 else f"{size} is no file size"


def _release_problem(value: str | None) -> str | None:
    return None if value is None else digest_problem(value)


@dataclass(frozen=True, slots=True)
class TracedFile:
    path: str = field(metadata=checked(path_problem))
    size: int = field(metadata=checked(_size_problem))


@dataclass(frozen=True, slots=True)
class UnitTrace:
    unit_id: str
    opened: tuple[str, ...] = field(metadata=checked(_paths_problem))


@dataclass(frozen=True, slots=True)
class ReplayTrace:
    cache_dir: str
    backend: str
    release_id: str | None = field(metadata=checked(_release_problem))
    tag: str | None
    files: tuple[TracedFile, ...]
    loading: tuple[str, ...] = field(metadata=checked(_paths_problem))
    units: tuple[UnitTrace, ...]
    opened: tuple[str, ...] = field(metadata=checked(_paths_problem))
    format: str = TRACE_FORMAT

    @property
    def sizes(self) -> dict[str, int]:
        return {f.path: f.size for f in self.files}


def write_trace(path: Path, trace: ReplayTrace) -> None:
    """Whole or not at all (DiskError naming path): a reader never sees half a trace."""
    write_atomic(path, (json.dumps(to_json(trace), indent=1, ensure_ascii=False) + "\n").encode())


def read_trace(path: Path) -> ReplayTrace:
    """A trace file, strictly (InputError naming the file and the flaw)."""
    try:
        with path.open("rb") as f:
            data = f.read(TRACE_MAX + 1)
    except OSError as exc:
        raise InputError(f"--unused {path}: cannot read it ({exc.strerror or exc})") from None
    hint = "give the file `neffbuild verify --replay --trace PATH` wrote"
    if len(data) > TRACE_MAX:
        raise InputError(f"--unused {path}: larger than {TRACE_MAX >> 20} MiB, no replay trace", hint=hint)
    try:
        trace = parse(ReplayTrace, data, f"--unused {path}")
    except IntegrityError as exc:
        raise InputError(exc.message, hint=hint) from None
    if trace.format not in FORMATS["replay trace"].reads:  # parse accepts the one format it knows; this says so again
        raise InputError(f"--unused {path}: format {trace.format!r}, expected {TRACE_FORMAT!r}", hint=hint)
    return trace
