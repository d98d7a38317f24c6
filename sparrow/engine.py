"""The engine: every request's generation, batched by one scheduler (scheduler.py) whose
steps a model runner computes (model_runner.py).

    prefill -> loop { propose -> verify -> accept -> advance -> yield } -> complete

It knows token ids, the target, a proposer and the acceptance functions; nothing of Ray or
gRPC. Transports consume `Engine.stream` (a plain iterator of TokenDelta whose final result,
`Generation.output`, carries the finish reason, usage and metrics) or `Engine.submit` (the
same events pushed to a callback, for an event loop). Requests run concurrently in the
scheduler's batches whichever way they are read.

With a PrefixCache, a request that names its video (`video_key`) reuses an earlier prefill
of that video: only the prompt's own text is prefilled, and the video is not even decoded.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future
from typing import Any, Callable

import torch

from .chat import Prompt
from .config import EngineConfig, SamplingParams, SpecConfig
from .errors import InvalidRequest, ResourceExhausted
from .model_runner import ModelRunner
from .models.draft import SparrowDraft
from .models.kv_cache import KVSlot
from .models.target import TargetModel
from .output import GenerationOutput, TokenDelta
from .prefix_cache import PrefixCache, PrefixEntry
from .request import Request
from .scheduler import Scheduler
from .speculative.proposer import Proposer
from .speculative.registry import build_proposer
from .step_costs import CostModel
from .video import ProcessedVideo, VideoOptions

__all__ = ["Engine", "Generation", "GenerationOutput", "TokenDelta"]


class Generation:
    """An in-flight request: iterate for deltas; `output` is set when iteration ends.
    Errors (a bad video, an over-budget request) are raised by the first `next()` that
    reaches them; `abort()` is thread-safe and ends the request at its next step."""

    def __init__(self):
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.request: Request | None = None
        self.output: GenerationOutput | None = None
        self._ended = False
        self._aborted = False

    def sink(self, item: Any) -> None:
        """Hand this generation its next event (a TokenDelta, then a GenerationOutput or an
        exception): what an engine request's `sink` calls, from any thread."""
        self._events.put(item)

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> TokenDelta:
        if self._ended:
            raise StopIteration
        item = self._events.get()
        while isinstance(item, TokenDelta) and self._aborted:     # the reader asked for no more
            item = self._events.get()
        if isinstance(item, TokenDelta):
            return item
        self._ended = True
        if isinstance(item, GenerationOutput):
            self.output = item
            raise StopIteration
        raise item

    def abort(self) -> None:
        """Stop at the next step boundary; the output's finish_reason is "abort". Deltas the
        engine made before it stopped are not handed out any more."""
        self._aborted = True
        if self.request is not None:
            self.request.abort()

    def close(self) -> None:
        """Abort and wait until the engine has let the request go (its KV slot and draft
        state are freed when this returns)."""
        if self._ended or self.request is None:
            return
        self.abort()
        while not self._ended:
            item = self._events.get()
            if not isinstance(item, TokenDelta):
                self._ended = True
                self.output = item if isinstance(item, GenerationOutput) else None


class Engine:
    def __init__(self, target: TargetModel, draft=None, spec: SpecConfig | None = None,
                 proposer: Proposer | None = None, prefix_cache: PrefixCache | None = None,
                 config: EngineConfig | None = None, step_costs: CostModel | None = None):
        self.target = target
        self.prefix_cache = prefix_cache
        # No spec: the library's defaults, with the geometry the draft was trained with.
        trained = draft.trained_with if isinstance(draft, SparrowDraft) else {}
        self.spec = spec or SpecConfig().with_geometry(trained)
        if self.spec.speculative and proposer is None:
            if draft is None:
                raise InvalidRequest(f"method {self.spec.method!r} needs a draft (or a proposer)")
            proposer = build_proposer(self.spec, target, draft)
        self.proposer = proposer if self.spec.speculative else None
        self.config = config or EngineConfig()
        self.runner = ModelRunner(target, self.proposer, self.spec, self.config, prefix_cache)
        self.scheduler = Scheduler(self.runner, self.config, step_costs)   # None: measured online

    # ----- inputs ------------------------------------------------------------------------------
    def process_video(self, video, options: VideoOptions | None = None) -> ProcessedVideo:
        """Decode, sample and patchify a video as a request would (a ProcessedVideo is kept)."""
        return self.runner.process_video(video, options)

    def prepare(self, video, prompt: Prompt, options: VideoOptions | None = None) -> dict[str, torch.Tensor]:
        """The exact kwargs handed to target.hf: `target.hf.generate(**engine.prepare(...))` works."""
        return self.target.build_inputs(self.process_video(video, options), prompt)

    # ----- public entry points -------------------------------------------------------------------
    def submit(self, video, prompt: Prompt, sampling: SamplingParams | None = None,
               options: VideoOptions | None = None, *, video_key: str | None = None,
               num_draft_tokens: int | None = None, sink: Callable[[Any], None],
               prefix: PrefixEntry | None = None, first_token_ids: tuple[int, ...] = (),
               deadline: float | None = None) -> Request:
        """Start a request; its events go to `sink` from the engine's threads: TokenDelta
        items, then a GenerationOutput or an exception. `request.abort()` stops it, at any
        stage: a video not yet decoded is never decoded, one being decoded stops at its next
        packet. `video`: a source, a ProcessedVideo, or a callable returning either, taking the
        request's abort event as its one argument or taking none (called on the preparation
        stage, only when the prefix cache cannot answer; another signature is InvalidRequest).
        prefix: the video already prefilled (a live window's snapshot, sparrow/live/session.py): the
        request prefills only its own text on a copy of it; `video` is then unused.
        first_token_ids: the output's `first_token_probs` gives the target's probability of each
        of these tokens at the answer's first position (its next-token distribution after the
        prompt, temperature 1): a yes/no question's P(yes) from one prefill (sparrow/live/alerts.py).
        deadline: time.monotonic() at which the request aborts itself, at the engine's next
        check (not prepared at all if it has passed by then)."""
        if isinstance(prompt, list):
            prompt = tuple(prompt)         # the request keeps its own copy of the turns
        return self.scheduler.submit(video, prompt, sampling or SamplingParams(), options, video_key,
                                     num_draft_tokens, sink, entry=prefix, first_token_ids=tuple(first_token_ids),
                                     deadline=deadline)

    def stream(self, video, prompt: Prompt, sampling: SamplingParams | None = None,
               options: VideoOptions | None = None, *, video_key: str | None = None,
               num_draft_tokens: int | None = None, timeout_s: float | None = None) -> Generation:
        """Start a request and iterate its deltas.

        prompt: a question, or a conversation about the video (sparrow.chat.Message turns,
        oldest first, ending with the user's question); the video sits in the first user turn.

        video_key: names the video's content (and how it is sampled) so the prefix cache can
        reuse its prefill; `video` may then be a zero-argument callable, called on a miss only.
        num_draft_tokens: this request's k (fixed for its life); 0 decodes without drafting.
        Default: the engine's, adapted to the load step by step (SpecConfig.adaptive_k).
        timeout_s: the request aborts itself this many seconds from now (finish reason
        "abort"), at whatever stage it is (submit's deadline).
        """
        gen = Generation()
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        try:
            gen.request = self.submit(video, prompt, sampling, options, video_key=video_key,
                                      num_draft_tokens=num_draft_tokens, sink=gen.sink, deadline=deadline)
        except ResourceExhausted as exc:
            gen.sink(exc)
        return gen

    def generate(self, video, prompt: Prompt, sampling: SamplingParams | None = None,
                 options: VideoOptions | None = None, *, video_key: str | None = None,
                 num_draft_tokens: int | None = None, timeout_s: float | None = None) -> GenerationOutput:
        gen = self.stream(video, prompt, sampling, options, video_key=video_key, num_draft_tokens=num_draft_tokens,
                          timeout_s=timeout_s)
        for _ in gen:
            pass
        return gen.output

    # ----- work beside requests (a live session's window) ----------------------------------------
    def call_soon(self, fn: Callable[[], Any], key: Any = None) -> Future:
        """Run `fn` on the engine's scheduler thread between steps, paced like a prefill slice;
        tasks of one `key` run in order, keys take turns (Scheduler.call_soon). The future gets
        its result or exception; RuntimeError once the engine is closed."""
        return self.scheduler.call_soon(fn, key=key)

    def after_each_turn(self, fn: Callable[[], None]) -> None:
        """Call `fn` on the scheduler thread after each phase of a loop turn (a prefill slice, a
        task, a decode step: the phase's events are given to their sinks by then) and at the
        turn's end. `fn` must not raise. A reader that collects the events hands them over once a
        phase (services/async_requests.py): a first token is not held behind the step after it."""
        self.scheduler.turn_done.append(fn)

    def on_scheduler_thread(self) -> bool:
        """Whether the caller is the scheduler's thread (a sink called there is inside a turn)."""
        return self.scheduler.on_thread()

    def claim_kv(self, tokens: int) -> KVSlot | None:
        """A slot of the engine's KV arena for `tokens` positions (its `cache`, `release()`),
        or None when that much is not free. Only on the scheduler thread (inside call_soon):
        the arena is that thread's."""
        return self.runner.arena.allocate(tokens)

    @property
    def kv_tokens(self) -> tuple[int, int]:
        """(free, total) positions of the engine's KV arena."""
        return self.runner.arena.free_tokens, self.runner.arena.tokens

    def close(self) -> None:
        """Take no more requests; those it holds run to their end."""
        self.scheduler.close()

    def shutdown(self) -> None:
        """Take no more requests and abort those it holds (each ends at its next step or prefill
        slice, its KV memory freed): a server stopping."""
        self.scheduler.shutdown()
