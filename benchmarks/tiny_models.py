"""Tiny random models in the benchmarks' --models layout: a smoke run, and the benchmark tests."""

from __future__ import annotations

from pathlib import Path


def save_tiny_models(root: str | Path) -> Path:
    """Tiny random models in the --models layout (root/world/{target,draft}, root/bench/draft-eagle,
    root/bench/small-target), with the world target's processor rule (frames not upscaled: one
    visual token per 28x28 px), so small world videos stay small."""
    from sparrow.models.target import TargetModel
    from sparrow.tiny import tiny_draft, tiny_target
    from sparrow.video import processor_for

    def world_style(hf) -> TargetModel:
        return TargetModel(hf.hf, hf.tokenizer, processor_for(hf.hf.config, min_pixels=28 * 28))

    root = Path(root)
    target = world_style(tiny_target("qwen2_5_vl", seed=0))
    target.save_pretrained(root / "world" / "target")
    tiny_draft(target, seed=0).save_pretrained(root / "world" / "draft")
    tiny_draft(target, seed=1).save_pretrained(root / "bench" / "draft-eagle")
    world_style(tiny_target("qwen2_5_vl", seed=1, hidden=32, layers=2)).save_pretrained(root / "bench" / "small-target")
    return root
