"""The generated gRPC stubs (package sparrow.v1), in one place.

They are generated from proto/ at install or build time (`python -m sparrow.services.protogen`,
run by `make setup`), never committed or edited.
"""

try:
    from sparrow.v1 import sparrow_pb2 as pb
    from sparrow.v1 import sparrow_pb2_grpc as pb_grpc
except ImportError as exc:   # a checkout where the build step has not run
    raise ImportError("the gRPC stubs sparrow.v1.* are not generated: run "
                      "`python -m sparrow.services.protogen` (make setup does)") from exc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Sparrow"].full_name      # "sparrow.v1.Sparrow"

__all__ = ["pb", "pb_grpc", "SERVICE_NAME"]
