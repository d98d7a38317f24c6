"""A minimal RTSP relay for tests: a publisher (ffmpeg `-f rtsp`, RTP interleaved over TCP)
announces a stream; players (FFmpeg's RTSP client, as the server's URL reader) describe it,
set it up over TCP and play it. The relay hands every interleaved RTP/RTCP frame of the
publisher to each player and ends their connections when the publisher stops: a camera that
ends its stream.

FFmpeg can publish to an RTSP server but cannot be one for players, hence this relay. The
publisher's RECORD is answered only once a player is playing, so the player sees the stream
from its first packet (the publisher's first seconds arrive as a burst, paced by the reader's
own timestamps). One stream, one path; enough for loopback tests, not a media server.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from pathlib import Path


class RtspRelay:
    def __init__(self, host: str = "127.0.0.1"):
        self._server = socket.create_server((host, 0))
        self.port = self._server.getsockname()[1]
        self.url = f"rtsp://{host}:{self.port}/cam"
        self._sdp: bytes | None = None
        self._announced = threading.Event()
        self._playing = threading.Event()
        self._players: list[socket.socket] = []
        self._send_locks: dict[socket.socket, threading.Lock] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._spawn(self._accept)

    def publish(self, path: Path, fps: int = 4) -> subprocess.Popen:
        """ffmpeg plays `path` at real time into the relay (re-encoded to MPEG-4 with a
        keyframe every second, so its SDP carries the decoder config)."""
        ffmpeg = shutil.which("ffmpeg")
        return subprocess.Popen(
            [ffmpeg, "-hide_banner", "-loglevel", "error", "-re", "-i", str(path), "-an", "-c:v", "mpeg4",
             "-g", str(fps), "-bf", "0", "-f", "rtsp", "-rtsp_transport", "tcp", self.url],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def close(self) -> None:
        self._closed = True
        self._server.close()
        with self._lock:
            for player in self._players:
                _close(player)
            self._players.clear()
        self._playing.set()
        self._announced.set()

    def __enter__(self) -> "RtspRelay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- connections ----------------------------------------------------------------------------
    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        publisher = False
        try:
            while True:
                first = reader.read(1)
                if not first:
                    return
                if first == b"$":                           # an interleaved frame: channel, length, payload
                    head = reader.read(3)
                    payload = reader.read(int.from_bytes(head[1:3], "big"))
                    if publisher:
                        self._forward(first + head + payload)
                    continue
                method, headers, body = _request(first + reader.readline(), reader)
                publisher = publisher or method in ("ANNOUNCE", "RECORD")
                reply = self._answer(method, headers, body)
                if method == "RECORD":
                    self._playing.wait(30)                   # the player sees the stream from its start
                with self._sending(conn):
                    conn.sendall(reply)
                if method == "PLAY":
                    self._add_player(conn)
                if method == "TEARDOWN":
                    return
        except OSError:
            return
        finally:
            if publisher:                                    # the camera stopped: its players' streams end
                with self._lock:
                    for player in self._players:
                        _close(player)
                    self._players.clear()
            _close(conn)

    def _answer(self, method: str, headers: dict[str, str], body: bytes) -> bytes:
        cseq = headers.get("cseq", "0")
        extra: dict[str, str] = {"Session": "1"} if method not in ("OPTIONS", "ANNOUNCE", "DESCRIBE") else {}
        payload = b""
        if method == "OPTIONS":
            extra["Public"] = "OPTIONS, DESCRIBE, ANNOUNCE, SETUP, PLAY, RECORD, TEARDOWN, GET_PARAMETER"
        elif method == "ANNOUNCE":
            self._sdp = body
            self._announced.set()
        elif method == "DESCRIBE":
            if not self._announced.wait(30) or self._sdp is None:
                return _reply(cseq, 404, "Not Found")
            extra.update({"Content-Type": "application/sdp", "Content-Base": self.url + "/"})
            payload = self._sdp
        elif method == "SETUP":
            transport = headers.get("transport", "")
            if "TCP" not in transport.upper():
                return _reply(cseq, 461, "Unsupported Transport")
            extra["Transport"] = transport
        return _reply(cseq, 200, "OK", extra, payload)

    def _sending(self, conn: socket.socket) -> threading.Lock:
        """One writer at a time per connection (a player's replies and the frames relayed to it)."""
        with self._lock:
            return self._send_locks.setdefault(conn, threading.Lock())

    def _forward(self, frame: bytes) -> None:
        with self._lock:
            players = list(self._players)
        for player in players:
            try:
                with self._sending(player):
                    player.sendall(frame)
            except OSError:
                with self._lock:
                    if player in self._players:
                        self._players.remove(player)

    def _add_player(self, conn: socket.socket) -> None:
        with self._lock:
            self._players.append(conn)
        self._playing.set()


def _request(line: bytes, reader) -> tuple[str, dict[str, str], bytes]:
    method = line.decode("latin-1").split(" ", 1)[0].strip()
    headers: dict[str, str] = {}
    while (raw := reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = raw.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = reader.read(int(headers.get("content-length", "0") or 0))
    return method, headers, body


def _reply(cseq: str, code: int, reason: str, headers: dict[str, str] | None = None, body: bytes = b"") -> bytes:
    lines = [f"RTSP/1.0 {code} {reason}", f"CSeq: {cseq}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()
