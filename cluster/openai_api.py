"""The OpenAI-compatible HTTP API: request bodies, response objects and the FastAPI routes.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming with `data: {...}`
chunks and a final `data: [DONE]`, or one JSON object), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text).

Bodies use OpenAI's parameter names (model, prompt / messages, max_tokens, temperature, top_p,
seed, stream, stream_options, stop, n = 1) plus the via-sd extensions under the names of
`viasd.config.GenerationParams` (mode, gamma, alpha1, alpha2, region_b, ...). Parameters a
request leaves out take the server's defaults (`ServeConfig.default_params`, then
GenerationParams' own: greedy, 128 tokens, `via`). Every error names its field:
`{"error": {"message": ..., "type": "invalid_request_error", "param": field, "code": 400}}`,
HTTP 400 (429 when the replica's queue is full, 404 for an unknown model).

Responses carry OpenAI's `usage` and a `viasd_stats` object (`viasd.metrics.RequestStats`):
on the last streamed chunk, and on the non-streaming response.

The routes are plain functions over `request.app.state.server` (an `OpenAIServer`), so the same
app runs under Ray Serve's ingress (one replica = one pipeline) and under plain uvicorn.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException

from viasd.config import GenerationParams

#: Largest request body (the public gRPC service's message limit too: cluster.guard.PUBLIC_MAX_MESSAGE_BYTES)
MAX_BODY_BYTES = 4 * 1024 * 1024

# GenerationParams fields that OpenAI names the same way; the rest are via-sd extensions
OPENAI_PARAMS = ("max_tokens", "temperature", "top_p", "seed")
EXTENSIONS = tuple(n for n in GenerationParams.model_fields if n not in OPENAI_PARAMS)

# validated by GenerationParams (so its errors name the field the same way on every entry point)
_Extensions = create_model(
    "_Extensions",
    __config__=ConfigDict(extra="forbid"),
    **{
        name: (Any, Field(None, description=f"via-sd extension: {GenerationParams.model_fields[name].description}"))
        for name in EXTENSIONS
    },
)


class StreamOptions(BaseModel):
    """OpenAI's stream_options."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, description="Send one more chunk with `usage` (and no choices) before [DONE].")
    continuous_usage_stats: bool = Field(
        False, description="vLLM's extension (sent by load generators such as guidellm): accepted; usage still comes "
        "once, in the last chunk.")


class _Common(_Extensions):
    """Parameters shared by completions and chat completions."""

    model: str | None = Field(None, description="Pipeline name from /v1/models; empty: the default pipeline.")
    max_tokens: int | None = Field(None, description=GenerationParams.model_fields["max_tokens"].description)
    temperature: float | None = Field(None, description=GenerationParams.model_fields["temperature"].description)
    top_p: float | None = Field(None, description=GenerationParams.model_fields["top_p"].description)
    seed: int | None = Field(None, description=GenerationParams.model_fields["seed"].description)
    stream: bool = Field(False, description="Stream server-sent events (`data: {chunk}` ... `data: [DONE]`).")
    stream_options: StreamOptions | None = Field(None, description="Streaming options (include_usage).")
    stop: str | list[str] | None = Field(None, description="Up to 4 strings that end the text (not included in it).")
    n: int = Field(1, description="Choices per request; only 1 is served.")
    user: str | None = Field(None, description="End-user id (accepted, not used).")
    frequency_penalty: float = Field(0.0, description="Not supported: only 0 is accepted.")
    presence_penalty: float = Field(0.0, description="Not supported: only 0 is accepted.")
    logprobs: Any = Field(None, description="Not supported: only null / false is accepted.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: only null / {} is accepted.")
    return_token_ids: bool = Field(False, description="via-sd extension: add the generated `token_ids` to each choice.")


class CompletionRequest(_Common):
    """Body of POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="Text, or pre-tokenized ids; a list of prompts must hold exactly one."
    )
    echo: bool = Field(False, description="Not supported: only false is accepted.")
    best_of: int | None = Field(None, description="Not supported: only null / 1 is accepted.")
    suffix: str | None = Field(None, description="Not supported: only null is accepted.")


class TextPart(BaseModel):
    """One part of a message's content (type text)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = Field("text", description="Only text parts are served.")
    text: str = Field(..., description="The text.")


class ChatMessage(BaseModel):
    """One chat message; rendered with the model's chat template."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"] = Field(..., description="Who says it.")
    content: str | list[TextPart] | None = Field(..., description="The message text (or text parts).")
    name: str | None = Field(None, description="Participant name (accepted, not used).")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation, at least one message.")
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens.")
    tools: list | None = Field(None, description="Not supported: only null / [] is accepted.")
    response_format: dict | None = Field(None, description="Only {'type': 'text'} is accepted.")


def unsupported(body: _Common) -> tuple[str, str] | None:
    """The first OpenAI option that is set to something this server does not do: (field, message)."""
    checks = [
        ("n", body.n != 1, "only n=1 is served"),
        ("frequency_penalty", body.frequency_penalty != 0, "not supported (only 0)"),
        ("presence_penalty", body.presence_penalty != 0, "not supported (only 0)"),
        ("logprobs", body.logprobs not in (None, False, 0), "not supported"),
        ("logit_bias", bool(body.logit_bias), "not supported"),
        ("stop", isinstance(body.stop, list) and len(body.stop) > 4, "at most 4 stop strings"),
        ("stop", any(not s for s in _stops(body.stop)), "stop strings must be non-empty"),
    ]
    if isinstance(body, CompletionRequest):
        checks += [
            ("echo", body.echo, "not supported"),
            ("best_of", body.best_of not in (None, 1), "not supported (only 1)"),
            ("suffix", body.suffix is not None, "not supported"),
        ]
    else:
        checks += [
            ("tools", bool(body.tools), "tool calls are not supported"),
            ("response_format", body.response_format not in (None, {"type": "text"}), "only {'type': 'text'}"),
        ]
    return next(((f, m) for f, bad, m in checks if bad), None)


def _stops(stop: str | list[str] | None) -> list[str]:
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def param_values(body: _Common) -> dict[str, Any]:
    """The GenerationParams fields the request set (None means: the server's default)."""
    values = {n: getattr(body, n) for n in (*OPENAI_PARAMS, *EXTENSIONS)}
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        values["max_tokens"] = body.max_completion_tokens
    return {k: v for k, v in values.items() if v is not None}


class StopStrings:
    """Cuts streamed text at the first stop string; holds back a tail that may begin one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        if final:
            out, self.pending = self.pending, ""
            return out, False
        keep = 0  # longest suffix of pending that is a proper prefix of a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


# ------------------------------------------------------------------------------- response objects


def usage(stats: dict | None) -> dict:
    p = (stats or {}).get("prompt_tokens", 0)
    c = (stats or {}).get("generated_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def error_body(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# ------------------------------------------------------------------------------------ the routes


OPEN_PATHS = ("/health", "/metrics")  # served without a token (probes, Prometheus)


def build_http_app():
    """The FastAPI app; its routes read the replica's `OpenAIServer` from `app.state.server` and
    the bearer token (None: no authentication) from `app.state.token`."""
    from viasd.cluster.security import bearer_ok
    from viasd.cluster.server import RETRY_AFTER_S, RequestError

    app = FastAPI(title="via-sd", description="OpenAI-compatible API of a via-sd pipeline", version="1")

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        """Bodies past MAX_BODY_BYTES (by their Content-Length) are refused with 413 before they are read."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return JSONResponse(error_body(413, f"body: {length} bytes, more than the {MAX_BODY_BYTES} allowed",
                                           "body"), status_code=413)
        return await call_next(request)

    @app.middleware("http")
    async def _authenticate(request: Request, call_next):
        """With a token configured (app.state.token), every route but /health and /metrics needs
        `Authorization: Bearer <token>` (constant-time comparison); else 401 in OpenAI's shape."""
        token = getattr(request.app.state, "token", None)
        if token and not request.url.path.rstrip("/").endswith(OPEN_PATHS):
            presented = request.headers.get("authorization")
            if not bearer_ok(presented, token):
                message = "missing bearer token" if presented is None else "invalid bearer token"
                return JSONResponse(error_body(401, message, None, "authentication_error"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc) or None
        msg = err.get("msg", "invalid request body")
        if err.get("type") == "extra_forbidden":
            msg = "unknown parameter"
        if err.get("type") == "json_invalid":  # loc is a character position: the body as a whole is at fault
            field, msg = "body", f"not valid JSON ({msg}, at character {loc[0] if loc else '?'})"
        return JSONResponse(error_body(400, f"{field}: {msg}" if field else msg, field), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # e.g. a body that is not UTF-8
        field = "body" if exc.status_code == 400 else None
        message = f"body: {exc.detail}" if field else str(exc.detail)
        return JSONResponse(error_body(exc.status_code, message, field), exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
        return JSONResponse(error_body(exc.status, str(exc), exc.field, exc.kind), exc.status, headers=headers)

    def server(request: Request):
        return request.app.state.server

    async def _serve(request: Request, body: _Common, chat: bool):
        srv = server(request)
        job = await srv.open_openai(body, chat)  # validates and admits, or raises RequestError
        if body.stream:
            return StreamingResponse(_stream(job, chat), media_type="text/event-stream")
        return JSONResponse(await _whole(job, chat))

    async def _stream(job, chat: bool) -> AsyncIterator[bytes]:
        base = {"id": job.id, "created": job.created, "model": job.model}
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat:  # the first chunk announces the role, as OpenAI does
                yield sse({**base, "object": obj, "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ]})
            async for piece in job:
                choice = {"index": 0, "logprobs": None, "finish_reason": piece.finish_reason}
                if chat:
                    choice["delta"] = {"content": piece.text} if piece.text or not piece.finish_reason else {}
                else:
                    choice["text"] = piece.text
                if job.return_token_ids:
                    choice["token_ids"] = piece.token_ids
                chunk = {**base, "object": obj, "choices": [choice]}
                if piece.finish_reason:
                    chunk["usage"] = usage(piece.stats)
                    chunk["viasd_stats"] = piece.stats
                yield sse(chunk)
            if job.include_usage:
                yield sse({**base, "object": obj, "choices": [], "usage": usage(job.stats)})
        except Exception as exc:  # after the headers: report in-band, like OpenAI's streaming errors
            err = RequestError.of(exc)
            job.server.count_error(err)
            yield sse(error_body(err.status, str(err), err.field, err.kind))
        finally:
            await job.aclose()
        yield sse("[DONE]")

    async def _whole(job, chat: bool) -> dict:
        text, ids, finish = [], [], None
        try:
            async for piece in job:
                text.append(piece.text)
                ids.extend(piece.token_ids)
                finish = piece.finish_reason or finish
        except Exception as exc:
            err = RequestError.of(exc)
            job.server.count_error(err)
            raise err from None
        finally:
            await job.aclose()
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        if job.return_token_ids:
            choice["token_ids"] = ids
        return {
            "id": job.id,
            "object": "chat.completion" if chat else "text_completion",
            "created": job.created,
            "model": job.model,
            "choices": [choice],
            "usage": usage(job.stats),
            "viasd_stats": job.stats,
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(request, body, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        created = int(time.time())
        data = [
            {"id": info["name"], "object": "model", "created": created, "owned_by": "via-sd", "viasd": info}
            for info in server(request).model_infos()
        ]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health(request: Request):
        ok, detail = await server(request).health()
        return JSONResponse(detail, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        body, content_type = server(request).metrics.exposition()
        return Response(body, media_type=content_type)

    return app
