"""`sparrow world train-target`'s loop and command: train a world target (world/target_model.py)
in stages on the data of world/target_data.py, checkpoint it, and report its held-out
accuracy next to the weights (`world_target.json`).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from sparrow.models.target import TargetModel

from sparrow.world.scenes import WorldVideo
from sparrow.world.target_model import EVAL_SEED, WorldTargetConfig, lm_parameters, new_world_target, world_accuracy
from sparrow.world.target_data import Stage, WorldData, focus_step, stage_at, training_stages


def lr_factor(c: WorldTargetConfig, stages: list[Stage], step: int) -> float:
    """The learning rate at `step` over c.lr: each stage warms up, then decays (cosine) to 5%."""
    st = stage_at(stages, step)
    s = step - st.start
    return st.lr / c.lr * min(1.0, (s + 1) / st.warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / st.steps))))


def train_world_target(c: WorldTargetConfig, log: Callable[[str], None] | None = None,
                       target: TargetModel | None = None, out: str | Path | None = None,
                       data: WorldData | None = None, checkpoint: str | Path | None = None,
                       deadline: float | None = None, stop_at: int | None = None) -> tuple[TargetModel, list[dict]]:
    """Deterministic under c.seed: the videos of step i come from seeds derived from (c.seed, i).
    `data`: what to train on (default: the world, WorldData(c)).
    `checkpoint`: a folder for the resumable state (the weights, the optimizer and schedule, the
    step, the log), written every c.save_every steps; a run given one that holds a state goes on
    from its step (`target` must then be the checkpoint's weights: `resume_target`), and the
    steps after it are the ones an unbroken run takes. `deadline` (time.time()): past it the run
    writes the checkpoint and stops early, its history ending with {"stopped": step}; so does
    `stop_at` (a step count) when it comes before the end, and so does a SIGTERM or SIGINT
    (Ctrl-C) in the main thread: the step under way ends, then the checkpoint and the stop (a
    second signal acts as it would have: a run of many hours is not killed mid-step by accident,
    nor kept from ending)."""
    with stop_signals() as stop:
        return _train(c, log, target, out, data, checkpoint, deadline, stop_at, stop)


@contextmanager
def stop_signals() -> Iterator[threading.Event]:
    """An event set by the first SIGTERM or SIGINT while inside (the previous handlers are back
    after it, and after the block); in a thread other than the main one, an event nothing sets."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    # a signal the process ignores stays ignored (SIGINT in a shell's background job, nohup)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)
                if signal.getsignal(sig) is not signal.SIG_IGN}

    def asked(signum, frame):
        stop.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    for sig in previous:
        signal.signal(sig, asked)
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _train(c: WorldTargetConfig, log: Callable[[str], None] | None, target: TargetModel | None, out: str | Path | None,
           data: WorldData | None, checkpoint: str | Path | None, deadline: float | None, stop_at: int | None,
           stop: threading.Event) -> tuple[TargetModel, list[dict]]:
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    data = data if data is not None else WorldData(c)
    target = target or new_world_target(c)
    hf = target.hf.train()
    # Trained jointly from scratch, the vision tower collapses: before the LM can read it, the
    # cheapest way to lower the loss is to make every visual token the same large vector (an
    # attention sink), and the video is ignored for good. The tower stays as initialised.
    vision = list(hf.model.visual.parameters())
    vision_ids = {id(p) for p in vision}
    groups = [{"params": [p for p in hf.parameters() if id(p) not in vision_ids], "lr": c.lr}]
    if c.vision_lr_scale > 0:
        if c.pool:
            raise ValueError("a video pool needs a frozen vision tower (vision_lr_scale 0)")
        groups.append({"params": vision, "lr": c.lr * c.vision_lr_scale})
    else:
        hf.model.visual.requires_grad_(False)
    stages = training_stages(c, data.kinds)
    data.prepare(target, stages, log)
    opt = torch.optim.AdamW(groups, lr=c.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(c, stages, s))
    total = sum(s.steps for s in stages)
    history, t0, run = [], time.perf_counter(), 0.0
    first = 0
    if checkpoint is not None and Path(checkpoint, STATE_FILE).is_file():
        state = torch.load(Path(checkpoint, STATE_FILE), weights_only=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        first, run, history = state["step"], state["run"], state["history"]
        log(f"resumed at step {first}/{total} from {checkpoint}")
    for step in range(first, total):
        rng = random.Random(c.seed * 1_000_003 + step)
        stage = stage_at(stages, step)
        focus = focus_step(stage, rng)
        loss = data.loss(target, stage, step, focus, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        opt.step()
        sched.step()
        run = float(loss.detach()) if step == 0 else 0.98 * run + 0.02 * float(loss.detach())
        if (step + 1) % c.log_every == 0 or step + 1 == total:
            history.append({"step": step + 1, "loss": run, "seconds": time.perf_counter() - t0})
            log(f"step {step + 1}/{total} loss {run:.4f} lr {sched.get_last_lr()[0]:.2e} "
                f"{time.perf_counter() - t0:.0f}s")
        if c.eval_every and (step + 1) % c.eval_every == 0:
            hf.eval()
            acc = data.heldout(target)
            hf.train()
            history.append({"step": step + 1, "heldout": acc})
            kinds_acc = " ".join(f"{k} {v:.2f}" for k, v in acc["per_kind"].items())
            log(f"  held-out accuracy {acc['accuracy']:.3f} ({kinds_acc})")
        if out is not None and c.save_every and (step + 1) % c.save_every == 0:
            target.save_pretrained(out)
        late = step + 1 < total and (deadline is not None and time.time() > deadline
                                     or stop_at is not None and step + 1 >= stop_at or stop.is_set())
        if checkpoint is not None and (late or c.save_every and (step + 1) % c.save_every == 0):
            save_checkpoint(checkpoint, target, opt, sched, step + 1, run, history)
        if late:
            history.append({"stopped": step + 1})
            log(f"stopped at step {step + 1}/{total}; the checkpoint resumes there")
            break
    hf.eval()
    return target, history


STATE_FILE = "train_state.pt"


def save_checkpoint(folder: str | Path, target: TargetModel, opt, sched, step: int, run: float, history: list[dict]) -> None:
    """The resumable state after `step` steps: the weights (save_pretrained) and STATE_FILE,
    written beside `folder` and swapped in whole, so a run stopped while saving leaves the
    previous checkpoint."""
    folder = Path(folder)
    fresh, old = folder.with_name(folder.name + ".new"), folder.with_name(folder.name + ".old")
    shutil.rmtree(fresh, ignore_errors=True)
    target.save_pretrained(fresh)
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step, "run": run,
                "history": history}, fresh / STATE_FILE)
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    fresh.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def resume_target(checkpoint: str | Path) -> TargetModel | None:
    """The weights to go on from when `checkpoint` holds a resumable state, else None."""
    return TargetModel.from_pretrained(checkpoint) if Path(checkpoint, STATE_FILE).is_file() else None


def train_world_target_cli(c: WorldTargetConfig, out: str | Path, eval_videos: int = 40,
                           init: str | Path | None = None) -> dict:
    """Train (from scratch, or on from the target in `init`), save to `out` (save_pretrained
    form), measure held-out accuracy on fresh short videos (seeds disjoint from training's),
    write the report next to the weights; a report found in `init` is kept in it as `before`."""
    if not c.steps and not c.stages:
        raise ValueError("nothing to train: steps is 0 and there are no stages")
    before = None
    target = None
    if init is not None:
        target = TargetModel.from_pretrained(init)
        found = Path(init, "world_target.json")
        before = json.loads(found.read_text()) if found.is_file() else None
    t0 = time.perf_counter()
    target, history = train_world_target(c, target=target, out=out)
    seconds = time.perf_counter() - t0
    target.save_pretrained(out)
    accuracy = world_accuracy(target, WorldVideo(), list(range(EVAL_SEED, EVAL_SEED + eval_videos)))
    report = {"config": asdict(c), "init": None if init is None else str(init), "train_seconds": seconds,
              "final_loss": [h for h in history if "loss" in h][-1]["loss"],
              "lm_parameters": lm_parameters(target), "accuracy": accuracy,
              "heldout_during_training": [h for h in history if "heldout" in h]}
    if before is not None:
        report["before"] = before
    Path(out, "world_target.json").write_text(json.dumps(report, indent=2))
    return report
