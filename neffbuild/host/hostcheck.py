"""Will this host hit, and why not? Its fingerprint, as the server will run, against a build's.

A host is judged as it will serve: this environment with the release's exports applied over it
(`host/exports.py`'s `serving_env`). Its facts come from files (versions, CPU flags, core topology; see each
backend's collect_facts), so a check costs milliseconds and starts no device; the facts no file
holds are named there. Each differing field is classified by the backend's own lists
(`breaking_fields`, `informational_fields`): breaking means kernels or the compiler's keys
change (a miss, or a "hit" that computes garbage), informational means only our key is stricter.

Given bundle records, every field of each unit is compared and the unit's key is recomputed for
this host (`unit_key`, as plan computes it). Given only a release, its common fingerprint is
compared: a field that differs between units is not in it, so that check is a prediction of
the shared toolchain, and only bundles say which unit a per-unit field keeps from hitting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from neffbuild.backends import get_backend
from neffbuild.backends.base import Backend, Scope
from neffbuild.backends.envreads import UNSET, host_differences
from neffbuild.documents.records import Release, unit_key
from neffbuild.errors import InputError
from neffbuild.host.exports import serving_env

if TYPE_CHECKING:
    from neffbuild.documents.bundles import BundleRecord
    from neffbuild.host.fielddiff import FieldDiff

Facts = Callable[[Backend, Mapping[str, str], str], Mapping[str, str]]


def read_facts(backend: Backend, env: Mapping[str, str], device: str) -> Mapping[str, str]:
    return backend.collect_facts(env, device)


@dataclass(frozen=True, slots=True)
class UnitCheck:
    """One unit's differences, and the key this host gives it."""

    unit_id: str
    key: str  # the key it was built under
    host_key: str  # the key this host gives it; "" when only a release was given
    diffs: tuple[FieldDiff, ...]

    @property
    def breaking(self) -> bool:
        return any(d.breaking for d in self.diffs)


@dataclass(frozen=True, slots=True)
class HostReport:
    """A host check: each unit's differences, and each distinct one once."""

    backend: str
    units: tuple[UnitCheck, ...]
    diffs: tuple[FieldDiff, ...]  # each distinct difference once, over all units, by field name

    @property
    def breaking(self) -> tuple[FieldDiff, ...]:
        return tuple(d for d in self.diffs if d.breaking)

    @property
    def informational(self) -> tuple[FieldDiff, ...]:
        return tuple(d for d in self.diffs if not d.breaking)

    @property
    def ok(self) -> bool:
        return not self.breaking


def host_fingerprint(
    backend: Backend, scope: Scope, env: Mapping[str, str], facts: Facts = read_facts
) -> dict[str, str]:
    """This host's fingerprint for a unit of that scope, run with env; no manifest, no compile."""
    return backend.fingerprint(facts(backend, env, scope.device), env, scope)


class KeyedUnit(Protocol):
    """What of a bundle a host check reads: a BundleRecord, or a unit a cache dir's state keeps."""

    @property
    def unit_id(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def unit(self) -> Mapping[str, Any]: ...
    @property
    def fingerprint(self) -> Mapping[str, str]: ...
    @property
    def env_reads(self) -> Mapping[str, str]: ...


def check_host(
    subject: Release | Sequence[BundleRecord] | Sequence[KeyedUnit],
    env: Mapping[str, str],
    *,
    facts: Facts = read_facts,
) -> HostReport:
    """Compare this host (run with env, the release's exports applied) with a release's common
    fingerprint, or with each bundle's fingerprint and key."""
    if isinstance(subject, Release):
        return _check_release(subject, env, facts)
    facts = _once(facts)  # units of one entry share device and env: read the host once for them
    records = list(subject)
    backends = sorted({r.backend for r in records})
    if len(backends) != 1:
        raise InputError(
            f"bundles of {len(backends)} backends ({', '.join(backends)}) given to one host check",
            hint="check one release at a time",
        )
    backend = get_backend(backends[0])
    units = []
    for record in records:
        scope = Scope.of_unit(record.unit)
        here = host_fingerprint(backend, scope, {**env, **scope.env}, facts)
        diffs = _diffs(backend, record.fingerprint, here, complete=True)
        diffs += read_diffs(record.env_reads, {**env, **scope.env}, {d.name for d in diffs} | set(record.fingerprint))
        units.append(UnitCheck(record.unit_id, record.key, unit_key(record.unit, here), diffs))
    unique = {d: None for u in units for d in u.diffs}
    return HostReport(
        backend.name, tuple(units), tuple(sorted(unique, key=lambda d: (d.name, d.built or "", d.here or "")))
    )


def read_diffs(reads: Mapping[str, str], env: Mapping[str, str], known: set[str]) -> tuple[FieldDiff, ...]:
    """A breaking `env.NAME` difference for each variable the build's compiler read (its process
    recorded it: backends/envreads.py) that is set otherwise here, unless the fingerprint already
    compares it or it is known to reach no key (envreads.NOT_KEYED). The build's value is known
    only by its digest, so the line shows that."""
    found = [(name, built, here) for name, built, here in host_differences(reads, env) if f"env.{name}" not in known]
    if not found:
        return ()
    from neffbuild.host.fielddiff import FieldDiff  # only where something differs: not on a no-op pull

    return tuple(
        FieldDiff(f"env.{name}", None if built == UNSET else f"<a value, xxh3 {built[:8]}>", here, breaking=True)
        for name, built, here in found
    )


def _once(facts: Facts) -> Facts:
    seen: dict[tuple[str, str, tuple[tuple[str, str], ...]], Mapping[str, str]] = {}

    def read(backend: Backend, env: Mapping[str, str], device: str) -> Mapping[str, str]:
        key = (backend.name, device, tuple(sorted(env.items())))
        if key not in seen:
            seen[key] = facts(backend, env, device)
        return seen[key]

    return read


def _check_release(release: Release, env: Mapping[str, str], facts: Facts) -> HostReport:
    backend = get_backend(release.backend)
    built = release.fingerprint
    tp = built.get("neuron.tp", "1")
    # Variables keyed by name alone (a unit's own env) appear as env.* in the build's fingerprint.
    names = {k.removeprefix("env."): "" for k in built if k.startswith("env.")}
    scope = Scope(
        built.get("device") or backend.default_device, int(tp) if tp.isdigit() else 1, names, "torchao" in built
    )
    here = host_fingerprint(backend, scope, serving_env(env, release.env), facts)
    diffs = _diffs(backend, built, here, complete=False)
    diffs += read_diffs(release.env_reads, serving_env(env, release.env), {d.name for d in diffs} | set(built))
    return HostReport(backend.name, tuple(UnitCheck(u.unit_id, u.key, "", diffs) for u in release.units), diffs)


def _diffs(
    backend: Backend, built: Mapping[str, str], here: Mapping[str, str], *, complete: bool
) -> tuple[FieldDiff, ...]:
    """Field by field. A release's common fingerprint leaves out fields its units differ in, so
    there only a compiler variable this host sets and the build did not counts as extra."""
    names = set(built) | {k for k in here if complete or k.startswith("env.")}
    differing = [name for name in sorted(names) if built.get(name) != here.get(name)]
    if not differing:
        return ()
    from neffbuild.host.fielddiff import FieldDiff  # only where something differs: not on a no-op pull

    return tuple(FieldDiff(name, built.get(name), here.get(name), backend.is_breaking(name)) for name in differing)
