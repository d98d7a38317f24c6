"""What the benchmarks' command lines share: parsing video sizes, and a run timed (or refused
when a model it needs is missing)."""

from __future__ import annotations

import sys
import time
from typing import Callable


def parse_videos(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in text.split(","):
        side, frames = item.lower().split("x")
        out.append((int(side), int(frames)))
    return tuple(out)


def run_timed(run: Callable[[], dict]) -> dict | None:
    """run() with its wall time added as "wall_seconds"; None, the reason on stderr, when a
    model it needs is missing (the CLI's exit status 2)."""
    t0 = time.perf_counter()
    try:
        result = run()
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    result["wall_seconds"] = time.perf_counter() - t0
    return result
