"""EAGLE-3 drafts, as published (SpecForge / SGLang / the EAGLE repository), as a proposer.

Checkpoint layout (a directory): config.json with the Llama-style sizes plus
`draft_vocab_size` (and optionally `eagle_config.eagle_aux_hidden_state_layer_ids`, the
target layers whose inputs are fused), and safetensors (one file or an index) holding

    fc.weight                          (H, 3H)     fuses the target's low/mid/high hidden states
    midlayer.input_layernorm.weight    (H,)        norms the token embedding
    midlayer.hidden_norm.weight        (H,)        norms the fused / previous draft hidden state
    midlayer.self_attn.{q,k,v}_proj    (*, 2H)     attention over [embedding ; hidden]
    midlayer.self_attn.o_proj, post_attention_layernorm, mlp.{gate,up,down}_proj
    norm.weight, lm_head.weight        (Vd, H)     its own head over the reduced draft vocabulary
    d2t                                (Vd,)       draft id d is target id d + d2t[d]
    t2d                                (V,) bool   which target ids the draft vocabulary holds
    embed_tokens.weight (optional)     (V, H)      else the target's embedding is shared

One step, for the entry pairing token x_t with hidden h (the fused target features at t-1,
or the draft's own pre-norm output when drafting ahead, as EAGLE-3 trains it):

    a = attn([norm_in(embed(x_t)) ; norm_h(h)])     causal over every earlier entry, 1-D rope
    r = a + h;  out = mlp(norm_post(r)) + r          out feeds the next step (pre-norm)
    logits_d = lm_head(norm(out))                    over the draft vocabulary, mapped by d2t

The draft's distribution over the target vocabulary puts q = 0 on ids outside the draft
vocabulary, so the one acceptance path (accept.py) stays exact. Positions are the entries'
indices (1-D), whatever the target's rope: what the published drafts use for text.

Eagle3Proposer follows the Proposer contract (sparrow.speculative.proposer): needs, begin, batched
propose / commit (here a loop over the batch's requests), end. Its draft context is "all" by
default: every prompt entry, visual ones included, as EAGLE-3 runs on a VLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from ..config import SamplingParams, SpecConfig
from ..errors import InvalidRequest
from ..models.prefill import FeatureNeeds
from .draft_context import DraftContext, build_context
from ..models.draft import DraftKV, RMSNorm, rope  # the Sparrow draft's cache, norm and rotary embedding
from .proposer import BeginInput, DraftRequest, DraftState, Pending, Proposal, StepResult
from .sampling import PositionNoise, draft_probs, sample

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    feature_layers: tuple[int, ...]        # indices into the target's HF hidden_states
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidRequest("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise InvalidRequest(f"draft_vocab_size {self.draft_vocab_size} must be in [1, {self.vocab_size}]")
        if len(self.feature_layers) != 3:
            raise InvalidRequest(f"an EAGLE-3 draft fuses 3 target layers, got {self.feature_layers}")

    @classmethod
    def from_json(cls, data: dict, target_layers: int) -> "Eagle3Config":
        """config.json as published. Feature layers: eagle_config's aux layer ids, else
        EAGLE-3's default (2, L/2, L-3) of the target's L layers."""
        try:
            heads = data["num_attention_heads"]
            aux = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            layers = tuple(aux) if aux else (2, target_layers // 2, target_layers - 3)
            rope = data.get("rope_theta") or (data.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            return cls(hidden_size=data["hidden_size"], intermediate_size=data["intermediate_size"], num_heads=heads,
                       num_kv_heads=data.get("num_key_value_heads") or heads,
                       head_dim=data.get("head_dim") or data["hidden_size"] // heads, vocab_size=data["vocab_size"],
                       draft_vocab_size=data.get("draft_vocab_size") or data["vocab_size"], feature_layers=layers,
                       rms_norm_eps=data.get("rms_norm_eps", 1e-6), rope_theta=float(rope))
        except KeyError as e:
            raise InvalidRequest(f"EAGLE-3 config.json lacks {e}") from e


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)


class Eagle3Draft(nn.Module):
    """The published EAGLE-3 draft: one decoder layer over [embedding ; fused hidden]."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None        # own, else the target's (bind)
        self._shared: tuple[nn.Module, ...] = ()

    # ----- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, target) -> "Eagle3Draft":
        """Load the published layout for `target` (a TargetModel): on its device, in its dtype."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise InvalidRequest(f"{path} holds no EAGLE-3 draft (no config.json)")
        config = Eagle3Config.from_json(json.loads((path / "config.json").read_text()), target.num_layers)
        draft = cls(config)
        tensors = _read_safetensors(path)
        embed = tensors.pop("embed_tokens.weight", None)
        missing, unexpected = draft.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise InvalidRequest(f"{path} is not in the EAGLE-3 layout: missing {sorted(missing)}, "
                                 f"unexpected {sorted(unexpected)}")
        dtype = target.embed_tokens().weight.dtype
        draft = draft.to(target.device, dtype)               # buffers d2t / t2d keep their integer dtypes
        if embed is not None:
            draft.embed_tokens = nn.Embedding.from_pretrained(embed.to(target.device, dtype), freeze=True)
        return draft.bind(target).eval()

    def bind(self, target) -> "Eagle3Draft":
        c = self.config
        if target.hidden_size != c.hidden_size or target.vocab_size != c.vocab_size:
            raise InvalidRequest(f"EAGLE-3 draft (hidden {c.hidden_size}, vocab {c.vocab_size}) does not fit the "
                                 f"target (hidden {target.hidden_size}, vocab {target.vocab_size})")
        if max(c.feature_layers) > target.num_layers:
            raise InvalidRequest(f"EAGLE-3 feature layers {c.feature_layers} exceed the target's {target.num_layers}")
        # The target's embedding, frozen; in a tuple so it stays outside this module's tree
        # (state_dict, .to()) as the target owns it.
        self._shared = (target.embed_tokens(),)
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if self.embed_tokens is not None else self._shared[0])(ids)

    # ----- one forward over new entries ---------------------------------------------------------------
    def forward_entries(self, ids: torch.Tensor, hidden: torch.Tensor, kv: DraftKV) -> torch.Tensor:
        """(m,) tokens with (m, H) hidden inputs (fused target features or draft outputs), after
        the len(kv) entries cached; appends their keys. Returns the (m, H) pre-norm outputs.
        kv: a one-layer DraftKV (empty_kv) whose entries are all pinned: nothing is evicted."""
        c, layer = self.config, self.midlayer
        m, start = ids.shape[0], len(kv)
        pos = torch.arange(start, start + m, device=ids.device)
        x = torch.cat([layer.input_layernorm(self.embed(ids)), layer.hidden_norm(hidden)], -1)     # (m, 2H)
        att = layer.self_attn
        q = att.q_proj(x).view(1, m, c.num_heads, c.head_dim).transpose(1, 2)                       # (1, h, m, d)
        k = att.k_proj(x).view(1, m, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = att.v_proj(x).view(1, m, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
        kv.reserve(m)                   # doubles in the rare case begin did not size it for the request
        kv.append_meta(pos, torch.ones(m, dtype=torch.bool, device=ids.device))
        keys, values = kv.write(0, k, v)                                                            # (1, hkv, N, d)
        kv.advance(m)
        kv.max_visible = max(kv.max_visible, len(kv))
        # causal: query i (entry start + i) sees entries [0, start + i]
        mask = torch.arange(start + m, device=ids.device)[None, :] <= pos[:, None]                  # (m, N)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        r = att.o_proj(o.transpose(1, 2).reshape(m, -1)) + hidden
        return layer.mlp(layer.post_attention_layernorm(r)) + r

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """(..., H) pre-norm outputs -> (..., Vd) logits over the draft vocabulary."""
        return self.lm_head(self.norm(out)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def empty_kv(self, device: torch.device, capacity: int = 0) -> DraftKV:
        """An empty one-layer cache with room for `capacity` entries (it grows past them if it must)."""
        c = self.config
        return DraftKV(1, c.num_kv_heads, c.head_dim, capacity, self.fc.weight.dtype, device)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (one file or an index of shards), names as stored."""
    if (path / INDEX).is_file():
        files = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
    elif (path / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise InvalidRequest(f"{path} holds no safetensors weights ({WEIGHTS} or {INDEX})")
    out = {}
    for name in files:
        with safe_open(path / name, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@dataclass(slots=True)
class Eagle3State(DraftState):
    kv: DraftKV
    committed: int               # entries in kv that hold target-verified inputs
    last_out: torch.Tensor       # (H,) pre-norm output at the last committed entry
    pending: Pending = field(default_factory=Pending)   # emitted, run at the next propose (proposer.py)

    def kv_bytes(self) -> int:
        """The draft cache's key/value buffers as allocated (DraftKV.nbytes: capacity, not fill)."""
        return self.kv.nbytes

    def max_keys(self) -> int:
        return self.kv.max_visible


class Eagle3Proposer:
    """Chain drafting with an EAGLE-3 draft. Keeps no per-request state on itself."""

    def __init__(self, draft: Eagle3Draft, draft_context: str = "all", draft_mass: float = 1.0,
                 draft_max_candidates: int = 0):
        self.draft = draft
        self.draft_mass, self.draft_max_candidates = draft_mass, draft_max_candidates     # sampling.draft_probs
        self.context = draft_context
        self.needs = FeatureNeeds(tuple(draft.config.feature_layers), None, draft_context != "text")
        self.vocab_size = draft.config.vocab_size

    @classmethod
    def from_spec(cls, target, draft, spec: SpecConfig) -> "Eagle3Proposer":
        """The registry's "eagle3": an Eagle3Draft (Eagle3Draft.from_pretrained(path, target)),
        over the EAGLE context spec.draft_context names ("text" is EAGLE-3 without visual entries)."""
        if not isinstance(draft, Eagle3Draft):
            raise InvalidRequest(f"method 'eagle3' needs an Eagle3Draft, got {type(draft).__name__}")
        return cls(draft, spec.draft_context, spec.draft_mass, spec.draft_max_candidates)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.needs.feature_layers

    # ----- the Proposer contract ----------------------------------------------------------------------
    def begin(self, start: BeginInput) -> Eagle3State:
        return self.begin_context(build_context(start.prefill, start.first_token, 0, self.context), start.room)

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        return [self.propose_one(r.state, r.k, r.sampling, r.generator, r.noise) for r in batch]

    def commit(self, states: list[Eagle3State], results: list[StepResult]) -> None:
        for state, result in zip(states, results):
            self.commit_one(state, result.tokens, result.features)

    def end(self, state: Eagle3State) -> None:
        """Nothing outside the state to free."""

    # ----- one request --------------------------------------------------------------------------------
    @torch.inference_mode()
    def begin_context(self, ctx: DraftContext, room: int = 0) -> Eagle3State:
        """Run the context's entries through the draft into a cache sized for them and `room`
        more (BeginInput.room: the request's new tokens and one step's drafts)."""
        d = self.draft
        kv = d.empty_kv(ctx.features.device, ctx.token_ids.shape[0] + room)
        out = d.forward_entries(ctx.token_ids.to(ctx.features.device), d.fc(ctx.features), kv)
        return Eagle3State(kv, len(kv), out[-1])

    @torch.inference_mode()
    def propose_one(self, state: Eagle3State, k: int, sampling: SamplingParams,
                    generator: torch.Generator, noise: PositionNoise | None = None) -> Proposal:
        self._run_pending(state)
        d, out = self.draft, state.last_out
        tokens, probs = [], []
        for j in range(k):
            tok, q = self._draw(d.logits(out), sampling, generator, noise, j)
            tokens.append(tok)
            if q is not None:
                probs.append(q)
            if j + 1 < k:          # feed the draft's own output forward (speculative entry, dropped at commit)
                out = d.forward_entries(torch.tensor([tok], device=out.device), out[None], state.kv)[0]
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)

    def _draw(self, logits_d: torch.Tensor, sampling: SamplingParams, generator: torch.Generator,
              noise: PositionNoise | None, offset: int) -> tuple[int, torch.Tensor | None]:
        """A target-vocabulary token from (Vd,) draft logits, with q over the target vocabulary
        (zero outside the draft vocabulary) when sampling (a seeded request: its Gumbel-max
        draw at `offset`)."""
        d = self.draft
        if sampling.greedy:
            return int(d.to_target_ids(logits_d.argmax())), None
        q_d = draft_probs(logits_d, sampling, self.draft_mass, self.draft_max_candidates)             # (Vd,)
        target_ids = d.to_target_ids(torch.arange(q_d.shape[0], device=q_d.device))
        q = q_d.new_zeros(self.vocab_size).index_copy_(0, target_ids, q_d)                            # (V,)
        return (noise.pick(q, offset)[0] if noise is not None else sample(q, generator)), q

    def commit_one(self, state: Eagle3State, tokens: list[int], features: torch.Tensor) -> None:
        """tokens: (m,) emitted this step; features: (m, 3H) target features before each. The
        speculative entries go now; the emitted ones wait for the next propose (`_run_pending`)."""
        state.kv.truncate(state.committed)
        state.pending.add(StepResult(None, tokens, features))

    @torch.inference_mode()
    def _run_pending(self, state: Eagle3State) -> None:
        """Run the entries emitted since the last propose through the draft (one pass)."""
        late = state.pending.take()
        if late is None:
            return
        d = self.draft
        ids = torch.tensor(late.tokens, device=late.features.device)
        out = d.forward_entries(ids, d.fc(late.features), state.kv)
        state.committed = len(state.kv)
        state.last_out = out[-1]

