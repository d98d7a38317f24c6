"""Sparrow: lossless speculative decoding for long-video LLMs.

    from sparrow import Engine, SpecConfig, SamplingParams
"""

from .errors import (ContextOverflow, InvalidRequest, ResourceExhausted, SparrowError, VideoError)
from .lazy import lazy_exports

# The engine's names load on first use, so what needs only the errors or a subpackage (the
# command line's parser, a gRPC client, `sparrow generate`) does not import torch.
__getattr__ = lazy_exports(__name__, {
    "SamplingParams": "config", "SpecConfig": "config", "Engine": "engine", "Generation": "engine",
    "GenerationOutput": "engine", "TokenDelta": "engine", "SpecMetrics": "metrics"})

__all__ = [
    "Engine", "Generation", "GenerationOutput", "TokenDelta", "SpecConfig", "SamplingParams", "SpecMetrics",
    "SparrowError", "InvalidRequest", "ContextOverflow", "ResourceExhausted", "VideoError",
]
__version__ = "0.1.0"
