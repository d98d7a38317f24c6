"""`train-draft`: distillation of a Sparrow draft from a frozen target.

    for each optimizer step:
        for grad_accum samples (deterministic order under the seed):
            from a feature store (feature_store.py): signals = the stored response i, or online:
            video -> processed (sparrow.video, as serving does)
            response = the target's own greedy generation (engine, memoised per sample)
            signals  = one teacher-forced target forward (features, logits, bridge states)
            unrolled = the draft over every chain, `unroll` steps (training-time test)
            loss     = distillation loss; backward
        clip, AdamW step, LR schedule
    periodically: log, held-out tau with the engine, checkpoint (resumable)

Bad samples (unreadable video, empty prompt, too long) are skipped and counted, never fatal.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.errors import InvalidRequest, SparrowError
from sparrow.models.draft import GEOMETRY_KEYS, DraftConfig, SparrowDraft
from sparrow.models.target import TargetModel
from sparrow.video import VideoOptions

from .config import TrainConfig
from .data import Sample
from .evaluate import held_out_tau
from .feature_store import FeatureStore
from .loss import chain_starts, distill_loss
from .signals import TargetSignals, target_signals
from .unroll import context_attention, unroll

STATE_NAME = "trainer_state.pt"


def draft_config(target: TargetModel, cfg: TrainConfig) -> DraftConfig:
    """The architecture `cfg` trains for `target`."""
    dcfg = DraftConfig.for_target(target, cfg.draft_layers, cfg.feature_layers)
    if cfg.draft_intermediate is not None:
        dcfg = replace(dcfg, intermediate_size=cfg.draft_intermediate)
    return dcfg


def new_draft(target: TargetModel, cfg: TrainConfig) -> SparrowDraft:
    """A fresh draft for `target`, initialised from cfg.seed (the global RNG is left alone)."""
    dcfg = draft_config(target, cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        draft = SparrowDraft(dcfg)
    return draft.to(target.device, target.hf.dtype).bind(target)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine down to 10% of the peak."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass(slots=True)
class StepStats:
    step: int
    loss: float
    top1: list[float]           # per unroll step: draft argmax == target argmax
    lr: float
    seconds: float


class DraftTrainer:
    """samples: (video, prompt) samples, distilled online, or a FeatureStore built for this
    target (its responses, read back)."""

    def __init__(self, target: TargetModel, draft: SparrowDraft, samples: list[Sample] | FeatureStore,
                 cfg: TrainConfig, heldout: list[Sample] | None = None, out_dir: str | Path | None = None,
                 log: Callable[[str], None] | None = None):
        if not len(samples):
            raise InvalidRequest("no training samples")
        if isinstance(samples, FeatureStore):
            samples = samples.only(cfg.store_responses)
        self.store = samples if isinstance(samples, FeatureStore) else None
        if self.store is not None:
            if cfg.context != "text" and not (cfg.context == "all" and self.store.visual):
                raise InvalidRequest(f"this feature store holds a 'text' draft's inputs; context {cfg.context!r} "
                                     f"reads the visual entries: build the store with --visual (context all), "
                                     f"or train it online")
            self.store.check(target, draft.config, cfg.bridge_tokens)
        target.hf.requires_grad_(False)
        self.target, self.draft, self.samples, self.cfg = target, draft.train(), samples, cfg
        spec = cfg.spec()             # what the draft is trained for travels with its checkpoint
        draft.trained_with = {key: getattr(spec, key) for key in GEOMETRY_KEYS}
        self.heldout = list(heldout or [])
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.options = VideoOptions(fps=cfg.fps, num_frames=cfg.num_frames)
        self.plain = Engine(target, spec=SpecConfig(method="none"))
        self.optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg))
        self.step = 0               # optimizer steps done
        self.seen = 0               # samples drawn (the data cursor)
        self.bad: dict[int, str] = {}          # sample index -> why it was skipped
        self._responses: dict[int, list[int]] = {}
        self.history: list[dict] = []

    # ----- construction ---------------------------------------------------------------------------
    @classmethod
    def fresh(cls, target: TargetModel, samples: list[Sample] | FeatureStore, cfg: TrainConfig,
              **kw) -> "DraftTrainer":
        if isinstance(samples, FeatureStore) and cfg.feature_layers is None:
            cfg = replace(cfg, feature_layers=samples.feature_layers)       # what the store holds
        return cls(target, new_draft(target, cfg), samples, cfg, **kw)

    @classmethod
    def from_draft(cls, target: TargetModel, path: str | Path, samples: list[Sample] | FeatureStore,
                   cfg: TrainConfig, **kw) -> "DraftTrainer":
        """Start from a saved draft's weights (a fine-tune), with a new optimizer and schedule;
        its architecture must be what `cfg` trains (feature layers, width, layers)."""
        if isinstance(samples, FeatureStore) and cfg.feature_layers is None:
            cfg = replace(cfg, feature_layers=samples.feature_layers)       # what the store holds
        draft = SparrowDraft.from_pretrained(path, target)
        want, got = draft_config(target, cfg), draft.config
        if (got.feature_layers, got.intermediate_size, got.num_layers) != (want.feature_layers, want.intermediate_size,
                                                                             want.num_layers):
            raise InvalidRequest(f"the draft at {path} is not what this config trains (feature layers, width, "
                                 f"layers): {got.feature_layers}/{got.intermediate_size}/{got.num_layers} vs "
                                 f"{want.feature_layers}/{want.intermediate_size}/{want.num_layers}")
        return cls(target, draft, samples, cfg, **kw)

    @classmethod
    def resume(cls, target: TargetModel, checkpoint: str | Path, samples: list[Sample] | FeatureStore,
               cfg: TrainConfig, **kw) -> "DraftTrainer":
        """Continue from a checkpoint written by `save`: weights, optimizer, schedule, data cursor."""
        checkpoint = Path(checkpoint)
        state = torch.load(checkpoint / STATE_NAME, weights_only=False)
        trainer = cls(target, SparrowDraft.from_pretrained(checkpoint, target), samples, cfg, **kw)
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
        trainer.step, trainer.seen, trainer.bad = state["step"], state["seen"], state["bad"]
        return trainer

    def save(self, path: str | Path) -> None:
        """Draft in save_pretrained form + trainer state; written aside, then swapped in."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.draft.save_pretrained(tmp)
        torch.save({"step": self.step, "seen": self.seen, "bad": self.bad, "config": asdict(self.cfg),
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   tmp / STATE_NAME)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)

    # ----- data -------------------------------------------------------------------------------------
    def _next_index(self) -> int:
        """Epoch e visits the samples in a permutation fixed by (seed, e): resumable from `seen`.
        With a store and length_balance > 0 an epoch is n draws weighted by video length instead."""
        n = len(self.samples)
        epoch, i = divmod(self.seen, n)
        self.seen += 1
        rng = np.random.default_rng([self.cfg.seed, epoch])
        if self.store is not None and self.cfg.length_balance > 0:
            return int(rng.choice(n, size=n, p=self.store.length_weights(self.cfg.length_balance))[i])
        return int(rng.permutation(n)[i])

    def _response(self, i: int, video) -> list[int]:
        if i not in self._responses:
            s, tok = self.samples[i], self.target.tokenizer
            if self.cfg.responses == "answer" and s.answer is not None:
                eos = tok.eos_token_id if tok.eos_token_id is not None else min(self.target.eos_token_ids)
                ids = tok(s.answer, add_special_tokens=False)["input_ids"] + [eos]
            else:       # self-distillation: the target's own greedy answer
                ids = self.plain.generate(video, s.prompt, SamplingParams(max_new_tokens=self.cfg.max_new_tokens),
                                          self.options).token_ids
            self._responses[i] = ids
        return self._responses[i]

    def signals(self, i: int) -> TargetSignals | None:
        """The target's signals for sample i, or None if the sample is unusable (counted)."""
        if i in self.bad:
            return None
        if self.store is not None:
            return self.store.signals(i, self.target.lm_head(), self.cfg.context)
        s, dc = self.samples[i], self.draft.config
        try:
            video = self.plain.process_video(s.video, self.options)
            response = self._response(i, video)
            if len(response) < 2:
                raise InvalidRequest("response shorter than two tokens: nothing to draft")
            return target_signals(self.target, video, s.prompt, response, dc.feature_layers, dc.bridge_layer,
                                  self.cfg.context, self.cfg.prune_keep)
        except (SparrowError, OSError) as exc:
            self.bad[i] = f"{type(exc).__name__}: {exc}"
            self.log(f"skipping sample {i} ({self.bad[i][:120]}); {len(self.bad)} skipped so far")
            return None

    # ----- one optimizer step --------------------------------------------------------------------
    def sample_loss(self, sig: TargetSignals, bridge: bool = True) -> tuple[torch.Tensor, dict]:
        cfg, device = self.cfg, sig.token_ids.device
        pinned, window = context_attention(cfg.context, sig.num_entries, sig.num_prompt, cfg.anchors, cfg.window,
                                           device)
        with self._autocast():
            out = unroll(self.draft, sig.token_ids, sig.features, pinned, sig.prefix(cfg.bridge_tokens if bridge else 0),
                         chain_starts(sig), cfg.unroll, window)
            return distill_loss(out, sig, cfg.ce_weight, cfg.hidden_weight, cfg.step_decay, cfg.topk)

    def train_step(self) -> StepStats:
        t0, cfg = time.perf_counter(), self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        losses, top1, used, drawn = [], [], 0, 0
        while used < cfg.grad_accum:
            if drawn >= len(self.samples) and not used:
                raise InvalidRequest(f"no usable training sample in a full pass ({len(self.bad)} bad)")
            # bridging or not is fixed by (seed, data cursor), so a resumed run draws the same
            bridge = np.random.default_rng([self.cfg.seed, self.seen, 1]).random() >= self.cfg.bridge_dropout
            sig = self.signals(self._next_index())
            drawn += 1
            if sig is None:
                continue
            loss, stats = self.sample_loss(sig, bridge)
            (loss / cfg.grad_accum).backward()
            losses.append(float(loss.detach()))
            top1.append(stats["top1"])
            used += 1
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.draft.parameters(), cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        steps = max(len(t) for t in top1)
        mean_top1 = [float(np.mean([t[j] for t in top1 if j < len(t)])) for j in range(steps)]
        return StepStats(self.step, float(np.mean(losses)), mean_top1, lr, time.perf_counter() - t0)

    def _autocast(self):
        # bf16 autocast where the hardware has it (CUDA); CPU trains in the target's dtype.
        if self.target.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ----- the loop ------------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        samples = self.heldout[: self.cfg.eval_samples]
        report = held_out_tau(self.target, self.draft, samples, self.cfg.spec(), self.cfg.max_new_tokens,
                              self.options)
        return report.to_dict()

    def fit(self) -> dict:
        cfg, t_start = self.cfg, time.perf_counter()
        last: StepStats | None = None
        log_file = self.out_dir / "train_log.jsonl" if self.out_dir is not None else None
        if self.step == 0 and log_file is not None and log_file.exists():
            log_file.unlink()                  # a fresh run starts its own log; a resumed one appends
        while self.step < cfg.steps:
            last = self.train_step()
            record = {"step": last.step, "loss": last.loss, "top1": last.top1, "lr": last.lr,
                      "skipped": len(self.bad)}
            if last.step % cfg.log_every == 0 or last.step == cfg.steps:
                self._log_progress(last)
            if self.heldout and cfg.eval_every and (last.step % cfg.eval_every == 0 or last.step == cfg.steps):
                record["heldout"] = held = self.evaluate()
                if held["tau"] is None:
                    self.log(f"  held-out tau not measured: no verify step ({held['samples']} samples ran, "
                             f"{held['skipped']} skipped)")
                else:
                    self.log(f"  held-out tau {held['tau']:.3f} (accepted/step {held['accepted_per_step']:.3f}, "
                             f"{held['samples']} samples, k={cfg.eval_draft_tokens})")
            self._record(record)
            if self.out_dir is not None and cfg.save_every and last.step % cfg.save_every == 0:
                self.save(self.out_dir / "checkpoint")
        if self.out_dir is not None:
            self.save(self.out_dir / "checkpoint")
            self.draft.save_pretrained(self.out_dir)
        return {"steps": self.step, "seconds": time.perf_counter() - t_start, "skipped": len(self.bad),
                "final_loss": last.loss if last else None,
                "heldout": self.history[-1].get("heldout") if self.history else None}

    def _log_progress(self, s: StepStats) -> None:
        done = s.step / self.cfg.steps
        bar = "#" * int(20 * done) + "-" * (20 - int(20 * done))
        top1 = "/".join(f"{t:.2f}" for t in s.top1)
        self.log(f"[{bar}] step {s.step}/{self.cfg.steps} loss {s.loss:.4f} top1 {top1} "
                 f"lr {s.lr:.2e} {s.seconds:.2f}s/step skipped {len(self.bad)}")

    def _record(self, record: dict) -> None:
        self.history.append(record)
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "train_log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
