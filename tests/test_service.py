"""The embedded host (`sparrow serve`): real gRPC over loopback against the in-process engine.

What must hold: the streamed answer equals engine.generate token for token; concurrent
streams do not disturb each other; cancel, deadline and Abort stop the generation and free
its state within a second; a second question on the same video reuses its prefill; bad
input gets the right status code and the server keeps serving; Redis going away costs
nothing but the cache.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest_services import SPEC_KWARGS

from sparrow import SamplingParams, SpecConfig, errors
from sparrow.services.client import SparrowClient
from sparrow.services.grpc_status import VideoNotFound, status_for
from sparrow.services.protos import SERVICE_NAME, pb, pb_grpc
from sparrow.services.server import BackgroundServer
from sparrow.services.config import ServiceConfig
from sparrow.services.servicer import SparrowService
from sparrow.services.settings import AppSettings, build_engine

MiB = 1 << 20
PROMPTS = ("What happens in the video?", "Which shape moves first, and where does it go?")


def make_service(model_dirs, clips, cache: str = "memory", **limits) -> SparrowService:
    config = ServiceConfig(max_new_tokens=2000, max_video_bytes=2 * MiB, max_message_bytes=4 * MiB,
                           max_frames=64, media_root=str(clips.root), **limits)
    settings = AppSettings(target=str(model_dirs[0]), draft=str(model_dirs[1]), spec=SpecConfig(**SPEC_KWARGS),
                           cache=cache, service=config)
    engine, state_cache = build_engine(settings)
    return SparrowService(engine, state_cache, config)


@pytest.fixture(scope="module")
def server(tiny_model_dirs, clips):
    with BackgroundServer(make_service(tiny_model_dirs, clips)) as running:
        yield running


@pytest.fixture
def client(server):
    with SparrowClient(server.address, max_message_bytes=16 * MiB) as c:
        yield c


def reference(engine, video: bytes, prompt: str, **sampling):
    return engine.generate(video, prompt, SamplingParams(**sampling))


def live_state(server) -> tuple[int, int]:
    """(requests the service tracks, generation threads still running), read on its loop."""
    async def read():
        return len(server.service.live), server.service.requests.active
    return server.call(read())


def wait_freed(server, since: float | None = None, within: float = 1.0) -> None:
    """The service holds no request; with `since`, it let go of the last one within `within`
    seconds of that moment (as the service timed it, so polling latency does not count)."""
    deadline = time.monotonic() + 30
    while live_state(server) != (0, 0):
        assert time.monotonic() < deadline, f"state never freed: {live_state(server)}"
        time.sleep(0.01)
    if since is not None:
        freed = server.service.last_released - since
        assert freed < within, f"state freed {freed:.2f} s after, not within {within} s"


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


# ----- 1. the answer equals engine.generate -----------------------------------------------------------
@pytest.mark.parametrize("how", ["upload", "path", "data"])
def test_answer_equals_engine_generate(client, clips, reference_engine, how):
    video = clips.data["a"]
    source = {"upload": lambda: {"video_id": client.upload(video)},
              "path": lambda: {"path": "a.mp4"},          # relative to the media root
              "data": lambda: {"data": video}}[how]()
    for prompt in PROMPTS:
        expected = reference(reference_engine, video, prompt, max_new_tokens=24)
        got = client.generate(prompt, max_new_tokens=24, **source)
        assert got.token_ids == expected.token_ids
        assert got.text == expected.text and got.finish_reason == expected.finish_reason
        usage, m = got.completion.usage, got.completion.metrics
        assert (usage.prompt_tokens, usage.visual_tokens, usage.completion_tokens) == (
            expected.metrics.prompt_tokens, expected.metrics.visual_tokens, len(expected.token_ids))
        assert m.num_draft_tokens == 4 and m.steps > 0 and m.draft_tokens > 0
        assert m.mean_acceptance_length == pytest.approx(1 + m.accepted_per_step)


def test_spec_off_and_seeded_sampling_equal_engine_generate(client, clips, reference_engine):
    video, prompt = clips.data["b"], PROMPTS[1]
    greedy = reference(reference_engine, video, prompt, max_new_tokens=20).token_ids
    plain = client.generate(prompt, data=video, max_new_tokens=20, spec=pb.SpecOptions(enabled=False))
    assert plain.token_ids == greedy and plain.completion.metrics.draft_tokens == 0
    k2 = client.generate(prompt, data=video, max_new_tokens=20, spec=pb.SpecOptions(num_draft_tokens=2))
    assert k2.token_ids == greedy and k2.completion.metrics.num_draft_tokens == 2
    sampled = reference(reference_engine, video, prompt, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    got = client.generate(prompt, data=video, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    assert got.token_ids == sampled.token_ids


# ----- 2. concurrency, cancel, deadline, Abort, the prefix cache ----------------------------------------
def test_eight_concurrent_streams_all_correct(server, clips, reference_engine):
    jobs = [(name, PROMPTS[i % 2]) for i, name in enumerate("abcdabcd")]
    expected = [reference(reference_engine, clips.data[n], p, max_new_tokens=16).token_ids for n, p in jobs]
    barrier = threading.Barrier(len(jobs))

    def ask(job):
        name, prompt = job
        with SparrowClient(server.address) as c:
            barrier.wait(timeout=30)
            return c.generate(prompt, data=clips.data[name], max_new_tokens=16, timeout=120).token_ids

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(ask, jobs))
    assert got == expected
    wait_freed(server)


def test_second_question_on_same_video_skips_prefill(client, clips, reference_engine):
    video_id = client.upload(clips.data["e"])            # a video no other test asks about first
    first = client.generate(PROMPTS[0], video_id=video_id, max_new_tokens=12)
    second = client.generate(PROMPTS[1], video_id=video_id, max_new_tokens=12)
    assert first.completion.usage.cached_prompt_tokens == 0
    cached = second.completion.usage.cached_prompt_tokens
    # Everything up to the last video token came from the cache: only the question was prefilled.
    assert second.completion.usage.visual_tokens < cached < second.completion.usage.prompt_tokens
    assert second.token_ids == reference(reference_engine, clips.data["e"], PROMPTS[1], max_new_tokens=12).token_ids
    assert first.token_ids == reference(reference_engine, clips.data["e"], PROMPTS[0], max_new_tokens=12).token_ids


def long_stream(client, video: bytes, **kwargs):
    return client.stream(PROMPTS[0], data=video, max_new_tokens=2000, ignore_eos=True, **kwargs)


def test_client_cancel_stops_generation_and_frees_state(server, client, clips):
    call = long_stream(client, clips.data["a"])
    first = next(call)
    assert first.HasField("chunk") and live_state(server)[1] == 1
    cancelled = time.monotonic()
    call.call.cancel()                      # the bare gRPC cancel (GenerateStream.cancel also sends Abort)
    wait_freed(server, since=cancelled)
    assert code_of(lambda: next(call)) == grpc.StatusCode.CANCELLED


def test_deadline_stops_generation_and_frees_state(server, client, clips):
    started = time.monotonic()
    call = long_stream(client, clips.data["a"], timeout=1.5)
    assert next(call).HasField("chunk")
    assert code_of(lambda: [r for r in call]) == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_freed(server, since=started + 1.5)


def test_abort_by_id(server, client, clips):
    call = long_stream(client, clips.data["a"], request_id="abort-me")
    assert next(call).request_id == "abort-me"
    assert code_of(lambda: next(long_stream(client, clips.data["a"], request_id="abort-me"))) == \
        grpc.StatusCode.INVALID_ARGUMENT                           # the id is taken while it runs
    aborted = time.monotonic()
    assert client.abort("abort-me")
    rest = list(call)
    done = rest[-1].completion
    assert done.finish_reason == pb.FINISH_REASON_ABORT and done.usage.completion_tokens < 2000
    wait_freed(server, since=aborted)
    assert not client.abort("abort-me") and not client.abort("never-existed")


# ----- 4. bad input: the right code, and the server keeps serving -----------------------------------------
BAD_REQUESTS = {
    "empty prompt": (dict(prompt="  ", video="a"), grpc.StatusCode.INVALID_ARGUMENT),
    "no video": (dict(video=None), grpc.StatusCode.INVALID_ARGUMENT),
    "not a video": (dict(data=b"\x00\x01 definitely not a container" * 10), grpc.StatusCode.INVALID_ARGUMENT),
    "path outside root": (dict(path="/etc/passwd"), grpc.StatusCode.PERMISSION_DENIED),
    "dotdot": (dict(path="../../etc/passwd"), grpc.StatusCode.PERMISSION_DENIED),
    "symlink out": (dict(path="escape.mp4"), grpc.StatusCode.PERMISSION_DENIED),
    "url": (dict(url="http://127.0.0.1:9/v.mp4"), grpc.StatusCode.PERMISSION_DENIED),
    "unknown video_id": (dict(video_id="0" * 64), grpc.StatusCode.NOT_FOUND),
    "malformed video_id": (dict(video_id="../../x"), grpc.StatusCode.INVALID_ARGUMENT),
    "too many tokens": (dict(max_new_tokens=100_000), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "temperature": (dict(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
    "top_p": (dict(top_p=2.0), grpc.StatusCode.INVALID_ARGUMENT),
    "draft tokens": (dict(spec=pb.SpecOptions(num_draft_tokens=99)), grpc.StatusCode.INVALID_ARGUMENT),
    "frames over limit": (dict(video_options=pb.VideoOptions(num_frames=1000)), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "fps": (dict(video_options=pb.VideoOptions(fps=-2.0)), grpc.StatusCode.INVALID_ARGUMENT),
    "video over limit": (dict(data=b"\x00" * (3 * MiB)), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "message over limit": (dict(data=b"\x00" * (5 * MiB)), grpc.StatusCode.RESOURCE_EXHAUSTED),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_its_code_and_server_keeps_serving(client, clips, reference_engine, case):
    (clips.root / "escape.mp4").unlink(missing_ok=True)
    (clips.root / "escape.mp4").symlink_to("/etc/passwd")
    kwargs, code = BAD_REQUESTS[case]
    kwargs = dict(kwargs)
    prompt, video = kwargs.pop("prompt", PROMPTS[0]), kwargs.pop("video", "a")
    if not {"data", "path", "url", "video_id"} & set(kwargs):
        kwargs = {**({"data": clips.data[video]} if video else {}), **kwargs}
    if video is None:        # no source at all: build the request by hand
        stub = pb_grpc.SparrowStub(client.channel)
        call = lambda: list(stub.Generate(pb.GenerateRequest(prompt=prompt)))      # noqa: E731
    else:
        call = lambda: list(client.stream(prompt, **kwargs))                       # noqa: E731
    assert code_of(call) == code
    good = client.generate(PROMPTS[0], data=clips.data["a"], max_new_tokens=8)
    assert good.token_ids == reference(reference_engine, clips.data["a"], PROMPTS[0], max_new_tokens=8).token_ids


def test_upload_is_content_addressed_and_checked(client, clips):
    stub = pb_grpc.SparrowStub(client.channel)
    video = clips.data["c"]
    first = client.upload(video, chunk_bytes=4096)               # several chunks
    again = stub.UploadVideo(iter([pb.VideoChunk(data=video)]))
    assert again.video_id == first and again.already_stored and again.size_bytes == len(video)
    # a hash alone names no video, stored or not: a client gets an id only for bytes it sent
    assert code_of(lambda: stub.UploadVideo(iter([pb.VideoChunk(sha256=first)]))) == grpc.StatusCode.INVALID_ARGUMENT
    assert client.upload(video, chunk_bytes=4096) == first       # the bytes, hash first: still uploads
    assert code_of(lambda: stub.UploadVideo(iter([]))) == grpc.StatusCode.INVALID_ARGUMENT
    wrong = pb.VideoChunk(data=b"abc", sha256="1" * 64)
    assert code_of(lambda: stub.UploadVideo(iter([wrong]))) == grpc.StatusCode.INVALID_ARGUMENT
    big = (pb.VideoChunk(data=b"\x00" * MiB) for _ in range(3))
    assert code_of(lambda: stub.UploadVideo(big)) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_health_reflection_and_model_info(client):
    assert client.health() == "SERVING" and client.health(SERVICE_NAME) == "SERVING"
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    services = set(ProtoReflectionDescriptorDatabase(client.channel).get_services())
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
    info = client.model_info()
    assert (info.target_model_type, info.spec_method, info.num_draft_tokens) == ("qwen2_5_vl", "sparrow", 4)
    assert (info.draft_placement, info.host, info.max_new_tokens) == ("colocated", "embedded", 2000)


def test_cli_generate_prints_the_answer(server, clips, reference_engine, capsys):
    from sparrow.cli.main import main

    assert main(["generate", "--server", server.address, str(clips.path("b")), PROMPTS[0],
                 "--max-new-tokens", "10"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == reference(reference_engine, clips.data["b"], PROMPTS[0], max_new_tokens=10).text
    assert "[length] 10 tokens" in err
    assert main(["generate", "--server", server.address, "/etc/passwd", "q", "--server-path"]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err


# ----- 5. Redis going away ---------------------------------------------------------------------------
def test_redis_stopped_mid_run_requests_still_complete(tiny_model_dirs, clips, reference_engine, own_redis):
    service = make_service(tiny_model_dirs, clips, cache=own_redis.url)
    with BackgroundServer(service) as running, SparrowClient(running.address) as c:
        video_id = c.upload(clips.data["d"])
        assert own_redis.client().exists(f"sparrow:video:{video_id}:m")      # it reached Redis
        own_redis.stop()
        expected = reference(reference_engine, clips.data["d"], PROMPTS[0], max_new_tokens=12).token_ids
        assert c.generate(PROMPTS[0], video_id=video_id, max_new_tokens=12).token_ids == expected
        assert c.generate(PROMPTS[0], data=clips.data["d"], max_new_tokens=12).token_ids == expected
        other = c.upload(clips.data["b"])                                     # uploads keep working
        assert c.generate(PROMPTS[1], video_id=other, max_new_tokens=8).finish_reason in ("length", "stop")


def test_not_ready_is_unavailable(server, client, clips):
    server.service.ready = False          # draining (as on shutdown)
    try:
        assert code_of(lambda: list(client.stream(PROMPTS[0], data=clips.data["a"]))) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.service.ready = True
    assert client.generate(PROMPTS[0], data=clips.data["a"], max_new_tokens=4).finish_reason == "length"


def test_abort_sent_to_another_replica_reaches_the_stream(tiny_model_dirs, clips, own_redis):
    """Two replicas share Redis: Abort lands on the one not running the request, and still stops it."""
    with BackgroundServer(make_service(tiny_model_dirs, clips, cache=own_redis.url)) as a, \
            BackgroundServer(make_service(tiny_model_dirs, clips, cache=own_redis.url)) as b, \
            SparrowClient(a.address) as on_a, SparrowClient(b.address) as on_b:
        call = long_stream(on_a, clips.data["a"], request_id="elsewhere")
        assert next(call).HasField("chunk")
        assert not on_b.abort("elsewhere")                  # not running on b: b leaves the mark in Redis
        done = list(call)[-1].completion
        assert done.finish_reason == pb.FINISH_REASON_ABORT
        wait_freed(a)
        again = on_a.generate(PROMPTS[0], data=clips.data["a"], max_new_tokens=80, ignore_eos=True,
                              request_id="elsewhere")
        assert again.finish_reason == "length"               # the old mark does not abort a new use of the id


@pytest.mark.parametrize("exc, code", [
    (errors.VideoTooLarge("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),       # a bad video *and* a budget
    (errors.ContextOverflow("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.SourceNotAllowed("x"), grpc.StatusCode.PERMISSION_DENIED),
    (errors.VideoTimeout("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.SourceUnavailable("x"), grpc.StatusCode.UNAVAILABLE),
    (errors.VideoUnreadable("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (VideoNotFound("x"), grpc.StatusCode.NOT_FOUND),
    (RuntimeError("x"), grpc.StatusCode.INTERNAL),
])
def test_every_error_class_has_its_code(exc, code):
    assert status_for(exc)[0] == code
