"""`status`: will this host hit? Each unit classified from the cache dir alone, on both stores.

Stores are written through the real publishing code from hand-made cache files: a unit's bundle
records a normalised unit and a fingerprint as a build on this host would (no compiling).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from neffbuild.backends.envreads import value_digest
from neffbuild.build.publish import move_tag, publish_bundle, publish_release
from neffbuild.documents.bundles import BundleRecord, Timings
from neffbuild.documents.records import FileEntry, Release, ReleaseUnit, unit_key
from neffbuild.store import open_store
from neffbuild.store.base import Store
from tests.storekit import this_host, write_files

UNITS = {
    "m/64x64x1": {"a/k1.so": 3000, "fxgraph/aa/k1/e": 500},
    "m/64x128x1": {"b/k2.so": 4000, "fxgraph/bb/k2/e": 600},
}


def unit_record(unit_id: str, env: dict[str, str], seed: int) -> dict[str, Any]:
    """A normalised unit as plan makes it (the parts a host check reads: device, env)."""
    height, width, batch = (int(n) for n in unit_id.split("/")[1].split("x"))
    return {
        "model": {"synthetic": str(seed)}, "pipeline": "P", "dtype": "float32", "backend": "inductor", "device": "cpu",
        "mode": "full", "components": ["transformer"], "tensor_parallel": 1,
        "shape": {"height": height, "width": width, "batch": batch}, "call": {}, "env": env,
    }  # fmt: skip


def publish_units(store: Store, root: Path, *, tag: str, seeds: tuple[int, int] = (0, 1), env: dict[str, str] | None = None,
                  edit: Callable[[dict[str, str]], dict[str, str]] = dict, reads: dict[str, str] | None = None) -> str:  # fmt: skip
    """A release of UNITS (one bundle each, files from seeds[i]) published as `neffbuild build`
    would on this host; edit changes each recorded fingerprint (another build host). Its id."""
    env = env if env is not None else {"OMP_NUM_THREADS": "2"}
    units, entries, fingerprints = [], [], []
    for n, (unit_id, sizes) in enumerate(UNITS.items()):
        sources = write_files(root / f"u{n}", sizes, seed=seeds[n])
        files = tuple(
            FileEntry(path=s.path.relative_to(root / f"u{n}").as_posix(), size=s.size, digest=s.digest, blake3=s.blake3)
            for s in sources
        )
        unit = unit_record(unit_id, env, seeds[n])
        fp = edit(this_host(unit, env))
        record = BundleRecord(
            key=unit_key(unit, fp), unit_id=unit_id, unit=unit, backend="inductor", fingerprint=fp, files=files,
            counters={}, timings=Timings(), created_at="2026-01-01T00:00:00+00:00", neffbuild_version="test",
            env_reads=reads or {},
        )  # fmt: skip
        publish_bundle(store, record, sources, jobs=2)
        units.append(ReleaseUnit(unit_id=unit_id, key=record.key))
        entries.extend(files)
        fingerprints.append(fp)
    release = Release(
        name=tag, manifest_digest="0" * 32, backend="inductor", cache_env="TORCHINDUCTOR_CACHE_DIR", env=env,
        fingerprint={k: v for k, v in fingerprints[0].items() if all(f.get(k) == v for f in fingerprints)},
        units=tuple(units), files=tuple(sorted(entries, key=lambda e: e.path)),
    )  # fmt: skip
    release_id = publish_release(store, release)
    move_tag(store, tag, release_id)
    return release_id


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    if request.param == "s3":
        return request.getfixturevalue("s3_url"), request.getfixturevalue("s3_env")
    return str(tmp_path / "store"), {}


def status_json(
    cli, cache: Path, *args: str, env: dict[str, str] | None = None, env_exact: dict[str, str] | None = None
) -> tuple[int, dict, str]:
    if env_exact is not None:  # exactly this environment (cli adds to the test's own)
        result = subprocess.run(
            [sys.executable, "-m", "neffbuild", "status", *args, "--cache-dir", str(cache), "--json"],
            capture_output=True, text=True, env=env_exact, check=False,
        )  # fmt: skip
    else:
        result = cli("status", *args, "--cache-dir", str(cache), "--json", env=env)
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout), result.stderr


def states(report: dict) -> dict[str, str]:
    return {u["unit_id"]: u["state"] for u in report["units"]}


def test_a_complete_host_hits_from_the_cache_dir_alone(target, tmp_path: Path, cli) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    release_id = publish_units(store, tmp_path / "src", tag="prod")
    cache = tmp_path / "cache"
    assert cli("pull", "prod", "--store", url, "--cache-dir", str(cache), env=env).returncode == 0
    # No store at all: neither reachable nor named (the state holds everything status needs).
    for args in ((), ("prod",), (release_id,)):
        code, report, err = status_json(cli, cache, *args, env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
        assert code == 0, err
        assert states(report) == {u: "hit" for u in UNITS} and report["ok"] is True
        assert report["release_id"] == report["installed_release_id"] == release_id
        assert report["source"].endswith(".neffbuild/state.json")
    plain = cli("status", "--cache-dir", str(cache))
    assert plain.returncode == 0 and "2 of 2 units will hit" in plain.stdout and "verify --replay" in plain.stdout
    # A file named like the tag in the working directory is not taken for a manifest.
    (tmp_path / "prod").write_text("not a manifest")
    by_tag = cli(
        "status", "prod", "--cache-dir", str(cache), env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, cwd=tmp_path
    )
    assert by_tag.returncode == 0 and "2 of 2 units will hit" in by_tag.stdout, by_tag.stderr


def test_a_deleted_file_makes_its_unit_missing(target, tmp_path: Path, cli) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    publish_units(store, tmp_path / "src", tag="prod")
    cache = tmp_path / "cache"
    assert cli("pull", "prod", "--store", url, "--cache-dir", str(cache), env=env).returncode == 0
    (cache / "b/k2.so").unlink()
    code, report, err = status_json(cli, cache)
    assert code == 12, err
    assert states(report) == {"m/64x64x1": "hit", "m/64x128x1": "missing"}
    missing = report["units"][1]
    assert (missing["missing_files"], missing["missing_bytes"]) == (1, 4000)
    assert "1 of 2 units of prod would not hit here: 1 missing" in err and "hint: `neffbuild pull prod" in err


def test_a_host_holding_another_release_is_stale(target, tmp_path: Path, cli) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    old = publish_units(store, tmp_path / "v1", tag="prod", seeds=(10, 11))
    cache = tmp_path / "cache"
    assert cli("pull", "prod", "--store", url, "--cache-dir", str(cache), env=env).returncode == 0
    # v2 has unit 0's files (same bytes), and unit 1's paths and sizes with other bytes.
    new = publish_units(store, tmp_path / "v2", tag="prod", seeds=(10, 21))
    assert new != old
    code, report, err = status_json(cli, cache, "prod", "--store", url, env=env)
    assert code == 12, err
    assert report["release_id"] == new and report["installed_release_id"] == old and report["source"] == url
    assert states(report) == {"m/64x64x1": "stale", "m/64x128x1": "missing"}
    # Without a REF the cache dir's own release is judged, and hits.
    assert status_json(cli, cache)[0] == 0


def test_verify_hashes_and_finds_a_file_with_other_bytes(tmp_path: Path, cli) -> None:
    store = open_store(str(tmp_path / "store"), create=True, env={})
    publish_units(store, tmp_path / "src", tag="prod")
    cache = tmp_path / "cache"
    assert cli("pull", "prod", "--store", str(tmp_path / "store"), "--cache-dir", str(cache)).returncode == 0
    victim = cache / "a/k1.so"
    data = bytearray(victim.read_bytes())
    data[7] ^= 0xFF  # same size, other bytes: only hashing sees it
    victim.write_bytes(bytes(data))
    assert status_json(cli, cache)[0] == 0
    code, report, _ = status_json(cli, cache, "--verify")
    assert code == 12 and states(report)["m/64x64x1"] == "missing" and report["units"][0]["corrupt_files"] == 1


def test_status_without_a_recorded_release_names_what_to_do(tmp_path: Path, cli) -> None:
    result = cli("status", "--cache-dir", str(tmp_path / "nothing"))
    assert result.returncode == 8 and "no installed release recorded" in result.stderr and "hint:" in result.stderr
    assert not (tmp_path / "nothing").exists()


def without_flag(fp: dict[str, str]) -> dict[str, str]:
    """A build host that lacked one of this host's ISA flags."""
    flags = fp["cpu.isa"].split(",")
    return {**fp, "cpu.isa": ",".join(flags[1:])}


def test_a_host_whose_fingerprint_differs_is_a_mismatch_naming_the_field(target, tmp_path: Path, cli) -> None:
    url, env = target
    store = open_store(url, create=True, env=env)
    release_id = publish_units(store, tmp_path / "src", tag="prod", edit=without_flag)
    cache = tmp_path / "cache"
    assert (
        cli("pull", release_id, "--store", url, "--cache-dir", str(cache), "--no-host-check", env=env).returncode == 0
    )
    code, report, err = status_json(cli, cache)
    assert code == 12 and states(report) == {u: "mismatch" for u in UNITS}
    flag = this_host(unit_record("m/64x64x1", {"OMP_NUM_THREADS": "2"}, 0), {"OMP_NUM_THREADS": "2"})["cpu.isa"].split(
        ","
    )[0]
    for unit in report["units"]:
        assert [(c["name"], c["breaking"]) for c in unit["changes"]] == [("cpu.isa", True)]
        assert unit["host_key"] != unit["key"]
    assert "(cpu.isa)" in err
    plain = cli("status", "--cache-dir", str(cache))
    assert f"m/64x64x1: mismatch: cpu.isa: this host also has {flag}, the build did not" in plain.stdout


def test_aten_cpu_capability_default_is_a_mismatch_and_informational_fields_only_warn(tmp_path: Path, cli) -> None:
    url = str(tmp_path / "store")
    store = open_store(url, create=True, env={})
    publish_units(store, tmp_path / "src", tag="prod", edit=lambda fp: {**fp, "diffusers": "0.1.0"})
    cache = tmp_path / "cache"
    pulled = cli("pull", "prod", "--store", url, "--cache-dir", str(cache), "--json")
    assert pulled.returncode == 0, pulled.stderr
    here = this_host(unit_record("m/64x64x1", {}, 0), {})["diffusers"]
    assert json.loads(pulled.stdout)["host_warnings"] == [f"diffusers: build has '0.1.0', this host {here!r}"]
    code, report, err = status_json(cli, cache)
    assert code == 0 and states(report) == {u: "hit" for u in UNITS}, err
    plain = cli("status", "--cache-dir", str(cache))
    assert f"warning: diffusers: build has '0.1.0', this host {here!r} (informational" in plain.stderr
    code, report, err = status_json(cli, cache, env={"ATEN_CPU_CAPABILITY": "default"})
    assert code == 12 and states(report) == {u: "mismatch" for u in UNITS}
    fields = {c["name"] for c in report["units"][0]["changes"]}
    assert {"cpu.capability", "cpu.isa", "env.ATEN_CPU_CAPABILITY"} <= fields and "diffusers" not in fields
    assert "env.ATEN_CPU_CAPABILITY" in err


def test_a_variable_the_build_read_and_this_host_sets_otherwise_is_a_mismatch_naming_it(tmp_path: Path, cli) -> None:
    """What the build's process read (envreads) is compared name by name, neffbuild's lists or not:
    CI unset at build and set here, a variable set at build and unset here; PATH (known to reach
    no key) differing is no mismatch."""
    url = str(tmp_path / "store")
    store = open_store(url, create=True, env={})
    reads = {
        "CI": "",
        "AOT_PARTITIONER_DEBUG": value_digest("AOT_PARTITIONER_DEBUG", "1"),
        "PATH": value_digest("PATH", "/nowhere"),
    }
    publish_units(store, tmp_path / "src", tag="prod", reads=reads)
    cache = tmp_path / "cache"
    assert cli("pull", "prod", "--store", url, "--cache-dir", str(cache), "--no-host-check").returncode == 0
    host = {k: v for k, v in os.environ.items() if k not in ("CI", "AOT_PARTITIONER_DEBUG")}
    code, report, err = status_json(cli, cache, env_exact={**host, "AOT_PARTITIONER_DEBUG": "1"})
    assert code == 0 and states(report) == {u: "hit" for u in UNITS}, err
    code, report, err = status_json(cli, cache, env_exact={**host, "CI": "true", "AOT_PARTITIONER_DEBUG": "1"})
    assert code == 12 and states(report) == {u: "mismatch" for u in UNITS}, err
    assert {c["name"] for u in report["units"] for c in u["changes"]} == {"env.CI"} and "(env.CI)" in err
    assert "hint: set CI here as the build had it" in err
    plain = subprocess.run(
        [sys.executable, "-m", "neffbuild", "status", "--cache-dir", str(cache)],
        capture_output=True, text=True, env={**host, "CI": "true", "AOT_PARTITIONER_DEBUG": "1"}, check=False,
    )  # fmt: skip
    assert "env.CI: this host sets 'true', the build did not" in plain.stdout, plain.stdout
    code, report, err = status_json(cli, cache, env_exact=host)
    assert code == 12 and "(env.AOT_PARTITIONER_DEBUG)" in err
    assert [c["built"].startswith("<a value, xxh3") for u in report["units"] for c in u["changes"]] == [True, True]
    assert "/nowhere" not in json.dumps(report)  # the build's values are never stored or shown
