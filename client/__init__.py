"""gRPC client SDK for via-sd (``viasd.client``); needs only grpcio, protobuf and pydantic.

    from viasd.client import Client
    with Client("127.0.0.1:9000") as client:
        print(client.complete("def fib(n):", mode="via", max_tokens=64).text)

`Client` (blocking) and `AsyncClient` (asyncio) have the same surface: `generate` (a stream of
`Chunk`), `complete` (a `Completion`), `models`, `health`. Parameters are validated with
`viasd.config.GenerationParams` before any network I/O; gRPC statuses become the typed errors of
`viasd.client.errors`. Guide: docs/CLIENT.md.
"""

from viasd.errors import InvalidParameterError, ViaSDError

from .aio import AsyncClient, AsyncGenerateStream
from .common import NO_RETRY, Chunk, Completion, Keepalive, ModelInfo, RetryPolicy, TLSConfig
from .errors import (
    Cancelled,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    RPCError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from .sync import Client, GenerateStream

__all__ = [
    "Client",
    "AsyncClient",
    "GenerateStream",
    "AsyncGenerateStream",
    "Chunk",
    "Completion",
    "ModelInfo",
    "RetryPolicy",
    "NO_RETRY",
    "TLSConfig",
    "Keepalive",
    "ViaSDError",
    "InvalidParameterError",
    "RPCError",
    "InvalidArgument",
    "Unavailable",
    "DeadlineExceeded",
    "Cancelled",
    "Unauthenticated",
    "PermissionDenied",
    "ResourceExhausted",
    "Unimplemented",
    "InternalError",
]
