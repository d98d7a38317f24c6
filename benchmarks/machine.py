"""What a benchmark ran on, in one line each: the machine and the target model."""

from __future__ import annotations

import os
import platform

import torch

from sparrow.kernels.native import cpu_flags
from sparrow.models.target import TargetModel


def vector_isa() -> str:
    """The CPU's widest vector instructions (what -march=native builds the kernels for: an AVX2 CPU
    runs them at half an AVX-512 one's width), and AMX where it has it; "" where it cannot be read."""
    flags = cpu_flags()
    widest = next((name for name in ("avx512f", "avx2", "avx", "sve", "asimd") if name in flags), "")
    return " + ".join(filter(None, [widest.upper(), "AMX" if "amx_tile" in flags else ""]))


def load_average() -> str:
    """The load average over 1 / 5 / 15 minutes, as a benchmark states it before and after a run."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def machine() -> str:
    try:
        model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                     platform.processor())
    except OSError:
        model = platform.processor() or platform.machine()
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", CPU only"
    isa = vector_isa()
    model = f"{model} ({isa})" if isa else model
    return (f"{model}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads), load average "
            f"{os.getloadavg()[0]:.1f} at start, torch {torch.__version__}{gpu}")


def describe_target(target: TargetModel) -> str:
    c = target.text_config
    return (f"{target.hf.config.model_type} (hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
            f"vocab {target.vocab_size}), {str(target.hf.dtype).removeprefix('torch.')}")
