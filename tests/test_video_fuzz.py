"""Fuzzing the decoder entry points with random and mutated container bytes: every input
either decodes into well-formed frames or raises a VideoError, quickly, in bounded memory."""

from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparrow.errors import InvalidRequest, VideoError
from sparrow.video import LiveSource, VideoOptions, load_frames, write_synthetic_video

# Tight bounds, so that a mutated header cannot ask for much (frame size, count, time).
FUZZ = VideoOptions(num_frames=4, max_frame_pixels=128 * 128, max_decoded_frames=16, max_bytes=1 << 20,
                    max_frame_bytes=1 << 20, max_duration_s=600.0, open_timeout_s=2.0, read_timeout_s=2.0,
                    timeout_s=2.0)
WALL_S = 3.0  # per example: timeout_s plus slack for a slow, shared machine


def _seeds() -> list[bytes]:
    """Small valid videos in the containers we accept (8 frames of 32x32)."""
    folder = Path(tempfile.mkdtemp(prefix="sparrow-fuzz-"))
    seeds = [write_synthetic_video(None, num_frames=8, width=32, height=32, fps=4, seed=1).data]
    for ext in ("ts", "mkv", "avi"):
        seeds.append(write_synthetic_video(folder / f"seed.{ext}", num_frames=8, width=32, height=32, fps=4).path
                     .read_bytes())
    return seeds


SEEDS = _seeds()


@st.composite
def mutated(draw) -> bytes:
    """A seed with a few byte flips, overwrites, insertions, deletions or a truncation."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "overwrite", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "overwrite":
            piece = draw(st.binary(min_size=1, max_size=8))
            data[at:at + len(piece)] = piece
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "delete":
            del data[at:at + draw(st.integers(1, 256))]
        else:
            del data[at:]
    return bytes(data)


def _check(outcome) -> None:
    frames = outcome
    assert frames.frames.dtype == np.uint8 and len(frames) % 2 == 0
    assert len(frames) <= FUZZ.max_decoded_frames and frames.frames.nbytes <= FUZZ.max_frame_bytes
    assert np.all(np.isfinite(frames.timestamps))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.binary(max_size=4096) | mutated())
def test_decoder_survives_random_and_mutated_bytes(data):
    start = time.monotonic()
    try:
        _check(load_frames(data, FUZZ))
    except VideoError:
        pass
    assert time.monotonic() - start < WALL_S


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=mutated(), pieces=st.integers(1, 8))
def test_live_source_survives_mutated_streams(data, pieces):
    start = time.monotonic()
    live = LiveSource(retention_s=5.0, max_bytes=1 << 20, probe_bytes=1 << 16)
    try:
        for chunk in np.array_split(np.frombuffer(data, np.uint8), pieces):
            live.append(chunk.tobytes())
        live.close()
        _check(load_frames(live, FUZZ))
    except (VideoError, InvalidRequest):
        pass
    assert time.monotonic() - start < WALL_S


def test_fuzzing_stays_within_memory():
    """Peak RSS may not grow by more than what the bounds allow plus decoder buffers."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    rng = np.random.default_rng(0)
    for index in range(60):
        data = bytearray(SEEDS[index % len(SEEDS)])
        for _ in range(4):
            data[rng.integers(len(data))] = rng.integers(256)
        try:
            load_frames(bytes(data), FUZZ)
        except VideoError:
            pass
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200
