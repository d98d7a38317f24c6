"""RTSP end to end: a file published by ffmpeg as an RTSP camera on loopback (through the relay
in rtsp_relay.py), read by the server itself (LiveOpen.url) with standing questions, over real
gRPC. Skips only when there is no ffmpeg binary (`make test` installs it).

What must hold: the session answers its standing questions on the camera's stream time, with
the camera's time on each answer, and its alert rule's incident carries the same camera time; when the camera stops, a SOURCE_ENDED event, the final stats
(every frame the camera sent) and an OK end; an unreachable camera fails the session at once
with UNAVAILABLE (a SOURCE_FAILED event first), not a session waiting for video.
"""

from __future__ import annotations

import shutil
import time

import grpc
import pytest
from rtsp_relay import RtspRelay
from test_service_live import GREEDY, OPEN, Reader, _closed_port, answers, events, make_server, wait_released

from sparrow.services.client import SparrowClient
from sparrow.services.protos import pb
from sparrow.video import write_synthetic_video

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="no ffmpeg binary (make test installs it)")


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    with make_server(*tiny_model_dirs, allowed_url_schemes=("rtsp",), allowed_url_hosts=("127.0.0.1",)) as running:
        yield running


@pytest.fixture
def client(server):
    with SparrowClient(server.address) as c:
        yield c


def test_a_live_session_answers_standing_questions_on_an_rtsp_camera(server, client, tmp_path):
    clip = tmp_path / "cam.mp4"
    write_synthetic_video(clip, num_frames=16, width=112, height=84, fps=4.0, seed=4)        # 4 s
    with RtspRelay() as relay:
        publisher = relay.publish(clip)
        try:
            before = time.time()
            # An alert rule whose threshold any P(yes) passes: it fires at its first check.
            rule = pb.AlertRule(rule_id="shape", question="is a shape in view ?", every_s=2.0, fire_at=1e-9)
            # stale_after_s past any stall of a loaded machine (a CI run saw ffmpeg's first frame
            # arrive more than the default 5 s after the open: STALE and RESUMED events).
            with client.live(url=relay.url, stats_every_s=0.2, standing_sampling=GREEDY, rules=[rule], stale_after_s=60.0,
                             standing=[("colour", "what colour is the shape now ?", 1.0)], **OPEN) as live:
                assert list(live.opened().rule_ids) == ["shape"]
                reader = Reader(live)
                reader.rest()                      # the camera stops: the server ends the stream OK
        finally:
            publisher.kill()
            publisher.wait()
    got = answers(reader.seen, "colour")
    assert [span for span, _, _ in got] == [(0.0, float(s)) for s in range(1, 5)]       # every second of stream
    assert all(len(tokens) == 10 and done.completion.finish_reason == pb.FINISH_REASON_LENGTH
               for _, tokens, done in got)
    # Camera time: RTP timestamps in seconds, one frame slot apart per second of stream, and
    # the wall time each answer's newest frame arrived.
    pts = [done.source_pts_s for _, _, done in got]
    assert [round(b - a, 3) for a, b in zip(pts, pts[1:])] == [1.0, 1.0, 1.0]
    assert all(before <= done.wall_time_s <= time.time() for _, _, done in got)
    # The rule's incident: the window it saw, with the camera's time of its newest frame.
    (incident,) = [r.incident for r in reader.seen if r.HasField("incident")]
    assert (incident.rule_id, incident.kind, incident.source) == ("shape", pb.INCIDENT_KIND_FIRED, relay.url)
    assert (incident.start_s, incident.end_s) == (0.0, 2.0) and incident.probability > 0
    assert incident.source_pts_s == got[1][2].source_pts_s and before <= incident.wall_time_s <= time.time()
    assert [e.kind for e in events(reader.seen)] == [pb.LIVE_EVENT_KIND_SOURCE_ENDED]
    final = reader.seen[-1].stats
    assert final.final and final.frames_received == 16 and final.pairs_prefilled == 4
    wait_released(server)


def test_an_unreachable_rtsp_camera_fails_the_session_unavailable(server, client):
    started = time.monotonic()
    with client.live(url=f"rtsp://127.0.0.1:{_closed_port()}/cam", **OPEN) as live:
        live.opened()
        reader = Reader(live)
        with pytest.raises(grpc.RpcError) as info:
            reader.rest()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    (failed,) = events(reader.seen)
    assert failed.kind == pb.LIVE_EVENT_KIND_SOURCE_FAILED and "source failed" in failed.message
    assert time.monotonic() - started < 10
    wait_released(server)
