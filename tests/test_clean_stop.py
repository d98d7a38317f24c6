"""A clean stop: `sparrow serve` exits within 5 s of SIGTERM (Kubernetes kills 30 s after it)
whatever it is doing: building its C++ kernels (an empty extension directory), compiling a target
step bucket (the default), prefilling a long video. A call running then ends CANCELLED or
UNAVAILABLE; it never hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from sparrow.video.synthetic import write_synthetic_video

STOP_WITHIN_S = 5.0


def _serve(tmp_path, *extra: str) -> tuple[subprocess.Popen, str, list[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    proc = subprocess.Popen([sys.executable, "-m", "sparrow.cli", "serve", "--port", "0",
                             "--target", "tiny:qwen2_5_vl", "--draft", "tiny", "--log-format", "text",
                             "--log-level", "INFO", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    while not (lines and "serving sparrow.v1.Sparrow on" in lines[-1]):
        line = proc.stdout.readline()
        assert line, "server exited: " + "".join(lines)
        lines.append(line)
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()   # keep the pipe drained
    return proc, lines[-1].split(" on ")[1].split(" ")[0], lines


def _stop(proc: subprocess.Popen, lines: list[str]) -> float:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail("still running 30 s after SIGTERM:\n" + "".join(lines[-30:]))
    return time.monotonic() - t0


def test_sigterm_during_a_kernel_build_a_step_compile_and_a_long_prefill(tmp_path):
    from sparrow.services.client import SparrowClient
    from sparrow.services.protos import pb
    proc, address, lines = _serve(tmp_path)
    try:
        assert any("building CPU prefix attention kernel" in line for line in lines), "".join(lines)
        short = write_synthetic_video(None, num_frames=4, width=56, height=56, fps=4, seed=3).data
        long = write_synthetic_video(None, num_frames=300, width=336, height=336, fps=8, seed=4).data
        with SparrowClient(address) as client:     # a first answer: its steps start bucket compiles
            client.generate("describe the video .", data=short, max_new_tokens=8,
                            video_options=pb.VideoOptions(num_frames=4))
        ended: list[BaseException | None] = []

        def ask_long():                             # ~25k visual tokens: decoded, then a long prefill
            try:
                with SparrowClient(address) as c:
                    c.generate("describe the video .", data=long, max_new_tokens=64,
                               video_options=pb.VideoOptions(num_frames=300))
                ended.append(None)
            except BaseException as exc:  # noqa: BLE001 - what the call ended with is the point
                ended.append(exc)
        asker = threading.Thread(target=ask_long)
        asker.start()
        time.sleep(2.0)                             # well inside its preparation or prefill
        took = _stop(proc, lines)
        asker.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < STOP_WITHIN_S, f"exited {took:.1f} s after SIGTERM:\n" + "".join(lines[-30:])
    assert proc.returncode == 0, "".join(lines[-30:])
    assert not asker.is_alive(), "the running call hung past the server's exit"
    assert ended and isinstance(ended[0], grpc.RpcError), f"the long call was not cut: {ended}"
    assert ended[0].code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), repr(ended[0])
