"""A live session's window: the text before the video and the newest frame pairs, in one KV cache.

Positions. Qwen2.5-VL (transformers 5) puts frame pair t of a video at temporal position
s + floor(t * tokens_per_second * seconds_per_pair) and height/width positions s + row/col
(s: the text before the video); the text after the video starts at s + max(rows, cols),
whatever the video's length. So an appended pair's positions do not depend on the future,
and a question asked now gets the positions it would get after the same frames prefilled
in one shot: incremental == one-shot, token for token (tests/test_live.py). The family owns
that rule (models/families.py: live_positions); the target runs the pairs (prefill_visual).

Eviction. A window keeps at most `window_s` seconds of pairs. When the oldest leave (in
steps of `evict_s`), the kept pairs' cache entries move down and the window is re-positioned
so it reads as a clip that starts at time 0: rather than rotating every kept key back in
time (O(window) and rounding that accumulates, badly in bf16), the text before the video
(a few tokens) is prefilled again with its temporal axis moved forward by the evicted span
D, and the question's text sits D later on that axis too (VideoPrefix.time_shift). Every
relative position is then exactly the one-shot clip's. What is not exact: kept pairs were
prefilled while evicted ones were still in the cache, so their deeper layers saw frames
the window no longer holds (the attention-sink + recent-frames approximation of streaming
LLMs, with the system prompt as the sink). Accuracy on the live world after eviction is in
models/live/MODEL_CARD.md and BENCHMARKS.md ("Live sessions").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from sparrow.errors import InvalidRequest
from sparrow.live.source_health import CameraTime
from sparrow.models.kv_cache import new_kv_cache
from sparrow.models.prefill import FeatureNeeds, VideoPrefix
from sparrow.models.target import TargetModel
from sparrow.prefix_cache import PrefixEntry
from sparrow.video import ProcessedVideo, VideoOptions
from sparrow.video.options import Frames


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """fps          frames sampled per second of stream (a pair covers 2 / fps seconds)
    window_s        seconds of pairs a session keeps (its memory bound)
    evict_s         the oldest pairs leave in steps of this many seconds (default window_s / 8):
                    each step moves the kept cache entries once and re-prefills the short
                    text before the video
    max_lag_s       ingest more than this far behind the newest frame drops the oldest waiting pairs
    stale_after_s   no frame for this many wall seconds: the source is stale (an event; answers
                    marked stale until frames come again)
    evict_mode      "shift": evicted pairs leave the cache, the kept ones stay as prefilled and the
                    window is re-positioned (cheap; kept pairs' deeper layers saw evicted ones);
                    "refresh": the kept pairs are prefilled again from their visual tokens (kept
                    for it) after each eviction step: exactly a one-shot clip of the window, at a
                    window prefill per evict_s (BENCHMARKS.md "Live sessions" measures both)
    options         pixel bounds of a frame (min/max_pixels); the frame size is fixed by the first frame
    """

    fps: float = 2.0
    window_s: float = 30.0
    evict_s: float | None = None
    max_lag_s: float = 10.0
    stale_after_s: float = 5.0
    evict_mode: str = "shift"
    options: VideoOptions = field(default_factory=VideoOptions)

    def __post_init__(self) -> None:
        for name in ("fps", "window_s", "max_lag_s", "stale_after_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InvalidRequest(f"{name} must be a number > 0, got {value!r}")
        if self.evict_s is not None and not (math.isfinite(self.evict_s) and self.evict_s > 0):
            raise InvalidRequest(f"evict_s must be > 0, got {self.evict_s!r}")
        if self.evict_mode not in ("shift", "refresh"):
            raise InvalidRequest(f"evict_mode must be 'shift' or 'refresh', got {self.evict_mode!r}")
        if self.window_pairs < 1:
            raise InvalidRequest(f"a window of {self.window_s} s at {self.fps} fps holds no frame pair")

    @property
    def pair_s(self) -> float:
        return 2.0 / self.fps

    @property
    def window_pairs(self) -> int:
        return int(self.window_s / self.pair_s + 1e-9)

    @property
    def evict_pairs(self) -> int:
        step = self.evict_s if self.evict_s is not None else self.window_s / 8
        return max(1, min(self.window_pairs, int(step / self.pair_s + 1e-9)))


@dataclass(slots=True)
class FramePair:
    index: int                       # pair slot since the stream's first frame (real time / pair_s)
    start_s: float                   # stream time of its first frame
    end_s: float                     # ... and where it stops covering (its second frame + a frame)
    frames: np.ndarray | None        # uint8 [2, H, W, 3] until prefilled
    bridge: torch.Tensor | None = None        # (tpp, H) bridge-layer states
    visual_features: torch.Tensor | None = None   # (tpp, F*H) features at t-1 of its tokens
    embeds: torch.Tensor | None = None            # (tpp, H) its visual tokens ("refresh" only)
    camera: CameraTime | None = None              # when its newest frame was (stream, source, wall)


class LiveWindow:
    """The target's side of a live session: a static cache of the text before the video + at
    most window_pairs frame pairs, the rows of them a draft reads (`needs`), and where the
    window stands in time. `start` sizes it from the first frame; the rest runs on the
    engine's scheduler thread, under the session's lock. The cache never grows: a pair makes
    room (`evict`) before it is appended."""

    def __init__(self, target: TargetModel, config: LiveConfig, needs: FeatureNeeds):
        processor = target.processor
        if not target.family.real_time_video:
            raise InvalidRequest(f"live sessions need a model whose video positions are real time (Qwen2.5-VL); "
                                 f"{target.family.model_type} places a video's frames by count")
        if getattr(processor, "temporal_positions", None) is not None:
            raise InvalidRequest(f"this target reads every video as {processor.temporal_positions} temporal positions "
                                 f"(time as a share of the video), which a growing stream cannot use; serve a target "
                                 f"with real-time positions (temporal_positions null), e.g. models/live/target")
        if processor.temporal_patch_size != 2:
            raise InvalidRequest("live sessions expect Qwen's temporal patch of 2 frames")
        self.target, self.config, self.needs = target, config, needs
        self.interval = processor.tokens_per_second * config.pair_s   # temporal positions per pair
        # The prompt's text before the video is the same for every question (the video sits in
        # the first user turn, before the question).
        ids = target.prompt_ids("?", 1)
        self.prefix_ids = ids[:ids.index(target.video_token_id)]
        self.s = len(self.prefix_ids)
        # Set by the first frame (start):
        self.grid: tuple[int, int] | None = None      # patches (rows, cols) per frame
        self.tpp = 0                                  # visual tokens per pair
        self.kv = None
        self.pairs: deque[FramePair] = deque()        # prefilled, oldest first
        self.shift = 0              # "shift": temporal positions the window was moved by
        self._origin = 0            # "refresh": the pair index at temporal position 0
        self._last_row: torch.Tensor | None = None    # features at the newest position
        self._prefix_features = self._prefix_bridge = None
        self._prefix_last = None    # features at the last text position before the video

    def start(self, height: int, width: int) -> None:
        """The first frame (height x width) fixes the grid and the cache's size."""
        processor = self.target.processor
        plan = processor.plan(2, height, width, self.config.options)
        if plan.num_visual_tokens < 1:
            raise InvalidRequest("a frame pair of this size makes no visual token")
        self.grid = (plan.height // processor.patch_size, plan.width // processor.patch_size)
        self.tpp = plan.num_visual_tokens
        self.target.check_fits(self.s + self.config.window_pairs * self.tpp, 1)

    @property
    def kv_bytes(self) -> int:
        if self.kv is None:
            return 0
        return sum(layer.k_buf.numel() * layer.k_buf.element_size() * 2 for layer in self.kv.layers
                   if layer.is_initialized)

    def clear(self) -> None:
        self.kv = None
        self.pairs.clear()
        self._last_row = None

    # On the scheduler thread ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_text(self) -> None:
        """(Re)prefill the text before the video at temporal positions moved by self.shift;
        its hidden states do not depend on the shift (all its positions move together)."""
        target, s, needs = self.target, self.s, self.needs
        if self.kv is None:
            self.kv = new_kv_cache("static", target.num_layers, s + self.config.window_pairs * self.tpp)
        out = target.prefill(target.text_inputs(self.prefix_ids), s, needs.feature_layers, needs.bridge_layer,
                             time_shift=self.shift)
        fresh = self.kv.layers[0].length == 0
        for layer, new in zip(self.kv.layers, out.state.kv.layers):
            if fresh:
                layer.update(new.keys, new.values)
            else:
                layer.k_buf[:, :, :s] = new.keys
                layer.v_buf[:, :, :s] = new.values
        if fresh:
            self._prefix_features, self._prefix_bridge = out.text_features, out.bridge_text
            self._last_row = self._prefix_last = out.last_feature

    @torch.inference_mode()
    def append(self, pair: FramePair) -> None:
        """Prefill the pair (vision tower, then the language model on top of the cache) and
        keep it; there must be room (`evict` first)."""
        target, cfg = self.target, self.config
        frames = Frames(pair.frames, np.array([pair.start_s, pair.start_s + cfg.pair_s / 2]), cfg.fps, cfg.options)
        video = target.processor.process(frames)
        grid = video.model_kwargs["video_grid_thw"]
        if tuple(int(x) for x in grid[0, 1:]) != self.grid:
            raise InvalidRequest(f"a frame pair made a {tuple(grid[0].tolist())} grid, the session's is {self.grid}")
        embeds = target.video_embeds(video)
        pair.frames = None
        if cfg.evict_mode == "refresh":
            pair.embeds = embeds                  # kept for the window's re-prefill after eviction
        self._run_pairs([pair], [embeds])
        self.pairs.append(pair)

    def _run_pairs(self, pairs: list[FramePair], embeds: list[torch.Tensor]) -> None:
        """The language model over these pairs' visual tokens, on top of the cache, at their
        real-time positions counted from pair self._origin; the rows the draft reads."""
        target, tpp = self.target, self.tpp
        merge = target.processor.merge_size
        pos = target.family.live_positions(self.s, [p.index - self._origin for p in pairs], self.interval,
                                           (self.grid[0] // merge, self.grid[1] // merge))
        out = target.prefill_visual(self.kv, torch.cat(embeds), pos, self.needs, before=self._last_row)
        for j, p in enumerate(pairs):
            if out.visual_features is not None:
                p.visual_features = out.visual_features[j * tpp:(j + 1) * tpp]
            if out.bridge_visual is not None:
                p.bridge = out.bridge_visual[j * tpp:(j + 1) * tpp]
        if out.last_feature is not None:
            self._last_row = out.last_feature

    @torch.inference_mode()
    def evict(self) -> int:
        """No room for one more pair: drop the oldest evict_pairs pairs (returns how many).
        "shift": move the rest down and re-position (the text before the video, re-prefilled
        D later in time); "refresh": prefill the kept pairs again from their visual tokens,
        from time 0."""
        cfg = self.config
        if len(self.pairs) < cfg.window_pairs:
            return 0
        n = max(cfg.evict_pairs, len(self.pairs) + 1 - cfg.window_pairs)
        for _ in range(n):
            self.pairs.popleft()
        s, gone = self.s, n * self.tpp
        if cfg.evict_mode == "refresh":
            for layer in self.kv.layers:
                layer.crop(-(layer.length - s))
            self._last_row = self._prefix_last
            if self.pairs:
                self._origin = self.pairs[0].index
                kept = list(self.pairs)
                self._run_pairs(kept, [p.embeds for p in kept])
            return n
        for layer in self.kv.layers:
            end = layer.length
            for buf in (layer.k_buf, layer.v_buf):
                buf[:, :, s:end - gone] = buf[:, :, s + gone:end].clone()
            layer.crop(-gone)
        shift = self.target.family.pair_time(self.pairs[0].index, self.interval)
        if shift != self.shift:
            self.shift = shift
            self.prefill_text()
        return n

    def snapshot(self) -> PrefixEntry:
        """The window as a VideoPrefix (copies) and the ProcessedVideo a prompt is built from."""
        target, needs = self.target, self.needs
        layers = self.kv.layers
        n_pairs = len(self.pairs)
        n_visual = n_pairs * self.tpp
        length = self.s + n_visual
        ids = torch.tensor(self.prefix_ids + [target.video_token_id] * n_visual, device=target.device)
        features = bridge_text = bridge_visual = visual_features = None
        if needs.feature_layers:
            features = torch.cat([self._prefix_features, self._last_row[None]])
            if needs.visual_features:
                visual_features = torch.cat([p.visual_features for p in self.pairs])
        if needs.bridge_layer is not None:
            bridge_text = self._prefix_bridge
            bridge_visual = torch.cat([p.bridge for p in self.pairs])
        prefix = VideoPrefix(ids, [layer.k_buf[:, :, :length].clone() for layer in layers],
                             [layer.v_buf[:, :, :length].clone() for layer in layers],
                             features, bridge_text, bridge_visual, visual_features, time_shift=self.shift)
        times = np.array([t for p in self.pairs for t in (p.start_s, p.start_s + self.config.pair_s / 2)])
        video = ProcessedVideo(
            pixel_values_videos=torch.zeros(0, 1),
            num_visual_tokens=n_visual,
            model_kwargs={"video_grid_thw": torch.tensor([[n_pairs, *self.grid]], dtype=torch.long),
                          "second_per_grid_ts": torch.tensor([self.config.pair_s])},
            timestamps=times,
        )
        return PrefixEntry(video, prefix)


__all__ = ["FramePair", "LiveConfig", "LiveWindow"]
