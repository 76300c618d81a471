#!/usr/bin/env python
"""Write a tiny, randomly initialised FLUX.2-klein pipeline for tests (no hub access).

Usage: python scripts/make_tiny_pipeline.py OUT_DIR [--seed N] [--force] [--blocks DOUBLE,SINGLE]

--blocks: the transformer's double- and single-stream block counts (default 2,2); 5,20 are
FLUX.2-klein-4B's (its transformer config), at this script's tiny width (bench/firstcall.py --blocks).

Standalone on purpose: tests and CI build the fixture without importing neffbuild.
Recipe: ../shared/design/inductor-cache.md ("A tiny FLUX.2-klein pipeline").
Call it with max_sequence_length=64, text_encoder_out_layers=(1,), height/width multiples of 16.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

# Never reach for a hub: everything below is built in memory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
)
from tokenizers.pre_tokenizers import ByteLevel  # noqa: E402
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
HIDDEN = 16  # text encoder width == transformer joint_attention_dim (one output layer is used)

# Enough of Qwen3's template for the pipeline: it renders with enable_thinking=False.
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _tokenizer() -> Qwen2Tokenizer:
    # Byte-level vocab with no merges: every byte is one token, so no vocab files are needed.
    vocab = {sym: i for i, sym in enumerate(sorted(ByteLevel.alphabet()))}
    vocab.update({tok: len(vocab) + i for i, tok in enumerate(SPECIALS)})
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>")
    # Registered as special so chat markup stays one token instead of being split into bytes.
    tok.add_special_tokens({"extra_special_tokens": SPECIALS[1:]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _components(seed: int, blocks: tuple[int, int] = (2, 2)) -> dict[str, object]:
    tokenizer = _tokenizer()
    # Reseed before each component so one component's size never shifts another's weights.
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4,  # = 4 * vae latent_channels (2x2 packed latents)
        num_layers=blocks[0],
        num_single_layers=blocks[1],
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=HIDDEN,
        timestep_guidance_channels=256,
        axes_dims_rope=[4, 4, 4, 4],  # sums to attention_head_dim
        guidance_embeds=False,  # klein is step-distilled: no guidance embedding
    )
    torch.manual_seed(seed)
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            hidden_size=HIDDEN,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=272,  # >= 256 bytes + specials
            max_position_embeddings=512,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(4, 4, 4, 4),  # 4 blocks -> vae_scale_factor 8, as in the real model
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    return {
        "transformer": transformer,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(),
    }


def is_complete(out_dir: Path) -> bool:
    """True if out_dir holds a model_index.json whose components are all present."""
    try:
        index = json.loads((out_dir / "model_index.json").read_text())
    except (OSError, ValueError):
        return False
    names = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v and v[0] is not None]
    return bool(names) and all((out_dir / n).is_dir() for n in names)


def make_tiny_pipeline(out_dir: Path, seed: int = 0, blocks: tuple[int, int] = (2, 2)) -> Path:
    """Build the pipeline and move it into out_dir atomically (replacing any old one)."""
    return save_atomically(Flux2KleinPipeline(**_components(seed, blocks), is_distilled=True), out_dir)


def save_atomically(pipe: object, out_dir: Path) -> Path:
    """save_pretrained into a sibling temp dir, then rename it to out_dir (replacing any old one)."""
    out_dir = Path(out_dir).absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A sibling temp dir is on the same filesystem, so the final rename is atomic.
    tmp = out_dir.parent / f".{out_dir.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.incomplete"
    tmp.mkdir()  # unlike mkdtemp, keeps the umask's permissions for the final dir
    old = tmp.with_suffix(".old")
    try:
        pipe.save_pretrained(tmp)  # type: ignore[attr-defined]
        if out_dir.exists():
            out_dir.rename(old)  # rename() cannot replace a non-empty dir; move it aside first
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--blocks", default="2,2")
    known, rest = ap.parse_known_args(argv)
    double, single = (int(n) for n in known.blocks.split(","))
    return run_script(rest, __doc__.splitlines()[0], lambda out, seed: make_tiny_pipeline(out, seed, (double, single)))


def run_script(argv: list[str] | None, description: str, make: Callable[[Path, int], Path]) -> int:
    """The command line both tiny-pipeline scripts share: OUT_DIR [--seed N] [--force]."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if out_dir is complete")
    args = ap.parse_args(argv)
    out: Path = args.out_dir.absolute()
    if out.exists() and not args.force:
        if is_complete(out):
            print(f"{out} exists and is complete ({_size(out)} bytes); use --force to rebuild")
            return 0
        print(f"error: {out} exists but is not a complete pipeline; use --force to replace it", file=sys.stderr)
        return 2
    out = make(out, args.seed)
    print(f"{out} {_size(out)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
