"""World v2's target recipe (issue 47): a stage stopped at its checkpoint and resumed takes the
unbroken run's steps exactly; the commands train, checkpoint, report and score a tiny target;
the scores are per kind and per length and the narration is scored by event recall."""

from __future__ import annotations

import json
import time

import pytest
import torch

from sparrow.models import TargetModel
from sparrow.world.target_train import STATE_FILE, resume_target, train_world_target
from sparrow.world.v2.target_v2 import SHORT_KINDS, V2Data, V2TargetConfig, new_v2_target, scene_pool

# 56 px frames: 2 x 2 visual tokens a frame pair, so an 8 s video is 32 tokens
TINY = dict(hidden=64, layers=1, heads=2, intermediate=64, batch=2, pool=3, side=56, seconds=(8,), eval_every=0,
            log_every=1)


def _weights(target: TargetModel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in target.hf.state_dict().items()}


def test_a_stopped_stage_resumes_to_the_unbroken_runs_weights(tmp_path):
    c = V2TargetConfig(steps=4, save_every=2, **TINY)
    cache = tmp_path / "pool.pt"
    whole, _ = train_world_target(c, log=lambda _: None, target=new_v2_target(c), data=V2Data(c, cache))
    whole = _weights(whole)
    # a deadline already past: the run checkpoints after its first step and stops
    ckpt = tmp_path / "checkpoint"
    _, history = train_world_target(c, log=lambda _: None, target=new_v2_target(c), data=V2Data(c, cache),
                                    checkpoint=ckpt, deadline=time.time() - 1)
    assert history[-1] == {"stopped": 1} and torch.load(ckpt / STATE_FILE, weights_only=False)["step"] == 1
    resumed, history = train_world_target(c, log=lambda _: None, target=resume_target(ckpt), data=V2Data(c, cache),
                                          checkpoint=ckpt)
    assert [h["step"] for h in history if "loss" in h] == [1, 2, 3, 4]
    after = _weights(resumed)
    assert after.keys() == whole.keys()
    for k in whole:
        assert torch.equal(after[k], whole[k]), k
    assert torch.load(ckpt / STATE_FILE, weights_only=False)["step"] == 4
    assert resume_target(tmp_path / "nothing-here") is None


def test_the_pool_is_train_split_scenes_cached_between_runs(tmp_path):
    from sparrow.world.v2.splits_v2 import split_of

    c = V2TargetConfig(**TINY)
    target = new_v2_target(c)
    lines: list[str] = []
    pool = scene_pool(target, c, lines.append, tmp_path / "pool.pt")
    assert len(pool) == 3 and {split_of(v.scene.seed) for v in pool} == {"train"}
    assert all(v.embeds.shape == (32, 64) for v in pool)
    again = scene_pool(target, c, lines.append, tmp_path / "pool.pt")
    assert all(torch.equal(a.embeds, b.embeds) and a.scene == b.scene for a, b in zip(pool, again))
    other = scene_pool(target, V2TargetConfig(**{**TINY, "seed": 1}), lines.append, tmp_path / "pool.pt")
    assert any("rendering again" in line for line in lines)
    assert {v.scene.seed for v in other}.isdisjoint({v.scene.seed for v in pool})
    with pytest.raises(ValueError, match="unknown question kinds"):
        V2Data(V2TargetConfig(**{**TINY, "kinds": ("poem",)}))


def test_train_target_v2_and_eval_v2_commands(tmp_path):
    from sparrow.cli.main import build_parser

    out, card = tmp_path / "target", tmp_path / "MODEL_CARD.md"
    tiny = ["--hidden", "64", "--layers", "1", "--heads", "2", "--intermediate", "64", "--batch", "2", "--pool", "2",
            "--side", "56", "--seconds", "8", "--eval-every", "0", "--save-every", "1", "--final-eval-scenes", "1"]
    # --final-eval-scenes 0: the target is saved with no final scores (it used to fail after saving)
    bare = tmp_path / "bare"
    args = build_parser().parse_args(["world", "train-target-v2", "--out", str(bare), "--steps", "2",
                                      *tiny[:-1], "0"])
    assert args.func(args) == 0 and json.loads((bare / "world_target_v2.json").read_text())["heldout"] is None
    assert (bare / "model.safetensors").is_file()
    args = build_parser().parse_args(["world", "train-target-v2", "--out", str(out), "--steps", "2", *tiny])
    assert args.func(args) == 0
    report = json.loads((out / "world_target_v2.json").read_text())
    assert report["stage"] == "short" and report["config"]["side"] == 56 and report["config"]["steps"] == 2
    held = report["heldout"]
    assert held["split"] == "test" and held["scenes"] == 1 and set(held["per_seconds"]) == {"8", "30"}
    assert set(held["per_kind"]) <= {*SHORT_KINDS, "narrate", "story"} and "narrate" in held["per_kind"]
    assert 0.0 <= held["event_recall"] <= 1.0 and held["questions"] >= 10
    runs = [json.loads(line) for line in (out / "train_runs.jsonl").read_text().splitlines()]
    assert runs[-1]["last_step"] == 2 and not runs[-1]["stopped"]
    assert TargetModel.from_pretrained(out).processor.temporal_positions is None      # real time
    assert not (out / "checkpoint").exists()                # done: the next stage starts from OUT
    parse = build_parser().parse_args
    # a stage stopped at its checkpoint (a zero time limit, a step) must be finished before another starts in OUT
    args = parse(["world", "train-target-v2", "--out", str(out), "--steps", "3", "--max-minutes", "0", *tiny])
    assert args.func(args) == 0 and (out / "checkpoint").is_dir()
    args = parse(["world", "train-target-v2", "--out", str(out), "--steps", "3", "--stop-at", "2", *tiny])
    assert args.func(args) == 0
    assert json.loads((out / "train_runs.jsonl").read_text().splitlines()[-1])["last_step"] == 2
    args = parse(["world", "train-target-v2", "--out", str(out), "--stage", "narrate", "--init", str(out), *tiny])
    with pytest.raises(ValueError, match="stage 'short'"):
        args.func(args)
    card.write_text("# card\n\nbefore\n")
    args = build_parser().parse_args(["world", "eval-v2", "--target", str(out), "--scenes", "1", "--seconds", "8",
                                      "--side", "56", "--kinds", "count_start,yesno", "--card", str(card),
                                      "--json", str(tmp_path / "eval.json")])
    assert args.func(args) == 0
    scores = json.loads((tmp_path / "eval.json").read_text())
    assert set(scores["per_kind"]) == {"count_start", "yesno"} and scores["event_recall"] is None
    text = card.read_text()
    assert text.startswith("# card\n\nbefore\n") and "| count_start |" in text and "| yesno |" in text
    args.func(args)                                       # again: the section is replaced, not added
    assert card.read_text().count("eval-v2 begin") == 1



def test_a_one_object_stage_asks_its_kinds_about_one_object_scenes_only(tmp_path, monkeypatch):
    """`where@1:N:one` (a curriculum's first steps): every batch of the stage is of one-object
    scenes, each chat a "where" question; `:two` draws scenes of at most two objects; mixed steps
    draw from the whole pool; a pool without one-object scenes is refused up front."""
    import random

    import sparrow.world.v2.target_v2 as target_v2
    from sparrow.world.target_data import training_stages
    from sparrow.world.v2.questions_v2 import QUESTIONS_V2
    from sparrow.world.v2.target_v2 import FALLBACK_KIND

    c = V2TargetConfig(**{**TINY, "pool": 24, "batch": 4, "steps": 1, "stages": ("where@1:3:one", "where@1:3:two")})
    stages = training_stages(c, V2Data.kinds)
    assert [s.objects for s in stages] == [0, 1, 2] and stages[1].kinds == ("where",)
    target = new_v2_target(c)
    data = V2Data(c, tmp_path / "pool.pt")
    data.prepare(target, stages, lambda _: None)
    drawn: list = []
    monkeypatch.setattr(target_v2, "pooled_loss", lambda t, videos, chats, *a, **k: drawn.append((videos, chats)))
    rng = random.Random(0)
    for _ in range(6):
        data.loss(target, stages[1], 1, True, rng)
    def kind(question: str) -> str:
        return next(k for k in ("where", FALLBACK_KIND) for w in QUESTIONS_V2[k] if question.startswith(w.split("{")[0]))

    assert all(len(v.scene.objects) == 1 for videos, _ in drawn for v in videos)
    # (an object near a border, or not there at the start, is not asked "where": the fallback kind)
    kinds = [kind(q) for _, chats in drawn for ((q, _),) in chats]
    assert kinds.count("where") >= len(kinds) // 4
    drawn.clear()
    for _ in range(6):
        data.loss(target, stages[0], 0, False, rng)
    assert any(len(v.scene.objects) > 2 for videos, _ in drawn for v in videos)     # the mix: the whole pool
    drawn.clear()
    for _ in range(12):
        data.loss(target, stages[2], 2, True, rng)
    assert {len(v.scene.objects) for videos, _ in drawn for v in videos} == {1, 2}
    whole = target_v2.scene_pool
    monkeypatch.setattr(target_v2, "scene_pool",
                        lambda *a, **k: [v for v in whole(*a, **k) if len(v.scene.objects) > 1])
    with pytest.raises(ValueError, match="one-object"):
        V2Data(c, tmp_path / "pool.pt").prepare(target, stages, lambda _: None)


def test_replay_steps_draw_the_second_pools_videos_at_its_side_and_batch(tmp_path, monkeypatch):
    """--replay-prob: that share of mixed steps is a batch of replay_batch videos from a second
    pool (its own side, lengths and scenes, cached beside the main pool); the rest are the main
    pool's; focus steps never replay."""
    import random

    import sparrow.world.v2.target_v2 as target_v2
    from sparrow.world.target_data import training_stages

    c = V2TargetConfig(**{**TINY, "batch": 1, "side": 112, "pool": 2, "replay_prob": 0.5, "replay_pool": 3,
                          "replay_side": 56, "replay_seconds": (8,), "replay_batch": 3})
    stages = training_stages(c, V2Data.kinds)
    target = new_v2_target(c)
    data = V2Data(c, tmp_path / "pool.pt")
    data.prepare(target, stages, lambda _: None)
    assert (tmp_path / "replay-seed50-56px-3.pt").is_file()
    assert {v.scene.seed for v in data.replay}.isdisjoint({v.scene.seed for v in data.pool})
    drawn: list = []
    monkeypatch.setattr(target_v2, "pooled_loss", lambda t, videos, chats, *a, **k: drawn.append(videos))
    rng = random.Random(0)
    for _ in range(40):
        data.loss(target, stages[0], 0, False, rng)
    sizes = [(len(videos), videos[0].embeds.shape[0]) for videos in drawn]
    assert set(sizes) == {(1, 128), (3, 32)}           # 112 px 8 s: 128 tokens; 56 px: 32
    assert 10 <= sizes.count((3, 32)) <= 30
    for v in data.replay:
        assert v.embeds.shape == (32, 64)


def test_sigterm_mid_run_checkpoints_after_the_step_and_stops(tmp_path, monkeypatch):
    """A SIGTERM during a step: the step ends, the checkpoint is written there and the run stops
    (the resumed run goes on from it); the handler is the previous one again from the first
    signal (a second acts as it would have) and after the run."""
    import os
    import signal

    c = V2TargetConfig(steps=4, save_every=0, **TINY)
    data = V2Data(c, tmp_path / "pool.pt")
    seen: list = []

    def before(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, before)
    try:
        real = data.loss
        handlers: list = []

        def loss(target, stage, step, focus, rng):
            if step == 1:
                os.kill(os.getpid(), signal.SIGTERM)
                handlers.append(signal.getsignal(signal.SIGTERM))
            return real(target, stage, step, focus, rng)

        monkeypatch.setattr(data, "loss", loss)
        ckpt = tmp_path / "checkpoint"
        _, history = train_world_target(c, log=lambda _: None, target=new_v2_target(c), data=data, checkpoint=ckpt)
        assert history[-1] == {"stopped": 2} and torch.load(ckpt / STATE_FILE, weights_only=False)["step"] == 2
        assert seen == [] and handlers == [before]      # the first signal was the run's; then the old handler
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)
    _, history = train_world_target(c, log=lambda _: None, target=resume_target(ckpt), data=V2Data(c, tmp_path / "pool.pt"),
                                    checkpoint=ckpt)
    assert [h["step"] for h in history if "loss" in h] == [1, 2, 3, 4]
