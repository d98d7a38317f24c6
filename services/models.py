"""Loading the models a server runs, from a spec string:

    target: a saved model directory (config.json + weights), or "tiny:<arch>[:seed]", a tiny
            random model built in code (demos and tests; the answers are noise)
    draft:  a saved Sparrow draft directory, or "tiny[:seed]" (random, fits the target)

A draft replica never loads the target: it reads only the target's token embedding and
lm_head (which the draft shares) from the checkpoint.

Every loader takes the placement settings (sparrow.models.placement): dtype ("float32",
"bfloat16", "float16", "auto"), device ("cpu", "cuda[:N]", "auto") and, for a target too
large for one GPU, device_map ("auto"). The draft goes where the target's embedding is, in its
dtype, unless told otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from transformers import AutoConfig

from sparrow.errors import InvalidRequest
from sparrow.models.draft import DraftArchitecture, SparrowDraft
from sparrow.models.placement import parse_device, parse_dtype
from sparrow.models.target import TargetModel


def load_target(spec: str, dtype: str | torch.dtype = "float32", device: str = "cpu",
                device_map: str | dict | None = None) -> TargetModel:
    if spec.startswith("tiny:"):
        from sparrow.tiny import tiny_target
        arch, _, seed = spec.removeprefix("tiny:").partition(":")
        target = tiny_target(arch, seed=int(seed or 0))
        if device_map is not None:
            raise InvalidRequest("a tiny target is built on one device: give device, not device_map")
        want = parse_dtype(dtype)
        target.hf.to(parse_device(device), **({"dtype": want} if want != "auto" else {}))
        return target
    return TargetModel.from_pretrained(spec, dtype=dtype, device=device, device_map=device_map)


def load_draft(spec: str, target, arch: DraftArchitecture = DraftArchitecture()) -> SparrowDraft:
    """target: a TargetModel, or SharedHeads on a draft replica. The draft takes the device
    and dtype of the target's embedding (which it shares)."""
    if spec.startswith("tiny"):
        from sparrow.tiny import tiny_draft
        if not isinstance(target, TargetModel):
            raise InvalidRequest("a tiny draft is built for a tiny target; give the target spec")
        return tiny_draft(target, arch, seed=int(spec.partition(":")[2] or 0))
    draft = SparrowDraft.from_pretrained(spec, attention_backend=arch.attention_backend)
    return draft.to(target.device, target.embed_tokens().weight.dtype).bind(target).eval()


@dataclass
class SharedHeads:
    """What a Sparrow draft takes from its target: the frozen embedding and lm_head (and the
    depth, to check its feature layers). Duck-types the part of TargetModel that bind() reads."""

    embed: nn.Embedding
    head: nn.Linear
    num_layers: int

    def embed_tokens(self) -> nn.Module:
        return self.embed

    def lm_head(self) -> nn.Module:
        return self.head

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device


def load_heads(target_spec: str, dtype: str | torch.dtype = "float32", device: str = "cpu") -> SharedHeads | TargetModel:
    """The target's embedding and lm_head without the rest of it (a tiny target is cheap
    to build whole), in `dtype` ("auto": as stored) on `device`."""
    if target_spec.startswith("tiny:"):
        return load_target(target_spec, dtype, device)
    want, where = parse_dtype(dtype), parse_device(device)
    path = Path(target_spec)
    text = AutoConfig.from_pretrained(path).get_text_config()
    weights = _read_tensors(path, ("embed_tokens.weight", "lm_head.weight"))
    if "embed_tokens.weight" not in weights:
        raise InvalidRequest(f"no embed_tokens weight in {path}")
    weights = {k: w.to(where, **({"dtype": want} if want != "auto" else {})) for k, w in weights.items()}
    embed = nn.Embedding.from_pretrained(weights["embed_tokens.weight"], freeze=True)
    head_weight = weights.get("lm_head.weight", weights["embed_tokens.weight"])    # tied when absent
    head = nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=False)
    head.weight = nn.Parameter(head_weight, requires_grad=False)
    return SharedHeads(embed, head, text.num_hidden_layers)


def _read_tensors(path: Path, suffixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """{suffix: tensor} for the language-model tensors whose names end with each suffix,
    read from (possibly sharded) safetensors without loading anything else. Names differ
    between checkpoint versions ("model.embed_tokens" vs "model.language_model.embed_tokens"),
    the suffixes do not."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = json.loads(index.read_text())["weight_map"]                 # name -> file
    else:
        with safe_open(path / "model.safetensors", "pt") as f:
            files = {name: "model.safetensors" for name in f.keys()}
    found = {}
    for suffix in suffixes:
        names = [n for n in files if n.endswith(suffix) and "visual" not in n and "vision" not in n]
        if names:
            name = min(names, key=len)
            with safe_open(path / files[name], "pt") as f:
                found[suffix] = f.get_tensor(name)
    return found
