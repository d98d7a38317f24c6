"""Output identity: where a method's tokens first differ from its reference's."""

from __future__ import annotations


def first_difference(ref: list[int], got: list[int]) -> dict | None:
    """Where two token sequences first differ (None: equal), with the 8 tokens from there on."""
    if got == ref:
        return None
    first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return {"index": first, "expected": ref[first: first + 8], "got": got[first: first + 8],
            "lengths": [len(ref), len(got)]}
