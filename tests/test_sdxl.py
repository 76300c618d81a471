"""A second pipeline family: tiny StableDiffusionXL (and SD 1.5 at plan level). What plan reads
from the pipeline's own code, checked against what its components really receive, then one
shared real build: pull elsewhere, replay with 0 compiles, and manifests that differ only in
what no graph sees keep their keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from neffbuild.documents.manifest import load_manifest
from neffbuild.errors import ManifestError
from neffbuild.units.plan import make_plan
from tests.conftest import SDXL_ONE_SHAPE, BuiltSdxl, write_sdxl_manifest
from tests.units.test_plan import facts_provider


def plan_keys(path: Path) -> list[str]:
    return [u.key for u in make_plan(load_manifest(path), {}, facts_provider()).units]


def plan_error(path: Path) -> ManifestError:
    with pytest.raises(ManifestError) as err:
        make_plan(load_manifest(path), {}, facts_provider())
    assert err.value.exit_code == 2 and err.value.hint
    return err.value


# -- plan: arguments through **kwargs, components, tuples, prompt lists --------------------------


@pytest.mark.parametrize(
    "old, new, expected",
    [
        (
            "num_inference_steps = 2",
            "num_inference_step = 2",
            ["call.num_inference_step", "did you mean 'num_inference_steps'"],
        ),
        (
            "num_inference_steps = 2",
            "num_inference_steps = 2\nmax_sequence_length = 64",
            ["call.max_sequence_length", "no parameter 'max_sequence_length'"],
        ),
        (
            "num_inference_steps = 2",
            "num_inference_steps = 2\ntext_encoder_out_layers = [1]",
            ["call.text_encoder_out_layers"],
        ),
        (
            'components = ["unet", "vae.decode"]',
            'components = ["unet", "vae"]',
            ["never calls vae.forward", "'vae.decode'"],
        ),
        (
            'components = ["unet", "vae.decode"]',
            'components = ["unet", "vae.encode"]',
            ["never calls vae.encode", "'vae.decode'"],
        ),
        (
            'prompt = "a photo of a cat"',
            'prompt = "a photo of a cat"\nprompt_2 = ["a", "b"]',
            ["call.prompt_2 has 2 entries for 1 prompt;"],
        ),
        (
            'prompt = "a photo of a cat"',
            'prompt = ["a cat", "a dog"]\nnegative_prompt_2 = ["blurry"]',
            ["call.negative_prompt_2 has 1 entry for 2 prompts"],
        ),
        ("original_size = [64, 64]", "original_size = [64, 64, 3]", ["call.original_size", "2-tuple, got 3 items"]),
        (
            'mode = "full"',
            'mode = "regional"',
            ["'vae.decode' names a method", "second [[model]] entry", "mode = 'full'"],
        ),
    ],
)
def test_sdxl_mistakes_exit_2_at_plan_naming_the_argument(
    tiny_sdxl: Path, tmp_path: Path, old: str, new: str, expected: list[str]
) -> None:
    manifest = write_sdxl_manifest(tmp_path / "m.toml", tiny_sdxl, replace=((old, new),))
    if "regional" in new or " for 1 prompt" in expected[0] or " for 2 prompts" in expected[0]:
        with pytest.raises(ManifestError) as err:
            load_manifest(manifest)
        error = err.value
    else:
        error = plan_error(manifest)
    text = f"{error.message} {error.hint}"
    assert all(fragment in text for fragment in expected), text


def test_deprecated_pass_through_arguments_of_kwargs_are_accepted(tiny_sdxl: Path, tmp_path: Path) -> None:
    manifest = write_sdxl_manifest(
        tmp_path / "m.toml",
        tiny_sdxl,
        replace=(("num_inference_steps = 2", "num_inference_steps = 2\ncallback_steps = 1"),),
    )
    assert len(plan_keys(manifest)) == 2


def test_the_typo_exits_2_from_the_cli_before_any_worker(tiny_sdxl: Path, tmp_path: Path, cli) -> None:
    manifest = write_sdxl_manifest(
        tmp_path / "m.toml", tiny_sdxl, replace=(("num_inference_steps = 2", "num_inference_step = 2"),)
    )
    result = cli("build", str(manifest), "--store", str(tmp_path / "store"))
    assert result.returncode == 2 and "num_inference_step" in result.stderr, result.stderr
    assert not (tmp_path / "store").exists()


# -- keys: what the graphs see --------------------------------------------------------------------

SAME_GRAPHS = {
    "prompt text": ('prompt = "a photo of a cat"', 'prompt = "an oil painting of a lighthouse in a storm, at night"'),
    "negative prompt": ('negative_prompt = "blurry"', 'negative_prompt = "low quality, watermark, text"'),
    # force_zeros_for_empty_prompt: without one, zeros_like the prompt's embeddings, of one shape
    "negative prompt omitted": ('negative_prompt = "blurry"', ""),
    "negative prompt as a list of one": ('negative_prompt = "blurry"', 'negative_prompt = ["blurry"]'),
    "guidance 7.5": ("guidance_scale = 5.0", "guidance_scale = 7.5"),
    "guidance 5 (int)": ("guidance_scale = 5.0", "guidance_scale = 5"),
    "guidance omitted": ("guidance_scale = 5.0", ""),
    "steps": ("num_inference_steps = 2", "num_inference_steps = 30"),
}
OTHER_GRAPHS = {
    "guidance 1.0": ("guidance_scale = 5.0", "guidance_scale = 1.0"),  # no CFG: the UNet batch halves
    "original size": (
        "original_size = [64, 64]",
        "original_size = [128, 128]",
    ),  # conservative: a plain value stays keyed
    "two prompts": ('prompt = "a photo of a cat"', 'prompt = ["a cat", "a dog"]'),
}


@pytest.mark.parametrize("case", sorted(SAME_GRAPHS))
def test_what_no_graph_sees_keeps_the_keys(tiny_sdxl: Path, tmp_path: Path, case: str) -> None:
    base = plan_keys(write_sdxl_manifest(tmp_path / "a.toml", tiny_sdxl))
    assert plan_keys(write_sdxl_manifest(tmp_path / "b.toml", tiny_sdxl, replace=(SAME_GRAPHS[case],))) == base


@pytest.mark.parametrize("case", sorted(OTHER_GRAPHS))
def test_what_a_graph_sees_changes_the_keys(tiny_sdxl: Path, tmp_path: Path, case: str) -> None:
    base = plan_keys(write_sdxl_manifest(tmp_path / "a.toml", tiny_sdxl))
    other = plan_keys(write_sdxl_manifest(tmp_path / "b.toml", tiny_sdxl, replace=(OTHER_GRAPHS[case],)))
    assert set(other).isdisjoint(base)


def test_plan_shows_the_batch_the_graphs_see(tiny_sdxl: Path, tmp_path: Path, cli) -> None:
    cfg = cli("plan", str(write_sdxl_manifest(tmp_path / "a.toml", tiny_sdxl)), "--json")
    assert cfg.returncode == 0, cfg.stderr
    units = json.loads(cfg.stdout)["units"]
    assert [u["graph_batch"] for u in units] == [2, 2]
    assert units[0]["reduced_in_key"] == {"guidance_scale": "guidance_scale > 1 (do_classifier_free_guidance)"}
    no_cfg = write_sdxl_manifest(
        tmp_path / "b.toml", tiny_sdxl, replace=(("guidance_scale = 5.0", "guidance_scale = 1.0"),)
    )
    plan = make_plan(load_manifest(no_cfg), {}, facts_provider())
    assert [u.graph_batch for u in plan.units] == [1, 1]
    assert plan.units[0].normalized["call"]["guidance_scale"] == {"> 1": False}
    table = cli("plan", str(no_cfg), env={"COLUMNS": "200"})
    assert "keyed only as guidance_scale > 1 (do_classifier_free_guidance)" in table.stdout, table.stdout
    assert "the graphs see batch" not in table.stdout
    assert "left out of the keys (warmup only): negative_prompt, num_inference_steps, prompt\n" in table.stdout
    doubled = cli("plan", str(tmp_path / "a.toml"))
    assert "sdxl/64x64x1: the graphs see batch 2 (classifier-free guidance doubles it)" in doubled.stdout, (
        doubled.stdout
    )


def test_the_plans_claims_hold_for_what_the_components_receive(tiny_sdxl: Path) -> None:
    """Run the real tiny pipeline eagerly (no compile) and record what the UNet and vae.decode
    receive: the arguments plan leaves out change nothing there, guidance 1.0 changes the batch."""
    import torch
    from diffusers import StableDiffusionXLPipeline

    from neffbuild.backends.components import describe_input

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl, torch_dtype=torch.float32, local_files_only=True)
    seen: list[str] = []
    pipe.unet.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(describe_input((args, kwargs))), with_kwargs=True
    )
    decode = pipe.vae.decode
    pipe.vae.decode = lambda *a, **k: (seen.append(describe_input((a, k))), decode(*a, **k))[1]

    def received(**call: object) -> list[str]:
        seen.clear()
        pipe(height=64, width=64, num_inference_steps=2, output_type="pt", original_size=(64, 64), **call)
        return sorted(set(seen))

    base = received(prompt="a photo of a cat", negative_prompt="blurry", guidance_scale=5.0)
    assert any("float32[2, 4, 8, 8]" in s for s in base)  # CFG: the UNet sees batch 2
    assert (
        received(
            prompt="an oil painting of a lighthouse in a storm, at night", negative_prompt="blurry", guidance_scale=5.0
        )
        == base
    )
    assert received(prompt="a photo of a cat", negative_prompt="low quality, watermark", guidance_scale=7.5) == base
    assert received(prompt="a photo of a cat", guidance_scale=5.0) == base  # no negative prompt: zeros, one shape
    assert received(prompt="a photo of a cat", guidance_scale=1.0) != base


# -- SD 1.5 at plan level: its configs only ----------------------------------------------------------


@pytest.fixture
def sd15(tiny_sdxl: Path, tmp_path: Path) -> Path:
    """A StableDiffusionPipeline directory with configs only (enough to plan): the SDXL UNet's
    and VAE's configs stand in for SD 1.5's."""
    model = tmp_path / "sd15"
    for name in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        shutil.copytree(tiny_sdxl / name, model / name, ignore=shutil.ignore_patterns("*.safetensors"))
    index = json.loads((tiny_sdxl / "model_index.json").read_text())
    keep = ("scheduler", "text_encoder", "tokenizer", "unet", "vae")
    index = {"_class_name": "StableDiffusionPipeline", **{k: index[k] for k in keep}}
    index.update(safety_checker=[None, None], feature_extractor=[None, None], requires_safety_checker=False)
    (model / "model_index.json").write_text(json.dumps(index))
    manifest = tmp_path / "sd15.toml"
    manifest.write_text(
        f'name = "sd15"\n[[model]]\nid = "sd15"\nmodel = "{model}"\npipeline = "StableDiffusionPipeline"\ndtype = "float32"\n'
        'components = ["unet", "vae.decode"]\nshapes = { height = 64, width = 64 }\n[model.call]\nprompt = "a cat"\nnegative_prompt = "blurry"\nnum_inference_steps = 2\n'
    )
    return manifest


def test_sd15_plans_checks_and_keys_from_its_own_code(sd15: Path) -> None:
    base = plan_keys(sd15)
    text = sd15.read_text()
    for old, new in (
        (
            'prompt = "a cat"\nnegative_prompt = "blurry"',
            'prompt = "a dog on a skateboard"\nnegative_prompt = "watermark, text"',
        ),
        ("num_inference_steps = 2", "guidance_scale = 7.5"),
    ):
        assert old in text
        sd15.write_text(text.replace(old, new))
        assert plan_keys(sd15) == base, new
    sd15.write_text(text.replace("num_inference_steps = 2", "guidance_scale = 1.0"))
    assert plan_keys(sd15) != base
    for old, new, fragment in (
        ("num_inference_steps", "num_inference_step", "did you mean 'num_inference_steps'"),
        ("num_inference_steps = 2", "prompt_2 = 'x'", "no parameter 'prompt_2'"),
        ('"vae.decode"', '"vae"', "'vae.decode'"),
    ):
        assert old in text
        sd15.write_text(text.replace(old, new))
        error = plan_error(sd15)
        assert fragment in f"{error.message} {error.hint}"


def test_the_worker_passes_tuple_arguments_as_tuples(tiny_sdxl: Path, tmp_path: Path) -> None:
    from neffbuild.backends.calls import call_kwargs

    manifest = write_sdxl_manifest(
        tmp_path / "m.toml",
        tiny_sdxl,
        replace=(("num_inference_steps = 2", "num_inference_steps = 2\ntarget_size = [64, 64]"),),
    )
    entry = load_manifest(manifest).manifest.models[0]
    kwargs = call_kwargs(entry, entry.expanded_shapes()[0])
    assert kwargs["original_size"] == (64, 64) and kwargs["target_size"] == (64, 64)
    assert kwargs["prompt"] == "a photo of a cat"  # lists that are not tuples in the signature stay


# -- one real build, shared ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pulled_sdxl(built_sdxl: BuiltSdxl, tmp_path_factory: pytest.TempPathFactory, cli) -> Path:
    cache = tmp_path_factory.mktemp("sdxl-host-b") / "srv" / "cache"
    result = cli("pull", "tiny-sdxl", "--store", str(built_sdxl.store), "--cache-dir", str(cache))
    assert result.returncode == 0, result.stderr
    return cache


@pytest.mark.slow
@pytest.mark.timeout(1800)  # its setup builds the unet and vae.decode cold: minutes, more on a busy machine
def test_sdxl_builds_records_what_graphs_saw_and_replays_pulled_with_zero_compiles(
    built_sdxl: BuiltSdxl, pulled_sdxl: Path, tmp_path: Path, cli
) -> None:
    outcomes = built_sdxl.report["outcomes"]
    assert [(o["unit_id"], o["status"]) for o in outcomes] == [("sdxl/64x64x1", "built")]
    assert all(o["compiles"] > 0 for o in outcomes)
    bundle = json.loads((built_sdxl.store / "bundles" / f"{outcomes[0]['key']}.json").read_text())
    assert bundle["counters"]["graphs.unet"] >= 1 and bundle["counters"]["graphs.vae.decode"] >= 1
    assert set(bundle["inputs"]) == {"unet", "vae.decode"}
    assert any(s.startswith("float32[2, 4, 8, 8]") for s in bundle["inputs"]["unet"])  # the batch CFG doubled
    # Another prompt, no negative prompt (zeros of one shape) and guidance 7.5: the same keys (the
    # files check below plans them), and the replay proves it.
    changed = write_sdxl_manifest(
        tmp_path / "changed.toml",
        Path(load_manifest(built_sdxl.manifest).resolve_model(load_manifest(built_sdxl.manifest).manifest.models[0])),
        replace=(
            SDXL_ONE_SHAPE,
            ('prompt = "a photo of a cat"', 'prompt = "a lighthouse in a storm"'),
            ('negative_prompt = "blurry"', ""),
            ("guidance_scale = 5.0", "guidance_scale = 7.5"),
        ),
    )
    result = cli("verify", str(changed), "--cache-dir", str(pulled_sdxl), "--replay", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["misses"] == 0 and len(report["units"]) == 1, report
    assert all(u["compiles"] == 0 and u["written"] == [] for u in report["units"])
    files = cli("verify", str(changed), "--cache-dir", str(pulled_sdxl), "--store", str(built_sdxl.store))
    assert files.returncode == 0, files.stderr


@pytest.mark.slow
def test_status_hits_for_what_no_graph_sees_and_names_the_manifest_field_otherwise(
    built_sdxl: BuiltSdxl, pulled_sdxl: Path, tmp_path: Path, cli
) -> None:
    model = Path(
        load_manifest(built_sdxl.manifest).resolve_model(load_manifest(built_sdxl.manifest).manifest.models[0])
    )
    same = write_sdxl_manifest(
        tmp_path / "same.toml",
        model,
        replace=(
            SDXL_ONE_SHAPE,
            ("guidance_scale = 5.0", "guidance_scale = 7.5"),
        ),
    )
    ok = cli("status", str(same), "--cache-dir", str(pulled_sdxl), "--json")
    assert ok.returncode == 0, ok.stderr
    assert {u["state"] for u in json.loads(ok.stdout)["units"]} == {"hit"}
    other = write_sdxl_manifest(
        tmp_path / "other.toml",
        model,
        replace=(
            SDXL_ONE_SHAPE,
            ("guidance_scale = 5.0", "guidance_scale = 1.0"),
        ),
    )
    miss = cli("status", str(other), "--cache-dir", str(pulled_sdxl))
    assert miss.returncode == 12, miss.stderr
    assert "model[sdxl].call.guidance_scale" in miss.stderr and "host's environment" not in miss.stderr, miss.stderr
