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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from ..errors import InvalidRequest
from .attention import get_backend, window_mask

CONFIG_NAME = "sparrow_draft.json"
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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x (B, H, n, D) at integer positions pos (n,)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.to(torch.float32).clamp(min=0)[:, None] * inv_freq[None, :]        # (n, D/2)
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@dataclass
class DraftKV:
    """One request's draft cache: per layer keys/values over a bounded set of entries.

    Entries are glimpse states (pos -1, pinned), anchor tokens (pinned) and recent tokens.
    `evict` drops recent entries no future query can see, so the size stays <=
    glimpse + anchors + window + draft tokens.
    """

    keys: list[torch.Tensor] = field(default_factory=list)     # per layer (1, Hkv, N, D)
    values: list[torch.Tensor] = field(default_factory=list)
    pos: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))     # (N,)
    pinned: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.bool))  # (N,)
    max_visible: int = 0     # most keys any query has attended to (for checks and metrics)

    @classmethod
    def empty(cls, device: torch.device | str) -> "DraftKV":
        return cls(pos=torch.empty(0, dtype=torch.long, device=device),
                   pinned=torch.empty(0, dtype=torch.bool, device=device))

    def __len__(self) -> int:
        return self.pos.shape[0]

    def append_meta(self, pos: torch.Tensor, pinned: torch.Tensor) -> None:
        self.pos = torch.cat([self.pos, pos])
        self.pinned = torch.cat([self.pinned, pinned])

    def truncate(self, n: int) -> None:
        """Keep the first n entries (drop speculative ones appended after)."""
        self.pos, self.pinned = self.pos[:n], self.pinned[:n]
        self.keys = [k[:, :, :n] for k in self.keys]
        self.values = [v[:, :, :n] for v in self.values]

    def evict(self, next_pos: int, window: int) -> None:
        keep = self.pinned | (self.pos > next_pos - window)
        if bool(keep.all()):
            return
        idx = torch.nonzero(keep).view(-1)
        self.pos, self.pinned = self.pos[idx], self.pinned[idx]
        self.keys = [k[:, :, idx] for k in self.keys]
        self.values = [v[:, :, idx] for v in self.values]


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

    def forward(self, x: torch.Tensor, pos: torch.Tensor, past_k: torch.Tensor | None,
                past_v: torch.Tensor | None, mask: torch.Tensor, attn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (n, H) new entries; past_k/v: (1, Hkv, N, D); mask: (n, N + n). Returns (out, k_all, v_all)."""
        cfg, n = self.cfg, x.shape[0]
        hx = self.input_norm(x)
        q = self.q_proj(hx).view(1, n, cfg.num_heads, cfg.head_dim).transpose(1, 2)      # (1, H, n, D)
        k = self.k_proj(hx).view(1, n, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)   # (1, Hkv, n, D)
        v = self.v_proj(hx).view(1, n, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
        if past_k is not None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        a = attn(q, k, v, mask).transpose(1, 2).reshape(n, -1)
        x = x + self.o_proj(a)
        hx = self.post_norm(x)
        x = x + self.down_proj(nn.functional.silu(self.gate_proj(hx)) * self.up_proj(hx))
        return x, k, v


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

    # ----- construction / persistence ------------------------------------------------------
    @classmethod
    def for_target(cls, target, spec=None, seed: int | None = None) -> "SparrowDraft":
        """A fresh (randomly initialised) draft shaped for `target`, bound to its embed/lm_head."""
        layers = spec.draft_layers if spec is not None else 1
        feats = spec.feature_layers if spec is not None else None
        if seed is not None:
            torch.manual_seed(seed)
        draft = cls(DraftConfig.for_target(target, layers, feats),
                    spec.attention_backend if spec is not None else "sdpa")
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
        (path / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, path: str | Path, target=None, attention_backend: str = "sdpa") -> "SparrowDraft":
        path = Path(path)
        if not (path / CONFIG_NAME).is_file():
            raise InvalidRequest(f"{path} holds no Sparrow draft ({CONFIG_NAME} missing)")
        cfg = DraftConfig(**json.loads((path / CONFIG_NAME).read_text()))
        draft = cls(cfg, attention_backend)
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

    def forward_entries(self, z: torch.Tensor, pos: torch.Tensor, pinned: torch.Tensor,
                        kv: DraftKV, window: int) -> torch.Tensor:
        """Run new entries (n, H) at positions (n,) through the layers, appending them to kv.
        Each entry attends to the keys `window_mask` allows. Returns hidden states (n, H)."""
        attn = get_backend(self.attention_backend)
        k_pos, k_pin = torch.cat([kv.pos, pos]), torch.cat([kv.pinned, pinned])
        mask = window_mask(pos, k_pos, k_pin, window)
        kv.max_visible = max(kv.max_visible, int(mask.sum(-1).max()))
        x = z
        for i, layer in enumerate(self.layers):
            have = i < len(kv.keys)
            x, k, v = layer(x, pos, kv.keys[i] if have else None, kv.values[i] if have else None, mask, attn)
            if have:
                kv.keys[i], kv.values[i] = k, v
            else:
                kv.keys.append(k)
                kv.values.append(v)
        kv.append_meta(pos, pinned)
        return x

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
