"""The service's limits, over real gRPC on loopback against the embedded server.

What must hold: an upload is received in bounded memory (a few chunks, whatever its size) and
probed before it is stored, so random bytes are refused (INVALID_ARGUMENT) and leave nothing
on disk; uploads in progress and the bytes they hold are limited (RESOURCE_EXHAUSTED); every
refusal, cancellation and deadline is counted in Prometheus under its reason; stop strings,
paths and URLs are bounded, a scheme-less url is no path, and an error never quotes
unbounded input; a directory symlink flipping under requests never yields INTERNAL.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest_services import SPEC_KWARGS

from sparrow import SpecConfig
from sparrow.errors import SparrowError
from sparrow.services import prom
from sparrow.services.client import SparrowClient
from sparrow.services.config import ServiceConfig
from sparrow.services.grpc_status import MAX_DETAILS_CHARS, status_for
from sparrow.services.protos import pb
from sparrow.services.server import BackgroundServer
from sparrow.services.servicer import SparrowService
from sparrow.services.settings import AppSettings, build_engine
from sparrow.video import SourcePolicy
from sparrow.video.sources import open_regular_file

MiB = 1 << 20
CHUNK = 1 * MiB
PROMPT = "What happens in the video?"


def make_service(model_dirs, media_root: Path, upload_dir: Path, **limits) -> SparrowService:
    config = ServiceConfig(max_new_tokens=4000, max_video_bytes=256 * MiB, max_message_bytes=8 * MiB,
                           max_frames=64, media_root=str(media_root), upload_dir=str(upload_dir), **limits)
    settings = AppSettings(target=str(model_dirs[0]), draft=str(model_dirs[1]), spec=SpecConfig(**SPEC_KWARGS),
                           service=config)
    engine, cache = build_engine(settings)
    return SparrowService(engine, cache, config)


@pytest.fixture(scope="module")
def server(tiny_model_dirs, clips, tmp_path_factory):
    uploads = tmp_path_factory.mktemp("uploads")
    with BackgroundServer(make_service(tiny_model_dirs, clips.root, uploads)) as running:
        yield running


@pytest.fixture(scope="module")
def tight(tiny_model_dirs, clips, tmp_path_factory):
    """A server with small limits: one request, two uploads, 6 MiB in flight."""
    uploads = tmp_path_factory.mktemp("tight-uploads")
    service = make_service(tiny_model_dirs, clips.root, uploads, max_concurrent=1, max_uploads=2,
                           max_upload_bytes_in_flight=6 * MiB)
    with BackgroundServer(service) as running:
        yield running


@pytest.fixture
def client(server):
    with SparrowClient(server.address, max_message_bytes=16 * MiB) as c:
        yield c


def code_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def stored_files(server) -> list[str]:
    return sorted(p.name for p in server.service.videos.directory.iterdir())


def padded_video(video: bytes, size: int) -> bytes:
    """`video` (an mp4) followed by a top-level 'free' box of random bytes up to `size`:
    still a valid video, as large as asked."""
    pad = size - len(video)
    return video + struct.pack(">I4s", pad, b"free") + os.urandom(pad - 8)


def chunked(data: bytes, sha256: str = "", chunk: int = CHUNK):
    view = memoryview(data)
    for i in range(0, len(data), chunk):
        yield pb.VideoChunk(data=bytes(view[i:i + chunk]), sha256=sha256 if i == 0 else "")


class PeakRss:
    """Peak resident set size of this process (the server runs in it) over a block, sampled
    every 2 ms from /proc."""

    def __init__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# ----- uploads ----------------------------------------------------------------------------------
def test_large_upload_is_received_in_a_few_chunks_of_memory(server, client, clips):
    """Server and client share this process. Python's own allocations (tracemalloc: bytes,
    protobuf messages, numpy) must stay a few chunks: one in flight at each end, serialized,
    parsed and read out of its message. RSS (from /proc) must stay far below the file, whatever
    the allocator keeps and gRPC's flow control lets queue. The old path held the parts, their
    join and the stored tensor: about 3x the file."""
    for name in "bc":           # once-per-process costs first (the probe's decoder, worker threads)
        client.stub.UploadVideo(chunked(padded_video(clips.data[name], 16 * CHUNK)), timeout=60)
    size = 256 * MiB
    video = padded_video(clips.data["a"], size)
    video_id = hashlib.sha256(video).hexdigest()
    messages = list(chunked(video))          # made before measuring: the client's copy is not the server's
    tracemalloc.start()
    try:
        with PeakRss() as rss:
            ref = client.stub.UploadVideo(iter(messages), timeout=120)
        traced_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ref.video_id == video_id and ref.size_bytes == size and not ref.already_stored
    assert traced_peak < 8 * CHUNK, f"Python objects peaked at {traced_peak / MiB:.1f} MiB"
    print(f"RSS +{rss.growth / MiB:.1f} MiB, Python objects peak {traced_peak / MiB:.1f} MiB")
    assert rss.growth < size // 4, f"RSS grew {rss.growth / MiB:.1f} MiB for a {size // MiB} MiB upload"
    assert video_id in stored_files(server) and not any(name.startswith(".") for name in stored_files(server))
    assert (server.service.videos.directory / video_id).stat().st_size == size
    assert client.generate(PROMPT, video_id=video_id, max_new_tokens=4, timeout=60).token_ids
    claimed = code_of(lambda: client.stub.UploadVideo(iter([pb.VideoChunk(data=b"x", sha256=video_id)]), timeout=60))
    assert claimed.code() == grpc.StatusCode.INVALID_ARGUMENT      # a stored video's hash, other bytes: no video


def test_random_bytes_upload_is_refused_and_not_stored(server, client):
    before = stored_files(server)
    data = os.urandom(3 * CHUNK + 12345)
    digest = hashlib.sha256(data).hexdigest()
    error = code_of(lambda: client.stub.UploadVideo(chunked(data, digest), timeout=60))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert stored_files(server) == before                   # no spool file, no stored entry
    assert not server.service.videos.contains(digest)
    error = code_of(lambda: client.generate(PROMPT, video_id=digest, max_new_tokens=4, timeout=30))
    assert error.code() == grpc.StatusCode.NOT_FOUND


def _held_upload(address: str, first: bytes, release: threading.Event, outcome: list) -> threading.Thread:
    """An upload that sends `first`, then waits for `release` before it ends (a valid clip)."""
    def messages():
        yield pb.VideoChunk(data=first)
        release.wait(30)

    def run():
        with SparrowClient(address) as c:
            try:
                outcome.append(c.stub.UploadVideo(messages(), timeout=60))
            except grpc.RpcError as exc:
                outcome.append(exc.code())

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_for(predicate, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def test_concurrent_uploads_past_the_limit_are_refused_cleanly(tight, clips):
    release, outcomes = threading.Event(), [[], []]
    held = [_held_upload(tight.address, clips.data[name], release, outcomes[i]) for i, name in enumerate("ab")]
    try:
        wait_for(lambda: tight.service.uploads.uploads == 2)
        with SparrowClient(tight.address) as c:
            error = code_of(lambda: c.upload(clips.data["c"], timeout=30))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "uploads in progress" in error.details()
    finally:
        release.set()
        for thread in held:
            thread.join(60)
    assert [o[0].video_id for o in outcomes] == [hashlib.sha256(clips.data[n]).hexdigest() for n in "ab"]
    assert tight.service.uploads.uploads == 0 and tight.service.uploads.bytes_in_flight == 0
    with SparrowClient(tight.address) as c:                 # the slots are free again
        assert c.upload(clips.data["c"], timeout=30) == hashlib.sha256(clips.data["c"]).hexdigest()


def test_bytes_in_flight_past_the_limit_are_refused(tight, clips):
    release, outcome = threading.Event(), []
    big = padded_video(clips.data["d"], 4 * MiB)
    thread = _held_upload(tight.address, big, release, outcome)
    try:
        wait_for(lambda: tight.service.uploads.bytes_in_flight == 4 * MiB)
        with SparrowClient(tight.address) as c:
            error = code_of(lambda: c.upload(padded_video(clips.data["e"], 3 * MiB), timeout=30))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in progress hold" in error.details()
    finally:
        release.set()
        thread.join(60)
    assert outcome[0].size_bytes == 4 * MiB
    assert tight.service.uploads.bytes_in_flight == 0
    assert not any(name.startswith(".") for name in stored_files(tight))     # the refused spool is gone


# ----- request sizes --------------------------------------------------------------------------------
def test_stop_strings_are_bounded_in_count_and_bytes(client):
    error = code_of(lambda: client.generate(PROMPT, path="a.mp4", stop=["x"] * 17, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "16 stop strings" in error.details()
    error = code_of(lambda: client.generate(PROMPT, path="a.mp4", stop=["é" * 300], timeout=30))   # 600 bytes
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "600 bytes" in error.details()
    assert client.generate(PROMPT, path="a.mp4", stop=["é" * 256], max_new_tokens=4, timeout=60).token_ids


def test_paths_and_urls_are_bounded_and_never_echoed_whole(client):
    for source in ({"path": "a" * 10_000}, {"url": "https://example.com/" + "a" * 10_000}):
        error = code_of(lambda: client.generate(PROMPT, **source, timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "over the limit of 4096" in error.details()
        assert len(error.details()) < 200
    # Within the limit, refused for where it points: the message quotes a bounded part of it.
    error = code_of(lambda: client.generate(PROMPT, path="../" + "b" * 4000, timeout=30))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and len(error.details()) < 300
    error = code_of(lambda: client.generate(PROMPT, path="no/such/" + "c" * 3000 + ".mp4", timeout=30))
    assert error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
    assert len(error.details()) < 400


def test_any_status_message_is_cut(client):
    code, details = status_for(SparrowError("x" * 100_000))
    assert code == grpc.StatusCode.INTERNAL and len(details) < MAX_DETAILS_CHARS + 100


def test_a_scheme_less_url_is_not_read_as_a_path(client, clips):
    assert client.generate(PROMPT, path="a.mp4", max_new_tokens=2, timeout=60).token_ids     # the file is there
    error = code_of(lambda: client.generate(PROMPT, url="a.mp4", timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "is not a URL" in error.details()
    error = code_of(lambda: client.generate(PROMPT, url=str(clips.path("a")), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


# ----- metrics -----------------------------------------------------------------------------------------
def scrape_errors(url: str) -> dict[tuple[str, str], float]:
    """{(method, reason): count} of sparrow:request_errors_total, from the /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.labels["method"], s.labels["reason"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "sparrow:request_errors_total"}


def test_every_refusal_cancellation_and_deadline_is_counted_by_reason(tight, clips):
    endpoint = prom.start_metrics_server("127.0.0.1", 0)          # the recorder both servers record on
    try:
        before = scrape_errors(endpoint.url)
        long = dict(path="a.mp4", max_new_tokens=3000, ignore_eos=True)
        with SparrowClient(tight.address) as c:
            expect: dict[tuple[str, str], int] = {}

            def refused(key, code, call):
                assert code_of(call).code() == code
                expect[key] = expect.get(key, 0) + 1

            refused(("Generate", "invalid_argument"), grpc.StatusCode.INVALID_ARGUMENT,
                    lambda: c.generate(" ", path="a.mp4", timeout=30))
            refused(("Generate", "permission_denied"), grpc.StatusCode.PERMISSION_DENIED,
                    lambda: c.generate(PROMPT, path="../outside.mp4", timeout=30))
            refused(("Generate", "not_found"), grpc.StatusCode.NOT_FOUND,
                    lambda: c.generate(PROMPT, video_id="0" * 64, timeout=30))
            refused(("UploadVideo", "invalid_argument"), grpc.StatusCode.INVALID_ARGUMENT,
                    lambda: c.upload(os.urandom(10_000), timeout=30))
            # Past its deadline while generating (the server cancels the call).
            refused(("Generate", "deadline"), grpc.StatusCode.DEADLINE_EXCEEDED,
                    lambda: c.generate(PROMPT, **long, timeout=0.8))
            wait_for(lambda: not tight.service.live)
            # Cancelled by the client mid-stream.
            stream = c.stream(PROMPT, **long)
            next(iter(stream))
            stream.call.cancel()
            expect[("Generate", "cancelled")] = 1
            wait_for(lambda: not tight.service.live)
            # One request running is this server's limit: the next is overloaded.
            stream = c.stream(PROMPT, **long)
            next(iter(stream))
            refused(("Generate", "overloaded"), grpc.StatusCode.RESOURCE_EXHAUSTED,
                    lambda: c.generate(PROMPT, path="b.mp4", timeout=30))
            stream.call.cancel()
            expect[("Generate", "cancelled")] += 1
            wait_for(lambda: not tight.service.live)
        # Two uploads held open are this server's limit: the next is refused as upload_limit.
        release, outcomes = threading.Event(), [[], []]
        held = [_held_upload(tight.address, clips.data[n], release, outcomes[i]) for i, n in enumerate("ab")]
        try:
            wait_for(lambda: tight.service.uploads.uploads == 2)
            with SparrowClient(tight.address) as c:
                refused(("UploadVideo", "upload_limit"), grpc.StatusCode.RESOURCE_EXHAUSTED,
                        lambda: c.upload(clips.data["c"], timeout=30))
        finally:
            release.set()
            for thread in held:
                thread.join(60)

        def counted() -> dict:
            after = scrape_errors(endpoint.url)
            return {key: after.get(key, 0) - before.get(key, 0) for key in set(after) | set(before)
                    if after.get(key, 0) != before.get(key, 0)}

        wait_for(lambda: counted() == expect, within=5)       # a cancel is counted as the handler unwinds
    finally:
        endpoint.close()


def test_a_cancelled_upload_leaves_nothing_behind(tight, clips):
    release = threading.Event()

    def messages():
        yield pb.VideoChunk(data=clips.data["a"])
        release.wait(30)

    with SparrowClient(tight.address) as c:
        call = c.stub.UploadVideo.future(messages(), timeout=60)
        wait_for(lambda: tight.service.uploads.bytes_in_flight > 0)
        assert any(name.startswith(".upload-") for name in stored_files(tight))     # the spool, while it lasts
        call.cancel()
        wait_for(lambda: tight.service.uploads.uploads == 0)
    release.set()
    assert tight.service.uploads.bytes_in_flight == 0
    assert not any(name.startswith(".") for name in stored_files(tight))


# ----- the symlink race -------------------------------------------------------------------------------
@pytest.fixture
def flipping(tmp_path, clips):
    """A media root whose `link` flips between a directory inside it, one outside it, and
    nothing, as fast as it can, while the test runs."""
    root, outside = tmp_path / "media", tmp_path / "outside"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    for directory in (root / "real", outside):
        (directory / "a.mp4").write_bytes(clips.data["a"])
    stop = threading.Event()

    def flip():
        targets, i = [root / "real", outside], 0
        while not stop.is_set():
            tmp = root / f".link-{i % 2}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(targets[i % 2], target_is_directory=True)
            os.replace(tmp, root / "link")            # atomic swap of the link
            if i % 5 == 0:
                (root / "link").unlink(missing_ok=True)     # and now and then no link at all
            i += 1

    thread = threading.Thread(target=flip, daemon=True)
    thread.start()
    yield root
    stop.set()
    thread.join()


def test_a_flipping_directory_symlink_never_fails_unexpectedly(flipping):
    """The library alone, thousands of times: a path through the link resolves, or is
    refused with a typed error; never an OSError (a gRPC INTERNAL)."""
    policy = SourcePolicy(flipping)
    outcomes: dict[str, int] = {}
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        try:
            with open_regular_file(policy.resolve_path("link/a.mp4"), policy):
                pass
            outcome = "opened"
        except SparrowError as exc:
            outcome = type(exc).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("opened", 0) > 0 and outcomes.get("SourceNotAllowed", 0) > 0, outcomes


def test_requests_through_a_flipping_symlink_never_get_internal(tiny_model_dirs, flipping, tmp_path):
    codes: dict[str, int] = {}
    with BackgroundServer(make_service(tiny_model_dirs, flipping, tmp_path / "uploads")) as running, \
            SparrowClient(running.address) as c:
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            try:
                c.generate(PROMPT, path="link/a.mp4", max_new_tokens=1, timeout=30)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            codes[code] = codes.get(code, 0) + 1
    assert set(codes) <= {"OK", "NOT_FOUND", "PERMISSION_DENIED"}, codes
    assert codes.get("PERMISSION_DENIED", 0) > 0, codes
