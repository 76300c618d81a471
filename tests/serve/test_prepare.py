"""neffbuild.serve.prepare's refusals and `neffbuild recipe`'s text, on the real tiny pipeline,
without compiling (the end-to-end hits are tests/test_recipes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neffbuild.errors import InputError, PipelineMismatch
from tests.conftest import write_manifest


@pytest.fixture(scope="module")
def pipe(tiny_model: Path):
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline.from_pretrained(tiny_model, torch_dtype=torch.float32, local_files_only=True)


def test_prepare_refuses_a_pipeline_of_another_dtype_naming_it(pipe, tiny_manifest: Path, tmp_path: Path) -> None:
    import neffbuild.serve

    manifest = tmp_path / "bf16.toml"
    manifest.write_text(tiny_manifest.read_text().replace('dtype = "float32"', 'dtype = "bfloat16"'))
    with pytest.raises(PipelineMismatch, match=r"model\[klein\]: transformer is float32, the entry built bfloat16"):
        neffbuild.serve.prepare(pipe, manifest)
    assert not hasattr(pipe.transformer, "_compiled_call_impl") or pipe.transformer._compiled_call_impl is None


def test_prepare_refuses_another_pipeline_class(pipe, tiny_manifest: Path, tmp_path: Path) -> None:
    import neffbuild.serve

    manifest = tmp_path / "sdxl.toml"
    manifest.write_text(
        tiny_manifest.read_text().replace('pipeline = "Flux2KleinPipeline"', 'pipeline = "StableDiffusionXLPipeline"')
    )
    with pytest.raises(
        PipelineMismatch, match="the pipeline is a Flux2KleinPipeline, the entry built a StableDiffusionXLPipeline"
    ):
        neffbuild.serve.prepare(pipe, manifest, entry="klein")
    with pytest.raises(InputError, match="0 entries build a Flux2KleinPipeline"):
        neffbuild.serve.prepare(pipe, manifest)
    with pytest.raises(InputError, match="no entry 'other'"):
        neffbuild.serve.prepare(pipe, manifest, entry="other")


def test_prepare_refuses_a_pipeline_without_a_listed_component(tiny_model: Path, tmp_path: Path) -> None:
    from diffusers import Flux2KleinPipeline

    import neffbuild.serve

    no_vae = Flux2KleinPipeline.from_pretrained(tiny_model, torch_dtype=torch.float32, vae=None, local_files_only=True)
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128,))
    manifest.write_text(manifest.read_text().replace('["transformer"]', '["transformer", "vae.decode"]'))
    with pytest.raises(PipelineMismatch, match="the pipeline has no component 'vae'"):
        neffbuild.serve.prepare(no_vae, manifest)


def test_recipe_prints_the_statements_the_build_applies(tiny_model: Path, tmp_path: Path, cli) -> None:
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128, 256))
    manifest.write_text(
        manifest.read_text().replace('["transformer"]', '["transformer", "vae.decode"]')
        + '\n[model.compile]\ndynamic = true\nduck_shape = false\nmatmul_precision = "high"\n'
        + "[model.compile.components.transformer]\nfuse_qkv = true\ninductor = { conv_1x1_as_mm = true }\n"
        + '[model.compile.components."vae.decode"]\nmemory_format = "channels_last"\n'
    )
    result = cli("recipe", str(manifest))
    assert result.returncode == 0, result.stderr
    code = [line for line in result.stdout.splitlines() if line and not line.startswith("#")]
    assert code == [
        "import torch",
        "import torch._dynamo",
        "import torch._inductor",
        "torch._dynamo.config.recompile_limit = 8",
        "torch._dynamo.config.accumulated_recompile_limit = 256",
        "pipe = pipe.to('cpu')",
        "torch.set_float32_matmul_precision('high')",
        "import torch.fx.experimental._config",
        "torch.fx.experimental._config.use_duck_shape = False",
        "torch._dynamo.config.specialize_float = True",
        "pipe.transformer.fuse_qkv_projections()",
        "pipe.vae.to(memory_format=torch.channels_last)",
        "pipe.transformer.compile(fullgraph=True, dynamic=True, options={'conv_1x1_as_mm': True})",
        "pipe.vae.decode = torch.compile(pipe.vae.decode, fullgraph=True, dynamic=True)",
    ]
    compile(result.stdout, "recipe.py", "exec")  # plain Python


def test_recipe_refuses_bad_input_like_plan(tiny_model: Path, tmp_path: Path, cli) -> None:
    manifest = write_manifest(tmp_path / "m.toml", tiny_model, widths=(128,))
    manifest.write_text(manifest.read_text() + "\n[model.compile]\ninductor = { epilogue_fusio = false }\n")
    result = cli("recipe", str(manifest))
    assert result.returncode == 2
    assert "compile.inductor.epilogue_fusio: not an Inductor setting" in result.stderr
    assert "did you mean 'epilogue_fusion'" in result.stderr and result.stdout == ""
