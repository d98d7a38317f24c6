"""sparrow.v1 responses as chat completions: one ChatCompletion, or a stream of chunks.

The chunks are the gRPC stream's own (one per engine delta), so a streamed answer arrives with
the cadence and the tokens the gRPC client sees.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ..protos import pb
from .schemas import (AssistantMessage, ChatCompletion, ChatCompletionChunk, Choice, ChunkChoice, Delta,
                      PromptTokensDetails, SpecUsage, Usage)

# sparrow.v1 finish reasons as OpenAI's; "abort" (as vLLM says it) for a request stopped by an
# Abort call (a deadline or a stopping server raise instead: 504, 503).
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


class StreamFailed(Exception):
    """A generation that failed after its answer began (pb.FINISH_REASON_ERROR)."""


def usage(completion: pb.Completion) -> Usage:
    u, m = completion.usage, completion.metrics
    return Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                 total_tokens=u.prompt_tokens + u.completion_tokens, visual_tokens=u.visual_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_prompt_tokens),
                 speculative=SpecUsage(num_draft_tokens=m.num_draft_tokens, steps=m.steps,
                                       draft_tokens=m.draft_tokens, accepted_tokens=m.accepted_tokens,
                                       mean_acceptance_length=m.mean_acceptance_length,
                                       accepted_per_step=m.accepted_per_step,
                                       acceptance_rate_per_position=list(m.acceptance_rate_per_position)))


def finish_reason(completion: pb.Completion) -> str:
    if completion.finish_reason == pb.FINISH_REASON_ERROR:
        raise StreamFailed(completion.error or "the generation failed")
    return FINISH.get(completion.finish_reason, "stop")


async def collect(responses: AsyncIterator[pb.GenerateResponse], completion_id: str, model: str) -> ChatCompletion:
    """The whole answer as one ChatCompletion."""
    text, token_ids, done = [], [], None
    async for response in responses:
        if response.HasField("chunk"):
            text.append(response.chunk.text)
            token_ids.extend(response.chunk.token_ids)
        else:
            done = response.completion
    if done is None:
        raise StreamFailed("the generation ended without its completion")
    choice = Choice(message=AssistantMessage(content="".join(text)), finish_reason=finish_reason(done),
                    token_ids=token_ids)
    return ChatCompletion(id=completion_id, model=model, choices=[choice], usage=usage(done))


async def chunks(responses: AsyncIterator[pb.GenerateResponse], completion_id: str, model: str,
                 include_usage: bool) -> AsyncIterator[ChatCompletionChunk]:
    """The answer as chat.completion.chunk objects: the role first, a chunk per delta, the
    finish reason, and with include_usage a last chunk with no choices and the usage."""
    created = int(time.time())

    def chunk(**choice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=completion_id, created=created, model=model, choices=[ChunkChoice(**choice)])

    first = True
    async for response in responses:
        if first:
            yield chunk(delta=Delta(role="assistant", content=""))
            first = False
        if response.HasField("chunk"):
            yield chunk(delta=Delta(content=response.chunk.text), token_ids=list(response.chunk.token_ids))
            continue
        done = response.completion
        yield chunk(delta=Delta(), finish_reason=finish_reason(done))
        if include_usage:
            yield ChatCompletionChunk(id=completion_id, created=created, model=model, choices=[], usage=usage(done))
