"""`neffbuild show REF --unused TRACE`: the files of a release (or a bundle) that no unit opened in
a traced replay (`verify --replay --trace`, host/trace.py): dead weight every pull moves.

The trace is judged against the release, not trusted to match it: a trace of another release's
cache dir (another installed release id, or files of this release it did not hold, or held with
other sizes) says so in `mismatch`; the list is then what that replay did not open, no more.
Files the trace lists that the release lacks are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from neffbuild.documents.bundles import ResolvedBundle
from neffbuild.documents.records import FileEntry
from neffbuild.documents.refs import resolve_any
from neffbuild.host.trace import read_trace
from neffbuild.store.base import Store


@dataclass(frozen=True)
class UnusedFile:
    path: str
    size: int


@dataclass(frozen=True)
class UnusedReport:
    ref: str  # the release id, or the bundle key
    name: str  # the release's name, or the bundle's unit id
    tag: str | None
    trace: str  # the trace file
    files: int  # in the release
    bytes: int
    opened: int  # of the release's files, how many the replay opened
    opened_bytes: int
    unused: tuple[UnusedFile, ...]  # largest first
    unused_bytes: int
    mismatch: tuple[str, ...]  # why the trace may not be of this release; empty when it is


def unused(store: Store, ref: str, trace_path: Path) -> UnusedReport:
    trace = read_trace(trace_path)  # before the store: a bad file fails fast
    found = resolve_any(store, ref)
    files: Sequence[FileEntry]
    if isinstance(found, ResolvedBundle):
        ref_id, name, tag, files = found.key, found.record.unit_id, None, found.record.files
    else:
        ref_id, name, tag, files = found.release_id, found.release.name, found.tag, found.release.files
    opened = set(trace.opened)
    unread = sorted((f for f in files if f.path not in opened), key=lambda f: (-f.size, f.path))
    read = [f for f in files if f.path in opened]
    return UnusedReport(
        ref=ref_id,
        name=name,
        tag=tag,
        trace=str(trace_path),
        files=len(files),
        bytes=sum(f.size for f in files),
        opened=len(read),
        opened_bytes=sum(f.size for f in read),
        unused=tuple(UnusedFile(f.path, f.size) for f in unread),
        unused_bytes=sum(f.size for f in unread),
        mismatch=_mismatch(files, trace.sizes, trace.release_id, None if isinstance(found, ResolvedBundle) else ref_id),
    )


def _mismatch(
    files: Sequence[FileEntry], traced: dict[str, int], traced_release: str | None, release_id: str | None
) -> tuple[str, ...]:
    problems = []
    if release_id is not None and traced_release is not None and traced_release != release_id:
        problems.append(f"the traced cache dir held release {traced_release}, not {release_id}")
    absent = [f for f in files if f.path not in traced]
    other = [f for f in files if f.path in traced and traced[f.path] != f.size]
    if absent:
        problems.append(f"{len(absent)} of its {len(files)} files were not in the traced cache dir")
    if other:
        problems.append(f"{len(other)} of its files had other sizes in the traced cache dir")
    return tuple(problems)
