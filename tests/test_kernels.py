"""sparrow.kernels against their plain-torch references, and the engine with every backend.

What must hold: every implementation of the draft window and the verify attention equals
the reference within float tolerance on random shapes and on the edge cases (window longer
than the sequence, zero glimpse, one anchor, ragged lengths, GQA, odd head dims, one query);
the engine's greedy output is the target's, token for token, whatever the backend.

Triton runs in its interpreter on CPU: TRITON_INTERPRET=1 must be set before triton is
first imported, and torch._dynamo imports it while conftest loads the tiny models, so it
belongs at the top of conftest.py (or in the environment). Without triton, or with the
variable set too late, the Triton tests are skipped with the reason.
"""

import importlib.util
import os

import pytest
import torch

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.kernels.reference import (PAD_POS, attend, chain_tree, verify_attention_ref,
                                       verify_mask, window_attention_ref)
from sparrow.kernels.split_kv import (combine_splits, split_partials, split_size,
                                      verify_attention_split)
from sparrow.models.attention import available_backends, get_backend
from sparrow.models.draft import DraftArchitecture
from sparrow.tiny import tiny_draft
from sparrow.anchored_window import window_mask


def _triton_unusable() -> str | None:
    """None when the Triton kernels can run in this process, else the reason they cannot."""
    if importlib.util.find_spec("triton") is None:
        return "triton not installed (pip install -c constraints.txt 'sparrow[kernels]'): Triton parity unchecked"
    if torch.cuda.is_available():
        return None
    os.environ.setdefault("TRITON_INTERPRET", "1")          # enough if nothing imported triton yet
    import triton
    import triton.language as tl
    if isinstance(tl.zeros, triton.runtime.JITFunction):
        return ("triton was imported before TRITON_INTERPRET=1 was set (torch._dynamo imports it): "
                "set it at the top of tests/conftest.py or in the environment")
    return None


TRITON_SKIP = _triton_unusable()
HAS_TRITON = TRITON_SKIP is None
# Where the Triton kernels run: compiled on a CUDA device when there is one (make gpu-check),
# else on CPU tensors under the interpreter. Results come back to the CPU for comparison.
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on(*tensors):
    return [None if t is None else t.to(KERNEL_DEVICE) for t in tensors]


def _kernel_target(cpu_target, backend: str):
    """The target a test runs a Triton backend with: the session's CPU target, or on a CUDA
    machine a copy of it on the GPU (compiled Triton needs CUDA tensors)."""
    if backend != "triton" or KERNEL_DEVICE.type == "cpu":
        return cpu_target
    import copy
    target = copy.deepcopy(cpu_target)
    target.hf.to(KERNEL_DEVICE)
    return target
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=str(TRITON_SKIP))
FP32 = dict(atol=2e-5, rtol=1e-4)


def _tri():
    from sparrow.kernels import triton_attention
    return triton_attention


def _flex():
    from sparrow.kernels import flex
    return flex


# ----- cases --------------------------------------------------------------------------------------

def window_keys(glimpse: int, anchors: int, recent: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft key set as the proposer builds it: glimpse (pos -1) and anchors 0..A-1, both
    pinned, then unpinned recent positions [lo, hi). Returns pos (n,), pinned (n,)."""
    pos = torch.cat([torch.full((glimpse,), -1), torch.arange(anchors), torch.arange(*recent)])
    pinned = torch.arange(pos.shape[0]) < glimpse + anchors
    return pos, pinned


def pad_rows(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged key sets -> (B, n_max) pos / pinned, padded with PAD_POS (seen by no query)."""
    n = max(p.shape[0] for p, _ in rows)
    pos = torch.full((len(rows), n), PAD_POS)
    pinned = torch.zeros(len(rows), n, dtype=torch.bool)
    for b, (p, pin) in enumerate(rows):
        pos[b, :p.shape[0]], pinned[b, :p.shape[0]] = p, pin
    return pos, pinned


# name: (glimpse, anchors, recent span, queries, window, heads, kv heads, head dim)
WINDOW_CASES = {
    "decode": (4, 8, (20, 52), 1, 32, 4, 2, 16),
    "multi_query_gqa": (3, 10, (30, 70), 5, 24, 8, 2, 32),
    "window_longer_than_sequence": (2, 5, (5, 17), 4, 1000, 4, 4, 16),
    "zero_glimpse": (0, 6, (40, 90), 3, 16, 4, 1, 24),
    "one_anchor": (0, 1, (60, 100), 4, 8, 2, 1, 64),
    "no_anchor_no_glimpse_one_query": (0, 0, (0, 9), 1, 4, 4, 2, 16),
}


def window_case(name: str, dtype=torch.float32, batch: int = 2, ragged: bool = False):
    glimpse, anchors, (lo, hi), nq, window, heads, hkv, dim = WINDOW_CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))      # not hash(): salted per process
    # ragged: row b has 3b more recent keys; the last nq keys of a row are its queries' own
    rows = [window_keys(glimpse, anchors, (lo, hi + (3 * b if ragged else 0))) for b in range(batch)]
    if ragged:
        k_pos, k_pinned = pad_rows(rows)                                                  # (B, nk)
        q_pos = torch.stack([p[-nq:] for p, _ in rows])                                   # (B, nq)
    else:
        (k_pos, k_pinned), q_pos = rows[0], rows[0][0][-nq:]                             # (nk,), (nq,)
    q = torch.randn(batch, heads, nq, dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, hkv, k_pos.shape[-1], dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v, q_pos, k_pos, k_pinned, window


def random_tree(nq: int, g: torch.Generator) -> torch.Tensor:
    """(nq, nq) ancestor mask of a random tree in topological order (parent index < child)."""
    tree = torch.eye(nq, dtype=torch.bool)
    for i in range(1, nq):
        parent = int(torch.randint(-1, i, (1,), generator=g))
        if parent >= 0:
            tree[i] |= tree[parent]
    return tree


def verify_case(seed: int, dtype=torch.float32):
    """Verify shapes that cycle with the seed through GQA ratios, head dims (incl. 24: not a
    power of two), batch sizes, chain / tree and a first prefix of 0, 1, 300 or 1023 tokens;
    the other rows' prefixes are random (ragged)."""
    g = torch.Generator().manual_seed(seed)
    heads, hkv = [(4, 4), (4, 2), (8, 1)][seed % 3]
    dim, nq, bsz = [16, 24, 64][(seed + seed // 3) % 3], [1, 3, 5, 6][seed % 4], 1 + seed % 3
    prefix = torch.randint(0, 900, (bsz,), generator=g)
    prefix[0] = [0, 1, 300, 1023][seed % 4]
    capacity = int(prefix.max()) + nq + 7                       # a preallocated cache, partly filled
    q = torch.randn(bsz, heads, nq, dim, generator=g).to(dtype)
    k, v = (torch.randn(bsz, hkv, capacity, dim, generator=g).to(dtype) for _ in range(2))
    tree = random_tree(nq, g) if seed % 2 else None
    return q, k, v, prefix, tree


# ----- plain torch: references against each other ----------------------------------------------

@pytest.mark.parametrize("name", WINDOW_CASES)
@pytest.mark.parametrize("ragged", [False, True])
def test_window_reference_gathers_what_the_dense_mask_allows(name, ragged):
    q, k, v, q_pos, k_pos, k_pinned, window = window_case(name, ragged=ragged)
    got = window_attention_ref(q, k, v, q_pos, k_pos, k_pinned, window)
    for b in range(q.shape[0]):     # the dense rule over all keys, one row at a time
        row = (lambda t: t if t.dim() == 1 else t[b])
        mask = window_mask(row(q_pos), row(k_pos), row(k_pinned), window)
        torch.testing.assert_close(got[b:b + 1], attend(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask), **FP32)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_kv_torch_matches_sdpa(seed, num_splits):
    q, k, v, prefix, tree = verify_case(seed)
    ref = verify_attention_ref(q, k, v, prefix, tree)
    torch.testing.assert_close(verify_attention_split(q, k, v, prefix, tree, num_splits), ref, **FP32)


def test_split_combine_ignores_empty_splits_and_zero_rows():
    out = torch.randn(2, 3, 4)                                  # (rows, S, D)
    lse = torch.tensor([[0.5, float("-inf"), 1.0], [float("-inf")] * 3])
    merged = combine_splits(out, lse)
    w = torch.softmax(torch.tensor([0.5, 1.0]), 0)
    torch.testing.assert_close(merged[0], w[0] * out[0, 0] + w[1] * out[0, 2])
    assert torch.equal(merged[1], torch.zeros(4))               # saw nothing: zeros, not NaN


def test_split_partials_are_each_splits_own_softmax():
    q, k, v, prefix, tree = verify_case(11)
    tree = chain_tree(q.shape[2]) if tree is None else tree
    out, lse = split_partials(q, k, v, prefix, tree, 4)          # (B, H, nq, S, D), (B, H, nq, S)
    size = split_size(int(prefix.max()) + q.shape[2], 4)
    for s, lo in enumerate(range(0, out.shape[-2] * size, size)):
        idx = torch.arange(lo, min(lo + size, int(prefix.max()) + q.shape[2]))
        mask = verify_mask(prefix, tree, idx).unsqueeze(1)                               # (B, 1, nq, c)
        torch.testing.assert_close(out[..., s, :], attend(q, k[:, :, idx], v[:, :, idx], mask), **FP32)
        group = q.shape[1] // k.shape[1]
        scores = q @ k[:, :, idx].repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
        torch.testing.assert_close(lse[..., s], scores.masked_fill(~mask, float("-inf")).logsumexp(-1), **FP32)


def test_bf16_reference_close_to_fp32():
    q, k, v, prefix, tree = verify_case(3)
    ref = verify_attention_ref(q, k, v, prefix, tree)
    got = verify_attention_split(q.bfloat16(), k.bfloat16(), v.bfloat16(), prefix, tree, 3)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=3e-2)


# ----- Triton (interpreter on CPU) ----------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("name", WINDOW_CASES)
@pytest.mark.parametrize("ragged", [False, True])
def test_triton_window_matches_reference(name, ragged):
    q, k, v, q_pos, k_pos, k_pinned, window = window_case(name, ragged=ragged)
    ref = window_attention_ref(q, k, v, q_pos, k_pos, k_pinned, window)
    got = _tri().window_attention_triton(*_on(q, k, v, q_pos, k_pos, k_pinned), window)
    torch.testing.assert_close(got.cpu(), ref, **FP32)


@needs_triton
@pytest.mark.parametrize("seed", range(6))
def test_triton_verify_matches_sdpa(seed):
    q, k, v, prefix, tree = verify_case(seed)
    ref = verify_attention_ref(q, k, v, prefix, tree)
    # one split writes directly; several go through the combine kernel; a grid sized by the
    # cache capacity (no host read of the lengths, as CUDA-graph capture needs) idles extra programs
    for splits, max_keys in ((1, None), (3, None), (4, k.shape[2])):
        got = _tri().verify_attention_triton(*_on(q, k, v, prefix, tree), splits, max_keys=max_keys)
        torch.testing.assert_close(got.cpu(), ref, **FP32)


@needs_triton
def test_triton_registry_signature_with_explicit_mask():
    q, k, v, q_pos, k_pos, k_pinned, window = window_case("multi_query_gqa", batch=1)
    mask = window_mask(q_pos, k_pos, k_pinned, window)
    mask[1] = False                                              # a query that sees nothing: zeros
    got = get_backend("triton")(*_on(q, k, v, mask)).cpu()
    torch.testing.assert_close(got, attend(q, k, v, mask), **FP32)
    assert torch.equal(got[:, :, 1], torch.zeros_like(got[:, :, 1]))


@needs_triton
def test_triton_bf16_inputs():
    """bf16 in, bf16 out (computed in fp32: the interpreter's bf16 tl.dot is wrong)."""
    q, k, v, prefix, tree = verify_case(4)
    ref = verify_attention_ref(q, k, v, prefix, tree)
    got = _tri().verify_attention_triton(*_on(q.bfloat16(), k.bfloat16(), v.bfloat16(), prefix, tree), 2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), ref, atol=3e-2, rtol=3e-2)


# ----- FlexAttention (eager on CPU: compiling costs seconds per shape) ---------------------------

@pytest.mark.parametrize("name", ["decode", "window_longer_than_sequence", "one_anchor"])
def test_flex_window_matches_reference(name):
    q, k, v, q_pos, k_pos, k_pinned, window = window_case(name, ragged=True)
    ref = window_attention_ref(q, k, v, q_pos, k_pos, k_pinned, window)
    torch.testing.assert_close(_flex().window_attention_flex(q, k, v, q_pos, k_pos, k_pinned, window), ref, **FP32)


@pytest.mark.parametrize("seed", [0, 2])
def test_flex_verify_matches_sdpa(seed):
    q, k, v, prefix, tree = verify_case(seed)
    ref = verify_attention_ref(q, k, v, prefix, tree)
    torch.testing.assert_close(_flex().verify_attention_flex(q, k, v, prefix, tree), ref, **FP32)


# ----- registry, draft, engine ----------------------------------------------------------------------

def test_registry_names_and_errors():
    assert {"sdpa", "eager", "flex"} <= set(available_backends())
    assert ("triton" in available_backends()) == (importlib.util.find_spec("triton") is not None)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("no_such_backend")
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash_attn" not in available_backends()
        with pytest.raises(ImportError, match="flash_attn"):
            get_backend("flash_attn")


def _backends() -> list[str]:
    return ["eager", "flex"] + (["triton"] if HAS_TRITON else [])


def test_draft_hidden_states_match_sdpa_with_every_backend(qwen_target):
    """Glimpse + anchors + window entries, then 3 drafted ones, through the real draft."""
    spec = SpecConfig(adaptive_k=False, window=6, anchors=5, glimpse=2)
    pos, pinned = window_keys(2, 5, (20, 25))                     # 12 context entries
    outs = {}
    for name in ["sdpa"] + _backends():
        draft = tiny_draft(_kernel_target(qwen_target, name), seed=0)
        dev = draft.fuse.weight.device
        z = torch.randn(12, draft.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dev)
        draft.attention_backend, kv = name, draft.new_kv(16)
        with torch.inference_mode():
            first = draft.forward_entries(z, pos.to(dev), pinned.to(dev), kv, spec.window)
            steps = [draft.forward_entries(z[i:i + 1], torch.tensor([25 + i], device=dev),
                                           torch.zeros(1, dtype=torch.bool, device=dev), kv, spec.window)
                     for i in range(3)]
        outs[name] = torch.cat([first] + steps).cpu()
    for name in _backends():
        torch.testing.assert_close(outs[name], outs["sdpa"], atol=1e-4, rtol=1e-4)


def _hf_greedy(target, engine, video, prompt: str, n: int) -> list[int]:
    inputs = engine.prepare(video, prompt)
    out = target.hf.generate(**inputs, do_sample=False, max_new_tokens=n)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_engine_greedy_output_is_the_targets_with_every_backend(qwen_target, small_video):
    prompt = "What happens in the video?"
    reference = None
    for name in ["sdpa"] + _backends():
        spec = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=8, anchors=16, glimpse=2)
        target = _kernel_target(qwen_target, name)
        engine = Engine(target, tiny_draft(target, DraftArchitecture(attention_backend=name), seed=1), spec)
        reference = reference or _hf_greedy(target, engine, small_video, prompt, 12)
        out = engine.generate(small_video, prompt, SamplingParams(max_new_tokens=12))
        assert out.token_ids == reference, name
        assert out.metrics.draft_tokens > 0


@pytest.mark.parametrize("backend", ["sdpa"] + (["triton"] if HAS_TRITON else []))
def test_static_decode_step_matches_forward_entries(qwen_target, backend):
    """The CUDA-graph-ready step (run eagerly here) computes what the draft computes."""
    spec = SpecConfig(adaptive_k=False, window=6, anchors=5, glimpse=2)
    draft = tiny_draft(_kernel_target(qwen_target, backend), DraftArchitecture(attention_backend=backend), seed=2)
    dev = draft.fuse.weight.device
    from benchmarks.draft_graph import DraftDecodeStep
    step = DraftDecodeStep(draft, capacity=24, window=spec.window)
    assert (step.graph is None) == (dev.type == "cpu")            # no CUDA: eager fallback; CUDA: captured
    pos, pinned = window_keys(2, 5, (20, 25))
    z = torch.randn(12, draft.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dev)
    kv = draft.new_kv(16)
    tol = dict(atol=1e-5, rtol=1e-5) if dev.type == "cpu" else dict(atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        hidden = draft.forward_entries(z, pos.to(dev), pinned.to(dev), kv, spec.window)[-1:]             # (1, H)
        step.load(kv)
        for j in range(3):
            token = torch.tensor([7 + j], device=dev)
            want = draft.forward_entries(draft.inputs_from_draft(token, hidden), torch.tensor([25 + j], device=dev),
                                         torch.zeros(1, dtype=torch.bool, device=dev), kv, spec.window)
            got, logits = step.step(token, hidden, 25 + j)
            torch.testing.assert_close(got, want, **tol)
            torch.testing.assert_close(logits, draft.logits(want), atol=1e-4 if dev.type == "cpu" else 1e-3,
                                       rtol=1e-4 if dev.type == "cpu" else 1e-3)
            hidden = want


def _verify_kernels() -> list[str]:
    return ["split"] + (["triton"] if HAS_TRITON else [])


@pytest.mark.parametrize("kernel", ["split", "triton"])
def test_target_tree_verify_with_each_verify_kernel(qwen_target, small_video, kernel):
    """The target's own verify step (a batch of a decode, a chain and a draft tree, ragged)
    through each verify kernel == through ragged SDPA; then the engine's tree decoding with
    the kernel == HF greedy."""
    if kernel == "triton" and not HAS_TRITON:
        pytest.skip(str(TRITON_SKIP))
    from sparrow.models.prefill import TargetState
    from sparrow.models.kv_cache import new_kv_cache
    from sparrow.speculative.tree import DraftTree

    target = _kernel_target(qwen_target, kernel)
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=3, tree_width=2, tree_branch=2, tree_budget=6)
    engine = Engine(target, tiny_draft(target, seed=1), spec)
    inputs = engine.prepare(small_video, "What happens?")
    dev = target.device
    tree = DraftTree(torch.tensor([5, 6, 7, 8], device=dev), torch.zeros(4, 1, device=dev),
                     parents=torch.tensor([-1, -1, 0, 1], device=dev))
    tokens = [torch.tensor(t, device=dev) for t in ([3], [3, 4, 5, 6], [3, 5, 6, 7, 8])]

    def run(name: str):
        target.verify_attention = name
        states = []
        for _ in tokens:
            pre = target.prefill(inputs, inputs["input_ids"].shape[1] + 16)
            states.append(pre.state)
        logits, _ = target.verify(states, tokens, trees=[None, None, tree])
        return logits

    before = target.verify_attention
    try:
        ref = run("sdpa")
        got = run(kernel)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a.cpu(), b.cpu(), atol=1e-4, rtol=1e-4)
        reference = _hf_greedy(target, engine, small_video, "What happens?", 12)
        out = engine.generate(small_video, "What happens?", SamplingParams(max_new_tokens=12))
        assert out.token_ids == reference and out.metrics.draft_tokens > 0
    finally:
        target.verify_attention = before
    with pytest.raises(ValueError, match="unknown verify attention"):
        target.verify_attention = "no_such_kernel"
