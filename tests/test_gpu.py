"""What only a CUDA device can check: the kernels compiled (Triton for real, not its
interpreter; FlexAttention through torch.compile) and the draft step captured as a CUDA graph.
On a machine without CUDA every test here skips with its reason; `make gpu-check` lists them.
(The bf16 lossless tests run on CUDA too: tests/test_bf16.py with SPARROW_TEST_DEVICE=cuda.)"""

import importlib.util

import pytest
import torch

from sparrow import SpecConfig
from sparrow.kernels.reference import verify_attention_ref, window_attention_ref
from sparrow.models.draft import DraftKV
from sparrow.tiny import tiny_draft, tiny_target
from test_kernels import verify_case, window_case, window_keys

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
BF16 = dict(atol=3e-2, rtol=3e-2)


def _cuda(*tensors, dtype=None):
    """To CUDA (floating tensors to `dtype` when given); None (a chain's tree) stays None."""
    return [None if t is None else t.cuda() if not t.is_floating_point() or dtype is None else t.to("cuda", dtype)
            for t in tensors]


@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_kernels_match_reference(dtype):
    from sparrow.kernels.triton_attention import verify_attention_triton, window_attention_triton

    q, k, v, q_pos, k_pos, k_pinned, window = window_case("multi_query_gqa", ragged=True)
    ref = window_attention_ref(q, k, v, q_pos, k_pos, k_pinned, window)
    got = window_attention_triton(*_cuda(q, k, v, q_pos, k_pos, k_pinned, dtype=dtype), window)
    torch.testing.assert_close(got.float().cpu(), ref, **BF16)
    q, k, v, prefix, tree = verify_case(3)
    ref = verify_attention_ref(q, k, v, prefix, tree)
    for splits in (1, 4):
        got = verify_attention_triton(*_cuda(q, k, v, prefix, tree, dtype=dtype), splits)
        torch.testing.assert_close(got.float().cpu(), ref, **BF16)


@needs_cuda
def test_cuda_flex_compiled_matches_reference():
    from sparrow.kernels.flex import verify_attention_flex, window_attention_flex

    q, k, v, q_pos, k_pos, k_pinned, window = window_case("decode", ragged=True)
    ref = window_attention_ref(q, k, v, q_pos, k_pos, k_pinned, window)
    got = window_attention_flex(*_cuda(q, k, v, q_pos, k_pos, k_pinned), window, compile=True)
    torch.testing.assert_close(got.cpu(), ref, atol=2e-4, rtol=2e-4)
    q, k, v, prefix, tree = verify_case(0)
    got = verify_attention_flex(*_cuda(q, k, v, prefix, tree), compile=True)
    torch.testing.assert_close(got.cpu(), verify_attention_ref(q, k, v, prefix, tree), atol=2e-4, rtol=2e-4)


@needs_cuda
def test_cuda_graph_draft_step_matches_forward_entries():
    from benchmarks.draft_graph import DraftDecodeStep

    target = tiny_target("qwen2_5_vl", seed=0)
    target.hf.to("cuda")
    spec = SpecConfig(adaptive_k=False, window=6, anchors=5, glimpse=2)
    draft = tiny_draft(target, seed=2).to("cuda")
    step = DraftDecodeStep(draft, capacity=24, window=spec.window)
    assert step.graph is not None                                  # really captured
    pos, pinned = window_keys(2, 5, (20, 25))
    z = torch.randn(12, draft.config.hidden_size, generator=torch.Generator().manual_seed(1)).cuda()
    kv = draft.new_kv(16)
    with torch.inference_mode():
        hidden = draft.forward_entries(z, pos.cuda(), pinned.cuda(), kv, spec.window)[-1:]
        step.load(kv)
        for j in range(3):
            token = torch.tensor([7 + j], device="cuda")
            want = draft.forward_entries(draft.inputs_from_draft(token, hidden), torch.tensor([25 + j], device="cuda"),
                                         torch.zeros(1, dtype=torch.bool, device="cuda"), kv, spec.window)
            got, logits = step.step(token, hidden, 25 + j)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(logits, draft.logits(want), atol=1e-3, rtol=1e-3)
            hidden = want.clone()
