"""distill-v2: a v2 VLM trained on a feature store's answers (the SpecVLM-style small VLM given
the drafts' data). A tiny v2 target answers a real v2 video into a real store; a second tiny v2
VLM trained on that store through the command line answers the video as the target did."""

from __future__ import annotations

import json

import torch

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.cli.main import main
from sparrow.models.target import TargetModel
from sparrow.training.data import Sample
from sparrow.training.feature_store import FeatureStore, StoreConfig, build_store
from sparrow.world.v2.distill_v2 import SUMMARY_FILE, store_answers
from sparrow.world.v2.render_v2 import FPS, make_video
from sparrow.world.v2.splits_v2 import split_seeds
from sparrow.world.v2.target_v2 import V2TargetConfig, new_v2_target

TINY = dict(hidden=64, layers=2, heads=2, intermediate=128)
PROMPT = "what happens in the video , and when ?"


def test_a_vlm_distilled_on_a_stores_answers_answers_as_the_target(tmp_path, monkeypatch):
    torch.manual_seed(0)
    teacher, student = new_v2_target(V2TargetConfig(seed=3, **TINY)), new_v2_target(V2TargetConfig(seed=5, **TINY))
    student.save_pretrained(tmp_path / "student")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "v.mp4").write_bytes(make_video(split_seeds("train", 1, first=11)[0], 8, None, side=112).source)
    monkeypatch.chdir(tmp_path)               # the store keeps the video's path as given: relative here
    cfg = StoreConfig(sampled=0, max_new_tokens=12, bridge_budgets=(4,), disk_dtype="float32", fps=FPS)
    build_store(teacher, [Sample("data/v.mp4", PROMPT)], "store", cfg)
    (video, prompt, answer), = store_answers(FeatureStore(tmp_path / "store"))
    assert FeatureStore(tmp_path / "store").video_options == cfg.options()
    assert video == tmp_path / "data" / "v.mp4" and prompt == PROMPT and answer

    assert main(["world", "distill-v2", "--student", "student", "--store", "store", "--out", "distilled",
                 "--steps", "120", "--batch", "2", "--lr", "1e-2", "--warmup", "5"]) == 0
    summary = json.loads((tmp_path / "distilled" / SUMMARY_FILE).read_text())
    assert summary["answers"] == 1 and summary["final_loss"] < 0.1 * summary["first_loss"]

    def answer_of(vlm: TargetModel) -> str:
        engine = Engine(vlm, spec=SpecConfig(method="none"))
        return engine.generate("data/v.mp4", PROMPT, SamplingParams(max_new_tokens=12), cfg.options()).text

    taught, target = answer_of(TargetModel.from_pretrained(tmp_path / "distilled")), answer_of(teacher)
    before = answer_of(TargetModel.from_pretrained(tmp_path / "student"))
    assert taught == target == answer and before != answer


def test_a_step_one_answer_at_a_time_equals_the_padded_batch(tmp_path):
    """distill-v2's step backs one answer at a time (no attention mask, so memory bounded at 25k);
    its gradients and loss equal the padded batch's token mean over answers of different lengths."""
    from sparrow.video import VideoOptions
    from sparrow.world.target_data import pooled_loss
    from sparrow.world.v2.distill_v2 import _pooled, accumulate_step

    torch.manual_seed(0)
    vlm = new_v2_target(V2TargetConfig(seed=7, **TINY))
    paths = []
    for i, seed in enumerate(split_seeds("train", 2, first=21)):
        paths.append(tmp_path / f"v{i}.mp4")
        paths[-1].write_bytes(make_video(seed, 8 + 8 * i, None, side=112).source)
    videos = [_pooled(vlm, p, VideoOptions(fps=FPS)) for p in paths]
    chats = [(PROMPT, "at 0 : 00 there is 1 object ."), (PROMPT, "at 0 : 00 there are 2 objects : a small red circle .")]
    assert videos[0].embeds.shape[0] != videos[1].embeds.shape[0]
    params = [p for p in vlm.hf.parameters() if p.requires_grad]

    vlm.hf.zero_grad(set_to_none=True)
    batch_loss = pooled_loss(vlm, videos, [[c] for c in chats], decode=True)
    batch_loss.backward()
    want = [p.grad.clone() if p.grad is not None else None for p in params]

    vlm.hf.zero_grad(set_to_none=True)
    got_loss = accumulate_step(vlm, [(v, q, a) for v, (q, a) in zip(videos, chats)], params)
    assert abs(got_loss - float(batch_loss.detach())) < 1e-4
    compared = 0
    for p, w in zip(params, want):
        if w is None:
            assert p.grad is None or not p.grad.any()
            continue
        torch.testing.assert_close(p.grad, w, rtol=1e-3, atol=1e-5)
        compared += 1
    assert compared > 10
