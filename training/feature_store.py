"""The feature store: what the draft reads from the target, computed once and kept on disk.

Online distillation (signals.py) runs the target over the whole video for every sample, every
epoch: at 25k visual tokens that is most of a training step. But the Sparrow draft never reads
the video itself. Per (video, prompt) it reads the prompt's text entries (token, target features
at t-1: the anchors and the window come from these) and, for bridging, a few bridge-layer visual
states chosen by the glimpse rule; per response it reads the response's entries and learns the
target's next-token distribution there. So the store keeps exactly that, in `disk_dtype` on disk:

    per context  (one video, one prompt)
        token_ids (P,), features (P, F*H)        the prompt's text entries, as prefill gives them
        glimpse (U, H), glimpse_idx.<G> (G,)     bridge states chosen for each budget G (their union)
        all_token_ids (P', ), all_features (P', F*H)   with `visual` only: the prompt's entries with
                                                 every visual token among them, in prompt order (the
                                                 inputs of a draft that reads every token, context
                                                 "all": the EAGLE-style), as inference builds them
    per response (the target's own answer to that context: greedy, and sampled with seeds)
        token_ids (n,), features (n, F*H)        entry i pairs r_i with the features at r_{i-1}
        final_hidden (n, H)                      what the lm_head reads: the target's distribution at
                                                 each entry is lm_head(final_hidden), recomputed on load

Responses are kept whatever they say (a wrong answer included): the draft must predict the
target, not the truth; `correct` records whether it matched the sample's answer, when one was given.

Layout: one safetensors shard per video (its records in the shard's metadata), written aside
and renamed, so an interrupted build resumes at the first video without a shard; `index.json`
lists every record and the header (the target it was built with, the draft inputs it holds).

Building reads each video once: the video prefix is prefilled once (prefill_prefix) and every
prompt about the video starts from it, the engine's generation included (its prefix cache is
given the same prefix), and each response's signals are one teacher-forced step over the
response on top of the prompt's cache, rolled back after.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sparrow.config import SamplingParams, SpecConfig, check
from sparrow.engine import Engine
from sparrow.errors import InvalidRequest, SparrowError
from sparrow.models.draft import DraftConfig, default_feature_layers
from sparrow.models.placement import parse_dtype
from sparrow.models.target import TargetModel
from sparrow.prefix_cache import PrefixCache, PrefixEntry
from sparrow.speculative.draft_context import in_prompt_order
from sparrow.speculative.glimpse import select_glimpse, text_to_visual_attention
from sparrow.video import VideoOptions

from .data import Sample, prompt_json
from .signals import TargetSignals

INDEX_NAME = "index.json"
STORE_VERSION = 1


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """What a feature store holds. greedy / sampled: responses per prompt (the target's greedy
    answer; `sampled` answers drawn at `temperature` / `top_p` with seeds from `seed`).
    bridge_budgets: the bridging budgets a draft may be trained with (TrainConfig.bridge_tokens)."""

    greedy: bool = True
    sampled: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    bridge_budgets: tuple[int, ...] = (16, 64)
    feature_layers: tuple[int, ...] | None = None     # None: the draft default for the target
    disk_dtype: str = "bfloat16"                      # of the stored states
    fps: float | None = 2.0
    num_frames: int | None = None
    max_frames: int = 768                             # frames kept at most (VideoOptions)
    max_visual_tokens: int | None = None              # None: the processor's own budget
    seed: int = 0
    visual: bool = False                              # also every prompt's visual entries (context "all")

    def __post_init__(self) -> None:
        check(self.greedy or self.sampled > 0, "a store needs responses: greedy, or sampled > 0")
        check(self.sampled >= 0 and self.temperature > 0 and 0 < self.top_p <= 1, "bad sampled / temperature / top_p")
        check(self.max_new_tokens >= 2, "max_new_tokens must be >= 2 (a chain needs two tokens)")
        check(all(b >= 1 for b in self.bridge_budgets), "bridge_budgets must be >= 1")
        check(self.disk_dtype in ("float32", "float16", "bfloat16"), "disk_dtype must be float32, float16 or bfloat16")

    def options(self) -> VideoOptions:
        budget = {"max_visual_tokens": self.max_visual_tokens} if self.max_visual_tokens else {}
        return VideoOptions(fps=self.fps, num_frames=self.num_frames, max_frames=self.max_frames,
                            max_decoded_frames=max(1024, self.max_frames), **budget)

    def samplings(self, seed: int) -> list[SamplingParams]:
        greedy = [SamplingParams(max_new_tokens=self.max_new_tokens)] if self.greedy else []
        return greedy + [SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                        top_p=self.top_p, seed=seed + j) for j in range(self.sampled)]


STORE_HELP = {
    "greedy": "store the target's greedy answer to every prompt",
    "sampled": "sampled answers per prompt besides the greedy one",
    "temperature": "temperature of the sampled answers",
    "top_p": "top-p of the sampled answers",
    "max_new_tokens": "length cap of the target's answers",
    "bridge_budgets": "bridging budgets (bridge-layer visual states) kept per prompt, comma-separated",
    "feature_layers": "target hidden-state indices the draft reads, comma-separated (default: low, mid, high)",
    "disk_dtype": "dtype of the stored states on disk: float32, float16 or bfloat16",
    "fps": "video frames sampled per second",
    "num_frames": "frames sampled per video (overrides fps)",
    "max_frames": "frames kept per video at most",
    "max_visual_tokens": "visual tokens per video at most (default: the processor's budget)",
    "seed": "seed of the sampled answers",
    "visual": "also keep each prompt's visual entries, for drafts that read every token (context all: the "
              "EAGLE-style), so they train on the same store as the Sparrow draft",
}


def target_fingerprint(target: TargetModel) -> dict:
    """What a store's signals depend on: the target's shape and (a digest of) its weights."""
    digest = hashlib.sha256()
    for w in (target.lm_head().weight, target.embed_tokens().weight):
        digest.update(w.detach().float().flatten()[: 1 << 20].cpu().numpy().tobytes())
    return {"num_layers": target.num_layers, "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
            "weights_sha256": digest.hexdigest()}


# ----- building ------------------------------------------------------------------------------------
def build_store(target: TargetModel, samples: list[Sample], out: str | Path, cfg: StoreConfig,
                log: Callable[[str], None] | None = None) -> Path:
    """Build (or finish building) a store of `samples`, grouped by video, in folder `out`."""
    out, log = Path(out), log or (lambda line: None)
    layers = tuple(cfg.feature_layers or default_feature_layers(target.num_layers))
    header = {"version": STORE_VERSION, "target": target_fingerprint(target), "feature_layers": list(layers),
              "bridge_layer": target.num_layers // 2, "config": _jsonable(cfg)}
    _claim(out, header)
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(_video_key(s.video), []).append(s)
    builder = _Builder(target, cfg, layers, header["bridge_layer"])
    t0 = time.perf_counter()
    for v, asks in enumerate(groups.values()):
        shard = out / f"shard_{v:06d}.safetensors"
        if shard.is_file():
            continue
        t = time.perf_counter()
        try:
            tensors, records = builder.video(v, asks)
        except (SparrowError, OSError) as exc:
            log(f"video {v + 1}/{len(groups)}: skipped ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        tmp = shard.with_name(shard.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"records": json.dumps(records)})
        tmp.rename(shard)
        n = sum(r["type"] == "response" for r in records)
        log(f"video {v + 1}/{len(groups)}: {records[0]['visual_tokens']:,} visual tokens, {len(asks)} prompts, "
            f"{n} responses, {time.perf_counter() - t:.1f} s (total {time.perf_counter() - t0:.0f} s)")
    builder.close()
    return write_index(out)


class _Builder:
    def __init__(self, target: TargetModel, cfg: StoreConfig, layers: tuple[int, ...], bridge: int):
        self.target, self.cfg, self.layers, self.bridge = target, cfg, layers, bridge
        self.options = cfg.options()
        self.dtype = parse_dtype(cfg.disk_dtype)
        self.engine = Engine(target, spec=SpecConfig(method="none"), prefix_cache=PrefixCache(max_entries=1))

    def close(self) -> None:
        self.engine.close()

    def video(self, v: int, asks: list[Sample]) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """Every record of one video: a context per prompt, its responses after it."""
        target, key = self.target, f"feature-store/{v}"
        processed = self.engine.process_video(asks[0].video, self.options)
        tensors, records, prefix = {}, [], None
        for p, s in enumerate(asks):
            if isinstance(s.prompt, str) and not s.prompt.strip():
                continue                                         # an empty prompt: nothing to ask
            inputs = target.build_inputs(processed, s.prompt)
            if prefix is None or not prefix.matches(inputs["input_ids"][0], target.video_token_id):
                prefix = target.prefill_prefix(inputs, self.layers, self.bridge, visual_features=self.cfg.visual)
                self.engine.prefix_cache.put(key, PrefixEntry.of(processed, prefix))
            capacity = inputs["input_ids"].shape[1] + self.cfg.max_new_tokens + 1
            pre = target.prefill(inputs, capacity, self.layers, self.bridge, prefix=prefix,
                                 visual_features=self.cfg.visual)
            cid = f"v{v}p{p}"
            tensors.update(self._context(cid, pre))
            records.append({"type": "context", "id": cid, "video": _video_name(s.video, v),
                            "prompt": prompt_json(s.prompt), "visual_tokens": processed.num_visual_tokens,
                            "num_prompt": int(pre.text_token_ids.shape[0]),
                            **({"num_visual": int(pre.visual_positions.shape[0])} if self.cfg.visual else {})})
            for j, sampling in enumerate(self.cfg.samplings(self.cfg.seed + 1000 * (1000 * v + p))):
                out = self.engine.generate(processed, s.prompt, sampling, video_key=key)
                if len(out.token_ids) < 2:
                    continue                                     # nothing to draft
                rid = f"{cid}r{j}"
                tensors.update(self._response(rid, pre, list(out.token_ids)))
                records.append(_response_record(rid, cid, sampling, out, s.answer))
        if not any(r["type"] == "response" for r in records):
            raise InvalidRequest("no usable prompt or response for this video")
        return tensors, records

    def _context(self, cid: str, pre) -> dict[str, torch.Tensor]:
        att = text_to_visual_attention(pre.bridge_text, pre.bridge_visual)
        picks = {b: select_glimpse(att, b).cpu() for b in self.cfg.bridge_budgets}
        union = torch.unique(torch.cat(list(picks.values())))                   # sorted
        out = {f"{cid}.token_ids": pre.text_token_ids.cpu(), f"{cid}.features": self._disk(pre.text_features),
               f"{cid}.glimpse": self._disk(pre.bridge_visual[union.to(pre.bridge_visual.device)])}
        for b, idx in picks.items():
            out[f"{cid}.glimpse_idx.{b}"] = torch.searchsorted(union, idx)          # rows of the union
        if self.cfg.visual:
            ids, feats = in_prompt_order(pre.text_token_ids, pre.text_features, pre.text_positions,
                                         pre.visual_positions, pre.visual_features, pre.video_token_id)
            out.update({f"{cid}.all_token_ids": ids.cpu(), f"{cid}.all_features": self._disk(feats)})
        return out

    @torch.inference_mode()
    def _response(self, rid: str, pre, ids: list[int]) -> dict[str, torch.Tensor]:
        """One teacher-forced step over the response on the prompt's cache, rolled back after."""
        target, state = self.target, pre.state
        _, feats = target.step(state, torch.tensor(ids, device=target.device), self.layers + (target.num_layers,))
        target.rollback(state, len(ids))
        width = pre.last_feature.shape[0]                     # F*H; the rest is the final hidden state
        features = torch.cat([pre.last_feature[None], feats[:-1, :width]])      # entry i: features at r_{i-1}
        return {f"{rid}.token_ids": torch.tensor(ids), f"{rid}.features": self._disk(features),
                f"{rid}.final_hidden": self._disk(feats[:, width:])}

    def _disk(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", self.dtype).contiguous()


def _response_record(rid: str, cid: str, sampling: SamplingParams, out, answer: str | None) -> dict:
    """What the index says of one response; `correct`: whether it is the sample's answer (None
    without one). A wrong answer is kept all the same."""
    return {"type": "response", "id": rid, "context": cid, "kind": "greedy" if sampling.greedy else "sampled",
            "temperature": sampling.temperature, "seed": sampling.seed, "length": len(out.token_ids), "text": out.text,
            "correct": None if answer is None else out.text.strip() == answer.strip()}


def _claim(out: Path, header: dict) -> None:
    """Start a store in `out`, or check that the one there was built the same way."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "store.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != header:
            raise InvalidRequest(f"{out} holds a feature store built for another target or with other settings; "
                                 f"use a new folder")
    else:
        path.write_text(json.dumps(header, indent=2))


def write_index(out: str | Path) -> Path:
    """index.json: the header and every shard's records (rebuilt from the shards)."""
    out = Path(out)
    header = json.loads((out / "store.json").read_text())
    records = []
    for shard in sorted(out.glob("shard_*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            records += [{**r, "shard": shard.name} for r in json.loads(f.metadata()["records"])]
    (out / INDEX_NAME).write_text(json.dumps({**header, "records": records}))
    return out / INDEX_NAME


def _video_key(video) -> str:
    if isinstance(video, (str, Path)):
        return str(Path(video).resolve())
    return f"object:{id(video)}"


def _video_name(video, v: int) -> str:
    return str(video) if isinstance(video, (str, Path)) else f"<video {v}>"


def _jsonable(cfg) -> dict:
    return {f.name: list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v for f in fields(cfg)}


# ----- reading -------------------------------------------------------------------------------------
@lru_cache(maxsize=16)
def _open(path: str):
    return safe_open(path, framework="pt")


class FeatureStore:
    """A built store, read lazily: item i is the i-th response with its context."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / INDEX_NAME).is_file():
            raise InvalidRequest(f"{self.path} holds no feature store ({INDEX_NAME} missing)")
        index = json.loads((self.path / INDEX_NAME).read_text())
        if index.get("version") != STORE_VERSION:
            raise InvalidRequest(f"{self.path}: feature store version {index.get('version')}, expected {STORE_VERSION}")
        self.header = {k: v for k, v in index.items() if k != "records"}
        self.contexts = {r["id"]: r for r in index["records"] if r["type"] == "context"}
        self.responses = [r for r in index["records"] if r["type"] == "response"]
        if not self.responses:
            raise InvalidRequest(f"{self.path}: the feature store holds no responses")

    def only(self, kind: str) -> "FeatureStore":
        """This store with only its "greedy" or "sampled" responses ("all": itself)."""
        if kind == "all":
            return self
        kept = [r for r in self.responses if r["kind"] == kind]
        if not kept:
            raise InvalidRequest(f"{self.path}: the feature store holds no {kind} responses")
        view = object.__new__(FeatureStore)
        view.path, view.header, view.contexts, view.responses = self.path, self.header, self.contexts, kept
        return view

    @staticmethod
    def is_store(path: str | Path) -> bool:
        return (Path(path) / INDEX_NAME).is_file()

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.header["feature_layers"])

    @property
    def bridge_budgets(self) -> tuple[int, ...]:
        return tuple(self.header["config"]["bridge_budgets"])

    @property
    def video_options(self) -> VideoOptions:
        """How the store's builder read its videos (StoreConfig.options), for a reader of the same frames."""
        cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in self.header["config"].items()}
        return StoreConfig(**cfg).options()

    @property
    def visual(self) -> bool:
        """Whether it keeps the prompts' visual entries (StoreConfig.visual): context "all" trains on it."""
        return bool(self.header["config"].get("visual"))

    def check(self, target: TargetModel, draft: DraftConfig, bridge_tokens: int) -> None:
        """A draft trained on this store reads what it holds, and the target is the one it was built with."""
        if self.header["target"] != target_fingerprint(target):
            raise InvalidRequest(f"{self.path}: the feature store was built with another target")
        if tuple(draft.feature_layers) != self.feature_layers or draft.bridge_layer != self.header["bridge_layer"]:
            raise InvalidRequest(f"{self.path}: the store holds feature layers {self.feature_layers} (bridge "
                                 f"{self.header['bridge_layer']}); the draft reads {tuple(draft.feature_layers)} "
                                 f"(bridge {draft.bridge_layer})")
        if bridge_tokens and bridge_tokens not in self.bridge_budgets:
            raise InvalidRequest(f"{self.path}: bridge_tokens {bridge_tokens} is not among the stored budgets "
                                 f"{self.bridge_budgets}")

    def _tensor(self, record: dict, name: str) -> torch.Tensor:
        return _open(str(self.path / record["shard"])).get_tensor(f"{record['id']}.{name}")

    def signals(self, i: int, lm_head: torch.nn.Module, context: str = "text") -> TargetSignals:
        """Response i as the trainer's TargetSignals, on the lm_head's device and dtype; the
        target's logits are lm_head(final hidden), recomputed here. context "all": the prompt's
        entries with its visual tokens (a store built with `visual`)."""
        if context not in ("text", "all") or (context == "all" and not self.visual):
            raise InvalidRequest(f"{self.path}: a draft with context {context!r} cannot train on this store "
                                 f"(context all needs a store built with --visual; pruned trains online)")
        r = self.responses[i]
        c = self.contexts[r["context"]]
        w = lm_head.weight
        load = lambda rec, name: self._tensor(rec, name).to(w.device, w.dtype)   # noqa: E731
        final = load(r, "final_hidden")
        glimpse = load(c, "glimpse")
        with torch.no_grad():
            logits = lm_head(final).float()
        prompt = "all_" if context == "all" else ""
        return TargetSignals(
            token_ids=torch.cat([self._tensor(c, f"{prompt}token_ids"), self._tensor(r, "token_ids")]).to(w.device),
            features=torch.cat([load(c, f"{prompt}features"), load(r, "features")]),
            num_prompt=c["num_prompt"] + (c["num_visual"] if context == "all" else 0),
            logits=logits, final_hidden=final, bridge_text=glimpse[:0], bridge_visual=glimpse,
            num_visual=c["num_visual"] if context == "all" else 0,
            glimpses={b: glimpse[self._tensor(c, f"glimpse_idx.{b}").to(w.device)] for b in self.bridge_budgets})

    def length_weights(self, balance: float) -> np.ndarray:
        """(n,) sampling probabilities of the responses: a video-length bucket (an octave of
        visual tokens) holding c responses weighs c ** -balance each (0: uniform over responses,
        1: every bucket equally often)."""
        bucket = np.array([int(np.log2(max(1, self.contexts[r["context"]]["visual_tokens"]))) for r in self.responses])
        counts = {b: int((bucket == b).sum()) for b in set(bucket.tolist())}
        w = np.array([counts[b] ** -balance for b in bucket.tolist()], dtype=np.float64)
        return w / w.sum()

    def summary(self) -> dict:
        """Counts by kind and by video length (for logs and model cards)."""
        kinds: dict[str, int] = {}
        lengths: dict[int, int] = {}
        for r in self.responses:
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
            n = self.contexts[r["context"]]["visual_tokens"]
            lengths[n] = lengths.get(n, 0) + 1
        wrong = sum(r["correct"] is False for r in self.responses)
        return {"responses": len(self), "contexts": len(self.contexts), "by_kind": kinds,
                "by_visual_tokens": dict(sorted(lengths.items())), "wrong": wrong}
