"""One fault suite, both hosts: the embedded server (grpc.aio around the engine) and Ray Serve
(the same servicer behind Serve's gRPC proxy, on a real Ray), each with the same settings
(tiny models, 2 requests at once). Every case must end the same on both.

What must hold: each bad input gets its status code and the host keeps answering right; an
undecodable message is INVALID_ARGUMENT; a deadline, as a gRPC deadline or as
`sparrow-timeout-ms` metadata alone, ends the call DEADLINE_EXCEEDED on time and frees the
request; a cancel frees it within a second while a neighbour's answer stays the reference's;
a request past the host's limit is RESOURCE_EXHAUSTED while the two running finish right;
and no call leaves its slot held: 1 s after each of 50 calls' 20 ms deadlines, 20 bare gRPC
cancels and 10 client processes killed mid-stream, the host holds nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from conftest_services import SPEC_KWARGS, free_port

from sparrow import SamplingParams, SpecConfig
from sparrow.services.client import SparrowClient
from sparrow.services.protos import pb

pytestmark = pytest.mark.slow
MiB = 1 << 20
PROMPT = "What happens in the video?"
APP = "faults"


@dataclass
class Host:
    name: str
    address: str
    metadata: tuple
    busy: Callable[[], tuple[int, int]]      # (requests the servicer holds, generation threads)
    idle: Callable[[float], dict]            # SparrowService.wait_idle(until), asked where the service runs

    def client(self) -> SparrowClient:
        return SparrowClient(self.address, metadata=self.metadata)


def settings(tiny_model_dirs, clips, **deployment):
    from sparrow.services.config import ServiceConfig
    from sparrow.services.settings import AppSettings

    return AppSettings(target=str(tiny_model_dirs[0]), draft=str(tiny_model_dirs[1]), spec=SpecConfig(**SPEC_KWARGS),
                       service=ServiceConfig(max_new_tokens=2000, max_video_bytes=2 * MiB, max_frames=64,
                                             max_concurrent=2, media_root=str(clips.root)), **deployment)


@pytest.fixture(scope="module", params=["embedded", "ray"])
def host(request, tiny_model_dirs, clips):
    if request.param == "embedded":
        from sparrow.services.server import BackgroundServer
        from sparrow.services.servicer import SparrowService
        from sparrow.services.settings import build_engine

        app = settings(tiny_model_dirs, clips)
        service = SparrowService(*build_engine(app), app.service)
        with BackgroundServer(service) as server:
            yield Host("embedded", server.address, (), lambda: (len(service.live), service.requests.active),
                       lambda until: server.call(service.wait_idle(until), timeout=30))
        return
    request.getfixturevalue("ray_instance")          # the session's Ray, started only for this host
    from ray import serve

    from sparrow.services import ray_app

    serve.shutdown()                 # Serve's proxy port is fixed when Serve starts: start it on ours
    port = free_port()
    ray_app.start(settings(tiny_model_dirs, clips, target_deployment={"ray_actor_options": {"num_cpus": 0}}),
                  grpc_port=port, http_port=free_port(), name=APP)
    handle = serve.get_deployment_handle("TargetDeployment", app_name=APP)

    def busy() -> tuple[int, int]:
        stats = handle.stats.remote().result(timeout_s=30)
        return stats["requests"], stats["threads"]

    yield Host("ray", f"127.0.0.1:{port}", (("application", APP),), busy,
               lambda until: handle.wait_idle.remote(until).result(timeout_s=30))
    serve.shutdown()


@pytest.fixture(scope="module")
def client(host):
    with host.client() as c:
        yield c


def reference(engine, video: bytes, **sampling) -> list[int]:
    return engine.generate(video, PROMPT, SamplingParams(**sampling)).token_ids


def code_of(call) -> grpc.StatusCode:
    try:
        got = call()
    except grpc.RpcError as exc:
        return exc.code()
    # What came back instead of an error (a rare Ray-mode run ended a 20 ms deadline's call OK):
    # the last response says how the host ended it.
    last = got[-1] if isinstance(got, list) and got else got
    pytest.fail(f"the call ended without an error; {len(got) if isinstance(got, list) else 1} responses, "
                f"the last: {last!r:.300}")


def wait_freed(host: Host, within: float) -> float:
    """Seconds until the host holds no request (fails past `within`)."""
    start = time.monotonic()
    while host.busy() != (0, 0):
        assert time.monotonic() - start < within, f"{host.name}: request state not freed: {host.busy()}"
        time.sleep(0.02)
    return time.monotonic() - start


def long_stream(client: SparrowClient, clips, **kwargs):
    """A stream that would run 2000 tokens, after its first chunk."""
    call = client.stream(PROMPT, data=clips.data["a"], max_new_tokens=2000, ignore_eos=True, **kwargs)
    assert next(call).HasField("chunk")
    return call


@pytest.mark.parametrize("kwargs, code", [
    (dict(prompt=" "), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(data=b"not a video at all" * 20), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(path="/etc/passwd"), grpc.StatusCode.PERMISSION_DENIED),
    (dict(video_id="f" * 64), grpc.StatusCode.NOT_FOUND),
    (dict(max_new_tokens=10_000), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (dict(data=b"\x00" * (3 * MiB)), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (dict(path="no-such.mp4"), grpc.StatusCode.NOT_FOUND),
    (dict(temperature=float("inf")), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(video_options=pb.VideoOptions(min_pixels=2**32 - 1)), grpc.StatusCode.INVALID_ARGUMENT),
], ids=["prompt", "not a video", "path", "unknown id", "tokens", "bytes", "missing file", "temperature inf",
        "min_pixels"])
def test_bad_input_gets_its_code_and_the_host_keeps_answering(host, client, clips, reference_engine, kwargs, code):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", PROMPT)
    if not {"data", "path", "video_id"} & set(kwargs):
        kwargs["data"] = clips.data["b"]
    assert code_of(lambda: list(client.stream(prompt, **kwargs))) == code
    good = client.generate(PROMPT, data=clips.data["b"], max_new_tokens=8)
    assert good.token_ids == reference(reference_engine, clips.data["b"], max_new_tokens=8)


def test_undecodable_request_is_invalid_argument(host, client, clips):
    call = client.channel.unary_stream("/sparrow.v1.Sparrow/Generate", request_serializer=None)
    bad = pb.GenerateRequest(prompt="abc", video=pb.VideoSource(data=clips.data["b"])).SerializeToString()
    assert code_of(lambda: list(call(bad.replace(b"abc", b"\xff\xfe\xfd"), timeout=60,
                                     metadata=host.metadata))) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("how", ["grpc deadline", "sparrow-timeout-ms"])
def test_a_deadline_ends_the_call_on_time_and_frees_it(host, client, clips, how):
    request = pb.GenerateRequest(prompt=PROMPT, video=pb.VideoSource(data=clips.data["a"]),
                                 sampling=pb.SamplingParams(max_new_tokens=2000, ignore_eos=True))
    call = client.channel.unary_stream("/sparrow.v1.Sparrow/Generate", request_serializer=None)
    given = {"timeout": 1.5} if how == "grpc deadline" else {"metadata": host.metadata + (("sparrow-timeout-ms", "1500"),)}
    given.setdefault("metadata", host.metadata)
    start = time.monotonic()
    assert code_of(lambda: list(call(request.SerializeToString(), **given))) == grpc.StatusCode.DEADLINE_EXCEEDED
    ended = time.monotonic() - start
    assert ended < 1.5 + 1.0, f"{host.name}, {how}: ended {ended:.2f} s after the start (deadline 1.5 s)"
    wait_freed(host, within=1.5 + 1.0 - ended + 1.0)


def test_a_cancel_frees_the_request_and_the_neighbour_is_right(host, client, clips, reference_engine):
    expected = reference(reference_engine, clips.data["c"], max_new_tokens=48, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool, host.client() as neighbour:
        victim = long_stream(client, clips)
        answer = pool.submit(lambda: neighbour.generate(PROMPT, data=clips.data["c"], max_new_tokens=48,
                                                        ignore_eos=True, timeout=120).token_ids)
        time.sleep(0.3)
        victim.cancel()
        assert answer.result() == expected
    wait_freed(host, within=1.0)


def test_past_the_limit_is_resource_exhausted_and_the_running_finish_right(host, client, clips, reference_engine):
    expected = reference(reference_engine, clips.data["d"], max_new_tokens=300, ignore_eos=True)
    with host.client() as first, host.client() as second:
        running = [c.stream(PROMPT, data=clips.data["d"], max_new_tokens=300, ignore_eos=True) for c in (first, second)]
        tokens = [list(next(call).chunk.token_ids) for call in running]       # both admitted and generating
        assert code_of(lambda: list(client.stream(PROMPT, data=clips.data["b"], max_new_tokens=8))) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        for got, call in zip(tokens, running):
            for response in call:
                got += response.chunk.token_ids if response.HasField("chunk") else []
            assert got == expected
    wait_freed(host, within=5.0)


# ----- no slot outlives its call ------------------------------------------------------------------------
# However a call ends (its deadline, a bare gRPC cancel with no Abort, its client process killed),
# the host holds nothing for it 1 s later: no request, no generation, no live session. Each
# call runs alone and is checked on its own, so a leak is pinned to the call that left it.
# `host.idle` waits where the service runs, returning as soon as it holds nothing.
LEAK_CHECK_S = 1.0
KILLED_CLIENT = """
import sys, grpc
address, request, *metadata = sys.argv[1:]
call = grpc.insecure_channel(address).unary_stream("/sparrow.v1.Sparrow/Generate")(
    bytes.fromhex(request), metadata=tuple(tuple(kv.split("=", 1)) for kv in metadata))
for i, _ in enumerate(call):
    if i == 0:
        print("streaming", flush=True)
"""


def assert_freed(host: Host, since: float, what: str) -> None:
    held = host.idle(since + LEAK_CHECK_S)
    assert held["idle"], f"{host.name}: {LEAK_CHECK_S} s after {what}, the host still holds {held}"


def long_request(clips, request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, prompt=PROMPT, video=pb.VideoSource(path="a.mp4"),
                              sampling=pb.SamplingParams(max_new_tokens=2000, ignore_eos=True))


def test_fifty_20ms_deadlines_leave_nothing_held(host, client, clips):
    call = client.channel.unary_stream("/sparrow.v1.Sparrow/Generate", request_serializer=None)
    codes = []
    for i in range(50):
        request = long_request(clips, f"deadline-{i}").SerializeToString()
        # a gRPC deadline, or the metadata one (with a far gRPC deadline only so that a bug cannot hang the test)
        given = ({"timeout": 0.02, "metadata": host.metadata} if i % 2 else
                 {"timeout": 30, "metadata": host.metadata + (("sparrow-timeout-ms", "20"),)})
        start = time.monotonic()
        codes.append(code_of(lambda: list(call(request, **given))))
        assert_freed(host, start + 0.02, f"call {i}'s 20 ms deadline")
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}, codes


def test_twenty_bare_cancels_leave_nothing_held(host, client, clips):
    """The gRPC cancel alone (SparrowClient.cancel would also send Abort), at a random point
    of the stream: it may reach the host while it is writing a response."""
    import random

    rng = random.Random(20)
    call = client.channel.unary_stream("/sparrow.v1.Sparrow/Generate", request_serializer=None,
                                       response_deserializer=pb.GenerateResponse.FromString)
    for i in range(20):
        stream = call(long_request(clips, f"cancel-{i}").SerializeToString(), metadata=host.metadata)
        for _ in range(1 + rng.randrange(4)):
            assert next(stream).HasField("chunk")
        time.sleep(rng.uniform(0, 0.03))
        stream.cancel()
        cancelled = time.monotonic()
        assert_freed(host, cancelled, f"cancel {i}")


def test_ten_killed_clients_leave_nothing_held(host, clips):
    """A client process killed (SIGKILL) mid-stream: its connection drops with no cancel sent."""
    import random
    import subprocess
    import sys
    import threading

    rng = random.Random(10)
    metadata = [f"{k}={v}" for k, v in host.metadata]
    for i in range(10):
        request = long_request(clips, f"killed-{i}").SerializeToString().hex()
        with subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, host.address, request, *metadata],
                              stdout=subprocess.PIPE, text=True) as process:
            watchdog = threading.Timer(30, process.kill)      # a client that never streams fails, not hangs
            watchdog.start()
            try:
                assert process.stdout.readline().strip() == "streaming", f"client {i} never streamed"
                time.sleep(rng.uniform(0, 0.03))
            finally:
                watchdog.cancel()
                process.kill()
                process.wait(timeout=30)
        killed = time.monotonic()
        assert_freed(host, killed, f"client {i} was killed")
