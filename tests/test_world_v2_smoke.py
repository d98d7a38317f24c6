"""World v2's smoke (issue 47): a tiny v2 target, trained a few steps on v2 narrations and saved
and loaded as a checkpoint is, answers a real v2 video (mp4 through the serving decode) through
the engine with Sparrow's speculative decoding, token for token as its plain greedy decoding
does, with the adaptive policy and at fixed k, chain and tree."""

from __future__ import annotations

import pytest

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.models import SparrowDraft, TargetModel
from sparrow.tiny import tiny_draft
from sparrow.video import prepare_video
from sparrow.world.target_train import train_world_target
from sparrow.world.v2.questions_v2 import QUESTIONS_V2
from sparrow.world.v2.render_v2 import make_video
from sparrow.world.v2.splits_v2 import split_seeds
from sparrow.world.v2.target_v2 import V2Data, V2TargetConfig, new_v2_target

SPECS = {"adaptive": SpecConfig(num_draft_tokens=4, window=16, anchors=32),
         "chain k=4": SpecConfig(num_draft_tokens=4, adaptive_k=False, window=16, anchors=32),
         "tree": SpecConfig(num_draft_tokens=4, adaptive_k=False, window=16, anchors=32, tree_width=2, tree_branch=2,
                            tree_budget=10)}


@pytest.fixture(scope="module")
def v2_pair(tmp_path_factory):
    """A tiny v2 target taught the narration's opening on a small pool of 8 s videos (56 px:
    2 x 2 tokens a frame pair), saved and loaded back, and a draft for it."""
    c = V2TargetConfig(hidden=64, layers=2, heads=2, intermediate=128, batch=4, pool=4, side=56, seconds=(8,),
                       steps=60, lr=3e-3, warmup=5, caption_prob=1.0, eval_every=0, log_every=100)
    target, _ = train_world_target(c, log=lambda _: None, target=new_v2_target(c), data=V2Data(c))
    folder = tmp_path_factory.mktemp("v2-target")
    target.save_pretrained(folder / "target")
    loaded = TargetModel.from_pretrained(folder / "target")
    tiny_draft(loaded, seed=5).save_pretrained(folder / "draft")
    return loaded, SparrowDraft.from_pretrained(folder / "draft", target=loaded)


def test_a_tiny_v2_target_answers_a_v2_video_losslessly_through_the_engine(v2_pair, tmp_path):
    target, draft = v2_pair
    seed = split_seeds("test", 1, first=7)[0]
    video = make_video(seed, 8, tmp_path / "v2.mp4", side=56)
    prepared = prepare_video(video.path, target.processor, video.options())
    assert prepared.num_visual_tokens == video.visual_tokens == 32
    prompt = QUESTIONS_V2["narrate"][0]
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = Engine(target, spec=SpecConfig(method="none")).generate(prepared, prompt, sampling)
    assert plain.text.startswith("at 0 : 00 there")        # it learned the narration's opening
    for name, spec in SPECS.items():
        out = Engine(target, draft, spec).generate(prepared, prompt, sampling)
        assert out.token_ids == plain.token_ids, name
        assert out.metrics.steps < len(plain.token_ids) or name == "adaptive", name   # it drafted
