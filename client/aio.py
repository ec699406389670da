"""The asyncio client: the same surface as `Client`, with coroutines and async iterators.

    async with AsyncClient("127.0.0.1:9000") as client:
        async with client.generate("def fib(n):", max_tokens=64) as stream:
            async for chunk in stream:
                print(chunk.text, end="", flush=True)

Create it inside the event loop that uses it (grpc.aio channels belong to one loop). Closing the
stream (``aclose()``, leaving the ``async with`` block) cancels the call on the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from viasd.errors import InvalidParameterError
from viasd.v1 import generation_pb2 as pb

from .common import (
    Chunk,
    Completion,
    Deadline,
    Endpoint,
    ModelInfo,
    build_request,
)
from .errors import Cancelled, error_from_rpc
from .sync import _retry_delay


class AsyncClient(Endpoint):
    """An asyncio client of one endpoint; the arguments are `Client`'s."""

    _grpc = grpc.aio

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncGenerateStream:
        """Start a request; returns its async stream of Chunk (validated here, before any I/O)."""
        request = build_request(prompt, **kwargs)
        return AsyncGenerateStream(self, request, self.timeout if timeout is None else timeout)

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """The whole generation (same arguments as `generate`; n = 1, `complete_n` for n > 1)."""
        if (kwargs.get("n") or 1) != 1:
            raise InvalidParameterError("n", "complete() returns one sample; use complete_n()")
        return (await self.complete_n(prompt, **kwargs))[0]

    async def complete_n(self, prompt: str | None = None, **kwargs: Any) -> list[Completion]:
        """Every sample's whole generation, in sample order (same arguments as `generate`)."""
        async with self.generate(prompt, **kwargs) as stream:
            chunks = [chunk async for chunk in stream]
        return Completion.of_samples(stream.request_id, kwargs.get("n") or 1, chunks)

    async def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The served pipelines (ListModels)."""
        response = await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [ModelInfo.from_proto(m) for m in response.models]

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """Status of the standard gRPC health service ("SERVING", ...); needs no token."""
        return await self._unary(self._health, service, timeout)

    async def _unary(self, method: Callable, request, timeout: float | None):
        deadline = Deadline(self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as exc:
                delay = _retry_delay(self.retry, exc, attempt, deadline)
                if delay is None:
                    raise error_from_rpc(exc) from None
                await asyncio.sleep(delay)

    async def close(self) -> None:
        """Close the channel (cancels the calls still open on it)."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncGenerateStream(AsyncIterator[Chunk]):
    """The chunks of one Generate call; ``async for`` it, and ``aclose()`` it (or use ``async with``)
    to cancel."""

    def __init__(self, client: AsyncClient, request: pb.GenerateRequest, timeout: float | None):
        self.request_id = request.request_id
        self._client = client
        self._request = request
        self._deadline = Deadline(timeout)
        self._call = None
        self._cancelled = False
        self._chunks = self._run()

    async def _run(self) -> AsyncIterator[Chunk]:
        client, attempt = self._client, 0
        while True:
            attempt += 1
            if self._cancelled:  # cancelled while waiting to retry
                raise Cancelled("CANCELLED", "cancelled by the client")
            self._call = call = client._stub.Generate(
                self._request, timeout=self._deadline.remaining(), metadata=client._metadata
            )
            started = False
            try:
                async for response in call:
                    started = True
                    yield Chunk.from_proto(response)
                return
            except grpc.RpcError as exc:
                # a retry after the first chunk would stream tokens the caller already has
                delay = None if started else _retry_delay(client.retry, exc, attempt, self._deadline)
                if delay is None:
                    raise error_from_rpc(exc) from None
            except asyncio.CancelledError:
                if self._cancelled:  # grpc.aio raises CancelledError when a call is cancelled locally
                    raise Cancelled("CANCELLED", "cancelled by the client") from None
                raise
            finally:
                call.cancel()  # a no-op once the call has ended; ends it when the stream is closed early
            await asyncio.sleep(delay)

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def __anext__(self) -> Chunk:
        return await self._chunks.__anext__()

    def cancel(self) -> None:
        """Cancel the call: the server aborts the request; iteration raises Cancelled."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    async def aclose(self) -> None:
        """Stop reading and cancel the call if it is still running."""
        self.cancel()
        try:
            await self._chunks.aclose()
        except RuntimeError:  # being iterated by another task: the cancel above ends it there
            pass

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __del__(self):
        call = getattr(self, "_call", None)
        if call is not None:
            call.cancel()
