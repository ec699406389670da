"""The public gRPC API (viasd.v1.GenerationService): translation to and from the request handler.

`GenerationServicer` serves named pipelines, one `handler.RequestHandler` each (requests naming
no model go to the default one): a GenerateRequest becomes a `handler.Request` (`request_of`),
each `handler.Piece` a GenerateResponse, and errors status codes through the handler's error
table (`status_of`: the bad field in the trailing metadata ``viasd-invalid-field``, a retry hint
``viasd-retry-after-ms`` when the queue is full). Cancelling a Generate call aborts the request.

Two hosts run the same methods `Generate` / `ListModels`, each checking the bearer token
(`security.authenticate`): the standalone server (`cluster/standalone.py`, grpc.aio) and the
Serve deployment (`cluster/app.py`, Serve's gRPC proxy); `end_call` ends a failed call on either.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from viasd.client.errors import INVALID_FIELD_KEY, RETRY_AFTER_KEY
from viasd.cluster.guard import Calls, parse_request
from viasd.cluster.handler import (
    INVALID,
    REJECTED,
    RETRY_AFTER_S,
    UNLIMITED,
    Admission,
    Backend,
    DrainedError,
    Request,
    RequestHandler,
    error_of,
)
from viasd.cluster.security import AUTH_KEY, authenticate
from viasd.config import Mode
from viasd.errors import InvalidParameterError
from viasd.v1 import generation_pb2 as pb
from viasd.v1 import generation_pb2_grpc
from viasd.v1.convert import FINISH_TO_PB, MODE_TO_PB, logprobs_to_proto, params_values_from_proto, stats_to_proto

log = logging.getLogger("viasd.cluster.grpc_api")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name  # "viasd.v1.GenerationService"
HEALTH_SERVICES = ("", SERVICE_NAME)  # what the standard health service reports on


def health_status(serving: bool) -> int:
    """The standard health service's status (grpc.health.v1.HealthCheckResponse)."""
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """GenerationService over named request handlers; requests naming no model go to `default`."""

    def __init__(
        self, pipelines: dict[str, Backend], default: str, *, admission: Admission | None = None, **options: Any
    ):
        """One handler per pipeline (`options`: RequestHandler's), sharing `admission` (None: no
        limit) and one drain."""
        shared = {"admission": admission or Admission(UNLIMITED, 0), "calls": Calls(), **options}
        self._init({name: RequestHandler(p, name, **shared) for name, p in pipelines.items()}, default)

    @classmethod
    def over(cls, handlers: dict[str, RequestHandler], default: str) -> GenerationServicer:
        """The service over existing handlers (shared with the HTTP API of the same process)."""
        servicer = cls.__new__(cls)
        servicer._init(handlers, default)
        return servicer

    def _init(self, handlers: dict[str, RequestHandler], default: str) -> None:
        if default not in handlers:
            raise ValueError(f"default pipeline {default!r} is not among {sorted(handlers)}")
        self.handlers = handlers
        self.default = default
        self.admission = handlers[default].admission
        self.calls = handlers[default].calls

    def in_flight(self) -> int:
        """Requests running (or waiting for admission) on these handlers."""
        return len(self.calls)

    def handler(self, model: str) -> RequestHandler:
        if not model:
            return self.handlers[self.default]
        found = next((h for h in self.handlers.values() if h.answers_to(model)), None)
        if found is None:
            names = sorted(n for h in self.handlers.values() for n in h.names)
            raise InvalidParameterError("model", f"unknown model {model!r}; served: {names}")
        return found

    async def Generate(self, request: pb.GenerateRequest | bytes, context=None, *, token: str | None = None):
        """The responses of one request. Either server's context: grpc.aio's (the standalone
        server) or Serve's (`context` None: no metadata); `token`: the bearer token the call must
        carry (None: none). Errors end the call with their status (`end_call`)."""
        try:
            authenticate(_metadata(context).get(AUTH_KEY), token)
            async with aclosing(self.generate(request)) as responses:
                async for response in responses:
                    yield response
        except Exception as exc:
            await end_call(context, exc)

    async def generate(self, request: pb.GenerateRequest | bytes) -> AsyncIterator[pb.GenerateResponse]:
        """The responses of one request, no transport around it; raises what `status_of` maps."""
        try:
            if isinstance(request, bytes):  # registered by serve_grpc: parsed here, bad fields named
                request = parse_request(request, pb.GenerateRequest)
            handler = self.handler(request.model)
            values = request_of(request)
        except InvalidParameterError as exc:
            self.handlers[self.default].refuse(exc)
            raise
        try:
            job = await handler.open(values)
        except DrainedError as exc:  # drained while queued: the stream's last message says so
            yield pb.GenerateResponse(request_id=exc.request_id, finish_reason=pb.FINISH_REASON_ABORT)
            return
        try:
            async for piece in job:
                yield pb.GenerateResponse(
                    request_id=job.id,
                    text=piece.text,
                    token_ids=piece.token_ids,
                    finish_reason=FINISH_TO_PB[piece.finish_reason],
                    stats=stats_to_proto(piece.request_stats) if piece.request_stats is not None else None,
                    logprobs=logprobs_to_proto(piece.logprobs),
                    prompt_logprobs=logprobs_to_proto(piece.prompt_logprobs),
                    index=piece.index,
                )
        except Exception as exc:
            raise await job.fail(exc) from None
        finally:
            await job.aclose()

    async def ListModels(self, request: pb.ListModelsRequest, context=None, *, token: str | None = None):
        """Every pipeline's ModelInfo (the same contexts and `token` as `Generate`)."""
        try:
            authenticate(_metadata(context).get(AUTH_KEY), token)
        except Exception as exc:
            await end_call(context, exc)
        return pb.ListModelsResponse(models=[model_info(h.info()) for h in self.handlers.values()])


class GRPCStatus(Exception):
    """Raised after a status is set on Serve's gRPC context: the proxy takes the status from the
    context, so the exception itself only has to end the call."""


def _metadata(context) -> dict:
    """A call's invocation metadata (the first value of each key); no context: none."""
    return dict(reversed(context.invocation_metadata() or ())) if context is not None else {}


def set_status(context, code: grpc.StatusCode, details: str, metadata=()) -> None:
    """Set a call's status on its context (Serve's, or grpc.aio's); None: no context to set."""
    if context is None:
        return
    context.set_code(code)
    context.set_details(details)
    if metadata:
        context.set_trailing_metadata(list(metadata))


async def end_call(context, exc: BaseException):
    """End a call with the status of `exc` (`status_of`). A grpc.aio context aborts; Serve's has no
    abort: its status is set and GRPCStatus raised, which ends the call with it."""
    code, details, metadata = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("request failed", exc_info=exc)
    if hasattr(context, "abort"):
        await context.abort(code, details, trailing_metadata=metadata)
    set_status(context, code, details, metadata)
    raise GRPCStatus(details) from None


_MODEL_INFO = tuple(pb.ModelInfo.DESCRIPTOR.fields_by_name)


def model_info(info: dict) -> pb.ModelInfo:
    """The ModelInfo message of a handler's info (the runtime facts flattened into it)."""
    flat = {**info, **{k: v or "" for k, v in info.get("runtime", {}).items() if k in _MODEL_INFO}}
    flat["default_mode"] = MODE_TO_PB[Mode(info["default_mode"])]
    return pb.ModelInfo(**{k: v for k, v in flat.items() if k in _MODEL_INFO})


def request_of(msg: pb.GenerateRequest) -> Request:
    """The handler's view of a GenerateRequest (InvalidParameterError names a bad field)."""
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidParameterError("prompt", "set one of prompt, messages or prompt_token_ids")
    prompt = {"prompt": msg.prompt, "prompt_token_ids": list(msg.prompt_token_ids.ids)}.get(which)
    messages = [{"role": m.role, "content": m.content} for m in msg.messages.messages] if which == "messages" else None
    return Request(
        prompt=prompt,
        messages=messages,
        params=params_values_from_proto(msg.params),
        model=msg.model or None,
        request_id=msg.request_id or None,
    )


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple]:
    """(status code, details, trailing metadata) of an error, from the handler's error table."""
    err = error_of(exc)
    metadata: tuple = ()
    if err.kind is REJECTED:  # the queue is full: when to try again
        metadata = ((RETRY_AFTER_KEY, str(RETRY_AFTER_S * 1000)),)
    elif err.field is not None and err.kind.grpc == INVALID.grpc:
        metadata = ((INVALID_FIELD_KEY, err.field),)
    return grpc.StatusCode[err.kind.grpc], str(err), metadata
