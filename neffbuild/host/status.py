"""`neffbuild status`: will this host hit, unit by unit, and if not, why? Read from the cache dir.

For each unit of a release it predicts what a server started now would do:
- `hit`: its key is the same on this host and every file it needs is present with its size;
- `mismatch`: its key would differ here (the host check names each field, old -> new);
- `missing`: files absent (or, with --verify, not the recorded bytes);
- `stale`: its files are present, but the cache dir holds another release (or one it cannot name);
- `absent`: a unit the manifest declares that the release does not have.
The installed release, its units and exports come from the cache dir's state (neffbuild.host.state),
so the store is needed only for a release other than the installed one. Nothing is hashed unless
verify. A prediction: `verify --replay` is the proof (it runs each unit and counts compiles).
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from neffbuild.errors import StatusMiss
from neffbuild.fs.confined import disk_error
from neffbuild.host.cachedir import CacheDir, find_target
from neffbuild.host.exports import exports_for, serving_env
from neffbuild.host.fielddiff import FieldDiff
from neffbuild.host.hostcheck import check_host
from neffbuild.host.state import CacheState, Files
from neffbuild.host.target import Target

if TYPE_CHECKING:
    from neffbuild.documents.records import FileEntry
    from neffbuild.host.trust import Signed, Trust
    from neffbuild.store import StoreChoice
    from neffbuild.store.base import Store
    from neffbuild.units.plan import Plan

UnitState = Literal["hit", "mismatch", "missing", "stale", "absent"]


@dataclass(frozen=True, slots=True)
class UnitStatus:
    unit_id: str
    key: str
    state: UnitState
    files: int = 0
    bytes: int = 0
    missing_files: int = 0
    missing_bytes: int = 0
    corrupt_files: int = 0  # of the missing ones: present with the size but other bytes (--verify)
    changes: tuple[FieldDiff, ...] = ()  # mismatch: the breaking fields; else informational ones
    host_key: str = ""  # the key this host gives the unit (equal to key when nothing differs)


@dataclass(frozen=True, slots=True)
class StatusReport:
    cache_dir: Path
    release_id: str
    release_name: str
    tag: str | None
    source: str  # where the release was read: the cache dir's state, or a store URL
    installed_release_id: str | None
    installed_at: str | None
    verified: bool
    units: tuple[UnitStatus, ...]
    signed: Signed | None = None  # with trusted keys: who signed the release (and its tag), until when

    @property
    def ok(self) -> bool:
        return all(u.state == "hit" for u in self.units)

    def count(self, state: UnitState) -> int:
        return sum(u.state == state for u in self.units)


@dataclass(frozen=True, kw_only=True)
class StatusQuery:
    """What `status` judges against: a tag where it points now (store_named) or as installed,
    a manifest's plan (its tag and units), sizes or digests (verify), and this host's allow."""

    store_named: bool = False
    verify: bool = False
    plan: Plan | None = None
    allow_env: tuple[str, ...] = ()


def status(
    cache_dir: Path,
    ref: str | None,
    *,
    env: Mapping[str, str],
    open_store: Callable[[], Store] | None = None,
    query: StatusQuery | None = None,
) -> StatusReport:
    """Judge cache_dir for REF's release (default: the installed one) on this host. A tag is
    judged where it points now if a store is named (store_named), else as it was installed.
    With a manifest's plan, REF is its tag, and units the manifest declares that the release
    lacks (by id, or with another normalised unit) are reported too."""
    with CacheDir.opened(cache_dir) as cache:
        return _status(cache, ref, env, open_store, query or StatusQuery())


def _status(
    cache: CacheDir, ref: str | None, env: Mapping[str, str], open_store: Callable[[], Store] | None, q: StatusQuery
) -> StatusReport:
    state = cache.state()
    cache_dir = cache.path
    plan = q.plan
    if plan is not None:
        ref = plan.loaded.manifest.name
    target = find_target(state, cache_dir, ref, open_store, store_named=q.store_named)
    # The host as the server will run: this environment with the release's exports applied.
    exports = exports_for(target.release, cache_dir, target.source, q.allow_env)
    checked = check_host(target.units, serving_env(env, exports)).units if target.units else ()
    changes: dict[str, Sequence[FieldDiff]] = {u.unit_id: u.diffs for u in checked}
    if plan is not None:
        changes = _manifest_changes(plan, target, changes)
    report = judge(cache, state, target, changes, {u.unit_id: u.host_key for u in checked}, verify=q.verify)
    if plan is None:
        return report
    have = {u.unit_id for u in target.units}
    lacking = tuple(UnitStatus(u.unit_id, u.key, "absent") for u in plan.units if u.unit_id not in have)
    return replace(report, units=report.units + lacking)


def status_of(
    ref: str | None,
    cache_dir: Path,
    store: StoreChoice,
    *,
    env: Mapping[str, str],
    verify: bool = False,
    allow_env: Collection[str] = (),
    trust: Trust | None = None,
) -> StatusReport:
    """`status` as the CLI names it: REF is a manifest (a .toml file or a path: its tag and its
    units), a tag, a release, or nothing (the installed release); the store opens only if needed.
    With trusted keys the store always opens: REF's signatures are checked first (TrustError),
    and the report says who signed the release and its tag, and when the tag statement expires."""
    plan, manifest_store = None, None
    # A path, never a file that happens to lie in the working directory under a tag's name: tags
    # and ids cannot hold "/" and a manifest ends in .toml.
    if ref is not None and (ref.endswith(".toml") or "/" in ref):
        from neffbuild.documents.manifest import load_manifest
        from neffbuild.units.plan import make_plan
        from neffbuild.units.plancache import cache_dir as plan_cache

        plan = make_plan(load_manifest(Path(ref)), env, cache=plan_cache(env))
        manifest_store = plan.loaded.manifest.store
    named = bool(store.url or env.get("NEFFBUILD_STORE"))  # then a tag is judged where it points now
    query = StatusQuery(store_named=named, verify=verify, plan=plan, allow_env=tuple(allow_env))
    signed = None
    with CacheDir.opened(cache_dir) as cache:
        if trust is not None:
            signed = _signatures(
                ref if plan is None else plan.loaded.manifest.name,
                cache,
                store.open(env, manifest_default=manifest_store),
                trust,
            )
        report = _status(cache, ref, env, lambda: store.open(env, manifest_default=manifest_store), query)
    return replace(report, signed=signed)


def _signatures(ref: str | None, cache: CacheDir, store: Store, trust: Trust) -> Signed:
    """REF's (else the installed tag's, else the installed release's) signatures, checked."""
    from neffbuild.errors import NotFoundError
    from neffbuild.host.trust import verify_release

    state = cache.read_state()[1]
    name = ref or state.tag or state.release_id
    if name is None:
        raise NotFoundError(f"{cache.path}: no installed release recorded", hint="name the tag or release to check")
    return verify_release(store, name, trust, state.accepted).summary()


def _manifest_changes(
    plan: Plan, target: Target, changes: dict[str, Sequence[FieldDiff]]
) -> dict[str, Sequence[FieldDiff]]:
    """Add, for each unit the manifest now describes otherwise than the release built it, the
    unit fields that differ (`unit.shape`, `unit.call`, ...): its key would differ anywhere."""
    planned = {u.unit_id: u for u in plan.units}
    out = dict(changes)
    for unit in target.units:
        now = planned.get(unit.unit_id)
        if now is None:
            continue
        old, new = _leaves(unit.unit), _leaves(now.normalized)
        differing = [
            FieldDiff(f"unit.{name}", _shown(old.get(name)), _shown(new.get(name)), breaking=True)
            for name in sorted(set(old) | set(new))
            if old.get(name) != new.get(name)
        ]
        if differing:
            out[unit.unit_id] = (*out.get(unit.unit_id, ()), *differing)
    return out


def _leaves(unit: Mapping[str, object]) -> dict[str, object]:
    """A normalised unit one level down (`call.guidance_scale`, `shape.height`): a change is
    named by the manifest field a user edits, not by the whole table it sits in."""
    out: dict[str, object] = {}
    for name, value in unit.items():
        if isinstance(value, dict) and value and name != "model":
            out.update({f"{name}.{k}": v for k, v in value.items()})
        else:
            out[name] = value
    return out


def _shown(value: object) -> str | None:
    import json

    return None if value is None else value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def judge(
    cache: CacheDir,
    state: CacheState,
    target: Target,
    changes: Mapping[str, Sequence[FieldDiff]],
    host_keys: Mapping[str, str],
    *,
    verify: bool,
) -> StatusReport:
    by_path = {f.path: f for f in target.release.files}
    found = presence(cache, target.release.files, state.files, verify=verify)
    current = state.release_id == target.release_id
    units = []
    for unit in target.units:
        entries = [by_path[p] for p in unit.paths if p in by_path]
        absent = [e for e in entries if found[e.path] != "ok"]
        differing = tuple(changes.get(unit.unit_id, ()))
        breaking = tuple(c for c in differing if c.breaking)
        if breaking:
            state_name: UnitState = "mismatch"
        elif absent:
            state_name = "missing"
        else:
            state_name = "hit" if current else "stale"
        units.append(
            UnitStatus(
                unit_id=unit.unit_id,
                key=unit.key,
                state=state_name,
                files=len(entries),
                bytes=sum(e.size for e in entries),
                missing_files=len(absent),
                missing_bytes=sum(e.size for e in absent),
                corrupt_files=sum(found[e.path] == "corrupt" for e in absent),
                changes=breaking or differing,
                host_key=host_keys.get(unit.unit_id, ""),
            )
        )
    installed = state.installed
    return StatusReport(
        cache_dir=cache.path,
        release_id=target.release_id,
        release_name=target.release.name,
        tag=target.tag,
        source=target.source,
        installed_release_id=state.release_id,
        installed_at=installed.installed_at if installed else None,
        verified=verify,
        units=tuple(units),
    )


Presence = Literal["ok", "absent", "corrupt"]


def presence(cache: CacheDir, files: Sequence[FileEntry], written: Files, *, verify: bool) -> dict[str, Presence]:
    """Each release file: a regular file with its size ("ok"; with verify, also its digest), or not.
    A file pull wrote for another release (the state has its size and mtime, another digest) is
    not this one's, hashing or not. Read the way pull lands files (no link below the cache dir
    followed), in path order."""
    if not cache.exists:
        return {f.path: "absent" for f in files}
    found: dict[str, Presence] = {}
    with cache.beneath() as tree:
        for entry in sorted(files, key=lambda f: f.path):
            try:
                st = tree.lstat(entry.path)
                other = written.get(entry.path)
                if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                    found[entry.path] = "absent"
                elif other is not None and other[:2] == (st.st_size, st.st_mtime_ns) and other[2] != entry.digest:
                    found[entry.path] = "absent"
                elif verify and tree.hash_file(entry.path, entry.size) != entry.digest:
                    found[entry.path] = "corrupt"
                else:
                    found[entry.path] = "ok"
            except OSError as exc:
                raise disk_error(exc, cache.path / entry.path) from None
    return found


def status_error(report: StatusReport) -> StatusMiss | None:
    """The error a status that predicts any miss ends with (after the report is printed)."""
    if report.ok:
        return None
    counts = ", ".join(f"{report.count(s)} {s}" for s in ("mismatch", "missing", "stale", "absent") if report.count(s))
    fields = sorted({c.name for u in report.units if u.state == "mismatch" for c in u.changes})
    named = f" ({', '.join(fields[:6])})" if fields else ""
    hints = []
    if report.count("missing") or report.count("stale"):
        hints.append(
            f"`neffbuild pull {report.tag or report.release_id} --cache-dir {report.cache_dir}` fetches what is missing"
        )
    mismatched = [u for u in report.units if u.state == "mismatch"]
    edited = sorted(
        {
            f"model[{u.unit_id.rpartition('/')[0] or u.unit_id}].{c.name.removeprefix('unit.')}"
            for u in mismatched
            for c in u.changes
            if c.name.startswith("unit.")
        }
    )
    if edited:  # the manifest, not the host: the same manifest would hit
        hints.append(
            f"the manifest differs from what the release built ({', '.join(edited[:4])}): build it, or undo that change"
        )
    variables = sorted(
        {c.name.removeprefix("env.") for u in mismatched for c in u.changes if c.name.startswith("env.")}
    )
    if variables:  # the compiler read them at build (or the fingerprint names them)
        hints.append(
            f"set {', '.join(variables[:4])} here as the build had it (see each unit's line), or build on this host"
        )
    elif any(not c.name.startswith("unit.") for u in mismatched for c in u.changes):
        hints.append("a mismatch needs this host's environment to match the build's, or a build on this host")
    if report.count("absent"):
        hints.append("build the manifest to add the units its release lacks")
    return StatusMiss(
        f"{len(report.units) - report.count('hit')} of {len(report.units)} units of {report.release_name} would not hit here: {counts}{named}",
        hint="; ".join(hints),
    )
