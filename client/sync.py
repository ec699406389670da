"""The blocking client: ``Client(target).generate(...)`` streams chunks from viasd.v1.GenerationService.

    with Client("127.0.0.1:9000", token=token, tls=TLSConfig(ca_file="ca.pem")) as client:
        with client.generate("def fib(n):", mode="via", max_tokens=64) as stream:
            for chunk in stream:
                print(chunk.text, end="", flush=True)

Closing the stream (``close()``, leaving the ``with`` block, or dropping it, e.g. by breaking out
of a ``for`` loop over it) cancels the call, and the server then aborts the request and frees its
caches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
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
    RetryPolicy,
    build_request,
)
from .errors import Cancelled, error_from_rpc, retry_after_s

log = logging.getLogger("viasd.client")


class Client(Endpoint):
    """A blocking client of one endpoint (a channel; thread-safe, reuse it for many calls).

    target: ``host:port`` (any gRPC target string). tls: None / False (plaintext), True (system
    roots) or a TLSConfig. token: bearer token sent with every call. timeout: default deadline of
    every call in seconds (None: none; each call may pass its own). retry: RetryPolicy of
    UNAVAILABLE (and of RESOURCE_EXHAUSTED from a full queue) before the first response. keepalive: HTTP/2 pings (None: off). metadata: extra
    pairs sent with every call (e.g. ``{"application": "viasd"}`` for Ray Serve). options: raw
    gRPC channel arguments, appended last.
    """

    _grpc = grpc

    # ---------------------------------------------------------------- calls

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> GenerateStream:
        """Start a request and return its stream of Chunk (see `common.build_request` for the
        inputs: prompt | messages | prompt_token_ids, model, request_id, params and keywords).
        Bad parameters raise InvalidParameterError here, before any network I/O."""
        request = build_request(prompt, **kwargs)
        return GenerateStream(self, request, self.timeout if timeout is None else timeout)

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """The whole generation (same arguments as `generate`; n = 1, `complete_n` for n > 1)."""
        if (kwargs.get("n") or 1) != 1:
            raise InvalidParameterError("n", "complete() returns one sample; use complete_n()")
        return (self.complete_n(prompt, **kwargs))[0]

    def complete_n(self, prompt: str | None = None, **kwargs: Any) -> list[Completion]:
        """Every sample's whole generation, in sample order (same arguments as `generate`)."""
        with self.generate(prompt, **kwargs) as stream:
            chunks = [chunk for chunk in stream]
        return Completion.of_samples(stream.request_id, kwargs.get("n") or 1, chunks)

    def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The served pipelines (ListModels)."""
        response = self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [ModelInfo.from_proto(m) for m in response.models]

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """Status of the standard gRPC health service: "SERVING", "NOT_SERVING", ... ("" = the
        server as a whole, "viasd.v1.GenerationService" = the API). Needs no token."""
        return self._unary(self._health, service, timeout)

    def _unary(self, method: Callable, request, timeout: float | None):
        deadline = Deadline(self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as exc:
                delay = _retry_delay(self.retry, exc, attempt, deadline)
                if delay is None:
                    raise error_from_rpc(exc) from None
                time.sleep(delay)

    # ---------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Close the channel (cancels the calls still open on it)."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _retry_delay(policy: RetryPolicy, exc: grpc.RpcError, attempt: int, deadline: Deadline) -> float | None:
    """Seconds to wait before retrying a call that failed with `exc` before any response, or None.

    UNAVAILABLE is retried after the policy's backoff; RESOURCE_EXHAUSTED (the server's queue is
    full) only when the server sent its retry hint, and after at least that hint."""
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        hint = 0.0
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        hint = retry_after_s(exc.trailing_metadata())
        if hint is None:  # not the queue: a message past the size limit would fail again
            return None
    else:
        return None
    if attempt >= policy.max_attempts:
        return None
    delay = max(policy.backoff(attempt), hint)
    if not deadline.allows(delay):
        return None
    log.info("%s (%s), retry %d/%d in %.2fs", code.name, exc.details(), attempt, policy.max_attempts - 1, delay)
    return delay


class GenerateStream(Iterator[Chunk]):
    """The chunks of one Generate call; iterate it, and close it (or use ``with``) to cancel."""

    def __init__(self, client: Client, request: pb.GenerateRequest, timeout: float | None):
        self.request_id = request.request_id  # the client makes one, so that every attempt uses it
        self._client = client
        self._request = request
        self._deadline = Deadline(timeout)
        self._call = None
        self._cancelled = threading.Event()
        self._chunks = self._run()

    def _run(self) -> Iterator[Chunk]:
        client, attempt = self._client, 0
        while True:
            attempt += 1
            if self._cancelled.is_set():  # cancelled while waiting to retry
                raise Cancelled("CANCELLED", "cancelled by the client")
            self._call = call = client._stub.Generate(
                self._request, timeout=self._deadline.remaining(), metadata=client._metadata
            )
            started = False
            try:
                for response in call:
                    started = True
                    yield Chunk.from_proto(response)
                return
            except grpc.RpcError as exc:
                # a retry after the first chunk would stream tokens the caller already has
                delay = None if started else _retry_delay(client.retry, exc, attempt, self._deadline)
                if delay is None:
                    raise error_from_rpc(exc) from None
            finally:
                call.cancel()  # a no-op once the call has ended; ends it when the stream is closed early
            self._cancelled.wait(delay)  # the backoff, cut short by cancel()

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def cancel(self) -> None:
        """Cancel the call (from any thread): the server aborts the request; iteration raises Cancelled."""
        self._cancelled.set()
        if self._call is not None:
            self._call.cancel()

    def close(self) -> None:
        """Stop reading and cancel the call if it is still running."""
        self.cancel()
        try:
            self._chunks.close()
        except ValueError:  # being iterated in another thread: the cancel above ends it there
            pass

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        call = getattr(self, "_call", None)
        if call is not None:
            call.cancel()
