"""`neffbuild suggest`: turn what serving hosts compiled into the manifest shapes that would have
covered it.

Each event (maint/events.py) is judged against the manifest's plan for its entry, in order: the
manifest and entry it names, the entry's pipeline, dtype and backend, the serving host's
fingerprint against the one the plan keys the entry with (a breaking field means no shape would
have helped: the host could not use the cache anyway; informational ones are noted, its shape is
still added), then the call's size against the entry's own checks (limits, the pipeline's size
multiple). What passes is a shape the entry lacks; what does not is listed with its reason.

The shapes become a manifest edit (maint/shapeedit.py), checked before anyone sees it the way
`plan` checks a manifest: loaded, planned, expanding to the old units plus exactly the new ones.
`--write` replaces the file atomically, only if it is still what was read.
"""

from __future__ import annotations

import difflib
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import ValidationError

from neffbuild.backends import get_backend
from neffbuild.documents.manifest import LoadedManifest, ModelEntry, Shape, load_manifest, shape_multiple
from neffbuild.documents.manifest_types import MAX_IMAGES
from neffbuild.errors import ConflictError, DiskError, ManifestError
from neffbuild.fs.atomic import write_atomic
from neffbuild.maint.events import EventsRead, Located, Skipped, read_events
from neffbuild.maint.shapeedit import add_shapes, cover
from neffbuild.units.plan import FactsProvider, Plan, collect_facts, make_plan


@dataclass(frozen=True)
class FieldChange:
    """A field the event's side has otherwise than the plan (None: that side has no such field)."""

    name: str
    planned: str | None
    event: str | None
    breaking: bool


@dataclass(frozen=True)
class Unexplained:
    """Events no shape change explains, grouped by entry, reason and differing fields."""

    entry: str | None
    reason: str
    changes: tuple[FieldChange, ...]
    events: int
    hosts: tuple[str, ...]
    first: str  # FILE:LINE of the first such event


@dataclass(frozen=True)
class EntryShapes:
    entry: str
    added: tuple[str, ...]  # unit labels HxWxB, as plan names them
    written: tuple[str, ...]  # how: `shapes: width += 384`, `shapes: add { ... }`
    events: int
    hosts: tuple[str, ...]
    informational: tuple[FieldChange, ...] = ()  # fingerprint fields that differ without breaking a hit


@dataclass(frozen=True)
class Suggestion:
    manifest: Path
    files: int
    events: int
    hosts: tuple[str, ...]
    skipped: tuple[Skipped, ...]
    entries: tuple[EntryShapes, ...]
    unexplained: tuple[Unexplained, ...]
    covered: int  # events at a listed shape that compiled nothing (served from the cache)
    before: str = field(repr=False)
    after: str = field(repr=False)
    written: bool = False

    @property
    def changed(self) -> bool:
        return self.before != self.after

    @property
    def diff(self) -> str:
        name = str(self.manifest)
        return "".join(
            difflib.unified_diff(
                self.before.splitlines(keepends=True), self.after.splitlines(keepends=True), f"a/{name}", f"b/{name}"
            )
        )


def suggest(
    manifest: Path,
    events: Sequence[Path],
    *,
    env: Mapping[str, str],
    write: bool = False,
    facts_provider: FactsProvider = collect_facts,
) -> Suggestion:
    """Read the event files, judge each event against MANIFEST's plan, and propose (or with write,
    apply) the shapes that explain them. ManifestError if the edit would not plan; DiskError (a
    read-only manifest) or ConflictError (edited meanwhile) from write, the file left as it was."""
    before = _read_text(manifest)
    loaded = load_manifest(manifest, text=before)
    plan = make_plan(loaded, env, facts_provider)
    read = read_events(events)
    judged = judge(read, loaded, plan)
    products = {entry: cover(shapes) for entry, shapes in judged.new_shapes.items()}
    after, changes = add_shapes(before, products) if products else (before, [])
    if products:
        _check_edit(loaded, after, judged.new_shapes, env, facts_provider)
    entries = tuple(
        EntryShapes(
            entry=entry,
            added=tuple(_label(loaded, entry, s) for s in shapes),
            written=tuple(c.text for c in changes if c.entry == entry),
            events=judged.counts[entry],
            hosts=tuple(sorted(judged.hosts[entry])),
            informational=tuple(sorted(judged.informational.get(entry, {}).values(), key=lambda c: c.name)),
        )
        for entry, shapes in judged.new_shapes.items()
    )
    result = Suggestion(
        manifest=manifest,
        files=len(read.files),
        events=len(read.events),
        hosts=read.hosts,
        skipped=read.skipped,
        entries=entries,
        unexplained=judged.unexplained(),
        covered=judged.covered,
        before=before,
        after=after,
    )
    if write and result.changed:
        _write(loaded.path, before, after)
        return replace(result, written=True)
    return result


@dataclass
class Judged:
    """What judge found: new shapes per entry (in first-seen order) and the rest, grouped."""

    new_shapes: dict[str, list[Shape]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    hosts: dict[str, set[str]] = field(default_factory=dict)
    informational: dict[str, dict[str, FieldChange]] = field(default_factory=dict)
    groups: dict[tuple[str | None, str, tuple[FieldChange, ...]], list[Located]] = field(default_factory=dict)
    covered: int = 0

    def unexplained(self) -> tuple[Unexplained, ...]:
        return tuple(
            Unexplained(
                entry=entry,
                reason=reason,
                changes=changes,
                events=len(located),
                hosts=tuple(sorted({e.event.host for e in located})),
                first=located[0].where,
            )
            for (entry, reason, changes), located in self.groups.items()
        )


def judge(read: EventsRead, loaded: LoadedManifest, plan: Plan) -> Judged:
    """Sort every event into a new shape of its entry, covered, or unexplained (with why). Pure."""
    judged = Judged()
    by_entry = plan.by_entry()
    entries = {e.id: e for e in loaded.manifest.models}
    name = loaded.manifest.name
    for located in read.events:
        event = located.event
        entry = entries.get(event.entry) if event.entry is not None else None
        if event.manifest_name != name:
            judged.groups.setdefault(
                (event.entry, f"written for manifest {event.manifest_name!r}, not {name!r}", ()), []
            ).append(located)
            continue
        if entry is None:
            reason = "the guard named no entry" if event.entry is None else "no such entry in this manifest"
            judged.groups.setdefault((event.entry, reason, ()), []).append(located)
            continue
        differing = _entry_changes(entry, event.pipeline, event.dtype, event.backend)
        if differing:
            judged.groups.setdefault(
                (entry.id, "the event's entry differs from this manifest's", differing), []
            ).append(located)
            continue
        changes = _fingerprint_changes(entry, by_entry[entry.id][0].fingerprint, event.fingerprint)
        if any(c.breaking for c in changes):
            reason = "not explained by a shape: the serving host differs from the plan"
            judged.groups.setdefault((entry.id, reason, changes), []).append(located)
            continue
        shape, problem = _shape_of(loaded, entry, located)
        if shape is None:
            judged.groups.setdefault((entry.id, problem, ()), []).append(located)
            continue
        if shape in entry.expanded_shapes():
            if event.compiles == 0 and not event.refused:
                judged.covered += 1
            else:
                reason = (
                    f"{entry.unit_label(shape)} is listed, yet it compiled: not explained by a shape "
                    "(`neffbuild status` says whether the host's cache dir serves it)"
                )
                judged.groups.setdefault((entry.id, reason, ()), []).append(located)
            continue
        shapes = judged.new_shapes.setdefault(entry.id, [])
        if shape not in shapes:
            shapes.append(shape)
        judged.counts[entry.id] = judged.counts.get(entry.id, 0) + 1
        judged.hosts.setdefault(entry.id, set()).add(event.host)
        judged.informational.setdefault(entry.id, {}).update({c.name: c for c in changes})
    return judged


def _entry_changes(entry: ModelEntry, pipeline: str, dtype: str, backend: str) -> tuple[FieldChange, ...]:
    pairs = (("pipeline", entry.pipeline, pipeline), ("dtype", entry.dtype, dtype), ("backend", entry.backend, backend))
    return tuple(FieldChange(n, planned, seen, breaking=True) for n, planned, seen in pairs if planned != seen)


def _fingerprint_changes(
    entry: ModelEntry, planned: Mapping[str, str], seen: Mapping[str, str]
) -> tuple[FieldChange, ...]:
    """Each differing field, breaking ones first (the backend's own classification, as a host check)."""
    backend = get_backend(entry.backend)
    names = sorted(n for n in set(planned) | set(seen) if planned.get(n) != seen.get(n))
    changes = [FieldChange(n, planned.get(n), seen.get(n), breaking=backend.is_breaking(n)) for n in names]
    return tuple(sorted(changes, key=lambda c: not c.breaking))


def _shape_of(loaded: LoadedManifest, entry: ModelEntry, located: Located) -> tuple[Shape | None, str]:
    """The event's shape, or why it cannot be one of this entry's."""
    call = located.event.call
    if call.height is None or call.width is None:
        return None, "call size not recovered (the guard saw no height and width)"
    batch = 1 if call.batch is None else call.batch  # num_images_per_prompt's default
    label = f"{call.height}x{call.width}x{batch}"
    try:
        shape = Shape(height=call.height, width=call.width, batch=batch)
    except ValidationError:
        return None, f"{label} is outside the manifest's limits (docs/manifest.md, 'Types and limits')"
    if batch * entry.prompts_per_call > MAX_IMAGES:
        return None, f"{label}: {batch * entry.prompts_per_call} images per call (at most {MAX_IMAGES})"
    multiple = entry.shape_multiple or shape_multiple(entry, loaded)
    if call.height % multiple or call.width % multiple:
        return None, f"{label}: not a multiple of {multiple}, which {entry.pipeline} needs (shape_multiple)"
    return shape, ""


def _label(loaded: LoadedManifest, entry_id: str, shape: Shape) -> str:
    entry = next(e for e in loaded.manifest.models if e.id == entry_id)
    return entry.unit_label(shape)


def _check_edit(
    loaded: LoadedManifest,
    after: str,
    added: Mapping[str, list[Shape]],
    env: Mapping[str, str],
    facts_provider: FactsProvider,
) -> None:
    """The edited text loads and plans, at the manifest's own path (its relative paths), and each
    entry expands to its old shapes plus exactly the added ones: never a shape nobody asked for."""
    edited = load_manifest(loaded.path, text=after)
    make_plan(edited, env, facts_provider)
    old = {e.id: e.expanded_shapes() for e in loaded.manifest.models}
    for entry in edited.manifest.models:
        expected = sorted([*old[entry.id], *added.get(entry.id, [])], key=lambda s: s.label)
        if sorted(entry.expanded_shapes(), key=lambda s: s.label) != expected:
            raise ManifestError(  # a bug in the edit, never the user's: stop before anything is written
                f"{loaded.path}: model[{entry.id}].shapes: the suggested edit would not list exactly the observed shapes",
                hint="report it (with --debug); nothing was written",
            )


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest", hint="check the path, e.g. manifests/<name>.toml") from None
    except UnicodeDecodeError:
        raise ManifestError(f"{path}: not UTF-8", hint="a manifest is UTF-8 TOML") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest ({exc.strerror or exc})") from None


def _write(path: Path, before: str, after: str) -> None:
    """Replace the manifest whole (write_atomic), with its mode, only if it is still `before`."""
    try:
        st = path.stat()
    except OSError as exc:
        raise DiskError(f"{path}: cannot stat ({exc.strerror or exc}); nothing written") from None
    # Root may write anything; a manifest without write bits is one its owner keeps as it is.
    if not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(path, os.W_OK):
        raise DiskError(
            f"{path}: read-only; nothing written",
            hint="make it writable (chmod u+w), or apply the printed diff elsewhere (drop --write)",
        )
    if _read_text(path) != before:
        raise ConflictError(f"{path}: changed while suggest ran; nothing written", hint="run suggest again")
    write_atomic(path, after.encode("utf-8"), mode=stat.S_IMODE(st.st_mode))
