"""Draft training: the training forward is the inference forward, training learns, and a
checkpoint resumes to exactly the step it would have taken."""

import json

import pytest
import torch
from helpers import check_unroll_equals_proposer

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.models.draft import SparrowDraft
from sparrow.speculative.draft_context import build_context
from sparrow.tiny import synthetic_frames, tiny_draft
from sparrow.training import DraftTrainer, Sample, TrainConfig, load_samples
from sparrow.training.signals import target_signals
from sparrow.training.unroll import anchor_flags

PROMPT = "What happens in the video?"
SPEC = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=4, anchors=5, glimpse=3)
CFG = TrainConfig(steps=12, grad_accum=2, lr=3e-3, warmup=2, window=8, anchors=16, bridge_tokens=8,
                  max_new_tokens=12, log_every=100, eval_every=0, save_every=0)


@pytest.fixture(scope="module")
def video():
    return synthetic_frames(4, 56, 56, seed=1)


@pytest.fixture(scope="module")
def signals(qwen_target, video):
    engine = Engine(qwen_target, spec=SpecConfig(method="none"))
    processed = engine.process_video(video)
    response = engine.generate(processed, PROMPT, SamplingParams(max_new_tokens=14, ignore_eos=True)).token_ids
    draft = tiny_draft(qwen_target, seed=1)
    return draft, processed, target_signals(qwen_target, processed, PROMPT, response,
                                            draft.config.feature_layers, draft.config.bridge_layer)


def test_signals_are_what_prefill_gives_the_draft(qwen_target, signals):
    draft, processed, sig = signals
    pre = qwen_target.prefill(qwen_target.build_inputs(processed, PROMPT), capacity=512,
                              feature_layers=draft.config.feature_layers, bridge_layer=draft.config.bridge_layer)
    ctx = build_context(pre, int(sig.token_ids[sig.num_prompt]), glimpse=3)
    p = sig.num_prompt
    assert torch.equal(ctx.token_ids, sig.token_ids[: p + 1]) and ctx.num_prompt == p
    torch.testing.assert_close(ctx.features, sig.features[: p + 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ctx.glimpse, sig.prefix(3), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("offset", [0, 3, 8])
def test_training_masks_and_outputs_equal_inference(qwen_target, signals, offset):
    """Chain start s = P + offset: the proposer's masks (recorded from `window_mask` inside the
    draft) and its sampled distributions equal the training unroll's, step for step."""
    draft, _, sig = signals
    s, p = sig.num_prompt + offset, sig.num_prompt
    inference_rows = check_unroll_equals_proposer(draft, SPEC, sig, s, anchor_flags(sig.num_entries, p, SPEC.anchors),
                                                  SPEC.window, 3)
    assert sum(row.shape[0] for row in inference_rows) > 0


def _samples(n):
    return [Sample(synthetic_frames(4, 56, 56, seed=i), PROMPT) for i in range(n)]


def test_a_few_steps_lower_the_loss_and_bad_samples_are_skipped(qwen_target):
    samples = _samples(2) + [Sample(b"not a video", PROMPT), Sample(synthetic_frames(4, 56, 56), "  ")]
    logs = []
    trainer = DraftTrainer.fresh(qwen_target, samples, CFG, log=logs.append)
    fixed = trainer.signals(0)

    def loss():
        with torch.no_grad():
            return float(trainer.sample_loss(fixed)[0])

    before = loss()
    trainer.fit()
    assert loss() < before - 0.05
    assert len(trainer.bad) == 2 and sorted(trainer.bad) == [2, 3]
    assert any("2 skipped so far" in line for line in logs)


def test_save_resume_gives_the_same_next_step(qwen_target, tmp_path):
    samples = _samples(3)
    a = DraftTrainer.fresh(qwen_target, samples, CFG, log=lambda _: None)
    for _ in range(3):
        a.train_step()
    a.save(tmp_path / "ckpt")
    next_a = a.train_step()
    b = DraftTrainer.resume(qwen_target, tmp_path / "ckpt", samples, CFG, log=lambda _: None)
    assert (b.step, b.seen) == (3, 6)
    next_b = b.train_step()
    assert next_a.loss == next_b.loss and next_a.lr == next_b.lr
    for (name, pa), pb in zip(a.draft.named_parameters(), b.draft.parameters()):
        assert torch.equal(pa, pb), name
    # and a fresh trainer under the same seed takes exactly the same steps
    c = DraftTrainer.fresh(qwen_target, samples, CFG, log=lambda _: None)
    assert [c.train_step().loss for _ in range(4)][-1] == next_a.loss


def test_manifest_and_folder_loading(tmp_path):
    (tmp_path / "clips").mkdir()
    for name in ("a.mp4", "b.mp4", "notes.md"):
        (tmp_path / "clips" / name).write_bytes(b"")
    (tmp_path / "clips" / "b.txt").write_text("first question?\n\nsecond question?\n")
    manifest = tmp_path / "train.jsonl"
    manifest.write_text(json.dumps({"video": "clips/a.mp4", "prompt": "p", "answer": "x"}) + "\n\n"
                        + json.dumps({"video": "/abs/b.mp4", "prompt": "q"}) + "\n")
    rows = load_samples(manifest)
    assert [(str(r.video), r.prompt, r.answer) for r in rows] == [
        (str(tmp_path / "clips" / "a.mp4"), "p", "x"), ("/abs/b.mp4", "q", None)]
    folder = load_samples(tmp_path / "clips", prompts=("describe",))
    assert [(r.video.name, r.prompt) for r in folder] == [
        ("a.mp4", "describe"), ("b.mp4", "first question?"), ("b.mp4", "second question?")]


def test_cli_options_mirror_the_config():
    import argparse

    from sparrow.training.commands import _config, add_commands

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train-draft", "--target", "t", "--data", "d", "--out", "o", "--unroll", "2",
                              "--feature-layers", "1,3", "--hidden-weight", "1.0"])
    cfg = _config(TrainConfig, args)
    assert (cfg.unroll, cfg.feature_layers, cfg.hidden_weight, cfg.steps) == (2, (1, 3), 1.0, TrainConfig().steps)
    args = parser.parse_args(["world", "train-target", "--out", "o", "--steps", "5", "--kinds", "count,present"])
    assert args.cfg_steps == 5


def test_a_fresh_run_starts_its_own_log(qwen_target, tmp_path):
    samples = _samples(2)
    for _ in range(2):                     # a second fresh run into the same folder replaces the log
        DraftTrainer.fresh(qwen_target, samples, CFG, log=lambda _: None, out_dir=tmp_path).fit()
        steps = [json.loads(line)["step"] for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
        assert steps == list(range(1, CFG.steps + 1))
    # the geometry it was trained with travels with the checkpoint (tests/test_draft_geometry.py)
    trained = SparrowDraft.from_pretrained(tmp_path).trained_with
    assert (trained["window"], trained["anchors"], trained["num_draft_tokens"]) == (8, 16, CFG.eval_draft_tokens)


def test_step0_over_every_entry_skips_the_mask_and_equals_the_masked_forward(signals, monkeypatch):
    """Context "all" (every key out of the window pinned, no prefix): step 0 is the plain causal
    mask, run without building it (n x n at 25k entries); its outputs equal the masked forward's."""
    from sparrow.training.unroll import plainly_causal, step0_mask, unroll

    draft, _, sig = signals
    n, window = sig.num_entries, 4
    pinned = torch.ones(n, dtype=torch.bool)
    assert plainly_causal(0, pinned, window) and plainly_causal(0, torch.zeros(n, dtype=torch.bool), n)
    assert not plainly_causal(2, pinned, window)
    assert not plainly_causal(0, anchor_flags(n, sig.num_prompt, 2), window)
    chains = torch.arange(sig.num_prompt, n - 3)
    import sparrow.training.unroll as unroll_module
    built = []
    monkeypatch.setattr(unroll_module, "step0_mask", lambda *a: built.append(a) or step0_mask(*a))
    with torch.no_grad():
        fast = unroll(draft, sig.token_ids, sig.features, pinned, sig.prefix(0), chains, 3, window)
        masked = unroll(draft, sig.token_ids, sig.features, pinned, sig.prefix(0), chains, 3, window, keep_masks=True)
    assert len(built) == 1 and not fast.masks and masked.masks[0].shape == (len(chains), n)   # the masked run's only
    for a, b in zip(fast.logits, masked.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
