"""The host check: this host's real fingerprint against builds that differ in one field each."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neffbuild.backends import get_backend
from neffbuild.backends.base import Scope
from neffbuild.documents.bundles import BundleRecord, Timings
from neffbuild.documents.manifest import load_manifest
from neffbuild.documents.records import Release, ReleaseUnit, unit_key
from neffbuild.host.fielddiff import FieldDiff
from neffbuild.host.hostcheck import check_host, host_fingerprint
from neffbuild.units.plan import make_plan
from tests.units.test_plan import manifest  # noqa: F401 - the fixture

# The environment the build and the checks run in: what the thread count and ISA read from.
BASE_ENV = {
    k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY")
}
HOST_ISA = get_backend("inductor").collect_facts(BASE_ENV, "cpu")["cpu.isa"].split(",")


@pytest.fixture
def records(manifest: Path) -> list[BundleRecord]:  # noqa: F811
    """Bundle records of a plan keyed with this host's real facts, as a build would publish them."""
    plan = make_plan(load_manifest(manifest), BASE_ENV)
    return [
        BundleRecord(
            key=u.key,
            unit_id=u.unit_id,
            unit=dict(u.normalized),
            backend="inductor",
            fingerprint=dict(u.fingerprint),
            files=(),
            counters={},
            timings=Timings(),
            created_at="2026-01-01T00:00:00Z",
            neffbuild_version="0",
        )
        for u in plan.units
    ]


def built_with(records: list[BundleRecord], **fields: str) -> list[BundleRecord]:
    """The same units built where the fingerprint had these fields (so under other keys)."""
    changed = []
    for r in records:
        fingerprint = {**r.fingerprint, **fields}
        changed.append(dataclasses.replace(r, fingerprint=fingerprint, key=unit_key(r.unit, fingerprint)))
    return changed


def release_of(records: list[BundleRecord], env: dict[str, str] | None = None) -> Release:
    return Release(
        name="tiny", manifest_digest="0" * 32, backend="inductor", cache_env="TORCHINDUCTOR_CACHE_DIR",
        env=env or dict(records[0].unit["env"]), fingerprint=dict(records[0].fingerprint),
        units=tuple(ReleaseUnit(r.unit_id, r.key) for r in records), files=(),
    )  # fmt: skip


def test_this_hosts_own_build_hits_and_keys_recompute_to_plans(records):
    report = check_host(records, BASE_ENV)
    assert report.ok and report.diffs == () and len(report.units) == 2
    assert [u.host_key for u in report.units] == [r.key for r in records]  # plan's key, recomputed
    assert check_host(release_of(records), BASE_ENV).diffs == ()


def test_a_cpu_flag_the_build_lacked_is_breaking(records):
    flag = next(f for f in ("avx2", "fma", "sse4_2") if f in HOST_ISA)
    fewer = ",".join(f for f in HOST_ISA if f != flag)
    report = check_host(built_with(records, **{"cpu.isa": fewer}), BASE_ENV)
    assert not report.ok
    assert [d.line() for d in report.breaking] == [f"cpu.isa: this host also has {flag}, the build did not"]
    assert all(u.host_key != u.key and u.breaking for u in report.units)


def test_a_cpu_flag_this_host_lacks_is_named(records):
    more = ",".join(sorted([*HOST_ISA, "amx_fp8"]))
    report = check_host(release_of(built_with(records, **{"cpu.isa": more})), BASE_ENV)
    assert [d.line() for d in report.breaking] == ["cpu.isa: build has amx_fp8, this host lacks it"]


def test_another_torch_version_is_breaking(records):
    report = check_host(built_with(records, torch="2.14.1"), BASE_ENV)
    here = records[0].fingerprint["torch"]
    assert [d.line() for d in report.breaking] == [f"torch: build has '2.14.1', this host {here!r}"]


def test_another_thread_count_is_breaking_and_the_releases_exports_count(records):
    report = check_host(built_with(records, threads="97"), BASE_ENV)
    assert [d.name for d in report.breaking] == ["threads"]
    # The same thread count exported by the release: the host runs with it and hits, except that
    # the variable itself is one the build did not set.
    rel = release_of(built_with(records, threads="97"), env={**records[0].unit["env"], "OMP_NUM_THREADS": "97"})
    lines = [d.line() for d in check_host(rel, BASE_ENV).breaking]
    assert lines == ["env.OMP_NUM_THREADS: this host sets '97', the build did not"]


def test_aten_cpu_capability_default_removes_the_vector_isa(records):
    # AVX, AMX (Inductor's VecAMX micro-GEMMs) and the FMA/F16C extensions: all vector code ATen
    # and Inductor leave out under "default"
    vector = [f for f in HOST_ISA if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    if not vector:
        pytest.skip("this CPU has no AVX: nothing for ATEN_CPU_CAPABILITY=default to take away")
    report = check_host(records, {**BASE_ENV, "ATEN_CPU_CAPABILITY": "default"})
    isa = next(d for d in report.breaking if d.name == "cpu.isa")
    assert (
        isa.line()
        == f"cpu.isa: build has {','.join(sorted(vector))}, this host lacks {'it' if len(vector) == 1 else 'them'}"
    )
    assert {d.name for d in report.breaking} == {"cpu.isa", "cpu.capability", "env.ATEN_CPU_CAPABILITY"}
    # Exported by the release, it is what the server runs with.
    rel = release_of(records, env={**records[0].unit["env"], "ATEN_CPU_CAPABILITY": "default"})
    assert "cpu.isa" in {d.name for d in check_host(rel, BASE_ENV).breaking}


def test_other_model_code_versions_are_informational(records):
    report = check_host(built_with(records, diffusers="0.41.0"), BASE_ENV)
    assert report.ok and [d.name for d in report.informational] == ["diffusers"]
    assert all(u.host_key != u.key for u in report.units)  # our key is stricter than Inductor's


@pytest.mark.parametrize("name", ["inductor", "neuron"])
def test_every_field_this_host_reports_is_declared(name):
    backend = get_backend(name)
    fields = host_fingerprint(
        backend, Scope(backend.default_device, env={"NEURON_RT_X": "1"}), {"TORCHINDUCTOR_X": "1"}
    )
    undeclared = [f for f in fields if f.split(".")[0] != "env" and not _declared(backend, f)]
    assert undeclared == []


def _declared(backend, field: str) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(field, p) for p in (*backend.breaking_fields, *backend.informational_fields))


def test_neuron_declares_its_own_breaking_fields():
    neuron = get_backend("neuron")
    assert all(
        neuron.is_breaking(f) for f in ("neuronx-cc", "torch-neuronx", "neuron.target", "neuron.lnc", "neuron.cc_flags")
    )
    # Source locations of the model code are in the persistent key: its versions and place break.
    assert all(neuron.is_breaking(f) for f in ("diffusers", "transformers", "python", "venv"))
    assert not neuron.is_breaking("neuronx-cc.bin") and neuron.is_breaking("a.field.nobody.declared")


def test_field_lines():
    assert FieldDiff("cpu.isa", "avx2,avx512f", "avx2", True).line() == "cpu.isa: build has avx512f, this host lacks it"
    assert FieldDiff("env.CXX", "clang++", None, True).line() == "env.CXX: build sets 'clang++', this host does not"
    assert FieldDiff("cuda", None, "12.8", True).line() == "cuda: this host has '12.8', the build did not"


def test_facts_are_read_without_torch_and_agree_with_torch():
    """The host check imports neither torch nor pydantic; what it derives from files is what
    torch itself reports (the worker's facts), in a clean process with no thread variables."""
    code = (
        "import json, sys, time; t = time.perf_counter()\n"
        "from neffbuild.backends import get_backend\n"
        "from neffbuild.host.hostcheck import host_fingerprint\n"
        "from neffbuild.backends.base import Scope\n"
        "b = get_backend('inductor'); fp = host_fingerprint(b, Scope('cpu'), dict(__import__('os').environ))\n"
        "print(json.dumps({'s': time.perf_counter() - t, 'torch': 'torch' in sys.modules, 'pydantic': 'pydantic' in sys.modules,"
        " 'facts': b.collect_facts({}, 'cpu')}))\n"
        "import torch; print(json.dumps(b.worker_facts({}, 'cpu')))\n"
    )
    env = {**BASE_ENV, "PYTHONPATH": str(Path(__file__).parents[2])}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    first, second = (json.loads(line) for line in out.stdout.splitlines())
    print(
        f"host fingerprint: {first['s']:.3f} s in-process; whole run with torch {time.perf_counter() - started:.1f} s"
    )
    assert first["torch"] is False and first["pydantic"] is False
    assert first["facts"] == second  # version.py, dispatch capability, thread count
