"""Upload memory: the peak resident memory of an embedded server (`sparrow serve`, its own
process) while several large uploads arrive at once.

Each upload is a valid video (a small mp4 followed by a top-level 'free' box of random
bytes up to the size asked), sent in chunks as SparrowClient sends them, so every upload is
received, probed and stored. The server's RSS is sampled from /proc every 5 ms; its
VmHWM gives the peak over its life.

    python -m benchmarks.upload_memory [--uploads 4] [--mib 384] [--chunk-mib 8] [--random]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20


def padded_video(video: bytes, size: int) -> bytes:
    """`video` (an mp4) and a top-level 'free' box of random bytes: a valid video of `size` bytes."""
    pad = size - len(video)
    return video + struct.pack(">I4s", pad, b"free") + os.urandom(pad - 8)


def proc_status(pid: int, field: str) -> int:
    """A VmRSS / VmHWM line of /proc/<pid>/status, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


class RssSampler:
    """The peak VmRSS of a process over a block, sampled every `every_s`."""

    def __init__(self, pid: int, every_s: float = 0.005):
        self.pid, self.every_s = pid, every_s
        self.start = self.peak = proc_status(pid, "VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, proc_status(self.pid, "VmRSS"))

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Server:
    process: subprocess.Popen
    address: str
    upload_dir: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_server(upload_dir: Path, *extra: str, target: str = "tiny:qwen2_5_vl", timeout_s: float = 120.0) -> Server:
    """`sparrow serve` (embedded, no draft) in its own process on a free loopback port."""
    from sparrow.services.client import SparrowClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    process = subprocess.Popen(
        [sys.executable, "-m", "sparrow.cli", "serve", "--target", target, "--draft", "none",
         "--host", "127.0.0.1", "--port", str(port), "--upload-dir", str(upload_dir), "--log-level", "WARNING",
         *extra], env=env, stdout=subprocess.DEVNULL)
    address, end = f"127.0.0.1:{port}", time.monotonic() + timeout_s
    with SparrowClient(address) as client:
        while True:
            try:
                if client.health(timeout=1.0) == "SERVING":
                    return Server(process, address, upload_dir)
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if process.poll() is not None or time.monotonic() > end:
                process.kill()
                raise RuntimeError(f"sparrow serve did not come up (exit code {process.poll()})")
            time.sleep(0.2)


def upload(address: str, data: bytes, chunk: int) -> tuple[str, float]:
    """(status name, seconds) of one upload sent in chunks, its SHA-256 on the first."""
    import grpc

    from sparrow.services.client import SparrowClient
    from sparrow.services.protos import pb

    digest = hashlib.sha256(data).hexdigest()

    def messages():
        view = memoryview(data)
        for i in range(0, len(data), chunk):
            yield pb.VideoChunk(data=bytes(view[i:i + chunk]), sha256=digest if i == 0 else "")

    start = time.perf_counter()
    with SparrowClient(address, max_message_bytes=2 * chunk) as client:
        try:
            client.stub.UploadVideo(messages(), timeout=600)
            status = "OK"
        except grpc.RpcError as exc:
            status = exc.code().name
    return status, time.perf_counter() - start


def measure(server: Server, videos: list[bytes], chunk: int) -> dict:
    """Send `videos` at once; the server's RSS before, at its peak and after, and the outcomes."""
    pid = server.process.pid
    with RssSampler(pid) as rss, ThreadPoolExecutor(len(videos)) as pool:
        start = time.perf_counter()
        outcomes = list(pool.map(lambda v: upload(server.address, v, chunk), videos))
        wall = time.perf_counter() - start
    time.sleep(0.5)
    return {"before": rss.start, "peak": rss.peak, "after": proc_status(pid, "VmRSS"), "hwm": proc_status(pid, "VmHWM"),
            "statuses": [s for s, _ in outcomes], "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--uploads", type=int, default=4, help="uploads sent at once (default 4)")
    p.add_argument("--mib", type=int, default=384, help="size of each upload, MiB (default 384)")
    p.add_argument("--chunk-mib", type=int, default=8, help="chunk size, MiB (default 8, SparrowClient's)")
    p.add_argument("--random", action="store_true", help="random bytes instead of valid videos (refused by the probe)")
    args = p.parse_args(argv)

    from sparrow.video import write_synthetic_video

    clip = write_synthetic_video(None, num_frames=8, width=56, height=56, fps=4.0, seed=1).data
    size = args.mib * MiB
    with tempfile.TemporaryDirectory(prefix="sparrow-bench-uploads-") as tmp:
        server = start_server(Path(tmp), "--max-uploads", str(args.uploads),
                              "--max-video-mb", str(max(2048, args.mib)),
                              "--max-upload-mb-in-flight", str(args.uploads * args.mib + 1),
                              "--max-message-mb", str(2 * args.chunk_mib))
        try:
            # A small upload first: what every server pays once (the probe's decoder, threads).
            measure(server, [padded_video(clip, 4 * MiB)], args.chunk_mib * MiB)
            videos = [os.urandom(size) if args.random else padded_video(clip, size) for _ in range(args.uploads)]
            result = measure(server, videos, args.chunk_mib * MiB)
        finally:
            server.stop()
    kind = "random-byte" if args.random else "video"
    print(f"{args.uploads} concurrent {args.mib} MiB {kind} uploads in {args.chunk_mib} MiB chunks "
          f"({result['wall_s']:.1f} s): {', '.join(result['statuses'])}")
    print(f"server RSS: {result['before'] / MiB:.0f} MiB before, {result['peak'] / MiB:.0f} MiB peak "
          f"(+{(result['peak'] - result['before']) / MiB:.0f} MiB), {result['after'] / MiB:.0f} MiB after; "
          f"VmHWM {result['hwm'] / MiB:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
