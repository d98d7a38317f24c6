"""Verify attention that reads each cached key once for all of a step's query rows, and builds
no mask over the cached prefix.

A verify step scores nq new tokens (a chain, or a draft tree) on top of P cached keys. Every
new token sees all P of them; only the last nq columns of its mask vary. One SDPA call with
the whole (G*nq, P + nq) mask (the "sdpa" path, ragged.py) pays for that mask every layer:
building it, SDPA turning the bool mask into a float one (~1 ms a layer at 25k keys and 13
tokens on the 2-core CPU), and the masked kernel's slower inner loop. Here:

    rows     the G query heads of kv head h are rows r = g * nq + i of one matrix,
             qg (B, Hkv, G*nq, D): one pass over kv head h's keys serves all G*nq rows (GQA
             without repeat_kv copies)
    prefix   all rows see all P cached keys: ONE unmasked attention call returning the rows'
             normalised outputs o_p and log-sum-exps lse_p (CPU: the compiled kernel of
             cpu_prefix.py, or torch's flash-attention op `_scaled_dot_product_flash_attention_for_cpu`
             where it is off or not built; elsewhere fp32 matmuls)
    own      the nq new keys: scores s (G*nq, nq) plus the tree's additive bias (0 / -inf)
    merge    a softmax over [lse_p, s] gives the prefix's total weight w_p and the new keys'
             weights w_o: out = w_p * o_p + w_o @ v_own, exact (o_p is already normalised)

A ragged batch (several requests, each over its own cache) on a CPU takes all of them in one
call of the compiled kernel a layer (verify_attention_ragged: per request the split above, in
C++), where one call a request costs ~70 us of mostly per-call overhead at 0.5k keys.

A decode step (nq = 1) sees every key: one unmasked call (on a CPU the prefix kernel's, over
the prefix and its own key: measured 5-30% under SDPA's from 0.5k to 25k keys). Up to DENSE_PREFIX cached keys one
call with a float mask made once per step (the layers share it) is cheaper than the split's
extra small ops. Contract (shapes, scale 1/sqrt(D), the new tokens' keys right after the
prefix): reference.py.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from . import autotune, cpu_prefix
from .reference import chain_tree

_NEG_INF = float("-inf")
# At most this many cached keys, one SDPA call with a float (G*nq, P + nq) mask costs less than
# the split: its ~10 extra small ops (~0.1 ms a layer) outweigh the mask until ~8k keys, and at
# 16k+ the masked kernel is the slower one (1.3x at 16k, 1.75x at 25k with 13 tokens). Measured
# on the 2-core CPU, one thread, 2 kv heads of dim 32 (kernels/README.md).
DENSE_PREFIX = 8192
# A ragged batch on a CPU: every request of a layer in one call of the compiled kernel
# (verify_attention_ragged) where that was measured faster than one call a request for the
# batch's shape (ragged_form, or forced). Off (or SPARROW_VERIFY_ONE_CALL=0): one call a request
# (verify_attention_packed's paths).
FORCED_PATH = autotune.FORCED
ONE_CALL = os.environ.get("SPARROW_VERIFY_ONE_CALL", "1").strip() != "0"
# A step calls the attention once per layer with the same new-token mask: what is made from it
# is kept for the next call. A tree is matched by value (a copy is kept); a dense mask by its
# bias's identity, which the entry holds, so a freed tensor's reused id cannot match. Entries are
# replaced whole and read once, so threads sharing them at worst miss.
_chain_bias: dict[tuple, torch.Tensor] = {}      # (nq, group, device) -> (G*nq, nq)
_last_tree: list = [None]                        # (tree copy, group, bias)
_last_dense: list = [None]                       # (bias, prefix_len, dense mask)


def own_bias(tree: torch.Tensor | None, nq: int, group: int, device: torch.device) -> torch.Tensor:
    """(G*nq, nq) fp32 additive mask of the new tokens among themselves: 0 where row r = g*nq + i
    sees new token j (tree[i, j]; None: a chain), -inf elsewhere."""
    if tree is None:
        key = (nq, group, str(device))
        if key not in _chain_bias:
            _chain_bias[key] = own_bias(chain_tree(nq, device), nq, group, device)
        return _chain_bias[key]
    tree = tree.to(device=device, dtype=torch.bool)
    last = _last_tree[0]                                 # one read: other threads may replace it
    if last is not None and last[1] == group and last[0].shape == tree.shape and last[0].device == tree.device \
            and torch.equal(last[0], tree):
        return last[2]
    bias = torch.zeros(nq, nq, device=device).masked_fill_(~tree, _NEG_INF).repeat(group, 1)
    _last_tree[0] = (tree.clone(), group, bias)
    return bias


def dense_mask(bias: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """(G*nq, P + nq) fp32 additive mask: the prefix seen by every row, then `bias`."""
    last = _last_dense[0]
    if last is not None and last[0] is bias and last[1] == prefix_len:
        return last[2]
    mask = torch.cat([bias.new_zeros(bias.shape[0], prefix_len), bias], dim=1)
    _last_dense[0] = (bias, prefix_len, mask)
    return mask


try:     # a private op (torch >= 2.3): without it the CPU takes the matmul path below
    _FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
except (AttributeError, RuntimeError):
    _FLASH_CPU = None


def prefix_partial(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float, kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of every row over all of k/v: outputs (B, Hkv, R, Dv) in q's dtype or
    fp32 and log-sum-exps (B, Hkv, R) fp32. qg (B, Hkv, R, D); k, v (B, Hkv, P >= 1, D). On a CPU
    the compiled kernel (cpu_prefix.py; torch's flash op where it is off or not built, or not `kernel`)."""
    if qg.device.type == "cpu" and kernel:
        done = cpu_prefix.prefix_attention(qg, k, v, scale)
        if done is not None:
            return done
    if qg.device.type == "cpu" and _FLASH_CPU is not None:
        return _FLASH_CPU(qg, k, v, scale=scale)[:2]
    scores = torch.matmul(qg.float(), k.float().transpose(-1, -2)).mul_(scale)       # (B, Hkv, R, P)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(scores.sub_(lse).exp_(), v.float()).to(qg.dtype), lse.squeeze(-1)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                     bias: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """q (B, H, nq, D), the new tokens; k, v (B, Hkv, >= prefix_len + nq, D), the cache with the
    new tokens' keys at rows prefix_len .. prefix_len + nq - 1 (rows after them are ignored);
    every batch row has this prefix_len. bias: own_bias(...) (None: a chain). -> (B, H, nq, Dv).
    On a CPU the path (PATHS) is the one measured fastest for this shape on this machine
    (kernels/autotune.py), today's rule until it is measured."""
    nq, group = q.shape[2], q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bias = own_bias(None, nq, group, q.device) if bias is None and nq > 1 else bias
    path = cpu_path(q, k, prefix_len) if q.device.type == "cpu" else None
    return run_path(path or default_path(q, prefix_len), q, k, v, prefix_len, bias, scale)


# The CPU's paths: "dense" one SDPA call (with the float mask made once a step when nq > 1);
# "flash" the split with the prefix by torch's CPU flash op; "kernel" the split with the prefix by
# the compiled kernel (cpu_prefix.py). A decode step (nq = 1) needs no split: the one call's op.
PATHS = ("dense", "flash", "kernel")
# Timings are of cold caches since 2026-11-30 (_bench): choices kept from warm timings are not read.
TUNER = autotune.tuner("verify attention", lambda: autotune.store_path(cpu_prefix.EXTENSION.build_name,
                                                                        kind="attention-cold"))
# At most this many caches a timing cycles through (_bench): 25k keys of the world target are ~13 MB a set.
COLD_SETS = 64


_WITHOUT_KERNEL = tuple(p for p in PATHS if p != "kernel" and (p != "flash" or _FLASH_CPU is not None))
_WITH_KERNEL = (*_WITHOUT_KERNEL, "kernel")


def cpu_paths() -> tuple[str, ...]:
    """The paths that can serve on this CPU now (the kernel once it is built; the first ask starts
    its build, in a process of its own)."""
    if cpu_prefix.ready():
        return _WITH_KERNEL
    cpu_prefix.start_loading()
    return _WITHOUT_KERNEL


_DTYPES: dict[torch.dtype, str] = {}


def shape_key(q: torch.Tensor, k: torch.Tensor, prefix_len: int) -> tuple:
    """(dtype, head dim, kv heads, group, batch, rows bucket, keys bucket): what a path's speed depends on."""
    bsz, heads, nq, dim = q.shape
    hkv = k.shape[1]
    dtype = _DTYPES.get(q.dtype) or _DTYPES.setdefault(q.dtype, str(q.dtype))
    return (dtype, dim, hkv, heads // hkv, bsz, autotune.rows_bucket(nq), autotune.keys_bucket(prefix_len + nq))


def cpu_path(q: torch.Tensor, k: torch.Tensor, prefix_len: int) -> str | None:
    """The measured (or forced) path for this shape; None until measured (the worker times it)."""
    return TUNER.choice(shape_key(q, k, prefix_len), cpu_paths(),
                        functools.partial(_bench, tuple(q.shape), tuple(k.shape), q.dtype, prefix_len))


@functools.lru_cache(maxsize=1)
def cold_bytes() -> int:
    """How many bytes of caches a timing cycles through: twice this CPU's last-level cache (64 MiB
    where it cannot be read), so every timed call reads its keys from memory, as a serving step does."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return 2 * max(sizes) if sizes else 64 << 20


def _bench(q_shape: tuple, k_shape: tuple, dtype: torch.dtype, prefix_len: int):
    """Inputs of this shape (made from shapes alone: a queued measurement holds no live cache),
    then a runner of each path over them. The runners take the next of several caches each call,
    as many as fill cold_bytes() (at most COLD_SETS): a serving step reads every request's every
    layer between two reads of one, so its keys come from memory, not from a cache the last call
    warmed. Timed warm, the paths that read the keys more than once looked as fast as the one that
    reads them once: at 8k keys and 5 tokens dense 0.50 ms against the kernel's 0.43, where in the
    engine (8 streams) dense took 0.83; cold, dense 0.83 against 0.60 (2-core EPYC, one thread)."""
    nq, group = q_shape[2], q_shape[1] // k_shape[1]
    g = torch.Generator().manual_seed(0)
    qq = torch.randn(q_shape, generator=g).to(dtype)
    kv_shape = (k_shape[0], k_shape[1], prefix_len + nq, k_shape[-1])
    per_set = 2 * math.prod(kv_shape) * torch.empty((), dtype=dtype).element_size()
    keys, values = torch.randn(kv_shape, generator=g).to(dtype), torch.randn(kv_shape, generator=g).to(dtype)
    copies = min(COLD_SETS, -(-cold_bytes() // per_set))        # enough sets to fill cold_bytes(), rounded up
    sets = [(keys, values)] + [(keys.clone(), values.clone()) for _ in range(copies - 1)]
    b = own_bias(None, nq, group, qq.device) if nq > 1 else None
    scale = q_shape[-1] ** -0.5
    turn = itertools.count()

    def runner(name: str):
        def run():
            kk, vv = sets[next(turn) % len(sets)]
            return run_path(name, qq, kk, vv, prefix_len, b, scale)
        return run
    return runner


def default_path(q: torch.Tensor, prefix_len: int) -> str:
    """The rule where nothing is measured yet: torch's ops only (the one dense call over short
    caches and every decode step, torch's flash op past DENSE_PREFIX). The compiled kernel serves
    only where it was measured fastest on this machine: tuned on one CPU, it was 3-10x slower than
    torch's ops on another (BENCHMARKS.md, attention paths)."""
    if q.shape[2] == 1 or prefix_len <= DENSE_PREFIX:
        return "dense"
    return "flash"


def run_path(path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
             bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """packed_attention by one path (PATHS); a path that does not apply here falls to the next one
    that does (kernel -> flash -> matmuls)."""
    bsz, heads, nq, dim = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    rows = heads // hkv * nq
    qg = q.reshape(bsz, hkv, rows, dim)                 # heads of one kv head are adjacent rows
    if nq == 1:                  # a decode step sees every key: no mask, no split, no log-sum-exp
        end = prefix_len + 1
        k_all, v_all = k.narrow(2, 0, end), v.narrow(2, 0, end)
        done = cpu_prefix.prefix_attention(qg, k_all, v_all, scale) if path == "kernel" else None
        if done is not None:     # the CPU kernel: 0.73 ms a layer at 25k keys where SDPA takes 1.04 (EPYC)
            return done[0].to(q.dtype).view(bsz, heads, 1, dv)
        if path == "flash" and _FLASH_CPU is not None and q.device.type == "cpu":
            return _FLASH_CPU(qg, k_all, v_all, scale=scale)[0].to(q.dtype).view(bsz, heads, 1, dv)
        return F.scaled_dot_product_attention(qg, k_all, v_all, scale=scale).view(bsz, heads, 1, dv)
    if path == "dense":
        end = prefix_len + nq
        mask = dense_mask(bias, prefix_len).to(q.dtype)
        return F.scaled_dot_product_attention(qg, k.narrow(2, 0, end), v.narrow(2, 0, end), attn_mask=mask,
                                              scale=scale).view(bsz, heads, nq, dv)
    k_own = k.narrow(2, prefix_len, nq).reshape(bsz * hkv, nq, dim).float()
    v_own = v.narrow(2, prefix_len, nq).reshape(bsz * hkv, nq, dv).float()
    scores = torch.baddbmm(bias, qg.reshape(bsz * hkv, rows, dim).float(), k_own.transpose(1, 2), alpha=scale)
    if prefix_len == 0:                                 # nothing cached (torch's CPU op fails on 0 keys)
        return torch.bmm(torch.softmax(scores, dim=-1), v_own).to(q.dtype).view(bsz, heads, nq, dv)
    o_p, lse_p = prefix_partial(qg, k.narrow(2, 0, prefix_len), v.narrow(2, 0, prefix_len), scale,
                                kernel=path == "kernel")
    # softmax over [the prefix as one entry of weight exp(lse_p), the own keys]: (B*Hkv, rows, 1 + nq)
    w_p, w_o = torch.softmax(torch.cat([lse_p.reshape(bsz * hkv, rows, 1), scores], dim=-1), dim=-1).split([1, nq], -1)
    out = torch.baddbmm(o_p.reshape(bsz * hkv, rows, dv).float() * w_p, w_o, v_own)          # (B*Hkv, rows, Dv)
    return out.to(q.dtype).view(bsz, heads, nq, dv)


def verify_attention_ragged(query: torch.Tensor, views: list[tuple[torch.Tensor, torch.Tensor]],
                            bounds: list[tuple[int, int]], trees: list[torch.Tensor | None],
                            forms: dict | None = None) -> torch.Tensor | None:
    """A ragged batch's step for one layer in one call (models/ragged.py): request s is rows
    bounds[s] = (start, end) of the packed queries (1, Hq, N, D), over its views[s] = (k, v), its
    cache with the new rows last, among which it sees trees[s] (None: causal). -> (1, N, Hq, Dv)
    in q's dtype; None where no one-call kernel applies (off the CPU, or cpu_prefix not built) or
    one call a request was measured faster for this batch (ragged_form). `forms`: the step's
    choices so far (RaggedBatch keeps one a step), so that every layer of a step with the same
    heads and dtype takes the form its first layer took, asked once (ragged_form costs ~40 us)."""
    if not ONE_CALL or query.device.type != "cpu" or not cpu_prefix.ready():
        return None
    if FORCED_PATH not in (None, "kernel"):
        return None
    if FORCED_PATH != "kernel" and _step_form(query, views, bounds, forms) != "one":
        return None
    out = cpu_prefix.ragged_attention(query, [k for k, _ in views], [v for _, v in views], [b[0] for b in bounds],
                                      [b[1] for b in bounds], trees, query.shape[-1] ** -0.5)
    return None if out is None else out.to(query.dtype).unsqueeze(0)


# How a ragged batch's layer is served on a CPU: "one" call of the compiled kernel for every
# request, or "each" request by its own measured path (packed_attention). The one call saves a
# handful of torch calls a request (~70 us each, mostly per-call overhead, at 0.5k keys): measured
# on a 2-core EPYC with cold caches (benchmarks.attention_paths), 8 requests of 5 rows over 0.5k
# keys took 0.44 ms in one call against 0.71 ms by dense SDPA a request, where the kernel alone a
# request (0.11 ms) loses to dense (0.08 ms), so choosing the one call by the per-request path's
# timing kept 48 calls a step at 0.5k.
RAGGED_FORMS = ("one", "each")


def batch_bucket(n: int) -> int:
    """Requests in a ragged batch by bucket: powers of two."""
    return 1 << max(n - 1, 0).bit_length()


def ragged_form(query: torch.Tensor, views: list[tuple[torch.Tensor, torch.Tensor]],
                bounds: list[tuple[int, int]]) -> str:
    """"one" or "each" for this batch: measured (RAGGED_FORMS) per the longest request's shape
    and the batch's size bucket; until measured, the rule before measuring: one call where the
    kernel is the longest request's own measured path."""
    longest = max(range(len(views)), key=lambda s: views[s][0].shape[2])
    (start, end), k = bounds[longest], views[longest][0]
    rows = max(e - s for s, e in bounds)
    q = query[:, :, start:end]
    prefix = k.shape[2] - (end - start)
    own = cpu_path(q, k, prefix)         # measured before the batch (one worker, in order): "each" runs it
    key = (*shape_key(q, k, prefix)[:-2], autotune.rows_bucket(rows), autotune.keys_bucket(prefix + rows),
           batch_bucket(len(views)))
    chosen = TUNER.choice(("ragged", *key), RAGGED_FORMS, functools.partial(
        _bench_ragged, tuple(q.shape[:2]) + (rows, q.shape[-1]), tuple(k.shape[:2]) + (k.shape[-1],),
        q.dtype, prefix, batch_bucket(len(views))))
    if chosen is not None:
        return chosen
    return "one" if own == "kernel" else "each"


def _step_form(query: torch.Tensor, views: list[tuple[torch.Tensor, torch.Tensor]], bounds: list[tuple[int, int]],
               forms: dict | None) -> str:
    """ragged_form, asked once a step for each layer shape (`forms`: the step's memo; None: ask)."""
    if forms is None:
        return ragged_form(query, views, bounds)
    k = views[0][0]
    shape = (query.shape[1], query.shape[-1], k.shape[1], views[0][1].shape[-1], query.dtype, k.dtype)
    if shape not in forms:
        forms[shape] = ragged_form(query, views, bounds)
    return forms[shape]


def _bench_ragged(q_shape: tuple, kv_shape: tuple, dtype: torch.dtype, prefix_len: int, requests: int):
    """`requests` chains of q_shape's rows over prefix_len cached keys each, packed as a ragged
    batch: "one" runs them in one call, "each" by packed_attention a request (each request's
    measured path). The requests' caches are drawn in turn from a pool that fills cold_bytes()
    (as _bench: read from memory, as in a serving step), and no bigger: a request's cache past
    that size is read cold anyway, so a long batch reuses one cache rather than holding
    `requests` of them (8 requests over 25k keys of a 7B-shaped layer would be ~1.6 GB)."""
    (_, heads, nq, dim), (_, hkv, dv) = q_shape, kv_shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, nq * requests, dim, generator=g).to(dtype)
    shape = (1, hkv, prefix_len + nq, dim)
    per_request = 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pool = [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(min(requests * COLD_SETS, max(1, -(-cold_bytes() // per_request))))]
    bounds = [(r * nq, (r + 1) * nq) for r in range(requests)]
    starts, ends, causal = [b[0] for b in bounds], [b[1] for b in bounds], [None] * requests
    turn = itertools.count()

    def runner(name: str):
        def run():
            first = next(turn) * requests
            views = [pool[(first + r) % len(pool)] for r in range(requests)]
            if name == "one":
                return cpu_prefix.ragged_attention(q, [k for k, _ in views], [v for _, v in views], starts, ends,
                                                   causal, dim ** -0.5)
            return [packed_attention(q[:, :, s:e], k, v, prefix_len) for (s, e), (k, v) in zip(bounds, views)]
        return run
    return runner


def verify_attention_packed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_lens: torch.Tensor,
                            tree: torch.Tensor | None = None, prefix_len: int | None = None) -> torch.Tensor:
    """Packed verify attention; the contract of reference.verify_attention_ref. (B, H, nq, D).
    prefix_len: the prefix length of every batch row, known on the host (no read of prefix_lens);
    None: rows may differ, each is computed with its own (read from prefix_lens)."""
    nq, group = q.shape[2], q.shape[1] // k_cache.shape[1]
    if prefix_len is not None or q.shape[0] == 1:
        if tree is not None and tree.dim() == 3:
            tree = tree[0] if tree.shape[0] == 1 else tree
        if tree is None or tree.dim() == 2:
            bias = own_bias(tree, nq, group, q.device) if tree is not None else None
            length = prefix_len if prefix_len is not None else int(prefix_lens[0])
            return packed_attention(q, k_cache, v_cache, length, bias)
    rows = []
    for b, length in enumerate(prefix_lens.tolist()):                  # ragged prefixes: row by row
        t = None if tree is None else (tree if tree.dim() == 2 else tree[b])
        bias = own_bias(t, nq, group, q.device) if t is not None else None
        rows.append(packed_attention(q[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1], length, bias))
    return torch.cat(rows)
