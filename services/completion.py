"""A finished generation as the sparrow.v1 message that ends its stream: the Generate RPC's
last response and a live answer's LiveDone carry the same pb.Completion."""

from __future__ import annotations

from sparrow.output import GenerationOutput
from sparrow.metrics import SpecMetrics

from .protos import pb

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def completion(output: GenerationOutput) -> pb.Completion:
    m: SpecMetrics = output.metrics
    return pb.Completion(
        finish_reason=FINISH.get(output.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=pb.Usage(prompt_tokens=m.prompt_tokens, visual_tokens=m.visual_tokens,
                       completion_tokens=m.completion_tokens, cached_prompt_tokens=m.cached_prompt_tokens),
        metrics=pb.SpecMetrics(
            num_draft_tokens=m.num_draft_tokens, steps=m.steps, draft_tokens=m.draft_tokens,
            accepted_tokens=m.accepted_tokens, mean_acceptance_length=m.mean_acceptance_length,
            accepted_per_step=m.accepted_per_step, acceptance_rate_per_position=m.acceptance_rate_per_position,
            video_seconds=m.video_seconds, prefill_seconds=m.prefill_seconds, decode_seconds=m.decode_seconds,
            draft_seconds=m.draft_seconds, verify_seconds=m.verify_seconds, policy_seconds=m.policy_seconds,
            decode_tokens_per_second=m.decode_tokens_per_second))
