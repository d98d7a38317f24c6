"""Requests off the wire: sparrow.v1.Sparrow registered so that a message gRPC cannot parse
(corrupt bytes, invalid UTF-8 in a string field) reaches the handler as `Undecodable`,
which answers INVALID_ARGUMENT, instead of failing inside gRPC's own deserialization (an
UNKNOWN/INTERNAL status with a Python exception name, and a traceback in the log).

Both hosts register through `add_sparrow_servicer`: the embedded grpc.aio server directly,
Ray Serve's gRPC proxy by naming it in `grpc_servicer_functions` (so this module stays
light: the proxy process imports it, and it must not pull in torch).
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from sparrow.services.grpc_status import UndecodableRequest, quiet_client_errors
from sparrow.services.protos import pb_grpc
from sparrow.services.ray_proxy import guarded_handlers


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel/server options bounding message sizes (set on both ends)."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


class Undecodable:
    """Stands in for a request message that could not be parsed; picklable, so it can cross
    from Serve's proxy to a replica."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def error(self) -> UndecodableRequest:
        return UndecodableRequest(f"the request message could not be decoded: {self.reason}")


def check_decoded(request):
    """The request, or UndecodableRequest for a message that could not be parsed."""
    if isinstance(request, Undecodable):
        raise request.error()
    return request


async def decoded_stream(requests):
    """A client stream's messages, raising UndecodableRequest at the first bad one."""
    async for request in requests:
        yield check_decoded(request)


def _tolerant(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as exc:
            return Undecodable(str(exc))
    return parse


class _Registrar:
    """Takes what the generated add_SparrowServicer_to_server registers, and registers it on
    the real server with tolerant request deserializers."""

    def __init__(self, server):
        self.server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass            # the same handlers come again through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        tolerant = {name: h._replace(request_deserializer=_tolerant(h.request_deserializer))
                    for name, h in handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, tolerant),))
        self.server.add_registered_method_handlers(service, tolerant)


def add_sparrow_servicer(servicer, server) -> None:
    """pb_grpc.add_SparrowServicer_to_server, with undecodable requests handed on as Undecodable."""
    registrar = _Registrar(server)
    pb_grpc.add_SparrowServicer_to_server(servicer, registrar)


def add_sparrow_servicer_to_serve_proxy(servicer, server) -> None:
    """For Serve's `grpc_servicer_functions`: add_sparrow_servicer, with the proxy's handlers
    guarded so that a call that ends frees its replica slot (services.ray_proxy), and, since
    Serve calls this in its proxy's process, that process's log then shows a caller's error
    as one INFO line instead of a traceback (services.errors.ClientErrorsAtInfo)."""
    quiet_client_errors("ray.serve")
    with guarded_handlers(server):
        add_sparrow_servicer(servicer, server)


__all__ = ["Undecodable", "add_sparrow_servicer", "add_sparrow_servicer_to_serve_proxy", "check_decoded", "decoded_stream"]
