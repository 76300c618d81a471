"""`build --unit-memory auto`: each unit's memory share from the peaks earlier builds recorded.

A bundle records its worker's peak RSS (the worker's own, or its C++ compiler's if larger). A
unit's share is that peak times MARGIN, from the first of:
1. the bundle of the unit's own key (a unit rebuilt after its bundle was deleted);
2. the bundles of the same entry's other units in this plan (other shapes, same toolchain: a
   second build that adds a shape, or a shard whose fleet built the others first), their largest;
3. the tag's current release: the bundle of the same unit id (the previous toolchain's build),
   else the largest of the same entry's;
and DEFAULT_UNIT_MEMORY where nothing was recorded (a first build, bundles older than the
record). Reading the store is a hint only: a failure to read falls back to the default.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from neffbuild.documents.bundles import BundleRecord
from neffbuild.documents.records import Release
from neffbuild.documents.refs import checked_doc, doc_where, find_doc, read_tag
from neffbuild.errors import NeffbuildError
from neffbuild.printable import printable
from neffbuild.store.base import Store
from neffbuild.units.plan import BuildUnit

log = logging.getLogger(__name__)

MARGIN = 1.25  # a shape's peak varies with the build's order and the allocator: a quarter more
DEFAULT_UNIT_MEMORY = 8 << 30  # no peak recorded: what a diffusers pipeline's compile commonly needs


@dataclass(frozen=True)
class Share:
    need: int  # bytes
    source: str  # what it was sized from, for the log


def unit_shares(
    store: Store, plan_units: Sequence[BuildUnit], building: Iterable[BuildUnit], tag: str
) -> dict[str, Share]:
    """Each unit's share by unit id (see the module's docstring)."""
    try:
        planned = _peaks(store, ((u.unit_id, u.key) for u in plan_units))
        released = _released_peaks(store, plan_units, tag)
    except NeffbuildError as exc:  # a hint only: never worth failing the build for
        log.warning("--unit-memory auto: peaks not read (%s): every unit gets the default", exc.message)
        planned, released = {}, {}
    shares = {}
    for unit in building:
        found = _first(unit.unit_id, planned) or _first(unit.unit_id, released)
        if found is None:
            share = Share(DEFAULT_UNIT_MEMORY, "no peak recorded: the default")
        else:
            peak, where = found
            # A released unit id is the store's text: escaped before it reaches a terminal.
            share = Share(int(peak * MARGIN), f"{MARGIN} x the {_mib(peak)} peak of {printable(where)}'s build")
        shares[unit.unit_id] = share
        log.info("memory: %s: %s (%s)", unit.unit_id, _mib(share.need), share.source)
    return shares


def _entry(unit_id: str) -> str:
    return unit_id.rpartition("/")[0]  # unit ids are `entry/shape label`


def _first(unit_id: str, peaks: Mapping[str, int]) -> tuple[int, str] | None:
    """The unit's own recorded peak, else the largest of its entry's units."""
    if peaks.get(unit_id):
        return peaks[unit_id], unit_id
    same = [(peak, other) for other, peak in peaks.items() if peak and _entry(other) == _entry(unit_id)]
    return max(same) if same else None


def _peaks(store: Store, units: Iterable[tuple[str, str]]) -> dict[str, int]:
    """Recorded peak RSS by unit id, of the bundles at these (unit id, key) pairs that exist."""
    wanted = list(units)
    docs = store.get_docs("bundles", [key for _, key in wanted], jobs=16)
    peaks = {}
    for unit_id, key in wanted:
        data = docs.get(key)
        if data is not None:
            peaks[unit_id] = checked_doc(BundleRecord, data, doc_where(store, BundleRecord, key), key).peak_rss
    return peaks


def _released_peaks(store: Store, plan_units: Sequence[BuildUnit], tag: str) -> dict[str, int]:
    """Recorded peaks by unit id in the tag's current release, for this plan's entries."""
    found = read_tag(store, tag)
    release = find_doc(store, Release, found[0].release) if found else None
    if release is None:
        return {}
    entries = {u.entry.id for u in plan_units}
    return _peaks(store, ((u.unit_id, u.key) for u in release.units if _entry(u.unit_id) in entries))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
