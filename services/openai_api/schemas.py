"""The shapes of the OpenAI chat-completions protocol that Sparrow speaks, as Pydantic models.

Requests are validated here for shape and range only (a negative max_tokens, a temperature of
7, an unknown content part: 400 before anything runs). What a server's limits allow (how many
tokens, how large a video, which paths) is the service's to decide, as it is for gRPC.

Fields an OpenAI client may send that change the answer and that Sparrow does not implement
(n > 1, tools, logprobs, penalties, logit_bias, a JSON response format) are refused with a 400
that names them: the answer is never silently something other than what was asked for. Other
unknown fields (user, metadata, store, ...) are ignored, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

U32 = 2**32 - 1           # sparrow.v1 carries counts as uint32
U64 = 2**64 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----- request -------------------------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: str


class VideoURL(_Strict):
    url: str = Field(min_length=1)


class VideoPart(_Strict):
    """url: http(s)://... (the server's URL allowlist), file://<path> (under its media root),
    data:video/<kind>;base64,<bytes>, or sparrow://videos/<id> (an UploadVideo id)."""

    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | VideoPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")       # name, refusal, ... carry nothing Sparrow uses

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class VideoKwargs(_Strict):
    """The video options of sparrow.v1.VideoOptions, under the names vLLM's
    `mm_processor_kwargs` gives them for Qwen2.5-VL (fps, min_pixels, max_pixels) and the
    rest under sparrow.v1's own names."""

    fps: float | None = Field(default=None, gt=0, le=1000)
    num_frames: int | None = Field(default=None, ge=1, le=U32)
    max_frames: int | None = Field(default=None, ge=1, le=U32)
    start_s: float | None = Field(default=None, ge=0)
    end_s: float | None = Field(default=None, ge=0)
    min_pixels: int | None = Field(default=None, ge=1, le=U32)
    max_pixels: int | None = Field(default=None, ge=1, le=U32)
    max_visual_tokens: int | None = Field(default=None, ge=1, le=U32)


class Speculative(_Strict):
    """The per-request speculation switch (sparrow.v1.SpecOptions): enabled False decodes
    without the draft; num_draft_tokens fixes k for this request."""

    enabled: bool | None = None
    num_draft_tokens: int | None = Field(default=None, ge=0, le=64)


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=U32)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=U32)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=U32)      # vLLM: -1 (or 0) is off
    seed: int | None = Field(default=None, ge=0, le=U64)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=U32)]] | None = None
    ignore_eos: bool = False
    mm_processor_kwargs: VideoKwargs | None = None
    speculative: Speculative | None = None
    request_id: str | None = Field(default=None, max_length=128)
    # Refused unless they ask for nothing (services.openai_api.chat_request.refuse_unsupported)
    n: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops_as_list(cls, value):
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_max(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ: give one")
        return self


# ----- responses ----------------------------------------------------------------------------------
class SpecUsage(BaseModel):
    """Speculative decoding's share of a request (DESIGN.md's terms): draft tokens proposed,
    accepted, verify steps, mean acceptance length tau = 1 + accepted / steps."""

    num_draft_tokens: int          # k (0: decoded without the draft)
    steps: int
    draft_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float
    accepted_per_step: float
    acceptance_rate_per_position: list[float]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    visual_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculative: SpecUsage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None
    token_ids: list[int]           # as vLLM's return_token_ids: what the lossless tests compare


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sparrow"
    max_model_len: int
    speculative: dict[str, Any]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
