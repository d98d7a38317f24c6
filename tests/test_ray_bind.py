"""`sparrow serve --ray --host 127.0.0.1`: the Ray cluster it starts listens on loopback only,
and drives only for holders of its token.

The real CLI in a subprocess (tiny random models); every process it started (the process
tree: GCS, raylet, agents, dashboard, monitor, Serve controller, proxy, replicas, idle
workers) is walked and each socket it holds is looked up in /proc/net/{tcp,tcp6,udp,udp6}.
Ray's token authentication is on by default: the GCS refuses a call without the token
(UNAUTHENTICATED) and answers one with it; the token file was written for its owner only.
Without the CLI: the token is kept once written and RAY_AUTH_MODE set by the operator stands;
the ray.init arguments each kind of host gets. SIGTERM (what Kubernetes sends) stops the server
cleanly: exit 0, and no process of the cluster it started left running.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from conftest_services import free_port



def process_tree(root: int) -> dict[int, str]:
    """pid -> command line of `root` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue                                   # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        todo += children.get(pid, [])
    return found


def bound_sockets() -> dict[int, tuple[str, str, int]]:
    """Socket inode -> (table, local address, port): TCP sockets listening, UDP sockets bound."""
    found = {}
    for table, width in (("tcp", 8), ("tcp6", 32), ("udp", 8), ("udp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if table.startswith("tcp") and fields[3] != "0A":          # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))   # each 32-bit word little-endian
            ip = ipaddress.ip_address(words)
            ip = getattr(ip, "ipv4_mapped", None) or ip                 # ::ffff:127.0.0.1 is 127.0.0.1
            found[int(fields[9])] = (table, str(ip), int(hex_port, 16))
    return found


def listeners(root: int) -> list[tuple[int, str, str, int]]:
    """(pid, command, address, port) of every bound socket a process of the tree holds."""
    sockets, held = bound_sockets(), []
    for pid, command in process_tree(root).items():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in sockets:
                _, address, port = sockets[int(link[8:-1])]
                held.append((pid, command, address, port))
    return held


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`sparrow serve --ray --host 127.0.0.1` with the environment's RAY_AUTH_MODE unset."""
    tmp = tmp_path_factory.mktemp("ray-bind")
    port, http_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    # An empty extension directory: the replica's C++ kernels are still building when SIGTERM comes
    # (at nice 19: the builds, killed by that SIGTERM, leave the CPU to the tests beside them).
    env.update(RAY_AUTH_TOKEN_PATH=str(tmp / "token"), OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(tmp / "ext"),
               SPARROW_BUILD_NICE="19")
    cli = subprocess.Popen([sys.executable, "-m", "sparrow.cli", "serve", "--ray", "--host", "127.0.0.1",
                            "--port", str(port), "--http-port", str(http_port), "--target", "tiny:qwen2_5_vl",
                            "--draft", "tiny", "--log-format", "text"],
                           env=env, stdout=subprocess.PIPE, stderr=(tmp / "stderr").open("w"), text=True, cwd=tmp)
    lines = []
    try:
        for line in cli.stdout:
            lines.append(line)
            if line.startswith("sparrow: serving"):
                break
        assert lines and lines[-1].startswith("sparrow: serving"), "".join(lines) + (tmp / "stderr").read_text()[-3000:]
        yield cli, port, http_port, tmp / "token", lines
    finally:
        pids = process_tree(cli.pid)
        cli.send_signal(signal.SIGTERM)         # as Kubernetes stops a pod: Serve shuts down, then the cluster
        sent = time.monotonic()
        try:
            cli.wait(60)
        except subprocess.TimeoutExpired:
            cli.kill()
        stopped_s = time.monotonic() - sent
        deadline = time.monotonic() + 20
        while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:                        # whatever outlived it, of the processes it started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert cli.returncode == 0 and not left, \
            f"SIGTERM: exit {cli.returncode}, still running: {[pids[p][:80] for p in left]}"
        assert stopped_s < 5.0, f"SIGTERM: exited after {stopped_s:.1f} s (Kubernetes' SIGKILL comes at 30 s)"
        for thread, ended in IN_FLIGHT:              # calls running at the stop end, never hang
            thread.join(30)
            assert not thread.is_alive(), "a call running at the stop hung past the server's exit"
            assert ended and isinstance(ended[0], grpc.RpcError) and ended[0].code() in (
                grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), repr(ended)


# Calls a test leaves running for the stop at the module's end (the `served` fixture checks them).
IN_FLIGHT: list = []


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_the_cluster_sparrow_serve_starts_listens_on_loopback_only(served):
    cli, port, http_port, _, lines = served
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:       # it serves (and the app is deployed)
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
    held = listeners(cli.pid)
    commands = " ".join(command for _, command, _, _ in held)
    # The walk sees the whole cluster: its core servers, Serve's proxy and the replica.
    for process in ("gcs_server", "raylet", "DashboardAgent", "ProxyActor", "ServeController", "TargetDeployment"):
        assert process in commands, f"no socket of {process} found: {held}"
    assert {port, http_port} <= {p for _, _, _, p in held}
    exposed = [(pid, command[:60], address, p) for pid, command, address, p in held
               if not ipaddress.ip_address(address).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert any("token authentication on" in line for line in lines), lines
    # The Serve controller, which times its proxies' readiness checks, got the patient setting.
    from sparrow.services import ray_bind

    (controller,) = {pid for pid, command, _, _ in held if "ServeController" in command}
    environ = Path(f"/proc/{controller}/environ").read_bytes().split(b"\0")
    assert f"{ray_bind.PROXY_READY_ENV}={ray_bind.PROXY_READY_S}".encode() in environ


@pytest.mark.slow
def test_ray_token_authentication_is_on_by_default(served):
    cli, _, _, token_path, _ = served
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    token = token_path.read_text().strip()
    gcs = [(address, p) for pid, command, address, p in listeners(cli.pid) if "gcs_server" in command]
    call = "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo"        # an empty request: every node
    answered = 0
    for address, p in gcs:
        with grpc.insecure_channel(f"{address}:{p}") as channel:
            rpc = channel.unary_unary(call, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as refused:
                rpc(b"", timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()
            try:
                rpc(b"", timeout=10, metadata=(("authorization", f"Bearer {token}"),))
                answered += 1
            except grpc.RpcError as exc:          # a GCS port that serves other services only
                assert exc.code() == grpc.StatusCode.UNIMPLEMENTED, exc.details()
    assert answered, f"no GCS port answered the token holder: {gcs}"


def test_token_auth_writes_a_token_for_its_owner_only_and_keeps_the_operators(tmp_path, monkeypatch):
    from sparrow.services import ray_bind

    path = tmp_path / "dir" / "token"
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    assert ray_bind.token_auth() == "token" and os.environ["RAY_AUTH_MODE"] == "token"
    token = path.read_text()
    assert len(token) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ray_bind.token_auth() == "token" and path.read_text() == token          # an existing token is kept
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    path.unlink()
    assert ray_bind.token_auth() == "disabled" and not path.exists()                # the operator's word stands


def test_local_cluster_arguments_by_host(monkeypatch):
    from sparrow.services import ray_bind

    monkeypatch.setenv(ray_bind.LOOPBACK_ONLY_ENV, "0")            # as if set before Ray was imported
    assert ray_bind.local_cluster("127.0.0.1") == {"address": "local", "dashboard_host": "127.0.0.1",
                                                   "_node_ip_address": "127.0.0.1"}
    assert ray_bind.local_cluster("::1")["_node_ip_address"] == "127.0.0.1"
    assert ray_bind.local_cluster("10.1.2.3")["_node_ip_address"] == "10.1.2.3"
    assert "_node_ip_address" not in ray_bind.local_cluster("0.0.0.0")             # Ray's default: its own choice
    assert all(ray_bind.local_cluster(h)["dashboard_host"] == "127.0.0.1" for h in ("0.0.0.0", "10.1.2.3"))


def test_a_long_request_is_running_when_the_server_stops(served):
    """Last in the module: a ~25k-visual-token request still decoding or prefilling when the
    fixture sends SIGTERM; the server still stops within 5 s, and the call ends UNAVAILABLE or
    CANCELLED (checked at the fixture's teardown)."""
    import threading

    from sparrow.services.client import SparrowClient
    from sparrow.services.protos import pb
    from sparrow.video.synthetic import write_synthetic_video

    _, port, _, _, _ = served
    long = write_synthetic_video(None, num_frames=300, width=336, height=336, fps=8, seed=4).data
    ended: list = []

    def ask():
        try:
            with SparrowClient(f"127.0.0.1:{port}") as client:
                client.generate("describe the video .", data=long, max_new_tokens=64,
                                video_options=pb.VideoOptions(num_frames=300))
            ended.append(None)
        except BaseException as exc:  # noqa: BLE001 - what the call ended with is the point
            ended.append(exc)
    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    IN_FLIGHT.append((thread, ended))
    time.sleep(2.0)
    assert not ended, f"the long request ended before the stop: {ended}"


def test_a_local_cluster_gives_serves_proxies_time_to_start_and_keeps_the_operators(monkeypatch):
    from sparrow.services import ray_bind

    monkeypatch.delenv(ray_bind.PROXY_READY_ENV, raising=False)
    monkeypatch.setenv(ray_bind.LOOPBACK_ONLY_ENV, "0")
    ray_bind.local_cluster("127.0.0.1")
    assert float(os.environ[ray_bind.PROXY_READY_ENV]) >= 30          # Serve's own default is 5 s
    monkeypatch.setenv(ray_bind.PROXY_READY_ENV, "12")
    ray_bind.local_cluster("0.0.0.0")
    assert os.environ[ray_bind.PROXY_READY_ENV] == "12"
