"""Live sessions: a video stream prefilled as it arrives; questions answered from its KV cache.

    frames (raw, or decoded from container chunks: LiveDecoder)
      -> sampled at `fps`, grouped in frame pairs (Qwen's temporal patch)
      -> each pair (a scheduler task between decode steps): vision tower, then the language
         model on top of the session's KV cache, at the pair's real-time rope positions
      -> a question: a copy of the session's KV (a VideoPrefix snapshot) + its own prefill + decode

Positions. Qwen2.5-VL (transformers 5) puts frame pair t of a video at temporal position
s + floor(t * tokens_per_second * seconds_per_pair) and height/width positions s + row/col
(s: the text before the video); the text after the video starts at s + max(rows, cols),
whatever the video's length. So an appended pair's positions do not depend on the future,
and a question asked now gets the positions it would get after the same frames prefilled
in one shot: incremental == one-shot, token for token (tests/test_live.py).

The window. A session keeps at most `window_s` seconds of pairs. When the oldest leave (in
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

Memory is bounded: the session's cache holds the text before the video + the window; drafts
whose context is text (sparrow) never see the video grow. Ingest that falls behind real time
(more than `max_lag_s` of pairs waiting) drops the oldest waiting pairs, counted in stats.
"""

from __future__ import annotations

import io
import itertools
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import av
import numpy as np
import torch

from .config import SamplingParams
from .engine import Generation, GenerationOutput, TokenDelta
from .errors import InvalidRequest, NoFrames, VideoUnreadable
from .models.kv_cache import new_kv_cache
from .models.target import FeatureNeeds, VideoPrefix
from .prefix_cache import PrefixEntry
from .video import ProcessedVideo, VideoOptions
from .video.options import Frames

# Methods whose draft can start from a live snapshot (their context is text + target features).
# The SpecVLM-style draft prefills the video itself: its live questions decode without drafts.
_SNAPSHOT_METHODS = ("sparrow", "eagle-style", "eagle3")
TS_PACKET = 188


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """fps          frames sampled per second of stream (a pair covers 2 / fps seconds)
    window_s        seconds of pairs a session keeps (its memory bound)
    evict_s         the oldest pairs leave in steps of this many seconds (default window_s / 8):
                    each step moves the kept cache entries once and re-prefills the short
                    text before the video
    max_lag_s       ingest more than this far behind the newest frame drops the oldest waiting pairs
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
    evict_mode: str = "shift"
    options: VideoOptions = field(default_factory=VideoOptions)

    def __post_init__(self) -> None:
        for name in ("fps", "window_s", "max_lag_s"):
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
class _Pair:
    index: int                       # pair slot since the stream's first frame (real time / pair_s)
    start_s: float                   # stream time of its first frame
    end_s: float                     # ... and where it stops covering (its second frame + a frame)
    frames: np.ndarray | None        # uint8 [2, H, W, 3] until prefilled
    bridge: torch.Tensor | None = None        # (tpp, H) bridge-layer states
    visual_features: torch.Tensor | None = None   # (tpp, F*H) features at t-1 of its tokens
    embeds: torch.Tensor | None = None            # (tpp, H) its visual tokens ("refresh" only)


@dataclass(frozen=True, slots=True)
class LiveStats:
    frames_received: int
    frames_sampled: int
    frames_dropped: int          # sampled but never prefilled (ingest behind real time)
    pairs_prefilled: int
    pairs_evicted: int
    window_pairs: int            # pairs held now
    visual_tokens: int           # visual tokens held now
    kv_bytes: int                # the session cache's bytes (allocated)
    window_start_s: float        # stream time the window covers, [start, end)
    window_end_s: float
    newest_s: float              # the newest frame received
    lag_s: float                 # newest frame received - window end
    time_shift: int              # temporal rope positions the window was moved by
    ingest_seconds: float        # time spent prefilling pairs (vision tower + language model)


@dataclass(slots=True)
class LiveAnswer:
    """A question about the stream: iterate `generation` for deltas; `start_s`/`end_s` is the
    stream time range the answer saw."""

    question_id: str
    question: str
    start_s: float
    end_s: float
    generation: Generation


@dataclass(frozen=True, slots=True)
class LiveEvent:
    """What a session reports through its `on_event` callback (standing questions, errors):
    kind "delta" (text, token_ids), "done" (output), "error" (error), "dropped" (count)."""

    kind: str
    question_id: str | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    delta: TokenDelta | None = None
    output: GenerationOutput | None = None
    error: BaseException | None = None
    dropped: int = 0


@dataclass(slots=True)
class _Standing:
    question_id: str
    question: str
    every_s: float
    sampling: SamplingParams
    next_s: float


class LiveSession:
    """One live stream on an engine. Feed it `push_frames` (raw frames with stream times) or
    `feed` (container bytes: MPEG-TS or fragmented MP4, decoded on a thread); `ask` a
    question at any time; `add_standing` questions asked every N seconds of stream, whose
    answers arrive as LiveEvents. Thread-safe. `close()` frees the cache at once."""

    def __init__(self, engine, config: LiveConfig | None = None, *,
                 on_event: Callable[[LiveEvent], None] | None = None):
        target = engine.target
        processor = target.processor
        if target.family.model_type != "qwen2_5_vl":
            raise InvalidRequest(f"live sessions need a model whose video positions are real time (Qwen2.5-VL); "
                                 f"{target.family.model_type} places a video's frames by count")
        if getattr(processor, "temporal_positions", None) is not None:
            raise InvalidRequest(f"this target reads every video as {processor.temporal_positions} temporal positions "
                                 f"(time as a share of the video), which a growing stream cannot use; serve a target "
                                 f"with real-time positions (temporal_positions null), e.g. models/live/target")
        if processor.temporal_patch_size != 2:
            raise InvalidRequest("live sessions expect Qwen's temporal patch of 2 frames")
        self.engine, self.config = engine, config or LiveConfig()
        self.on_event = on_event
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._closed = False
        drafting = engine.proposer is not None and engine.spec.method in _SNAPSHOT_METHODS
        self._draft_k = None if drafting else 0
        self.needs: FeatureNeeds = engine.proposer.needs if drafting else FeatureNeeds()
        self._interval = processor.tokens_per_second * self.config.pair_s   # temporal positions per pair
        # The prompt's text before the video is the same for every question (the video sits in
        # the first user turn, before the question).
        ids = target.prompt_ids("?", 1)
        self._prefix_ids = ids[:ids.index(target.video_token_id)]
        self._s = len(self._prefix_ids)
        # Set by the first frame:
        self._frame_shape: tuple[int, int] | None = None      # source frame (H, W)
        self._grid: tuple[int, int] | None = None             # patches (rows, cols) per frame
        self._tpp = 0                                          # visual tokens per pair
        self._kv = None
        self._capacity = 0
        # Sampling state
        self._t0: float | None = None
        self._last_slot = -1
        self._pending: tuple[np.ndarray, float, int] | None = None   # a sampled frame waiting for its partner
        self._waiting: deque[tuple[_Pair, Any]] = deque()           # pairs handed to the scheduler
        self._pairs: deque[_Pair] = deque()                          # prefilled, in the window
        self._last_row: torch.Tensor | None = None                   # features at the newest position
        self._prefix_features = self._prefix_bridge = None
        self._shift = 0             # "shift": temporal positions the window was moved by
        self._origin = 0            # "refresh": the pair index at temporal position 0
        self._prefix_last = None    # features at the last text position before the video
        self._standing: dict[str, _Standing] = {}
        self._answers: set[Generation] = set()
        self._decoder: LiveDecoder | None = None
        self._media_bytes, self._ts = 0, False
        self._counts = dict(received=0, sampled=0, dropped=0, prefilled=0, evicted=0)
        self._newest_s = 0.0
        self._ingest_s = 0.0
        self._error: BaseException | None = None

    # ----- feeding ----------------------------------------------------------------------------------
    def push_frames(self, frames: np.ndarray, timestamps) -> int:
        """RGB frames uint8 [T, H, W, 3] at stream times (seconds, increasing). Frames are
        sampled at the session's fps; each complete pair is queued for prefill. Returns the
        pairs queued. Frames of another size than the first are resized to it."""
        frames = np.asarray(frames)
        times = np.asarray(timestamps, dtype=np.float64).reshape(-1)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] != times.shape[0]:
            raise InvalidRequest(f"frames must be uint8 [T, H, W, 3] with T timestamps, got {frames.dtype} "
                                 f"{frames.shape} and {times.shape[0]} timestamps")
        if frames.shape[0] and not np.all(np.isfinite(times)):
            raise InvalidRequest("timestamps must be finite")
        queued = 0
        with self._lock:
            self._check_open()
            for frame, t in zip(frames, times):
                queued += self._sample(frame, float(t))
        return queued

    def feed(self, chunk: bytes) -> None:
        """Container bytes (MPEG-TS or fragmented MP4), in order, split anywhere; decoded on a
        thread. A chunk the decoder cannot read ends that media with an "error" event; what
        was prefilled stays, and the next chunk starts a new media (its times continue)."""
        chunk = bytes(chunk)
        with self._lock:
            self._check_open()
            if self._decoder is None or self._decoder.finished:
                # A new media: its first frame follows the newest frame so far.
                offset = self._newest_s + 1.0 / self.config.fps if self._t0 is not None else 0.0
                self._decoder = LiveDecoder(self._on_decoded, self._on_decode_error, offset=offset)
                self._media_bytes, self._ts = 0, chunk[:1] == b"\x47"
            if self._ts and chunk:
                # MPEG-TS is 188-byte packets, each starting 0x47: a chunk that breaks that is
                # refused whole, and the stream goes on from where it was.
                marks = np.frombuffer(chunk, dtype=np.uint8)[(-self._media_bytes) % TS_PACKET::TS_PACKET]
                if not bool((marks == 0x47).all()):
                    bad = int(np.argmax(marks != 0x47))
                    raise VideoUnreadable(f"chunk at byte {self._media_bytes} of the stream is not MPEG-TS: no sync "
                                          f"byte at its packet {bad}; the chunk was dropped, the session goes on")
            self._media_bytes += len(chunk)
            decoder = self._decoder
        decoder.feed(chunk)

    def end_of_stream(self) -> None:
        """No more frames: the last odd frame is prefilled as a pair (repeated, as HF pads)."""
        with self._lock:
            decoder = self._decoder
        if decoder is not None:
            decoder.close()
            decoder.join()
        with self._lock:
            if self._pending is not None:
                frame, t, slot = self._pending
                self._pending = None
                self._queue_pair(frame, frame, t, slot // 2)

    def wait_ingested(self, timeout: float | None = None) -> None:
        """Block until every frame fed so far is prefilled (or dropped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            decoder = self._decoder
        if decoder is not None:
            decoder.drain(timeout)
        while True:
            with self._lock:
                futures = [f for _, f in self._waiting if not f.done()]
            if not futures:
                return
            for f in futures:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                try:
                    f.result(timeout=left)
                except Exception:  # noqa: BLE001 - reported through events, or a timeout: checked above
                    pass

    # ----- questions ---------------------------------------------------------------------------------
    def ask(self, question: str, sampling: SamplingParams | None = None, *, question_id: str | None = None,
            sink: Callable[[Any], None] | None = None) -> LiveAnswer:
        """Answer `question` about the window as it is now (what has been prefilled)."""
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest("question must be a non-empty string")
        sampling = sampling or SamplingParams()
        with self._lock:
            self._check_open()
            if not self._pairs:
                raise NoFrames("the live session has no prefilled frame yet")
            entry = self._snapshot()
            start_s, end_s = self._pairs[0].start_s, self._pairs[-1].end_s
            question_id = question_id or f"q{next(self._ids)}"
            gen = Generation()
            put = sink or gen._events.put

            def deliver(item: Any) -> None:
                put(item)
                if not isinstance(item, TokenDelta):
                    # The answer's last item, handed on first: whoever sees running_answers
                    # reach 0 has been given every answer's last item.
                    with self._lock:
                        self._answers.discard(gen)

            gen.request = self.engine.submit(None, question, sampling, prefix=entry,
                                             num_draft_tokens=self._draft_k, sink=deliver)
            self._answers.add(gen)
        return LiveAnswer(question_id, question, start_s, end_s, gen)

    def add_standing(self, question: str, every_s: float, sampling: SamplingParams | None = None,
                     question_id: str | None = None) -> str:
        """Ask `question` every `every_s` seconds of stream time (first when the window reaches
        `every_s`); answers arrive as events tagged with the returned id."""
        if not (isinstance(every_s, (int, float)) and math.isfinite(every_s) and every_s > 0):
            raise InvalidRequest(f"every_s must be > 0, got {every_s!r}")
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest("question must be a non-empty string")
        with self._lock:
            self._check_open()
            question_id = question_id or f"s{next(self._ids)}"
            if question_id in self._standing:
                raise InvalidRequest(f"standing question {question_id!r} exists already")
            start = self._pairs[-1].end_s if self._pairs else 0.0
            self._standing[question_id] = _Standing(question_id, question, float(every_s),
                                                    sampling or SamplingParams(), start + every_s)
        return question_id

    def remove_standing(self, question_id: str) -> bool:
        with self._lock:
            return self._standing.pop(question_id, None) is not None

    # ----- state -------------------------------------------------------------------------------------
    @property
    def stats(self) -> LiveStats:
        with self._lock:
            c = self._counts
            start = self._pairs[0].start_s if self._pairs else 0.0
            end = self._pairs[-1].end_s if self._pairs else 0.0
            return LiveStats(c["received"], c["sampled"], c["dropped"], c["prefilled"], c["evicted"], len(self._pairs),
                             len(self._pairs) * self._tpp, self.kv_bytes, start, end, self._newest_s,
                             max(0.0, self._newest_s - end) if self._pairs else self._newest_s, self._shift,
                             self._ingest_s)

    @property
    def kv_bytes(self) -> int:
        if self._kv is None:
            return 0
        return sum(layer.k_buf.numel() * layer.k_buf.element_size() * 2 for layer in self._kv.layers
                   if layer.is_initialized)

    @property
    def running_answers(self) -> int:
        """Answers (asked and standing) the engine is still producing."""
        with self._lock:
            return len(self._answers)

    @property
    def error(self) -> BaseException | None:
        """The last ingest error (also sent as an event), if any."""
        return self._error

    def close(self) -> None:
        """End the session now: queued pairs are cancelled, running answers aborted, the cache freed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            decoder, self._decoder = self._decoder, None
            for _, future in self._waiting:
                future.cancel()
            self._waiting.clear()
            answers = list(self._answers)
            self._answers.clear()
            self._standing.clear()
        if decoder is not None:
            decoder.abort()
        for gen in answers:
            gen.abort()
        with self._lock:              # after any running ingest task (it holds the lock)
            self._kv = None
            self._pairs.clear()
            self._last_row = None

    @property
    def closed(self) -> bool:
        return self._closed

    # ----- internals ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequest("the live session is closed")

    def _sample(self, frame: np.ndarray, t: float) -> int:
        """Keep the first frame of each 1/fps slot; pair slots (2j, 2j+1). Lock held."""
        self._counts["received"] += 1
        if self._t0 is None:
            self._t0 = t
        if self._frame_shape is None:
            self._start(frame.shape[0], frame.shape[1])
        elif frame.shape[:2] != self._frame_shape:
            from .video.processors import _resize_all
            frame = _resize_all(frame[None], *self._frame_shape)[0]
        self._newest_s = max(self._newest_s, t)
        slot = int(math.floor((t - self._t0) * self.config.fps + 1e-6))
        if slot <= self._last_slot:
            return 0
        self._last_slot = slot
        self._counts["sampled"] += 1
        queued = 0
        if self._pending is not None:
            first, t_first, first_slot = self._pending
            self._pending = None
            if slot == first_slot + 1:
                return self._queue_pair(first, frame, t_first, first_slot // 2, t)
            queued += self._queue_pair(first, first, t_first, first_slot // 2)      # its partner never came
        if slot % 2 == 0:
            self._pending = (frame, t, slot)
        else:                                                                        # a pair's first frame is missing
            queued += self._queue_pair(frame, frame, t, slot // 2)
        return queued

    def _start(self, height: int, width: int) -> None:
        """The first frame fixes the frame size, the grid and the cache; prefill the text before the video."""
        processor = self.engine.target.processor
        plan = processor.plan(2, height, width, self.config.options)
        if plan.num_visual_tokens < 1:
            raise InvalidRequest("a frame pair of this size makes no visual token")
        self._frame_shape = (height, width)
        self._size = (plan.height, plan.width)
        self._grid = (plan.height // processor.patch_size, plan.width // processor.patch_size)
        self._tpp = plan.num_visual_tokens
        self._capacity = self._s + self.config.window_pairs * self._tpp
        target = self.engine.target
        target.check_fits(self._capacity, 1)
        self.engine.scheduler.call_soon(self._prefill_text).result()

    def _queue_pair(self, a: np.ndarray, b: np.ndarray, t: float, index: int, t_b: float | None = None) -> int:
        pair_s = self.config.pair_s
        frames = np.stack([a, b])
        pair = _Pair(index, t, (t_b if t_b is not None else t) + pair_s / 2, frames)
        future = self.engine.scheduler.call_soon(lambda: self._ingest(pair))
        self._waiting.append((pair, future))
        self._drop_if_behind()
        return 1

    def _drop_if_behind(self) -> None:
        """More than max_lag_s of pairs waiting: cancel the oldest not yet started. Lock held."""
        limit = max(1, int(self.config.max_lag_s / self.config.pair_s))
        dropped = 0
        over = len(self._waiting) - limit
        if over > 0:
            kept: deque = deque()
            for pair, future in self._waiting:       # the oldest first; one already running stays
                if over > 0 and future.cancel():
                    over -= 1
                    dropped += 2
                else:
                    kept.append((pair, future))
            self._waiting = kept
        if dropped:
            self._counts["dropped"] += dropped
            self._emit(LiveEvent("dropped", dropped=dropped))

    # On the scheduler thread ------------------------------------------------------------------------
    @torch.inference_mode()
    def _prefill_text(self) -> None:
        """(Re)prefill the text before the video at temporal positions moved by self._shift;
        its hidden states do not depend on the shift (all its positions move together)."""
        target, s = self.engine.target, self._s
        needs = self.needs
        if self._kv is None:
            self._kv = new_kv_cache("static", target.num_layers, self._capacity)
        cache = new_kv_cache("static", target.num_layers, s)
        index = torch.arange(s, device=target.device)
        pos = index.view(1, 1, s).expand(3, 1, s).clone()
        pos[0] += self._shift
        ids = torch.tensor([self._prefix_ids], device=target.device)
        out = target.hf(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                        output_hidden_states=needs.hidden, logits_to_keep=1)
        fresh = self._kv.layers[0].length == 0
        for layer, new in zip(self._kv.layers, cache.layers):
            if fresh:
                layer.update(new.keys, new.values)
            else:
                layer.k_buf[:, :, :s] = new.keys
                layer.v_buf[:, :, :s] = new.values
        if fresh and needs.hidden:
            hs = out.hidden_states
            if needs.feature_layers:
                feats = torch.cat([hs[i][0] for i in needs.feature_layers], dim=-1)
                self._prefix_features, self._last_row = feats[:-1], feats[-1]
                self._prefix_last = feats[-1]
            if needs.bridge_layer is not None:
                self._prefix_bridge = hs[needs.bridge_layer][0][1:]

    @torch.inference_mode()
    def _ingest(self, pair: _Pair) -> None:
        with self._lock:
            if self._closed:
                return
            if self._waiting and self._waiting[0][0] is pair:
                self._waiting.popleft()
            else:
                self._waiting = deque(entry for entry in self._waiting if entry[0] is not pair)
            t0 = time.perf_counter()
            try:
                self._evict()                 # room for this pair first: the cache never grows
                self._prefill_pair(pair)
            except Exception as exc:  # noqa: BLE001 - reported on the session; the window stays as it was
                self._error = exc
                self._emit(LiveEvent("error", error=exc))
                return
            finally:
                self._ingest_s += time.perf_counter() - t0
            self._counts["prefilled"] += 1
            self._pairs.append(pair)
            due = [q for q in self._standing.values() if q.next_s <= pair.end_s + 1e-9]
            for q in due:
                while q.next_s <= pair.end_s + 1e-9:
                    q.next_s += q.every_s
        for q in due:
            self._ask_standing(q)

    def _prefill_pair(self, pair: _Pair) -> None:
        target, processor = self.engine.target, self.engine.target.processor
        frames = Frames(pair.frames, np.array([pair.start_s, pair.start_s + self.config.pair_s / 2]),
                        self.config.fps, self.config.options)
        video = processor.process(frames)
        grid = video.model_kwargs["video_grid_thw"]
        if tuple(int(x) for x in grid[0, 1:]) != self._grid:
            raise InvalidRequest(f"a frame pair made a {tuple(grid[0].tolist())} grid, the session's is {self._grid}")
        hf = target.hf
        embeds = target.family.video_embeds(hf, {"pixel_values_videos": video.pixel_values_videos.to(target.device, hf.dtype),
                                                 "video_grid_thw": grid.to(target.device)})
        if embeds.shape[0] != self._tpp:
            raise InvalidRequest(f"the vision tower made {embeds.shape[0]} tokens for a pair, expected {self._tpp}")
        pair.frames = None
        if self.config.evict_mode == "refresh":
            pair.embeds = embeds.to(hf.dtype)             # kept for the window's re-prefill after eviction
        self._run_pairs([pair], [embeds.to(hf.dtype)])

    def _run_pairs(self, pairs: list[_Pair], embeds: list[torch.Tensor]) -> None:
        """The language model over these pairs' visual tokens, on top of the session cache, at
        their real-time positions counted from pair self._origin; the rows the draft reads."""
        target, processor, needs = self.engine.target, self.engine.target.processor, self.needs
        merge = processor.merge_size
        rows, cols = self._grid[0] // merge, self._grid[1] // merge
        s, device = self._s, target.device
        h = torch.arange(rows, device=device).view(rows, 1).expand(rows, cols) + s
        w = torch.arange(cols, device=device).view(1, cols).expand(rows, cols) + s
        pos = torch.cat([torch.stack([torch.full_like(h, s + int((p.index - self._origin) * self._interval)), h, w])
                         .view(3, 1, rows * cols) for p in pairs], dim=-1)
        out = target.hf(inputs_embeds=torch.cat(embeds)[None], position_ids=pos, past_key_values=self._kv,
                        use_cache=True, output_hidden_states=needs.hidden, logits_to_keep=1)
        tpp = self._tpp
        if needs.feature_layers:
            feats = torch.cat([out.hidden_states[i][0] for i in needs.feature_layers], dim=-1)
            if needs.visual_features:
                shifted = torch.cat([self._last_row[None], feats[:-1]])
                for j, p in enumerate(pairs):
                    p.visual_features = shifted[j * tpp:(j + 1) * tpp]
            self._last_row = feats[-1]
        if needs.bridge_layer is not None:
            bridge = out.hidden_states[needs.bridge_layer][0]
            for j, p in enumerate(pairs):
                p.bridge = bridge[j * tpp:(j + 1) * tpp]

    def _evict(self) -> None:
        """No room for one more pair: drop the oldest evict_pairs pairs. "shift": move the rest
        down and re-position (the text before the video, re-prefilled D later in time);
        "refresh": prefill the kept pairs again from their visual tokens, from time 0. Lock held."""
        cfg = self.config
        if len(self._pairs) < cfg.window_pairs:
            return
        n = max(cfg.evict_pairs, len(self._pairs) + 1 - cfg.window_pairs)
        for _ in range(n):
            self._pairs.popleft()
        self._counts["evicted"] += n
        s, gone = self._s, n * self._tpp
        if cfg.evict_mode == "refresh":
            for layer in self._kv.layers:
                layer.crop(-(layer.length - s))
            self._last_row = self._prefix_last
            if self._pairs:
                self._origin = self._pairs[0].index
                kept = list(self._pairs)
                self._run_pairs(kept, [p.embeds for p in kept])
            return
        for layer in self._kv.layers:
            end = layer.length
            for buf in (layer.k_buf, layer.v_buf):
                buf[:, :, s:end - gone] = buf[:, :, s + gone:end].clone()
            layer.crop(-gone)
        shift = int(self._pairs[0].index * self._interval)
        if shift != self._shift:
            self._shift = shift
            self._prefill_text()

    def _snapshot(self) -> PrefixEntry:
        """The window as a VideoPrefix (copies) and the ProcessedVideo a prompt is built from. Lock held."""
        target, needs = self.engine.target, self.needs
        layers = self._kv.layers
        n_pairs = len(self._pairs)
        n_visual = n_pairs * self._tpp
        length = self._s + n_visual
        ids = torch.tensor(self._prefix_ids + [target.video_token_id] * n_visual, device=target.device)
        features = bridge_text = bridge_visual = visual_features = None
        if needs.feature_layers:
            features = torch.cat([self._prefix_features, self._last_row[None]])
            if needs.visual_features:
                visual_features = torch.cat([p.visual_features for p in self._pairs])
        if needs.bridge_layer is not None:
            bridge_text = self._prefix_bridge
            bridge_visual = torch.cat([p.bridge for p in self._pairs])
        prefix = VideoPrefix(ids, [layer.k_buf[:, :, :length].clone() for layer in layers],
                             [layer.v_buf[:, :, :length].clone() for layer in layers],
                             features, bridge_text, bridge_visual, visual_features, time_shift=self._shift)
        times = np.array([t for p in self._pairs for t in (p.start_s, p.start_s + self.config.pair_s / 2)])
        video = ProcessedVideo(
            pixel_values_videos=torch.zeros(0, 1),
            num_visual_tokens=n_visual,
            model_kwargs={"video_grid_thw": torch.tensor([[n_pairs, *self._grid]], dtype=torch.long),
                          "second_per_grid_ts": torch.tensor([self.config.pair_s])},
            timestamps=times,
        )
        return PrefixEntry(video, prefix)

    def _ask_standing(self, q: _Standing) -> None:
        with self._lock:
            if self._closed or q.question_id not in self._standing:
                return
        box: dict[str, LiveAnswer] = {}
        started = threading.Event()

        def sink(item: Any) -> None:
            started.wait()
            answer = box["answer"]
            if isinstance(item, TokenDelta):
                self._emit(LiveEvent("delta", answer.question_id, answer.start_s, answer.end_s, delta=item))
            else:
                with self._lock:
                    self._answers.discard(answer.generation)
                if isinstance(item, GenerationOutput):
                    self._emit(LiveEvent("done", answer.question_id, answer.start_s, answer.end_s, output=item))
                else:
                    self._emit(LiveEvent("error", answer.question_id, answer.start_s, answer.end_s, error=item))

        try:
            box["answer"] = self.ask(q.question, q.sampling, question_id=q.question_id, sink=sink)
        except Exception as exc:  # noqa: BLE001 - e.g. the engine is full: the event says so
            self._emit(LiveEvent("error", q.question_id, error=exc))
            return
        finally:
            started.set()

    def _emit(self, event: LiveEvent) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # noqa: BLE001 - a listener's failure must not stop ingest
                pass

    # Decoder callbacks (the decoder's thread) -------------------------------------------------------
    def _on_decoded(self, frames: np.ndarray, times: np.ndarray) -> None:
        try:
            self.push_frames(frames, times)
        except InvalidRequest:
            if not self._closed:
                raise

    def _on_decode_error(self, exc: BaseException) -> None:
        with self._lock:
            self._error = exc
        self._emit(LiveEvent("error", error=exc))


class _Pipe(io.RawIOBase):
    """A blocking byte pipe: `write` from the feeding thread, `read` from the decoder's."""

    def __init__(self):
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._buf = b""
        self._eof = False

    def readable(self) -> bool:
        return True

    def write_chunk(self, data: bytes | None) -> None:
        self._chunks.put(data)

    def readinto(self, b) -> int:
        while not self._buf and not self._eof:
            chunk = self._chunks.get()
            if chunk is None:
                self._eof = True
            else:
                self._buf = bytes(chunk)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


class LiveDecoder:
    """Decodes a container stream fed in chunks (MPEG-TS, fragmented MP4) on its own thread and
    hands RGB frames with stream times (seconds from the media's first frame + `offset`) to
    `on_frames`; a decode failure goes to `on_error` and ends this media."""

    def __init__(self, on_frames: Callable[[np.ndarray, np.ndarray], None],
                 on_error: Callable[[BaseException], None], offset: float = 0.0, batch: int = 1):
        self._pipe = _Pipe()
        self._on_frames, self._on_error = on_frames, on_error
        self._offset, self._batch = offset, batch
        self._fed = 0
        self._done = threading.Event()
        self._aborted = False
        self._progress = threading.Condition()
        self._consumed = 0
        self._thread = threading.Thread(target=self._run, name="sparrow-live-decode", daemon=True)
        self._thread.start()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def feed(self, chunk: bytes) -> None:
        if chunk:
            self._fed += 1
            self._pipe.write_chunk(chunk)

    def close(self) -> None:
        self._pipe.write_chunk(None)

    def abort(self) -> None:
        self._aborted = True
        self._pipe.write_chunk(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until the decoder has read every chunk fed so far (or finished)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._progress:
            while not self._done.is_set() and self._pipe._chunks.qsize() > 0:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._progress.wait(timeout=0.05 if left is None else min(0.05, left))

    def _run(self) -> None:
        frames, times = [], []
        origin = None
        try:
            with av.open(self._pipe, mode="r", options={"probesize": "4096", "analyzeduration": "0"}) as container:
                if not container.streams.video:
                    raise VideoUnreadable("the live media has no video stream")
                stream = container.streams.video[0]
                stream.thread_type = "AUTO"
                for frame in container.decode(stream):
                    if self._aborted:
                        return
                    if frame.pts is None:
                        continue
                    t = float(frame.pts * stream.time_base)
                    origin = t if origin is None else origin
                    frames.append(frame.to_ndarray(format="rgb24"))
                    times.append(t - origin + self._offset)
                    if len(frames) >= self._batch:
                        self._flush(frames, times)
                    with self._progress:
                        self._progress.notify_all()
            self._flush(frames, times)
        except _SinkError as exc:             # the session refused the frames: its own error, as is
            if not self._aborted:
                self._on_error(exc.error)
        except (av.error.FFmpegError, VideoUnreadable, ValueError) as exc:
            try:
                self._flush(frames, times)
            except _SinkError:
                pass
            if not self._aborted:
                error = exc if isinstance(exc, VideoUnreadable) else VideoUnreadable(
                    f"the live media could not be decoded: {exc}")
                self._on_error(error)
        except BaseException as exc:  # noqa: BLE001 - e.g. the session closed under it
            if not self._aborted:
                self._on_error(exc)
        finally:
            self._done.set()
            with self._progress:
                self._progress.notify_all()

    def _flush(self, frames: list, times: list) -> None:
        if frames:
            batch, stamps = np.stack(frames), np.array(times)
            frames.clear()
            times.clear()
            try:
                self._on_frames(batch, stamps)
            except Exception as exc:  # noqa: BLE001 - told apart from a decode failure above
                raise _SinkError(exc) from exc


class _SinkError(Exception):
    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


__all__ = ["LiveConfig", "LiveSession", "LiveAnswer", "LiveEvent", "LiveStats", "LiveDecoder"]
