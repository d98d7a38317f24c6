"""sparrow.video sources: file objects, allowlisted paths and URLs (against an HTTP server on
loopback), live MPEG-TS streams, and the typed errors of bad input and dead sources."""

from __future__ import annotations

import io
import os
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import av
import numpy as np
import pytest

from sparrow.errors import (InvalidRequest, NoFrames, SourceNotAllowed, SourceUnavailable, VideoError, VideoTimeout,
                            VideoTooLarge, VideoUnreadable, VideoUnsupported)
from sparrow.video import (LiveSource, QwenVLVideoProcessor, SourcePolicy, VideoOptions, load_frames, prepare_video,
                           write_synthetic_video)

FPS, N, SIDE = 8, 48, 64  # shared clip: 6 s
SMALL_QWEN = QwenVLVideoProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 16)


@pytest.fixture(scope="module")
def clip():
    return write_synthetic_video(None, num_frames=N, width=SIDE, height=SIDE, fps=FPS, seed=4)


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory):  # moov first (faststart): the layout web servers hold
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    return write_synthetic_video(path, num_frames=N, width=SIDE, height=SIDE, fps=FPS, seed=4)


@pytest.fixture(scope="module")
def reference(clip):
    return load_frames(clip.data, VideoOptions(num_frames=N))  # every frame, t = i / FPS


@pytest.fixture(scope="module")
def ts_clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / "live.ts"
    video = write_synthetic_video(path, num_frames=240, width=SIDE, height=SIDE, fps=FPS, seed=6)  # 30 s
    return video, path.read_bytes(), load_frames(path, VideoOptions(num_frames=240))


def _same(frames, reference) -> None:
    """frames must be exactly the reference frames shown at their timestamps."""
    index = np.round(frames.timestamps * FPS).astype(int)
    np.testing.assert_allclose(frames.timestamps, index / FPS, atol=1e-6)
    np.testing.assert_array_equal(frames.frames, reference.frames[index])


# ---------------------------------------------------------------- file objects


class _Pipe(io.RawIOBase):
    """A non-seekable reader, like a socket or a pipe, handing out small pieces."""

    def __init__(self, data: bytes):
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        piece = self._data[self._pos:self._pos + min(len(buffer), 1000)]
        buffer[: len(piece)] = piece
        self._pos += len(piece)
        return len(piece)


def test_file_objects_give_the_same_frames_as_bytes(clip, clip_file, reference, tmp_path):
    options = VideoOptions(num_frames=12)
    expected = load_frames(clip.data, options)
    with open(clip_file.path, "rb") as handle:
        handle.seek(100)  # read from offset 0 whatever the position
        from_handle = load_frames(handle, options)
    for frames in (from_handle, load_frames(io.BytesIO(clip.data), options), load_frames(_Pipe(clip.data), options)):
        np.testing.assert_array_equal(frames.frames, expected.frames)
        np.testing.assert_array_equal(frames.timestamps, expected.timestamps)
    # A raw h264 stream declares no duration: the decoder takes a second pass over the same
    # object, which must not disturb the first one's position.
    raw = write_synthetic_video(tmp_path / "clip.h264", num_frames=N, width=SIDE, height=SIDE, fps=FPS, seed=4)
    _same(load_frames(io.BytesIO(raw.path.read_bytes()), VideoOptions(num_frames=N)), reference)


def test_file_object_bounds(clip):
    with pytest.raises(VideoTooLarge, match="max_bytes"):
        load_frames(_Pipe(clip.data), VideoOptions(max_bytes=len(clip.data) - 1))
    with pytest.raises(VideoTooLarge, match="bytes"):
        load_frames(io.BytesIO(clip.data), VideoOptions(max_bytes=len(clip.data) - 1))
    with pytest.raises(VideoUnreadable, match="empty"):
        load_frames(_Pipe(b""))
    with pytest.raises(InvalidRequest, match="LiveSource"):
        load_frames(object())


# ---------------------------------------------------------------- allowlists: paths


@pytest.fixture()
def media(tmp_path, clip):
    """media root with a clip, a subfolder, links in and out; a secret outside."""
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "clip.mp4").write_bytes(clip.data)
    secret = tmp_path / "secret.mp4"
    secret.write_bytes(clip.data)
    (root / "inside.mp4").symlink_to(root / "clip.mp4")
    (root / "outside.mp4").symlink_to(secret)
    (root / "escape").symlink_to(tmp_path)
    return root, secret


def test_paths_inside_the_media_root_resolve(media):
    root, _ = media
    policy = SourcePolicy(media_root=root)
    real = (root / "clip.mp4").resolve()
    assert policy.resolve("clip.mp4") == real  # relative to the root
    assert policy.resolve(str(root / "sub" / ".." / "clip.mp4")) == real
    assert policy.resolve(root / "inside.mp4") == real  # a link that stays inside is fine
    assert len(load_frames("clip.mp4", VideoOptions(num_frames=4), policy=policy)) == 4
    processed = prepare_video("sub/../clip.mp4", SMALL_QWEN, VideoOptions(num_frames=4), policy=policy)
    assert processed.model_kwargs["video_grid_thw"].tolist()[0][0] == 2
    with pytest.raises(SourceNotAllowed):
        prepare_video("../secret.mp4", SMALL_QWEN, policy=policy)


@pytest.mark.parametrize("path", ["../secret.mp4", "sub/../../secret.mp4", "outside.mp4", "escape/secret.mp4",
                                  "/etc/passwd", "clip.mp4\x00.txt"])
def test_paths_outside_the_media_root_are_refused(media, path):
    root, _ = media
    policy = SourcePolicy(media_root=root)
    with pytest.raises(SourceNotAllowed):
        policy.resolve(path)
    with pytest.raises(SourceNotAllowed):
        load_frames(path, policy=policy)


def test_path_policy_edges(media, tmp_path):
    root, secret = media
    with pytest.raises(SourceNotAllowed, match="not allowed"):
        SourcePolicy().resolve("clip.mp4")  # no media root: no local paths at all
    with pytest.raises(SourceNotAllowed, match="file://"):
        SourcePolicy(media_root=root, allowed_schemes={"http"}, allowed_hosts={"*"}).resolve(f"file://{secret}")
    with pytest.raises(InvalidRequest):
        SourcePolicy(allowed_schemes={"file"})
    with pytest.raises(InvalidRequest):
        SourcePolicy(media_root=tmp_path / "missing")
    assert not issubclass(SourceNotAllowed, VideoError) and issubclass(SourceNotAllowed, PermissionError)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.mp4"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    with pytest.raises(VideoUnreadable, match="not a regular file"):
        load_frames(fifo)
    with pytest.raises(VideoUnreadable, match="not a regular file"):
        load_frames("pipe.mp4", policy=SourcePolicy(media_root=tmp_path))


# ---------------------------------------------------------------- allowlists: URLs


def test_url_policy():
    policy = SourcePolicy(allowed_schemes={"HTTPS", "rtsp"},
                          allowed_hosts={"cdn.example.com", "*.video.example.org", "cam.local:8554", "[::1]"})
    assert policy.resolve("HTTPS://CDN.example.com/a/b.mp4?x=1#frag") == "https://cdn.example.com/a/b.mp4?x=1"
    assert policy.resolve("https://eu.video.example.org/v.mp4").startswith("https://eu.")
    assert policy.resolve("rtsp://cam.local:8554/live") == "rtsp://cam.local:8554/live"
    assert policy.resolve("https://[::1]/v.mp4") == "https://[::1]/v.mp4"
    refused = [
        "http://cdn.example.com/v.mp4",  # scheme
        "https://evil.example.com/v.mp4",  # host
        "https://video.example.org/v.mp4",  # the wildcard is for subdomains only
        "https://cdn.example.com.evil.net/v.mp4",
        "https://cdn.example.com@evil.net/v.mp4",  # user info: parsers disagree on the host
        "https://evil.net\\@cdn.example.com/v.mp4",
        "https://cdn.example.com/a b.mp4",
        "rtsp://cam.local/live",  # the entry allows port 8554 only
        "rtsp://cam.local:9999/live",
        "file:///etc/passwd",
        "ftp://cdn.example.com/v.mp4",
        "https://cdn.example.com:notaport/v.mp4",
    ]
    for url in refused:
        with pytest.raises(SourceNotAllowed):
            policy.resolve(url)
    anywhere = SourcePolicy(allowed_schemes={"http"}, allowed_hosts={"*"})
    assert anywhere.resolve("http://any.where/v") == "http://any.where/v"
    with pytest.raises(SourceNotAllowed, match="SourcePolicy"):
        load_frames("https://cdn.example.com/v.mp4")  # the library default reads no URL


# ---------------------------------------------------------------- URLs, served on loopback


class _Server:
    """HTTP on 127.0.0.1 with Range support, plus paths that misbehave on purpose."""

    def __init__(self, files: dict[str, bytes], endless: bytes):
        self.release = threading.Event()  # frees handlers that stall, at teardown
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                try:
                    server.answer(self, files, endless)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up, as it should

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer(self, h: BaseHTTPRequestHandler, files: dict[str, bytes], endless: bytes) -> None:
        if h.path == "/redirect":
            h.send_response(302)
            h.send_header("Location", "/clip.mp4")
            h.send_header("Content-Length", "0")
            h.end_headers()
        elif h.path == "/silent":
            self.release.wait(10)  # accepts the connection, never answers
        elif h.path == "/endless":  # a live-like stream that never ends and declares no length
            h.send_response(200)
            h.end_headers()
            while not self.release.is_set():
                h.wfile.write(endless)
        elif h.path.split("?")[0] in files:
            self.send_file(h, files[h.path.split("?")[0]], stall=h.path.endswith("?stall"))
        else:
            h.send_error(404)

    def send_file(self, h: BaseHTTPRequestHandler, data: bytes, stall: bool) -> None:
        start, end = 0, len(data) - 1
        if "Range" in h.headers:
            first, last = h.headers["Range"].split("=")[1].split("-")
            start, end = int(first), int(last) if last else end
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        else:
            h.send_response(200)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(end - start + 1))
        h.end_headers()
        body = data[start:end + 1]
        if stall:  # 60% of the body, then nothing
            h.wfile.write(body[: len(body) * 6 // 10])
            h.wfile.flush()
            self.release.wait(10)
        else:
            h.wfile.write(body)

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server(clip, clip_file, ts_clip):
    files = {"/clip.mp4": clip_file.path.read_bytes(), "/tail.mp4": clip.data}  # tail: moov at the end
    server = _Server(files, endless=ts_clip[1][:50_000])
    yield server
    server.close()


LOOPBACK = SourcePolicy(allowed_schemes={"http", "rtsp"}, allowed_hosts={"127.0.0.1"})
QUICK = dict(open_timeout_s=1.0, read_timeout_s=1.0)


def test_urls_decode_like_bytes(server, clip):
    options = VideoOptions(num_frames=12, **QUICK)
    expected = load_frames(clip.data, options)
    for path in ("/clip.mp4", "/tail.mp4"):  # the second needs Range requests to reach its index
        frames = load_frames(server.base + path, options, policy=LOOPBACK)
        np.testing.assert_array_equal(frames.frames, expected.frames, err_msg=path)
        np.testing.assert_array_equal(frames.timestamps, expected.timestamps)
    sparse = load_frames(server.base + "/clip.mp4", VideoOptions(num_frames=2, seek="always", **QUICK), policy=LOOPBACK)
    np.testing.assert_array_equal(sparse.frames, load_frames(clip.data, VideoOptions(num_frames=2)).frames)


def test_urls_refused_or_unavailable(server):
    with pytest.raises(SourceNotAllowed):
        load_frames(server.base.replace("127.0.0.1", "localhost") + "/clip.mp4", policy=LOOPBACK)
    with pytest.raises(SourceUnavailable, match="[Rr]edirect"):
        load_frames(server.base + "/redirect", VideoOptions(**QUICK), policy=LOOPBACK)  # never followed
    with pytest.raises(SourceUnavailable):
        load_frames(server.base + "/missing.mp4", VideoOptions(**QUICK), policy=LOOPBACK)
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SourceUnavailable):
        load_frames(f"http://127.0.0.1:{port}/clip.mp4", VideoOptions(**QUICK), policy=LOOPBACK)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, clip):
    """The clip over HTTPS on loopback, with a fresh self-signed certificate for 127.0.0.1."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = _Server({"/clip.mp4": clip.data}, endless=b"")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.httpd.socket = context.wrap_socket(server.httpd.socket, server_side=True)
    yield server.base.replace("http:", "https:"), cert
    server.close()


def test_https_certificates_are_verified(tls_server, clip):
    base, cert = tls_server
    options = VideoOptions(num_frames=4, **QUICK)
    with pytest.raises(SourceUnavailable):  # self-signed: not trusted by the system's CAs
        load_frames(base + "/clip.mp4", options, policy=SourcePolicy(allowed_schemes={"https"},
                                                                      allowed_hosts={"127.0.0.1"}))
    trusting = SourcePolicy(allowed_schemes={"https"}, allowed_hosts={"127.0.0.1"}, tls_ca_file=cert)
    frames = load_frames(base + "/clip.mp4", options, policy=trusting)
    np.testing.assert_array_equal(frames.frames, load_frames(clip.data, options).frames)


def test_a_url_that_never_answers_times_out(server):
    start = time.monotonic()
    with pytest.raises(VideoTimeout, match="did not answer"):
        load_frames(server.base + "/silent", VideoOptions(**QUICK), policy=LOOPBACK)
    assert time.monotonic() - start < 3.0
    with socket.socket() as listener:  # RTSP: the TCP handshake completes, no RTSP reply ever comes
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        start = time.monotonic()
        with pytest.raises(VideoTimeout):
            load_frames(f"rtsp://127.0.0.1:{listener.getsockname()[1]}/live", VideoOptions(**QUICK), policy=LOOPBACK)
        assert time.monotonic() - start < 3.0


def test_a_stream_that_stalls_midway_times_out(server):
    start = time.monotonic()
    with pytest.raises(VideoTimeout):
        load_frames(server.base + "/clip.mp4?stall", VideoOptions(num_frames=N, **QUICK), policy=LOOPBACK)
    assert time.monotonic() - start < 3.0
    assert isinstance(VideoTimeout("x"), TimeoutError)


def test_an_endless_stream_is_bounded_by_time_and_bytes(server):
    url = server.base + "/endless"
    with pytest.raises(VideoUnsupported, match="end_s"):
        load_frames(url, VideoOptions(**QUICK), policy=LOOPBACK)  # no length: say how much to read
    start = time.monotonic()
    with pytest.raises(VideoTimeout, match="timeout_s"):  # the clip repeats: time never reaches end_s
        load_frames(url, VideoOptions(end_s=1000.0, timeout_s=1.0, max_duration_s=1e6, **QUICK), policy=LOOPBACK)
    assert time.monotonic() - start < 3.0
    with pytest.raises(VideoTooLarge, match="max_bytes"):
        load_frames(url, VideoOptions(end_s=1000.0, max_bytes=500_000, **QUICK), policy=LOOPBACK)


# ---------------------------------------------------------------- live streams


def _chunks(data: bytes, count: int, seed: int = 0) -> list[bytes]:
    """`data` cut at random places (not TS packet boundaries)."""
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, len(data)), count - 1, replace=False))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


def test_live_source_samples_up_to_now_and_the_last_seconds(ts_clip):
    _, data, full = ts_clip
    live = LiveSource(retention_s=60.0)
    with pytest.raises(NoFrames, match="no complete frame"):
        load_frames(live)
    chunks = _chunks(data, 60)
    for chunk in chunks[:30]:
        live.append(chunk)
    now = live.now_s
    assert 5.0 < now < 25.0
    recent = load_frames(live, VideoOptions(fps=FPS, last_s=2.0))
    assert len(recent) == 16 and now - 2.0 <= recent.timestamps[0] and recent.timestamps[-1] < now
    _same(recent, full)
    everything = load_frames(live, VideoOptions(fps=4.0))  # up to now, from the start
    assert everything.timestamps[0] < 0.25 and everything.timestamps[-1] < now
    _same(everything, full)
    for chunk in chunks[30:]:
        live.append(chunk)
    live.close()  # the newest frame counts once the stream has ended
    assert live.now_s == pytest.approx(240 / FPS, abs=1e-3)
    _same(load_frames(live, VideoOptions(num_frames=240)), full)
    with pytest.raises(InvalidRequest, match="closed"):
        live.append(b"more")


def test_live_source_memory_is_bounded(ts_clip):
    _, data, full = ts_clip
    live = LiveSource(retention_s=5.0)
    sizes = []
    for chunk in _chunks(data, 120, seed=1):
        live.append(chunk)
        sizes.append(live.nbytes)
    # 5 s + one keyframe interval (1 s) of a 30 s stream, never the whole of it
    assert max(sizes) < len(data) * 7.5 / 30
    assert live.now_s - 6.0 <= live.first_s <= live.now_s - 5.0
    old = load_frames(live, VideoOptions(fps=FPS, start_s=0.0))  # what is gone is gone
    assert old.timestamps[0] >= live.first_s
    _same(old, full)
    tight = LiveSource(max_bytes=len(data) // 10)  # bytes bound the window too, cut at keyframes
    for chunk in _chunks(data, 50, seed=2):
        tight.append(chunk)
        assert tight.nbytes <= len(data) // 10 + 564  # + the stream tables
    _same(load_frames(tight, VideoOptions(fps=FPS)), full)
    with pytest.raises(VideoTooLarge, match="keyframe"):
        LiveSource(max_bytes=2000).append(data[:20_000])  # no keyframe leaves under 2000 bytes


def test_live_source_while_it_is_fed(ts_clip):
    _, data, full = ts_clip
    live = LiveSource(retention_s=10.0)
    chunks = _chunks(data, 40, seed=3)

    def feed():
        for chunk in chunks:
            live.append(chunk)
            time.sleep(0.005)

    producer = threading.Thread(target=feed)
    producer.start()
    ends = []
    while producer.is_alive() or not ends:
        if live.now_s > 1.0:
            frames = load_frames(live, VideoOptions(fps=FPS, last_s=1.0))
            _same(frames, full)
            ends.append(frames.timestamps[-1])
    producer.join()
    assert len(ends) >= 2 and ends == sorted(ends)


def test_live_source_refuses_what_is_not_ts_video(clip):
    live = LiveSource(probe_bytes=10_000)
    with pytest.raises(VideoUnreadable, match="MPEG-TS"):
        for start in range(0, 30_000, 5_000):
            live.append(np.random.default_rng(start).bytes(5_000))
    with pytest.raises(InvalidRequest):
        LiveSource(retention_s=0)


# ---------------------------------------------------------------- bad input


def _avi_raw(width: int, height: int, claimed: tuple[int, int] | None = None) -> bytes:
    """A raw-RGB AVI whose headers may claim another frame size than its frames hold."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="avi") as container:
        stream = container.add_stream("rawvideo", rate=4)
        stream.width, stream.height, stream.pix_fmt = width, height, "rgb24"
        for index in range(4):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 40 * index, np.uint8), format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    data = bytearray(buffer.getvalue())
    if claimed is not None:
        w, h = claimed
        info = data.index(b"strf") + 12  # BITMAPINFOHEADER: biSize, then biWidth, biHeight
        data[info:info + 8] = struct.pack("<ii", w, -h)
        main = data.index(b"avih") + 8 + 32  # MainAVIHeader: dwWidth, dwHeight
        data[main:main + 8] = struct.pack("<II", w, h)
    return bytes(data)


def _pts_jump_mkv() -> bytes:
    """Four frames, the last one ten hours in: a huge declared duration."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=8)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = Fraction(1, 8)
        for pts in (0, 1, 2, 8 * 3600 * 10):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            frame.pts = pts
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def test_absurd_dimensions_are_refused_before_decoding():
    assert len(load_frames(_avi_raw(16, 16))) == 4
    # Probing already applies the bound, so FFmpeg never allocates such a frame; a raw
    # stream's header then gives no size, and decoding fails with a message naming the bound.
    # (Coded streams keep their parsed size: VideoTooLarge "WxH", see test_video.test_bounds.)
    for claimed, bound in (((9000, 9000), 8192 * 8192), ((60000, 60000), 8192 * 8192), ((2000, 2000), 10**6)):
        start = time.monotonic()
        with pytest.raises(VideoUnreadable, match="max_frame_pixels"):
            load_frames(_avi_raw(16, 16, claimed=claimed), VideoOptions(max_frame_pixels=bound))
        assert time.monotonic() - start < 1.0
    assert len(load_frames(_avi_raw(16, 16, claimed=(16, 16)))) == 4  # the patching itself is harmless
    with pytest.raises(VideoUnsupported, match="aspect ratio"):
        load_frames(_avi_raw(4020, 16))  # 251:1


def test_huge_declared_duration_and_zero_frames(ts_clip):
    with pytest.raises(VideoTooLarge, match="36000"):
        load_frames(_pts_jump_mkv())
    tables_only = ts_clip[1][:564]  # PAT, PMT, SDT: a video stream with no packet
    with pytest.raises(NoFrames):
        load_frames(tables_only)
