"""Typed errors of the client SDK: one class per gRPC status a caller handles differently.

Every class derives from :class:`viasd.errors.ViaSDError` (one hierarchy for the engine, the
servers and the client) and from :class:`RPCError`, which carries the status ``code`` (its name,
e.g. ``"UNAVAILABLE"``) and the server's ``message``. INVALID_ARGUMENT becomes
:class:`InvalidArgument`, which is also an :class:`~viasd.errors.InvalidParameterError`: its
``field`` comes from the trailing metadata ``viasd-invalid-field``, so ``except
InvalidParameterError`` catches a bad value whether the client (before any network I/O) or the
server found it.
"""

from __future__ import annotations

import grpc

from viasd.errors import InvalidParameterError, ViaSDError

# the one definition of the service's trailing metadata keys (the servers import them from here):
INVALID_FIELD_KEY = (
    "viasd-invalid-field"  # trailing metadata of INVALID_ARGUMENT naming the field (cluster/grpc_api.py)
)
# trailing metadata of RESOURCE_EXHAUSTED when the server's queue is full: milliseconds to wait before
# trying again (cluster/handler.py RETRY_AFTER_KEY; HTTP's Retry-After)
RETRY_AFTER_KEY = "viasd-retry-after-ms"


def retry_after_s(trailing_metadata) -> float | None:
    """The server's retry hint in seconds (RETRY_AFTER_KEY), or None when it sent none (or junk)."""
    value = next((v for k, v in trailing_metadata or () if k == RETRY_AFTER_KEY), None)
    try:
        ms = float(value) if value is not None else None
    except ValueError:
        return None
    return ms / 1000.0 if ms is not None and 0 <= ms < 3.6e6 else None


class RPCError(ViaSDError):
    """A call failed with a gRPC status; ``code`` is the status name, ``message`` the server's text."""

    def __init__(self, code: str, message: str):
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}" if message else code)


class Unavailable(RPCError):
    """The server cannot be reached, is starting or stopping, or a pipeline actor is down (retryable
    before the first token; the client retries it by its RetryPolicy)."""


class DeadlineExceeded(RPCError):
    """The call's deadline (``timeout``) passed before it finished."""


class Cancelled(RPCError):
    """The call was cancelled (by this client, or the server cancelled it)."""


class Unauthenticated(RPCError):
    """The bearer token is missing or wrong."""


class PermissionDenied(RPCError):
    """The caller is authenticated but not allowed to make this call."""


class ResourceExhausted(RPCError):
    """The server's queue is full (HTTP 429's twin; retried before the first token when the server
    sends its retry hint), or a message is past the size limit (not retried)."""


class Unimplemented(RPCError):
    """The server does not offer this method."""


class InternalError(RPCError):
    """The server failed (INTERNAL, UNKNOWN, DATA_LOSS and every other status)."""


class InvalidArgument(RPCError, InvalidParameterError):
    """The server refused a value (INVALID_ARGUMENT); ``field`` names it."""

    def __init__(self, field: str, message: str):
        InvalidParameterError.__init__(self, field, message)
        self.code = "INVALID_ARGUMENT"

    def __reduce__(self):
        return (InvalidArgument, (self.field, self.message))


_BY_CODE: dict[grpc.StatusCode, type[RPCError]] = {
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
}


def error_from_status(code: grpc.StatusCode, details: str | None, trailing_metadata=()) -> RPCError:
    """The typed error of a gRPC status, with the server's message."""
    details = details or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = next((v for k, v in trailing_metadata or () if k == INVALID_FIELD_KEY), None)
        if field is None:  # a server that does not send the key: "field: message" is the convention
            field, sep, rest = details.partition(": ")
            field, details = (field, rest) if sep else ("request", details)
        else:
            details = details.removeprefix(f"{field}: ")
        return InvalidArgument(field, details)
    return _BY_CODE.get(code, InternalError)(code.name, details)


def error_from_rpc(exc: grpc.RpcError) -> RPCError:
    """The typed error of a failed call (grpc.RpcError of the sync API or grpc.aio.AioRpcError)."""
    return error_from_status(exc.code(), exc.details(), exc.trailing_metadata())
