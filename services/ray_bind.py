"""Where a Ray cluster started by `sparrow serve --ray` listens, and who may drive it.

A local cluster (no --ray-address) is started for --host, never joined: every server of it
listens on that address. Ray binds its own servers (GCS, raylets, object manager, core
workers, dashboard agent, metrics export, runtime-env agent, autoscaler monitor) to the
node's IP, and a node at 127.0.0.1 on loopback alone; but on Linux Ray resolves a loopback
`_node_ip_address` to the host's outward address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
(the single-machine mode Ray uses on macOS), which `local_cluster` sets before Ray is
imported. The dashboard listens on loopback whatever the host.

Two Serve servers do not follow the node's IP in Ray Serve 2.60: the gRPC proxy binds every
interface (`[::]:port`, ray.serve._private.grpc_util.start_grpc_server) and each replica's
inter-deployment gRPC server too (`[::]:0`, ray.serve._private.replica). So the job's
runtime_env names `setup` as its worker_process_setup_hook: every worker of the job, Serve's
proxy and replica actors included (they inherit the job's runtime_env through the Serve
controller), runs it first; it makes the proxy bind the host in SPARROW_GRPC_HOST and the
replica's server bind the node's IP (where Serve's routers reach it).

This reaches into private Ray names, on purpose and in this one place: a Ray upgrade that
renames them makes `setup` fail loudly (AttributeError in the proxy's or replica's start),
never silently bind everywhere; tests/test_ray_bind.py checks every listening socket of the
cluster `sparrow serve --ray` starts.

Serve's proxies get 30 s, not Serve's 5, to answer their first readiness check
(`patient_proxies`): a proxy's process imports gRPC and the servicers, and on a busy node
(measured: the 2-core CI machine with another test process beside it) that took longer; the
controller then declared the proxy unhealthy and replaced it, and serve.start failed with
ActorDiedError.

Ray's token authentication is on unless RAY_AUTH_MODE says otherwise (`token_auth`): every
Ray RPC and the dashboard then need the token, written once, readable by its owner only.
Serve's gRPC and HTTP proxies do not ask for it (they serve sparrow.v1 to clients).

On Kubernetes (a RayService), none of this applies: pods listen on the pod's address and
KubeRay configures the cluster; see docs/deployment.md.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import sys
from pathlib import Path

GRPC_HOST_ENV = "SPARROW_GRPC_HOST"
SETUP_HOOK = "sparrow.services.ray_bind.setup"
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"    # "0": a loopback node IP stays loopback
AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


PROXY_READY_ENV, PROXY_READY_S = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30"


def patient_proxies() -> None:
    """Serve's proxies' first readiness check waits PROXY_READY_S (an operator's setting stands).
    Read by the Serve controller's process: call before the cluster's processes start (a local
    cluster's inherit the environment of the process that starts it)."""
    os.environ.setdefault(PROXY_READY_ENV, PROXY_READY_S)


def runtime_env(host: str, env_vars: dict[str, str] | None = None) -> dict:
    """The job runtime_env that makes Serve's gRPC proxy listen on `host` (and each
    replica's inter-deployment server on its node's IP)."""
    return {"env_vars": {**(env_vars or {}), GRPC_HOST_ENV: host}, "worker_process_setup_hook": SETUP_HOOK}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_every_interface(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")


def local_cluster(host: str) -> dict:
    """ray.init keyword arguments that start a NEW local cluster whose servers listen on
    `host` (0.0.0.0 or :: : Ray's default, the node's outward address), its proxies patient.
    Call before Ray is imported: it sets the environment Ray reads at import (and its processes
    inherit)."""
    patient_proxies()
    kwargs = {"address": "local", "dashboard_host": "127.0.0.1"}
    if is_every_interface(host):
        return kwargs
    if is_loopback(host):
        if "ray._private.ray_constants" in sys.modules and os.environ.get(LOOPBACK_ONLY_ENV) != "0":
            raise RuntimeError("ray_bind.local_cluster must run before Ray is imported (it reads "
                               f"{LOOPBACK_ONLY_ENV} at import)")
        os.environ[LOOPBACK_ONLY_ENV] = "0"
        return {**kwargs, "_node_ip_address": "127.0.0.1"}
    return {**kwargs, "_node_ip_address": socket.gethostbyname(host.strip("[]"))}


def token_auth() -> str:
    """Turn Ray's token authentication on unless RAY_AUTH_MODE is set, and make sure a token
    exists: RAY_AUTH_TOKEN, else the file at RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, created
    here (mode 0600) when missing. Returns the mode in force ("token", or the operator's)."""
    mode = os.environ.setdefault(AUTH_MODE_ENV, "token").lower()
    if mode != "token" or os.environ.get(TOKEN_ENV):
        return mode
    path = Path(os.environ.get(TOKEN_PATH_ENV) or Path.home() / ".ray" / "auth_token")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)      # never readable by others
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return mode


def setup() -> None:
    host = os.environ.get(GRPC_HOST_ENV)
    if not host:
        return
    _bind_proxy(host)
    _bind_replica_server()


def _bind_proxy(host: str) -> None:
    from ray.serve._private import default_impl      # read at call time by start_grpc_server

    original = default_impl.add_grpc_address
    if getattr(original, "sparrow_host", None) == host:
        return

    def add_grpc_address(grpc_server, server_address: str):
        port = server_address.rsplit(":", 1)[1]
        return original(grpc_server, f"{_bracketed(host)}:{port}")

    add_grpc_address.sparrow_host = host
    default_impl.add_grpc_address = add_grpc_address


def _bind_replica_server() -> None:
    """A replica's inter-deployment server on the node's IP: Serve's routers reach it there
    (RunningReplicaInfo carries the node's IP and this port)."""
    import ray
    from ray.serve._private import replica        # looks the helper up at call time (_on_initialized)

    original = replica.add_port_to_grpc_server
    if getattr(original, "sparrow_bound", False):
        return

    def add_port_to_grpc_server(server, address: str):
        host, port = address.rsplit(":", 1)
        if is_every_interface(host):
            address = f"{_bracketed(ray.util.get_node_ip_address())}:{port}"
        return original(server, address)

    add_port_to_grpc_server.sparrow_bound = True
    replica.add_port_to_grpc_server = add_port_to_grpc_server


def _bracketed(host: str) -> str:
    """IPv6 literals need brackets in a gRPC address ("[::1]:9000")."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
