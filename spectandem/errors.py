"""The client SDK's exceptions: one class per gRPC status a caller handles differently, mapped
in one place (`error_from_rpc`)."""

from __future__ import annotations

import grpc


class SpectandemError(Exception):
    """A failed call. `code` is the gRPC status code, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, details)
        self.code = code
        self.details = details

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class InvalidArgument(SpectandemError):
    """Bad sampling parameters or prompt; retrying the same request cannot succeed."""


class AlreadyExists(SpectandemError):
    """The request id is in use by a request that has not ended."""


class ResourceExhausted(SpectandemError):
    """Queue full, prompt too long for the cache, or message too large."""


class Unavailable(SpectandemError):
    """Server not ready, draining or unreachable (retried automatically before the first chunk)."""


class DeadlineExceeded(SpectandemError):
    """The call's timeout expired."""


class Cancelled(SpectandemError):
    """The call was cancelled."""


class Unauthenticated(SpectandemError):
    """Missing or rejected credentials."""


class InternalError(SpectandemError):
    """A server fault (INTERNAL, UNKNOWN, DATA_LOSS) or a broken stream."""


_ERROR_CLASSES: dict[grpc.StatusCode, type[SpectandemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,  # an exception the server did not map
    grpc.StatusCode.DATA_LOSS: InternalError,
}


def error_from_rpc(err: grpc.RpcError) -> SpectandemError:
    """The SDK exception for a failed RPC; codes without a class of their own get the base class."""
    code, details = err.code(), err.details() or ""
    return _ERROR_CLASSES.get(code, SpectandemError)(code, details)


class ListenError(OSError):
    """A server of this process cannot listen on its address (the port in use, an address not
    of this host): the user's to fix, reported in one line."""
