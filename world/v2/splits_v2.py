"""World v2's held-out rule: each split owns a range of scene seeds, and the ranges never meet.

Training draws from `train`; tests and the accuracy measured while training from `test`; the
benchmark's and the model cards' numbers from `benchmark`, which nothing trains or tunes on.
A scene is a pure function of (seed, seconds), so a seed range is the whole rule.
"""

from __future__ import annotations

from sparrow.errors import InvalidRequest

SPLITS: dict[str, range] = {
    "train": range(0, 1_000_000_000),
    "test": range(1_000_000_000, 1_010_000_000),
    "benchmark": range(2_000_000_000, 2_010_000_000),
}


def split_seeds(split: str, count: int, first: int = 0) -> range:
    """`count` seeds of `split`, from its `first`-th on (InvalidRequest past its end)."""
    if split not in SPLITS:
        raise InvalidRequest(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if count < 1 or first < 0:
        raise InvalidRequest(f"need count >= 1 and first >= 0, got {count}, {first}")
    seeds = SPLITS[split]
    if first + count > len(seeds):
        raise InvalidRequest(f"split {split} has {len(seeds):,} seeds; {first} + {count} is past its end")
    return range(seeds.start + first, seeds.start + first + count)


def split_of(seed: int) -> str:
    """The split a seed belongs to (InvalidRequest for a seed in none)."""
    for name, seeds in SPLITS.items():
        if seed in seeds:
            return name
    raise InvalidRequest(f"seed {seed} is in no v2 split ({', '.join(f'{k}: {v.start}..{v.stop - 1}' for k, v in SPLITS.items())})")
