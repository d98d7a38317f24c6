"""The OpenAI-compatible HTTP API under Ray Serve (`sparrow serve --ray`): Serve's HTTP proxy in
front of the TargetDeployment, which serves the API's routes over its own service (and calls the
draft deployment, as for gRPC); the official openai client.

What must hold, as on the embedded host: the answer equals Engine.generate's and the gRPC
API's (through Serve's gRPC proxy), streamed or not; refusals carry their status and an OpenAI
error object and the app keeps serving; a client that disconnects mid-stream frees the target
replica's slot within a second.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from conftest_services import SPEC_KWARGS, free_port

openai = pytest.importorskip("openai")

from sparrow import SamplingParams, SpecConfig  # noqa: E402
from sparrow.services.client import SparrowClient  # noqa: E402

MiB = 1 << 20
MODEL = "sparrow-tiny"
PROMPT = "What happens in the video?"


@pytest.fixture(scope="module")
def app(ray_instance, tiny_model_dirs, clips):
    from ray import serve

    from sparrow.services import ray_app
    from sparrow.services.config import ServiceConfig
    from sparrow.services.settings import AppSettings

    settings = AppSettings(
        target=str(tiny_model_dirs[0]), draft=str(tiny_model_dirs[1]), spec=SpecConfig(**SPEC_KWARGS),
        service=ServiceConfig(max_new_tokens=2000, max_video_bytes=2 * MiB, max_frames=64, media_root=str(clips.root)),
        target_deployment={"ray_actor_options": {"num_cpus": 0}}, served_model_name=MODEL)
    grpc_port, http_port = free_port(), free_port()
    serve.shutdown()          # Serve started by an earlier module keeps its proxies' ports: start afresh on ours
    ray_app.start(settings, grpc_port=grpc_port, http_port=http_port)
    yield {"grpc": f"127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}",
           "target": serve.get_deployment_handle("TargetDeployment", app_name="sparrow")}
    serve.delete("sparrow")
    serve.shutdown()


@pytest.fixture
def client(app):
    with openai.OpenAI(base_url=app["http"] + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def messages(path: str = "a.mp4") -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"file://{path}"}},
                                         {"type": "text", "text": PROMPT}]}]


def wait_freed(app, since: float, within: float = 1.0) -> None:
    until = time.monotonic() + 30
    while True:
        stats = app["target"].stats.remote().result(timeout_s=10)
        if stats["requests"] == 0 and stats["threads"] == 0:
            break
        assert time.monotonic() < until, f"the request was never freed: {stats}"
        time.sleep(0.05)
    freed = stats["last_released"] - since            # time.monotonic(), one clock on this host
    assert freed < within, f"freed {freed:.2f} s after the client went, not within {within} s"


def test_answers_equal_engine_generate_and_grpc(app, client, clips, reference_engine):
    want = reference_engine.generate(clips.data["a"], PROMPT, SamplingParams(max_new_tokens=24)).token_ids
    with SparrowClient(app["grpc"]) as c:
        assert c.generate(PROMPT, path="a.mp4", max_new_tokens=24, timeout=120).token_ids == want
    r = client.chat.completions.create(model=MODEL, messages=messages(), max_tokens=24)
    assert r.choices[0].token_ids == want and r.usage.speculative["num_draft_tokens"] == 4
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages(), max_tokens=24, stream=True):
        for choice in chunk.choices:
            streamed += choice.token_ids or []
    assert streamed == want
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(app["http"] + "/health", timeout=30) as health:
        assert health.status == 200


@pytest.mark.parametrize("fields,status", [
    ({"n": 2}, 400), ({"temperature": 9}, 400), ({"messages": messages("/etc/hostname")}, 403),
    ({"model": "gpt-4o"}, 404), ({"messages": messages("missing.mp4")}, 404), ({"max_tokens": 5000}, 413)],
    ids=["n", "temperature", "outside-media-root", "model", "missing-file", "max-tokens"])
def test_refusals_have_their_status_and_the_app_keeps_serving(app, client, fields, status):
    body = json.dumps({"model": MODEL, "messages": messages(), "max_tokens": 4, **fields}).encode()
    request = urllib.request.Request(app["http"] + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == status
    assert json.loads(info.value.read())["error"]["message"]
    assert client.chat.completions.create(model=MODEL, messages=messages(), max_tokens=2).choices[0].finish_reason


def test_deadline_is_504(app, client):
    start = time.monotonic()
    try:
        answer = client.chat.completions.create(model=MODEL, messages=messages("b.mp4"), max_tokens=2000,
                                                extra_body={"ignore_eos": True}, extra_headers={"X-Request-Timeout": "0.3"})
    except openai.APIStatusError as exc:
        assert exc.status_code == 504, exc.message
    else:                      # say what came back instead (seen once in CI under load, not reproduced)
        choice = answer.choices[0]
        pytest.fail(f"200 after {time.monotonic() - start:.2f} s: finish_reason {choice.finish_reason}, "
                    f"{len(choice.token_ids or [])} tokens, usage {answer.usage}")


def test_disconnect_mid_stream_frees_the_slot_within_one_second(app, client):
    stream = client.chat.completions.create(model=MODEL, messages=messages("c.mp4"), max_tokens=2000, stream=True,
                                            extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += sum(len(c.token_ids or []) for c in chunk.choices)
        if received >= 3:
            break
    gone = time.monotonic()
    stream.close()
    wait_freed(app, since=gone)
