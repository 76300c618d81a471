"""The product's promise on real components: a real diffusers pipeline compiled by Inductor,
built into a store, pulled into a new directory at another path, replayed with zero compiles."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import write_manifest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pulled(built_store: Path, tmp_path_factory: pytest.TempPathFactory, cli) -> Path:
    cache = tmp_path_factory.mktemp("host-b") / "var" / "cache" / "neffbuild"
    result = cli("pull", "tiny-flux2-klein", "--store", str(built_store), "--cache-dir", str(cache), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["files_fetched"] == report["files_total"] > 0
    assert report["exports"]["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
    return cache


def replay(cli, manifest: Path, cache: Path, outputs: Path) -> tuple[int, dict]:
    result = cli("verify", str(manifest), "--cache-dir", str(cache), "--replay", "--outputs", str(outputs), "--json")
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout)


def test_pulled_cache_replays_with_zero_compiles_and_matches_eager(
    tiny_manifest: Path, pulled: Path, tmp_path: Path, tiny_model: Path, cli
) -> None:
    code, report = replay(cli, tiny_manifest, pulled, tmp_path / "compiled")
    assert code == 0, report
    assert report["misses"] == 0
    assert [u["unit_id"] for u in report["units"]] == ["klein/128x128x1", "klein/128x256x1"]
    for unit in report["units"]:
        assert unit["compiles"] == 0 and unit["written"] == []
        assert unit["counters"].get("inductor.fxgraph_cache_hit", 0) > 0, unit

    eager_manifest = write_manifest(tmp_path / "eager.toml", tiny_model)
    eager_manifest.write_text(
        eager_manifest.read_text().replace('mode = "full"\ncomponents = ["transformer"]\n', 'mode = "eager"\n')
    )
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    code, _ = replay(cli, eager_manifest, empty, tmp_path / "eager")
    assert code == 0
    for unit in report["units"]:
        name = unit["unit_id"].replace("/", "__") + ".pt"
        compiled, eager = torch.load(tmp_path / "compiled" / name), torch.load(tmp_path / "eager" / name)
        assert compiled.shape == eager.shape and compiled.shape[-2:] == (128, int(unit["unit_id"].split("x")[1]))
        torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=1e-3)


def test_second_build_compiles_nothing_and_keeps_the_release(built_store: Path, tiny_manifest: Path, cli) -> None:
    tag_before = json.loads((built_store / "tags" / "tiny-flux2-klein.json").read_text())
    result = cli("build", str(tiny_manifest), "--store", str(built_store), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [o["status"] for o in report["outcomes"]] == ["present", "present"]
    assert sum(o["uploaded"] for o in report["outcomes"]) == 0
    assert report["release_id"] == tag_before["release"]
    assert json.loads((built_store / "tags" / "tiny-flux2-klein.json").read_text()) == tag_before


def test_adding_a_shape_builds_only_the_new_unit(built) -> None:
    first = {o["unit_id"]: o["status"] for o in built.first_build["outcomes"]}
    second = {o["unit_id"]: o["status"] for o in built.second_build["outcomes"]}
    assert first == {"klein/128x128x1": "built"}
    assert second == {"klein/128x128x1": "present", "klein/128x256x1": "built"}
    new_unit = next(o for o in built.second_build["outcomes"] if o["status"] == "built")
    assert new_unit["compiles"] > 0 and new_unit["files"] > 0
    assert built.first_build["tag"] == built.second_build["tag"] == "tiny-flux2-klein"
    assert built.first_build["release_id"] != built.second_build["release_id"]
    history = json.loads((built.path / "tags" / "tiny-flux2-klein.json").read_text())["history"]
    assert [h["release"] for h in history] == [built.first_build["release_id"], built.second_build["release_id"]]


def test_replay_counts_recompiled_kernels_even_when_counters_say_hit(
    tiny_manifest: Path, built_store: Path, tmp_path: Path, cli
) -> None:
    cache = tmp_path / "cache"
    assert cli("pull", "tiny-flux2-klein", "--store", str(built_store), "--cache-dir", str(cache)).returncode == 0
    # One kernel gone: Inductor still reports a graph-cache hit, then rebuilds the kernel.
    removed = sorted(cache.rglob("*.so"))[0]
    removed.unlink()
    code, report = replay(cli, tiny_manifest, cache, tmp_path / "out")
    assert code == 6, report
    assert report["misses"] >= 1
    rewritten = {w["path"]: w for u in report["units"] for w in u["written"]}
    assert rewritten[removed.relative_to(cache).as_posix()]["change"] == "new"
    assert not removed.exists()  # rewritten in the replay's private copy, not in the checked dir


def test_verify_checks_the_cache_files_against_the_store(
    tiny_manifest: Path, built_store: Path, pulled: Path, tmp_path: Path, cli
) -> None:
    ok = cli("verify", str(tiny_manifest), "--cache-dir", str(pulled), "--store", str(built_store))
    assert ok.returncode == 0, ok.stderr
    cache = tmp_path / "damaged"
    shutil.copytree(pulled, cache)
    victim = next(p for p in sorted(cache.rglob("*.so")))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = cli("verify", str(tiny_manifest), "--cache-dir", str(cache), "--store", str(built_store), "--json")
    assert bad.returncode == 4
    corrupt = [p for unit in json.loads(bad.stdout) for p in unit["corrupt"]]
    assert victim.relative_to(cache).as_posix() in corrupt


def test_status_predicts_hits_on_the_pulled_cache_and_a_mismatch_under_another_cpu_capability(
    tiny_manifest: Path, built_store: Path, pulled: Path, tmp_path: Path, cli
) -> None:
    # From the cache dir alone: no store named.
    ok = cli("status", "--cache-dir", str(pulled), "--json")
    assert ok.returncode == 0, ok.stderr
    assert {u["state"] for u in json.loads(ok.stdout)["units"]} == {"hit"}
    by_manifest = cli("status", str(tiny_manifest), "--cache-dir", str(pulled), "--json")
    assert by_manifest.returncode == 0, by_manifest.stderr
    assert [u["unit_id"] for u in json.loads(by_manifest.stdout)["units"]] == ["klein/128x128x1", "klein/128x256x1"]
    # The server would run with scalar kernels: every unit's key differs, and status says why.
    scalar = {"ATEN_CPU_CAPABILITY": "default"}
    capped = cli("status", "--cache-dir", str(pulled), "--json", env=scalar)
    assert capped.returncode == 12, capped.stderr
    report = json.loads(capped.stdout)
    assert {u["state"] for u in report["units"]} == {"mismatch"}
    assert "env.ATEN_CPU_CAPABILITY" in {c["name"] for u in report["units"] for c in u["changes"]}
    assert "env.ATEN_CPU_CAPABILITY" in capped.stderr
    fresh = tmp_path / "host-c"
    refused = cli("pull", "tiny-flux2-klein", "--store", str(built_store), "--cache-dir", str(fresh), env=scalar)
    assert refused.returncode == 7 and "env.ATEN_CPU_CAPABILITY: this host sets 'default'" in refused.stderr
    assert not fresh.exists()
