"""The engine: one request's generation loop, read as its phases.

    prefill -> loop { propose -> verify -> accept -> advance -> yield } -> complete

It knows token ids, the target, a proposer and the acceptance functions; nothing of Ray or
gRPC. Transports consume `Engine.stream`, a plain iterator of TokenDelta whose final result
(`Generation.output`) carries the finish reason, usage and metrics.

With a PrefixCache, a request that names its video (`video_key`) reuses an earlier prefill
of that video: only the prompt's own text is prefilled, and the video is not even decoded.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .config import SamplingParams, SpecConfig
from .errors import InvalidRequest, RequestAborted
from .metrics import SpecMetrics
from .models.target import PrefillOutput, TargetModel
from .prefix_cache import PrefixCache, PrefixEntry
from .spec.accept import AcceptResult, accept_greedy, accept_speculative
from .spec.propose import SparrowProposer, build_context
from .spec.sampling import draw_token, logits_to_probs, new_generator
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


@dataclass(slots=True)
class Generation:
    """An in-flight request: iterate for deltas; `output` is set when iteration ends."""

    _it: Iterator[TokenDelta]
    _abort: threading.Event = field(default_factory=threading.Event)
    output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[TokenDelta]:
        return self

    def __next__(self) -> TokenDelta:
        return next(self._it)

    def abort(self) -> None:
        """Stop at the next step boundary (thread-safe); the output's finish_reason is "abort"."""
        self._abort.set()

    def close(self) -> None:
        self._it.close()


class _Detokenizer:
    """Incremental text: decode everything so far, emit what is new, hold back a partial
    UTF-8 sequence (shown as U+FFFD) until its bytes complete."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""

    def push(self, all_ids: list[int]) -> str:
        text = self.tokenizer.decode(all_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


class Engine:
    def __init__(self, target: TargetModel, draft=None, spec: SpecConfig | None = None, proposer=None,
                 prefix_cache: PrefixCache | None = None):
        self.target = target
        self.prefix_cache = prefix_cache
        self.spec = spec or SpecConfig()
        if self.spec.speculative and proposer is None:
            if draft is None:
                raise InvalidRequest(f"method {self.spec.method!r} needs a draft (or a proposer)")
            if not draft.bound:
                draft.bind(target)
            proposer = SparrowProposer(draft, self.spec)
        self.proposer = proposer if self.spec.speculative else None

    # ----- inputs ------------------------------------------------------------------------------
    def process_video(self, video, options: VideoOptions | None = None) -> ProcessedVideo:
        if callable(video):         # deferred: decoded only when no cached prefill can be used
            video = video()
        if isinstance(video, ProcessedVideo):
            return video
        return prepare_video(video, self.target.processor, options or VideoOptions())

    def prepare(self, video, prompt: str, options: VideoOptions | None = None) -> dict[str, torch.Tensor]:
        """The exact kwargs handed to target.hf: `target.hf.generate(**engine.prepare(...))` works."""
        return self.target.build_inputs(self.process_video(video, options), prompt)

    # ----- public entry points -------------------------------------------------------------------
    def stream(self, video, prompt: str, sampling: SamplingParams | None = None,
               options: VideoOptions | None = None, *, video_key: str | None = None,
               num_draft_tokens: int | None = None) -> Generation:
        """Start a request. Validation and video decoding happen on the first `next()`.

        video_key: names the video's content (and how it is sampled) so the prefix cache can
        reuse its prefill; `video` may then be a zero-argument callable, called on a miss only.
        num_draft_tokens: this request's k; 0 decodes without drafting. Default: the engine's.
        """
        gen = Generation(iter(()))
        gen._it = self._run(gen, video, prompt, sampling or SamplingParams(), options, video_key, num_draft_tokens)
        return gen

    def generate(self, video, prompt: str, sampling: SamplingParams | None = None,
                 options: VideoOptions | None = None, *, video_key: str | None = None,
                 num_draft_tokens: int | None = None) -> GenerationOutput:
        gen = self.stream(video, prompt, sampling, options, video_key=video_key, num_draft_tokens=num_draft_tokens)
        for _ in gen:
            pass
        return gen.output

    # ----- the loop --------------------------------------------------------------------------------
    def _run(self, gen: Generation, video, prompt: str, sampling: SamplingParams,
             options: VideoOptions | None, video_key: str | None, num_draft_tokens: int | None) -> Iterator[TokenDelta]:
        m = SpecMetrics()
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequest("prompt must be a non-empty string")
        k = self._draft_tokens(num_draft_tokens)
        proposer = self.proposer if k > 0 else None
        m.num_draft_tokens = k

        # prefill
        pre, inputs, processed = self._prefill(video, prompt, options, video_key, sampling.max_new_tokens, k, m)
        t0 = time.perf_counter()
        rng = new_generator(sampling.seed, self.target.device)   # sampling happens where the logits are
        token = self._sample_one(pre.logits, sampling, rng)
        dstate = None
        if proposer is not None and hasattr(proposer, "begin_request"):
            # Hook for proposers that need the video itself, not a DraftContext (SpecVLM: a small
            # VLM re-reads a pruned video): begin_request(prefill, prompt inputs, video, first token,
            # video key if the prefix cache serves it: a hit has no pixels, the key names the video).
            dstate = proposer.begin_request(pre, inputs, processed, token,
                                            video_key if self.prefix_cache is not None else None)
        elif proposer is not None:
            ctx = (build_context(pre, token, self.spec.glimpse, self.spec.draft_context, self.spec.prune_keep)
                   if proposer.feature_layers else None)
            dstate = proposer.begin(ctx)
        del inputs, processed       # the request's generator frame must not hold the pixels
        m.prefill_seconds += time.perf_counter() - t0
        try:
            yield from self._decode(gen, proposer, dstate, pre, token, k, sampling, rng, m)
        finally:   # however the request ends (done, aborted, closed): a remote draft frees its state
            if dstate is not None and hasattr(proposer, "end"):
                proposer.end(dstate)

    def _decode(self, gen: Generation, proposer, dstate, pre: PrefillOutput, token: int, k: int,
                sampling: SamplingParams, rng: torch.Generator, m: SpecMetrics) -> Iterator[TokenDelta]:
        target = self.target
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(target.eos_token_ids))
        out: list[int] = []
        detok = _Detokenizer(target.tokenizer)
        finish = None
        t_decode = time.perf_counter()
        new_tokens = [token]
        # Stop strings are not part of the answer; text that could still become one is held back.
        hold = max((len(x) for x in sampling.stop), default=1) - 1
        shown = 0                                    # characters of detok.text already yielded
        while True:
            # yield: emit this step's tokens up to a stop condition
            new_tokens, finish = self._truncate(new_tokens, out, stop_ids, sampling)
            out.extend(new_tokens)
            detok.push(out)
            end = len(detok.text)
            if sampling.stop:
                cut = self._stop_string(detok.text, sampling.stop, max(0, shown - hold))
                if cut is not None:
                    finish, end = "stop", cut
                elif finish is None:
                    end = max(shown, end - hold)
            delta, shown = detok.text[shown:end], max(shown, end)
            if new_tokens or delta:
                yield TokenDelta(tuple(new_tokens), delta)
            if finish is None and gen._abort.is_set():
                finish = "abort"
            if finish is not None:
                break
            token = out[-1]
            remaining = sampling.max_new_tokens - len(out)
            k_step = min(k, remaining - 1)      # never draft past max_new_tokens
            if k_step <= 0:
                logits, _ = target.step(pre.state, torch.tensor([token]))
                new_tokens = [self._sample_one(logits[0], sampling, rng)]
                m.record_step(0, 0)
                continue
            # propose
            t1 = time.perf_counter()
            proposal = proposer.propose(dstate, k_step, sampling, rng)
            t2 = time.perf_counter()
            # verify: the last emitted token + k draft tokens, one forward
            logits, feats = target.step(pre.state, torch.cat([torch.tensor([token]), proposal.tokens]),
                                        proposer.feature_layers)
            # accept
            result = self._accept(proposal, logits, sampling, rng)
            # advance: drop rejected drafts from the target cache, feed the draft what was kept
            target.rollback(pre.state, k_step - result.num_accepted)
            t3 = time.perf_counter()          # verify time: the target's forward, acceptance, its rollback
            new_tokens = result.tokens(proposal.tokens)
            proposer.commit(dstate, new_tokens, feats[: len(new_tokens)] if feats is not None else None)
            m.draft_seconds += (t2 - t1) + (time.perf_counter() - t3)
            m.verify_seconds += t3 - t2
            m.record_step(k_step, result.num_accepted)

        m.decode_seconds = time.perf_counter() - t_decode
        m.completion_tokens = len(out)
        if dstate is not None and hasattr(dstate, "kv"):
            m.draft_max_keys = dstate.kv.max_visible
        gen.output = GenerationOutput(out, detok.text[:shown], finish, m)

    # ----- phases ---------------------------------------------------------------------------------
    def _draft_tokens(self, requested: int | None) -> int:
        if requested is None:
            return self.spec.num_draft_tokens if self.proposer is not None else 0
        if not 0 <= requested <= 32:
            raise InvalidRequest(f"num_draft_tokens must be in [0, 32], got {requested}")
        if requested > 0 and self.proposer is None:
            raise InvalidRequest("this engine has no draft: num_draft_tokens must be 0")
        return requested

    def _prefill(self, video, prompt: str, options: VideoOptions | None, video_key: str | None,
                 max_new_tokens: int, k: int, m: SpecMetrics
                 ) -> tuple[PrefillOutput, dict[str, torch.Tensor], ProcessedVideo]:
        """Video -> prompt -> one prefill; through the prefix cache when the video has a key.
        With a prefix cache the draft's features are kept even for a request that does not
        draft, so the cached prefix serves every later request. Returns the prefill, the
        prompt's model inputs and the processed video (the last two for `begin_request`)."""
        target, proposer = self.target, self.proposer
        use_prefix = self.prefix_cache is not None and video_key is not None
        want = proposer is not None and (k > 0 or use_prefix)
        feature_layers = proposer.feature_layers if want else ()
        bridge_layer = proposer.bridge_layer if want else None
        visual = bool(feature_layers) and self.spec.draft_context != "text"   # "all" / "pruned" draft context
        t0 = time.perf_counter()
        entry = self.prefix_cache.get(video_key) if use_prefix else None
        processed = entry.video if entry is not None else self.process_video(video, options)
        inputs = target.build_inputs(processed, prompt)
        if entry is not None and (not entry.prefix.matches(inputs["input_ids"][0], target.video_token_id)
                                  or (visual and entry.prefix.visual_features is None)):
            entry, processed = None, self.process_video(video, options)   # a template that puts text first
            inputs = target.build_inputs(processed, prompt)
        m.video_seconds = time.perf_counter() - t0
        m.prompt_tokens, m.visual_tokens = inputs["input_ids"].shape[1], processed.num_visual_tokens
        target.check_fits(m.prompt_tokens, max_new_tokens)

        t0 = time.perf_counter()
        if use_prefix and entry is None:
            entry = PrefixEntry.of(processed, target.prefill_prefix(inputs, feature_layers, bridge_layer, visual))
            self.prefix_cache.put(video_key, entry)
        elif entry is not None:
            m.cached_prompt_tokens = entry.prefix.length
        pre = target.prefill(inputs, capacity=m.prompt_tokens + max_new_tokens + k + 1, feature_layers=feature_layers,
                             bridge_layer=bridge_layer, kv_cache=self.spec.kv_cache, visual_features=visual,
                             prefix=entry.prefix if entry is not None else None)
        m.prefill_seconds = time.perf_counter() - t0
        return pre, inputs, processed

    # ----- small helpers ------------------------------------------------------------------------
    @staticmethod
    def _sample_one(logits: torch.Tensor, sampling: SamplingParams, rng: torch.Generator) -> int:
        return draw_token(logits, sampling, rng)[0]

    @staticmethod
    def _accept(proposal, logits: torch.Tensor, sampling: SamplingParams, rng: torch.Generator) -> AcceptResult:
        if sampling.greedy:
            return accept_greedy(proposal.tokens, logits)
        p = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        return accept_speculative(proposal.tokens, proposal.probs, p, rng)

    @staticmethod
    def _truncate(new: list[int], out: list[int], stop_ids: set[int],
                  sampling: SamplingParams) -> tuple[list[int], str | None]:
        """Cut a step's tokens at a stop token (kept, as HF generate keeps EOS) or the length cap."""
        for i, t in enumerate(new):
            if t in stop_ids:
                return new[: i + 1], "stop"
        room = sampling.max_new_tokens - len(out)
        if len(new) >= room:
            return new[:room], "length"
        return new, None

    @staticmethod
    def _stop_string(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
        """Where the earliest stop string begins in text[start:], or None."""
        found = [i for i in (text.find(x, start) for x in stops) if i >= 0]
        return min(found) if found else None
