"""The target (verifier): a Hugging Face video LLM behind three calls the engine needs.

    prepare(video, prompt) -> the exact kwargs the HF model takes
    prefill(inputs)        -> KV cache, last logits, the draft's features at text positions
    step(state, tokens)    -> logits (and features) for a few tokens on top of the cache

The HF model is used only through public arguments (input_ids, position_ids,
cache, output_hidden_states, logits_to_keep); no modeling file is forked and no
per-request state is left on the model, so one TargetModel serves many requests at once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from ..chat import Prompt, chat_template_messages
from ..config import TARGET_STEPS
from ..errors import ContextOverflow, InvalidRequest
from ..video import ProcessedVideo, VideoProcessor, processor_for
from . import gqa
from .checkpoint import (HF_VIDEO_PROCESSOR_FILE, SPARROW_ONLY_FIELDS, VIDEO_PROCESSOR_FILE, read_chat_template,
                         read_processor)
from .compiling import GATE
from .families import FAMILIES, Family
from .kv_cache import new_kv_cache
from .ragged import RaggedBatch, RaggedSegment, VerifyFn, verify_kernel
from .step_graph import StepGraph
from .placement import check_device_map, parse_device, parse_dtype
from .prefill import FeatureCollector, FeatureNeeds, PrefillJob, PrefillOutput, TargetState, VideoPrefix


class TargetModel:
    def __init__(self, hf, tokenizer, processor: VideoProcessor | None = None):
        family = FAMILIES.get(hf.config.model_type)
        if family is None:
            raise InvalidRequest(f"unsupported target model type {hf.config.model_type!r}; "
                                 f"supported: {sorted(FAMILIES)}")
        self.hf = hf.eval()
        self._first_param = next(hf.parameters())
        if getattr(hf.config.get_text_config(), "_attn_implementation", None) == "sdpa":
            hf.set_attn_implementation({"text_config": gqa.NAME})   # verify steps without K/V copies (gqa.py)
        self.tokenizer = tokenizer
        self.family: Family = family
        self.processor = processor or processor_for(hf.config)
        self.text_config = hf.config.get_text_config()
        self.video_token_id = family.video_token_id(hf.config)
        self.eos_token_ids = _eos_ids(hf, tokenizer)
        self._verify_attention, self._verify_kernel = "auto", None
        self._auto_kernel: tuple[str, VerifyFn | None] | None = None     # (device, kernel) "auto" chose
        self.step_graph: StepGraph | None = None       # target_step "compiled"

    @property
    def verify_attention(self) -> str:
        """How decode/verify steps attend over the cache: "packed" (the cached prefix without a
        mask + the new tokens with theirs, merged by log-sum-exp: kernels/packed.py), "sdpa"
        (one ragged SDPA call with a dense mask), "split" (flash-decoding in torch), "triton"
        (the split-KV Triton kernel, for GPUs), each tested against the reference
        (tests/test_verify_attention.py), or "auto" (the default): "triton" when the model is on CUDA
        and triton is installed, "packed" on a CPU, else "sdpa". Measured on an H100
        (BENCHMARKS.md, GPU check): over 25k cached keys one layer's ragged SDPA costs ~0.9 ms
        at any step size, the Triton kernel 31 us for a decode step and 195 us for a 13-node
        tree. On a CPU "packed" is the fastest (benchmarks.verify_cost). Prefill uses SDPA."""
        return self._verify_attention

    @verify_attention.setter
    def verify_attention(self, name: str) -> None:
        self._verify_kernel = None if name == "auto" else verify_kernel(name)
        self._verify_attention = name

    @property
    def target_step(self) -> str:
        """How decode/verify steps run: "eager" (the default, and the reference) or "compiled"
        (the HF forward through torch.compile, padded to token buckets, each bucket compiled
        on a background thread the first time a step needs it, eager until then:
        step_graph.py)."""
        return "eager" if self.step_graph is None else "compiled"

    @target_step.setter
    def target_step(self, name: str) -> None:
        if name not in TARGET_STEPS:
            raise ValueError(f"unknown target step {name!r}; choose from {TARGET_STEPS}")
        if name == "eager":
            self.step_graph = None
        elif self.step_graph is None:
            self.step_graph = StepGraph(self)

    def step_kernel(self) -> VerifyFn | None:
        """The kernel decode/verify steps use now (None: ragged SDPA); "auto" decides per device."""
        if self._verify_attention != "auto":
            return self._verify_kernel
        device = str(self.device)
        if self._auto_kernel is None or self._auto_kernel[0] != device:
            use_triton = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
            name = "triton" if use_triton else "packed" if self.device.type == "cpu" else "sdpa"
            self._auto_kernel = (device, verify_kernel(name))
        return self._auto_kernel[1]

    # ----- loading ---------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str = torch.float32,
                        attn_implementation: str = "sdpa", device: str | torch.device = "cpu",
                        device_map: str | dict | None = None) -> "TargetModel":
        """dtype: a torch dtype or its name ("bfloat16"), or "auto" (the checkpoint's).
        device: where the whole model goes ("auto": cuda when visible). device_map: instead of
        `device`, let HF/accelerate place the layers ("auto": across the visible GPUs)."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise InvalidRequest(f"{path} is not a saved model directory (no config.json)")
        config = AutoConfig.from_pretrained(path)
        if config.model_type not in FAMILIES:
            raise InvalidRequest(f"unsupported target model type {config.model_type!r}")
        processor = read_processor(path, config)      # before the weights: a bad file fails fast
        place = {"device_map": device_map} if device_map is not None else {}
        if device_map is not None:
            check_device_map(device_map)
        hf = AutoModelForImageTextToText.from_pretrained(
            path, dtype=parse_dtype(dtype), attn_implementation=attn_implementation, **place)
        if device_map is None:
            hf = hf.to(parse_device(device))
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.chat_template is None:
            tokenizer.chat_template = read_chat_template(path)
        return cls(hf, tokenizer, processor)

    def save_pretrained(self, path: str | Path, max_shard_size: str | int | None = None) -> None:
        """Weights (sharded safetensors above max_shard_size, HF's default when None), tokenizer,
        and the video processor: HF's video_preprocessor_config.json, so HF's own processor
        gives the same inputs, and sparrow_video_processor.json for what HF has no field for
        (so a model trained on, say, time as a fraction of the video is served the same way)."""
        self.hf.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        self.tokenizer.save_pretrained(path)
        if dataclasses.is_dataclass(self.processor):
            Path(path, HF_VIDEO_PROCESSOR_FILE).write_text(json.dumps(self.processor.to_hf_dict(), indent=2) + "\n")
            extra = {k: v for k, v in dataclasses.asdict(self.processor).items() if k in SPARROW_ONLY_FIELDS}
            settings = {"processor": type(self.processor).__name__, **extra}
            Path(path, VIDEO_PROCESSOR_FILE).write_text(json.dumps(settings, indent=2) + "\n")

    # ----- shape facts -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.hf.get_output_embeddings().weight.shape[0]

    @property
    def max_context(self) -> int:
        return int(self.text_config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        """Where the model's first parameter is (transformers' `device` walks every parameter,
        ~20 us, and steps ask several times; `Module.to` moves parameters in place, so this one
        follows the model)."""
        return self._first_param.device

    def embed_tokens(self) -> torch.nn.Module:
        return self.hf.get_input_embeddings()

    def lm_head(self) -> torch.nn.Module:
        return self.hf.get_output_embeddings()

    # ----- inputs ------------------------------------------------------------------------
    def prompt_ids(self, prompt: Prompt, num_visual_tokens: int) -> list[int]:
        """Token ids of the chat-formatted prompt with the video placeholder expanded. `prompt`:
        a question, or a conversation (sparrow.chat) whose first user turn holds the video."""
        if isinstance(prompt, str) and not prompt.strip():
            raise InvalidRequest("prompt must be a non-empty string")
        messages = chat_template_messages(prompt)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if ids.count(self.video_token_id) != 1:
            raise InvalidRequest("the prompt must not contain the video placeholder token itself")
        i = ids.index(self.video_token_id)
        return ids[:i] + [self.video_token_id] * num_visual_tokens + ids[i + 1:]

    def build_inputs(self, video: ProcessedVideo, prompt: Prompt) -> dict[str, torch.Tensor]:
        return {**self.text_inputs(self.prompt_ids(prompt, video.num_visual_tokens)), **self._video_inputs(video)}

    @torch.inference_mode()
    def prompt_embeds(self, inputs: dict) -> torch.Tensor:
        """(1, T, H) input embeddings of a whole prompt, its video's visual tokens in place (the
        vision tower's work, done here so it can run off the scheduler thread): PrefillJob(embeds=)."""
        with GATE.forward(long=True):       # never beside a compile (compiling.py)
            return self.family.prompt_embeds(self.hf, inputs, 0, inputs["input_ids"].shape[1], self.video_token_id)

    def text_inputs(self, ids: list[int]) -> dict[str, torch.Tensor]:
        """The model's inputs for token ids (a prompt's, with its video placeholders if any)."""
        input_ids = torch.tensor([ids], device=self.device)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                **self.family.extra_inputs(input_ids, self.video_token_id)}

    def _video_inputs(self, video: ProcessedVideo) -> dict[str, torch.Tensor]:
        return {"pixel_values_videos": video.pixel_values_videos.to(self.device, self.hf.dtype),
                **{k: v.to(self.device) for k, v in video.model_kwargs.items()}}

    def check_fits(self, prompt_len: int, max_new_tokens: int, extra: int = 0) -> None:
        need = prompt_len + max_new_tokens + extra
        if need > self.max_context:
            raise ContextOverflow(
                f"prompt ({prompt_len} tokens incl. video) + max_new_tokens ({max_new_tokens}) = {need} "
                f"exceeds the model's context of {self.max_context} tokens; use fewer frames, a "
                f"smaller resolution or fewer new tokens")

    # ----- forward passes ----------------------------------------------------------------
    def prefill(self, inputs: dict, capacity: int, feature_layers: tuple[int, ...] = (),
                bridge_layer: int | None = None, kv_cache: str = "static",
                prefix: VideoPrefix | None = None, visual_features: bool = False, time_shift: int = 0) -> PrefillOutput:
        """The whole prompt in one go into a fresh cache of `capacity` slots (the engine's
        scheduler runs a PrefillJob over an arena slot instead, chunk by chunk).
        With `prefix` the cache starts as a copy of the video prefix's. visual_features: also
        the features at t-1 of the visual positions (drafts whose context holds visual entries).
        time_shift: the prompt moved later on the temporal axis (PrefillJob)."""
        needs = FeatureNeeds(tuple(feature_layers or ()), bridge_layer, visual_features)
        kv = new_kv_cache(kv_cache, self.num_layers, capacity)
        return PrefillJob(self, inputs, kv, needs, prefix, time_shift=time_shift).run().output()

    @torch.inference_mode()
    def video_embeds(self, video: ProcessedVideo) -> torch.Tensor:
        """(Nv, H) the video's visual tokens as the model's own forward embeds them (the vision
        tower alone), in the model's dtype."""
        with GATE.forward(long=True):
            embeds = self.family.video_embeds(self.hf, self._video_inputs(video))
        if embeds.shape[0] != video.num_visual_tokens:
            raise InvalidRequest(f"the vision tower made {embeds.shape[0]} visual tokens, "
                                 f"expected {video.num_visual_tokens}")
        return embeds.to(self.hf.dtype)

    @torch.inference_mode()
    def prefill_visual(self, kv, embeds: torch.Tensor, position_ids: torch.Tensor, needs: FeatureNeeds,
                       before: torch.Tensor | None = None) -> PrefillOutput:
        """Visual tokens appended to a cache (the frame pairs of a live window, as they come):
        embeds (N, H) at position_ids (3, 1, N), in one forward on top of `kv`. The rows the
        draft reads are the FeatureCollector's, as in any prefill; `before`: the features at
        the position just before these tokens (the t-1 row of the first)."""
        ids = torch.full((embeds.shape[0],), self.video_token_id, device=self.device)
        rows = FeatureCollector(ids, self.video_token_id, needs, before=before)
        with GATE.forward(long=True):
            out = self.hf(inputs_embeds=embeds[None], position_ids=position_ids.to(self.device), cache=kv,
                          use_cache=True, output_hidden_states=needs.hidden, logits_to_keep=1)
        if needs.hidden:
            rows.add(out.hidden_states, 0)
        state = TargetState(kv=kv, length=kv.get_seq_length(), rope_delta=0)   # positions: the caller's
        return rows.output(state, out.logits[0, -1].float())

    def prefill_prefix(self, inputs: dict, feature_layers: tuple[int, ...] = (),
                       bridge_layer: int | None = None, visual_features: bool = False) -> VideoPrefix:
        """Prefill the prompt up to its last video token and keep what `prefill` needs to
        continue from there: the KV cache and the few hidden-state rows of that span that
        the draft reads."""
        ids = inputs["input_ids"][0]
        video_pos = torch.nonzero(ids == self.video_token_id).view(-1)
        if video_pos.numel() == 0:
            raise InvalidRequest("the prompt holds no video tokens")
        end = int(video_pos[-1]) + 1
        needs = FeatureNeeds(tuple(feature_layers or ()), bridge_layer, visual_features)
        return PrefillJob(self, inputs, new_kv_cache("static", self.num_layers, end), needs, end=end).run().video_prefix()

    @torch.inference_mode()
    def verify(self, states: list[TargetState], tokens: list[torch.Tensor], feature_layers: tuple[int, ...] = (),
               trees: list | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Score every request's new tokens in ONE forward: request i's tokens (n_i,) on top of
        its own cache (n_i = 1: a decode step; k_i + 1: a verify step). The tokens are packed
        along the sequence and each request attends only to its own keys (ragged.py).
        trees[i] (a DraftTree, or None for a chain): tokens[i] is [root] + the tree's nodes;
        node j sits at position root + depth_j and sees the root and its own ancestors.
        Returns per request logits (n_i, V) and, if asked, features (n_i, F*H)."""
        segments, positions, row = [], [], 0
        for i, (state, t) in enumerate(zip(states, tokens)):
            n = t.shape[-1]
            tree = trees[i] if trees is not None else None
            if tree is None or tree.is_chain:
                segments.append(RaggedSegment(state.kv, row, row + n))
                positions.append(self.family.step_positions(state.length, n, state.rope_delta, state.time_shift))
            else:
                depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths()])
                segments.append(RaggedSegment(state.kv, row, row + n, tree.attention_mask()))
                positions.append(self.family.text_positions(state.length + depth, state.rope_delta, state.time_shift))
            row += n
        batch = RaggedBatch(segments, self.step_kernel())
        ids = torch.cat([t.view(-1) for t in tokens]).view(1, row).to(self.device)
        position_ids = torch.cat(positions, dim=-1).to(self.device)
        graph = self.step_graph.forward(batch, ids, position_ids, feature_layers) if self.step_graph else None
        if graph is not None:
            logits, feats = graph
        else:
            with GATE.forward():
                out = self.hf(input_ids=ids, position_ids=position_ids, cache=batch, attention_mask=batch.as_mask(),
                              use_cache=True, output_hidden_states=bool(feature_layers))
            logits = out.logits[0].float()                                              # (N, V)
            feats = (torch.cat([out.hidden_states[i][0] for i in feature_layers], dim=-1)
                     if feature_layers else None)                                       # (N, F*H)
        result_logits, result_feats = [], []
        for state, seg in zip(states, segments):
            state.length += seg.end - seg.start
            result_logits.append(logits[seg.start:seg.end])
            result_feats.append(feats[seg.start:seg.end] if feats is not None else None)
        return result_logits, result_feats

    def step(self, state: TargetState, token_ids: torch.Tensor,
             feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One request's n tokens on top of its cache: `verify` with a batch of one."""
        logits, feats = self.verify([state], [token_ids], feature_layers)
        return logits[0], feats[0]

    @torch.inference_mode()
    def keep_path(self, state: TargetState, verified: int, path: list[int]) -> None:
        """After verifying a tree of `verified` tokens (root + nodes): keep the root and the
        accepted nodes `path` (node indices, root to leaf), moved in place to follow the root;
        everything else the tree wrote is dropped (a length move)."""
        root = state.length - verified
        if path != list(range(len(path))):           # a chain's accepted prefix is in place already
            src = torch.tensor(path, device=self.device) + root + 1
            for layer in state.kv.layers:
                for buf in (layer.k_buf, layer.v_buf):
                    buf[:, :, root + 1: root + 1 + len(path)] = buf[:, :, src]    # gathers first: no overlap hazard
        self.rollback(state, verified - 1 - len(path))

    def keep_paths(self, states: list[TargetState], verified: list[int], paths: list[list[int]]) -> None:
        """`keep_path` for a whole step: every request's accepted tree nodes moved in ONE gather and
        scatter per layer over the KV arena (requests in slots of one arena); a chain's accepted
        prefix is in place already and only its length moves."""
        moves = [i for i, path in enumerate(paths) if path != list(range(len(path)))]
        arena = [getattr(states[i].kv.layers[0], "arena", None) for i in moves]
        if len(moves) > 1 and all(a is not None for a in arena) and len({id(a[0]) for a in arena}) == 1:
            src, dst = [], []
            for i, a in zip(moves, arena):
                root = a[2] + states[i].length - verified[i]       # the root's position in the arena
                src += [root + 1 + j for j in paths[i]]
                dst += range(root + 1, root + 1 + len(paths[i]))
            src_t, dst_t = (torch.tensor(x, device=self.device) for x in (src, dst))
            for layer in states[moves[0]].kv.layers:
                for buf in layer.arena[:2]:                         # the arena's (1, Hkv, tokens, D) k and v
                    buf.index_copy_(2, dst_t, buf.index_select(2, src_t))    # gathers first: no overlap hazard
            moves = []
        for i, (state, n, path) in enumerate(zip(states, verified, paths)):
            if i in moves:
                self.keep_path(state, n, path)
            else:
                self.rollback(state, n - 1 - len(path))

    def rollback(self, state: TargetState, n_remove: int) -> None:
        """Drop the last n_remove tokens (rejected drafts) from the KV cache."""
        if n_remove > 0:
            state.kv.crop(-n_remove)
            state.length -= n_remove


def _eos_ids(hf, tokenizer) -> frozenset[int]:
    ids = set()
    for source in (hf.generation_config, hf.config.get_text_config(), hf.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
