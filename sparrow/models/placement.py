"""Where and in what precision models load: the dtype / device / device_map settings every
loader, CLI and deployment passes down, parsed and checked in one place.

    dtype       "float32" | "bfloat16" | "float16" | "auto" (the checkpoint's own torch_dtype)
    device      "cpu" | "cuda" | "cuda:N" | "auto" (cuda when one is visible, else cpu)
    device_map  None (the whole model on `device`) | "auto" (split across the visible GPUs by
                accelerate, for a target too large for one) | an HF device_map dict
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from ..errors import InvalidRequest

if TYPE_CHECKING:
    import torch

# torch loads on first use, so a command line's parser (add_placement_arguments) does not need it.
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_NAMES = (*DTYPES, "auto")
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """A torch dtype, or "auto" (HF then keeps the checkpoint's torch_dtype)."""
    import torch

    if isinstance(dtype, torch.dtype):
        if str(dtype).removeprefix("torch.") not in DTYPES:
            raise InvalidRequest(f"dtype {dtype} is not supported; use one of {DTYPE_NAMES}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        return "auto"
    if name not in DTYPES:
        raise InvalidRequest(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
    return getattr(torch, name)


def parse_device(device: str | torch.device) -> torch.device:
    """A torch device; "auto" is the first GPU when one is visible, else the CPU."""
    import torch

    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidRequest(f"device {device!r} is not a torch device: {e}") from e
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"device {device!r} asked for, but no CUDA device is visible")
    return parsed


def check_device_map(device_map) -> None:
    if device_map is None:
        return
    if isinstance(device_map, str) and device_map not in DEVICE_MAPS:
        raise InvalidRequest(f"device_map must be one of {DEVICE_MAPS} or a mapping, got {device_map!r}")
    if not isinstance(device_map, (str, dict)):
        raise InvalidRequest(f"device_map must be a string or a mapping, got {type(device_map).__name__}")
    # HF splits a model across devices through accelerate, an optional dependency.
    if importlib.util.find_spec("accelerate") is None:
        raise InvalidRequest("device_map needs the accelerate package: pip install accelerate")


def check_placement(dtype: str, device: str, device_map=None) -> None:
    """Validate settings strings where they are given (a config file, a CLI flag), without
    needing the device to exist here: a Ray head without GPUs checks a GPU replica's settings."""
    import torch

    parse_dtype(dtype)
    if device != "auto":
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidRequest(f"device {device!r} is not a torch device: {e}") from e
    if device_map is not None and not isinstance(device_map, (str, dict)):
        raise InvalidRequest(f"device_map must be a string or a mapping, got {type(device_map).__name__}")
    if isinstance(device_map, str) and device_map not in DEVICE_MAPS:
        raise InvalidRequest(f"device_map must be one of {DEVICE_MAPS} or a mapping, got {device_map!r}")


def add_placement_arguments(p, device_map: bool = False) -> None:
    """--dtype / --device (and --device-map where a command can split a target across GPUs):
    the same names and values as the settings fields (sparrow.models.placement)."""
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                   help="model weights' dtype (auto: the checkpoint's own); bfloat16 on a GPU")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (cuda when visible)")
    if device_map:
        p.add_argument("--device-map", choices=DEVICE_MAPS, default=None,
                       help="split a target too large for one GPU across the visible GPUs (needs accelerate); "
                            "overrides --device for the target, the draft goes where its embedding is")
