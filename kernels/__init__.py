"""Attention kernels for the two shapes Sparrow runs, each beside the plain-torch reference it
is tested against (tests/test_kernels.py). Contract and conventions: reference.py.

    draft window   a few draft queries over anchors + window + glimpse keys
                   reference.window_attention_ref      (gathers the visible keys)
                   triton_attention.window_attention_triton, flex.window_attention_flex
    verify         nq draft tokens (chain or tree) over a long cached prefix
                   reference.verify_attention_ref      (plain SDPA, dense mask)
                   packed.verify_attention_packed      (prefix unmasked + own mask, merged by
                                                        log-sum-exp: the target's CPU default)
                   split_kv.verify_attention_split     (flash-decoding in torch)
                   triton_attention.verify_attention_triton, flex.verify_attention_flex,
                   flash.verify_attention_flash        (chain only, CUDA)

The draft reaches these through the backend registry (`DraftArchitecture.attention_backend`:
"sdpa", "eager", "flex", "triton", "flash_attn"), which imports the optional modules only when
selected. Importing this package imports neither triton, flex attention nor flash-attn.

Kernels are leaves: they import nothing of the core but the window rule (sparrow.anchored_window), so
the registry's import by name is the only edge between the two. The draft's CUDA-graph
decode step uses the draft model itself, so it lives with it (benchmarks.draft_graph).
"""

from .packed import verify_attention_packed
from .reference import PAD_POS, chain_tree, verify_attention_ref, window_attention_ref
from .split_kv import verify_attention_split

__all__ = ["PAD_POS", "chain_tree", "verify_attention_ref", "window_attention_ref", "verify_attention_packed",
           "verify_attention_split"]
