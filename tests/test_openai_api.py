"""The OpenAI-compatible HTTP API on the embedded host: a real uvicorn server on loopback beside
the gRPC one, the official `openai` client unchanged.

What must hold: the answer over HTTP (streamed or not) is the gRPC API's and Engine.generate's,
token for token, at T = 0 and seeded at T = 1; every refusal has its HTTP status and an OpenAI
error object, and the server keeps serving after it; a client that disconnects mid-stream frees
its slot within a second; X-Request-Timeout is a deadline (504); a stopping server says 503.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import http.client
import json
import time
import urllib.error
import urllib.request

import pytest
from conftest_services import SPEC_KWARGS

openai = pytest.importorskip("openai")

from sparrow import Engine, SamplingParams, SpecConfig  # noqa: E402
from sparrow.services.client import SparrowClient  # noqa: E402
from sparrow.services.config import ServiceConfig  # noqa: E402
from sparrow.services.protos import pb  # noqa: E402
from sparrow.services.server import BackgroundServer  # noqa: E402
from sparrow.services.servicer import SparrowService  # noqa: E402
from sparrow.services.settings import AppSettings, build_engine  # noqa: E402

MiB = 1 << 20
MODEL = "sparrow-world"
QUESTION = "describe the video ."
FRAMES = 8


def world_pair():
    from sparrow.cli.serve import _target_spec, _draft_spec      # the pair `sparrow serve` serves by default
    import argparse

    args = argparse.Namespace(target=None, draft=None)
    try:
        return _target_spec(args), _draft_spec(args)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the committed world pair is not in this checkout: {exc}")


@functools.lru_cache(maxsize=4)
def world_video(seed: int) -> bytes:
    from sparrow.world.scenes import WorldVideo

    return WorldVideo(num_frames=FRAMES).make(seed).data


def make_service(target: str, draft: str, media_root, **limits) -> SparrowService:
    config = ServiceConfig(max_new_tokens=2000, max_video_bytes=2 * MiB, max_message_bytes=4 * MiB, max_frames=64,
                           media_root=str(media_root), **limits)
    spec = SpecConfig(**SPEC_KWARGS)
    settings = AppSettings(target=target, draft=draft, spec=spec, spec_given=frozenset(SPEC_KWARGS), service=config)
    engine, cache = build_engine(settings)
    return SparrowService(engine, cache, config)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("world-media")
    (root / "w12.mp4").write_bytes(world_video(12))
    return root


@pytest.fixture(scope="module")
def server(media):
    target, draft = world_pair()
    with BackgroundServer(make_service(target, draft, media), http_port=0, model_name=MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def reference(server):
    """Engine.generate with the models and spec the server runs, loaded apart."""
    from sparrow.services.models import load_draft, load_target

    target, draft = world_pair()
    model = load_target(target)
    engine = Engine(model, load_draft(draft, model), server.service.engine.spec)
    yield engine
    engine.close()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def video_message(url: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def data_url(video: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(video).decode()


def ask(client, video: bytes, stream: bool = False, **kw):
    """(token ids, text, usage) of an answer through the openai client."""
    body = dict(model=MODEL, messages=video_message(data_url(video)), max_tokens=kw.pop("max_tokens", 32),
                extra_body={"mm_processor_kwargs": {"num_frames": FRAMES}, **kw.pop("extra_body", {})}, **kw)
    if not stream:
        r = client.chat.completions.create(**body)
        choice = r.choices[0]
        return choice.token_ids, choice.message.content, r.usage, choice.finish_reason
    ids, text, usage, finish = [], [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            ids += choice.token_ids or []
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return ids, "".join(text), usage, finish


def grpc_answer(server, video: bytes, **sampling):
    with SparrowClient(server.address) as c:
        return c.generate(QUESTION, data=video, video_options=pb.VideoOptions(num_frames=FRAMES), **sampling)


def wait_freed(server, since: float, within: float = 1.0) -> None:
    async def held():
        return len(server.service.live), server.service.requests.active
    until = time.monotonic() + 30
    while server.call(held()) != (0, 0):
        assert time.monotonic() < until, f"the request was never freed: {server.call(held())}"
        time.sleep(0.01)
    freed = server.service.last_released - since
    assert freed < within, f"freed {freed:.2f} s after the client went, not within {within} s"


def raw(server, path: str, body: bytes | None = None, headers: dict | None = None, method: str | None = None):
    """(status, headers, parsed JSON body) of a plain HTTP request (urllib: no OpenAI client)."""
    base = server.http_url.removesuffix("/v1")
    request = urllib.request.Request(base + path, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, head, data = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        status, head, data = err.code, dict(err.headers), err.read()
    try:
        return status, head, json.loads(data)
    except ValueError:
        return status, head, data


# ----- 1. the answer is the gRPC API's and Engine.generate's ------------------------------------------
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_p": 0.9, "seed": 7}], ids=["T0", "T1-seeded"])
def test_streamed_and_not_equal_grpc_and_engine_generate(server, client, reference, sampling):
    video = world_video(12)
    from sparrow.world.scenes import WorldVideo

    want = reference.generate(video, QUESTION, SamplingParams(max_new_tokens=32, **sampling),
                              WorldVideo(num_frames=FRAMES).options())
    by_grpc = grpc_answer(server, video, max_new_tokens=32, **sampling)
    assert by_grpc.token_ids == want.token_ids
    for stream in (False, True):
        ids, text, usage, finish = ask(client, video, stream=stream, **sampling)
        assert ids == want.token_ids, f"stream={stream}"
        assert text == want.text and finish == want.finish_reason
        assert (usage.prompt_tokens, usage.completion_tokens, usage.visual_tokens) == (
            want.metrics.prompt_tokens, len(want.token_ids), want.metrics.visual_tokens)
        spec = usage.speculative
        assert spec["num_draft_tokens"] == 4 and spec["steps"] > 0 and spec["draft_tokens"] > 0
        assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["steps"])
    if not sampling:
        from sparrow.world.scenes import WorldVideo, caption
        events = WorldVideo(num_frames=FRAMES).make(12).events
        assert want.text.strip() == caption(events)          # a right answer about the world video, not noise


def test_every_source_and_the_spec_switch_give_the_same_tokens(server, client):
    video = world_video(12)
    want = grpc_answer(server, video, max_new_tokens=24).token_ids
    with SparrowClient(server.address) as c:
        video_id = c.upload(video)
    for url in ("file://w12.mp4", f"sparrow://videos/{video_id}", data_url(video)):
        r = client.chat.completions.create(model=MODEL, messages=video_message(url), max_completion_tokens=24,
                                           extra_body={"mm_processor_kwargs": {"num_frames": FRAMES}})
        assert r.choices[0].token_ids == want, url
    plain = client.chat.completions.create(model=MODEL, messages=video_message(data_url(video)), max_tokens=24,
                                           extra_body={"mm_processor_kwargs": {"num_frames": FRAMES},
                                                       "speculative": {"enabled": False}})
    assert plain.choices[0].token_ids == want and plain.usage.speculative["draft_tokens"] == 0


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, _, body = raw(server, "/health")
    assert status == 200 and body == {"status": "ok"}
    ask(client, world_video(12), max_tokens=4)
    status, head, text = raw(server, "/metrics")
    text = text.decode()
    assert status == 200 and head["content-type"].startswith("text/plain")
    assert 'route="/v1/chat/completions",status="200"' in text and "sparrow:http_requests_total" in text
    assert "sparrow:request_success_total" in text


# ----- 2. every refusal: its status, an OpenAI error object, the server still serving -----------------
def _chat(**fields) -> bytes:
    body = {"model": MODEL, "messages": video_message("file://w12.mp4"), "max_tokens": 4, **fields}
    return json.dumps(body).encode()


REFUSALS = {
    "bad json": (b'{"model": "x", "messages": [', {}, 400),
    "unknown content part": (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "audio_url", "audio_url": {"url": "x"}}]}]}).encode(), {}, 400),
    "absurd temperature": (_chat(temperature=7), {}, 400),
    "negative max_tokens": (_chat(max_tokens=-3), {}, 400),
    "n > 1": (_chat(n=2), {}, 400),
    "tools": (_chat(tools=[{"type": "function", "function": {"name": "f"}}]), {}, 400),
    "logprobs": (_chat(logprobs=True), {}, 400),
    "no video": (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode(), {}, 400),
    "bad deadline header": (_chat(), {"X-Request-Timeout": "soon"}, 400),
    "path outside the media root": (_chat(messages=video_message("file:///etc/passwd")), {}, 403),
    "url not allowed": (_chat(messages=video_message("https://example.com/v.mp4")), {}, 403),
    "unknown model": (_chat(model="gpt-4o"), {}, 404),
    "unknown video id": (_chat(messages=video_message("sparrow://videos/" + "0" * 64)), {}, 404),
    "missing file": (_chat(messages=video_message("file://nope.mp4")), {}, 404),
    "inline video over the limit": (_chat(messages=video_message(data_url(b"\0" * (2 * MiB + 9)))), {}, 413),
    "max_tokens over the limit": (_chat(max_tokens=5000), {}, 413),
    "past its deadline": (_chat(max_tokens=2000, ignore_eos=True), {"X-Request-Timeout": "0.05"}, 504),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusals_have_their_status_and_an_error_object(server, client, name):
    body, headers, want = REFUSALS[name]
    status, _, answer = raw(server, "/v1/chat/completions", body, headers)
    assert status == want, answer
    error = answer["error"]
    assert error["message"] and isinstance(error["type"], str) and "code" in error
    assert ask(client, world_video(12), max_tokens=3)[3] in ("length", "stop")          # still serving


def test_body_over_the_limit_is_413_unread(server, client):
    """Refused on its Content-Length, before a byte of it is sent (as a client waiting on
    `Expect: 100-continue` sends it)."""
    host, port = server.http_url.removeprefix("http://").removesuffix("/v1").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(64 * MiB))
        conn.endheaders()
        response = conn.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        conn.close()
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    assert ask(client, world_video(12), max_tokens=3)[3] == "length"


def test_the_openai_client_raises_its_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="one choice per request"):
        client.chat.completions.create(model=MODEL, messages=video_message("file://w12.mp4"), n=2)
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model=MODEL, messages=video_message("file:///etc/hostname"))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=video_message("file://w12.mp4"))


def test_deadline_mid_stream_ends_the_stream_with_an_error(server, client):
    stream = client.chat.completions.create(
        model=MODEL, messages=video_message("file://w12.mp4"), max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True}, extra_headers={"X-Request-Timeout": "1.5"})
    got = 0
    with pytest.raises(openai.APIError, match="deadline"):
        for chunk in stream:
            got += sum(len(c.token_ids or []) for c in chunk.choices)
    assert 0 < got < 2000
    wait_freed(server, since=time.monotonic() - 1, within=5)


# ----- 3. a client that goes away frees its slot within a second --------------------------------------
def test_disconnect_mid_stream_frees_the_slot_within_one_second(server, client):
    stream = client.chat.completions.create(model=MODEL, messages=video_message("file://w12.mp4"), max_tokens=2000,
                                            stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += sum(len(c.token_ids or []) for c in chunk.choices)
        if received >= 3:
            break
    gone = time.monotonic()
    stream.close()                     # the connection closes; the generation must stop
    wait_freed(server, since=gone)
    assert ask(client, world_video(12), max_tokens=3)[3] == "length"


def test_a_client_that_gives_up_on_a_non_streamed_answer_frees_its_slot(server):
    with openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=1.0) as impatient:
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model=MODEL, messages=video_message("file://w12.mp4"), max_tokens=2000,
                                              extra_body={"ignore_eos": True})
        gone = time.monotonic()
    wait_freed(server, since=gone)


# ----- 4. limits: a full replica is 429 with Retry-After; a stopping one 503 ---------------------------
@pytest.fixture
def small_server(tiny_model_dirs, clips):
    service = make_service(str(tiny_model_dirs[0]), str(tiny_model_dirs[1]), clips.root, max_concurrent=1)
    with BackgroundServer(service, http_port=0, model_name=MODEL) as running:
        yield running


def test_full_replica_is_429_and_a_stopping_one_503(small_server):
    with openai.OpenAI(base_url=small_server.http_url, api_key="unused", max_retries=0, timeout=60) as c:
        long = c.chat.completions.create(model=MODEL, messages=video_message("file://a.mp4"), max_tokens=2000,
                                         stream=True, extra_body={"ignore_eos": True})
        next(iter(long))                                          # running: the replica's one slot is taken
        status, head, answer = raw(small_server, "/v1/chat/completions", _chat(messages=video_message("file://b.mp4")))
        assert status == 429 and head["retry-after"] == "1" and answer["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            c.chat.completions.create(model=MODEL, messages=video_message("file://b.mp4"), max_tokens=2)
        long.close()
        wait_freed(small_server, since=time.monotonic())
        assert c.chat.completions.create(model=MODEL, messages=video_message("file://b.mp4"),
                                         max_tokens=2).choices[0].finish_reason == "length"

        async def stop_admitting():
            small_server.service.ready = False        # what service.close() does first when the server stops
        small_server.call(stop_admitting())
        status, head, answer = raw(small_server, "/health")
        assert status == 503 and head["retry-after"] == "1" and answer["error"]["code"] == "unavailable"
        with pytest.raises(openai.InternalServerError) as info:
            c.chat.completions.create(model=MODEL, messages=video_message("file://b.mp4"), max_tokens=2)
        assert info.value.status_code == 503


def test_grpc_off_and_http_off_are_options(tiny_model_dirs, clips):
    """serve_forever with port None serves HTTP only (`sparrow serve --no-grpc`)."""
    from sparrow.services.server import serve_forever

    service = make_service(str(tiny_model_dirs[0]), str(tiny_model_dirs[1]), clips.root)

    async def run():
        task = asyncio.create_task(serve_forever(service, "127.0.0.1", None, stop_on=(), http_port=0))
        await asyncio.sleep(1.0)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(asyncio.wait_for(run(), 30))
    assert service.ready is False                  # the stop closed the service


# ----- 5. live session events over SSE ------------------------------------------------------------------
def test_live_events_of_an_unknown_session_are_404(server):
    status, _, answer = raw(server, "/v1/live/nope/events")
    assert status == 404 and answer["error"]["type"] == "not_found_error"


def test_live_event_hub_publishes_incidents_and_standing_answers_until_the_session_ends():
    from sparrow.services.openai_api.live_events import LiveEventHub, SessionNotFound

    hub = LiveEventHub()
    messages = [pb.LiveResponse(opened=pb.LiveOpened(session_id="s1")),
                pb.LiveResponse(chunk=pb.LiveChunk(question_id="q1", text="no", standing=False)),    # asked: not published
                pb.LiveResponse(chunk=pb.LiveChunk(question_id="st1", text="a cat", standing=True)),
                pb.LiveResponse(incident=pb.AlertIncident(rule_id="r1", probability=0.9, session_id="s1")),
                pb.LiveResponse(done=pb.LiveDone(question_id="st1", standing=True))]

    async def run():
        gate = asyncio.Event()

        async def call():
            yield messages[0]
            await gate.wait()
            for m in messages[1:]:
                yield m
        passed, tee = [], hub.tee(call())
        passed.append(await anext(tee))
        events = hub.subscribe("s1")
        assert (await anext(events))["event"] == "subscribed"
        gate.set()
        passed += [m async for m in tee]
        got = [e async for e in events]
        with pytest.raises(SessionNotFound):
            await anext(hub.subscribe("s1"))
        return passed, got
    passed, got = asyncio.run(asyncio.wait_for(run(), 10))
    assert passed == messages                                        # the Live call's own stream is unchanged
    assert [e["event"] for e in got] == ["standing_chunk", "incident", "standing_done", "ended"]
    assert got[1]["data"]["ruleId"] == "r1" and got[0]["data"]["text"] == "a cat"


def test_a_live_sessions_standing_answers_stream_over_sse(small_server):
    """A dashboard subscribes by session id while a gRPC Live call streams frames: it gets the
    standing answers the Live call gets, then `ended` when the session closes."""
    import threading

    from sparrow.tiny import synthetic_frames

    frames, times = synthetic_frames(8, 84, 112, seed=6), [i / 2.0 for i in range(8)]
    opening = dict(fps=2.0, window_s=60.0, max_lag_s=100.0, min_pixels=28 * 28, max_pixels=84 * 112)
    events: list[tuple[str, dict]] = []
    with SparrowClient(small_server.address, max_message_bytes=4 * MiB) as c, \
            c.live(standing=[("red", "is there a red shape ?", 2.0)], standing_sampling=dict(max_new_tokens=4),
                   stats_every_s=0, **opening) as live:
        session_id = live.opened().session_id
        url = small_server.http_url.removesuffix("/v1") + f"/v1/live/{session_id}/events"
        response = urllib.request.urlopen(url, timeout=60)
        assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")

        def read():                                   # the SSE stream, parsed as a dashboard would
            name = None
            for line in response:
                line = line.decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line[len("event: "):]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[len("data: "):])))
                    if name == "ended":
                        return
        reader = threading.Thread(target=read)
        reader.start()
        for i in range(0, 8, 2):
            live.send_frames(frames[i:i + 2], times[i:i + 2])
        live.close()
        grpc_standing = [r.done for r in live if r.HasField("done") and r.done.standing]
        reader.join(60)
        response.close()
    assert not reader.is_alive()
    names = [name for name, _ in events]
    assert names[0] == "subscribed" and names[-1] == "ended"
    done = [data for name, data in events if name == "standing_done"]
    assert len(done) == len(grpc_standing) >= 2 and all(d["questionId"] == "red" for d in done)
    assert [d["endS"] for d in done] == [g.end_s for g in grpc_standing]
