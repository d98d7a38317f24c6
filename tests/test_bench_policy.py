"""benchmarks/policy_batch.py on tiny random models: a burst per arm, the arms' policies swapped
into one engine (each its own, kept), the fixed arm's k capped, the report's section written.
Timings are the benchmark's business, never asserted here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/ is a repo folder, not installed
from benchmarks import policy_batch  # noqa: E402
from benchmarks.tiny_models import save_tiny_models  # noqa: E402


def test_arms_run_paired_and_their_section_is_written(tmp_path, monkeypatch):
    models = save_tiny_models(tmp_path / "models")
    made: dict = {}
    real = policy_batch.arm_policy
    monkeypatch.setattr(policy_batch, "arm_policy", lambda arm, k: made.setdefault(arm, real(arm, k)))
    out = tmp_path / "BENCHMARKS.md"
    assert policy_batch.main(["--models", str(models), "--side", "84", "--frames", "8", "--streams", "2", "--reps", "2",
                              "--tokens", "8", "--arms", "adaptive,fixed-1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "## The draft policy at batch 8 against fixed k" in text and "Command: `python -m benchmarks.policy_batch" in text
    rows = [line for line in text.splitlines() if line.startswith("| adaptive |") or line.startswith("| fixed-1 |")]
    assert len(rows) == 2
    fixed = made["fixed-1"]
    assert fixed.request_steps > 0 and 0 < fixed.drafts <= fixed.request_steps        # never more than K = 1
    assert made["adaptive"].adaptive and not fixed.adaptive
    with pytest.raises(ValueError, match="adaptive or fixed-K"):
        policy_batch.arm_policy("fixed-9", 4)
