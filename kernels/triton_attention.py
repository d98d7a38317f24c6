"""Triton kernels for the draft window and the verify step (contract: reference.py).

One split-KV attention kernel serves three ways of saying which keys a query sees:

    MODE_MASK     an explicit (nq, nk) bool mask: the registry signature the draft calls today
    MODE_WINDOW   the window rule from positions (q_pos, k_pos, k_pinned, window), computed in
                  registers: only O(nk) metadata is read, never an (nq, nk) mask
    MODE_VERIFY   a cached prefix of length L[b] seen by all, then the (nq, nq) tree mask

A program owns BLOCK_M query rows of one (batch, kv head) and one split of the keys. The
GROUP query heads that share a kv head are stacked as rows (r = g * nq + i), so a decode
step with 1 query still fills a 16-row tl.dot and each key is loaded once per kv head.
With several splits each program writes a partial (out, log-sum-exp) and `_combine_kernel`
merges them (split_kv.py derives the merge); with one split it writes the output directly.

CPU: kernels run only under Triton's interpreter (TRITON_INTERPRET=1 set before triton is
first imported), and there a bf16 tl.dot is wrong, so CPU inputs are upcast to fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .reference import PAD_POS, chain_tree
from .split_kv import split_size

MODE_MASK, MODE_WINDOW, MODE_VERIFY = 0, 1, 2
LOG2E = 1.4426950408889634
_PAD_POS = tl.constexpr(PAD_POS)   # jit code reads globals only as constexpr


@triton.jit
def _visible(MODE: tl.constexpr, b, qi, kj, row_ok, key_ok, n_q, window,
             MASK, sm_q, sm_k, QPOS, sqp_b, KPOS, KPIN, skp_b, PREFIX, TREE, st_b, st_q):
    """(BLOCK_M, BLOCK_N) bool: query rows qi may see keys kj (both already range-checked)."""
    ok = row_ok[:, None] & key_ok[None, :]
    if MODE == 0:                                        # MODE_MASK (jit code sees no plain-int globals)
        m = tl.load(MASK + qi[:, None] * sm_q + kj[None, :] * sm_k, mask=ok, other=0)
        vis = m != 0
    elif MODE == 1:                                      # MODE_WINDOW
        qp = tl.load(QPOS + b * sqp_b + qi, mask=row_ok, other=0)                       # (BM,)
        kp = tl.load(KPOS + b * skp_b + kj, mask=key_ok, other=_PAD_POS)                 # (BN,)
        pin = tl.load(KPIN + b * skp_b + kj, mask=key_ok, other=0) != 0                 # (BN,)
        causal = kp[None, :] <= qp[:, None]
        vis = causal & (pin[None, :] | (kp[None, :] > qp[:, None] - window))
    else:                                                # MODE_VERIFY
        rel = kj - tl.load(PREFIX + b)                    # (BN,) index among the draft tokens, <0: prefix
        in_draft = (rel >= 0) & (rel < n_q)
        t = tl.load(TREE + b * st_b + qi[:, None] * st_q + rel[None, :], mask=ok & in_draft[None, :], other=0)
        vis = (rel < 0)[None, :] | (t != 0)
    return vis & ok


@triton.jit
def _attn_split_kernel(
        Q, K, V, O, O_PART, LSE_PART,
        MASK, QPOS, KPOS, KPIN, PREFIX, TREE,
        sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n,
        sm_q, sm_k, sqp_b, skp_b, st_b, st_q,
        n_q, n_k, n_kv_heads, window, keys_per_split, scale_log2,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr,
        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, pid_bh, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, hk = (pid_bh // n_kv_heads).to(tl.int64), pid_bh % n_kv_heads     # int64: b * stride may pass 2**31
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                # (BM,) r = g * nq + i
    row_ok = rows < GROUP * n_q
    qi, h = rows % n_q, hk * GROUP + rows // n_q                  # query index, query head
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + b * sq_b + h[:, None] * sq_h + qi[:, None] * sq_n + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)                          # (BM, BD)

    n_keys = n_k
    if MODE == 2:                                                 # MODE_VERIFY
        n_keys = tl.load(PREFIX + b) + n_q                        # ragged: this row's prefix + drafts
    lo = pid_s * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n_keys)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)           # running max score (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)                         # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)                # running sum of p v
    for start in range(lo, hi, BLOCK_N):
        kj = start + tl.arange(0, BLOCK_N)
        key_ok = kj < hi
        kt = tl.load(K + b * sk_b + hk * sk_h + kj[None, :] * sk_n + d[:, None],
                     mask=d_ok[:, None] & key_ok[None, :], other=0.0)                     # (BD, BN)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2                        # (BM, BN)
        vis = _visible(MODE, b, qi, kj, row_ok, key_ok, n_q, window,
                       MASK, sm_q, sm_k, QPOS, sqp_b, KPOS, KPIN, skp_b, PREFIX, TREE, st_b, st_q)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)     # nothing seen yet: exp2 stays 0, not NaN
        p = tl.exp2(s - m_use[:, None])                                                   # (BM, BN)
        alpha = tl.exp2(m_i - m_use)                              # rescales what earlier blocks summed
        v = tl.load(V + b * sv_b + hk * sv_h + kj[:, None] * sv_n + d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)                      # (BN, BD)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]                 # a row that saw nothing: zeros
    if SPLIT:
        n_split = tl.num_programs(2)
        part = ((b * n_kv_heads * GROUP + h) * n_q + qi) * n_split + pid_s                # (BM,)
        tl.store(O_PART + part[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))      # (BM,) log2 units
        tl.store(LSE_PART + part, lse, mask=row_ok)
    else:
        tl.store(O + b * so_b + h[:, None] * so_h + qi[:, None] * so_n + d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(O_PART, LSE_PART, O, n_q, n_heads, n_split, so_b, so_h, so_n,
                    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)                                        # (b * H + h) * nq + i
    b, h, qi = row // (n_heads * n_q), (row // n_q) % n_heads, row % n_q
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok, d_ok = s < n_split, d < HEAD_DIM
    lse = tl.load(LSE_PART + row * n_split + s, mask=s_ok, other=float("-inf"))          # (BS,) log2 units
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))                               # (BS,)
    part = tl.load(O_PART + (row * n_split + s[:, None]) * HEAD_DIM + d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)                        # (BS, BD)
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(den > 0, den, 1.0)                      # (BD,)
    tl.store(O + b * so_b + h * so_h + qi * so_n + d, out.to(O.dtype.element_ty), mask=d_ok)


# ----- host side ------------------------------------------------------------------------------------

# TRITON_INTERPRET is read when a function is decorated: for these kernels at this module's
# import, for triton.language's own helpers (tl.zeros, tl.sum...) at triton's first import,
# which torch._dynamo triggers early. Both must have seen it for the interpreter to work.
INTERPRETED = not isinstance(_attn_split_kernel, triton.runtime.JITFunction)
_LANGUAGE_INTERPRETED = not isinstance(tl.zeros, triton.runtime.JITFunction)


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cpu":
        return
    if not INTERPRETED:
        raise RuntimeError("Triton kernels run on CUDA tensors, or on CPU only under Triton's interpreter: "
                           "set TRITON_INTERPRET=1 before triton is first imported")
    if not _LANGUAGE_INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was first imported (torch._dynamo imports "
                           "it): set it before importing torch's compiler stack, e.g. at the top of conftest.py")


def _dot_safe(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The interpreter computes bf16/fp16 tl.dot wrongly: on CPU run in fp32 (caller casts back)."""
    if ts[0].device.type == "cpu" and ts[0].dtype != torch.float32:
        ts = [t.float() for t in ts]
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]     # the kernel assumes unit stride in D


def default_num_splits(programs: int, n_keys: int, device: torch.device, min_keys: int = 256) -> int:
    """Enough splits that programs x splits covers the device twice over, each split >= min_keys.
    (Interpreter: one split per 4k keys; programs run one after another, extra ones only cost.)"""
    if device.type != "cuda":
        return max(1, min(64, n_keys // 4096))
    units = torch.cuda.get_device_properties(device).multi_processor_count
    want = math.ceil(2 * units / max(1, programs))
    return max(1, min(want, math.ceil(n_keys / min_keys), 64))


def _blocks(rows: int, dim: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D). tl.dot needs every side >= 16. The interpreter pays per block
    in Python, so there key blocks are large; on a GPU 64 keys keep registers in bounds."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    block_n = 64 if device.type == "cuda" else 256
    return block_m, block_n, max(16, triton.next_power_of_2(dim))


def _launch(q, k, v, mode: int, n_keys: int, num_splits: int | None, meta: dict, window: int = 0) -> torch.Tensor:
    """Run the split kernel (+ combine). q (B, H, nq, D); k, v (B, Hkv, >=n_keys, D) -> (B, H, nq, D).
    n_keys: keys of the longest row (the grid covers it; shorter rows' extra programs exit at once)."""
    _check_device(q)
    bsz, heads, nq, dim = q.shape
    hkv = k.shape[1]
    group = heads // hkv
    out_dtype = q.dtype
    q, k, v = _dot_safe(q, k, v)
    block_m, block_n, block_d = _blocks(group * nq, dim, q.device)
    m_blocks = triton.cdiv(group * nq, block_m)
    splits = num_splits or default_num_splits(m_blocks * bsz * hkv, n_keys, q.device)
    per_split = split_size(max(1, n_keys), splits, block_n)
    splits = max(1, triton.cdiv(n_keys, per_split))
    out = torch.empty(bsz, heads, nq, dim, device=q.device, dtype=q.dtype)          # (B, H, nq, D)
    o_part = lse_part = out                                       # placeholders when not split
    if splits > 1:
        o_part = torch.empty(bsz, heads, nq, splits, dim, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(bsz, heads, nq, splits, device=q.device, dtype=torch.float32)
    _attn_split_kernel[(m_blocks, bsz * hkv, splits)](
        q, k, v, out, o_part, lse_part,
        meta["mask"], meta["q_pos"], meta["k_pos"], meta["k_pinned"], meta["prefix"], meta["tree"],
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        *meta["mask_strides"], meta["q_pos_stride"], meta["k_pos_stride"], *meta["tree_strides"],
        nq, n_keys, hkv, window, per_split, dim ** -0.5 * LOG2E,
        GROUP=group, HEAD_DIM=dim, MODE=mode, SPLIT=splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d)
    if splits > 1:
        _combine_kernel[(bsz * heads * nq,)](
            o_part, lse_part, out, nq, heads, splits, *out.stride()[:3],
            HEAD_DIM=dim, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d)
    return out.to(out_dtype)


def _meta(dummy: torch.Tensor, **given) -> dict:
    """Kernel metadata with unused pointers pointing at `dummy` and unused strides 0."""
    meta = dict(mask=dummy, q_pos=dummy, k_pos=dummy, k_pinned=dummy, prefix=dummy, tree=dummy,
                mask_strides=(0, 0), q_pos_stride=0, k_pos_stride=0, tree_strides=(0, 0))
    meta.update(given)
    return meta


def _batched(meta: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """(n,) shared or (B, n) per row -> contiguous tensor and its batch stride (0 when shared)."""
    meta = meta.to(dtype).contiguous()
    return meta, (0 if meta.dim() == 1 else meta.stride(0))


def masked_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The registry signature: q (B, H, nq, D); k, v (B, Hkv, nk, D); mask (nq, nk) bool."""
    mask = mask.contiguous().view(torch.uint8)     # same bytes; the kernel reads bytes, not i1
    meta = _meta(mask, mask=mask, mask_strides=mask.stride())
    return _launch(q, k, v, MODE_MASK, k.shape[2], 1, meta)


def window_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                            k_pos: torch.Tensor, k_pinned: torch.Tensor, window: int) -> torch.Tensor:
    """Draft window attention from positions (contract: reference.window_attention_ref).
    Keys are few (anchors + window + glimpse), so one split: no combine pass."""
    qp, sqp = _batched(q_pos, torch.int64)
    kp, skp = _batched(k_pos, torch.int64)
    pin, _ = _batched(k_pinned, torch.uint8)
    meta = _meta(qp, q_pos=qp, k_pos=kp, k_pinned=pin, q_pos_stride=sqp, k_pos_stride=skp)
    return _launch(q, k, v, MODE_WINDOW, k.shape[2], 1, meta, window=window)


def verify_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_lens: torch.Tensor,
                            tree: torch.Tensor | None = None, num_splits: int | None = None,
                            max_keys: int | None = None) -> torch.Tensor:
    """Split-KV verify attention (contract: reference.verify_attention_ref). num_splits None:
    chosen to fill the device. The grid covers max_keys keys per row; None reads
    max(prefix_lens) + nq on the host (a sync). For CUDA-graph capture pass num_splits and
    max_keys = the cache capacity: rows shorter than that leave their extra programs idle."""
    bsz, _, nq, _ = q.shape
    tree = chain_tree(nq, q.device) if tree is None else tree
    tree = tree.expand(bsz, nq, nq).contiguous().view(torch.uint8)   # (B, nq, nq): tiny, copied per call
    prefix = prefix_lens.to(torch.int64).contiguous()
    n_keys = max_keys if max_keys is not None else int(prefix.max()) + nq
    meta = _meta(prefix, prefix=prefix, tree=tree, tree_strides=tree.stride()[:2])
    return _launch(q, k_cache, v_cache, MODE_VERIFY, n_keys, num_splits, meta)
