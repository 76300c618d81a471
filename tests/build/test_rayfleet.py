"""`build --ray`: each unit a task on a real Ray cluster (a local instance, or a head the test
starts with `ray start`), the store as the meeting point, then the fan-in."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from neffbuild.build.rayfleet import unit_resources
from neffbuild.documents.manifest import load_manifest
from neffbuild.store import open_store
from neffbuild.units.plan import make_plan
from tests.build.test_fanin import manifest, publish_unit  # noqa: F401  (a fixture)
from tests.conftest import write_manifest
from tests.test_e2e import replay

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
pytestmark = pytest.mark.xdist_group("ray")  # one Ray cluster on the machine at a time
RAY_BIN = Path(sys.executable).with_name("ray")
# Ray's token authentication (on by default since 2.52) is for clusters reached over a network;
# this one listens on 127.0.0.1 for one test. The driver would otherwise need the head's token.
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


def test_present_units_are_reported_by_their_tasks_and_released(
    ray_head: str,
    manifest: Path,  # noqa: F811
    tmp_path: Path,
    cli,
) -> None:
    """Every unit already has a bundle (as if built earlier): each Ray task finds its own unit
    present, and the driver releases and moves the tag, exactly as a one-process build would."""
    plan = make_plan(load_manifest(manifest), dict(os.environ))
    store = open_store(str(tmp_path / "store"), create=True)
    for unit in plan.units:
        publish_unit(store, tmp_path / "work", unit)
    report = tmp_path / "report.json"
    result = cli(
        "build", str(manifest), "--store", str(tmp_path / "store"), "--ray", ray_head, "--report", str(report), "--json",
        env=NO_AUTH,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    released = json.loads(result.stdout)
    assert released["missing"] == [] and released["tag"] == "tiny" and released["planned"] is True
    rows = json.loads(report.read_text())
    assert sorted((u["unit_id"], u["status"], u["shard"]) for u in rows["units"]) == sorted(
        (u.unit_id, "present", "ray") for u in plan.units
    )
    assert rows["release_id"] == released["release_id"]
    again = cli("release", str(manifest), "--store", str(tmp_path / "store"), "--json")
    assert json.loads(again.stdout)["release_id"] == released["release_id"]  # what the fan-in gives


def test_ray_with_a_shard_or_a_plan_is_bad_input(manifest: Path, tmp_path: Path, cli) -> None:  # noqa: F811
    for extra in (["--shard", "0/2"], ["--plan", str(tmp_path / "plan.json")]):
        result = cli("build", str(manifest), "--store", str(tmp_path / "store"), "--ray", *extra)
        assert result.returncode == 2 and "--ray: Ray places every unit itself" in result.stderr, result.stderr
    assert not (tmp_path / "store").exists()


def test_resources_follow_the_units_threads_memory_and_neuron_cores(manifest: Path) -> None:  # noqa: F811
    import dataclasses

    unit = make_plan(load_manifest(manifest), dict(os.environ)).units[0]
    assert unit_resources(dataclasses.replace(unit, env={"OMP_NUM_THREADS": "4"}), "inductor", None) == {"num_cpus": 4}
    assert unit_resources(dataclasses.replace(unit, env={}), "inductor", 6 << 30) == {"num_cpus": 1, "memory": 6 << 30}
    on_neuron = dataclasses.replace(unit, env={}, normalized={**unit.normalized, "tensor_parallel": 8})
    assert unit_resources(on_neuron, "neuron", None) == {"num_cpus": 1, "resources": {"neuron_cores": 8}}


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory):
    """A Ray head node started as an operator would (`ray start --head`), stopped afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = tmp_path_factory.mktemp("ray")
    started = subprocess.run(
        [str(RAY_BIN), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
        capture_output=True, text=True, timeout=180, check=False, env={**os.environ, **NO_AUTH},
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run(
            [str(RAY_BIN), "stop", "--force"],
            capture_output=True,
            timeout=120,
            check=False,
            env={**os.environ, **NO_AUTH},
        )
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_a_unit_compiled_as_a_ray_task_is_released_and_replays_with_zero_compiles(
    ray_head: str, tiny_model: Path, tmp_path: Path, cli
) -> None:
    # One shape, compiled regionally, keeps the compile short: the Ray path is under test here.
    one = write_manifest(tmp_path / "one.toml", tiny_model, widths=(128,), mode="regional")
    store = str(tmp_path / "store")
    report = tmp_path / "report.json"
    built = cli("build", str(one), "--store", store, "--ray", ray_head, "--report", str(report), "--json", env=NO_AUTH)
    assert built.returncode == 0, built.stderr
    (row,) = json.loads(report.read_text())["units"]
    assert row["status"] == "built" and row["shard"] == "ray" and row["compiles"] > 0 and row["peak_rss"] > 0
    cache = tmp_path / "host" / "cache"
    pulled = cli("pull", "tiny-flux2-klein", "--store", store, "--cache-dir", str(cache), "--json")
    assert pulled.returncode == 0, pulled.stderr
    code, replayed = replay(cli, one, cache, tmp_path / "out")
    assert code == 0 and replayed["misses"] == 0, replayed
