"""Is the Sparrow draft step itself length-independent? Times `propose(k=4)` alone and right
after a target verify step, at a short and a long world video (world pair, one thread).

    python -m benchmarks.draft_after_verify

A draft step that reads a constant number of keys should cost the same at any length; if it
costs more right after a long-context verify, the difference is the verify evicting the CPU
caches (it streams the whole KV cache), not the draft's attention.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks.world_accuracy import ladder_ends  # noqa: E402
from sparrow.config import SamplingParams, SpecConfig  # noqa: E402
from sparrow.models.draft import SparrowDraft  # noqa: E402
from sparrow.models.target import TargetModel  # noqa: E402
from sparrow.speculative.sparrow_proposer import SparrowProposer  # noqa: E402
from sparrow.speculative.draft_context import build_context
from sparrow.speculative.sampling import new_generator  # noqa: E402


def main(models: str = "models/world", reps: int = 30) -> None:
    torch.set_num_threads(1)
    target = TargetModel.from_pretrained(f"{models}/target")
    proposer = SparrowProposer(SparrowDraft.from_pretrained(f"{models}/draft", target), SpecConfig(window=16, anchors=32))
    sampling, rng = SamplingParams(), new_generator(0)
    for video, pre in ladder_ends(target, 64, proposer.needs.feature_layers):
        token = int(pre.logits.argmax())
        state = proposer.begin_context(build_context(pre, token, 0))
        alone, after = [], []
        proposal = proposer.propose_one(state, 4, sampling, rng)
        for _ in range(reps):                  # back to back: the draft's own working set stays warm
            t0 = time.perf_counter()
            proposal = proposer.propose_one(state, 4, sampling, rng)
            alone.append(time.perf_counter() - t0)
        for _ in range(reps):                  # as in decoding: each draft step follows a verify
            target.step(pre.state, torch.cat([torch.tensor([token]), proposal.tokens]), proposer.needs.feature_layers)
            target.rollback(pre.state, 5)
            t0 = time.perf_counter()
            proposal = proposer.propose_one(state, 4, sampling, rng)
            after.append(time.perf_counter() - t0)
        print(f"{video.num_visual_tokens:>6} visual tokens: propose(k=4) alone {statistics.median(alone) * 1e3:.2f} ms, "
              f"right after a verify {statistics.median(after) * 1e3:.2f} ms ({reps} reps, medians)")


if __name__ == "__main__":
    main()
