"""Command-line entry points, registered on the `sparrow` parser by sparrow.cli.main:

    sparrow train-draft --target DIR --data MANIFEST|FOLDER|STORE --out DIR [--store DIR] [--heldout ...]
    sparrow build-features --target DIR --data MANIFEST|FOLDER --out STORE     the target's signals, once
    sparrow world make-data    --out DIR [--videos N]          synthetic videos + JSONL manifest
    sparrow world make-data-v2 --out DIR [--split S]           world v2 (several objects, narrations)
    sparrow world train-target-v2 --out DIR [--stage S]        world v2's target, resumable stages
    sparrow world eval-v2 --target DIR                         its held-out scores per kind and length
    sparrow world train-target --out DIR [--steps N]           tiny Qwen2.5-VL from scratch
    sparrow world tune-target  --target DIR --out DIR          its later stages (presence, direction)
    sparrow world train-live-target --out DIR                  a target for live streams (real time, "now")
    sparrow world train-draft  --target DIR --out DIR          the train-draft path on world data
    sparrow world eval         --target DIR [--draft DIR]      accuracy by video length, held-out tau
    sparrow world compare-drafts --target DIR --drafts A=DIR,B=DIR   tau side by side on the same videos
    sparrow world demo         [--seed N]                      the committed pair on a fresh video

Every TrainConfig / WorldTargetConfig field is an option of the same name (dashes for
underscores), so the commands and the dataclasses cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, fields
from pathlib import Path


def _parse_type(annotation: str):
    if annotation.startswith("tuple"):
        item = int if annotation.startswith("tuple[int") else str
        return lambda s: tuple(item(x.strip()) for x in s.split(",") if x.strip())
    base = annotation.split("|")[0].strip()
    return {"int": int, "float": float, "str": str, "bool": lambda s: s.lower() in ("1", "true", "yes")}[base]


def _add_config_options(parser: argparse.ArgumentParser, cls, helps: dict[str, str], skip: tuple[str, ...] = (),
                        preset: dict | None = None, prefix: str = "") -> None:
    """One option per field, its help from `helps` (every field must have one); `preset`: the
    command's own defaults over the dataclass's; `prefix`: before each option's name (a
    second dataclass on one command)."""
    preset = preset or {}
    where = "the command's preset, else the dataclass" if preset else "the dataclass"
    group = parser.add_argument_group(f"{cls.__name__} (defaults as in {where})")
    for f in fields(cls):
        if f.name in skip:
            continue
        default = preset.get(f.name, f.default if f.default is not MISSING else None)
        name = prefix + f.name
        group.add_argument("--" + name.replace("_", "-"), dest=f"cfg_{name}", type=_parse_type(str(f.type)),
                           default=None, metavar=f.name.upper(), help=f"{helps[f.name]} (default {default})")


def _config(cls, args: argparse.Namespace, prefix: str = "", **overrides):
    given = {f.name: getattr(args, f"cfg_{prefix}{f.name}") for f in fields(cls)
             if getattr(args, f"cfg_{prefix}{f.name}", None) is not None}
    return cls(**{**overrides, **given})


# ----- train-draft ---------------------------------------------------------------------------------
def train_draft(target_dir: str | Path, data: str | Path, out: str | Path, cfg, heldout: str | Path | None = None,
                resume: str | Path | None = None, log=None, dtype: str = "float32", device: str = "cpu",
                store: str | Path | None = None, store_cfg=None, restart: bool = False,
                init: str | Path | None = None) -> dict:
    """Load the target (in `dtype` on `device`), read the samples, train (or resume), save the
    draft to `out`. data: samples (distilled online), or a feature store; with `store`, the
    samples' features are built there first (an unfinished build goes on where it stopped) and
    training reads them. A run whose `out` holds a checkpoint resumes from it unless `restart`.
    init: a draft (save_pretrained form) to start from instead of fresh weights (a fine-tune:
    its weights, a new optimizer and schedule)."""
    from sparrow.training.data import load_samples
    from sparrow.training.feature_store import FeatureStore, StoreConfig, build_store
    from sparrow.training.trainer import STATE_NAME, DraftTrainer
    from sparrow.models.target import TargetModel

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    target = TargetModel.from_pretrained(target_dir, dtype=dtype, device=device)
    if FeatureStore.is_store(data):
        samples = FeatureStore(data)
    elif store is not None:
        build_store(target, load_samples(data), store, store_cfg or StoreConfig(), log)
        samples = FeatureStore(store)
    else:
        samples = load_samples(data)
    if isinstance(samples, FeatureStore):
        log(f"feature store {samples.path}: {json.dumps(samples.summary())}")
    held = load_samples(heldout) if heldout else []
    kw = dict(heldout=held, out_dir=out, log=log)
    if resume is None and not restart and (Path(out) / "checkpoint" / STATE_NAME).is_file():
        resume = Path(out) / "checkpoint"
    if resume:
        trainer = DraftTrainer.resume(target, resume, samples, cfg, **kw)
        log(f"resuming from {resume} at step {trainer.step}/{cfg.steps}")
    elif init:
        trainer = DraftTrainer.from_draft(target, init, samples, cfg, **kw)
        log(f"starting from the draft at {init}")
    else:
        trainer = DraftTrainer.fresh(target, samples, cfg, **kw)
    summary = trainer.fit()
    Path(out, "train_summary.json").write_text(json.dumps({**summary, "config": _jsonable(cfg)}, indent=2))
    return summary


def _jsonable(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


def _cmd_train_draft(args: argparse.Namespace) -> int:
    from sparrow.training.config import TrainConfig
    from sparrow.training.feature_store import StoreConfig

    summary = train_draft(args.target, args.data, args.out, _config(TrainConfig, args), args.heldout, args.resume,
                          dtype=args.dtype, device=args.device, store=args.store,
                          store_cfg=_config(StoreConfig, args, "store_", **_store_preset(args)), restart=args.restart,
                          init=args.init)
    print(json.dumps(summary, indent=2))
    return 0


def _store_preset(args: argparse.Namespace) -> dict:
    """A store built for a training run holds what the run reads: its feature layers, its
    bridging budget, answers as long as its responses and its video sampling."""
    preset = {}
    for name in ("feature_layers", "max_new_tokens", "fps", "num_frames"):
        if getattr(args, f"cfg_{name}", None) is not None:
            preset[name] = getattr(args, f"cfg_{name}")
    if getattr(args, "cfg_bridge_tokens", None):
        preset["bridge_budgets"] = (args.cfg_bridge_tokens,)
    return preset


def _cmd_build_features(args: argparse.Namespace) -> int:
    from sparrow.training.data import load_samples
    from sparrow.training.feature_store import FeatureStore, StoreConfig, build_store
    from sparrow.models.target import TargetModel

    target = TargetModel.from_pretrained(args.target, dtype=args.dtype, device=args.device)
    build_store(target, load_samples(args.data), args.out, _config(StoreConfig, args),
                log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(FeatureStore(args.out).summary(), indent=2))
    return 0


# ----- world -----------------------------------------------------------------------------------------
def _cmd_world_make_data(args: argparse.Namespace) -> int:
    from sparrow.world.draft_data import make_world_data, make_world_ladder

    if args.ladder:
        path = make_world_ladder(args.out, args.ladder, args.seed, args.questions_per_video)
    else:
        path = make_world_data(args.out, args.videos, args.frames, args.seed, args.questions_per_video)
    print(f"wrote {path}")
    return 0


def _cmd_world_train_target(args: argparse.Namespace) -> int:
    """train-target (from scratch) and tune-target (on from --target, with the TUNE preset)."""
    from sparrow.world.target_model import TUNE, WorldTargetConfig
    from sparrow.world.target_train import train_world_target_cli

    init = getattr(args, "target", None)
    c = _config(WorldTargetConfig, args, **(TUNE if init else {}))
    report = train_world_target_cli(c, args.out, eval_videos=args.final_eval_videos, init=init)
    print(json.dumps({k: v for k, v in report.items() if k != "before"}, indent=2))
    return 0 if report["accuracy"]["accuracy"] >= 0.9 else 1


def _cmd_world_train_live_target(args: argparse.Namespace) -> int:
    from sparrow.world.live_target import LiveTargetConfig, train_live_target_cli
    from sparrow.world.live_words import STANDING_KINDS

    c = _config(LiveTargetConfig, args)
    report = train_live_target_cli(c, args.out, eval_streams=args.final_eval_streams, eval_pairs=args.final_eval_pairs,
                                   init=args.target, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps({k: v for k, v in report.items() if k != "heldout_during_training"}, indent=2))
    per_kind = report["accuracy"]["per_kind"]
    return 0 if all(per_kind.get(k, 0.0) >= 0.9 for k in STANDING_KINDS if k in c.kinds) else 1


def _cmd_world_train_draft(args: argparse.Namespace) -> int:
    from sparrow.world.draft_data import world_draft_config, make_world_data

    cfg = _config(type(world_draft_config()), args, **_jsonable(world_draft_config(seed=args.seed)))
    data = args.data or make_world_data(Path(args.out) / "data" / "train", args.videos, (8,), args.seed,
                                        args.questions_per_video)
    held = make_world_data(Path(args.out) / "data" / "heldout", cfg.eval_samples, (8,), args.seed + 10**6, 0)
    summary = train_draft(args.target, data, args.out, cfg, held, args.resume, dtype=args.dtype, device=args.device,
                          init=args.init)
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_world_train_baselines(args: argparse.Namespace) -> int:
    """The benchmark's other drafts (EAGLE-style, ablations), each through `world train-draft`'s
    recipe with one change, and the SpecVLM-style small VLM through `world train-target`."""
    from sparrow.world.draft_data import VARIANT_DIRS, VARIANTS, make_world_data, world_draft_config
    from sparrow.world.target_model import SMALL_TARGET, WorldTargetConfig
    from sparrow.world.target_train import train_world_target_cli

    names = args.only or [*VARIANTS, "small-target"]
    for name in names:
        out = Path(args.out) / VARIANT_DIRS.get(name, name)
        if name == "small-target":
            report = train_world_target_cli(WorldTargetConfig(**SMALL_TARGET), out)
            print(f"{name}: accuracy {report['accuracy']['accuracy']:.3f}", flush=True)
            continue
        cfg = world_draft_config(seed=args.seed, **VARIANTS[name])
        data = make_world_data(out / "data" / "train", args.videos, (8,), args.seed, args.questions_per_video)
        held = make_world_data(out / "data" / "heldout", cfg.eval_samples, (8,), args.seed + 10**6, 0)
        summary = train_draft(args.target, data, out, cfg, held, dtype=args.dtype, device=args.device)
        print(f"{name}: {heldout_text(summary.get('heldout'))}", flush=True)
    return 0


def _cmd_world_eval(args: argparse.Namespace) -> int:
    from sparrow.world.draft_data import evaluate_world

    report = evaluate_world(args.target, args.draft, args.videos_at, args.videos, args.seed,
                            log=lambda line: print(line, file=sys.stderr, flush=True), dtype=args.dtype,
                            device=args.device, progress=sys.stderr)
    print(json.dumps(report, indent=2))
    return 0


def _cmd_world_compare_drafts(args: argparse.Namespace) -> int:
    from sparrow.world.compare_drafts import compare_drafts

    drafts = dict(part.split("=", 1) for part in args.drafts.split(","))
    report = compare_drafts(args.target, drafts, args.videos_at, args.videos, args.seed, args.temperatures, args.k,
                            log=lambda line: print(line, file=sys.stderr, flush=True), dtype=args.dtype,
                            device=args.device)
    print(json.dumps(report, indent=2))
    return 0


def _cmd_world_demo(args: argparse.Namespace) -> int:
    from sparrow.world.pair_demo import DEFAULT_MODELS, run_world_demo

    report = run_world_demo(args.seed, args.models or DEFAULT_MODELS, k=args.k,
                            print_fn=lambda *a, **kw: print(*a, **kw, flush=True), dtype=args.dtype,
                            device=args.device)
    return 0 if all(r["lossless"] for r in report["results"]) else 1


def heldout_text(heldout: dict | None) -> str:
    """The held-out tau as measured, or that none was (no held-out data, or no verify step)."""
    if not heldout or heldout.get("tau") is None:
        return "held-out tau not measured" + (f" ({heldout['samples']} samples, {heldout['skipped']} skipped)"
                                              if heldout else "")
    return f"held-out tau {heldout['tau']:.3f} ({heldout['samples']} samples)"


def _ladder(text: str) -> dict[tuple[int, int], int]:
    """SIDExFRAMES:N,... -> {(side, frames): N}"""
    out = {}
    for part in text.split(","):
        size, _, count = part.partition(":")
        out[_sizes(size)[0]] = int(count or 1)
    return out


def _cmd_world_make_data_v2(args: argparse.Namespace) -> int:
    from sparrow.world.v2.dataset_v2 import make_data_v2

    print(f"wrote {make_data_v2(args.out, args.split, args.videos, args.seconds, args.first, args.questions_per_video, args.side)}")
    return 0


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(x) for x in part.split("x")) for part in text.split(","))


TRAINING_COMMANDS = {"train-draft": "train a Sparrow draft for a target (online distillation)",
                     "build-features": "store the target's signals for draft training (a feature store)",
                     "world": "the synthetic video world: data, a trained target and draft"}


def add_commands(sub, common: argparse.ArgumentParser | None = None, options: bool = True) -> None:
    """Register `train-draft` and the `world` group on the `sparrow` subparsers; `common`: a
    parent parser of options every command takes (--verbose). options=False: the two names and
    their help only (for a command line running another command: their configs import torch)."""
    from sparrow.models.placement import add_placement_arguments
    from sparrow.progress import verbose_option

    if not options:
        for name, text in TRAINING_COMMANDS.items():
            sub.add_parser(name, help=text)
        return
    from sparrow.training.config import TRAIN_HELP, TrainConfig
    from sparrow.training.feature_store import STORE_HELP, StoreConfig
    from sparrow.world.live_target import LIVE_TARGET_HELP, LIVE_UNUSED, LiveTargetConfig
    from sparrow.world.target_model import TUNE, WORLD_TARGET_HELP, WorldTargetConfig

    parents = [common if common is not None else verbose_option()]
    p = sub.add_parser("train-draft", parents=parents, help=TRAINING_COMMANDS["train-draft"])
    p.add_argument("--target", required=True, help="target model directory (save_pretrained form)")
    p.add_argument("--data", required=True, help="JSONL manifest (one sample a line: video, prompt or messages, "
                                                 "optional answer), a folder of videos, or a feature store")
    p.add_argument("--store", help="build the data's feature store here first (or finish building it), then "
                                   "train on it")
    p.add_argument("--heldout", help="JSONL manifest or folder for the periodic held-out tau")
    p.add_argument("--out", required=True, help="where the draft, checkpoint and log go")
    p.add_argument("--resume", help="checkpoint directory to continue from (default: OUT/checkpoint if there)")
    p.add_argument("--restart", action="store_true", help="start afresh even if OUT holds a checkpoint")
    p.add_argument("--init", help="a draft directory to start from (fine-tune its weights; new optimizer)")
    _add_config_options(p, TrainConfig, TRAIN_HELP)
    _add_config_options(p, StoreConfig, STORE_HELP, skip=("feature_layers", "max_new_tokens", "fps", "num_frames",
                                                          "seed"), prefix="store_")
    add_placement_arguments(p)
    p.set_defaults(func=_cmd_train_draft)

    p = sub.add_parser("build-features", parents=parents, help=TRAINING_COMMANDS["build-features"])
    p.add_argument("--target", required=True, help="target model directory (save_pretrained form)")
    p.add_argument("--data", required=True, help="JSONL manifest or a folder of videos (as train-draft)")
    p.add_argument("--out", required=True, help="the store's folder (an unfinished build there goes on)")
    _add_config_options(p, StoreConfig, STORE_HELP)
    add_placement_arguments(p)
    p.set_defaults(func=_cmd_build_features)

    world = sub.add_parser("world", help=TRAINING_COMMANDS["world"])
    wsub = world.add_subparsers(dest="world_command", required=True)
    p = wsub.add_parser("make-data", parents=parents, help="synthetic videos + a JSONL manifest of questions and answers")
    p.add_argument("--out", required=True, help="folder for the videos and manifest.jsonl")
    p.add_argument("--videos", type=int, default=64, help="videos to render (default 64)")
    p.add_argument("--frames", type=lambda s: tuple(int(x) for x in s.split(",")), default=(8,),
                   help="video lengths in frames, comma-separated, drawn per video (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first video (the others follow)")
    p.add_argument("--questions-per-video", type=int, default=1, help="QA samples per video besides its caption")
    p.add_argument("--ladder", type=_ladder, help="videos by length instead of --videos/--frames: SIDExFRAMES:N,... "
                                                  "(168x1392 is 25,056 visual tokens)")
    p.set_defaults(func=_cmd_world_make_data)

    p = wsub.add_parser("make-data-v2", parents=parents, help="world v2 videos + a JSONL manifest (docs/world-v2.md)")
    p.add_argument("--out", required=True, help="folder for the videos, manifest.jsonl and scenes.jsonl")
    p.add_argument("--split", default="train", help="train, test or benchmark: whose seeds (default train)")
    p.add_argument("--videos", type=int, default=16, help="videos to render (default 16)")
    p.add_argument("--seconds", type=lambda s: tuple(int(x) for x in s.split(",")), default=(8, 30),
                   help="video lengths in seconds, comma-separated, in turn (default 8,30; 784 is 50k visual tokens)")
    p.add_argument("--first", type=int, default=0, help="index of the first seed within the split")
    p.add_argument("--questions-per-video", type=int, default=4, help="questions per video besides its narration")
    p.add_argument("--side", type=int, default=224, help="frame side in px, a multiple of 28 (default 224, the long "
                                                         "stage's; 112 is the short stage's, a quarter of the tokens)")
    p.set_defaults(func=_cmd_world_make_data_v2)
    from sparrow.world.v2.commands_v2 import add_v2_commands
    add_v2_commands(wsub, parents, _add_config_options, _config)

    p = wsub.add_parser("train-target", parents=parents, help="train a tiny Qwen2.5-VL target on the world from scratch")
    p.add_argument("--out", required=True, help="where the target goes (save_pretrained form)")
    p.add_argument("--final-eval-videos", type=int, default=40, help="fresh short videos for the final accuracy")
    _add_config_options(p, WorldTargetConfig, WORLD_TARGET_HELP)
    p.set_defaults(func=_cmd_world_train_target)

    p = wsub.add_parser("tune-target", parents=parents, help="the later training stages on top of a trained world target")
    p.add_argument("--target", required=True, help="a world target (train-target's output)")
    p.add_argument("--out", required=True, help="where the tuned target goes (may be --target itself)")
    p.add_argument("--final-eval-videos", type=int, default=40, help="fresh short videos for the final accuracy")
    _add_config_options(p, WorldTargetConfig, WORLD_TARGET_HELP, preset=TUNE)
    p.set_defaults(func=_cmd_world_train_target)

    p = wsub.add_parser("train-live-target", parents=parents,
                        help="train a tiny Qwen2.5-VL on the live world: real-time positions, questions about now")
    p.add_argument("--out", required=True, help="where the target goes (save_pretrained form, with live_target.json)")
    p.add_argument("--target", help="a live target to continue from (default: a fresh one)")
    p.add_argument("--final-eval-streams", type=int, default=40,
                   help="held-out streams for the final accuracy (one clip of each --final-eval-pairs length)")
    p.add_argument("--final-eval-pairs", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1, 4, 8, 16, 24, 32),
                   help="clip lengths in frame pairs (seconds) of the final accuracy, comma-separated "
                        "(default 1,4,8,16,24,32)")
    _add_config_options(p, LiveTargetConfig, LIVE_TARGET_HELP, skip=LIVE_UNUSED)
    p.set_defaults(func=_cmd_world_train_live_target)

    p = wsub.add_parser("train-draft", parents=parents, help="train the world draft through the train-draft path")
    p.add_argument("--target", required=True, help="the world target the draft is for")
    p.add_argument("--out", required=True, help="where the draft, its data, checkpoint and log go")
    p.add_argument("--data", help="a feature store (build-features) or manifest to train on instead of fresh videos")
    p.add_argument("--videos", type=int, default=192, help="training videos (each with a caption and questions)")
    p.add_argument("--questions-per-video", type=int, default=1, help="QA samples per video besides its caption")
    p.add_argument("--resume", help="checkpoint directory to continue from (OUT/checkpoint)")
    p.add_argument("--init", help="a draft directory to start from (fine-tune its weights; new optimizer)")
    p.add_argument("--seed", type=int, default=0, dest="seed", help="seed of the data and the draft's initialisation")
    _add_config_options(p, TrainConfig, TRAIN_HELP, skip=("seed",))
    add_placement_arguments(p)
    p.set_defaults(func=_cmd_world_train_draft)

    p = wsub.add_parser("train-baselines", parents=parents,
                        help="the benchmark's EAGLE-style and ablation drafts and the small VLM")
    p.add_argument("--target", required=True, help="the world target the drafts are for")
    p.add_argument("--out", required=True, help="e.g. models/bench")
    p.add_argument("--only", nargs="*", help="names among eagle none window mtp bridge small-target (default: all)")
    p.add_argument("--videos", type=int, default=192, help="training videos per draft")
    p.add_argument("--questions-per-video", type=int, default=1, help="QA samples per video besides its caption")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the drafts' initialisation")
    add_placement_arguments(p)
    p.set_defaults(func=_cmd_world_train_baselines)

    p = wsub.add_parser("eval", parents=parents, help="world accuracy by video length and held-out tau")
    p.add_argument("--target", required=True, help="the world target")
    p.add_argument("--draft", help="a draft for it: also its tau against an untrained one of the same shape")
    p.add_argument("--videos-at", type=_sizes, default=((84, 8),),
                   help="SIDExFRAMES list, e.g. 84x8,168x28,168x1392 (the benchmark ladder: 168x28 ... 168x1392)")
    p.add_argument("--videos", type=int, default=20, help="fresh videos per size")
    p.add_argument("--seed", type=int, default=10**6, help="seed of the first video (held out from training's)")
    add_placement_arguments(p)
    p.set_defaults(func=_cmd_world_eval)

    p = wsub.add_parser("compare-drafts", parents=parents, help="several drafts' tau on the same fresh world videos")
    p.add_argument("--target", required=True, help="the world target")
    p.add_argument("--drafts", required=True, help="NAME=DIR,... (e.g. committed=models/world/draft,new=out/draft)")
    p.add_argument("--videos-at", type=_sizes, default=((168, 28), (168, 448), (168, 1392)),
                   help="SIDExFRAMES list (default 168x28,168x448,168x1392: 0.5k, 8k and 25k visual tokens)")
    p.add_argument("--videos", type=int, default=5, help="fresh videos per size")
    p.add_argument("--seed", type=int, default=31337, help="seed of the videos (keep it apart from training's)")
    p.add_argument("--temperatures", type=lambda s: tuple(float(x) for x in s.split(",")), default=(0.0,),
                   help="comma-separated (default 0)")
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    add_placement_arguments(p)
    p.set_defaults(func=_cmd_world_compare_drafts)

    p = wsub.add_parser("demo", parents=parents, help="stream answers about a fresh world video with the committed pair")
    p.add_argument("--seed", type=int, help="video seed (default: a fresh random one)")
    p.add_argument("--models", help="folder with target/ and draft/ (default: models/world)")
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    add_placement_arguments(p)
    p.set_defaults(func=_cmd_world_demo)


def main(argv: list[str] | None = None) -> int:
    """Standalone: python -m sparrow.training.commands ... (the same commands as `sparrow ...`)."""
    parser = argparse.ArgumentParser(prog="sparrow-training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    from sparrow.progress import quiet_third_party

    quiet_third_party(args.verbose)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
