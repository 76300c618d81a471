"""Synthetic stores for the inspection tests and bench/inspection.py: releases published through the
real publishing code (publish_bundle, publish_release, move_tag) from hand-made cache files,
normalised units and fingerprints shaped like a real Inductor build's. No compiling.

The three-release store (`three_releases`):
  v1      klein/128x128x1, klein/128x256x1                   tag `klein` first
  v2      klein/128x128x1 (the same bundle), klein/256x256x1 tag `klein` next: shares v1's blobs
  v3      v1's units under another fingerprint (torch 2.14.1, avx512f removed, 4 threads)
                                                             tag `klein` last, and tag `canary`
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neffbuild.build.publish import move_tag, publish_bundle, publish_release
from neffbuild.documents.bundles import BundleRecord, Timings
from neffbuild.documents.records import FileEntry, Release, ReleaseUnit, unit_key
from neffbuild.hashing import blake3_bytes, hash_bytes
from neffbuild.store.base import Store
from neffbuild.store.blobs import BlobSource

FINGERPRINT = {
    "backend": "inductor", "cpu.capability": "avx512", "cpu.isa": "avx avx2 avx512bw avx512f fma sse4_2",
    "cxx": "g++ (Debian 12.2.0-14) 12.2.0", "device": "cpu", "diffusers": "0.36.0", "platform": "Linux-x86_64",
    "python": "CPython 3.11.9", "python.prefix": "/opt/venv", "threads": "2", "torch": "2.13.0",
    "torch.git": "0123abcd", "transformers": "4.57.1",
}  # fmt: skip
# What the third release was built under: exactly these fields differ from FINGERPRINT.
CHANGED = {"torch": "2.14.1", "cpu.isa": "avx avx2 avx512bw fma sse4_2", "threads": "4"}


def unit_of(entry: str, height: int, width: int, batch: int = 1, **changes: Any) -> dict[str, Any]:
    """A normalised unit shaped like plan.normalize_unit's."""
    unit = {
        "model": {"local_config": hash_bytes(entry.encode())}, "pipeline": "Flux2KleinPipeline", "dtype": "float32",
        "backend": "inductor", "device": "cpu", "mode": "full", "components": ["transformer", "vae.decode"],
        "tensor_parallel": 1, "shape": {"height": height, "width": width, "batch": batch},
        "call": {"max_sequence_length": 64}, "env": {"OMP_NUM_THREADS": "2"},
    }  # fmt: skip
    return {**unit, **changes}


@dataclass(frozen=True)
class Unit:
    unit_id: str
    normalized: dict[str, Any]
    fingerprint: Mapping[str, str]
    files: Mapping[str, bytes]  # cache path -> bytes
    inputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # what each component received

    @property
    def key(self) -> str:
        return unit_key(self.normalized, self.fingerprint)


def klein_unit(height: int, width: int, fingerprint: Mapping[str, str] = FINGERPRINT, flavour: str = "") -> Unit:
    """A unit with three files: one of its own, a header every unit shares, and a kernel whose
    bytes depend on the fingerprint (flavour) at a path that does not."""
    label = f"{height}x{width}x1"
    files = {
        f"kernels/{label}.so": f"kernel {label} {flavour}".encode() * 50,
        "headers/common.h": b"common header " * 30,
        f"aot/{label}.bin": f"graph {label} {flavour}".encode() * 20,
    }
    return Unit(f"klein/{label}", unit_of("klein", height, width), fingerprint, files)


def publish_units(
    store: Store, work: Path, name: str, units: list[Unit], *, tag: str | None = None, by: str = "test",
    created_at: str = "2025-01-01T00:00:00+00:00",
) -> str:  # fmt: skip
    """Publish each unit's bundle, then the release of them all (as `neffbuild build` would); its id."""
    for unit in units:
        sources = []
        for path, data in unit.files.items():
            target = work / unit.key / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            sources.append(BlobSource(hash_bytes(data), len(data), target))
        record = BundleRecord(
            key=unit.key, unit_id=unit.unit_id, unit=unit.normalized, backend="inductor",
            fingerprint=dict(unit.fingerprint), files=_entries(unit.files), counters={"compiles": 3, "graphs.transformer": 1},
            timings=Timings(load_s=1.5, first_call_s=40.0, total_s=41.5), created_at=created_at, neffbuild_version="test",
            inputs=dict(unit.inputs),
        )  # fmt: skip
        publish_bundle(store, record, sources, jobs=8)
    merged: dict[str, bytes] = {}
    for unit in units:
        merged.update(unit.files)
    common = {k: v for k, v in units[0].fingerprint.items() if all(u.fingerprint.get(k) == v for u in units)}
    release = Release(
        name=name, manifest_digest=hash_bytes(name.encode()), backend="inductor", cache_env="TORCHINDUCTOR_CACHE_DIR",
        env={"OMP_NUM_THREADS": "2"}, fingerprint=common,
        units=tuple(ReleaseUnit(unit_id=u.unit_id, key=u.key) for u in units), files=_entries(merged),
    )  # fmt: skip
    release_id = publish_release(store, release)
    if tag:
        move_tag(store, tag, release_id, by=by)
    return release_id


def _entries(files: Mapping[str, bytes]) -> tuple[FileEntry, ...]:
    return tuple(
        FileEntry(path=p, size=len(d), digest=hash_bytes(d), blake3=blake3_bytes(d)) for p, d in sorted(files.items())
    )


@dataclass(frozen=True)
class ThreeReleases:
    v1: str
    v2: str
    v3: str
    units: Mapping[str, list[Unit]]  # release id -> its units


def three_releases(store: Store, work: Path) -> ThreeReleases:
    v1_units = [klein_unit(128, 128), klein_unit(128, 256)]
    v2_units = [klein_unit(128, 128), klein_unit(256, 256)]
    v3_units = [
        klein_unit(128, 128, {**FINGERPRINT, **CHANGED}, "new"),
        klein_unit(128, 256, {**FINGERPRINT, **CHANGED}, "new"),
    ]
    v1 = publish_units(store, work, "klein", v1_units, tag="klein", by="ci-a")
    v2 = publish_units(store, work, "klein", v2_units, tag="klein", by="ci-b")
    v3 = publish_units(store, work, "klein", v3_units, tag="klein", by="ci-c")
    move_tag(store, "canary", v3, by="ci-c")
    return ThreeReleases(v1, v2, v3, {v1: v1_units, v2: v2_units, v3: v3_units})


# ---- fixtures: the same store on the local store and on the real S3 server ----------------------

import pytest  # noqa: E402


@dataclass(frozen=True)
class Target:
    url: str
    env: dict[str, str]  # what a neffbuild process needs to reach it (S3: endpoint, keys)
    store: Store
    three: ThreeReleases


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """The three-release store, on each store."""
    from neffbuild.store import open_store

    if request.param == "s3":
        url, env = request.getfixturevalue("s3_url"), request.getfixturevalue("s3_env")
    else:
        url, env = str(tmp_path / "store"), {}
    store = open_store(url, create=True, env=env)
    return Target(url, env, store, three_releases(store, tmp_path / "work"))
