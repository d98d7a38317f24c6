"""The Sparrow draft's steps for a whole batch of requests, with static shapes, so they run
compiled: torch.compile on a CPU, CUDA graphs (torch.compile's "reduce-overhead") on a GPU.
The reference stays `SparrowDraft.forward_packed` over each request's own DraftKV.

Why: the draft is one small decoder layer over ~100 keys. Through the reference a k = 4
propose is hundreds of tiny torch ops per request (norms, rope, a mask per request and step,
a host read per step): its cost is per-op overhead, not arithmetic. Here one draft *level*
(R new rows per request: R = 1 for a chain, the tree width for a tree) is one function of
tensors whose shapes depend only on a bucket (B requests padded to the next batch bucket,
C key slots fixed per proposer):

    DraftBatch   per propose: the keys of B requests gathered once. Request b's committed
                 entries sit at slots [0, n_b); its drafted ones at slots every request
                 shares, S + (level - 1) * R + r (S = the longest committed cache), so a
                 level writes one slice; every other slot is at PAD_POS, seen by no query
    draft_level  one level: tokens (B, R) + the draft outputs they follow -> hidden (B, R, H),
                 logits (B, R, V) and the top token; writes its keys in place
    greedy_chain a whole chain at T=0; first, when given, the entries the last steps emitted
                 (the tokens with the target's features before each: what a commit runs),
                 so a step's commit and its next propose are one call
    DraftLevels  the buckets, the weights draft_level reads, the gather; compiled levels are
                 kept per shape for the process (compiled on first use, the time logged at INFO)

Nothing here reads a value on the host.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from sparrow.speculative.sampling import gumbel_noise
from sparrow.anchored_window import PAD_POS, window_mask
from sparrow.models.attention import get_backend
from sparrow.models.compiling import CPU_OPTIONS, GATE, compiled
from sparrow.models.draft import DraftKV, SparrowDraft, apply_rope, rope_frequencies, rope_tables

log = logging.getLogger(__name__)

# Batch sizes the compiled levels are built for: a batch runs in the next one up (its padding
# rows compute nothing anyone reads). Above the last, the proposer keeps the reference path.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Attention backends whose function takes a mask that broadcasts over a batch (B, 1, R, C).
STATIC_BACKENDS = ("sdpa", "eager")


def draft_kernel():
    """The C++ draft kernel (sparrow.kernels.draft_chain: the static levels for a small float32
    draft on a CPU), imported by name on first use as the verify kernels are (models/ragged.py):
    the core imports no kernel module."""
    if not _DRAFT_KERNEL:
        _DRAFT_KERNEL.append(importlib.import_module("sparrow.kernels.draft_chain"))
    return _DRAFT_KERNEL[0]


_DRAFT_KERNEL: list = []       # the module, once imported (an import_module call is ~4 us: a few a step)


class Dims(NamedTuple):
    """The draft's shape as draft_level reads it (plain values: a compiled level specializes on
    them, so two drafts of one shape share it)."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    window: int
    backend: str


# The draft's weights as draft_level reads them: q/k/v and gate/up concatenated (one matrix
# product each). Per layer: (input_norm, qkv_w, qkv_b, o_w, post_norm, gate_up_w, down_w).
LayerWeights = tuple[torch.Tensor, ...]
StepWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[LayerWeights, ...], torch.Tensor,
                    torch.Tensor]


def step_weights(draft: SparrowDraft) -> StepWeights:
    """(embed, fc, final norm, lm_head, per-layer weights, fuse, the rotary inverse frequencies),
    from the draft's own parameters and config."""
    embed, head = draft._shared[0].weight, draft._shared[1].weight
    layers = tuple((layer.input_norm.weight,
                    torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]),
                    torch.cat([layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias]),
                    layer.o_proj.weight, layer.post_norm.weight,
                    torch.cat([layer.gate_proj.weight, layer.up_proj.weight]), layer.down_proj.weight)
                   for layer in draft.layers)
    cfg = draft.config
    return (embed, draft.fc.weight, draft.norm.weight, head, layers, draft.fuse.weight,
            rope_frequencies(cfg.head_dim, cfg.rope_theta, draft.fc.weight.device))


def step_sources(draft: SparrowDraft) -> list[torch.Tensor]:
    """The parameters step_weights reads (the shared embedding and lm_head included)."""
    return [draft._shared[0].weight, draft._shared[1].weight, draft.fc.weight, draft.norm.weight, draft.fuse.weight,
            *(p for layer in draft.layers for p in layer.parameters())]


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """draft.RMSNorm in two ops (bit-identical to it in float32 and bfloat16; in float32 no casts,
    which are no-ops there but each a dispatch in an eager step)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def draft_logits(dims: Dims, w: StepWeights, hidden: torch.Tensor) -> torch.Tensor:
    """`SparrowDraft.logits` from the step's weights: (..., H) -> (..., V)."""
    return F.linear(_norm(hidden, w[2], dims.eps), w[3])


def draft_layers(dims: Dims, w: StepWeights, tokens: torch.Tensor, hidden: torch.Tensor, q_pos: torch.Tensor,
                 live: torch.Tensor, allowed: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                 pinned: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers of one level for B requests of R rows each: what
    `SparrowDraft.forward_packed` computes for them (z from each row's token and the state it
    follows, the layers under `window_mask`); every shape fixed by (B, R, C).

    tokens (B, R) long; hidden (B, R, H): the states they follow (a draft output; for an
    emitted entry the target's features through `fuse`); q_pos (B,) long: the level's position
    per request, or (B, R): each row's (PAD_POS: a row that does not run, a padding request);
    live (B, R) bool: the real rows; allowed (B, R, C) bool: a tree's ancestor rule over the
    drafted slots, each row's own slot included (all True for a chain: positions suffice);
    slots (R,) long: the key slots the rows write, the same for every request; pos (B, C) long,
    pinned (B, C) bool: every slot's position and pinned flag; keys, values: per layer
    (B, Hkv, C, D). Writes the rows' keys, values and positions at `slots`. Returns hidden
    (B, R, H) and the keys each live row attended to (B, R)."""
    b, r = tokens.shape
    embed, fc, layers = w[0], w[1], w[4]
    hq, hkv, d = dims.heads, dims.kv_heads, dims.head_dim
    if q_pos.dim() == 1:
        q_pos = q_pos[:, None].expand(b, r)
    pos.index_copy_(1, slots, q_pos)
    mask = window_mask(q_pos, pos, pinned, dims.window) & allowed                    # (B, R, C)
    seen = mask.sum(-1) * live                                                         # (B, R)
    cos, sin = rope_tables(q_pos, d, dims.rope_theta, hidden.dtype, w[6])            # (B, R, D)
    cos, sin = cos[:, None], sin[:, None]                                            # (B, 1, R, D)
    x = F.linear(torch.cat([F.embedding(tokens, embed), hidden], -1), fc)            # (B, R, H)
    attn = get_backend(dims.backend)
    # one request: the (nq, nk) mask every backend takes; a batch: (B, 1, R, C) (STATIC_BACKENDS)
    attn_mask = mask[0] if b == 1 else mask[:, None]
    for i, (in_norm, qkv_w, qkv_b, o_w, post_norm, gate_up_w, down_w) in enumerate(layers):
        qkv = F.linear(_norm(x, in_norm, dims.eps), qkv_w, qkv_b).view(b, r, hq + 2 * hkv, d).transpose(1, 2)
        qk = apply_rope(qkv[:, : hq + hkv], cos, sin)                                # (B, Hq + Hkv, R, D)
        keys[i].index_copy_(2, slots, qk[:, hq:])
        values[i].index_copy_(2, slots, qkv[:, hq + hkv:])
        a = attn(qk[:, :hq], keys[i], values[i], attn_mask)                           # (B, Hq, R, D)
        x = x + F.linear(a.transpose(1, 2).reshape(b, r, hq * d), o_w)
        gate, up = F.linear(_norm(x, post_norm, dims.eps), gate_up_w).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, down_w)
    return x, seen


def draft_level(dims: Dims, w: StepWeights, tokens: torch.Tensor, hidden: torch.Tensor, q_pos: torch.Tensor,
                live: torch.Tensor, allowed: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                pinned: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One draft level (`draft_layers`, tokens the drafted ones, hidden the draft outputs they
    follow), then the logits and the most probable next token. Returns hidden (B, R, H), logits
    (B, R, V), the top token's log-probability (B, R) float32 and id (B, R), and the keys each
    live row attended to (B, R)."""
    x, seen = draft_layers(dims, w, tokens, hidden, q_pos, live, allowed, slots, pos, pinned, keys, values)
    logits = draft_logits(dims, w, x)
    top = torch.topk(torch.log_softmax(logits.float(), -1), 1)
    return x, logits, top.values[..., 0], top.indices[..., 0], seen


class Emitted(NamedTuple):
    """What the batch's last steps emitted, as rows before a chain's levels (`greedy_chain`):
    tokens (B, M) long and the target's features before each (B, M, F*H); pos (B, M) long
    (PAD_POS: no entry); last (B,) long: each request's last real row (0 when it has none);
    slots (M,) long: the key slots they are written at."""

    tokens: torch.Tensor
    features: torch.Tensor
    pos: torch.Tensor
    last: torch.Tensor
    slots: torch.Tensor


def greedy_chain(dims: Dims, w: StepWeights, hidden: torch.Tensor, q_pos: torch.Tensor, live: torch.Tensor,
                 allowed: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, pinned: torch.Tensor,
                 keys: list[torch.Tensor], values: list[torch.Tensor],
                 emitted: Emitted | None = None, seeded: Seeded | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole chain for B requests: the top token of the draft's output hidden (B, 1, H),
    then L levels, each feeding the token just picked (draft_level), picking the next. With
    `emitted`, first the entries the last steps emitted run through the layers (what a commit
    computes), and a request with any starts from its last one's output instead of hidden.
    With `seeded`, a row with a temperature > 0 draws its picks instead, as a seeded request's
    draft does (chain_pick).

    q_pos (L, B), live (L, B, 1), slots (L, 1): each level's (see draft_layers); the rest as there.
    Returns (B, 2 (L + 1) + 1) float64, everything a propose reads, in one tensor: per request
    the L + 1 tokens, their cumulative log-probabilities (float64, as the reference sums them in
    Python floats), and the most keys one of its rows attended to; and the output the chain
    started from (B, 1, H)."""
    seen = []
    if emitted is not None:
        real = emitted.pos != PAD_POS                                                  # (B, M)
        x, keys_seen = draft_layers(dims, w, emitted.tokens, F.linear(emitted.features, w[5]), emitted.pos, real,
                                    allowed, emitted.slots, pos, pinned, keys, values)
        at = x.gather(1, emitted.last[:, None, None].expand(-1, 1, x.shape[-1]))      # (B, 1, H)
        hidden = torch.where(real.any(1)[:, None, None], at, hidden)
        seen.append(keys_seen.amax(1, keepdim=True))
    token, logp = chain_pick(draft_logits(dims, w, hidden), seeded, 0)                  # (B, 1)
    tokens, scores, start = [token], [logp.double()], hidden
    for level in range(q_pos.shape[0]):
        hidden, logits, logp, token, keys_seen = draft_level(dims, w, token, hidden, q_pos[level], live[level],
                                                             allowed, slots[level], pos, pinned, keys, values)
        if seeded is not None:
            token, logp = chain_pick(logits, seeded, level + 1)
        tokens.append(token)
        scores.append(scores[-1] + logp.double())
        seen.append(keys_seen)
    most = torch.stack(seen).amax(0) if seen else torch.zeros_like(token)               # (B, 1)
    return torch.cat([torch.cat(tokens, 1).double(), torch.cat(scores, 1), most.double()], 1), start


class Seeded(NamedTuple):
    """A chain's seeded draws: per row the request's temperature (0: greedy), seed and the output
    position of its first pick (float64, int64, int64 (B,))."""
    temperature: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor


def chain_pick(logits: torch.Tensor, seeded: Seeded | None, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick j of every row of logits (B, 1, V): the top token and its log-probability; a seeded
    row draws from q = softmax(logits / temperature) by Gumbel-max under its noise at output
    position + j (what PositionNoise.pick draws from the same q), with log q of the draw. The
    reference of the kernel's seeded picks: a row at a time, on the host."""
    top = torch.topk(torch.log_softmax(logits.float(), -1), 1)
    token, logp = top.indices[..., 0], top.values[..., 0]                              # (B, 1)
    if seeded is None:
        return token, logp
    token, logp = token.clone(), logp.clone()
    for i in torch.nonzero(seeded.temperature > 0).view(-1).tolist():
        lq = torch.log_softmax(logits[i, 0].float() / float(seeded.temperature[i]), -1)
        at = (seeded.position[i: i + 1] + j).to(lq.device)       # the noise is made where the logits are
        t = int(torch.argmax(lq + gumbel_noise(int(seeded.seed[i]), at, lq.shape[-1])[0]))
        token[i, 0], logp[i, 0] = t, lq[t]
    return token, logp


# Seconds each compiled level's first (compiling) call took, by its shape.
COMPILE_SECONDS: dict[tuple, float] = {}


@dataclass(slots=True)
class DraftBatch:
    """One propose's static keys: the requests' committed entries, then the drafted levels.

    keys/values: per layer (Bb, Hkv, C, D); pos (Bb, C) long; pinned (Bb, C) bool; allowed
    (Bb, R, C) bool: a tree's rule (all True for chains); size: the real requests (<= Bb);
    start: S, the first drafted slot; rows: R a request and level; q_pos (levels, Bb) long:
    each level's position per request (PAD_POS: not drafting); live (levels, Bb, 1) bool:
    whether it drafts (chains; a tree's rows say it per level); level_slots (levels, R): the
    slots each level writes; weights: the draft's, as
    draft_level reads them; seen: per level (Bb, R), the keys each live row attended to
    (reduced and read once, at the end); emitted: the entries the requests' last steps emitted,
    run before the levels at slots [S, S + M) (None: none; `DraftLevels.gather`).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    pos: torch.Tensor
    pinned: torch.Tensor
    allowed: torch.Tensor
    size: int = 0
    start: int = 0
    rows: int = 1
    q_pos: torch.Tensor | None = None
    live: torch.Tensor | None = None
    level_slots: torch.Tensor | None = None
    weights: StepWeights | None = None
    seen: list[torch.Tensor] | None = None
    emitted: Emitted | None = None

    @property
    def bucket(self) -> int:
        return self.pos.shape[0]

    def allow(self, rule: torch.Tensor) -> None:
        """A tree's rule for the next level: rule (Bb, R, drafted slots so far) bool, row (b, r)
        may see drafted slot j. Committed entries keep the window rule alone."""
        self.allowed[:, :, self.start: self.start + rule.shape[-1]].copy_(rule)

    def max_seen(self) -> torch.Tensor:
        """(Bb,) the most keys a live row of each request attended to in this propose."""
        return torch.stack(self.seen).amax((0, 2))


class DraftLevels:
    """Draft levels over static buffers, per batch bucket: eager, or compiled.

    window: the draft's attention window; capacity: C, the key slots of every request
    (committed entries + drafted levels); rows: R; tree: rows see drafted slots by the tree's
    rule (`DraftBatch.allow`), not by position alone. compiled: the levels run compiled
    (CPU: inductor with `cpu_options`, default CPU_OPTIONS; CUDA: "reduce-overhead", i.e.
    CUDA graphs), each shape compiled on first use; else eagerly: by the C++ levels
    (draft_kernel) for a small float32 draft on a CPU once built, where they measure faster than
    torch's on this machine (draft_chain.serves: they serve until measured), torch's otherwise.
    emitted_rows: M, the most emitted entries a request may bring to a greedy chain (its last
    steps' commit, run in the same call; 0: never); capacity counts them.
    """

    def __init__(self, draft: SparrowDraft, window: int, capacity: int, rows: int = 1, tree: bool = False,
                 compiled: bool = False, cpu_options: dict | None = None, emitted_rows: int = 0):
        if draft.attention_backend not in STATIC_BACKENDS:
            raise ValueError(f"the static draft step supports the backends {STATIC_BACKENDS}, "
                             f"not {draft.attention_backend!r}")
        cfg = draft.config
        self.draft, self.capacity, self.rows, self.tree = draft, capacity, rows, tree
        self.compiled, self.cpu_options, self.emitted_rows = compiled, cpu_options, emitted_rows
        self.dims = Dims(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta, window,
                         draft.attention_backend)
        self._buffers: dict[int, DraftBatch] = {}
        self._features: dict[int, torch.Tensor] = {}      # per bucket: the emitted rows' target features
        self._weights: tuple[list, StepWeights] | None = None
        self._sources: tuple[tuple, list[torch.Tensor]] | None = None
        # the C++ kernel (draft_kernel) for a draft it takes, its shared embedding and lm_head counted
        self.native = not compiled and draft._shared is not None and draft_kernel().usable(self.weights(), self.dims)
        if self.native:
            draft_kernel().ready()                        # starts its build, on a thread of its own

    def kernel(self):
        """The C++ draft kernel's module when these levels's work goes through it now (its draft
        is one it takes and it is built; the build starts on the first ask), else None."""
        if not self.native:
            return None
        kernel = draft_kernel()
        return kernel if kernel.ready() else None

    def bucket(self, n: int) -> int | None:
        """The batch bucket n requests run in (n itself when eager); None: too many to compile for."""
        if not self.compiled:
            return n
        return next((b for b in BATCH_BUCKETS if b >= n), None)

    def fits(self, kvs: list[DraftKV], levels: int, emitted: bool = False) -> bool:
        """Whether these requests' caches, `emitted_rows` emitted entries (when asked) and
        `levels` drafted levels fit the static shapes."""
        return (self.bucket(len(kvs)) is not None
                and max(len(kv) for kv in kvs) + levels * self.rows + emitted * self.emitted_rows <= self.capacity)

    def gather(self, kvs: list[DraftKV], positions: list[list[int]],
               emitted: list[tuple[list[int], torch.Tensor, int] | None] | None = None) -> DraftBatch:
        """The requests' committed keys in the bucket's buffers (request b at slots [0, n_b),
        PAD_POS after) and the levels' positions: positions[l][b] is request b's query position
        at level l + 1 (PAD_POS: it does not draft at that level). emitted[b]: request b's
        entries to run first (tokens, the target's features before each, the first one's
        position), at most `emitted_rows`, or None; with none at all (and eager) no such rows
        run. Callers check `fits` first."""
        n = len(kvs)
        bucket = self.bucket(n)
        batch = self._buffers.get(bucket) or self._new_buffers(bucket)
        s = max(len(kv) for kv in kvs)
        batch.size, batch.start, batch.seen, batch.weights = n, s, [], self.weights()
        kernel = self.kernel()
        if kernel is not None:                           # the same copies, one kernel call
            kernel.gather(batch.pos, batch.pinned, batch.keys, batch.values, kvs)
        else:
            # one padded copy per buffer (pad_sequence loops in C++): (n, S, Hkv, D) -> (n, Hkv, S, D)
            for layer in range(len(batch.keys)):
                for dst, src in ((batch.keys, DraftKV.keys), (batch.values, DraftKV.values)):
                    rows = pad_sequence([src.fget(kv)[layer][0].transpose(0, 1) for kv in kvs], batch_first=True)
                    dst[layer][:n, :, :s].copy_(rows.transpose(1, 2))
            batch.pos[:n, :s] = pad_sequence([kv.pos for kv in kvs], batch_first=True, padding_value=PAD_POS)
            batch.pinned[:n, :s] = pad_sequence([kv.pinned for kv in kvs], batch_first=True)
            batch.pos[:, s:] = PAD_POS                   # drafted slots get their position when written
            batch.pinned[:, s:] = False
            batch.pos[n:] = PAD_POS
        batch.q_pos = torch.tensor([row + [PAD_POS] * (bucket - n) for row in positions],
                                   device=batch.pos.device)                             # (levels, Bb)
        batch.live = (batch.q_pos != PAD_POS)[:, :, None]
        batch.emitted = None
        if emitted is not None and (self.compiled or any(emitted)):    # compiled: one graph, rows or not
            batch.emitted = self._emitted(batch, emitted, s)
            s += self.emitted_rows
        batch.level_slots = torch.arange(s, s + len(positions) * self.rows, device=batch.pos.device).view(-1, self.rows)
        if self.tree:
            batch.allowed.zero_()
            batch.allowed[:, :, :s] = True               # committed entries: the window rule alone
        return batch

    def _emitted(self, batch: DraftBatch, emitted: list, start: int) -> Emitted:
        """The batch's emitted rows (`Emitted`), the features in a buffer kept per bucket."""
        m, device = self.emitted_rows, batch.pos.device
        features = self._features.get(batch.bucket)
        if features is None:
            p = self.draft.fuse.weight
            features = self._features[batch.bucket] = p.new_zeros(batch.bucket, m, p.shape[1])
        tokens, pos, last = [[0] * m for _ in range(batch.bucket)], [[PAD_POS] * m for _ in range(batch.bucket)], \
            [0] * batch.bucket
        features.zero_()
        for b, entry in enumerate(emitted):
            if entry is None:
                continue
            ids, feats, first = entry
            tokens[b][: len(ids)], pos[b][: len(ids)], last[b] = ids, range(first, first + len(ids)), len(ids) - 1
            features[b, : len(ids)].copy_(feats)
        return Emitted(torch.tensor(tokens, device=device), features, torch.tensor(pos, device=device),
                       torch.tensor(last, device=device), torch.arange(start, start + m, device=device))

    def _new_buffers(self, bucket: int) -> DraftBatch:
        cfg, p = self.draft.config, self.draft.fuse.weight
        shape = (bucket, cfg.num_kv_heads, self.capacity, cfg.head_dim)
        # zeros, not empty: a slot no query sees still enters q.k, and NaN garbage * 0 is NaN
        batch = DraftBatch([torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_layers)],
                           [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_layers)],
                           torch.full((bucket, self.capacity), PAD_POS, dtype=torch.long, device=p.device),
                           torch.zeros(bucket, self.capacity, dtype=torch.bool, device=p.device),
                           torch.ones(bucket, self.rows, self.capacity, dtype=torch.bool, device=p.device),
                           rows=self.rows)
        if self.compiled and p.device.type == "cuda":
            for t in (*batch.keys, *batch.values, batch.pos):      # written in place inside the graph
                torch._dynamo.mark_static_address(t)
        self._buffers[bucket] = batch
        return batch

    def weights(self) -> StepWeights:
        """The draft's weights as draft_level reads them; rebuilt when a parameter was written
        since (trained, loaded), so the levels never reads stale weights. (The levels' buffers
        live on the draft's device and dtype at construction: a moved draft needs a new one.)"""
        if self._sources is None or self._sources[0] is not self.draft._shared:
            self._sources = (self.draft._shared, step_sources(self.draft))
        key = [p._version for p in self._sources[1]]
        if self._weights is None or self._weights[0] != key:
            with torch.no_grad():
                self._weights = (key, step_weights(self.draft))
        return self._weights[1]

    def level(self, batch: DraftBatch, level: int, tokens: torch.Tensor, hidden: torch.Tensor,
              live: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Run level `level` (1-based): tokens (Bb, R), hidden (Bb, R, H). live (Bb, R) bool: the
        rows that are real tree nodes (None: a chain, whose `gather` positions say so).
        Returns hidden (Bb, R, H), logits (Bb, R, V), the top token's log-probability and id (Bb, R)."""
        live = batch.live[level - 1] if live is None else live
        out = self._run(draft_level, batch, (self.dims, batch.weights, tokens, hidden, batch.q_pos[level - 1], live,
                                             batch.allowed, batch.level_slots[level - 1], batch.pos, batch.pinned,
                                             batch.keys, batch.values))
        batch.seen.append(out[-1])
        return out[:-1]

    def greedy_chains(self, batch: DraftBatch, hidden: torch.Tensor,
                      seeded: Seeded | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """greedy_chain over the batch's emitted rows (if any) and levels from the draft outputs
        hidden (Bb, 1, H): (Bb, 2 (L + 1) + 1), and the outputs the chains started from (Bb, 1, H).
        seeded (rows drawn by their seeded noise): not with compiled steps (their graphs have none)."""
        if seeded is not None and self.compiled:
            raise ValueError("compiled chains are greedy: a seeded chain runs the kernel's or torch's levels")
        return self._run(greedy_chain, batch, (self.dims, batch.weights, hidden, batch.q_pos, batch.live,
                                               batch.allowed, batch.level_slots, batch.pos, batch.pinned,
                                               batch.keys, batch.values, batch.emitted, seeded))

    def _run(self, fn: Callable, batch: DraftBatch, args: tuple):
        if not self.compiled:
            kernel = self.kernel()         # the C++ levels where built and measured faster here (or forced)
            if kernel is not None and kernel.serves(fn, args):
                return (kernel.greedy_chain if fn is greedy_chain else kernel.draft_level)(*args)
            return fn(*args)
        device, dtype = batch.pos.device, batch.keys[0].dtype
        options = self.cpu_options or CPU_OPTIONS
        levels = batch.q_pos.shape[0] if fn is greedy_chain else None          # a level's shape has none
        emitted = self.emitted_rows if fn is greedy_chain and batch.emitted is not None else 0
        shape = (fn.__name__, batch.bucket, self.rows, self.capacity, levels, self.dims, self.draft.config, dtype,
                 str(device), tuple(sorted(options.items())), emitted)
        run = compiled(fn, shape, f"b{batch.bucket}_r{self.rows}_c{self.capacity}", device, options)
        cuda = device.type == "cuda"
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()
        if shape in COMPILE_SECONDS:
            out = run(*args)
        else:
            t0 = time.perf_counter()
            with GATE.compile():         # no model forward on another thread meanwhile (compiling.py)
                out = run(*args)
            COMPILE_SECONDS[shape] = time.perf_counter() - t0
            log.info("%s compiled for batch bucket %d (%d rows a request, %s levels, %d key slots, %s %s) in %.1f s",
                     fn.__name__, batch.bucket, self.rows, levels or "-", self.capacity, device.type, dtype,
                     COMPILE_SECONDS[shape])
        if cuda:       # a graph's outputs are overwritten by its next replay
            out = out.clone() if isinstance(out, torch.Tensor) else tuple(t.clone() for t in out)
        return out

