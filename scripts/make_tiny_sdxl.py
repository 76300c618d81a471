#!/usr/bin/env python
"""Write a tiny, randomly initialised StableDiffusionXL pipeline for tests (no hub access).

Usage: python scripts/make_tiny_sdxl.py OUT_DIR [--seed N] [--force]

A second pipeline family beside FLUX.2-klein: a UNet, two CLIP text encoders, a VAE whose
text-to-image call uses only `decode`. Standalone, like make_tiny_pipeline.py (whose atomic
write and completeness check it reuses). Recipe: ../shared/design/inductor-cache.md ("A tiny
StableDiffusionXL pipeline"). Heights and widths are multiples of 8 (vae_scale_factor).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel  # noqa: E402
from make_tiny_pipeline import run_script, save_atomically  # noqa: E402
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer  # noqa: E402

HIDDEN_1, HIDDEN_2 = 16, 32  # the UNet's cross-attention width is their sum; pooled = HIDDEN_2
TIME_EMBED = 8  # per time id; SDXL passes 6 (original size, crop, target size)
MAX_LENGTH = 77


def _tokenizer(root: Path, pad_token: str) -> CLIPTokenizer:
    # A byte-level vocab with no useful merges; transformers 5 ignores vocab_file/merges_file
    # passed to the constructor, so the files are written and loaded with from_pretrained.
    from tokenizers.pre_tokenizers import ByteLevel

    symbols = sorted(ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({f"{s}</w>": len(symbols) + i for i, s in enumerate(symbols)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    root.mkdir(parents=True)
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer.from_pretrained(root, model_max_length=MAX_LENGTH, pad_token=pad_token, local_files_only=True)


def _text_config(tokenizer: CLIPTokenizer, hidden: int, **extra: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,  # SDXL reads hidden_states[-2]
        num_attention_heads=2,
        max_position_embeddings=MAX_LENGTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def make_pipeline(seed: int, scratch: Path) -> StableDiffusionXLPipeline:
    tokenizer = _tokenizer(scratch / "tokenizer", "<|endoftext|>")
    tokenizer_2 = _tokenizer(scratch / "tokenizer_2", "!")
    # Reseed before each component so one component's size never shifts another's weights.
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(_text_config(tokenizer, HIDDEN_1))
    torch.manual_seed(seed)
    text_encoder_2 = CLIPTextModelWithProjection(_text_config(tokenizer_2, HIDDEN_2, projection_dim=HIDDEN_2))
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        cross_attention_dim=HIDDEN_1 + HIDDEN_2,
        addition_embed_type="text_time",
        addition_time_embed_dim=TIME_EMBED,
        projection_class_embeddings_input_dim=6 * TIME_EMBED + HIDDEN_2,
    )
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(4, 4, 4, 4),  # 4 blocks -> vae_scale_factor 8, as in the real model
        # One resnet per decoder block instead of two (the decoder has layers_per_block + 1): each
        # is its own kernels at its own resolution, and the tests are about the pipeline family, not
        # the VAE's depth (measured: 61 -> 55 C++ kernels in the shared build). The encoder has none,
        # so its downsamplers see the channels they were made for: equal widths keep encode working.
        layers_per_block=0,
        latent_channels=4,
        norm_num_groups=4,
        scaling_factor=0.13025,
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", timestep_spacing="leading", steps_offset=1
    )
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )


def make_tiny_sdxl(out_dir: Path, seed: int = 0) -> Path:
    with tempfile.TemporaryDirectory(prefix="tiny-sdxl-tokenizers-") as scratch:
        return save_atomically(make_pipeline(seed, Path(scratch)), out_dir)


def main(argv: list[str] | None = None) -> int:
    return run_script(argv, __doc__.splitlines()[0], make_tiny_sdxl)


if __name__ == "__main__":
    sys.exit(main())
