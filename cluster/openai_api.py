"""The OpenAI-compatible HTTP API: request bodies, their translation to the request handler, the routes.

Endpoints, body parsing, defaults and errors are listed in docs/SERVING.md ("Endpoints"). Bodies
are parsed as vLLM parses them: OpenAI's names, each mapped to the engine through one table,
`OPENAI_FIELDS`, plus the via-sd parameters under their `GenerationParams` names; an explicit
`null` is the default; an unknown field is ignored and listed in the response header
`x-viasd-ignored-fields`, unless it is a near-miss of a known name (a typo, refused); a wrong
type or a feature not served is a 400 naming the field and saying what to do instead. Errors
take the handler's error table (`cluster/handler.py`) in OpenAI's shape.

The routes are plain functions over `request.app.state.server` (a `handler.RequestHandler`), so
the same app runs under Ray Serve's ingress (one replica = one pipeline) and under plain uvicorn.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

import viasd
from viasd.cluster.handler import REJECTED, RETRY_AFTER_S, UNAUTHENTICATED, Job, Piece, RequestError, RequestHandler
from viasd.cluster.handler import Request as HandlerRequest
from viasd.cluster.security import authenticate
from viasd.config import GenerationParams
from viasd.errors import InvalidParameterError

log = logging.getLogger("viasd.cluster.openai_api")

#: Largest request body (the public gRPC service's message limit too: cluster.guard.PUBLIC_MAX_MESSAGE_BYTES)
MAX_BODY_BYTES = 4 * 1024 * 1024
IGNORED_FIELDS_HEADER = "x-viasd-ignored-fields"  # the unknown fields a request sent, comma-separated
#: Headers of the errors that need them: when to try again, how to authenticate.
ERROR_HEADERS = {REJECTED: {"Retry-After": str(RETRY_AFTER_S)}, UNAUTHENTICATED: {"WWW-Authenticate": "Bearer"}}


@dataclass(frozen=True)
class OpenAIField:
    """How one OpenAI (or vLLM) request field reaches the engine."""

    type: Any  # its type in a body (a type error names the field)
    param: str | None  # the GenerationParams field it sets; None: not wired to the engine (yet)
    unused: tuple = (None,)  # values that ask for nothing: accepted while `param` is None
    todo: str = ""  # the 400's advice when an unwired field asks for something
    transport: str = ""  # served by this module (the response's shape), not by a GenerationParams field: what it does


#: Every OpenAI / vLLM sampling field: wiring a new engine feature is one entry here.
OPENAI_FIELDS: dict[str, OpenAIField] = {
    "max_tokens": OpenAIField(int, "max_tokens"),
    "max_completion_tokens": OpenAIField(int, "max_tokens"),  # OpenAI's newer name (chat)
    "temperature": OpenAIField(float, "temperature"),
    "top_p": OpenAIField(float, "top_p"),
    "seed": OpenAIField(int, "seed"),
    "stop": OpenAIField(str | list[str], "stop"),
    "n": OpenAIField(int, "n"),  # n samples sharing one prefill: choices 0..n-1
    "best_of": OpenAIField(int, None, (None, 1), "only best_of=1 is served"),
    "presence_penalty": OpenAIField(float, "presence_penalty"),
    "frequency_penalty": OpenAIField(float, "frequency_penalty"),
    "repetition_penalty": OpenAIField(float, "repetition_penalty"),  # vLLM's extension
    "logit_bias": OpenAIField(dict[str, float], "logit_bias"),  # {"token id": bias}
    "logprobs": OpenAIField(bool | int, "logprobs"),  # completions: k alternatives; chat: true / false
    "top_logprobs": OpenAIField(int, "logprobs"),  # chat: k alternatives (needs logprobs: true)
    "echo": OpenAIField(
        bool,
        None,
        transport="Return the prompt before the generated text; with logprobs, the prompt tokens' logprobs "
        "too (the first token's is null), as lm-eval's loglikelihood requests need.",
    ),
    "suffix": OpenAIField(str, None, (None,), "suffix (fill in the middle) is not served; put the text in the prompt"),
    "min_tokens": OpenAIField(int, None, (None, 0), "min_tokens is not served; leave it unset (or 0)"),
    "use_beam_search": OpenAIField(bool, None, (None, False), "beam search is not served"),
    "tools": OpenAIField(
        list,
        None,
        (None, []),
        "tool calls are not served: describe the tools in the prompt and parse the reply yourself",
    ),
    "tool_choice": OpenAIField(str | dict, None, (None, "none", "auto"), "tool calls are not served"),
    "response_format": OpenAIField(
        dict, None, (None, {"type": "text"}), "only {'type': 'text'} is served: ask for JSON in the prompt"
    ),
}
_COMPLETION_ONLY = ("echo", "best_of", "suffix")
_CHAT_ONLY = ("max_completion_tokens", "tools", "tool_choice", "response_format", "top_logprobs")
# GenerationParams fields OpenAI's table does not set: via-sd extensions under their own names
EXTENSIONS = tuple(n for n in GenerationParams.model_fields if n not in {f.param for f in OPENAI_FIELDS.values()})


def _fields(names) -> dict:
    return {n: (OPENAI_FIELDS[n].type | None, Field(None, description=_describe(n))) for n in names}


def _describe(name: str) -> str:
    f = OPENAI_FIELDS[name]
    if f.transport:
        return f.transport
    if f.param is None:
        return f"Not served yet ({f.todo}); accepted when it asks for nothing ({', '.join(map(repr, f.unused))})."
    return GenerationParams.model_fields[f.param].description


class _Lenient(BaseModel):
    """Unknown fields are kept (`model_extra`) and reported, an explicit null means the default."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Lenient):
    """OpenAI's stream_options."""

    include_usage: bool = Field(False, description="Send one more chunk with `usage` (and no choices) before [DONE].")


# validated by GenerationParams (so its errors name the field the same way on every entry point)
_Extensions = create_model(
    "_Extensions",
    __base__=_Lenient,
    **{
        name: (Any, Field(None, description=f"via-sd extension: {GenerationParams.model_fields[name].description}"))
        for name in EXTENSIONS
    },
)
_Common = create_model(
    "_Common",
    __base__=_Extensions,
    __doc__="Parameters shared by completions and chat completions.",
    model=(str | None, Field(None, description="A name from /v1/models (or an alias); empty: this pipeline.")),
    stream=(bool, Field(False, description="Stream server-sent events (`data: {chunk}` ... `data: [DONE]`).")),
    stream_options=(StreamOptions | None, Field(None, description="Streaming options (include_usage).")),
    user=(str | None, Field(None, description="End-user id (accepted, not used).")),
    return_token_ids=(
        bool,
        Field(False, description="via-sd extension: add the generated `token_ids` to each choice."),
    ),
    **_fields(n for n in OPENAI_FIELDS if n not in _COMPLETION_ONLY + _CHAT_ONLY),
)


CompletionRequest = create_model(
    "CompletionRequest",
    __base__=_Common,
    __doc__="Body of POST /v1/completions.",
    prompt=(
        str | list[int] | list[str] | list[list[int]],
        Field(..., description="Text or pre-tokenized ids, or a list of either: one choice per prompt and sample."),
    ),
    **_fields(_COMPLETION_ONLY),
)


class TextPart(_Lenient):
    """One part of a message's content (type text)."""

    type: Literal["text"] = Field("text", description="Only text parts are served.")
    text: str = Field(..., description="The text.")


class ChatMessage(_Lenient):
    """One chat message; rendered with the model's chat template."""

    role: Literal["system", "user", "assistant", "developer", "tool"] = Field(..., description="Who says it.")
    content: str | list[TextPart] | None = Field(None, description="The message text (or text parts).")
    name: str | None = Field(None, description="Participant name (accepted, not used).")

    def as_dict(self) -> dict:
        """As the handler takes a message: {"role", "content"} (text parts joined)."""
        text = "".join(p.text for p in self.content) if isinstance(self.content, list) else self.content or ""
        return {"role": self.role, "content": text}


ChatCompletionRequest = create_model(
    "ChatCompletionRequest",
    __base__=_Common,
    __doc__="Body of POST /v1/chat/completions.",
    messages=(list[ChatMessage], Field(..., min_length=1, description="The conversation, at least one message.")),
    **_fields(_CHAT_ONLY),
)


class TokenizeRequest(_Lenient):
    """Body of POST /tokenize (vLLM's): a prompt or chat messages."""

    model: str | None = Field(None, description="A name from /v1/models; empty: this pipeline.")
    prompt: str | None = Field(
        None, description="Text to tokenize, as a completions prompt is (with the model's BOS, if any)."
    )
    messages: list[ChatMessage] | None = Field(None, description="Chat messages, rendered with the chat template.")


class DetokenizeRequest(_Lenient):
    """Body of POST /detokenize (vLLM's)."""

    model: str | None = Field(None, description="A name from /v1/models; empty: this pipeline.")
    tokens: list[int] = Field(..., description="Token ids to turn into text.")


_warned: set[str] = set()  # unknown field names already logged by this process


def check_fields(body: BaseModel) -> list[str]:
    """Refuse what this server does not do (InvalidParameterError naming the field and what to do
    instead) and typos of known names; return the unknown fields, which are ignored."""
    for name, spec in OPENAI_FIELDS.items():  # in the table's order: the first one asked for is named
        unwired = spec.param is None and not spec.transport
        if unwired and name in type(body).model_fields and getattr(body, name) not in spec.unused:
            raise InvalidParameterError(name, spec.todo)
    unknown = sorted(body.model_extra or ())
    known = list(type(body).model_fields)
    for name in unknown:
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if near:
            raise InvalidParameterError(name, f"unknown parameter; did you mean {near[0]!r}?")
        if name not in _warned:
            _warned.add(name)
            log.warning(
                "request field %r is not known to via-sd; it is ignored (listed in %s)", name, IGNORED_FIELDS_HEADER
            )
    return unknown


def param_values(body: BaseModel) -> dict[str, Any]:
    """The GenerationParams fields the request set, through OPENAI_FIELDS (unset: the server's default)."""
    values = {n: getattr(body, n) for n in EXTENSIONS if getattr(body, n) is not None}
    for name, spec in OPENAI_FIELDS.items():  # max_completion_tokens after max_tokens: the newer name wins
        value = getattr(body, name, None) if name in type(body).model_fields else None
        if spec.param is not None and value is not None:
            values[spec.param] = value
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    if getattr(body, "top_logprobs", None) is not None and not getattr(body, "logprobs", None):
        raise InvalidParameterError("top_logprobs", "needs logprobs: true")
    if getattr(body, "echo", None) and values.get("logprobs") is not None:  # the echoed prompt's logprobs too
        values["prompt_logprobs"] = values["logprobs"]
    return values


def prompts_of(body: BaseModel) -> list:
    """A completions body's prompts: one string or token-id list, or a list of either."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def request_of(body: BaseModel, chat: bool) -> tuple[list[HandlerRequest], list[str]]:
    """The handler's requests of an OpenAI body (one per prompt of a completions body), and the
    unknown fields it ignored (InvalidParameterError names a field refused)."""
    ignored = check_fields(body)
    common = {"params": param_values(body), "model": body.model}
    if chat:
        messages = [m.as_dict() for m in body.messages]
        return [HandlerRequest(messages=messages, id_prefix="chatcmpl-", fill_context=True, **common)], ignored
    return [HandlerRequest(prompt=p, id_prefix="cmpl-", **common) for p in prompts_of(body)], ignored


class JobFailed(Exception):
    """A job's stream raised: the job and what it raised."""

    def __init__(self, job: Job, error: Exception):
        super().__init__(str(error))
        self.job, self.error = job, error


class Prompts:
    """The jobs of one OpenAI request, one per prompt (chat: one), and their pieces as they come.

    One job is read as the response is (`pieces` pulls it). Several are read on tasks of their own
    into one queue, each closed once it ended: a prompt waiting for a decoding slot must not wait
    for the response to read the others, which free the slots. `open` returns once every job is
    open (its first piece ready), so that a refusal is still the response's status."""

    def __init__(self, jobs: list[Job], tasks: list[asyncio.Task] | None = None, queue: asyncio.Queue | None = None):
        self.jobs, self._tasks, self._queue = jobs, tasks or [], queue

    @classmethod
    async def open(cls, handler: RequestHandler, requests: list[HandlerRequest]) -> Prompts:
        if len(requests) == 1:
            return cls([await handler.open(requests[0])])
        jobs = [await handler.prepare(r) for r in requests]  # every prompt validated before any starts
        queue: asyncio.Queue = asyncio.Queue()
        opened = [asyncio.get_running_loop().create_future() for _ in requests]

        async def pump(i: int, job: Job) -> None:  # (owns its job: it closes it, whatever ends it)
            try:
                try:
                    await job.start()
                except Exception as exc:
                    opened[i].set_exception(exc)
                    return
                opened[i].set_result(None)
                async for piece in job:
                    await queue.put((i, piece))
                await queue.put((i, None))
            except Exception as exc:
                await queue.put((i, JobFailed(job, exc)))
            finally:
                if not opened[i].done():
                    opened[i].cancel()
                await job.aclose()  # its decoding slot goes to a prompt waiting for one

        prompts = cls(jobs, [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)], queue)
        outcomes = await asyncio.gather(*opened, return_exceptions=True)  # (no prompt is cut off mid-start)
        refused = [x for x in outcomes if isinstance(x, BaseException)]
        if refused:
            await prompts.aclose()
            raise refused[0]
        return prompts

    async def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """(prompt index, piece) of every job until all have ended; JobFailed when one raises."""
        if self._queue is None:
            try:
                async for piece in self.jobs[0]:
                    yield 0, piece
            except Exception as exc:
                raise JobFailed(self.jobs[0], exc) from exc
            return
        live = len(self.jobs)
        while live:
            i, item = await self._queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, JobFailed):
                raise item
            else:
                yield i, item

    async def aclose(self) -> None:
        """End the request: one job is closed here; several, by their own tasks (cancelled here),
        which close their jobs whatever ends them (the client going away, too)."""
        if not self._tasks:
            for job in self.jobs:
                await job.aclose()
            return
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# ------------------------------------------------------------------------------- response objects


def usage(*stats: dict | None) -> dict:
    """OpenAI's usage of one or more requests' stats (a completions body's prompts: summed)."""
    p = sum((s or {}).get("prompt_tokens", 0) for s in stats)
    c = sum((s or {}).get("generated_tokens", 0) for s in stats)
    cached = sum((s or {}).get("cached_tokens", 0) for s in stats)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def error_body(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(err: RequestError) -> JSONResponse:
    """An error of the handler's table in OpenAI's shape (429 with Retry-After, 401 with WWW-Authenticate)."""
    body = error_body(err.status, str(err), err.field, err.kind.openai_type)
    return JSONResponse(body, err.status, headers=ERROR_HEADERS.get(err.kind))


def model_card(handler: RequestHandler, name: str, created: int) -> dict:
    """One entry of /v1/models: OpenAI's fields, vLLM's `root` and `max_model_len`, and `viasd`."""
    info = handler.info()
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "via-sd",
        "root": info["verifier"],
        "parent": None,
        "max_model_len": info["max_context"] or None,
        "viasd": info,
    }


def token_text(tokenizer, token_id: int) -> str:
    """A token as text (as vLLM returns it); `token_id:N` for a model without a tokenizer."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


class Choices:
    """The choices of one response (n > 1: one per sample, by `index`): pieces in, OpenAI's
    choice objects out, streamed (`delta`) or whole (`add`, then `whole`).

    Logprobs take OpenAI's two shapes: chat `{"content": [{token, logprob, bytes, top_logprobs}]}`;
    completions `{tokens, token_logprobs, top_logprobs, text_offset}`, where `top_logprobs` maps
    token text to logprob for the k most likely tokens and the chosen one (as vLLM), and `echo`
    puts the prompt (text, tokens and, with logprobs, their logprobs: the first is null) first.
    """

    def __init__(self, job: Job, chat: bool, body: BaseModel, prompt: str | list | None = None, first: int = 0):
        self.job, self.chat, self.tokenizer = job, chat, job.handler.tokenizer
        self.first = first  # the index of this job's first choice (a completions body's prompt i: i * n)
        self.token_ids = bool(body.return_token_ids)
        self.echo = not chat and bool(getattr(body, "echo", None))
        self.logprobs = job.params.logprobs is not None
        self.prompt_text = ""
        if self.echo:
            decoded = self.tokenizer.decode(job.prompt_ids) if self.tokenizer is not None else ""
            self.prompt_text = prompt if isinstance(prompt, str) else decoded
        self._offset: dict[int, int] = {}  # choice -> characters of text so far (completions' text_offset)
        self._pieces: dict[int, list[Piece]] = {}  # whole responses: each choice's pieces

    def _choice(self, index: int, text: str, ids: list[int], entries: list | None, finish: str | None) -> dict:
        choice: dict[str, Any] = {"index": self.first + index, "logprobs": None, "finish_reason": finish}
        if self.logprobs and entries is not None:
            choice["logprobs"] = (
                self._chat_logprobs(entries) if self.chat else self._completion_logprobs(index, entries)
            )
        if self.token_ids:
            choice["token_ids"] = ids
        return choice

    def _with_prompt(self, piece: Piece, first: bool) -> tuple[str, list[int], list | None]:
        """A piece's text, ids and (token id, logprob) entries, after the echoed prompt's on a choice's first."""
        text, ids = piece.text, list(piece.token_ids)
        entries = [(t, e) for t, e in zip(ids, piece.logprobs or ())] if self.logprobs else None
        if self.echo and first:
            text = self.prompt_text + text
            if entries is not None:
                scored = piece.prompt_logprobs or [None] * len(self.job.prompt_ids)
                entries = [*zip(self.job.prompt_ids, scored), *entries]
        return text, ids, entries

    def delta(self, piece: Piece) -> dict:
        """A streamed chunk's choice."""
        first = piece.index not in self._offset
        self._offset.setdefault(piece.index, 0)
        text, ids, entries = self._with_prompt(piece, first)
        choice = self._choice(piece.index, text, ids, entries, piece.finish_reason)
        if self.chat:
            choice["delta"] = {"content": text} if text or not piece.finish_reason else {}
        else:
            choice["text"] = text
        if piece.finish_reason and len(self.job.samples) > 1:
            choice["viasd_stats"] = piece.stats
        return choice

    def add(self, piece: Piece) -> None:
        self._pieces.setdefault(piece.index, []).append(piece)

    def whole(self) -> list[dict]:
        """Every choice, in index order, of the pieces added."""
        out = []
        for index in sorted(self._pieces):
            pieces = self._pieces[index]
            merged = Piece(
                "".join(p.text for p in pieces),
                [t for p in pieces for t in p.token_ids],
                next((p.finish_reason for p in pieces if p.finish_reason), None),
                next((p.stats for p in pieces if p.finish_reason), None),
                index=index,
                logprobs=[e for p in pieces for e in p.logprobs or ()],
                prompt_logprobs=next((p.prompt_logprobs for p in pieces if p.prompt_logprobs is not None), None),
            )
            choice = self.delta(merged)
            if self.chat:
                choice["message"] = {"role": "assistant", "content": choice.pop("delta").get("content", "")}
            out.append(choice)
        return out

    def _chat_logprobs(self, entries: list) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = token_text(self.tokenizer, token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**item(t, e.logprob), "top_logprobs": [item(*a) for a in e.top]} for t, e in entries]}

    def _completion_logprobs(self, index: int, entries: list) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, e in entries:
            text = token_text(self.tokenizer, token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self._offset[index])
            self._offset[index] += len(text)
            out["token_logprobs"].append(e.logprob if e is not None else None)
            top = None
            if e is not None:
                top = {token_text(self.tokenizer, t): lp for t, lp in e.top}
                top.setdefault(text, e.logprob)
            out["top_logprobs"].append(top)
        return out


# ------------------------------------------------------------------------------------ the routes


OPEN_PATHS = ("/health", "/metrics")  # served without a token (probes, Prometheus)


def build_http_app(server: RequestHandler, token: str | None = None):
    """The FastAPI app over `server` (a replica's `RequestHandler`, kept in `app.state.server`),
    requiring the bearer token `token` (None: no authentication)."""
    app = FastAPI(title="via-sd", description="OpenAI-compatible API of a via-sd pipeline", version="1")
    app.state.server, app.state.token = server, token

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        """With a token configured (app.state.token), every route but /health and /metrics needs
        `Authorization: Bearer <token>` (constant-time comparison), else 401 in OpenAI's shape; then
        bodies past MAX_BODY_BYTES (by their Content-Length) are refused with 413 before they are read."""
        if not request.url.path.rstrip("/").endswith(OPEN_PATHS):
            try:
                authenticate(request.headers.get("authorization"), getattr(request.app.state, "token", None))
            except RequestError as exc:
                return error_response(exc)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            message = f"body: {length} bytes, more than the {MAX_BODY_BYTES} allowed"
            return JSONResponse(error_body(413, message, "body"), status_code=413)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc) or None
        msg = err.get("msg", "invalid request body")
        if err.get("type") == "json_invalid":  # loc is a character position: the body as a whole is at fault
            field, msg = "body", f"not valid JSON ({msg}, at character {loc[0] if loc else '?'})"
        return JSONResponse(error_body(400, f"{field}: {msg}" if field else msg, field), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # e.g. a body that is not UTF-8
        field = "body" if exc.status_code == 400 else None
        message = f"body: {exc.detail}" if field else str(exc.detail)
        return JSONResponse(error_body(exc.status_code, message, field), exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestError)  # (counted where it was raised)
    async def _request_error(request: Request, exc: RequestError):
        return error_response(exc)

    @app.exception_handler(InvalidParameterError)  # a bad field found by a route: counted here
    async def _invalid_parameter(request: Request, exc: InvalidParameterError):
        return error_response(server(request).refuse(exc))

    def server(request: Request, model: str | None = None) -> RequestHandler:
        """The replica's handler; RequestError (counted) when it does not serve `model`."""
        handler = request.app.state.server
        try:
            handler.check_model(model)
        except RequestError as exc:
            raise handler.refuse(exc) from None
        return handler

    async def _serve(request: Request, body: BaseModel, chat: bool):
        handler = server(request)
        translated, ignored = request_of(body, chat)
        prompts = await Prompts.open(handler, translated)  # validated and admitted, or RequestError
        texts = [None] if chat else prompts_of(body)
        choices = [Choices(job, chat, body, t, i * job.params.n) for i, (job, t) in enumerate(zip(prompts.jobs, texts))]
        headers = {IGNORED_FIELDS_HEADER: ",".join(ignored)} if ignored else None
        if body.stream:
            return StreamingResponse(
                _stream(prompts, choices, chat, body), media_type="text/event-stream", headers=headers
            )
        return JSONResponse(await _whole(prompts, choices, chat), headers=headers)

    async def _stream(prompts: Prompts, choices: list[Choices], chat: bool, body: BaseModel) -> AsyncIterator[bytes]:
        """OpenAI's stream: a chunk per piece of any prompt's choices; with `include_usage`, every
        chunk has `usage: null` and one last chunk, with no choices, the usage of the whole request."""
        jobs = prompts.jobs
        base = {"id": jobs[0].id, "created": jobs[0].created, "model": jobs[0].model}
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        extra = {"usage": None} if include_usage else {}
        try:
            try:
                if chat:  # the first chunk of each choice announces the role, as OpenAI does
                    for i in range(jobs[0].params.n):
                        delta = {"role": "assistant", "content": ""}
                        first = [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]
                        yield sse({**base, "object": obj, "choices": first, **extra})
                async for i, piece in prompts.pieces():
                    chunk = {**base, "object": obj, "choices": [choices[i].delta(piece)], **extra}
                    if piece.finish_reason:
                        chunk["viasd_stats"] = piece.stats
                    yield sse(chunk)
                if include_usage:
                    yield sse({**base, "object": obj, "choices": [], "usage": usage(*(j.stats for j in jobs))})
            except JobFailed as failed:  # after the headers: report in-band, like OpenAI's streaming errors
                err = await failed.job.fail(failed.error)
                yield sse(error_body(err.status, str(err), err.field, err.kind.openai_type))
            # [DONE] goes out while the request still counts as in flight: a drain waits for it
            yield sse("[DONE]")
        finally:
            await prompts.aclose()

    async def _whole(prompts: Prompts, choices: list[Choices], chat: bool) -> dict:
        jobs = prompts.jobs
        try:
            async for i, piece in prompts.pieces():
                choices[i].add(piece)
        except JobFailed as failed:
            raise await failed.job.fail(failed.error) from None
        finally:
            await prompts.aclose()
        return {
            "id": jobs[0].id,
            "object": "chat.completion" if chat else "text_completion",
            "created": jobs[0].created,
            "model": jobs[0].model,
            "choices": [choice for c in choices for choice in c.whole()],
            "usage": usage(*(j.stats for j in jobs)),
            "viasd_stats": jobs[0].stats if len(jobs) == 1 else [j.stats for j in jobs],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(request, body, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        handler, created = server(request), int(time.time())
        names = [handler.name, *(n for n in handler.aliases if n != handler.name)]
        return {"object": "list", "data": [model_card(handler, n, created) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        return model_card(server(request, model_id), model_id, int(time.time()))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        handler = server(request, body.model)
        messages = [m.as_dict() for m in body.messages] if body.messages else None
        ids = await asyncio.to_thread(handler.tokenize, body.prompt, messages)
        return {"count": len(ids), "max_model_len": handler.max_context, "tokens": ids}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        return server(request).tokenizer_info()

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        return {"prompt": await asyncio.to_thread(server(request, body.model).detokenize, body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": viasd.__version__}

    @app.get("/health")
    async def health(request: Request):
        ok, detail = await server(request).health()
        return JSONResponse(detail, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        body, content_type = server(request).metrics.exposition()
        return Response(body, media_type=content_type)

    return app
