"""The Live RPC over real gRPC (loopback, the embedded host): a tiny Qwen2.5-VL target with
real-time positions, saved and loaded like a served model.

What must hold: an answer over the wire equals the library's LiveSession answer on the same
stream, token for token; a corrupt chunk is an INVALID_ARGUMENT event and loses nothing;
standing questions arrive on stream time with their ids and ranges; a client that goes away
closes its session at once (KV freed, count and gauges back to 0); over a limit:
RESOURCE_EXHAUSTED; bad options: INVALID_ARGUMENT; a target that cannot go live:
FAILED_PRECONDITION; `sparrow live` plays a file and prints the answers; the server reads an
allowed URL itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import json
import socket
import threading
import time

import grpc
import numpy as np
import pytest
from conftest_services import SPEC_KWARGS

from sparrow import SpecConfig
from sparrow.live.session import LiveSession
from sparrow.cli import main as cli
from sparrow.services import prom
from sparrow.services.client import SparrowClient
from sparrow.services.live.messages import live_config
from sparrow.services.protos import pb, pb_grpc
from sparrow.services.server import BackgroundServer
from sparrow.services.config import ServiceConfig
from sparrow.services.servicer import SparrowService
from sparrow.services.settings import AppSettings, build_engine
from sparrow.tiny import synthetic_frames, tiny_target
from sparrow.video import write_synthetic_video
from sparrow.video.encode import encode_ts

MiB = 1 << 20
PIXELS = dict(min_pixels=28 * 28, max_pixels=84 * 112)       # 84x112 frames: 3x4 = 12 visual tokens a pair
OPEN = dict(fps=2.0, window_s=60.0, max_lag_s=100.0, **PIXELS)
GREEDY = dict(max_new_tokens=10, temperature=0.0)
QUESTION = "what happens in the video ?"


def make_server(target_dir, draft_dir, **limits) -> BackgroundServer:
    config = ServiceConfig(max_new_tokens=2000, max_message_bytes=4 * MiB, **limits)
    settings = AppSettings(target=str(target_dir), draft=None if draft_dir is None else str(draft_dir),
                           spec=SpecConfig(**SPEC_KWARGS), service=config)
    engine, cache = build_engine(settings)
    return BackgroundServer(SparrowService(engine, cache, config))


@pytest.fixture(scope="module")
def recorder():
    return prom.configure(prom.PrometheusSink(), model_name="tiny")


@pytest.fixture(scope="module")
def server(tiny_model_dirs, recorder):
    limits = dict(allowed_url_schemes=("http",), allowed_url_hosts=("127.0.0.1",))
    with make_server(*tiny_model_dirs, **limits) as running:
        yield running


@pytest.fixture
def client(server):
    with SparrowClient(server.address, max_message_bytes=4 * MiB) as c:
        yield c


def ts_bytes(frames: np.ndarray, fps: int = 4, codec: str = "mpeg4") -> bytes:
    return encode_ts(frames, fps, codec)


class Reader:
    """The responses of a LiveStream, read in the test's thread."""

    def __init__(self, live):
        self.live, self.seen = live, []
        self._it = iter(live)

    def until(self, done) -> list:
        out = []
        for response in self._it:
            out.append(response)
            self.seen.append(response)       # kept if the stream then ends with an error
            if done(response):
                break
        return out

    def rest(self) -> list:
        return self.until(lambda r: False)


def prefilled(n: int):
    return lambda r: r.HasField("stats") and r.stats.pairs_prefilled >= n


def answers(responses, question_id: str) -> list[tuple[tuple[float, float], list[int], pb.LiveDone]]:
    """Per answer to question_id, in order of completion: ((start_s, end_s), token ids, its LiveDone)."""
    tokens: dict[tuple[float, float], list[int]] = {}
    out = []
    for r in responses:
        if r.HasField("chunk") and r.chunk.question_id == question_id:
            tokens.setdefault((r.chunk.start_s, r.chunk.end_s), []).extend(r.chunk.token_ids)
        elif r.HasField("done") and r.done.question_id == question_id:
            span = (r.done.start_s, r.done.end_s)
            out.append((span, tokens.pop(span, []), r.done))
    return out


def events(responses) -> list[pb.LiveEvent]:
    return [r.event for r in responses if r.HasField("event")]


def library_answer(engine, session: LiveSession, question: str = QUESTION) -> tuple[tuple[float, float], list[int]]:
    answer = session.ask(question, pb_sampling(GREEDY))
    for _ in answer.generation:
        pass
    return (answer.start_s, answer.end_s), answer.generation.output.token_ids


def pb_sampling(sampling: dict):
    from sparrow.config import SamplingParams
    return SamplingParams(**sampling)


def wait_released(server, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while server.call(_count(server)):
        assert time.monotonic() < deadline, "a live session was never released"
        time.sleep(0.01)


def _count(server):
    async def read():
        return len(server.service.live_sessions)
    return read()


def gauge(recorder, name: str, **labels) -> float:
    value = recorder.sink.registry.get_sample_value(f"sparrow:{name}", {"model_name": "tiny", **labels})
    return 0.0 if value is None else value


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


# ----- answers -----------------------------------------------------------------------------------------
def test_answer_equals_the_library_session_and_a_corrupt_chunk_loses_nothing(server, client, reference_engine):
    data = ts_bytes(synthetic_frames(16, 84, 112, seed=8))            # 4 s at 4 fps, sampled at 2 fps
    chunks = [data[i:i + 1000] for i in range(0, len(data), 1000)]
    garbage = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    with client.live(stats_every_s=0.1, **OPEN) as live:
        assert live.opened().window_pairs == 60 and live.opened().spec_method == "sparrow"
        half = len(chunks) // 2
        for chunk in chunks[:half] + [garbage] + chunks[half:]:
            live.send_chunk(chunk)
        live.end()
        reader = Reader(live)
        bad = events(reader.until(prefilled(4)))
        assert [(e.code, e.kind) for e in bad] == [(grpc.StatusCode.INVALID_ARGUMENT.value[0], pb.LIVE_EVENT_KIND_ERROR)]
        assert "not MPEG-TS" in bad[0].message
        live.ask(QUESTION, question_id="q1", **GREEDY)
        reader.until(lambda r: r.HasField("done"))
        # Not a container at all, as a new media: an error event, and the window stays.
        live.send_chunk(b"this is not a video" * 20000)
        live.end()
        reader.until(lambda r: r.HasField("event"))
        live.ask(QUESTION, question_id="q2", **GREEDY)
        live.close()
        reader.rest()
    (span, tokens, done), = answers(reader.seen, "q1")
    assert done.completion.finish_reason == pb.FINISH_REASON_LENGTH and not done.standing
    later = events(reader.seen)[-1]
    assert later.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "could not be decoded" in later.message
    assert [(s, t) for s, t, _ in answers(reader.seen, "q2")] == [(span, tokens)]
    final = reader.seen[-1].stats
    assert final.final and final.pairs_prefilled == 4 and final.frames_received == 16 and final.tokens_per_pair == 12
    assert final.bytes_received == len(data) + len(garbage) + 19 * 20000
    # The library, fed the clean stream, answers the same.
    session = LiveSession(reference_engine, live_config(pb.LiveOpen(**OPEN), server.service.config))
    for chunk in chunks:
        session.feed(chunk)
    session.end_of_stream()
    session.wait_ingested()
    assert library_answer(reference_engine, session) == (span, tokens) and span == (0.0, 4.0)
    session.close()
    wait_released(server)


def test_standing_questions_arrive_on_stream_time_with_ids_and_ranges(server, client, reference_engine):
    frames, times = synthetic_frames(12, 84, 112, seed=6), np.arange(12) / 2.0
    red = "is there a red shape ?"
    with client.live(standing=[("red", red, 2.0)], standing_sampling=GREEDY, stats_every_s=0, **OPEN) as live:
        assert list(live.opened().standing_ids) == ["red"]
        for i in range(0, 12, 2):
            live.send_frames(frames[i:i + 2], times[i:i + 2])
        live.remove_standing("nope")
        live.close()
        responses = Reader(live).rest()
    got = answers(responses, "red")
    assert [span for span, _, _ in got] == [(0.0, 2.0), (0.0, 4.0), (0.0, 6.0)]     # every 2 s of stream
    assert all(done.standing for _, _, done in got)
    # Camera time: the source time and arrival wall time of each answer's newest frame.
    assert [done.source_pts_s for _, _, done in got] == [1.5, 3.5, 5.5]
    assert all(abs(done.wall_time_s - time.time()) < 60 for _, _, done in got)
    assert all(r.chunk.standing and r.chunk.question_id == "red" for r in responses if r.HasField("chunk"))
    (refused,) = events(responses)
    assert refused.question_id == "nope" and refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert responses[-1].stats.final and sum(r.HasField("stats") for r in responses) == 1    # stats_every_s=0
    # The library's standing answers on the same frames.
    done = []
    session = LiveSession(reference_engine, live_config(pb.LiveOpen(**OPEN), server.service.config),
                          on_event=lambda e: e.kind == "done" and done.append(e))
    session.add_standing(red, 2.0, pb_sampling(GREEDY), question_id="red")
    for i in range(0, 12, 2):
        session.push_frames(frames[i:i + 2], times[i:i + 2])
        session.wait_ingested()
    for _ in range(400):
        if len(done) == 3:
            break
        time.sleep(0.01)
    assert [((e.start_s, e.end_s), e.output.token_ids) for e in done] == [(s, t) for s, t, _ in got]
    session.close()
    wait_released(server)


def test_camera_time_and_a_silent_source_on_the_wire(server, client):
    """Frames stamped from 100 s: answers and stats carry that source time besides stream
    seconds; silence past stale_after_s is a STALE event and marks answers stale; frames
    again: RESUMED."""
    frames = synthetic_frames(8, 84, 112, seed=2)
    stamps = 100.0 + np.arange(8) / 2.0
    with client.live(stats_every_s=0.1, stale_after_s=0.5, **OPEN) as live:
        assert live.opened().stale_after_s == 0.5
        reader = Reader(live)
        live.send_frames(frames[:4], stamps[:4])
        reader.until(lambda r: r.HasField("event") and r.event.kind == pb.LIVE_EVENT_KIND_STALE)
        live.ask(QUESTION, question_id="late", **GREEDY)
        reader.until(lambda r: r.HasField("done"))
        live.send_frames(frames[4:], stamps[4:])
        reader.until(lambda r: r.HasField("event") and r.event.kind == pb.LIVE_EVENT_KIND_RESUMED)
        live.close()
        reader.rest()
    stale = next(e for e in events(reader.seen) if e.kind == pb.LIVE_EVENT_KIND_STALE)
    assert (stale.stream_s, stale.source_pts_s) == (1.5, 101.5) and "no frame for" in stale.message
    (span, tokens, done), = answers(reader.seen, "late")
    assert span == (0.0, 2.0) and done.stale and done.source_pts_s == 101.5 and len(tokens) == 10
    assert all(r.chunk.stale for r in reader.seen if r.HasField("chunk"))
    final = reader.seen[-1].stats
    assert final.final and (final.newest_s, final.newest_source_pts_s, final.stale) == (3.5, 103.5, False)
    wait_released(server)


def test_a_codec_switch_and_restarting_timestamps_are_events_on_the_wire(server, client):
    """A client's MPEG-TS that switches codec (its timestamps restarting with it): one
    FORMAT_CHANGED event and stream time goes on; raw frames whose times go back: one
    TIMESTAMP_RESET event; no frame lost, no error."""
    media = ts_bytes(synthetic_frames(8, 84, 112, seed=1)) + ts_bytes(synthetic_frames(8, 84, 112, seed=2),
                                                                      codec="mpeg2video")
    frames = synthetic_frames(4, 84, 112, seed=3)
    with client.live(stats_every_s=0, **OPEN) as live:
        for i in range(0, len(media), 4096):
            live.send_chunk(media[i:i + 4096])
        live.end()
        live.close()
        first = Reader(live).rest()
    with client.live(stats_every_s=0, **OPEN) as live:
        live.send_frames(frames[:2], [5.0, 5.5])
        live.send_frames(frames[2:], [0.0, 0.5])
        live.close()
        second = Reader(live).rest()
    (switch,) = events(first)
    assert switch.kind == pb.LIVE_EVENT_KIND_FORMAT_CHANGED and "mpeg2video" in switch.message
    assert (first[-1].stats.frames_received, first[-1].stats.window_end_s) == (16, 4.0)
    (reset,) = events(second)
    assert reset.kind == pb.LIVE_EVENT_KIND_TIMESTAMP_RESET and (reset.stream_s, reset.source_pts_s) == (1.0, 0.0)
    assert (second[-1].stats.frames_sampled, second[-1].stats.newest_s) == (4, 1.5)
    wait_released(server)


# ----- faults and limits -------------------------------------------------------------------------------
def test_a_client_that_goes_away_frees_the_session_at_once(server, client, recorder):
    ended_before = gauge(recorder, "live_sessions_ended_total", reason="cancelled")
    frames, times = synthetic_frames(8, 84, 112, seed=9), np.arange(8) / 2.0
    with client.live(stats_every_s=0.1, **OPEN) as live:
        live.opened()
        live.send_frames(frames, times)
        reader = Reader(live)
        reader.until(prefilled(4))
        (call,) = server.call(_calls(server))
        session = call.session
        assert session.kv_bytes > 0
        deadline = time.monotonic() + 5
        while gauge(recorder, "live_kv_bytes") == 0:       # the metrics tick
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert gauge(recorder, "live_sessions_active") == 1
        live.ask(QUESTION, question_id="long", max_new_tokens=1500, ignore_eos=True)
        reader.until(lambda r: r.HasField("chunk"))
        scheduler = server.service.engine.scheduler
        closing, seen = session.close, []

        def close_seen():                          # the server has seen the client go
            seen.append(scheduler.stats["steps"])
            closing()
        session.close = close_seen
    # Leaving the block before the stream ended cancelled it: the session is released at the next
    # step after the server sees the cancel (counted in steps from that event, not from the test's
    # own read, and not in seconds: a loaded machine's steps are slower, not more).
    wait_released(server)
    assert seen, "the server never closed the session"
    steps_at_cancel = seen[0]
    assert scheduler.stats["steps"] - steps_at_cancel <= 2
    assert session.closed and session.kv_bytes == 0 and session.running_answers == 0
    deadline = time.monotonic() + 10.0
    while scheduler.num_running:                          # the long answer was aborted
        assert time.monotonic() < deadline, "the answer kept running after the client left"
        time.sleep(0.01)
    assert scheduler.stats["steps"] - steps_at_cancel <= 3, "the answer ran on after the client left"
    assert gauge(recorder, "live_sessions_active") == 0 and gauge(recorder, "live_kv_bytes") == 0
    assert gauge(recorder, "live_sessions_ended_total", reason="cancelled") == ended_before + 1
    assert gauge(recorder, "live_frames_ingested_total") >= 8


def test_a_request_stream_that_fails_mid_session_ends_it_cancelled_not_internal(server):
    """Under Ray Serve the replica reads the client's messages from the proxy, which may drop a
    cancelled call before it says so: reading the stream then raises. The client is gone; the
    session closes as cancelled, like any client that leaves, never as an INTERNAL failure."""
    service = server.service

    async def requests():
        yield pb.LiveRequest(open=pb.LiveOpen(**OPEN))
        await asyncio.sleep(0.05)
        raise RuntimeError("the proxy no longer has this call")

    async def run() -> tuple[list, BaseException | None]:
        got, ended = [], None
        try:
            async for response in service.live_stream(requests()):
                got.append(response)
        except BaseException as exc:  # noqa: BLE001 - how the stream ended is the point
            ended = exc
        return got, ended

    before = dict(service.live_ended)
    got, ended = server.call(run())
    assert got and got[0].HasField("opened")
    assert isinstance(ended, asyncio.CancelledError), repr(ended)
    wait_released(server)
    after = dict(service.live_ended)
    assert after.get("cancelled", 0) == before.get("cancelled", 0) + 1, after
    assert after.get("internal", 0) == before.get("internal", 0), after


def _calls(server):
    async def read():
        return list(server.service.live_sessions.values())
    return read()


def test_limits_answer_resource_exhausted_and_a_deadline_ends_the_session(tiny_model_dirs):
    limits = dict(max_live_sessions=1, max_live_session_s=1.5, max_live_bytes=40_000, max_live_window_s=30.0)
    with make_server(*tiny_model_dirs, **limits) as tight, SparrowClient(tight.address) as client:
        with client.live() as first:
            first.opened()
            with client.live() as second:                 # one session at a time here
                assert code_of(second.opened) == grpc.StatusCode.RESOURCE_EXHAUSTED
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:     # the first ends by itself at 1.5 s
                Reader(first).rest()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "open 1.5 s" in info.value.details()
            assert time.monotonic() - started < 3.0
        wait_released(tight)
        with client.live() as live:
            live.opened()
            live.send_chunk(bytes(50_000))                 # over the session's bytes
            with pytest.raises(grpc.RpcError) as info:
                Reader(live).rest()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes" in info.value.details()
        wait_released(tight)
        with client.live(window_s=60) as live:
            assert code_of(live.opened) == grpc.StatusCode.RESOURCE_EXHAUSTED
        wait_released(tight)
        with client.live(timeout=0.5) as live:              # the client's deadline comes first
            live.opened()
            with pytest.raises(grpc.RpcError) as info:
                Reader(live).rest()
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_released(tight)


@pytest.mark.parametrize("options, words", [
    (dict(fps=0.0), "fps"), (dict(window_s=-1.0), "window_s"), (dict(evict_s=-2.0), "evict_s"),
    (dict(window_s=0.5), "no frame pair"), (dict(min_pixels=100_000, max_pixels=1000), "min_pixels"),
    (dict(max_pixels=1 << 30), "max_pixels"), (dict(stats_every_s=-1.0), "stats_every_s"),
    (dict(standing=[("s", "q ?", 0.0)]), "every_s"), (dict(evict_mode="drop"), "evict_mode"),
])
def test_bad_open_options_are_invalid_argument(server, client, options, words):
    with client.live(**options) as live:
        with pytest.raises(grpc.RpcError) as info:
            live.opened()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
    wait_released(server)


def test_first_message_not_open_undecodable_url_off_the_allowlist_and_a_target_that_cannot_go_live(server, client, tmp_path):
    stub = pb_grpc.SparrowStub(client.channel)
    ask = pb.LiveRequest(question=pb.LiveQuestion(text=QUESTION))
    assert code_of(lambda: list(stub.Live(iter([ask])))) == grpc.StatusCode.INVALID_ARGUMENT
    # A message gRPC cannot parse: first, the stream is refused; later, an event and the session goes on.
    raw = client.channel.stream_stream("/sparrow.v1.Sparrow/Live", request_serializer=None,
                                       response_deserializer=pb.LiveResponse.FromString)
    junk = b"\x0a\xff\xff\xff\x0f"
    assert code_of(lambda: list(raw(iter([junk])))) == grpc.StatusCode.INVALID_ARGUMENT
    opening = pb.LiveRequest(open=pb.LiveOpen(**OPEN)).SerializeToString()
    responses = list(raw(iter([opening, junk])))
    assert [r.WhichOneof("kind") for r in responses] == ["opened", "event", "stats"]
    assert responses[1].event.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "decoded" in responses[1].event.message
    with client.live(url="http://example.com/cam.ts") as live:
        assert code_of(live.opened) == grpc.StatusCode.PERMISSION_DENIED
    assert client.model_info().live_sessions
    # LLaVA-OneVision places frames by count: no live session, whatever the options.
    tiny_target("llava_onevision", seed=0).save_pretrained(tmp_path / "llava")
    with make_server(tmp_path / "llava", None) as other, SparrowClient(other.address) as c:
        assert not c.model_info().live_sessions
        with c.live(**OPEN) as live:
            with pytest.raises(grpc.RpcError) as info:
                live.opened()
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "real time" in info.value.details()
    wait_released(server)


def test_the_server_reads_an_allowed_url_itself_and_ends_with_its_source(server, client, tmp_path):
    """The server plays the URL at real time; when the source ends, the session says so,
    drains (the answer asked before finishes), sends its final stats and ends OK by itself."""
    (tmp_path / "cam.ts").write_bytes(ts_bytes(synthetic_frames(16, 84, 112, seed=3)))    # 4 s, played at real time
    with _http_dir(tmp_path) as base:
        with client.live(url=f"{base}/cam.ts", stats_every_s=0.1, **OPEN) as live:
            live.opened()
            reader = Reader(live)
            reader.until(prefilled(1))
            live.send_chunk(b"\x47" * 188)               # a URL session takes no media from the client
            live.ask(QUESTION, question_id="q", **GREEDY)
            reader.rest()                                # the server ends the stream: no RpcError
    (span, tokens, done), = answers(reader.seen, "q")
    assert span[1] >= 1.0 and len(tokens) == 10 and done.source_pts_s > 0
    kinds = [e.kind for e in events(reader.seen)]
    assert any("takes no media" in e.message for e in events(reader.seen))
    assert kinds[-1] == pb.LIVE_EVENT_KIND_SOURCE_ENDED
    final = reader.seen[-1].stats
    assert final.final and final.frames_received == 16 and final.pairs_prefilled == 4
    wait_released(server)


def test_an_unreachable_source_fails_the_session_unavailable(server, client):
    """Nothing listens at the URL: a SOURCE_FAILED event, then the stream ends UNAVAILABLE at
    once (not a session waiting for video that never comes)."""
    started = time.monotonic()
    with client.live(url=f"http://127.0.0.1:{_closed_port()}/cam.ts", **OPEN) as live:
        live.opened()
        reader = Reader(live)
        with pytest.raises(grpc.RpcError) as info:
            reader.rest()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "could not fetch" in info.value.details()
    (failed,) = events(reader.seen)
    assert failed.kind == pb.LIVE_EVENT_KIND_SOURCE_FAILED and failed.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert time.monotonic() - started < 10
    wait_released(server)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _http_dir(path):
    handler = functools.partial(_QuietHandler, directory=str(path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


# ----- the command line --------------------------------------------------------------------------------
def test_sparrow_live_plays_a_file_and_prints_answers(server, tmp_path, capsys):
    path = tmp_path / "clip.mp4"
    write_synthetic_video(path, num_frames=24, width=112, height=84, fps=4.0, seed=1)       # 6 s
    common = ["live", "--server", server.address, str(path), "--speed", "20", "--window", "60", "--max-lag", "100",
              "--min-pixels", str(PIXELS["min_pixels"]), "--max-pixels", str(PIXELS["max_pixels"]),
              "--max-new-tokens", "6"]
    assert cli.main(common + ["--standing", "2:is there a red shape ?", "--ask", "3:what happens ?"]) == 0
    out, err = capsys.readouterr()
    for tag in ("[s1 0.0-2.0s]", "[s1 0.0-4.0s]", "[s1 0.0-6.0s]", "[q1 0.0-"):
        assert tag in out, out
    assert out.count("[length, 6 tokens]") == 4 and "final stats: 24 frames received" in err
    assert cli.main(common + ["--ask", "1:what happens ?", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "opened" in lines[0] and lines[-1]["stats"]["final"]
    assert [line["done"]["questionId"] for line in lines if "done" in line] == ["q1"]
    wait_released(server)


def test_sparrow_live_exits_zero_when_a_url_ends_and_non_zero_when_it_fails(server, tmp_path, capsys):
    (tmp_path / "cam.ts").write_bytes(ts_bytes(synthetic_frames(8, 84, 112, seed=3)))     # 2 s
    common = ["live", "--server", server.address, "--window", "60", "--max-lag", "100",
              "--min-pixels", str(PIXELS["min_pixels"]), "--max-pixels", str(PIXELS["max_pixels"]),
              "--max-new-tokens", "4", "--standing", "1:what happens ?"]
    with _http_dir(tmp_path) as base:
        assert cli.main(common + [f"{base}/cam.ts"]) == 0          # no --duration: ends with the source
    out, err = capsys.readouterr()
    assert "[s1 0.0-1.0s]" in out and "source ended" in err and "final stats: 8 frames received" in err
    assert cli.main(common + [f"http://127.0.0.1:{_closed_port()}/cam.ts"]) == 1
    err = capsys.readouterr().err
    assert "source failed" in err and "UNAVAILABLE" in err
    wait_released(server)
