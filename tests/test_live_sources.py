"""A live session's source (sparrow/live/source_health.py, video/ts_framing.py): each fault of a real
source is an event and leaves the stream clock continuous, and every answer carries the
camera time of its newest frame.

What must hold: silence past stale_after_s -> a "stale" event, answers marked stale, then
"resumed" when frames come again (none after the stream ended); source timestamps that
restart -> "timestamp_reset", no frame lost, the answer equal to the one-shot answer of the
whole clip (stream time went on); a codec switch inside an MPEG-TS stream -> "format_changed",
a new media whose frames continue the stream; a frame size switch -> "format_changed", frames
resized; answers carry the source PTS and arrival wall time of their newest frame.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sparrow.config import SamplingParams, SpecConfig
from sparrow.engine import Engine
from sparrow.live.session import LiveSession
from sparrow.live.source_health import SourceClock
from sparrow.live.window import LiveConfig
from sparrow.tiny import synthetic_frames, tiny_target
from sparrow.video import VideoOptions
from sparrow.video.options import Frames
from sparrow.video.ts_framing import TsFraming
from sparrow.video.encode import encode_ts

OPTIONS = VideoOptions(min_pixels=28 * 28, max_pixels=84 * 112)      # 84x112 frames: 12 visual tokens a pair
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
QUESTION = "what happens in the video ?"


@pytest.fixture(scope="module")
def engine():
    eng = Engine(tiny_target("qwen2_5_vl", seed=3), spec=SpecConfig(method="none"))
    yield eng
    eng.close()


class Events:
    """A session's events, waited for by kind."""

    def __init__(self):
        self.seen, self._cv = [], threading.Condition()

    def __call__(self, event) -> None:
        with self._cv:
            self.seen.append(event)
            self._cv.notify_all()

    def kinds(self) -> list[str]:
        with self._cv:
            return [e.kind for e in self.seen]

    def wait_for(self, kind: str, count: int = 1, timeout: float = 10.0):
        with self._cv:
            assert self._cv.wait_for(lambda: self.kinds_locked().count(kind) >= count, timeout), self.kinds_locked()
            return [e for e in self.seen if e.kind == kind][count - 1]

    def kinds_locked(self) -> list[str]:
        return [e.kind for e in self.seen]


def session_of(engine, events: Events, **config) -> LiveSession:
    return LiveSession(engine, LiveConfig(window_s=60, max_lag_s=100, options=OPTIONS, **config), on_event=events)


def answer(session: LiveSession, question: str = QUESTION):
    a = session.ask(question, GREEDY)
    for _ in a.generation:
        pass
    return a, a.generation.output.token_ids


def one_shot(engine, frames: np.ndarray) -> list[int]:
    clip = Frames(frames, np.arange(len(frames)) / 2.0, 2.0, OPTIONS)
    return engine.generate(clip, QUESTION, GREEDY, OPTIONS).token_ids


def ts_bytes(frames: np.ndarray, codec: str = "mpeg4", fps: int = 4) -> bytes:
    return encode_ts(frames, fps, codec)


def feed_all(session: LiveSession, data: bytes, chunk: int = 1000) -> None:
    for i in range(0, len(data), chunk):
        session.feed(data[i:i + chunk])


# ----- silence ----------------------------------------------------------------------------------------
def test_silence_marks_answers_stale_until_frames_come_again(engine):
    events = Events()
    session = session_of(engine, events, stale_after_s=1.5)
    frames = synthetic_frames(8, 84, 112, seed=1)
    session.push_frames(frames[:4], np.arange(4) / 2.0)
    session.wait_ingested(60)
    # The newest frame once more (its slot is taken: received, not sampled), so the silence
    # starts now however long the ingest took on a loaded machine.
    session.push_frames(frames[3:4], np.array([1.5]))
    fresh, _ = answer(session)
    assert not fresh.stale and not session.stats.stale
    stale = events.wait_for("stale")
    assert "no frame for" in stale.message and stale.camera.source_pts_s == 1.5
    late, _ = answer(session)
    assert late.stale and session.stats.stale and late.camera == fresh.camera
    session.push_frames(frames[4:], 2.0 + np.arange(4) / 2.0)
    assert "frames again" in events.wait_for("resumed").message
    session.wait_ingested(60)
    again, _ = answer(session)
    assert not again.stale and again.camera.source_pts_s == 3.5
    # After the end of the stream silence is expected: no more stale events.
    session.end_of_stream()
    time.sleep(2.0)
    assert events.kinds().count("stale") == 1 and not session.stats.stale
    session.close()


# ----- timestamps -------------------------------------------------------------------------------------
def test_source_timestamps_that_restart_keep_the_stream_clock(engine):
    """A source whose timestamps restart at 0 mid-stream loses no frame: stream time goes on
    one frame slot after the newest frame, so the window is the whole clip, and the answer is
    the one-shot answer of all its frames."""
    events = Events()
    session = session_of(engine, events)
    frames = synthetic_frames(16, 84, 112, seed=4)
    session.push_frames(frames[:8], 10.0 + np.arange(8) / 2.0)         # pts 10.0 .. 13.5
    session.push_frames(frames[8:], np.arange(8) / 2.0)                # the camera restarted: 0.0 .. 3.5
    session.wait_ingested(60)
    reset = events.wait_for("timestamp_reset")
    assert "13.500 s to 0.000 s" in reset.message
    stats = session.stats
    assert (stats.frames_sampled, stats.pairs_prefilled, stats.window_end_s) == (16, 8, 8.0)
    assert (stats.newest_s, stats.newest_source_pts_s) == (7.5, 3.5)
    got, tokens = answer(session)
    assert (got.start_s, got.end_s) == (0.0, 8.0)
    assert (got.camera.stream_s, got.camera.source_pts_s) == (7.5, 3.5)
    assert tokens == one_shot(engine, frames)
    session.close()


def test_the_clock_ignores_jitter_and_places_a_new_media_after_the_newest_frame():
    clock = SourceClock(fps=2.0)
    assert clock.place(5.0, 1.0)[0].stream_s == 0.0
    camera, reset = clock.place(4.6, 2.0)        # back by less than RESET_S: jitter, not a reset
    assert not reset and camera.stream_s == pytest.approx(-0.4) and clock.newest.source_pts_s == 5.0
    camera, reset = clock.place(3.0, 3.0)        # back by 2 s: a reset
    assert reset and camera.stream_s == 0.5 and camera.wall_time_s == 3.0
    clock.new_media()
    camera, reset = clock.place(100.0, 4.0)      # a new media: after the newest, without a reset
    assert not reset and camera.stream_s == 1.0


# ----- container streams ------------------------------------------------------------------------------
def test_a_codec_switch_in_an_mpeg_ts_stream_starts_a_new_media_on_the_same_clock(engine):
    events = Events()
    session = session_of(engine, events)
    first, second = synthetic_frames(8, 84, 112, seed=1), synthetic_frames(8, 84, 112, seed=2)
    feed_all(session, ts_bytes(first, "mpeg4") + ts_bytes(second, "mpeg2video"))
    session.end_of_stream()
    session.wait_ingested(60)
    switch = events.wait_for("format_changed")
    assert "mpeg4" in switch.message and "mpeg2video" in switch.message
    assert "error" not in events.kinds() and "timestamp_reset" not in events.kinds()
    stats = session.stats
    assert (stats.frames_received, stats.pairs_prefilled, stats.window_end_s) == (16, 4, 4.0)
    session.close()


def test_a_frame_size_switch_and_a_pts_restart_in_one_media(engine):
    events = Events()
    session = session_of(engine, events)
    data = ts_bytes(synthetic_frames(8, 84, 112, seed=1)) + ts_bytes(synthetic_frames(8, 56, 56, seed=2))
    feed_all(session, data)
    session.end_of_stream()
    session.wait_ingested(60)
    assert "from 112x84 to 56x56" in events.wait_for("format_changed").message

    events.wait_for("timestamp_reset")
    stats = session.stats
    assert (stats.frames_received, stats.pairs_prefilled, stats.window_end_s) == (16, 4, 4.0)
    answer(session)
    session.close()


def test_ts_framing_refuses_broken_chunks_and_cuts_at_a_program_change():
    a, b = ts_bytes(synthetic_frames(4, 56, 56, seed=1)), ts_bytes(synthetic_frames(4, 56, 56, seed=2), "mpeg2video")
    framing = TsFraming()
    segments = [seg for i in range(0, len(a + b), 1001) for seg in framing.push((a + b)[i:i + 1001])]
    switches = [seg.switch for seg in segments if seg.switch]
    assert switches == ["mpeg4 (PID 256) -> mpeg2video (PID 256)"]
    cut = next(i for i, seg in enumerate(segments) if seg.switch)
    # The old media: the first stream, then the second's packets before its PMT (SDT, PAT);
    # the new one: that PAT again, then the second stream from its PMT on.
    old, new = (b"".join(seg.data for seg in part) for part in (segments[:cut], segments[cut:]))
    head = old[len(a):]
    assert old.startswith(a) and b.startswith(head) and 0 < len(head) < 4 * 188
    assert new[:188] in head and new[188:] == b[len(head):]

    with pytest.raises(Exception, match="not MPEG-TS"):
        TsFraming().push(b"\x00" * 400)


# ----- camera time -------------------------------------------------------------------------------------
def test_answers_and_standing_answers_carry_the_camera_time_of_their_newest_frame(engine):
    events = Events()
    session = session_of(engine, events)
    session.add_standing("is there a red shape ?", 2.0, GREEDY, question_id="s")
    before = time.time()
    session.push_frames(synthetic_frames(8, 84, 112, seed=5), 1000.0 + np.arange(8) / 2.0)
    after = time.time()
    session.wait_ingested(60)
    got, _ = answer(session)
    assert (got.start_s, got.end_s) == (0.0, 4.0) and got.camera.stream_s == 3.5
    assert got.camera.source_pts_s == 1003.5 and before <= got.camera.wall_time_s <= after
    done = [events.wait_for("done", n) for n in (1, 2)]
    assert [(e.end_s, e.camera.source_pts_s) for e in done] == [(2.0, 1001.5), (4.0, 1003.5)]
    session.close()
