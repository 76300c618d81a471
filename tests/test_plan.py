"""Planning and keys: what changes a compiled artifact changes the key, and nothing else does."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest

from neffbuild.backends.base import Backend, cpu_isa_flags
from neffbuild.manifest import load_manifest
from neffbuild.plan import make_plan

FACTS = {
    "torch": "2.13.0+cpu",
    "torch.git": "cf30153c",
    "python": "CPython 3.11.7",
    "python.prefix": "/opt/venv",
    "platform": "linux-x86_64",
    "cpu.isa": "avx,avx2,avx512f,fma",
    "cpu.capability": "AVX512",
    "threads.default": "2",
    "cxx.default": "g++: g++ (Debian 12.2.0) 12.2.0",
    "diffusers": "0.42.1",
    "transformers": "5.24.0",
    "triton": "",
}

MANIFEST = """
name = "tiny"

[[model]]
id = "klein"
model = "./model"
pipeline = "Flux2KleinPipeline"
dtype = "float32"
shapes = { height = 128, width = [128, 256] }

[model.call]
num_inference_steps = 2
"""


def facts_provider(**changes: str):
    def provide(backend: Backend, env: Mapping[str, str], device: str) -> Mapping[str, str]:
        return {**FACTS, **changes}

    return provide


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text('{"_class_name": "Flux2KleinPipeline"}')
    (model / "transformer" / "config.json").write_text('{"num_layers": 2}')
    (model / "transformer" / "weights.safetensors").write_bytes(b"\0" * 64)
    path = tmp_path / "m.toml"
    path.write_text(MANIFEST)
    return path


def keys(path: Path, env: Mapping[str, str] | None = None, **fact_changes: str) -> dict[str, str]:
    plan = make_plan(load_manifest(path), env or {}, facts_provider(**fact_changes))
    return {u.unit_id: u.key for u in plan.units}


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_one_unit_per_shape_with_distinct_keys(manifest: Path) -> None:
    got = keys(manifest)
    assert list(got) == ["klein/128x128x1", "klein/128x256x1"]
    assert len(set(got.values())) == 2


def test_unchanged_manifest_keeps_its_keys(manifest: Path) -> None:
    assert keys(manifest) == keys(manifest)


def test_model_moved_to_another_directory_keeps_its_keys(manifest: Path, tmp_path: Path) -> None:
    before = keys(manifest)
    shutil.move(tmp_path / "model", tmp_path / "elsewhere")
    edit(manifest, "./model", "./elsewhere")
    assert keys(manifest) == before


def test_entry_name_is_not_part_of_the_key(manifest: Path) -> None:
    before = keys(manifest)
    edit(manifest, 'id = "klein"', 'id = "renamed"')
    assert sorted(keys(manifest).values()) == sorted(before.values())


def test_changed_dtype_changes_every_key(manifest: Path) -> None:
    before = keys(manifest)
    edit(manifest, 'dtype = "float32"', 'dtype = "bfloat16"')
    after = keys(manifest)
    assert all(after[u] != before[u] for u in before)


def test_changed_shape_changes_only_that_units_key(manifest: Path) -> None:
    before = keys(manifest)
    edit(manifest, "width = [128, 256]", "width = [128, 384]")
    after = keys(manifest)
    assert after["klein/128x128x1"] == before["klein/128x128x1"]
    assert after["klein/128x384x1"] not in before.values()


def test_changed_mode_and_call_change_keys(manifest: Path) -> None:
    before = set(keys(manifest).values())
    edit(manifest, 'dtype = "float32"', 'dtype = "float32"\nmode = "regional"')
    regional = set(keys(manifest).values())
    edit(manifest, "num_inference_steps = 2", "num_inference_steps = 4")
    assert len(before | regional | set(keys(manifest).values())) == 6


def test_changed_model_config_changes_keys_weights_do_not(manifest: Path, tmp_path: Path) -> None:
    before = keys(manifest)
    (tmp_path / "model" / "transformer" / "weights.safetensors").write_bytes(b"\1" * 64)
    assert keys(manifest) == before
    (tmp_path / "model" / "transformer" / "config.json").write_text('{"num_layers": 3}')
    assert set(keys(manifest).values()).isdisjoint(before.values())


@pytest.mark.parametrize(
    "fact, value",
    [
        ("torch", "2.14.0+cpu"),
        ("cpu.isa", "avx,avx2,fma"),  # the AVX-512 -> AVX2 move that produced NaNs
        ("cpu.capability", "AVX2"),
        ("cxx.default", "g++: g++ 13.1"),
        ("python.prefix", "/srv/other-venv"),
        ("diffusers", "0.43.0"),
        ("threads.default", "8"),
    ],
)
def test_environment_fingerprint_changes_keys(manifest: Path, fact: str, value: str) -> None:
    before = keys(manifest)
    after = keys(manifest, **{fact: value})
    assert set(after.values()).isdisjoint(before.values())


@pytest.mark.parametrize(
    "env",
    [{"OMP_NUM_THREADS": "4"}, {"ATEN_CPU_CAPABILITY": "avx2"}, {"TORCH_COMPILE_CACHE_KEY_TAG": "x"}, {"TORCHINDUCTOR_FREEZING": "1"}],
)
def test_compiler_env_vars_change_keys(manifest: Path, env: dict[str, str]) -> None:
    assert set(keys(manifest, env).values()).isdisjoint(keys(manifest).values())


def test_unrelated_env_vars_do_not_change_keys(manifest: Path) -> None:
    assert keys(manifest, {"HOME": "/somewhere", "TERM": "dumb", "TORCHINDUCTOR_CACHE_DIR": "/x"}) == keys(manifest)


def test_manifest_env_overrides_the_probed_thread_count(manifest: Path) -> None:
    edit(manifest, "[model.call]", '[model.env]\nOMP_NUM_THREADS = "2"\n\n[model.call]')
    plan = make_plan(load_manifest(manifest), {"OMP_NUM_THREADS": "7"}, facts_provider())
    assert plan.units[0].fingerprint["threads"] == "2"
    assert plan.runtime_env["OMP_NUM_THREADS"] == "2"


def test_cpu_isa_flags_keep_only_kernel_relevant_flags() -> None:
    cpuinfo = "processor\t: 0\nflags\t\t: fpu vme avx2 avx512f sse4_2 ht fma avx512_bf16 amx_tile\n"
    assert cpu_isa_flags(cpuinfo) == "amx_tile,avx2,avx512_bf16,avx512f,fma,sse4_2"
    assert cpu_isa_flags("Features\t: fp asimd sve2 bf16 crc32\n") == "asimd,bf16,sve2"


def test_plan_json_shows_units_keys_and_named_fingerprint_fields(manifest: Path, cli) -> None:
    result = cli("plan", str(manifest), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [u["unit_id"] for u in doc["units"]] == ["klein/128x128x1", "klein/128x256x1"]
    fingerprint = doc["units"][0]["fingerprint"]
    for field in ("torch", "cpu.isa", "cpu.capability", "cxx", "threads", "python.prefix", "diffusers"):
        assert fingerprint[field], field
    # The CLI's keys are the ones the library computes from the same probe.
    assert all(len(u["key"]) == 32 for u in doc["units"])
    assert doc["env"]["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"
