"""The Sparrow draft: a small decoder that reads the target's hidden states at text positions
and attends over a short, gathered set of keys, so its cost does not grow with the video.

    z_t = fc([embed(x_t) ; fuse(h_{t-1})])        h: target features (F feature layers, concatenated)
    d_t = DecoderLayers(z_t) with text-anchored window attention (anchors + window + glimpse)
    p(x_{t+1}) = softmax(lm_head(norm(d_t)))      embed and lm_head: the target's, frozen, shared

When drafting several tokens ahead, the draft's own output d replaces fuse(h) (the target's
features for a drafted token do not exist yet), as in EAGLE.

The shared embedding and lm_head are held outside the module tree, so `state_dict` and
`save_pretrained` contain only the draft's own weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from sparrow.errors import InvalidRequest
from sparrow.anchored_window import window_mask
from sparrow.models.attention import get_backend

CONFIG_NAME = "sparrow_draft.json"
# The inference geometry a draft was trained with (SpecConfig fields), saved in its config file
# under "trained_with": what an engine or server runs it with unless told otherwise.
GEOMETRY_KEYS = ("window", "anchors", "glimpse", "num_draft_tokens", "draft_context")
WEIGHTS_NAME = "model.safetensors"


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low / mid / high target layers, as EAGLE-3 (indices into HF hidden_states, 0 = embeddings)."""
    low, mid, high = (2, num_layers // 2, num_layers - 3) if num_layers >= 8 else (1, num_layers // 2, num_layers - 1)
    return tuple(sorted({max(1, low), max(1, mid), max(1, high)}))


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    feature_layers: tuple[int, ...]
    bridge_layer: int                       # target layer whose visual states feed the glimpse
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    architecture: str = "sparrow"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidRequest("num_heads must be a multiple of num_kv_heads")
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))

    @classmethod
    def for_target(cls, target, num_layers: int = 1, feature_layers: tuple[int, ...] | None = None) -> "DraftConfig":
        tc = target.text_config
        heads = tc.num_attention_heads
        return cls(
            hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_layers=num_layers,
            num_heads=heads, num_kv_heads=getattr(tc, "num_key_value_heads", heads) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads, vocab_size=target.vocab_size,
            feature_layers=tuple(feature_layers or default_feature_layers(target.num_layers)),
            bridge_layer=target.num_layers // 2, rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        )


@dataclass(frozen=True)
class DraftArchitecture:
    """How a fresh draft is built and how it computes attention: apart from the speculation
    policy (SpecConfig) and the engine's internals (EngineConfig).

    num_layers: decoder layers; feature_layers: target hidden-state indices it reads (None:
    low/mid/high, as EAGLE-3); attention_backend: its window attention (sparrow.models.attention).
    """

    num_layers: int = 1
    feature_layers: tuple[int, ...] | None = None
    attention_backend: str = "sdpa"

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise InvalidRequest(f"num_layers must be >= 1, got {self.num_layers}")
        if self.feature_layers is not None:
            if not self.feature_layers or any(i < 0 for i in self.feature_layers):
                raise InvalidRequest("feature_layers must be a non-empty tuple of hidden-state indices")
            object.__setattr__(self, "feature_layers", tuple(self.feature_layers))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope_frequencies(dim: int, theta: float, device) -> torch.Tensor:
    """(D/2,) float32: the rotary embedding's inverse frequencies."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)


def rope_tables(pos: torch.Tensor, dim: int, theta: float, dtype: torch.dtype,
                inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (..., n, D) of the rotary embedding at integer positions pos (..., n).
    inv_freq: `rope_frequencies(dim, theta)` computed once by a caller that runs many steps."""
    if inv_freq is None:
        inv_freq = rope_frequencies(dim, theta, pos.device)
    ang = pos.to(torch.float32).clamp(min=0)[..., None] * inv_freq                 # (..., n, D/2)
    ang = torch.cat([ang, ang], -1)
    if dtype == torch.float32:          # (no cast: a step's few ops are what its time is)
        return ang.cos(), ang.sin()
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., n, D) rotated by tables cos, sin that broadcast to it."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x (B, H, n, D) at integer positions pos (n,)."""
    cos, sin = rope_tables(pos, x.shape[-1], theta, x.dtype)
    return apply_rope(x, cos, sin)


class DraftKV:
    """One request's draft cache: per-layer key/value buffers (1, Hkv, capacity, D) plus each
    entry's position and pinned flag, and a fill length (buffer + position, as the target's).

    Entries are glimpse states (pos -1, pinned), anchor tokens (pinned) and recent tokens.
    `truncate` (dropping speculative entries) is a length move. `evict` forgets recent
    entries no future query can see; it compacts the buffers in place only when they run
    short of room, so most steps move nothing. A buffer that is still too small grows
    (doubling), so a full-attention context never fails.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (1, num_kv_heads, max(1, capacity), head_dim)
        self._k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._pos = torch.empty(shape[2], dtype=torch.long, device=device)
        self._pinned = torch.empty(shape[2], dtype=torch.bool, device=device)
        self.length = 0
        self.max_visible = 0     # most keys any query has attended to (for checks and metrics)

    @classmethod
    def for_draft(cls, cfg: "DraftConfig", capacity: int, dtype: torch.dtype, device) -> "DraftKV":
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, dtype, device)

    def __len__(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        return self._pos.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the key/value buffers as allocated (every layer, the whole capacity, filled
        or not); the entries' positions and pinned flags (9 bytes an entry) are not counted."""
        return sum(b.nbytes for bufs in (self._k, self._v) for b in bufs)

    @property
    def pos(self) -> torch.Tensor:          # (N,) views of the filled part
        return self._pos[: self.length]

    @property
    def pinned(self) -> torch.Tensor:
        return self._pinned[: self.length]

    @property
    def keys(self) -> list[torch.Tensor]:   # per layer (1, Hkv, N, D)
        return [k[:, :, : self.length] for k in self._k]

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[:, :, : self.length] for v in self._v]

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The whole buffers, filled or not: positions and pinned flags (capacity,), keys and
        values per layer (1, Hkv, capacity, D) (a kernel writes entries after `length` in place)."""
        return self._pos, self._pinned, self._k, self._v

    def reserve(self, n: int) -> None:
        """Room for n more entries (grows the buffers, keeping the filled part)."""
        need = self.length + n
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        for bufs in (self._k, self._v):
            for i, b in enumerate(bufs):
                grown = b.new_empty((*b.shape[:2], cap, b.shape[3]))
                grown[:, :, : self.length] = b[:, :, : self.length]
                bufs[i] = grown
        for name in ("_pos", "_pinned"):
            old = getattr(self, name)
            grown = old.new_empty(cap)
            grown[: self.length] = old[: self.length]
            setattr(self, name, grown)

    def append_meta(self, pos: torch.Tensor, pinned: torch.Tensor) -> None:
        n = pos.shape[0]
        self._pos[self.length: self.length + n] = pos
        self._pinned[self.length: self.length + n] = pinned

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write n new entries' keys/values after the filled part of one layer; views of all
        (old + new) keys and values. The length moves once per forward (`advance`)."""
        n = k.shape[2]
        end = self.length + n
        self._k[layer][:, :, self.length:end] = k
        self._v[layer][:, :, self.length:end] = v
        return self._k[layer][:, :, :end], self._v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        """Keep the first n entries (drop speculative ones appended after)."""
        self.length = min(self.length, n)

    def evict(self, next_pos: int, window: int, room: int = 0) -> None:
        """Forget entries no query at >= next_pos can see, if `room` more entries would not
        fit otherwise (compaction in place; the order of the kept entries is unchanged)."""
        if self.length + room <= self.capacity:
            return
        keep = self.pinned | (self.pos > next_pos - window)
        idx = torch.nonzero(keep).view(-1)
        m = idx.shape[0]
        if m == self.length:
            return
        for bufs in (self._k, self._v):
            for b in bufs:
                b[:, :, :m] = b[:, :, idx]
        self._pos[:m] = self._pos[idx]
        self._pinned[:m] = self._pinned[idx]
        self.length = m


@dataclass(slots=True)
class DraftSegment:
    """One request's rows [start, end) of a packed draft batch, over its own DraftKV."""

    kv: DraftKV
    start: int
    end: int
    window: int
    # Draft trees: the cache's entries from `committed` on are speculative tree nodes; new row
    # i sees those where spec_mask[i] is True (its ancestors and itself), not by position.
    committed: int = 0
    spec_mask: torch.Tensor | None = None     # (n, entries after committed, the new ones included)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=True)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def qkv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (n, H) -> q (1, H, n, D), k and v (1, Hkv, n, D), rotated at positions pos (n,)."""
        cfg, n = self.cfg, x.shape[0]
        hx = self.input_norm(x)
        q = self.q_proj(hx).view(1, n, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(hx).view(1, n, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(hx).view(1, n, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        return rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta), v

    def finish(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Residual + output projection of the attention output a (n, H*D), then the MLP."""
        x = x + self.o_proj(a)
        hx = self.post_norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(hx)) * self.up_proj(hx))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, past_k: torch.Tensor | None,
                past_v: torch.Tensor | None, mask: torch.Tensor, attn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence (training): x (n, H) new entries; past_k/v: (1, Hkv, N, D); mask: (n, N + n).
        Returns (out, k_all, v_all)."""
        q, k, v = self.qkv(x, pos)
        if past_k is not None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        a = attn(q, k, v, mask).transpose(1, 2).reshape(x.shape[0], -1)
        return self.finish(x, a), k, v

    def forward_packed(self, x: torch.Tensor, pos: torch.Tensor, segments: list[DraftSegment],
                       masks: list[torch.Tensor], index: int, attn) -> torch.Tensor:
        """Many requests at once (inference): the linear layers run over all packed rows x (N, H);
        each segment's rows attend to its own DraftKV (written in place) under its mask."""
        q, k, v = self.qkv(x, pos)
        out = []
        for seg, mask in zip(segments, masks):
            keys, values = seg.kv.write(index, k[:, :, seg.start:seg.end], v[:, :, seg.start:seg.end])
            out.append(attn(q[:, :, seg.start:seg.end], keys, values, mask))
        a = torch.cat(out, dim=2).transpose(1, 2).reshape(x.shape[0], -1)
        return self.finish(x, a)


class SparrowDraft(nn.Module):
    def __init__(self, cfg: DraftConfig, attention_backend: str = "sdpa"):
        super().__init__()
        self.config = cfg
        h, f = cfg.hidden_size, len(cfg.feature_layers)
        self.fuse = nn.Linear(f * h, h, bias=False)         # target features (F*H) -> H
        self.fc = nn.Linear(2 * h, h, bias=False)           # [embed(x); fused h] -> z
        self.glimpse_proj = nn.Linear(h, h, bias=False)     # bridge-layer visual state -> z
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.attention_backend = attention_backend
        self._shared: tuple[nn.Module, nn.Module] | None = None   # (embed, lm_head), not registered
        self.trained_with: dict = {}       # GEOMETRY_KEYS it was trained with (set by the trainer)

    # ----- construction / persistence ------------------------------------------------------
    @classmethod
    def for_target(cls, target, arch: DraftArchitecture | None = None, seed: int | None = None) -> "SparrowDraft":
        """A fresh (randomly initialised) draft shaped for `target`, bound to its embed/lm_head."""
        arch = arch or DraftArchitecture()
        if seed is not None:
            torch.manual_seed(seed)
        draft = cls(DraftConfig.for_target(target, arch.num_layers, arch.feature_layers), arch.attention_backend)
        return draft.to(target.device, target.hf.dtype).bind(target)

    def bind(self, target) -> "SparrowDraft":
        """Share the target's frozen token embedding and lm_head."""
        embed, head = target.embed_tokens(), target.lm_head()
        if embed.weight.shape[-1] != self.config.hidden_size or head.weight.shape[0] != self.config.vocab_size:
            raise InvalidRequest(
                f"draft (hidden {self.config.hidden_size}, vocab {self.config.vocab_size}) does not fit target "
                f"(hidden {embed.weight.shape[-1]}, vocab {head.weight.shape[0]})")
        if max(self.config.feature_layers + (self.config.bridge_layer,)) > target.num_layers:
            raise InvalidRequest("draft feature layers exceed the target's depth")
        self._shared = (embed, head)
        return self

    @property
    def bound(self) -> bool:
        return self._shared is not None

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = asdict(self.config)
        if self.trained_with:
            config["trained_with"] = {k: self.trained_with[k] for k in GEOMETRY_KEYS if k in self.trained_with}
        (path / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, path: str | Path, target=None, attention_backend: str = "sdpa") -> "SparrowDraft":
        path = Path(path)
        if not (path / CONFIG_NAME).is_file():
            raise InvalidRequest(f"{path} holds no Sparrow draft ({CONFIG_NAME} missing)")
        config = json.loads((path / CONFIG_NAME).read_text())
        trained_with = config.pop("trained_with", None) or {}
        cfg = DraftConfig(**config)
        draft = cls(cfg, attention_backend)
        draft.trained_with = {k: trained_with[k] for k in GEOMETRY_KEYS if k in trained_with}
        draft.load_state_dict(load_file(str(path / WEIGHTS_NAME)))
        if target is not None:
            draft = draft.to(target.device, target.hf.dtype).bind(target)
        return draft.eval()

    # ----- the pieces of a step -----------------------------------------------------------------
    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self._shared is None:
            raise InvalidRequest("draft is not bound to a target: call draft.bind(target)")
        return self._shared[0](token_ids)

    def inputs_from_target(self, token_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """z for tokens whose previous-position target features are known. (n,), (n, F*H) -> (n, H)."""
        return self.fc(torch.cat([self._embed(token_ids), self.fuse(features)], dim=-1))

    def inputs_from_draft(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """z for drafted tokens: the draft's own output stands in for the target's features."""
        return self.fc(torch.cat([self._embed(token_ids), hidden], dim=-1))

    def inputs_from_glimpse(self, visual_states: torch.Tensor) -> torch.Tensor:
        return self.glimpse_proj(visual_states)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._shared[1](self.norm(hidden))

    def new_kv(self, capacity: int) -> DraftKV:
        p = self.fuse.weight
        return DraftKV.for_draft(self.config, capacity, p.dtype, p.device)

    def forward_entries(self, z: torch.Tensor, pos: torch.Tensor, pinned: torch.Tensor,
                        kv: DraftKV, window: int) -> torch.Tensor:
        """Run one request's new entries (n, H) at positions (n,) through the layers, appending
        them to kv. Each entry attends to the keys `window_mask` allows. Returns (n, H)."""
        return self.forward_packed(z, pos, pinned, [DraftSegment(kv, 0, z.shape[0], window)])

    def forward_packed(self, z: torch.Tensor, pos: torch.Tensor, pinned: torch.Tensor,
                       segments: list[DraftSegment]) -> torch.Tensor:
        """Several requests' new entries packed in rows: z (N, H), pos/pinned (N,); segment i
        owns rows [start, end) and its DraftKV. One batched pass of the linear layers, each
        request's attention over its own cache. Returns hidden states (N, H)."""
        attn = get_backend(self.attention_backend)
        masks = []
        for seg in segments:
            kv, n = seg.kv, seg.end - seg.start
            kv.reserve(n)
            kv.append_meta(pos[seg.start:seg.end], pinned[seg.start:seg.end])
            end = kv.length + n
            mask = window_mask(pos[seg.start:seg.end], kv._pos[:end], kv._pinned[:end], seg.window)
            if seg.spec_mask is not None:
                mask[:, seg.committed:end] &= seg.spec_mask.to(mask.device)
            kv.max_visible = max(kv.max_visible, int(mask.sum(-1).max()))
            masks.append(mask)
        x = z
        for i, layer in enumerate(self.layers):
            x = layer.forward_packed(x, pos, segments, masks, i, attn)
        for seg in segments:
            seg.kv.advance(seg.end - seg.start)
        return x

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
