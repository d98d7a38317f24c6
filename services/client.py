"""A small blocking client for programs (and `sparrow generate`).

    client = SparrowClient("127.0.0.1:50051")
    video_id = client.upload("clip.mp4")                  # content-hashed; stored once
    for response in client.stream("What happens?", video_id=video_id, max_new_tokens=64):
        ...                                               # chunks, then one completion
    result = client.generate("What happens?", video_id=video_id)   # all at once
    client.generate("Which way?", video_id=video_id,                # a follow-up: the video's prefill is reused
                    history=[("user", "What happens?"), ("assistant", result.text)])

    with client.live(fps=2, window_s=30, standing=[("red", "Is a red shape in view?", 5.0)]) as live:
        live.opened()                                     # LiveOpened (the session's window, its limits)
        live.send_chunk(ts_bytes)                         # MPEG-TS / fragmented MP4, or send_frames(rgb, times)
        live.ask("What just happened?", question_id="q1", max_new_tokens=32)
        live.close()                                      # no more messages: drain, final stats, OK
        for response in live:                             # LiveChunk / LiveDone / LiveEvent / LiveStats
            ...
"""

from __future__ import annotations

import hashlib
import itertools
import queue
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .protos import pb, pb_grpc
from .wire import message_options

MiB = 1 << 20
# Ray Serve routes a call carrying this metadata to a replica that has "loaded" the id (model
# multiplexing): the target replica that already holds the video's prefill.
VIDEO_AFFINITY_KEY = "multiplexed_model_id"


def video_affinity(video_id: str | None = None, path: str | None = None, url: str | None = None,
                   data: bytes | None = None) -> str:
    """A routing key naming the video a request asks about: questions about one video go to
    the replica that prefilled it. Uploads are named by their content hash (the video id),
    inline bytes by theirs; a path or URL by itself, or its hash when long (metadata is
    bounded; the server keys the video by content anyway: this only routes)."""
    if video_id:
        return video_id
    if data is not None:
        return hashlib.sha256(data).hexdigest()
    name = "path:" + path if path is not None else "url:" + (url or "")
    return name if len(name) <= 256 else name[:4] + hashlib.sha256(name.encode()).hexdigest()


@dataclass
class GenerateResult:
    request_id: str
    token_ids: list[int]
    text: str
    completion: pb.Completion

    @property
    def finish_reason(self) -> str:
        return pb.FinishReason.Name(self.completion.finish_reason).removeprefix("FINISH_REASON_").lower()


class SparrowClient:
    def __init__(self, address: str, *, max_message_bytes: int = 64 * MiB, metadata: tuple = ()):
        self.channel = grpc.insecure_channel(address, options=message_options(max_message_bytes))
        self.stub = pb_grpc.SparrowStub(self.channel)
        self.max_message_bytes = max_message_bytes
        self.metadata = tuple(metadata)        # e.g. (("application", "sparrow"),) behind Ray Serve

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "SparrowClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- videos ------------------------------------------------------------------------------
    def upload(self, video: str | Path | bytes, chunk_bytes: int = 8 * MiB, timeout: float | None = None) -> str:
        """Upload a file (or its bytes) in chunks; returns its video_id. The first chunk
        carries the SHA-256, which the server checks the bytes against (every byte is sent,
        even of a video the server holds: it is stored once)."""
        read = _file_chunks(Path(video), chunk_bytes) if isinstance(video, (str, Path)) else _byte_chunks(video, chunk_bytes)
        digest = hashlib.sha256()
        for part in read():
            digest.update(part)

        def messages():
            for i, part in enumerate(read()):
                yield pb.VideoChunk(data=part, sha256=digest.hexdigest() if i == 0 else "")

        metadata = self.metadata + ((VIDEO_AFFINITY_KEY, digest.hexdigest()),)    # to the replica that will prefill it
        return self.stub.UploadVideo(messages(), timeout=timeout, metadata=metadata).video_id

    # ----- generation --------------------------------------------------------------------------
    def stream(self, prompt: str, *, video_id: str | None = None, path: str | None = None, url: str | None = None,
               data: bytes | None = None, request_id: str = "", timeout: float | None = None,
               video_options: pb.VideoOptions | None = None, spec: pb.SpecOptions | None = None,
               history: Sequence[tuple[str, str]] = (), **sampling) -> "GenerateStream":
        """The response stream; sampling: the fields of pb.SamplingParams (max_new_tokens,
        temperature, top_p, top_k, seed, stop, ...). history: earlier turns about the same
        video as (role, text) pairs, oldest first: ("user", q1), ("assistant", a1), ..."""
        given = {k: v for k, v in dict(video_id=video_id, path=path, url=url, data=data).items() if v is not None}
        if len(given) != 1:
            raise ValueError("name the video exactly one way: video_id, path, url or data")
        request_id = request_id or uuid.uuid4().hex          # known here, so cancel() can Abort it
        request = pb.GenerateRequest(request_id=request_id, prompt=prompt, video=pb.VideoSource(**given),
                                     sampling=pb.SamplingParams(**sampling), video_options=video_options, spec=spec,
                                     history=[pb.Message(role=role, text=text) for role, text in history])
        # The deadline again as metadata: behind Ray Serve's proxy the server may not see the gRPC one.
        metadata = self.metadata + ((("sparrow-timeout-ms", str(int(timeout * 1000))),) if timeout else ())
        metadata += ((VIDEO_AFFINITY_KEY, video_affinity(**given)),)
        return GenerateStream(self, request_id, self.stub.Generate(request, timeout=timeout, metadata=metadata))

    def generate(self, prompt: str, **kwargs) -> GenerateResult:
        """Stream to the end and collect: token ids, text and the completion."""
        token_ids, text, request_id, done = [], [], "", None
        for response in self.stream(prompt, **kwargs):
            request_id = response.request_id
            if response.HasField("chunk"):
                token_ids.extend(response.chunk.token_ids)
                text.append(response.chunk.text)
            else:
                done = response.completion
        if done is None:
            raise RuntimeError("the stream ended without a completion")
        return GenerateResult(request_id, token_ids, "".join(text), done)

    # ----- live sessions -----------------------------------------------------------------------
    def live(self, *, fps: float | None = None, window_s: float | None = None, evict_s: float | None = None,
             max_lag_s: float | None = None, min_pixels: int | None = None, max_pixels: int | None = None,
             standing: Sequence[tuple[str, str, float]] = (), stats_every_s: float | None = None,
             url: str = "", timeout: float | None = None, standing_sampling: dict | None = None,
             evict_mode: str = "", stale_after_s: float | None = None, rules: Sequence[pb.AlertRule] = (),
             webhook_url: str = "") -> "LiveStream":
        """Open a live session (the Live RPC). None: the server's default. standing: questions
        asked every N seconds of stream, as (question_id, text, every_s); url: the server
        reads the video itself (under its URL allowlists) instead of the client sending it;
        evict_mode: "shift" (default) or "refresh" (sparrow.live.window.LiveConfig);
        stale_after_s: wall seconds without a frame before the source counts as stale.
        rules: alert rules from the start (pb.AlertRule); webhook_url: where the server also
        POSTs their incidents (under its allowed webhook prefixes).
        Use as a context manager: leaving the block before the server has ended the stream
        cancels it (the server frees the session at once)."""
        given = dict(fps=fps, window_s=window_s, evict_s=evict_s, max_lag_s=max_lag_s, min_pixels=min_pixels,
                     max_pixels=max_pixels, stats_every_s=stats_every_s, stale_after_s=stale_after_s)
        opening = pb.LiveOpen(**{k: v for k, v in given.items() if v is not None}, url=url, evict_mode=evict_mode, standing=[
            pb.StandingQuestion(question_id=qid, text=text, every_s=every_s,
                                sampling=pb.SamplingParams(**(standing_sampling or {})))
            for qid, text, every_s in standing], rules=list(rules), webhook_url=webhook_url)
        metadata = self.metadata + ((("sparrow-timeout-ms", str(int(timeout * 1000))),) if timeout else ())
        return LiveStream(self, opening, timeout, metadata)

    def abort(self, request_id: str, timeout: float | None = 10.0) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout, metadata=self.metadata).found

    def model_info(self, timeout: float | None = 10.0) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def health(self, service: str = "", timeout: float | None = 10.0) -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=self.metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class GenerateStream:
    """Responses of one Generate call. `cancel()` cancels the call and also sends Abort for
    its request id, because a proxy in between (Ray Serve's) may not pass the cancel on."""

    def __init__(self, client: SparrowClient, request_id: str, call):
        self.client, self.request_id, self.call = client, request_id, call

    def __iter__(self) -> "GenerateStream":
        return self

    def __next__(self) -> pb.GenerateResponse:
        return next(self.call)

    def cancel(self) -> None:
        self.call.cancel()
        try:
            self.client.abort(self.request_id, timeout=5.0)
        except grpc.RpcError:
            pass                   # the server may be gone; the cancel stands


class LiveStream:
    """One live session: send_* / ask / add_standing / remove_standing / end queue messages
    (thread-safe); iterate for the server's LiveResponse messages after the LiveOpened
    (`opened()`). `close()` half-closes: the server ingests what it got, finishes running
    answers, sends a final LiveStats and ends the stream OK. `cancel()` ends it at once."""

    _CLOSE = object()

    def __init__(self, client: SparrowClient, opening: pb.LiveOpen, timeout: float | None, metadata: tuple):
        self.client = client
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox.put(pb.LiveRequest(open=opening))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._opened: pb.LiveOpened | None = None
        self._finished = False
        self.call = client.stub.Live(self._requests(), timeout=timeout, metadata=metadata)

    def _requests(self) -> Iterator[pb.LiveRequest]:
        while (message := self._outbox.get()) is not self._CLOSE:
            yield message

    def _send(self, message: pb.LiveRequest) -> None:
        with self._lock:
            if self._closed:
                raise ValueError("the live stream is closed for sending")
            self._outbox.put(message)

    # ----- sending -------------------------------------------------------------------------------
    def send_chunk(self, data: bytes) -> None:
        """Container bytes (MPEG-TS or fragmented MP4), in order; split into messages under
        the message size limit."""
        step = max(1, self.client.max_message_bytes // 2)
        for i in range(0, len(data), step):
            self._send(pb.LiveRequest(media=pb.MediaChunk(data=bytes(data[i:i + step]))))

    def send_frames(self, frames: np.ndarray, timestamps: Sequence[float]) -> None:
        """RGB frames uint8 [T, H, W, 3] at stream times (seconds, increasing)."""
        frames = np.ascontiguousarray(frames, dtype=np.uint8)
        if frames.ndim != 4 or frames.shape[-1] != 3 or len(timestamps) != frames.shape[0]:
            raise ValueError(f"frames must be [T, H, W, 3] with T timestamps, got {frames.shape} and {len(timestamps)}")
        per_message = max(1, (self.client.max_message_bytes // 2) // max(1, frames[0].nbytes if len(frames) else 1))
        _, height, width, _ = frames.shape
        for i in range(0, frames.shape[0], per_message):
            part = frames[i:i + per_message]
            self._send(pb.LiveRequest(frames=pb.RawFrames(width=width, height=height, count=part.shape[0],
                                                          rgb=part.tobytes(),
                                                          timestamps=list(timestamps[i:i + per_message]))))

    def ask(self, text: str, question_id: str = "", **sampling) -> str:
        """Ask about the window as it is when the server gets this; returns the question's id
        (answers and events carry it). sampling: the fields of pb.SamplingParams."""
        question_id = question_id or f"c{next(self._ids)}"
        self._send(pb.LiveRequest(question=pb.LiveQuestion(question_id=question_id, text=text,
                                                           sampling=pb.SamplingParams(**sampling))))
        return question_id

    def add_standing(self, text: str, every_s: float, question_id: str = "", **sampling) -> str:
        question_id = question_id or f"cs{next(self._ids)}"
        self._send(pb.LiveRequest(add_standing=pb.StandingQuestion(
            question_id=question_id, text=text, every_s=every_s, sampling=pb.SamplingParams(**sampling))))
        return question_id

    def remove_standing(self, question_id: str) -> None:
        self._send(pb.LiveRequest(remove_standing=pb.RemoveStanding(question_id=question_id)))

    def add_rule(self, rule: pb.AlertRule) -> None:
        """An alert rule (pb.AlertRule); the server answers with a RuleList, incidents follow."""
        self._send(pb.LiveRequest(add_rule=rule))

    def replace_rule(self, rule: pb.AlertRule) -> None:
        self._send(pb.LiveRequest(replace_rule=rule))

    def remove_rule(self, rule_id: str) -> None:
        self._send(pb.LiveRequest(remove_rule=pb.RemoveRule(rule_id=rule_id)))

    def list_rules(self) -> None:
        self._send(pb.LiveRequest(list_rules=pb.ListRules()))

    def end(self) -> None:
        """No more video (questions may still come)."""
        self._send(pb.LiveRequest(end=pb.EndOfStream()))

    def close(self) -> None:
        """Half-close: nothing more will be sent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._outbox.put(self._CLOSE)

    def cancel(self) -> None:
        self.close()
        self.call.cancel()

    # ----- receiving -----------------------------------------------------------------------------
    def opened(self) -> pb.LiveOpened:
        """The server's LiveOpened (waits for it; a refused open raises grpc.RpcError)."""
        if self._opened is None:
            first = next(self.call)
            if not first.HasField("opened"):
                raise RuntimeError(f"the live stream began with {first.WhichOneof('kind')}, not opened")
            self._opened = first.opened
        return self._opened

    def __iter__(self) -> Iterator[pb.LiveResponse]:
        self.opened()
        for response in self.call:
            yield response
        self._finished = True

    def __enter__(self) -> "LiveStream":
        return self

    def __exit__(self, *exc) -> None:
        if not self._finished:
            self.cancel()
        else:
            self.close()


def _file_chunks(path: Path, size: int):
    def read():
        with open(path, "rb") as f:
            while part := f.read(size):
                yield part
    return read


def _byte_chunks(data: bytes, size: int):
    def read():
        for i in range(0, len(data), size):
            yield data[i:i + size]
    return read
