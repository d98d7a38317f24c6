"""The target's verify steps: grouped-query attention without K/V copies, same numbers."""

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from sparrow import Engine, SpecConfig
from sparrow.models import gqa
PROMPT = "What happens in the video?"


def _verify_logits(target, video, n: int, ragged: bool = True):
    """n tokens on top of the prompt's cache: through the engine's ragged verify, or through
    the HF model's own forward (its attention implementation, its mask)."""
    inputs = Engine(target, spec=SpecConfig(method="none")).prepare(video, PROMPT)
    pre = target.prefill(inputs, inputs["input_ids"].shape[1] + n + 1)
    tokens = torch.arange(10, 10 + n)
    if ragged:
        return target.step(pre.state, tokens)[0]
    st = pre.state
    position_ids = target.family.step_positions(st.length, n, st.rope_delta)
    with torch.inference_mode():
        return target.hf(input_ids=tokens.view(1, n), position_ids=position_ids, cache=st.kv,
                         use_cache=True).logits[0].float()


@pytest.mark.parametrize("n", [1, 5])
def test_packed_verify_equals_transformers_sdpa_without_copying_the_cache(any_target, large_video, monkeypatch, n):
    text = any_target.hf.config.get_text_config()
    assert text.num_key_value_heads < text.num_attention_heads          # the tiny targets are grouped-query
    assert text._attn_implementation == gqa.NAME                        # TargetModel switched it
    copies = []
    real = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, g: copies.append(x.shape) or real(x, g))
    ours = _verify_logits(any_target, large_video, n)
    assert copies == []                                                 # the cache was read in place
    try:
        any_target.hf.set_attn_implementation({"text_config": "sdpa"})
        theirs = _verify_logits(any_target, large_video, n, ragged=False)
    finally:
        any_target.hf.set_attn_implementation({"text_config": gqa.NAME})
    assert (len(copies) > 0) == (n > 1)                                 # transformers copies K/V for n > 1
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_packed_attention_matches_repeated_heads_on_random_inputs():
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    mask = torch.ones(2, 1, 4, 11, dtype=torch.bool).tril(diagonal=7)
    mask[1, :, :, :2] = False                                           # per-row padding differs
    ours, _ = gqa.grouped_sdpa(module, q, k, v, mask, scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), attn_mask=mask, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(ours, ref)
