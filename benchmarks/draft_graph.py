"""The draft's decode step with static shapes, so it can be captured once as a CUDA graph.

A Sparrow draft step is a handful of small kernels (norms, 7 linears, rope, attention over
~100 keys): on a GPU its cost is mostly launch overhead, paid k times per verify step.
A CUDA graph replays all of them with one launch, but needs every tensor to keep its
address and shape from call to call. Hence:

    StaticDraftKV     per-layer key/value buffers of a fixed capacity plus each slot's
                      position and pinned flag; free slots hold PAD_POS, which no query
                      sees, so attention always runs over all `capacity` slots
    DraftDecodeStep   one drafted token -> (hidden, logits), writing its keys into the next
                      slot; captured as a CUDA graph on CUDA, run eagerly elsewhere (the same
                      code: the CPU tests check it against SparrowDraft.forward_entries). Its
                      step is draft_compile.draft_level for one request and one row, the
                      function the proposer's batched levels run (compiled or not)

Use: after the proposer commits (variable-length, not graphed), `load` its DraftKV; then each
of the k draft steps is `step(token, hidden, pos)`. Outputs are static buffers, overwritten by
the next call: read (or clone) them first. Speed on a GPU is unmeasured (see README.md).
"""

from __future__ import annotations

import torch

from sparrow.anchored_window import PAD_POS
from sparrow.models.draft import DraftKV, SparrowDraft
from sparrow.models.draft_compile import Dims, draft_level, step_weights


class StaticDraftKV:
    """Fixed-capacity draft cache: keys/values (layers, 1, Hkv, capacity, D), pos/pinned (capacity,).
    Built and written under inference mode, like the DraftKV it mirrors."""

    @torch.inference_mode()
    def __init__(self, draft: SparrowDraft, capacity: int, device: torch.device, dtype: torch.dtype):
        cfg = draft.config
        shape = (cfg.num_layers, 1, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = torch.full((capacity,), PAD_POS, device=device, dtype=torch.long)
        self.pinned = torch.zeros(capacity, device=device, dtype=torch.bool)
        self.capacity = capacity
        self.length = 0                                    # filled slots (host-side count)

    @torch.inference_mode()
    def load(self, kv: DraftKV) -> None:
        """Copy a DraftKV in (in place: addresses a captured graph holds stay valid)."""
        n = len(kv)
        if n > self.capacity:
            raise ValueError(f"draft cache holds {n} entries, static capacity is {self.capacity}")
        for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
            self.keys[i, :, :, :n].copy_(k)
            self.values[i, :, :, :n].copy_(v)
        self.pos.fill_(PAD_POS)
        self.pos[:n].copy_(kv.pos)
        self.pinned.zero_()
        self.pinned[:n].copy_(kv.pinned)
        self.length = n


class DraftDecodeStep:
    """One draft decode step over a StaticDraftKV, as a CUDA graph when on CUDA."""

    @torch.inference_mode()
    def __init__(self, draft: SparrowDraft, capacity: int, window: int, use_graph: bool | None = None):
        p, cfg = next(draft.parameters()), draft.config
        self.draft, self.window = draft, window
        self.dims = Dims(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta, window,
                         draft.attention_backend)
        self.weights = step_weights(draft)                  # read once: a captured graph holds their addresses
        self.kv = StaticDraftKV(draft, capacity, p.device, p.dtype)
        self.live = torch.ones(1, 1, dtype=torch.bool, device=p.device)
        self.allowed = torch.ones(1, 1, capacity, dtype=torch.bool, device=p.device)     # a chain: positions suffice
        # static inputs: the drafted token, the draft output it follows, its position, its slot
        self.token = torch.zeros(1, dtype=torch.long, device=p.device)                  # (1,)
        self.hidden_in = torch.zeros(1, draft.config.hidden_size, device=p.device, dtype=p.dtype)
        self.pos = torch.zeros(1, dtype=torch.long, device=p.device)                    # (1,)
        self.slot = torch.zeros(1, dtype=torch.long, device=p.device)                   # (1,)
        self.graph = None
        if use_graph if use_graph is not None else p.device.type == "cuda":
            self._capture()

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.kv
        kv.pinned.index_fill_(0, self.slot, False)           # drafted tokens are never anchors
        x, logits, _, _, _ = draft_level(self.dims, self.weights, self.token.view(1, 1), self.hidden_in[:, None],
                                         self.pos, self.live, self.allowed, self.slot, kv.pos.view(1, -1),
                                         kv.pinned.view(1, -1), list(kv.keys), list(kv.values))
        return x.view(1, -1), logits.view(1, -1)                                          # (1, hidden), (1, V)

    def _capture(self) -> None:
        # warm up on a side stream (allocator and lazy init happen outside the graph), then capture;
        # both write slot 0 of an empty cache, which `load` overwrites before real use
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out_hidden, self.out_logits = self._forward()

    def load(self, kv: DraftKV) -> None:
        self.kv.load(kv)

    @torch.inference_mode()
    def step(self, token: torch.Tensor, hidden: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """token (1,) long, hidden (1, hidden): the draft output before it; pos: its draft position.
        Returns (hidden (1, hidden), logits (1, V)); on CUDA these are the graph's static buffers."""
        if self.kv.length >= self.kv.capacity:
            raise ValueError(f"static draft cache full ({self.kv.capacity} slots)")
        self.token.copy_(token.view(1))
        self.hidden_in.copy_(hidden.view(1, -1))
        self.pos.fill_(pos)
        self.slot.fill_(self.kv.length)
        self.kv.length += 1
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.out_hidden, self.out_logits
