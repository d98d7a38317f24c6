"""`sparrow train-draft` on a feature store: a killed run resumes where its checkpoint stood and
ends where an uninterrupted one does; the recipe trained on a tiny world beats an untrained
draft on videos it never saw."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sparrow.errors import InvalidRequest
from sparrow.models import SparrowDraft, TargetModel
from sparrow.tiny import synthetic_frames
from sparrow.training import Sample, TrainConfig
from sparrow.training.commands import train_draft
from sparrow.training.feature_store import FeatureStore, StoreConfig, build_store

ROOT = Path(__file__).resolve().parents[1]
WORLD = ROOT / "models" / "world"
OPTIONS = dict(steps=80, grad_accum=2, lr=3e-3, warmup=2, window=8, anchors=16, bridge_tokens=8, max_new_tokens=10,
               log_every=1, eval_every=0, save_every=5, fps=None, num_frames=4)


def _cli_args(options: dict) -> list[str]:
    return [a for k, v in options.items() for a in ("--" + k.replace("_", "-"), str(v)) if v is not None]


@pytest.fixture(scope="module")
def saved(qwen_target, tmp_path_factory):
    """A saved tiny target and a store of its answers about three videos."""
    root = tmp_path_factory.mktemp("train_draft")
    qwen_target.save_pretrained(root / "target")
    target = TargetModel.from_pretrained(root / "target")
    samples = [Sample(synthetic_frames(4, 56, 56, seed=i), p) for i in range(3) for p in ("What happens?", "Colours?")]
    build_store(target, samples, root / "store", StoreConfig(sampled=1, max_new_tokens=10, bridge_budgets=(8,),
                                                             fps=None, num_frames=4))
    return root / "target", root / "store"


def _steps(out: Path) -> list[int]:
    log = out / "train_log.jsonl"
    return [json.loads(line)["step"] for line in log.read_text().splitlines()] if log.is_file() else []


def test_train_draft_resumes_from_its_checkpoint_after_a_kill(saved, tmp_path):
    target, store = saved
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "sparrow.training.commands", "train-draft", "--target", str(target), "--data", str(store),
           "--out", str(killed), *_cli_args(OPTIONS)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while max(_steps(killed), default=0) < 12 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)          # mid-run: no clean shutdown, no final save
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    reached = max(_steps(killed))
    assert 12 <= reached < OPTIONS["steps"], (reached, proc.stderr.read().decode()[-2000:])
    saved_at = torch.load(killed / "checkpoint" / "trainer_state.pt", weights_only=False)["step"]
    assert saved_at % OPTIONS["save_every"] == 0 and 5 <= saved_at <= reached

    cfg = TrainConfig(**{k: v for k, v in OPTIONS.items()})
    logs = []
    summary = train_draft(target, store, killed, cfg, log=logs.append)           # the same command, rerun
    assert f"resuming from {killed / 'checkpoint'} at step {saved_at}/{cfg.steps}" in logs
    assert summary["steps"] == cfg.steps
    assert _steps(killed)[-(cfg.steps - saved_at):] == list(range(saved_at + 1, cfg.steps + 1))

    whole = tmp_path / "whole"
    train_draft(target, store, whole, cfg, log=lambda _: None)
    t = TargetModel.from_pretrained(target)
    resumed, uninterrupted = SparrowDraft.from_pretrained(killed, t), SparrowDraft.from_pretrained(whole, t)
    for (name, a), b in zip(resumed.state_dict().items(), uninterrupted.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
    # and --restart starts over instead of resuming
    logs.clear()
    train_draft(target, store, whole, TrainConfig(**{**OPTIONS, "steps": 2}), log=logs.append, restart=True)
    assert not any(line.startswith("resuming") for line in logs) and _steps(whole) == [1, 2]
    # --init fine-tunes a saved draft: its weights are where training starts
    from sparrow.training.trainer import DraftTrainer
    start = DraftTrainer.from_draft(t, killed, FeatureStore(store), cfg, log=lambda _: None)
    for (name, a), b in zip(start.draft.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    logs.clear()
    train_draft(target, store, tmp_path / "tuned", TrainConfig(**{**OPTIONS, "steps": 2}), log=logs.append, init=killed)
    assert f"starting from the draft at {killed}" in logs and _steps(tmp_path / "tuned") == [1, 2]
    with pytest.raises(InvalidRequest, match="not what this config trains"):
        train_draft(target, store, tmp_path / "wide", TrainConfig(**{**OPTIONS, "draft_intermediate": 48}),
                    log=lambda _: None, init=killed)


needs_pair = pytest.mark.skipif(not (WORLD / "target" / "config.json").is_file(),
                                reason="models/world not trained yet (sparrow world train-target)")


@needs_pair
def test_the_recipe_on_a_tiny_world_beats_an_untrained_draft_on_fresh_videos(tmp_path):
    from sparrow.training import DraftTrainer
    from sparrow.training.data import load_samples
    from sparrow.world.scenes import WorldVideo
    from sparrow.world.draft_data import WORLD_FPS, make_world_data, tau_rows, world_draft_config

    target = TargetModel.from_pretrained(WORLD / "target")
    manifest = make_world_data(tmp_path / "data", 12, (8,), seed=5, questions_per_video=2)
    build_store(target, load_samples(manifest), tmp_path / "store",
                StoreConfig(sampled=1, max_new_tokens=80, bridge_budgets=(16,), fps=WORLD_FPS))
    store = FeatureStore(tmp_path / "store")
    assert store.summary()["by_kind"] == {"greedy": 36, "sampled": 36}
    trainer = DraftTrainer.fresh(target, store, world_draft_config(steps=150, warmup=10, eval_every=0, save_every=0),
                                 log=lambda _: None)
    trainer.fit()
    rows = tau_rows(target, trainer.draft, WorldVideo(), list(range(3 * 10**9, 3 * 10**9 + 3)), k=4)
    assert rows["tau"] >= 1.8 and rows["tau"] >= rows["tau_untrained"] + 0.6, rows


@needs_pair
def test_compare_drafts_runs_every_draft_on_the_same_videos():
    from sparrow.world.compare_drafts import compare_drafts

    report = compare_drafts(WORLD / "target", {"a": WORLD / "draft", "b": WORLD / "draft"}, ((84, 8),), 2, seed=424242)
    a, b = report["84x8"]["a"]["T=0"], report["84x8"]["b"]["T=0"]
    assert a == b and len(a["per_video"]) == 2 and a["steps"] > 0        # the same draft: the same tau, video by video
    assert 1.0 <= a["min"] <= a["median"] <= a["max"] <= 5.0 and 1.0 <= a["pooled"] <= 5.0
