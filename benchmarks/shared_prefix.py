"""One prefill of a video's prefix (system prompt + video) shared by every engine that starts
from it: prefilled once per bridge layer with the union of the feature layers the engines
read, cached once per engine signature."""

from __future__ import annotations

import dataclasses
import time

import torch

from sparrow import Engine
from sparrow.models.prefill import VideoPrefix
from sparrow.models.target import TargetModel
from sparrow.prefix_cache import PrefixCache, PrefixEntry
from sparrow.speculative.specvlm import SpecVLMProposer
from sparrow.video import ProcessedVideo


def uses_prefix(engine: Engine) -> bool:
    """Engines whose proposer re-reads the video (SpecVLM's small VLM) prefill it themselves."""
    return not isinstance(engine.proposer, SpecVLMProposer)


def _signature(engine: Engine) -> tuple[tuple[int, ...], int | None, bool]:
    """What the engine's prefill reads from a video prefix: feature layers, bridge layer, and
    whether it needs features at the visual positions (draft context "all" / "pruned")."""
    p = engine.proposer
    if p is None:
        return (), None, False
    layers = tuple(p.needs.feature_layers or ())
    return layers, p.needs.bridge_layer, bool(layers) and engine.spec.draft_context != "text"


def _select_features(prefix: VideoPrefix, union: tuple[int, ...], layers: tuple[int, ...], hidden: int) -> VideoPrefix:
    """The prefix as if prefilled for `layers`: its feature columns are `union`'s, concatenated."""
    if layers == union:
        return prefix
    if not layers:
        return dataclasses.replace(prefix, features=None, visual_features=None)
    cols = torch.cat([torch.arange(union.index(i) * hidden, (union.index(i) + 1) * hidden) for i in layers])
    pick = lambda t: t[:, cols.to(t.device)] if t is not None else None   # noqa: E731
    return dataclasses.replace(prefix, features=pick(prefix.features), visual_features=pick(prefix.visual_features))


def share_prefix(target: TargetModel, processed: ProcessedVideo, prompt: str, engines: dict[str, Engine],
                 cache: PrefixCache, tag: str) -> tuple[dict[str, str], dict[str, float]]:
    """Prefill the video's prefix (system prompt + video) once per bridge layer, with the
    union of the feature layers the engines read (and visual-position features if one needs
    them), and cache one entry per engine signature. Returns each engine's video key and the
    seconds of the prefill it starts from."""
    sigs = {name: _signature(e) for name, e in engines.items() if uses_prefix(e)}
    bridges = sorted({b for _, b, _ in sigs.values() if b is not None}) or [None]
    inputs = target.build_inputs(processed, prompt)
    keys, seconds = {}, {}
    for bridge in bridges:                           # signatures without a bridge go with the first
        group = {n: s for n, s in sigs.items() if s[1] == bridge or (s[1] is None and bridge == bridges[0])}
        union = tuple(sorted({i for layers, _, _ in group.values() for i in layers}))
        visual = any(v for _, _, v in group.values())
        t0 = time.perf_counter()
        prefix = target.prefill_prefix(inputs, union, bridge, visual)
        elapsed = time.perf_counter() - t0
        for name, (layers, _, _) in group.items():
            key = f"{tag}|{layers}|{bridge}|{visual}"
            if cache.get(key) is None:
                cache.put(key, PrefixEntry.of(processed, _select_features(prefix, union, layers, target.hidden_size)))
            keys[name], seconds[name] = key, elapsed
    return keys, seconds


def no_video(cancelled=None):
    raise RuntimeError("benchmark prefix missing from the prefix cache (evicted?): refusing to re-prefill")
