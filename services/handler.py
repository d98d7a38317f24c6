"""sparrow.v1.Sparrow's methods, written once for both hosts (services.server: grpc.aio;
services.ray_app: Ray Serve's gRPC proxy). A host says how a call's deadline is read, where its
metrics go and how a status code reaches the client; here every exception a method raises
becomes a status code (services.errors), and a response stream is closed however the call ends.

A cancelled call's CancelledError (or a closed handler's GeneratorExit) is no Exception: it
passes through, closing the service's stream, which aborts the generation (Live: closes the
session, freeing its KV).
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from sparrow.services import prom
from sparrow.services.grpc_status import error_reason
from sparrow.services.servicer import SparrowService
from sparrow.services.wire import check_decoded, decoded_stream


class SparrowMethods(abc.ABC):
    """Generate, Live, UploadVideo and Abort over `self.service`. The context parameter has
    the name Ray Serve passes it by (grpc.aio passes it by position)."""

    service: SparrowService

    # ----- what a host says ----------------------------------------------------------------------
    @abc.abstractmethod
    def _deadline(self, grpc_context) -> float | None:
        """time.monotonic() past which the client has given up, or None."""

    @abc.abstractmethod
    def _recorder(self) -> prom.Recorder:
        """Where this call's metrics go."""

    @abc.abstractmethod
    async def _set_status(self, grpc_context, exc: Exception) -> None:
        """Give the client exc's status code: grpc.aio's abort ends the call itself (it
        raises); Serve's proxy sends the code set on the context once the method raises."""

    def _cancelled(self, request_stream) -> Callable[[], bool] | None:
        """Tells, once the request stream has ended, whether the client cancelled rather than
        half-closed; None where the host does not end both alike."""
        return None

    # ----- the methods ---------------------------------------------------------------------------
    async def Generate(self, request, grpc_context):
        def generated() -> AsyncIterator:
            check_decoded(request)
            deadline = self._deadline(grpc_context)
            return prom.observe_stream(self.service.generate(request, deadline), self._recorder())

        async with self._responses(grpc_context, "Generate", generated) as responses:
            async for response in responses:
                yield response

    async def Live(self, request_stream, grpc_context):
        def session() -> AsyncIterator:
            return self.service.live_stream(request_stream, self._deadline(grpc_context),
                                            metrics=self._recorder().live_session,
                                            cancelled=self._cancelled(request_stream))

        async with self._responses(grpc_context, "Live", session) as responses:
            async for response in responses:
                yield response

    async def UploadVideo(self, request_stream, grpc_context):
        async with self._status_on_error(grpc_context, "UploadVideo"):
            return await self.service.upload_video(decoded_stream(request_stream))

    async def Abort(self, request, grpc_context):
        async with self._status_on_error(grpc_context, "Abort"):
            return await self.service.abort(check_decoded(request))

    # ----- one try block for them all ------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _status_on_error(self, grpc_context, method: str) -> AsyncIterator[None]:
        """Every error becomes a status code; every call that ends without its answer is
        counted (prom: request_errors) under its reason."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - every error becomes a status code
            self._recorder().record_error(method, error_reason(exc))
            await self._set_status(grpc_context, exc)
            raise
        except BaseException:     # CancelledError, GeneratorExit: the client went, or its deadline passed
            self._recorder().record_error(method, "deadline" if self._expired(grpc_context) else "cancelled")
            raise

    def _expired(self, grpc_context) -> bool:
        try:
            deadline = self._deadline(grpc_context)
        except Exception:  # noqa: BLE001 - a malformed deadline was refused already; only the count asks
            return False
        return deadline is not None and time.monotonic() >= deadline

    @contextlib.asynccontextmanager
    async def _responses(self, grpc_context, method: str,
                         open_stream: Callable[[], AsyncIterator]) -> AsyncIterator[AsyncIterator]:
        """open_stream()'s responses (its checks of the request raise inside the status
        mapping), closed when the method ends, whichever way it ends."""
        async with self._status_on_error(grpc_context, method):
            async with contextlib.aclosing(open_stream()) as stream:
                yield stream
