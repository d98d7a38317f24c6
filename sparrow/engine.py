"""The engine: every request's generation, batched by one scheduler (scheduler.py).

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
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .chat import Prompt, as_messages
from .config import SamplingParams, SpecConfig
from .errors import InvalidRequest, ResourceExhausted
from .metrics import SpecMetrics
from .models.target import FeatureNeeds, PrefillJob, TargetModel
from .output import OutputDelta, OutputProcessor
from .prefix_cache import PrefixCache, PrefixEntry
from .scheduler import MAX_DRAFT_TOKENS, EngineConfig, Request, Scheduler, first_token
from .speculative.proposer import BeginInput, Proposer, build_proposer
from .speculative.sampling import new_generator
from .video import ProcessedVideo, VideoOptions, prepare_video


@dataclass(frozen=True, slots=True)
class TokenDelta:
    token_ids: tuple[int, ...]
    text: str


@dataclass(slots=True)
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str               # "stop" | "length" | "abort"
    metrics: SpecMetrics


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
                 config: EngineConfig | None = None):
        self.target = target
        self.prefix_cache = prefix_cache
        self.spec = spec or SpecConfig()
        if self.spec.speculative and proposer is None:
            if draft is None:
                raise InvalidRequest(f"method {self.spec.method!r} needs a draft (or a proposer)")
            proposer = build_proposer(self.spec, target, draft)
        self.proposer = proposer if self.spec.speculative else None
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(self, self.config)

    # ----- inputs ------------------------------------------------------------------------------
    def process_video(self, video, options: VideoOptions | None = None) -> ProcessedVideo:
        if callable(video):         # deferred: decoded only when no cached prefill can be used
            video = video()
        if isinstance(video, ProcessedVideo):
            return video
        return prepare_video(video, self.target.processor, options or VideoOptions())

    def prepare(self, video, prompt: Prompt, options: VideoOptions | None = None) -> dict[str, torch.Tensor]:
        """The exact kwargs handed to target.hf: `target.hf.generate(**engine.prepare(...))` works."""
        return self.target.build_inputs(self.process_video(video, options), prompt)

    # ----- public entry points -------------------------------------------------------------------
    def submit(self, video, prompt: Prompt, sampling: SamplingParams | None = None,
               options: VideoOptions | None = None, *, video_key: str | None = None,
               num_draft_tokens: int | None = None, sink: Callable[[Any], None],
               prefix: PrefixEntry | None = None) -> Request:
        """Start a request; its events go to `sink` from the engine's threads: TokenDelta
        items, then a GenerationOutput or an exception. `request.abort()` stops it.
        prefix: the video already prefilled (a live window's snapshot, sparrow/live.py): the
        request prefills only its own text on a copy of it; `video` is then unused."""
        if isinstance(prompt, list):
            prompt = tuple(prompt)         # the request keeps its own copy of the turns
        return self.scheduler.submit(video, prompt, sampling or SamplingParams(), options, video_key,
                                     num_draft_tokens, sink, entry=prefix)

    def stream(self, video, prompt: Prompt, sampling: SamplingParams | None = None,
               options: VideoOptions | None = None, *, video_key: str | None = None,
               num_draft_tokens: int | None = None) -> Generation:
        """Start a request and iterate its deltas.

        prompt: a question, or a conversation about the video (sparrow.chat.Message turns,
        oldest first, ending with the user's question); the video sits in the first user turn.

        video_key: names the video's content (and how it is sampled) so the prefix cache can
        reuse its prefill; `video` may then be a zero-argument callable, called on a miss only.
        num_draft_tokens: this request's k (fixed for its life); 0 decodes without drafting.
        Default: the engine's, adapted to the load step by step (SpecConfig.adaptive_k).
        """
        gen = Generation()
        try:
            gen.request = self.submit(video, prompt, sampling, options, video_key=video_key,
                                      num_draft_tokens=num_draft_tokens, sink=gen._events.put)
        except ResourceExhausted as exc:
            gen._events.put(exc)
        return gen

    def generate(self, video, prompt: Prompt, sampling: SamplingParams | None = None,
                 options: VideoOptions | None = None, *, video_key: str | None = None,
                 num_draft_tokens: int | None = None) -> GenerationOutput:
        gen = self.stream(video, prompt, sampling, options, video_key=video_key, num_draft_tokens=num_draft_tokens)
        for _ in gen:
            pass
        return gen.output

    def close(self) -> None:
        self.scheduler.close()

    # ----- what the scheduler asks of the engine ---------------------------------------------------
    def _prepare_request(self, request: Request) -> None:
        """On a worker thread: validate, decode the video (unless the prefix cache has its
        prefill), build the prompt, size the request's KV slot."""
        m = request.metrics
        if isinstance(request.prompt, str) and not request.prompt.strip():
            raise InvalidRequest("prompt must be a non-empty string")
        as_messages(request.prompt)        # a conversation's turns are checked here, before any decoding
        k = self._draft_tokens(request.requested_k)
        request.k = k
        request.pinned_k = request.requested_k is not None or request.sampling.replayable
        m.num_draft_tokens = k
        target = self.target
        given = request.entry                                  # a live window's snapshot
        use_prefix = given is None and self.prefix_cache is not None and request.video_key is not None
        want = self.proposer is not None and (k > 0 or use_prefix)
        needs = self.proposer.needs if want else FeatureNeeds()
        t0 = time.perf_counter()
        entry = given if given is not None else self.prefix_cache.get(request.video_key) if use_prefix else None
        processed = entry.video if entry is not None else self.process_video(request.video, request.options)
        inputs = target.build_inputs(processed, request.prompt)
        if given is not None and not given.prefix.matches(inputs["input_ids"][0], target.video_token_id):
            raise InvalidRequest("the question must follow the video (a live window's prompt starts with it)")
        if given is None and entry is not None and (not entry.prefix.matches(inputs["input_ids"][0], target.video_token_id)
                                                    or (needs.visual_features and entry.prefix.visual_features is None)):
            entry, processed = None, self.process_video(request.video, request.options)   # text before the video
            inputs = target.build_inputs(processed, request.prompt)
        m.video_seconds = time.perf_counter() - t0
        m.prompt_tokens, m.visual_tokens = inputs["input_ids"].shape[1], processed.num_visual_tokens
        m.cached_prompt_tokens = entry.prefix.length if entry is not None else 0
        target.check_fits(m.prompt_tokens, request.sampling.max_new_tokens)
        # KV room: the answer, plus one verify step's root and draft tree (a chain: k tokens).
        request.capacity = m.prompt_tokens + request.sampling.max_new_tokens + self.spec.max_tree_nodes(k) + 1
        arena_tokens = self.scheduler._arena().tokens
        if request.capacity > arena_tokens:
            raise ResourceExhausted(
                f"the request needs {request.capacity} tokens of KV memory (prompt {m.prompt_tokens} incl. video + "
                f"max_new_tokens {request.sampling.max_new_tokens} + {k + 1}), more than this engine's whole KV "
                f"cache ({arena_tokens} tokens); use fewer frames, a smaller resolution or fewer new tokens")
        request.needs, request.entry, request.processed, request.inputs = needs, entry, processed, inputs

    def _prefill_job(self, request: Request) -> PrefillJob:
        entry = request.entry
        return PrefillJob(self.target, request.inputs, request.slot.cache, request.needs,
                          prefix=entry.prefix if entry is not None else None,
                          chunk_tokens=self.config.prefill_chunk_tokens)

    def _start_decoding(self, request: Request) -> int:
        """After the prefill: keep the video's prefix for later questions, draw the first
        token, start the draft. Returns the first token."""
        t0 = time.perf_counter()
        job, sampling = request.job, request.sampling
        pre = job.output()
        if self.prefix_cache is not None and request.video_key is not None and request.entry is None:
            self.prefix_cache.put(request.video_key, PrefixEntry.of(request.processed, job.video_prefix()))
        request.generator = new_generator(sampling.seed, self.target.device)   # sampling happens where the logits are
        token = first_token(pre.logits, sampling, request.generator)
        if self.proposer is not None and request.k > 0:
            key = request.video_key if self.prefix_cache is not None else None
            request.draft_state = self.proposer.begin(BeginInput(pre, token, sampling.max_new_tokens, request.inputs,
                                                                 request.processed, key))
        request.state = pre.state
        request.job = request.inputs = request.processed = request.entry = None   # the pixels go now
        request.output = OutputProcessor(self.target.tokenizer, sampling, self.target.eos_token_ids)
        request.metrics.prefill_seconds += time.perf_counter() - t0
        request.decode_start = time.perf_counter()
        return token

    @staticmethod
    def _delta(delta: OutputDelta) -> TokenDelta:
        return TokenDelta(delta.token_ids, delta.text)

    def _final(self, request: Request, finish: str) -> GenerationOutput:
        m, out = request.metrics, request.output
        if request.decode_start:
            m.decode_seconds = time.perf_counter() - request.decode_start
        kv = getattr(request.draft_state, "kv", None)
        if kv is not None:
            m.draft_max_keys = kv.max_visible
        if out is None:                       # ended before its first token
            return GenerationOutput([], "", finish, m)
        m.completion_tokens = len(out.token_ids)
        return GenerationOutput(list(out.token_ids), out.final_text, finish, m)

    def _draft_tokens(self, requested: int | None) -> int:
        if requested is None:
            return self.spec.num_draft_tokens if self.proposer is not None else 0
        if not 0 <= requested <= MAX_DRAFT_TOKENS:
            raise InvalidRequest(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {requested}")
        if requested > 0 and self.proposer is None:
            raise InvalidRequest("this engine has no draft: num_draft_tokens must be 0")
        return requested
