"""Planning and keys: what changes a compiled artifact changes the key, and nothing else does."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest

from neffbuild.backends.base import Backend, cpu_isa_flags
from neffbuild.documents.manifest import load_manifest
from neffbuild.errors import EnvironmentMismatch, InputError, ManifestError
from neffbuild.units.plan import check_buildable, make_plan, plan_document
from tests.conftest import KLEIN_INDEX, once, run_cli, write_model_index

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


def write_planned_model(root: Path) -> Path:
    model = root / "model"
    (model / "transformer").mkdir(parents=True)
    write_model_index(model)
    (model / "transformer" / "config.json").write_text('{"num_layers": 2}')
    (model / "transformer" / "weights.safetensors").write_bytes(b"\0" * 64)
    path = root / "m.toml"
    path.write_text(MANIFEST)
    return path


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    return write_planned_model(tmp_path)


@pytest.fixture(scope="session")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The unedited manifest (read only) and `plan --json` of it by two processes with different
    hash seeds, once per run for both xdist workers (`once`): the two tests on the CLI's plan of it
    share them instead of each importing torch and diffusers (~8 CPU-s), on either worker."""

    def make(root: Path) -> dict:
        path = write_planned_model(root)
        runs = [run_cli("plan", str(path), "--json", env={"PYTHONHASHSEED": seed}) for seed in ("1", "2")]
        return {"manifest": str(path), "runs": [vars(run) for run in runs]}

    made = once(tmp_path_factory, "planned-tiny", make)
    assert isinstance(made, dict)
    return Path(made["manifest"]), made["runs"]


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


def test_changed_mode_changes_keys(manifest: Path) -> None:
    before = set(keys(manifest).values())
    edit(manifest, 'dtype = "float32"', 'dtype = "float32"\nmode = "regional"')
    assert before.isdisjoint(keys(manifest).values())


def test_a_component_method_is_its_own_key(manifest: Path) -> None:
    # Both methods are reached by Flux2Klein's call (encode for image conditioning); a whole
    # `vae` is not, and plan refuses it (test_pipelines.py).
    edit(manifest, 'dtype = "float32"', 'dtype = "float32"\ncomponents = ["transformer", "vae.encode"]')
    encode = set(keys(manifest).values())
    edit(manifest, '"vae.encode"]', '"vae.decode"]')
    assert encode.isdisjoint(keys(manifest).values())


# -- the key holds what changes a graph, and nothing else (warmup-only call arguments) -----------


def test_warmup_only_arguments_keep_every_key(manifest: Path) -> None:
    edit(manifest, "num_inference_steps = 2", 'num_inference_steps = 2\nprompt = "a photo of a cat"')
    before = keys(manifest)
    edit(manifest, "num_inference_steps = 2", "num_inference_steps = 28")
    edit(manifest, 'prompt = "a photo of a cat"', 'prompt = "an oil painting of a lighthouse in a storm, at night"')
    assert keys(manifest) == before
    edit(manifest, "num_inference_steps = 28\n", "")  # the pipeline's default number of steps
    assert keys(manifest) == before


@pytest.mark.parametrize(
    "change",
    [
        "max_sequence_length = 128",  # the text sequence: every graph's shape
        "text_encoder_out_layers = [1, 2]",  # the embedding width
        'prompt = ["a cat", "a dog"]',  # two prompts: a batch of two
    ],
)
def test_arguments_that_change_shapes_change_every_key(manifest: Path, change: str) -> None:
    before = keys(manifest)
    edit(manifest, "num_inference_steps = 2", f"num_inference_steps = 2\n{change}")
    assert set(keys(manifest).values()).isdisjoint(before.values())


def test_prompt_text_stays_in_the_key_where_the_pipeline_is_not_known_to_pad(tmp_path: Path) -> None:
    # QwenImage tokenizes with padding=True (to the longest prompt) and drops the padding again:
    # another text is another sequence length.
    write_model_index(
        tmp_path / "model",
        {"_class_name": "QwenImagePipeline", "transformer": ["diffusers", "QwenImageTransformer2DModel"]},
    )
    path = tmp_path / "m.toml"
    path.write_text(
        MANIFEST.replace("Flux2KleinPipeline", "QwenImagePipeline").replace(
            "num_inference_steps = 2", 'prompt = "a cat"'
        )
    )
    before = keys(path)
    edit(path, 'prompt = "a cat"', 'prompt = "a dog on a skateboard"')
    assert set(keys(path).values()).isdisjoint(before.values())


def test_plan_json_shows_what_the_key_leaves_out(manifest: Path, cli) -> None:
    edit(
        manifest,
        "num_inference_steps = 2",
        'num_inference_steps = 2\nprompt = ["a cat", "a dog"]\nmax_sequence_length = 64',
    )
    unit = plan_document(make_plan(load_manifest(manifest), {}, facts_provider()))["units"][0]
    assert unit["left_out_of_key"] == {"num_inference_steps": 2, "prompt": ["a cat", "a dog"]}
    assert unit["unit"]["call"] == {"max_sequence_length": 64, "prompt": ["<text>", "<text>"]}
    text = cli("plan", str(manifest))
    assert text.returncode == 0, text.stderr
    assert "left out of the keys (warmup only): num_inference_steps, prompt" in text.stdout


@pytest.mark.parametrize(
    "pipeline, padded",
    [
        ("FluxPipeline", {"prompt", "prompt_2", "negative_prompt", "negative_prompt_2"}),
        ("Flux2KleinPipeline", {"prompt"}),
        (
            "StableDiffusion3Pipeline",
            {"prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3"},
        ),
        ("StableDiffusionXLPipeline", {"prompt", "prompt_2", "negative_prompt", "negative_prompt_2"}),
        ("StableDiffusionPipeline", {"prompt", "negative_prompt"}),
        ("QwenImagePipeline", set()),  # padding=True: to the longest prompt, so the text is a length
    ],
)
def test_padded_prompts_are_read_from_the_pipeline_code(pipeline: str, padded: set[str]) -> None:
    """What the hand-written table held (and SDXL, SD 1.5, which it lacked), read from the
    installed diffusers' tokenizer calls instead of a list of class names."""
    import diffusers

    from neffbuild.backends.pipecode import call_facts

    assert call_facts(getattr(diffusers, pipeline)).padded_prompts == padded


def test_a_prompt_list_multiplies_the_batch_in_the_unit_id_and_key(manifest: Path) -> None:
    one = keys(manifest)
    edit(manifest, "num_inference_steps = 2", 'num_inference_steps = 2\nprompt = ["a cat", "a dog"]')
    edit(manifest, "width = [128, 256] }", "width = [128, 256], batch = [1, 2] }")
    two = keys(manifest)
    assert list(two) == ["klein/128x128x2", "klein/128x128x4", "klein/128x256x2", "klein/128x256x4"]
    assert set(two.values()).isdisjoint(one.values())


# -- checks before any worker starts ---------------------------------------------------------------

PLAN_CHECKS = {
    "pipeline class typo": (
        ('pipeline = "Flux2KleinPipeline"', 'pipeline = "Flux2KlienPipeline"'),
        ["model[klein].pipeline", "no pipeline 'Flux2KlienPipeline'", "did you mean 'Flux2KleinPipeline'"],
    ),
    "not a pipeline class": (
        ('pipeline = "Flux2KleinPipeline"', 'pipeline = "AutoencoderKL"'),
        ["model[klein].pipeline", "not a pipeline class"],
    ),
    "component typo": (
        ('dtype = "float32"', 'dtype = "float32"\ncomponents = ["transfomer"]'),
        [
            "model[klein].components",
            "'transfomer' is not a component",
            "did you mean 'transformer'",
            "model_index.json lists",
        ],
    ),
    "component method typo": (
        ('dtype = "float32"', 'dtype = "float32"\ncomponents = ["vae.decod"]'),
        ["model[klein].components", "AutoencoderKLFlux2 has no method 'decod'", "did you mean 'decode'"],
    ),
    "component that is no module": (
        ('dtype = "float32"', 'dtype = "float32"\ncomponents = ["tokenizer"]'),
        ["model[klein].components", "'tokenizer' is a Qwen2Tokenizer, not a torch module"],
    ),
    "regional without repeated blocks": (
        ('dtype = "float32"', 'dtype = "float32"\nmode = "regional"\ncomponents = ["vae"]'),
        ["model[klein].components", "declares no _repeated_blocks", "mode = 'full'"],
    ),
    "regional with a method": (
        ('dtype = "float32"', 'dtype = "float32"\nmode = "regional"\ncomponents = ["vae.decode"]'),
        ["model[klein]", "'vae.decode' names a method", "mode 'regional'"],
    ),
    "call argument typo": (
        ("num_inference_steps = 2", "num_inference_step = 2"),
        [
            "model[klein].call.num_inference_step",
            "no parameter 'num_inference_step'",
            "did you mean 'num_inference_steps'",
        ],
    ),
    "cuda on a host without cuda": (
        ('dtype = "float32"', 'dtype = "float32"\ndevice = "cuda"'),
        ["model[klein].device", "no CUDA device", "device = 'cpu'"],
    ),
    "neuron without torch-neuronx": (
        ('dtype = "float32"', 'dtype = "float32"\nbackend = "neuron"'),
        ["model[klein].backend", "torch-neuronx is not importable", "[toolchain]"],
    ),
}


@pytest.mark.parametrize("case", sorted(PLAN_CHECKS))
def test_each_plan_check_is_one_line_exit_2_with_its_hint(case: str, manifest: Path) -> None:
    (old, new), expected = PLAN_CHECKS[case]
    if case == "cuda on a host without cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this host has CUDA")
    if case == "neuron without torch-neuronx" and _has_module("torch_neuronx"):
        pytest.skip("torch-neuronx is installed here")
    edit(manifest, old, new)
    with pytest.raises(ManifestError) as err:
        make_plan(load_manifest(manifest), {}, facts_provider())
    assert err.value.exit_code == 2 and err.value.hint
    assert err.value.message.startswith(f"{manifest}: ") and "\n" not in err.value.message
    for fragment in expected:
        assert fragment in f"{err.value.message} {err.value.hint}", (
            f"{fragment!r} not in {err.value.message!r} / {err.value.hint!r}"
        )


@pytest.mark.parametrize("case", ["pipeline class typo", "component method typo"])
def test_build_stops_at_a_plan_check_before_any_worker_starts(case: str, manifest: Path, tmp_path: Path, cli) -> None:
    (old, new), expected = PLAN_CHECKS[case]
    edit(manifest, old, new)
    store, work = tmp_path / "store", tmp_path / "work"
    work.mkdir()
    result = cli("build", str(manifest), "--store", str(store), "--work-dir", str(work))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.startswith(f"error: {manifest}: ")
    assert all(fragment in result.stderr for fragment in expected), result.stderr
    error_lines = [line for line in result.stderr.splitlines() if not line.startswith("hint: ")]
    assert len(error_lines) == 1 and "hint: " in result.stderr
    assert not store.exists() and list(work.iterdir()) == []  # no store opened, no worker scratch


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_hub_models_say_what_could_not_be_checked(manifest: Path, cli) -> None:
    edit(manifest, 'model = "./model"', 'model = "no-such-org/no-such-model"\nrevision = "0123abcd"')
    result = cli("plan", str(manifest))
    assert result.returncode == 0, result.stderr
    assert "note: model[klein]: not checked before building: its components" in result.stderr


def test_eager_on_inductor_says_nothing_is_cached_and_build_refuses(manifest: Path, tmp_path: Path, cli) -> None:
    edit(manifest, 'dtype = "float32"', 'dtype = "float32"\nmode = "eager"')
    plan = make_plan(load_manifest(manifest), {}, facts_provider())
    assert any("mode 'eager' on the inductor backend compiles nothing, so nothing is cached" in n for n in plan.notes)
    with pytest.raises(InputError, match="mode 'eager' on the inductor backend compiles nothing"):
        check_buildable(plan)
    built = cli("build", str(manifest), "--store", str(tmp_path / "store"))
    assert built.returncode == 2 and "nothing to cache" in built.stderr, built.stderr


# -- planning for another host: the [toolchain] table ---------------------------------------------

TOOLCHAIN = """
[toolchain]
torch = "2.9.0"
torch-neuronx = "2.9.0.2.11"
neuronx-cc = "2.21.33"
diffusers = "0.42.1"
transformers = "4.57.1"
torch-mlir = "torch-mlir 20251101+neuron"
jax = "jax 0.6.2"
jaxlib = "jaxlib 0.6.2"
python = "3.11"
target = "trn2"
"torch-neuronx.build" = "RELEASE"
venv = "/opt/neffbuild/venv"
"neuronx-cc.bin" = "/opt/neffbuild/venv/bin/neuronx-cc"
"neuronx-cc.bin-version" = "2.21.33"
"""


def neuron_manifest(manifest: Path, toolchain: str = TOOLCHAIN) -> None:
    edit(manifest, 'dtype = "float32"', 'dtype = "float32"\nbackend = "neuron"')
    edit(manifest, "\n[[model]]", toolchain + "\n[[model]]")


def test_toolchain_plans_neuron_keys_for_another_host(manifest: Path, cli) -> None:
    if _has_module("torch_neuronx"):
        pytest.skip("torch-neuronx is installed here")
    neuron_manifest(manifest)
    result = cli("plan", str(manifest), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["host"] == "declared by [toolchain]"
    assert any(
        n.startswith("planning for another host") and "neuronx-cc '2.21.33' (here 'absent')" in n for n in doc["notes"]
    )
    fingerprint = doc["units"][0]["fingerprint"]
    assert (
        fingerprint["neuronx-cc"] == "2.21.33"
        and fingerprint["neuron.target"] == "trn2"
        and fingerprint["device"] == "neuron"
    )
    assert "absent" not in json.dumps(doc["units"])
    # The same table on another planning host gives the same keys: they come from the manifest.
    plan = make_plan(
        load_manifest(manifest), {}, lambda backend, env, device: {"torch": "2.13.0", "neuronx-cc": "absent"}
    )
    assert [u.key for u in plan.units] == [u["key"] for u in doc["units"]]
    with pytest.raises(EnvironmentMismatch, match=r"\[toolchain\] plans for another host"):
        check_buildable(plan)


def test_an_incomplete_toolchain_never_yields_absent_keys(manifest: Path) -> None:
    neuron_manifest(manifest, TOOLCHAIN.replace('neuronx-cc = "2.21.33"\n', ""))
    with pytest.raises(ManifestError, match=r"toolchain: \[toolchain\] declares no neuronx-cc") as err:
        make_plan(load_manifest(manifest), {}, lambda backend, env, device: backend.collect_facts(env, device))
    assert err.value.exit_code == 2 and "declare them" in (err.value.hint or "")


def test_toolchain_names_are_checked(manifest: Path) -> None:
    neuron_manifest(manifest, TOOLCHAIN.replace("neuronx-cc =", "neuronx_cc ="))
    with pytest.raises(
        ManifestError, match="toolchain.neuronx_cc: not a fact of the neuron backend; did you mean 'neuronx-cc'"
    ):
        make_plan(load_manifest(manifest), {}, facts_provider())


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
    [
        {"OMP_NUM_THREADS": "4"},
        {"ATEN_CPU_CAPABILITY": "avx2"},
        {"TORCH_COMPILE_CACHE_KEY_TAG": "x"},
        {"TORCHINDUCTOR_FREEZING": "1"},
    ],
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


def test_plan_json_shows_units_keys_and_named_fingerprint_fields(planned: tuple[Path, list[dict]]) -> None:
    manifest, (result, _) = planned
    assert result["returncode"] == 0, result["stderr"]
    doc = json.loads(result["stdout"])
    assert [u["unit_id"] for u in doc["units"]] == ["klein/128x128x1", "klein/128x256x1"]
    fingerprint = doc["units"][0]["fingerprint"]
    for field in ("torch", "cpu.isa", "cpu.capability", "cxx", "threads", "python.prefix", "diffusers"):
        assert fingerprint[field], field
    # The CLI's keys are the ones the library computes from the same probe of this host.
    library = make_plan(load_manifest(manifest), dict(os.environ))
    assert {u["unit_id"]: u["key"] for u in doc["units"]} == {u.unit_id: u.key for u in library.units}
    assert doc["env"]["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"


def test_keys_are_stable_across_processes(planned: tuple[Path, list[dict]]) -> None:
    """Two processes with different hash seeds (set and dict order, object ids) key alike."""
    _, runs = planned
    assert all(r["returncode"] == 0 for r in runs), [r["stderr"] for r in runs]
    first, second = ({u["unit_id"]: u["key"] for u in json.loads(r["stdout"])["units"]} for r in runs)
    assert first == second and len(set(first.values())) == 2


def test_guidance_keys_only_where_this_models_configs_let_it_double_the_batch(manifest: Path) -> None:
    """FLUX.2-klein's do_classifier_free_guidance is `guidance_scale > 1 and not is_distilled`
    (its check_inputs also takes guidance_scale, only to warn): a distilled model never doubles
    the batch, so no guidance_scale moves its keys; an undistilled one keys 1.0 (CFG off)."""
    base = keys(manifest)
    text = manifest.read_text()
    for value in ("1.0", "4.0", "7.5"):
        manifest.write_text(
            text.replace("num_inference_steps = 2", f"num_inference_steps = 2\nguidance_scale = {value}")
        )
        assert keys(manifest) == base, value
    write_model_index(manifest.parent / "model", {**KLEIN_INDEX, "is_distilled": False})
    manifest.write_text(text)
    undistilled = keys(manifest)
    manifest.write_text(text.replace("num_inference_steps = 2", "num_inference_steps = 2\nguidance_scale = 7.5"))
    assert keys(manifest) == undistilled  # CFG on either way (the default is 4.0)
    manifest.write_text(text.replace("num_inference_steps = 2", "num_inference_steps = 2\nguidance_scale = 1.0"))
    assert set(keys(manifest).values()).isdisjoint(undistilled.values())
