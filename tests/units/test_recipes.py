"""Compile recipes at plan time: every setting changes the unit key, bad recipe input is one line
exit 2 with a hint, and `plan --json` shows what each key holds. No compiling here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neffbuild.documents.manifest import load_manifest
from neffbuild.errors import ManifestError
from neffbuild.units.plan import make_plan
from tests.conftest import write_model_index
from tests.units.test_plan import MANIFEST, edit, facts_provider, keys, neuron_manifest

TWO_COMPONENTS = 'dtype = "float32"\ncomponents = ["transformer", "vae.decode"]'

# One recipe setting each, written as the manifest's [model.compile] tables (TOML after the entry).
SETTINGS = {
    "mode": '[model.compile]\nmode = "max-autotune-no-cudagraphs"\n',
    "mode reduce-overhead": '[model.compile]\nmode = "reduce-overhead"\n',
    "inductor flag": "[model.compile]\ninductor = { conv_1x1_as_mm = true }\n",
    "inductor flag value": "[model.compile]\ninductor = { epilogue_fusion = false }\n",
    "dynamic": "[model.compile]\ndynamic = true\n",
    "dynamic without duck shapes": "[model.compile]\ndynamic = true\nduck_shape = false\n",
    "memory format": '[model.compile]\nmemory_format = "channels_last"\n',
    "fused qkv": "[model.compile]\nfuse_qkv = true\n",
    "attention backend": '[model.compile]\nattention_backend = "native"\n',
    "matmul precision": '[model.compile]\nmatmul_precision = "high"\n',
    "per-component override": '[model.compile.components."vae.decode"]\nmemory_format = "channels_last"\n',
    "per-component inductor": "[model.compile.components.transformer]\ninductor = { coordinate_descent_tuning = true }\n",
    "dynamic auto": '[model.compile]\ndynamic = "auto"\n',
    "quantize": '[model.compile]\nquantize = "int8-dynamic"\n',
    "quantize with a layer filter": '[model.compile]\nquantize = "int8-dynamic"\nquantize_skip = ["proj_out"]\n',
    "quantize with a size filter": '[model.compile]\nquantize = "int8-dynamic"\nquantize_min_features = 64\n',
}
NEEDS_TORCHAO = {"quantize", "quantize with a layer filter", "quantize with a size filter"}


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    """test_plan's manifest (a model dir holding model_index.json), compiling transformer and vae.decode."""
    write_model_index(tmp_path / "model")
    path = tmp_path / "m.toml"
    path.write_text(MANIFEST.replace('dtype = "float32"', TWO_COMPONENTS))
    return path


def with_recipe(path: Path, recipe: str) -> Path:
    path.write_text(path.read_text() + recipe)
    return path


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_every_recipe_setting_changes_every_key(setting: str, manifest: Path) -> None:
    if setting in NEEDS_TORCHAO:
        pytest.importorskip("torchao")
    before = keys(manifest)
    after = keys(with_recipe(manifest, SETTINGS[setting]))
    assert before.keys() == after.keys()
    assert all(before[u] != after[u] for u in before), setting


def test_settings_key_apart_from_each_other(manifest: Path) -> None:
    pytest.importorskip("torchao")
    text = manifest.read_text()
    seen = {}
    for setting, recipe in SETTINGS.items():
        manifest.write_text(text + recipe)
        seen.setdefault(keys(manifest)["klein/128x128x1"], setting)
    assert len(seen) == len(SETTINGS)


def test_a_recipe_that_spells_out_the_defaults_keeps_the_keys(manifest: Path) -> None:
    before = keys(manifest)
    defaults = '[model.compile]\nmode = "default"\ndynamic = false\nmemory_format = "contiguous"\nfuse_qkv = false\n'
    assert keys(with_recipe(manifest, defaults)) == before


def test_plan_json_shows_each_components_resolved_recipe(manifest: Path, cli) -> None:
    with_recipe(
        manifest, SETTINGS["mode"] + "inductor = { conv_1x1_as_mm = true }\n" + SETTINGS["per-component override"]
    )
    result = cli("plan", str(manifest), "--json")
    assert result.returncode == 0, result.stderr
    recipe = json.loads(result.stdout)["units"][0]["unit"]["recipe"]
    assert recipe["transformer"]["mode"] == recipe["vae.decode"]["mode"] == "max-autotune-no-cudagraphs"
    assert recipe["transformer"]["inductor"] == {"conv_1x1_as_mm": True}
    assert recipe["transformer"]["memory_format"] == "contiguous"
    assert recipe["vae.decode"]["memory_format"] == "channels_last"


def test_plan_says_which_dynamic_shapes_share_a_graph(manifest: Path) -> None:
    edit(
        manifest,
        "shapes = { height = 128, width = [128, 256] }",
        "shapes = { height = 128, width = [128, 256], batch = [1, 2] }",
    )
    plan = make_plan(load_manifest(with_recipe(manifest, SETTINGS["dynamic"])), {}, facts_provider())
    (note,) = [n for n in plan.notes if "dynamic" in n]
    assert "128x128x1, 128x256x1; 128x128x2, 128x256x2" in note


# (recipe, fragments of the one-line message and its hint)
BAD_RECIPES = {
    "unknown inductor setting": (
        "[model.compile]\ninductor = { conv_1x1_as_m = true }\n",
        ["model[klein].compile.inductor.conv_1x1_as_m", "not an Inductor setting", "did you mean 'conv_1x1_as_mm'"],
    ),
    "mistyped inductor setting": (
        "[model.compile]\ninductor = { conv_1x1_as_mm = 1 }\n",
        ["model[klein].compile.inductor.conv_1x1_as_mm", "takes a bool, got 1", "true/false"],
    ),
    "a setting that turns the cache off": (
        "[model.compile]\ninductor = { fx_graph_cache = false }\n",
        ["compile.inductor.fx_graph_cache", "switches the caches", "neffbuild owns the caches"],
    ),
    "fusion on a component without it": (
        '[model.compile.components."text_encoder"]\nfuse_qkv = true\n',
        ["model[klein].compile.fuse_qkv", "'text_encoder': Qwen3ForCausalLM has no fuse_qkv_projections()"],
    ),
    "unknown attention backend": (
        '[model.compile]\nattention_backend = "flashy"\n',
        ["model[klein].compile.attention_backend", "no attention backend 'flashy'", "did you mean 'flash'"],
    ),
    "recipe key typo": (
        '[model.compile]\nmemory_fromat = "channels_last"\n',
        ["model[klein].compile.memory_fromat", "unknown key", "did you mean 'memory_format'"],
    ),
    "bad mode": (
        '[model.compile]\nmode = "max_autotune"\n',
        ["model[klein].compile.mode", "max-autotune"],
    ),
    "override of an unlisted component": (
        "[model.compile.components.unet]\nfuse_qkv = true\n",
        ["compile.components.unet: not a listed component", "transformer, vae.decode"],
    ),
    "float8 on a CPU": (
        '[model.compile]\nquantize = "float8-dynamic"\n',
        ["model[klein].compile.quantize", "'float8-dynamic' on device 'cpu'", "CUDA", "'int8-dynamic' on CPU"],
    ),
    "a layer filter without quantize": (
        '[model.compile]\nquantize_skip = ["proj_out"]\n',
        ["quantize_skip / quantize_min_features have no effect without quantize"],
    ),
    "dynamic neither a bool nor auto": (
        '[model.compile]\ndynamic = "yes"\n',
        ["model[klein].compile.dynamic"],
    ),
    "duck_shape without dynamic": (
        "[model.compile]\nduck_shape = false\n",
        ["duck_shape = false has no effect without dynamic = true"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_each_bad_recipe_is_one_line_exit_2_with_a_hint(case: str, manifest: Path) -> None:
    recipe, expected = BAD_RECIPES[case]
    if case == "float8 on a CPU":
        pytest.importorskip("torchao")
    if case == "fusion on a component without it":
        edit(manifest, '"vae.decode"]', '"vae.decode", "text_encoder"]')
    with pytest.raises(ManifestError) as err:
        make_plan(load_manifest(with_recipe(manifest, recipe)), {}, facts_provider())
    assert err.value.exit_code == 2 and err.value.hint
    assert "\n" not in err.value.message, err.value.message
    for fragment in expected:
        assert fragment in f"{err.value.message} {err.value.hint}", f"{fragment!r} not in {err.value}/{err.value.hint}"


def test_quantization_without_torchao_is_refused_at_plan(manifest: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("torchao") is not None:
        pytest.skip("torchao is installed here")
    with pytest.raises(ManifestError) as err:
        make_plan(
            load_manifest(with_recipe(manifest, '[model.compile]\nquantize = "int8-dynamic"\n')), {}, facts_provider()
        )
    assert err.value.exit_code == 2 and "\n" not in err.value.message
    assert "compile.quantize" in err.value.message and "torchao" in err.value.message and "torchao" in err.value.hint


NEURON_REFUSALS = {
    "dynamic": ("[model.compile]\ndynamic = true\n", "compile.dynamic: the neuron backend compiles static shapes only"),
    "inductor settings": ("[model.compile]\ninductor = { conv_1x1_as_mm = true }\n", "compile.inductor"),
    "mode": ('[model.compile]\nmode = "max-autotune"\n', "compile.mode"),
    "package artifact": ('[model.compile]\nartifact = "package"\n', "compile.artifact: 'package'"),
}


@pytest.mark.parametrize("case", sorted(NEURON_REFUSALS))
def test_neuron_refuses_what_neuronx_cc_cannot_do_at_plan(case: str, manifest: Path) -> None:
    recipe, expected = NEURON_REFUSALS[case]
    neuron_manifest(manifest)
    with pytest.raises(ManifestError) as err:
        make_plan(load_manifest(with_recipe(manifest, recipe)), {}, facts_provider())
    assert err.value.exit_code == 2 and "\n" not in err.value.message and err.value.hint
    assert expected in err.value.message, err.value.message


def test_torchao_is_keyed_where_a_unit_quantizes_and_only_there(manifest: Path) -> None:
    pytest.importorskip("torchao")
    plain = keys(manifest, torchao="0.18.0")
    assert keys(manifest, torchao="0.19.0") == plain  # installing torchao changes no other key
    with_recipe(manifest, SETTINGS["quantize"])
    quantized = keys(manifest, torchao="0.18.0")
    assert quantized != keys(manifest, torchao="0.19.0")
    fingerprint = make_plan(load_manifest(manifest), {}, facts_provider(torchao="0.18.0")).units[0].fingerprint
    assert fingerprint["torchao"] == "0.18.0"


def test_plan_says_the_order_a_dynamic_auto_server_must_call(manifest: Path) -> None:
    edit(manifest, "shapes = { height = 128, width = [128, 256] }", "shapes = { height = 128, width = [256, 128] }")
    plan = make_plan(load_manifest(with_recipe(manifest, SETTINGS["dynamic auto"])), {}, facts_provider())
    (note,) = [n for n in plan.notes if "dynamic 'auto'" in n]
    assert "first calls at 128x256x1, 128x128x1, in this order" in note, note


def test_the_layer_filter_quantizes_what_it_keeps_only() -> None:
    pytest.importorskip("torchao")
    import torch

    from neffbuild.backends.recipe import quantize
    from neffbuild.documents.compile_recipe import ResolvedRecipe

    def model() -> torch.nn.Module:
        return torch.nn.ModuleDict(
            {"proj_out": torch.nn.Linear(32, 32), "big": torch.nn.Linear(32, 32), "small": torch.nn.Linear(32, 8)}
        )

    def quantized(recipe: ResolvedRecipe) -> set[str]:
        module = model()
        quantize(module, recipe)
        return {name for name, layer in module.items() if type(layer.weight) is not torch.nn.Parameter}

    everything = ResolvedRecipe(quantize="int8-dynamic")
    assert quantized(everything) == {"proj_out", "big", "small"}
    assert quantized(ResolvedRecipe(quantize="int8-dynamic", quantize_skip=("proj_*",))) == {"big", "small"}
    assert quantized(ResolvedRecipe(quantize="int8-dynamic", quantize_min_features=16)) == {"proj_out", "big"}


def test_the_printed_recipe_tells_a_hand_writing_user_what_must_match_and_the_order(manifest: Path) -> None:
    from neffbuild.backends.recipecode import recipe_source

    entry = load_manifest(with_recipe(manifest, SETTINGS["dynamic auto"])).manifest.models[0]
    code = recipe_source(entry, "cpu", 8)
    (line,) = [c for c in code.splitlines() if "what must match the build" in c]
    assert "torch.compile's mode, options, dynamic (omitted = 'auto') and fullgraph=True" in line
    assert "# dynamic 'auto': make the first calls at 128x128x1, 128x256x1, in this order." in code
    assert "dynamic=" not in code  # torch's default: the argument left out, as a hand-written server has it
