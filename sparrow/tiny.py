"""Tiny random models built in code (no downloads): the `tiny:` model specs the services
accept, the random-weights demo, tests and benchmarks. The models are real transformers
models with real tokenizers; save them with `save_pretrained` and load them back with
`TargetModel.from_pretrained`. Also `synthetic_frames`, raw frames to feed them.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration)

from .models.draft import DraftArchitecture, SparrowDraft
from .models.target import TargetModel
from .tokenizer import llava_ov_tokenizer, qwen_vl_tokenizer

ARCHS = ("qwen2_5_vl", "llava_onevision")


def _text_config(tok, hidden: int, layers: int, heads: int, kv_heads: int, init_range: float) -> dict:
    return dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32768,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
        bos_token_id=None, initializer_range=init_range, tie_word_embeddings=False,
    )


def tiny_qwen_config(tok, hidden: int = 64, layers: int = 4, heads: int = 4, init_range: float = 0.1):
    ids = tok.convert_tokens_to_ids
    head_dim = hidden // heads
    section = [head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6]   # sums to head_dim / 2
    text = _text_config(tok, hidden, layers, heads, max(1, heads // 2), init_range)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1], tokens_per_second=2, initializer_range=init_range),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def tiny_llava_ov_config(tok, hidden: int = 64, layers: int = 4, heads: int = 4, init_range: float = 0.1,
                         image_size: int = 56):
    ids = tok.convert_tokens_to_ids
    text = _text_config(tok, hidden, layers, heads, max(1, heads // 2), init_range)
    text["model_type"] = "qwen2"
    return LlavaOnevisionConfig(
        text_config=text,
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=image_size, patch_size=14),
        image_token_index=ids("<image>"), video_token_index=ids("<video>"),
        vision_feature_layer=-1, vision_feature_select_strategy="full", tie_word_embeddings=False,
        image_grid_pinpoints=[[image_size, image_size]],
    )


def tiny_target(arch: str = "qwen2_5_vl", seed: int = 0, **size) -> TargetModel:
    """A tiny random target of the given architecture with a matching tokenizer.

    The global RNG is left as it was (the weights come from a forked RNG seeded with `seed`).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if arch == "qwen2_5_vl":
        tok = qwen_vl_tokenizer()
        config, cls = tiny_qwen_config(tok, **size), Qwen2_5_VLForConditionalGeneration
    else:
        tok = llava_ov_tokenizer()
        config, cls = tiny_llava_ov_config(tok, **size), LlavaOnevisionForConditionalGeneration
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        hf = cls(config).eval()
    hf.generation_config.eos_token_id = config.get_text_config().eos_token_id
    hf.generation_config.pad_token_id = tok.pad_token_id
    return TargetModel(hf, tok)


def tiny_draft(target: TargetModel, arch: DraftArchitecture | None = None, seed: int = 0) -> SparrowDraft:
    """A randomly initialised Sparrow draft bound to `target` (little will be accepted)."""
    with torch.random.fork_rng():
        return SparrowDraft.for_target(target, arch, seed=seed).eval()


def synthetic_frames(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """(T, H, W, 3) uint8 frames of a coloured square moving over a noisy background."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 40, size=(num_frames, height, width, 3), dtype=np.uint8)
    side = max(4, min(height, width) // 4)
    colour = rng.integers(80, 256, size=3, dtype=np.uint8)
    for t in range(num_frames):
        y = (t * 3) % max(1, height - side)
        x = (t * 5) % max(1, width - side)
        frames[t, y:y + side, x:x + side] = colour
    return frames
