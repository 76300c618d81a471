"""A release's units with their key parts, as its bundles record them (what a cache dir's state
records of each unit, and what status recomputes a key from)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from neffbuild.documents.records import ReleaseUnit
from neffbuild.host.state import InstalledUnit

if TYPE_CHECKING:
    from neffbuild.documents.bundles import BundleRecord
    from neffbuild.documents.refs import ResolvedRelease
    from neffbuild.store.base import Store


def installed_unit(unit: ReleaseUnit, record: BundleRecord) -> InstalledUnit:
    return InstalledUnit(
        unit.unit_id,
        unit.key,
        record.backend,
        record.unit,
        record.fingerprint,
        tuple(f.path for f in record.files),
        env_reads=record.env_reads,
    )


def release_units(store: Store, resolved: ResolvedRelease, jobs: int) -> tuple[InstalledUnit, ...]:
    """Each unit of the release as its bundle records it (read in parallel); a bundle the store
    lacks or that does not match its key is an error: the store is damaged."""
    from concurrent.futures import ThreadPoolExecutor

    from neffbuild.documents.refs import release_bundle
    from neffbuild.retry import carried

    def load(unit: ReleaseUnit) -> InstalledUnit:
        return installed_unit(unit, release_bundle(store, resolved, unit))

    units = resolved.release.units
    with ThreadPoolExecutor(
        max_workers=max(1, min(jobs, len(units), 32)), thread_name_prefix="neffbuild-bundles"
    ) as pool:
        loads = [pool.submit(carried(partial(load, u))) for u in units]  # under the pull's deadline
        return tuple(f.result() for f in loads)
