"""The target's verify attention paths against the reference, and greedy decoding through each
against HF greedy.

What must hold: every path ("packed" with one masked call for a short prefix and with the
prefix/own split, the ragged SDPA "sdpa", "split", "triton" under its interpreter) computes the
reference attention (kernels/reference.py) within float tolerance for chains, trees, ragged
batches of different cached lengths, GQA and not; in the model, a ragged batch of a decode, a
chain and a tree on caches of different lengths gets the same logits through every path; and
the engine's greedy output through "packed" is HF's, chains and trees, both families.
"""

import pytest
import torch
from helpers import OracleProposer, ragged_step_inputs
from test_kernels import FP32, HAS_TRITON, random_tree, verify_case

import sparrow.kernels.packed as packed
from sparrow.kernels import cpu_prefix
from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.kernels.packed import verify_attention_packed
from sparrow.kernels.reference import verify_attention_ref
from sparrow.models.ragged import ragged_attention
from sparrow.tiny import tiny_draft, tiny_target

PROMPT = "What happens in the video?"


@pytest.fixture(params=["dense", "split"])
def packed_mode(request, monkeypatch):
    """"packed" one call a request as it runs at these short prefixes (one masked call), or forced
    to split the prefix from the new tokens at every length (what it does past DENSE_PREFIX keys)."""
    monkeypatch.setattr(packed, "ONE_CALL", False)
    if request.param == "split":
        monkeypatch.setattr(packed, "DENSE_PREFIX", -1)
    return request.param


@pytest.fixture(params=["dense", "split", "one-call"])
def step_mode(request, monkeypatch):
    """packed_mode's two, or every request of a layer in one call of the compiled CPU kernel
    (forced here; unforced it serves where the tuner measured it fastest; skipped where it
    cannot be built)."""
    one_call = request.param == "one-call"
    if one_call:
        if cpu_prefix.load() is None:
            pytest.skip("the CPU kernel is not built on this machine")
        monkeypatch.setattr(cpu_prefix, "IMPL", "kernel")
        monkeypatch.setattr(packed, "FORCED_PATH", "kernel")      # unforced: only where measured fastest
    monkeypatch.setattr(packed, "ONE_CALL", one_call)
    if request.param == "split":
        monkeypatch.setattr(packed, "DENSE_PREFIX", -1)
    done, real = [], cpu_prefix.ragged_attention

    def counted(*args):
        out = real(*args)
        done.append(out is not None)
        return out
    monkeypatch.setattr(cpu_prefix, "ragged_attention", counted)
    return request.param, done


def _one_call(q, k, v, prefix, tree):
    """The batch as a ragged batch through verify_attention_ragged: row b's queries are rows
    b * nq .. of one packed query, its keys a view of its cache up to prefix + nq."""
    bsz, heads, nq, dim = q.shape
    packed_q = q.transpose(0, 1).reshape(1, heads, bsz * nq, dim)
    views = [(k[b:b + 1, :, :p + nq], v[b:b + 1, :, :p + nq]) for b, p in enumerate(prefix.tolist())]
    trees = [None if tree is None else (tree if tree.dim() == 2 else tree[b]) for b in range(bsz)]
    out = packed.verify_attention_ragged(packed_q, views, [(b * nq, b * nq + nq) for b in range(bsz)], trees)
    return None if out is None else out[0].view(bsz, nq, heads, -1).transpose(1, 2)


def _ragged_sdpa(q, k, v, prefix, tree):
    """The "sdpa" path (ragged_attention) under the kernel contract: one batch row at a time."""
    nq = q.shape[2]
    rows = [ragged_attention(q[b:b + 1], k[b:b + 1, :, :p + nq], v[b:b + 1, :, :p + nq], None,
                             None if tree is None else (tree if tree.dim() == 2 else tree[b]))
            for b, p in enumerate(prefix.tolist())]
    return torch.cat(rows)


# ----- the attention alone ------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_packed_and_ragged_sdpa_match_the_reference(seed, packed_mode, monkeypatch):
    """verify_case cycles GQA 1:1 / 2:1 / 8:1, head dims 16/24/64, chains and trees, batches of
    1-3 rows with ragged prefixes (the first 0, 1, 300 or 1023 tokens)."""
    q, k, v, prefix, tree = verify_case(seed)
    ref = verify_attention_ref(q, k, v, prefix, tree)
    torch.testing.assert_close(verify_attention_packed(q, k, v, prefix, tree), ref, **FP32)
    torch.testing.assert_close(_ragged_sdpa(q, k, v, prefix, tree), ref, **FP32)
    if cpu_prefix.load() is not None:                      # every row in one call of the CPU kernel
        monkeypatch.setattr(packed, "ONE_CALL", True)
        monkeypatch.setattr(cpu_prefix, "IMPL", "kernel")
        monkeypatch.setattr(packed, "FORCED_PATH", "kernel")
        torch.testing.assert_close(_one_call(q, k, v, prefix, tree), ref, **FP32)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_packed_prefix_by_matmuls_matches_the_reference(seed, monkeypatch):
    """The prefix's partial softmax without torch's CPU flash op (GPUs, or a torch without it)."""
    monkeypatch.setattr(packed, "DENSE_PREFIX", -1)
    monkeypatch.setattr(packed, "_FLASH_CPU", None)
    q, k, v, prefix, tree = verify_case(seed)
    torch.testing.assert_close(verify_attention_packed(q, k, v, prefix, tree),
                               verify_attention_ref(q, k, v, prefix, tree), **FP32)


def test_packed_per_row_trees_and_host_prefix(packed_mode):
    """A tree per batch row (B, nq, nq); and the host-side prefix_len the engine passes (every
    row the same length) instead of reading prefix_lens."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 8, 6, 32, generator=g)
    k, v = torch.randn(3, 2, 60, 32, generator=g), torch.randn(3, 2, 60, 32, generator=g)
    trees = torch.stack([random_tree(6, g) for _ in range(3)])
    prefix = torch.tensor([40, 0, 53])
    torch.testing.assert_close(verify_attention_packed(q, k, v, prefix, trees),
                               verify_attention_ref(q, k, v, prefix, trees), **FP32)
    same = torch.tensor([41, 41, 41])
    torch.testing.assert_close(verify_attention_packed(q, k, v, same, trees[1], prefix_len=41),
                               verify_attention_ref(q, k, v, same, trees[1]), **FP32)


def test_packed_masks_kept_for_the_next_layer_follow_the_step(packed_mode):
    """The masks made for one call are kept for the step's next layer: a call with another
    prefix length, step size or tree (even the same tensor changed in place) must not reuse them."""
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 80, 16, generator=g), torch.randn(1, 2, 80, 16, generator=g)
    tree = random_tree(4, g)
    other = tree.clone()
    other[3] = torch.tensor([True, False, False, True])
    cases = [(30, 4, None), (30, 4, None), (31, 4, None), (31, 3, None), (0, 3, None),
             (30, 4, tree), (30, 4, tree), (30, 4, other), (31, 4, other), (31, 4, tree), "change tree", (31, 4, tree)]
    for case in cases:
        if case == "change tree":
            tree[3] = ~tree[3]
            tree[3, 3] = True
            continue
        p, nq, t = case
        q = torch.randn(1, 4, nq, 16, generator=g)
        prefix = torch.tensor([p])
        torch.testing.assert_close(verify_attention_packed(q, k, v, prefix, t, prefix_len=p),
                                   verify_attention_ref(q, k, v, prefix, t), **FP32)


def test_packed_bf16_close_to_fp32(packed_mode):
    q, k, v, prefix, tree = verify_case(7)
    got = verify_attention_packed(q.bfloat16(), k.bfloat16(), v.bfloat16(), prefix, tree)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), verify_attention_ref(q, k, v, prefix, tree), atol=3e-2, rtol=3e-2)


# ----- in the target -----------------------------------------------------------------------------

def _paths() -> list[str]:
    return ["packed", "sdpa", "split"] + (["triton"] if HAS_TRITON else [])


def _ragged_step_logits(target, video, path: str) -> list[torch.Tensor]:
    """One forward over a decode, a chain and a tree, each on its own cache; the caches have
    different lengths (different prompts)."""
    states, tokens, trees = ragged_step_inputs(target, video)
    before = target.verify_attention
    try:
        target.verify_attention = path
        return target.verify(states, tokens, trees=trees)[0]
    finally:
        target.verify_attention = before


@pytest.mark.parametrize("grouped", [True, False])
def test_every_path_gives_the_same_logits_in_a_ragged_batch(qwen_target, llava_target, small_video, monkeypatch,
                                                             grouped):
    """Both families with grouped-query attention (2 query heads per kv head), and a target with
    one kv head per query head."""
    targets = [qwen_target, llava_target] if grouped else [tiny_target("qwen2_5_vl", seed=3, heads=1)]
    for target in targets:
        text = target.hf.config.get_text_config()
        assert (text.num_key_value_heads < text.num_attention_heads) == grouped
        ref = _ragged_step_logits(target, small_video, "sdpa")
        for path in _paths():
            modes = ["dense", "split"] + (["one-call"] if cpu_prefix.load() is not None else [])
            for mode in (modes if path == "packed" else ["dense"]):
                monkeypatch.setattr(packed, "DENSE_PREFIX", -1 if mode == "split" else packed.DENSE_PREFIX)
                monkeypatch.setattr(packed, "ONE_CALL", mode == "one-call")
                for got, want in zip(_ragged_step_logits(target, small_video, path), ref):
                    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            monkeypatch.undo()


def test_packed_is_the_cpu_default(qwen_target):
    assert qwen_target.verify_attention == "auto" and qwen_target.device.type == "cpu"
    assert qwen_target.step_kernel() is verify_attention_packed


_HF_GREEDY: dict[str, list[int]] = {}


def _hf_greedy(target, video, n: int) -> list[int]:
    key = target.hf.config.model_type
    if key not in _HF_GREEDY:
        inputs = Engine(target, spec=SpecConfig(method="none")).prepare(video, PROMPT)
        _HF_GREEDY[key] = target.hf.generate(**inputs, do_sample=False, max_new_tokens=n)[
            0, inputs["input_ids"].shape[1]:].tolist()
    return _HF_GREEDY[key]


def test_greedy_through_packed_is_hf_greedy(any_target, small_video, step_mode):
    """Chains of k + 1 = 5 tokens all accepted (an oracle draft) and none accepted (a corrupted
    one), and draft trees from a random draft: the tokens are HF's."""
    reference = _hf_greedy(any_target, small_video, 16)
    sampling = SamplingParams(max_new_tokens=16)
    chain = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=8, anchors=16)
    for corrupt in (False, True):
        oracle = OracleProposer(reference, corrupt=corrupt, vocab_size=any_target.vocab_size)
        out = Engine(any_target, spec=chain, proposer=oracle).generate(small_video, PROMPT, sampling)
        assert out.token_ids == reference
        assert (out.metrics.accepted_tokens == 0) == corrupt
    tree = SpecConfig(adaptive_k=False, num_draft_tokens=3, tree_width=2, tree_branch=2, tree_budget=6)
    out = Engine(any_target, tiny_draft(any_target, seed=1), tree).generate(small_video, PROMPT, sampling)
    assert out.token_ids == reference and out.metrics.draft_tokens > 0
    assert any_target.verify_attention == "auto"         # the default path ran
    mode, one_calls = step_mode
    assert (one_calls and all(one_calls)) if mode == "one-call" else not one_calls
