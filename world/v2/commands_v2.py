"""World v2's training and evaluation commands, registered under `sparrow world`:

    sparrow world train-target-v2 --out DIR [--stage short|narrate|long] [--init DIR]   resumable
    sparrow world eval-v2 --target DIR [--split test] [--scenes N] [--seconds 8,30]      held-out scores
    sparrow world distill-v2 --student DIR --store STORE --out DIR                       a VLM on a store's answers

A stage checkpoints into OUT/checkpoint every --save-every steps and the same command resumes
from there (deterministic under --seed: the resumed steps are the unbroken run's); --max-minutes
(or --stop-at STEP, or a SIGTERM or Ctrl-C: after the step under way) stops it at a checkpoint.
When the stage's steps are done the target is saved to OUT with its
held-out scores (eval-v2 on --final-eval-scenes test scenes) in OUT/world_target_v2.json and the
checkpoint is removed, so the next stage (`--stage narrate --init OUT --out OUT`) starts from
OUT; each run's span is appended to OUT/train_runs.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def train_target_v2(c, out: str | Path, stage: str, init: str | Path | None = None, restart: bool = False,
                    max_minutes: float | None = None, final_eval_scenes: int = 5,
                    log=None, stop_at: int | None = None) -> dict:
    """Run (or resume) one stage into `out`; returns the run's summary (and the report when done)."""
    from sparrow.models.target import TargetModel
    from sparrow.world.target_model import lm_parameters
    from sparrow.world.target_train import resume_target, train_world_target
    from sparrow.world.v2.eval_v2 import evaluate_v2
    from sparrow.world.v2.target_v2 import SHORT_KINDS, V2Data, new_v2_target

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    out = Path(out)
    checkpoint = out / "checkpoint"
    if restart:
        shutil.rmtree(checkpoint, ignore_errors=True)
    runs_file = out / "train_runs.jsonl"
    last = json.loads(runs_file.read_text().splitlines()[-1]) if runs_file.is_file() and runs_file.read_text() else None
    if checkpoint.is_dir() and last is not None and last["stage"] != stage:
        raise ValueError(f"{checkpoint} is stage {last['stage']!r}'s, not {stage!r}'s: finish that stage, or "
                         "--restart, or another --out")
    target = resume_target(checkpoint)
    if target is None:
        target = TargetModel.from_pretrained(init) if init is not None else new_v2_target(c)
    data = V2Data(c, cache=out / "data" / f"pool-{stage}-seed{c.seed}-{c.side}px-{c.pool}.pt")
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.perf_counter()
    deadline = time.time() + 60 * max_minutes if max_minutes is not None else None
    target, history = train_world_target(c, log=log, target=target, data=data, checkpoint=checkpoint, deadline=deadline,
                                         stop_at=stop_at)
    steps = [h["step"] for h in history if "loss" in h]
    stopped = history[-1].get("stopped") if history else None
    run = {"stage": stage, "started": started, "seconds": time.perf_counter() - t0, "load": _load(),
           "last_step": stopped or (steps[-1] if steps else 0), "stopped": stopped is not None}
    out.mkdir(parents=True, exist_ok=True)
    with open(runs_file, "a") as f:
        f.write(json.dumps(run) + "\n")
    if stopped:
        log(f"stopped at step {stopped}: run the same command to resume from {checkpoint}")
        return run
    target.save_pretrained(out)
    shutil.rmtree(checkpoint, ignore_errors=True)     # done: the next stage starts from OUT (--init)
    report = (evaluate_v2(out, "test", final_eval_scenes, (8, 30), c.side, (*SHORT_KINDS, "narrate", "story"), log=log)
              if final_eval_scenes > 0 else None)              # 0: no final scores (a probe scores itself)
    runs = [json.loads(line) for line in runs_file.read_text().splitlines()]
    summary = {"stage": stage, "config": asdict(c), "init": None if init is None else str(init),
               "train_seconds": sum(r["seconds"] for r in runs if r["stage"] == stage),
               "final_loss": [h for h in history if "loss" in h][-1]["loss"], "lm_parameters": lm_parameters(target),
               "heldout": report, "heldout_during_training": [h for h in history if "heldout" in h]}
    (out / "world_target_v2.json").write_text(json.dumps(summary, indent=2))
    return {**run, "report": summary}


def _cmd_train_target_v2(args: argparse.Namespace) -> int:
    from sparrow.world.v2.target_v2 import STAGES_V2, V2TargetConfig

    torch.set_num_threads(args.threads)
    c = args.config_from_args(V2TargetConfig, args, **STAGES_V2[args.stage])
    result = train_target_v2(c, args.out, args.stage, args.init, args.restart, args.max_minutes, args.final_eval_scenes,
                             stop_at=args.stop_at)
    print(json.dumps({k: v for k, v in result.items() if k != "report"}, indent=2))
    return 0


def _cmd_eval_v2(args: argparse.Namespace) -> int:
    from sparrow.world.v2.eval_v2 import card_section, evaluate_v2, write_card_section

    torch.set_num_threads(args.threads)
    kinds = tuple(args.kinds.split(",")) if args.kinds else None
    report = evaluate_v2(args.target, args.split, args.scenes, args.seconds, args.side,
                         **({"kinds": kinds} if kinds else {}), first=args.first,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    if args.card:
        command = "sparrow world eval-v2 " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "sparrow world eval-v2"
        write_card_section(args.card, card_section(report, command))
    print(text)
    return 0


def _cmd_distill_v2(args: argparse.Namespace) -> int:
    from sparrow.world.v2.distill_v2 import DistillConfig, distill_v2

    torch.set_num_threads(args.threads)
    c = DistillConfig(steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup, seed=args.seed,
                      draw=args.draw)
    summary = distill_v2(args.student, args.store, args.out, c, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(summary, indent=2))
    return 0


def add_v2_commands(wsub, parents: list, add_config_options, config_from_args) -> None:
    """Register train-target-v2, eval-v2 and distill-v2 on the `world` subparsers; the two helpers are the
    command line's (training.commands): a dataclass's options, and the dataclass from them."""
    from sparrow.world.v2.target_v2 import STAGES_V2, V2_TARGET_HELP, V2_UNUSED, V2TargetConfig

    p = wsub.add_parser("train-target-v2", parents=parents,
                        help="train the world v2 target from nothing, one resumable stage a run (docs/world-v2.md)")
    p.add_argument("--out", required=True, help="where the stage's target, checkpoint, pool cache and logs go")
    p.add_argument("--stage", choices=tuple(STAGES_V2), default="short", help="the stage's preset (default short)")
    p.add_argument("--init", help="the previous stage's target to start from (default: a fresh target)")
    p.add_argument("--restart", action="store_true", help="start afresh even if OUT holds a checkpoint")
    p.add_argument("--max-minutes", type=float, help="stop at a checkpoint after this long (resume with the same command)")
    p.add_argument("--stop-at", type=int, help="stop at a checkpoint after this many of the stage's steps")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--final-eval-scenes", type=int, default=5, help="test scenes (at 8 s and 30 s) for the final scores (0: none)")
    add_config_options(p, V2TargetConfig, V2_TARGET_HELP, skip=V2_UNUSED)
    p.set_defaults(func=_cmd_train_target_v2, config_from_args=config_from_args)

    p = wsub.add_parser("eval-v2", parents=parents, help="a v2 target's held-out scores per question kind and length")
    p.add_argument("--target", required=True, help="the v2 target")
    p.add_argument("--split", default="test", help="whose seeds: test or benchmark (default test)")
    p.add_argument("--scenes", type=int, default=5, help="scenes, each at every --seconds length (default 5)")
    p.add_argument("--first", type=int, default=0, help="index of the first seed within the split")
    p.add_argument("--seconds", type=_ints, default=(8, 30), help="video lengths in seconds (default 8,30)")
    p.add_argument("--side", type=int, default=112, help="frame side in px (default 112, the short stage's)")
    p.add_argument("--kinds", help="question kinds, comma-separated (default all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", help="write the report here too")
    p.add_argument("--card", help="write the scores into this model card (between its eval-v2 markers)")
    p.set_defaults(func=_cmd_eval_v2)

    p = wsub.add_parser("distill-v2", parents=parents,
                        help="train a v2 VLM (the SpecVLM-style small one) on a feature store's answers, as the drafts are")
    p.add_argument("--student", required=True, help="the v2 VLM to start from (save_pretrained folder)")
    p.add_argument("--store", required=True, help="a feature store (sparrow build-features): its videos, prompts and answers")
    p.add_argument("--out", required=True, help="where the trained VLM goes")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps (default 800, the drafts' budget)")
    p.add_argument("--batch", type=int, default=4, help="answers a step (default 4)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--warmup", type=int, default=40, help="warmup steps (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the answers' order (default 0)")
    p.add_argument("--draw", choices=("answers", "lengths"), default="answers",
                   help="answers: each uniformly, as train-draft draws a store's (default); lengths: a video "
                        "length uniformly, then its answers (the recipe before 2026-12-01)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.set_defaults(func=_cmd_distill_v2)
