"""The feature store: what it holds is what the target computes, a build resumes, and training
reads it."""

from dataclasses import fields

import numpy as np
import pytest
import torch

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.errors import InvalidRequest
from sparrow.tiny import synthetic_frames
from sparrow.training import DraftTrainer, Sample, TrainConfig
from sparrow.training.feature_store import FeatureStore, StoreConfig, build_store
from sparrow.training.loss import teacher_probs
from sparrow.training.signals import target_signals
from sparrow.video import VideoOptions

PROMPTS = ("What happens in the video?", "Describe the colours.")
STORE = StoreConfig(sampled=2, max_new_tokens=10, bridge_budgets=(3, 8), disk_dtype="float32", fps=None, num_frames=8)
OPTIONS = VideoOptions(fps=STORE.fps, num_frames=STORE.num_frames)
CFG = TrainConfig(steps=12, grad_accum=2, lr=3e-3, warmup=2, window=8, anchors=16, bridge_tokens=8,
                  max_new_tokens=10, log_every=100, eval_every=0, save_every=0, num_frames=4, fps=None)


@pytest.fixture(scope="module")
def videos():
    return [synthetic_frames(4, 56, 56, seed=i) for i in range(2)] + [synthetic_frames(16, 56, 56, seed=7)]


def _samples(videos):
    return [Sample(v, p) for v in videos for p in PROMPTS]


@pytest.fixture(scope="module")
def store(qwen_target, videos, tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    build_store(qwen_target, _samples(videos), path, STORE)
    return FeatureStore(path)


def _recomputed(target, store, videos, i):
    """The response's signals by one teacher-forced target forward over the whole sequence."""
    r = store.responses[i]
    c = store.contexts[r["context"]]
    v, p = (int(x) for x in c["id"][1:].split("p"))
    engine = Engine(target, spec=SpecConfig(method="none"))
    video = engine.process_video(videos[v], OPTIONS)
    sig = store.signals(i, target.lm_head())
    response = sig.token_ids[sig.num_prompt:].tolist()
    return sig, target_signals(target, video, PROMPTS[p], response, store.feature_layers, store.header["bridge_layer"])


def test_stored_signals_equal_recomputed_ones(qwen_target, store, videos):
    summary = store.summary()
    assert summary["contexts"] == 6 and summary["by_kind"]["greedy"] == 6 and summary["by_kind"]["sampled"] >= 6
    assert len(summary["by_visual_tokens"]) == 2           # two video sizes
    compared = 0
    for i, r in enumerate(store.responses):
        sig = store.signals(i, qwen_target.lm_head())
        if qwen_target.video_token_id in sig.token_ids[sig.num_prompt:].tolist():
            continue     # a sampled video pad id: the teacher-forced forward would read it as a video
        sig, ref = _recomputed(qwen_target, store, videos, i)
        assert torch.equal(sig.token_ids, ref.token_ids) and sig.num_prompt == ref.num_prompt
        assert sig.token_ids.shape[0] - sig.num_prompt == r["length"]
        torch.testing.assert_close(sig.features, ref.features, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(sig.final_hidden, ref.final_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(sig.logits, ref.logits, atol=1e-4, rtol=1e-4)
        for budget in STORE.bridge_budgets:          # the bridging prefix: the glimpse rule's own choice
            torch.testing.assert_close(sig.prefix(budget), ref.prefix(budget), atol=1e-5, rtol=1e-5)
        with pytest.raises(InvalidRequest, match="not stored"):
            sig.prefix(5)
        compared += 1
    assert compared >= 9


def test_greedy_responses_are_the_engines_and_sampled_ones_differ(qwen_target, store, videos):
    engine = Engine(qwen_target, spec=SpecConfig(method="none"))
    out = engine.generate(videos[0], PROMPTS[0], SamplingParams(max_new_tokens=10), OPTIONS)
    first = [r for r in store.responses if r["context"] == "v0p0"]
    assert [r["kind"] for r in first] == ["greedy", "sampled", "sampled"]
    assert first[0]["text"] == out.text
    assert len({r["text"] for r in store.responses if r["kind"] == "sampled"}) > 1


def test_a_half_precision_store_holds_the_same_states_rounded(qwen_target, videos, store, tmp_path):
    bf16 = StoreConfig(**{**_fields(STORE), "disk_dtype": "bfloat16"})
    half = build_store(qwen_target, _samples(videos[:1]), tmp_path, bf16)
    half = FeatureStore(half.parent)
    for i in range(len(half)):
        assert half.responses[i]["id"] == store.responses[i]["id"]
        a, b = half.signals(i, qwen_target.lm_head()), store.signals(i, qwen_target.lm_head())
        torch.testing.assert_close(a.features, b.features, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(a.final_hidden, b.final_hidden, atol=2e-2, rtol=1e-2)
    shard = next(tmp_path.glob("shard_*.safetensors")).stat().st_size
    assert shard < 0.6 * next(store.path.glob("shard_*.safetensors")).stat().st_size


def _fields(cfg):
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


def test_an_interrupted_build_goes_on_and_other_settings_are_refused(qwen_target, videos, tmp_path):
    samples = _samples(videos[:2]) + [Sample(b"not a video", "What happens?")]
    logs = []
    build_store(qwen_target, samples, tmp_path, STORE, log=logs.append)
    assert len(logs) == 3 and "skipped" in logs[2]
    full = FeatureStore(tmp_path)
    kept = (tmp_path / "shard_000000.safetensors").stat().st_mtime_ns
    (tmp_path / "shard_000001.safetensors").unlink()          # killed while writing the second video
    (tmp_path / "index.json").unlink()
    logs.clear()
    build_store(qwen_target, samples, tmp_path, STORE, log=logs.append)
    assert logs[0].startswith("video 2/3") and len(logs) == 2
    assert (tmp_path / "shard_000000.safetensors").stat().st_mtime_ns == kept
    again = FeatureStore(tmp_path)
    assert [r["id"] for r in again.responses] == [r["id"] for r in full.responses]
    for i in range(len(again)):
        head = qwen_target.lm_head()
        assert torch.equal(again.signals(i, head).features, full.signals(i, head).features)
    with pytest.raises(InvalidRequest, match="other settings"):
        build_store(qwen_target, samples, tmp_path, StoreConfig(**{**_fields(STORE), "sampled": 1}))


def test_training_on_the_store_lowers_the_loss(qwen_target, store):
    trainer = DraftTrainer.fresh(qwen_target, store, CFG, log=lambda _: None)
    assert trainer.draft.config.feature_layers == store.feature_layers
    fixed = trainer.signals(0)

    def loss():
        with torch.no_grad():
            return float(trainer.sample_loss(fixed)[0])

    before = loss()
    trainer.fit()
    assert loss() < before - 0.05
    # the same with the top-k teacher, and what the draft reads must be what the store holds
    topk = DraftTrainer.fresh(qwen_target, store, TrainConfig(**{**_fields(CFG), "topk": 4}), log=lambda _: None)
    first = topk.train_step().loss
    for _ in range(10):
        last = topk.train_step().loss
    assert last < first
    greedy = DraftTrainer.fresh(qwen_target, store, TrainConfig(**{**_fields(CFG), "store_responses": "greedy"}))
    assert len(greedy.samples) == 6 and {r["kind"] for r in greedy.samples.responses} == {"greedy"}
    with pytest.raises(InvalidRequest, match="not among the stored budgets"):
        DraftTrainer.fresh(qwen_target, store, TrainConfig(**{**_fields(CFG), "bridge_tokens": 4}))
    with pytest.raises(InvalidRequest, match="feature layers"):
        DraftTrainer.fresh(qwen_target, store, TrainConfig(**{**_fields(CFG), "feature_layers": (1, 2)}))
    with pytest.raises(InvalidRequest, match="train it online"):
        DraftTrainer.fresh(qwen_target, store, TrainConfig(**{**_fields(CFG), "context": "all"}))


def test_a_store_with_visual_entries_trains_a_draft_that_reads_every_token(qwen_target, videos, tmp_path):
    """Built with `visual`, a store also keeps each prompt's entries with its visual tokens in
    prompt order: an EAGLE-style draft (context "all") reads from it what online distillation's
    teacher-forced forward gives it, and trains on it (the same store as the Sparrow draft's)."""
    visual = StoreConfig(**{**_fields(STORE), "visual": True, "sampled": 0})
    build_store(qwen_target, _samples(videos[:1] + videos[2:]), tmp_path, visual)
    store, head = FeatureStore(tmp_path), qwen_target.lm_head()
    assert store.visual
    compared = 0
    for i, r in enumerate(store.responses):
        c = store.contexts[r["context"]]
        v, p = (int(x) for x in c["id"][1:].split("p"))
        sig = store.signals(i, head, "all")
        text = store.signals(i, head)               # the Sparrow draft's reading of the same record
        assert sig.num_visual == c["num_visual"] > 0 and sig.num_prompt == text.num_prompt + sig.num_visual
        assert torch.equal(sig.token_ids[sig.num_prompt:], text.token_ids[text.num_prompt:])
        video = Engine(qwen_target, spec=SpecConfig(method="none")).process_video((videos[:1] + videos[2:])[v], OPTIONS)
        ref = target_signals(qwen_target, video, PROMPTS[p], sig.token_ids[sig.num_prompt:].tolist(),
                             store.feature_layers, store.header["bridge_layer"], context="all")
        assert torch.equal(sig.token_ids, ref.token_ids) and (sig.num_prompt, sig.num_visual) == (ref.num_prompt,
                                                                                                  ref.num_visual)
        torch.testing.assert_close(sig.features, ref.features, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(sig.logits, ref.logits, atol=1e-4, rtol=1e-4)
        compared += 1
    assert compared == 4
    eagle = DraftTrainer.fresh(qwen_target, store, TrainConfig(**{**_fields(CFG), "context": "all", "bridge_tokens": 0}),
                               log=lambda _: None)
    first = eagle.train_step().loss
    for _ in range(10):
        last = eagle.train_step().loss
    assert last < first
    with pytest.raises(InvalidRequest, match="--visual"):           # a store without them says how to get them
        FeatureStore(tmp_path).signals(0, head, "pruned")


def test_length_balance_draws_each_video_length_alike(qwen_target, store):
    lengths = [store.contexts[r["context"]]["visual_tokens"] for r in store.responses]
    short = np.array([n == min(lengths) for n in lengths])
    assert len({int(np.log2(n)) for n in lengths}) == 2 and short.sum() > len(short) / 2     # two length buckets
    uniform, even = store.length_weights(0.0), store.length_weights(1.0)
    assert abs(uniform[short].sum() - short.mean()) < 1e-9 and abs(even[short].sum() - 0.5) < 1e-9
    trainer = DraftTrainer.fresh(qwen_target, store, TrainConfig(**{**_fields(CFG), "length_balance": 1.0}))
    drawn = [short[trainer._next_index()] for _ in range(30 * len(store))]
    assert abs(sum(drawn) / len(drawn) - 0.5) < 0.05


def test_topk_teacher_keeps_the_head_of_the_targets_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    full, top2, hard = teacher_probs(logits), teacher_probs(logits, 2), teacher_probs(logits, 1)
    torch.testing.assert_close(full, torch.softmax(logits, -1))
    torch.testing.assert_close(top2, torch.tensor([[full[0, 0] / (full[0, 0] + full[0, 1]),
                                                    full[0, 1] / (full[0, 0] + full[0, 1]), 0.0, 0.0, 0.0]]))
    assert torch.equal(hard, torch.tensor([[1.0, 0, 0, 0, 0]]))
