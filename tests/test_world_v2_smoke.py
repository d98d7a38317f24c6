"""World v2's smoke: a tiny v2 target, built and taught in code in seconds, answers a real v2
video (mp4 through the serving decode) through the engine, and Sparrow's speculative decoding
gives exactly the target's plain greedy tokens. (Not HF generate's: with real-time positions a
video's last temporal position runs past its question, and the engine decodes one past the
prompt's largest position, as the target is trained: target_data.decode_positions.)"""

from __future__ import annotations

import random

import pytest
import torch

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.tiny import tiny_draft
from sparrow.video import load_frames
from sparrow.world.target_data import PooledVideo, pooled_loss
from sparrow.world.v2.narration import event_recall
from sparrow.world.v2.questions_v2 import ask
from sparrow.world.v2.render_v2 import make_video
from sparrow.world.v2.splits_v2 import split_seeds
from sparrow.world.v2.target_v2 import V2TargetConfig, new_v2_target

# the v2 target's time (real time, 2 rope steps a second) and placed tower; a tiny language model
TINY_V2 = V2TargetConfig(hidden=64, layers=2, heads=2, intermediate=128, seed=3)
SPEC = SpecConfig(adaptive_k=False, method="sparrow", num_draft_tokens=4, window=8, anchors=16)


@pytest.fixture(scope="module")
def taught():
    """A tiny v2 target taught one held-out video's narration (a few hundred steps on its pooled
    visual tokens, the training path's loss), the video as the engine reads it, and the scene."""
    torch.manual_seed(0)
    target = new_v2_target(TINY_V2)
    v2 = make_video(split_seeds("test", 1, first=7)[0], 8, None, side=112)
    video = target.processor.process(load_frames(v2.source, v2.options()))
    hf = target.hf
    with torch.no_grad():
        embeds = hf.model.visual(video.pixel_values_videos, grid_thw=video.model_kwargs["video_grid_thw"])
    embeds = embeds if torch.is_tensor(embeds) else embeds.pooler_output
    question, answer = ask(v2.scene, "narrate", random.Random(1))
    pooled = PooledVideo(embeds, dict(video.model_kwargs), [])
    hf.model.visual.requires_grad_(False)
    steps = 150
    opt = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=1e-2)
    # lr falls to a tenth: at a constant 1e-2 the loss spikes now and then (0.08 -> 1.2), and where
    # the last step lands on a spike is down to float rounding (a fresh clone failed CI on it);
    # decayed, five seeds of model and data all end under 0.02 and all narrate it
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - 0.9 * i / steps)
    hf.train()
    for _ in range(steps):
        loss = pooled_loss(target, [pooled], [[(question, answer)]], decode=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        decay.step()
    hf.eval()
    return target, video, v2.scene, question, answer


def test_a_tiny_v2_target_narrates_a_v2_video_losslessly_with_sparrow(taught):
    target, video, scene, question, answer = taught
    budget = len(target.tokenizer(answer, add_special_tokens=False)["input_ids"]) + 4
    plain = Engine(target, spec=SpecConfig(method="none")).generate(video, question, SamplingParams(max_new_tokens=budget))
    assert plain.text.strip() == answer                      # it learned the narration: times, objects, counts
    assert event_recall(plain.text.strip(), scene) == 1.0
    for seed in (0, 1):                                     # two random drafts: each rejects differently
        spec = Engine(target, tiny_draft(target, seed=seed), SPEC).generate(video, question,
                                                                             SamplingParams(max_new_tokens=budget))
        assert spec.token_ids == plain.token_ids
        assert spec.metrics.steps > 0 and spec.metrics.draft_tokens > 0


def test_the_saved_v2_target_stays_lossless_with_the_adaptive_policy_and_a_tree(taught, tmp_path):
    """The same target through save_pretrained / from_pretrained, under the engine's default
    (adaptive k) and a tree: still the plain greedy tokens."""
    from sparrow.models import SparrowDraft, TargetModel

    target, video, _, question, answer = taught
    target.save_pretrained(tmp_path / "target")
    loaded = TargetModel.from_pretrained(tmp_path / "target")
    tiny_draft(loaded, seed=2).save_pretrained(tmp_path / "draft")
    draft = SparrowDraft.from_pretrained(tmp_path / "draft", target=loaded)
    sampling = SamplingParams(max_new_tokens=len(target.tokenizer(answer, add_special_tokens=False)["input_ids"]) + 4)
    plain = Engine(loaded, spec=SpecConfig(method="none")).generate(video, question, sampling)
    assert plain.text.strip() == answer
    for spec in (SpecConfig(method="sparrow", num_draft_tokens=4, window=8, anchors=16),
                 SpecConfig(method="sparrow", adaptive_k=False, num_draft_tokens=4, window=8, anchors=16,
                            tree_width=2, tree_branch=2, tree_budget=10)):
        out = Engine(loaded, draft, spec).generate(video, question, sampling)
        assert out.token_ids == plain.token_ids, spec
