"""Where Ray Serve's gRPC proxy listens.

Ray Serve 2.60 binds its gRPC proxy to every interface (`[::]:port`, in
ray.serve._private.grpc_util.start_grpc_server) and has no option for the address. For a
local `sparrow serve --ray --host 127.0.0.1`, listening on every interface would expose
the service to the network against the user's word. So the job's runtime_env names
`setup` as its worker_process_setup_hook: every worker of the job, Serve's proxy actor
included (it inherits the job's runtime_env through the Serve controller), runs it first,
and it makes the proxy bind the host in SPARROW_GRPC_HOST instead.

This reaches into a private Ray function, on purpose and in this one place: a Ray upgrade
that renames it makes `setup` fail loudly (AttributeError in the proxy's start), never
silently bind everywhere; tests/test_ray_bind.py checks the listening address.

On Kubernetes (a RayService), none of this applies: the proxy must listen on the pod's
address, so it keeps Serve's all-interfaces bind; see docs/deploy.md.
"""

from __future__ import annotations

import os

GRPC_HOST_ENV = "SPARROW_GRPC_HOST"
SETUP_HOOK = "sparrow.services.ray_bind.setup"


def runtime_env(host: str, env_vars: dict[str, str] | None = None) -> dict:
    """The job runtime_env that makes Serve's gRPC proxy listen on `host`."""
    return {"env_vars": {**(env_vars or {}), GRPC_HOST_ENV: host}, "worker_process_setup_hook": SETUP_HOOK}


def setup() -> None:
    host = os.environ.get(GRPC_HOST_ENV)
    if not host:
        return
    from ray.serve._private import default_impl      # read at call time by start_grpc_server

    original = default_impl.add_grpc_address
    if getattr(original, "sparrow_host", None) == host:
        return

    def add_grpc_address(grpc_server, server_address: str):
        port = server_address.rsplit(":", 1)[1]
        return original(grpc_server, f"{_bracketed(host)}:{port}")

    add_grpc_address.sparrow_host = host
    default_impl.add_grpc_address = add_grpc_address


def _bracketed(host: str) -> str:
    """IPv6 literals need brackets in a gRPC address ("[::1]:9000")."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
