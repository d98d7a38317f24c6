"""A chat-completions request as the sparrow.v1.GenerateRequest a gRPC client would send.

The HTTP front door is a translation, not a second engine: what comes out of here goes to the
same `SparrowService.generate` (embedded) or TargetDeployment (Ray) a gRPC call reaches, so the
service's checks (limits, the source policy, video options, admission) and its answer are the
gRPC path's own, token for token.
"""

from __future__ import annotations

import base64
import binascii
import re

from sparrow.errors import InvalidRequest, VideoTooLarge

from ..protos import pb
from .schemas import ChatCompletionRequest, ChatMessage, TextPart, VideoPart

UPLOADED = "sparrow://videos/"          # video_url of a video sent through UploadVideo
_DATA_URL = re.compile(r"data:video/[\w.+-]+;base64,", re.IGNORECASE)


def refuse_unsupported(req: ChatCompletionRequest) -> None:
    """A 400 naming any field that asks for something Sparrow does not do."""
    asked = []
    if req.n not in (None, 1):
        asked.append(f"n={req.n} (one choice per request)")
    if req.tools or req.functions or req.tool_choice not in (None, "none", "auto"):
        asked.append("tools / function calling")
    if req.logprobs or req.top_logprobs:
        asked.append("logprobs")
    if req.presence_penalty or req.frequency_penalty:
        asked.append("presence / frequency penalties")
    if req.logit_bias:
        asked.append("logit_bias")
    if req.response_format and req.response_format.get("type", "text") != "text":
        asked.append(f"response_format {req.response_format.get('type')!r}")
    if asked:
        raise InvalidRequest("not supported by this server: " + ", ".join(asked))


def to_generate_request(req: ChatCompletionRequest, max_video_bytes: int, request_id: str) -> pb.GenerateRequest:
    """The request as sparrow.v1 (InvalidRequest / VideoTooLarge for what cannot be one)."""
    refuse_unsupported(req)
    turns, video = _conversation(req.messages)
    history = [pb.Message(role=role, text=text) for role, text in turns[:-1]]
    max_new = req.max_completion_tokens or req.max_tokens or 0
    sampling = pb.SamplingParams(max_new_tokens=max_new, temperature=req.temperature or 0.0,
                                 top_p=req.top_p or 0.0, top_k=max(req.top_k or 0, 0),
                                 stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
                                 ignore_eos=req.ignore_eos)
    if req.seed is not None:
        sampling.seed = req.seed
    out = pb.GenerateRequest(request_id=request_id, video=_video_source(video, max_video_bytes),
                             prompt=turns[-1][1], sampling=sampling, history=history)
    if req.mm_processor_kwargs is not None:
        out.video_options.CopyFrom(pb.VideoOptions(**req.mm_processor_kwargs.model_dump(exclude_none=True)))
    if req.speculative is not None:
        out.spec.CopyFrom(pb.SpecOptions(**req.speculative.model_dump(exclude_none=True)))
    return out


def _conversation(messages: list[ChatMessage]) -> tuple[list[tuple[str, str]], str]:
    """(role, text) turns, user first and alternating, and the one video's url, which must be
    in the first user turn (the video opens the conversation, as sparrow.chat places it)."""
    turns, videos = [], []
    for i, m in enumerate(messages):
        if m.role not in ("user", "assistant"):
            raise InvalidRequest(f"messages[{i}]: role {m.role!r} is not supported (user and assistant turns only)")
        parts = [TextPart(type="text", text=m.content)] if isinstance(m.content, str) else (m.content or [])
        for part in parts:
            if isinstance(part, VideoPart):
                if m.role != "user" or turns:
                    raise InvalidRequest(f"messages[{i}]: the video must be in the first user message")
                videos.append(part.video_url.url)
        text = "\n".join(p.text for p in parts if isinstance(p, TextPart))
        turns.append((m.role, text))
    if len(videos) != 1:
        raise InvalidRequest(f"a request asks about exactly one video (a video_url content part); got {len(videos)}")
    return turns, videos[0]


def _video_source(url: str, max_video_bytes: int) -> pb.VideoSource:
    """sparrow.v1.VideoSource for a video_url. Paths and URLs are checked by the service's
    source policy (403 outside it), as for gRPC; inline bytes are bounded before decoding."""
    if url.startswith(UPLOADED):
        return pb.VideoSource(video_id=url[len(UPLOADED):])
    if url.startswith("file://"):
        return pb.VideoSource(path=url[len("file://"):])
    match = _DATA_URL.match(url)
    if match:
        encoded = url[match.end():]
        if len(encoded) // 4 * 3 > max_video_bytes + 2:          # refused before decoding
            raise VideoTooLarge(f"the inline video is about {len(encoded) // 4 * 3} bytes, over the limit of "
                                f"{max_video_bytes}")
        try:
            return pb.VideoSource(data=base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            raise InvalidRequest("the data: video_url is not valid base64") from None
    if url.startswith("data:"):
        raise InvalidRequest("a data: video_url must be data:video/<type>;base64,<bytes>")
    return pb.VideoSource(url=url)        # http(s)://..., rtsp://...: the URL allowlist decides
