"""Fixtures for the serving tests: a real redis-server on a free loopback port, tiny models
saved to disk (loaded back with the real from_pretrained path), a real Ray instance.

Loaded from tests/conftest.py through `pytest_plugins`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    port: int
    pidfile: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def restart(self) -> None:
        """Start again on the same port (after stop)."""
        start_redis(self.pidfile.parent, self.port)

    def stop(self) -> None:
        """Kill the server this fixture started (by its pid), and wait until it is gone."""
        try:
            pid = int(self.pidfile.read_text())
        except (OSError, ValueError):
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.02)


def start_redis(directory: Path, port: int | None = None) -> RedisServer:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install -y redis-server)")
    port = port or free_port()
    pidfile = directory / "redis.pid"
    subprocess.run([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--daemonize", "yes", "--pidfile", str(pidfile), "--dir", str(directory),
                    "--logfile", str(directory / "redis.log")], check=True, timeout=10)
    server = RedisServer(port, pidfile)
    client = server.client()
    for _ in range(100):                         # ready within ~2 s, or fail loudly
        try:
            if client.ping() and pidfile.exists():
                return server
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(0.02)
    raise RuntimeError(f"redis-server did not start on port {port}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The session server, emptied for each test."""
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path):
    """A server of this test's own, that it may stop."""
    server = start_redis(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """A tiny Qwen2.5-VL target and a Sparrow draft for it, saved as real model directories."""
    from sparrow.tiny import tiny_draft, tiny_target

    root = tmp_path_factory.mktemp("models")
    target = tiny_target("qwen2_5_vl", seed=0)
    target.save_pretrained(root / "target")
    tiny_draft(target, seed=0).save_pretrained(root / "draft")
    return root / "target", root / "draft"


@pytest.fixture(scope="session")
def ray_metrics_port() -> int:
    """Where the session Ray node's metrics agent exports (Prometheus text)."""
    return free_port()


@pytest.fixture(scope="session")
def ray_instance(ray_metrics_port):
    """One real Ray instance (2 CPUs) for the whole session. Its metrics agent exports on
    ray_metrics_port every 0.5 s rather than every 10 s (the Ray sink's test reads it)."""
    from sparrow.services import ray_bind

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_metrics_report_interval_ms"] = "500"
    ray_bind.patient_proxies()          # as `sparrow serve --ray` starts its cluster
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _metrics_export_port=ray_metrics_port)
    yield ray
    from ray import serve
    serve.shutdown()
    ray.shutdown()


SPEC_KWARGS = dict(num_draft_tokens=4, window=8, anchors=16, adaptive_k=False)   # fixed k: the tests exercise drafting


@dataclass
class Clips:
    """Small synthetic mp4 videos, as bytes and as files under a media root."""

    root: Path
    data: dict[str, bytes]

    def path(self, name: str) -> Path:
        return self.root / f"{name}.mp4"


@pytest.fixture(scope="session")
def clips(tmp_path_factory) -> Clips:
    from sparrow.video import write_synthetic_video

    root = tmp_path_factory.mktemp("media")
    data = {}
    for name, (frames, seed) in {"a": (8, 1), "b": (6, 2), "c": (8, 3), "d": (8, 4), "e": (8, 5)}.items():
        data[name] = write_synthetic_video(None, num_frames=frames, width=56, height=56, fps=4.0, seed=seed).data
        (root / f"{name}.mp4").write_bytes(data[name])
    return Clips(root, data)


@pytest.fixture(scope="session")
def reference_engine(tiny_model_dirs):
    """engine.generate as the golden reference: the same saved models, loaded the same way,
    with no prefix cache and the draft in process."""
    return _reference(tiny_model_dirs, {})


@pytest.fixture(scope="session")
def remote_reference_engine(tiny_model_dirs):
    """The golden reference for a service whose draft is remote: the spec that placement runs
    (its draft draws from a cut q: services.settings.REMOTE_DRAFT_CUT), the draft in process."""
    from sparrow.services.settings import REMOTE_DRAFT_CUT

    return _reference(tiny_model_dirs, REMOTE_DRAFT_CUT)


def _reference(tiny_model_dirs, extra: dict):
    from sparrow import Engine, SpecConfig
    from sparrow.services.models import load_draft, load_target

    spec = SpecConfig(**SPEC_KWARGS, **extra)
    target = load_target(str(tiny_model_dirs[0]))
    return Engine(target, load_draft(str(tiny_model_dirs[1]), target), spec)
