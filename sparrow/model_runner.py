"""The model runner: every forward of one engine, apart from the scheduler that decides.

The scheduler (scheduler.py) decides who runs and how many tokens each scores; the runner
computes: a request's preparation (video, prompt, KV size), its prefill job and first token,
and each decode step's phases over a batch,

    propose  one batched draft pass for the requests that draft (each proposer first runs what
             its requests emitted since they last drafted: commits are deferred in the
             proposer, proposer.py)
    verify   one ragged target forward over every request's last token + its draft tree,
             then the batch's acceptance in one tensor program (accept_batch.py, each request
             with its own generator), and every target cache kept to its accepted path
    commit   the draft learns what each step emitted (kept for its next propose)

timing each into `StepTimes`, which the scheduler's draft policy reads. It owns the target,
the proposer and the KV arena; it knows nothing of queues, admission or threads.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .chat import as_messages
from .config import EngineConfig, SamplingParams, SpecConfig
from .errors import InvalidRequest, ResourceExhausted
from .models.kv_cache import KVArena
from .models.prefill import FeatureNeeds, PrefillJob, finish_together
from .models.target import TargetModel
from .output import GenerationOutput, OutputProcessor
from .prefix_cache import PrefixCache, PrefixEntry
from .request import Request
from .speculative.accept_batch import accept_all
from .speculative.proposer import BeginInput, DraftRequest, Proposal, Proposer, StepResult
from .speculative.sampling import PositionNoise, draw_token, logits_to_probs, new_generator
from .video import ProcessedVideo, VideoOptions, prepare_video

MAX_DRAFT_TOKENS = 32
_NO_DRAFT = torch.empty(0, dtype=torch.long)


@dataclass(slots=True)
class StepTimes:
    """Seconds one decode step spent drafting (propose + commit) and verifying."""

    draft_s: float = 0.0
    verify_s: float = 0.0


def call_deferred(video: Callable[..., Any], cancelled: threading.Event | None) -> Any:
    """Call a deferred video: `video(cancelled)` when it takes a positional argument (the
    request's abort event, to stop a decode early), `video()` when it takes none (the first
    form, `lambda: processed`). Any other signature is InvalidRequest, never a TypeError from
    inside the call; what the callable itself raises reaches the request's reader unchanged."""
    try:
        params = list(inspect.signature(video).parameters.values())
    except (TypeError, ValueError):        # no signature to read (some builtins): the documented form
        return video(cancelled)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(required) > 1 or (required and required[0] not in positional[:1]):
        raise InvalidRequest(f"a callable video takes the request's abort event (threading.Event) as its one "
                             f"argument, or no argument, and returns a source or a ProcessedVideo; "
                             f"{getattr(video, '__qualname__', type(video).__name__)} takes "
                             f"({', '.join(p.name for p in required)})")
    if positional or any(p.kind == p.VAR_POSITIONAL for p in params):
        return video(cancelled)
    return video()


class ModelRunner:
    def __init__(self, target: TargetModel, proposer: Proposer | None, spec: SpecConfig, config: EngineConfig,
                 prefix_cache: PrefixCache | None):
        self.target, self.proposer, self.spec, self.config = target, proposer, spec, config
        self.prefix_cache = prefix_cache
        self.times = StepTimes()
        self._arena: KVArena | None = None
        if config.kv_prefault:
            _ = self.arena     # made and written now, not by the first request (EngineConfig.kv_prefault)

    @property
    def arena(self) -> KVArena:
        """The target's KV memory for every request, allocated on first use (at once with kv_prefault)."""
        if self._arena is None:
            t = self.target
            self._arena = KVArena.for_model(t.text_config, self.config.kv_cache_bytes, t.hf.dtype, t.device,
                                            prefault=self.config.kv_prefault)
        return self._arena

    # ----- a request's start -----------------------------------------------------------------------
    def process_video(self, video, options: VideoOptions | None = None,
                      cancelled: threading.Event | None = None) -> ProcessedVideo:
        """video: a source, a ProcessedVideo, or a deferred one (decoded only when no cached
        prefill can be used): a callable returning either, taking `cancelled` as its one
        argument or taking none (call_deferred). `cancelled` (a request's abort) stops the
        decode at its next packet with RequestAborted."""
        if callable(video):
            video = call_deferred(video, cancelled)
        if isinstance(video, ProcessedVideo):
            return video
        return prepare_video(video, self.target.processor, options or VideoOptions(), cancelled=cancelled)

    def prepare(self, request: Request) -> None:
        """On a worker thread: validate, decode the video (unless the prefix cache has its
        prefill), build the prompt, size the request's KV slot."""
        m = request.metrics
        if isinstance(request.prompt, str) and not request.prompt.strip():
            raise InvalidRequest("prompt must be a non-empty string")
        as_messages(request.prompt)        # a conversation's turns are checked here, before any decoding
        k = self.draft_tokens(request.requested_k)
        request.k = k
        request.pinned_k = request.requested_k is not None
        m.num_draft_tokens = k
        target = self.target
        given = request.entry                                  # a live window's snapshot
        use_prefix = given is None and self.prefix_cache is not None and request.video_key is not None
        want = self.proposer is not None and (k > 0 or use_prefix)
        needs = self.proposer.needs if want else FeatureNeeds()
        t0 = time.perf_counter()
        entry = given if given is not None else self.prefix_cache.get(request.video_key) if use_prefix else None
        processed = entry.video if entry is not None else self.process_video(request.video, request.options, request.aborted)
        inputs = target.build_inputs(processed, request.prompt)
        if given is not None and not given.prefix.matches(inputs["input_ids"][0], target.video_token_id):
            raise InvalidRequest("the question must follow the video (a live window's prompt starts with it)")
        if given is None and entry is not None and (not entry.prefix.matches(inputs["input_ids"][0], target.video_token_id)
                                                    or entry.prefix.missing(needs) is not None):
            # text before the video, or prefilled for a draft that reads less: prefilled again
            entry, processed = None, self.process_video(request.video, request.options, request.aborted)
            inputs = target.build_inputs(processed, request.prompt)
        m.video_seconds = time.perf_counter() - t0
        m.prompt_tokens, m.visual_tokens = inputs["input_ids"].shape[1], processed.num_visual_tokens
        m.cached_prompt_tokens = entry.prefix.length if entry is not None else 0
        target.check_fits(m.prompt_tokens, request.sampling.max_new_tokens)
        # KV room: the answer, plus one verify step's root and draft tree (a chain: k tokens).
        request.capacity = m.prompt_tokens + request.sampling.max_new_tokens + self.spec.max_tree_nodes(k) + 1
        arena_tokens = self.arena.tokens
        if request.capacity > arena_tokens:
            raise ResourceExhausted(
                f"the request needs {request.capacity} tokens of KV memory (prompt {m.prompt_tokens} incl. video + "
                f"max_new_tokens {request.sampling.max_new_tokens} + {k + 1}), more than this engine's whole KV "
                f"cache ({arena_tokens} tokens); use fewer frames, a smaller resolution or fewer new tokens")
        request.needs, request.entry, request.processed, request.inputs = needs, entry, processed, inputs
        if entry is None and not request.aborted.is_set():
            # the vision tower here, on a worker thread: a long video's never holds up the scheduler's
            # decode steps and other prefills (it counts as prefill time)
            t1 = time.perf_counter()
            request.embeds = target.prompt_embeds(inputs)
            m.prefill_seconds += time.perf_counter() - t1

    def draft_tokens(self, requested: int | None) -> int:
        """A request's k: its own (checked) or the engine's."""
        if requested is None:
            return self.spec.num_draft_tokens if self.proposer is not None else 0
        if not 0 <= requested <= MAX_DRAFT_TOKENS:
            raise InvalidRequest(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {requested}")
        if requested > 0 and self.proposer is None:
            raise InvalidRequest("this engine has no draft: num_draft_tokens must be 0")
        return requested

    def prefill_job(self, request: Request) -> PrefillJob:
        prefix = request.entry.prefix if request.entry is not None else None
        embeds, request.embeds = request.embeds, None
        slot = request.slot
        job = PrefillJob(self.target, request.inputs, slot.cache, request.needs, prefix=prefix,
                         chunk_tokens=self.config.prefill_chunk_tokens, embeds=embeds,
                         prefix_in_place=prefix is not None and slot.preloaded is prefix)
        if prefix is not None:
            slot.holds = prefix          # its rows are the slot's first: kept for the next question (KVArena)
        return job

    def finish_prefills(self, requests: list[Request]) -> None:
        """The short rests of these requests' prefills (a question after a cached video) in one
        forward (prefill.finish_together). Each request's embeddings are made already
        (PrefillJob.embed). A failure fails them all, as a failed decode step fails its batch."""
        finish_together([request.job for request in requests])

    def start_decoding(self, request: Request) -> int:
        """After the prefill: keep the video's prefix for later questions, draw the first
        token, start the draft. Returns the first token."""
        t0 = time.perf_counter()
        job, sampling = request.job, request.sampling
        pre = job.output()
        if self.prefix_cache is not None and request.video_key is not None and request.entry is None:
            made = job.video_prefix()
            self.prefix_cache.put(request.video_key, PrefixEntry.of(request.processed, made))
            request.slot.holds = made        # cloned from the slot's rows: they stay for the next question
            pre.prefix = made        # what the draft's begin makes once per video is kept there (glimpse_mass)
        request.generator = new_generator(sampling.seed, self.target.device)   # sampling happens where the logits are
        request.noise = PositionNoise(sampling.seed) if sampling.replayable else None
        token = _first_token(pre.logits, sampling, request.generator, request.noise)
        if request.first_token_ids:
            probs = torch.softmax(pre.logits.float(), dim=-1)       # (V,) the raw next-token distribution
            ids = torch.tensor(request.first_token_ids, device=probs.device)
            request.first_token_probs = tuple(probs[ids].tolist())
        if self.proposer is not None and request.k > 0:
            key = request.video_key if self.prefix_cache is not None else None
            request.draft_state = self.proposer.begin(BeginInput(pre, token, sampling.max_new_tokens, request.inputs,
                                                                 request.processed, key,
                                                                 self.spec.max_tree_nodes(request.k)))
        request.state = pre.state
        request.job = request.inputs = request.processed = request.entry = None   # the pixels go now
        request.output = OutputProcessor(self.target.tokenizer, sampling, self.target.eos_token_ids)
        request.metrics.prefill_seconds += time.perf_counter() - t0
        request.decode_start = time.perf_counter()
        return token

    # ----- a decode step's phases ------------------------------------------------------------------
    def propose(self, batch: list[Request], ks: list[int]) -> list[Proposal | None]:
        """One batched draft pass: request i drafts ks[i] tokens deep (0: it does not draft)."""
        t0 = time.perf_counter()
        self.times = StepTimes()
        drafting = [i for i, k in enumerate(ks) if k > 0]
        proposals: list[Proposal | None] = [None] * len(batch)
        if drafting:
            cap = self.config.step_draft_nodes
            share = max(1, cap // len(drafting)) if cap else None
            calls = [DraftRequest(batch[i].draft_state, ks[i], batch[i].sampling, batch[i].generator, share,
                                  batch[i].noise) for i in drafting]
            for i, proposal in zip(drafting, self.proposer.propose(calls)):
                proposals[i] = proposal
        self.times.draft_s += time.perf_counter() - t0
        return proposals

    def verify(self, batch: list[Request], proposals: list[Proposal | None]) -> list[StepResult]:
        """One target forward over the batch; each request's acceptance; its cache kept to
        the accepted path."""
        t0 = time.perf_counter()
        device = self.target.device
        tokens = []
        for request, proposal in zip(batch, proposals):
            last = torch.tensor([request.output.token_ids[-1]], dtype=torch.long)
            tokens.append(torch.cat([last, proposal.tokens]) if proposal is not None else last)
        drafts = any(r.draft_state is not None for r in batch)
        layers = self.proposer.needs.feature_layers if drafts else ()
        logits, feats = self.target.verify([r.state for r in batch], [t.to(device) for t in tokens], layers,
                                           trees=proposals)
        # the whole batch's acceptance in one tensor program, its KV kept to the accepted paths in one move
        accepts = accept_all(proposals, logits, [r.sampling for r in batch], [r.generator for r in batch],
                             [r.noise for r in batch])
        self.target.keep_paths([r.state for r in batch], [lg.shape[0] for lg in logits], [list(a.path) for a in accepts])
        results = []
        for proposal, accept, ft in zip(proposals, accepts, feats):
            emitted = accept.tokens(proposal.tokens if proposal is not None else _NO_DRAFT)
            # The target's features before each emitted token: at the root, then at each accepted node.
            rows = [0] + [i + 1 for i in accept.path]
            results.append(StepResult(accept, emitted, ft[rows] if ft is not None else None))
        self.times.verify_s += time.perf_counter() - t0
        return results

    def commit(self, batch: list[Request], results: list[StepResult]) -> None:
        """The draft learns what each step emitted, drafted or not. A commit runs no
        draft pass: the proposer keeps the entries for the request's next propose (the
        Proposer contract, proposer.py), so plain steps cost the draft nothing."""
        t0 = time.perf_counter()
        pairs = [(r.draft_state, res) for r, res in zip(batch, results) if r.draft_state is not None]
        if pairs:
            self.proposer.commit([s for s, _ in pairs], [res for _, res in pairs])
        self.times.draft_s += time.perf_counter() - t0

    # ----- a request's end -------------------------------------------------------------------------
    def final(self, request: Request, finish: str) -> GenerationOutput:
        """The request's output; read before `release` frees its draft state, so the draft's
        memory is measured here."""
        m, out = request.metrics, request.output
        if request.decode_start:
            m.decode_seconds = time.perf_counter() - request.decode_start
        if request.draft_state is not None:
            m.draft_kv_bytes = request.draft_state.kv_bytes()
            m.draft_max_keys = request.draft_state.max_keys()
        if out is None:                       # ended before its first token
            return GenerationOutput([], "", finish, m)
        m.completion_tokens = len(out.token_ids)
        return GenerationOutput(list(out.token_ids), out.final_text, finish, m, request.first_token_probs)

    def release(self, request: Request) -> None:
        """Free the request's KV slot and draft state (the proposer's `end`)."""
        if request.slot is not None:
            request.slot.release()
        try:
            if request.draft_state is not None:
                self.proposer.end(request.draft_state)
        finally:
            request.state = request.draft_state = request.job = request.inputs = request.processed = None
            request.embeds = None
            request.slot = None


def _first_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator,
                 noise: PositionNoise | None) -> int:
    """The token after the prompt (output position 0), from the prefill's (V,) logits."""
    if noise is None or sampling.greedy:
        return draw_token(logits, sampling, generator)[0]
    p = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    token = int(noise.scores(p[None], torch.zeros(1, dtype=torch.long)).argmax())
    noise.position = 1
    return token
