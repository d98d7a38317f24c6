"""`sparrow serve --ray --host H`: Serve's gRPC proxy listens on H only (Ray Serve itself
binds every interface). A real Ray started in a subprocess with the runtime_env the CLI
uses; the listening sockets are read from /proc/net."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
from conftest_services import free_port

pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent("""
    import sys
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions, HTTPOptions
    from sparrow.services import ray_bind
    from sparrow.services.ray_app import SERVICER_FUNCTIONS

    port, http_port = int(sys.argv[1]), int(sys.argv[2])
    ray.init(num_cpus=1, include_dashboard=False, runtime_env=ray_bind.runtime_env("127.0.0.1"))
    serve.start(grpc_options=gRPCOptions(port=port, grpc_servicer_functions=SERVICER_FUNCTIONS),
                http_options=HTTPOptions(host="127.0.0.1", port=http_port))
    print("READY", flush=True)
    sys.stdin.read()                   # until the test closes it
    serve.shutdown()
    ray.shutdown()
""")


def listening(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on `port` (IPv4 and IPv6)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:        # 0A: LISTEN
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word little-endian
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))
                ip = ipaddress.ip_address(words)
                found.add(str(getattr(ip, "ipv4_mapped", None) or ip))    # ::ffff:127.0.0.1 is 127.0.0.1
    return found


def test_serve_grpc_proxy_binds_the_host_it_is_told(tmp_path):
    port, http_port = free_port(), free_port()
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(port), str(http_port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        assert driver.stdout.readline().strip() == "READY"
        deadline = time.monotonic() + 30
        while not listening(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert listening(port) == {"127.0.0.1"}                   # not 0.0.0.0, not ::
        # The proxy serves (its servicer functions, services.wire's included, loaded): with
        # no app deployed it routes a request, even an undecodable one, to NOT_FOUND.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/sparrow.v1.Sparrow/Generate", request_serializer=None)
            with pytest.raises(grpc.RpcError) as info:
                list(call(b"\x0a\xff\xff\xff\xff\x0f", timeout=20))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
    finally:
        driver.stdin.close()
        try:
            driver.wait(60)
        except subprocess.TimeoutExpired:
            driver.kill()
