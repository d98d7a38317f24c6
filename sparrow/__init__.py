"""Sparrow: lossless speculative decoding for long-video LLMs.

    from sparrow import Engine, SpecConfig, SamplingParams
"""

from .config import SamplingParams, SpecConfig
from .engine import Engine, Generation, GenerationOutput, TokenDelta
from .errors import (ContextOverflow, InvalidRequest, ResourceExhausted, SparrowError, VideoError)
from .metrics import SpecMetrics

__all__ = [
    "Engine", "Generation", "GenerationOutput", "TokenDelta", "SpecConfig", "SamplingParams", "SpecMetrics",
    "SparrowError", "InvalidRequest", "ContextOverflow", "ResourceExhausted", "VideoError",
]
__version__ = "0.1.0"
