"""One replica's request handling, independent of Ray and of the transport.

`ReplicaServer` owns one pipeline (drafter + verifier group + coordinator, or the in-process
engine) and does, for every request: validation with the field named, admission (a bounded
number decoding at once, a bounded queue, 429 / RESOURCE_EXHAUSTED past it), tokenization and
the chat template, incremental detokenization and stop strings, metrics, and cancellation (closing
a request's stream aborts it in the pipeline). The HTTP routes (`openai_api`) and the gRPC
methods of the Serve deployment (`app`) are thin layers over it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from viasd.cluster.guard import SHUTTING_DOWN, Aborted, Calls, until_aborted
from viasd.config import GenerationParams, parse_params
from viasd.errors import InvalidParameterError
from viasd.llm import IncrementalDetokenizer, encode_prompt


#: Seconds a client refused with 429 / RESOURCE_EXHAUSTED (the queue is full) should wait before it
#: tries again: HTTP's ``Retry-After`` header and gRPC's trailing metadata RETRY_AFTER_KEY (in ms).
RETRY_AFTER_S = 1
RETRY_AFTER_KEY = "viasd-retry-after-ms"  # the client's twin: viasd.client.errors.RETRY_AFTER_KEY


def retry_after_metadata() -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a RESOURCE_EXHAUSTED that tells the client when to try again."""
    return ((RETRY_AFTER_KEY, str(RETRY_AFTER_S * 1000)),)


class RequestError(Exception):
    """A request that cannot be served: HTTP status, the field at fault, OpenAI's error type."""

    def __init__(self, status: int, message: str, field: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.field = field
        self.kind = kind

    @classmethod
    def invalid(cls, exc: InvalidParameterError) -> "RequestError":
        return cls(400, str(exc), exc.field)

    @classmethod
    def of(cls, exc: BaseException) -> "RequestError":
        """The HTTP view of an error raised while serving: 400 for a bad field, 503 when a
        pipeline actor is down or too slow, 500 otherwise."""
        from viasd.actors.coordinator import BackendError

        if isinstance(exc, RequestError):
            return exc
        if isinstance(exc, InvalidParameterError):
            return cls.invalid(exc)
        if isinstance(exc, BackendError):
            return cls(503 if exc.unavailable else 500, str(exc), kind="server_error")
        return cls(500, f"{type(exc).__name__}: {exc}", kind="server_error")


_STATUS = {400: "invalid", 404: "invalid", 429: "rejected", 503: "unavailable"}  # metrics label of an HTTP status


class Admission:
    """At most `max_running` requests decode at once; at most `max_waiting` wait for a slot.

    A request past both limits is refused at once (429 / RESOURCE_EXHAUSTED) rather than queued
    without bound: the router and the autoscaler then see the pressure.
    """

    def __init__(self, max_running: int, max_waiting: int, on_change=None, on_admit=None):
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self.waiting = 0
        self._sem: asyncio.Semaphore | None = None
        self._on_change = on_change or (lambda running, waiting: None)
        self._on_admit = on_admit or (lambda seconds: None)  # the queue time of each admitted request

    async def enter(self) -> float:
        """Wait for a slot (RequestError 429 when the queue is full); returns the seconds waited."""
        if self._sem is None:  # bound to the loop that serves requests
            self._sem = asyncio.Semaphore(self.max_running)
        if self.running >= self.max_running and self.waiting >= self.max_waiting:
            raise RequestError(
                429,
                f"server busy: {self.running} requests decoding and {self.waiting} queued "
                f"(limits.max_concurrent_requests={self.max_running}, limits.max_queued_requests={self.max_waiting})",
                kind="rate_limit_exceeded",
            )
        self.waiting += 1
        self._on_change(self.running, self.waiting)
        t0 = time.perf_counter()
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        self._on_change(self.running, self.waiting)
        queued = time.perf_counter() - t0
        self._on_admit(queued)
        return queued

    def leave(self) -> None:
        self.running -= 1
        self._sem.release()
        self._on_change(self.running, self.waiting)


@dataclass
class Piece:
    """Text and tokens of one streamed step; the last piece has the finish reason and stats."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict | None = None


def prompt_ids_of(tokenizer, prompt: str | Sequence[int] | None = None, messages: list[dict] | None = None) -> list[int]:
    """Token ids of a text prompt, pre-tokenized ids, or chat messages (the model's chat template).

    Text and messages go through `viasd.llm.encode_prompt`, as in the in-process engine and the
    gRPC servicer, so that every entry point tokenizes the same text the same way.
    """
    if messages is not None:
        if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            raise InvalidParameterError("messages", "this model has no chat template; send a prompt instead")
        return encode_prompt(tokenizer, None, messages)
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt)
    ids = list(prompt or [])
    if not ids:
        raise InvalidParameterError("prompt", "must contain at least one token")
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
        raise InvalidParameterError("prompt", "token ids must be non-negative integers")
    return ids


class Job:
    """One admitted request's output stream (async iterator of `Piece`); `aclose()` ends it."""

    def __init__(self, server: "ReplicaServer", request_id: str, prompt_ids: list[int], params: GenerationParams,
                 stops: list[str], *, model: str, chat: bool = False, include_usage: bool = False,
                 return_token_ids: bool = False):
        from viasd.cluster.openai_api import StopStrings

        self.server = server
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.prompt_ids = prompt_ids
        self.params = params
        self.chat = chat
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.stats: dict | None = None
        self.finish_reason: str | None = None
        self._stops = StopStrings(stops)
        tok = server.tokenizer
        self._detok = IncrementalDetokenizer(tok) if tok is not None else None
        self._timer = server.metrics.timer()
        self._gen: AsyncIterator | None = None
        self._first: Piece | None = None
        self._admitted = False
        self._queued = 0.0  # seconds waited for admission
        self._closed = False
        self._generated = 0
        self._abort = server.calls.enter()  # set when a drain runs out of time: end with `abort`

    async def start(self) -> None:
        """Admit the request and wait for its first step, so that a request the pipeline refuses
        fails before any response header is sent (and streams then start with real tokens)."""
        try:
            self._queued = await until_aborted(self.server.admission.enter(), self._abort)
        except Aborted:  # drained while waiting for a slot
            await self.aclose(record=False)
            err = RequestError(503, SHUTTING_DOWN, kind="service_unavailable")
            self.server.count_error(err)
            raise err from None
        except BaseException:
            await self.aclose(record=False)
            raise
        self._admitted = True
        self._gen = self.server.pipeline.coordinator.generate(self.id, self.prompt_ids, self.params)
        try:
            self._first = await self._step()
        except Exception as exc:
            err = RequestError.of(exc)
            self.server.count_error(err)
            await self.aclose(record=False)
            raise err from None
        except BaseException:
            await self.aclose(record=False)
            raise

    async def _step(self) -> Piece | None:
        if self.finish_reason is not None:
            return None
        try:
            chunk = await until_aborted(self._gen.__anext__(), self._abort)
        except StopAsyncIteration:  # the pipeline ended without a final chunk: aborted
            self.finish_reason = "abort"
            self._timer.finish(None, "abort")
            return Piece("", [], "abort", self.stats)
        except Aborted:  # the server drained and this request's time is up
            self.finish_reason = "abort"
            self.stats = {"prompt_tokens": len(self.prompt_ids), "generated_tokens": self._generated,
                          "finish_reason": "abort", "stopped_by": "drain"}
            self._timer.finish(None, "abort")
            return Piece("", [], "abort", self.stats)
        ids = [int(t) for t in chunk.token_ids]
        self._generated += len(ids)
        self._timer.tokens(len(ids))
        text = self._detok.push(ids, final=chunk.finished) if self._detok is not None else ""
        text, hit = self._stops.push(text, final=chunk.finished)
        if hit:  # a stop string: cut the text, end the request in the pipeline
            self.finish_reason = "stop"
            self.stats = {"prompt_tokens": len(self.prompt_ids), "generated_tokens": self._generated,
                          "finish_reason": "stop", "stopped_by": "stop string"}
            self._timer.finish(None, "stop")
            return Piece(text, ids, "stop", self.stats)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            if chunk.stats is not None:
                chunk.stats.queue_seconds += self._queued  # admission + (in-process) the scheduler's queue
            self.stats = chunk.stats.to_dict() if chunk.stats is not None else None
            self._timer.finish(chunk.stats, chunk.finish_reason)
            return Piece(text, ids, chunk.finish_reason, self.stats)
        return Piece(text, ids)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Piece:
        if self._first is not None:
            piece, self._first = self._first, None
            return piece
        piece = await self._step() if not self._closed else None
        if piece is None:
            raise StopAsyncIteration
        return piece

    async def aclose(self, record: bool = True) -> None:
        """End the request: close its stream (the pipeline aborts it and frees its caches)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._gen is not None and hasattr(self._gen, "aclose"):
                await self._gen.aclose()
        finally:
            if record and self.finish_reason is None:  # the client went away mid-stream
                self._timer.finish(None, "abort")
            if self._admitted:
                self.server.admission.leave()
            self.server.calls.leave(self._abort)


class ReplicaServer:
    """Serves one pipeline: validation, admission, tokenization, streaming and metrics."""

    def __init__(self, pipeline, name: str, *, default_params: dict[str, Any] | None = None,
                 max_concurrent_requests: int = 4, max_queued_requests: int = 16, metrics=None,
                 admission: Admission | None = None):
        from viasd.cluster.metrics import ServingMetrics

        self.pipeline = pipeline
        self.name = name
        self.tokenizer = getattr(pipeline, "tokenizer", None)
        info = pipeline.info()
        self.max_context = info.get("max_context") or None
        base = {"mode": info["default_mode"]} if info.get("default_mode") else {}
        self.default_params = {**base, **(default_params or {})}
        parse_params(self.default_params)  # fail at start-up, not on the first request
        self.metrics = metrics or ServingMetrics(name)
        # its own limits, or an admission shared with other entry points (the standalone server's gRPC)
        self.admission = admission or Admission(max_concurrent_requests, max_queued_requests, self.metrics.set_queue,
                                                self.metrics.queue_time)
        self.metrics.set_queue(0, 0)
        self.calls = Calls()  # every request in flight on this replica, HTTP and gRPC: for `drain`

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests (HTTP 503 / gRPC UNAVAILABLE), let the running ones finish for up to
        `timeout_s`, then end the rest with finish reason `abort`; returns how many were aborted."""
        return await self.calls.drain(timeout_s)

    def check_accepting(self) -> None:
        if self.calls.draining:
            raise RequestError(503, SHUTTING_DOWN, kind="service_unavailable")

    def count_error(self, err: RequestError) -> None:
        self.metrics.error(_STATUS.get(err.status, "internal"))

    def model_infos(self) -> list[dict]:
        return [self.pipeline.info()]

    def params(self, values: dict[str, Any]) -> GenerationParams:
        """The server's defaults overridden by the request's values; InvalidParameterError names the field."""
        return parse_params({**self.default_params, **values})

    def check_model(self, model: str | None) -> None:
        if model and model != self.name:
            raise RequestError(404, f"model {model!r} is not served here; /v1/models lists {self.name!r}",
                               "model", "model_not_found")

    async def open_openai(self, body, chat: bool) -> Job:
        """Validate an OpenAI request body, admit it and start it; RequestError when refused."""
        from viasd.cluster.openai_api import _stops, param_values, unsupported

        try:
            self.check_accepting()
            bad = unsupported(body)
            if bad:
                raise InvalidParameterError(*bad)
            self.check_model(body.model)
            params = self.params(param_values(body))
            if chat:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                prompt_ids = await asyncio.to_thread(prompt_ids_of, self.tokenizer, None, messages)
            else:
                prompt = body.prompt
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                    if len(prompt) != 1:
                        raise InvalidParameterError("prompt", "only one prompt per request is served")
                    prompt = prompt[0]
                prompt_ids = await asyncio.to_thread(prompt_ids_of, self.tokenizer, prompt)
            self.check_context(prompt_ids)
        except InvalidParameterError as exc:
            self.metrics.error("invalid")
            raise RequestError.invalid(exc) from None
        except RequestError as exc:
            self.count_error(exc)
            raise
        job = Job(self, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, prompt_ids, params, _stops(body.stop),
                  model=self.name, chat=chat, include_usage=bool(body.stream_options and body.stream_options.include_usage),
                  return_token_ids=body.return_token_ids)
        try:
            await job.start()
        except RequestError as exc:
            if exc.status == 429:  # refused by admission (errors after it are counted by the job)
                self.metrics.error("rejected")
            raise
        return job

    def check_context(self, prompt_ids: list[int]) -> None:
        if self.max_context and len(prompt_ids) >= self.max_context:
            raise InvalidParameterError(
                "prompt", f"{len(prompt_ids)} tokens leave no room in the context of {self.max_context}")
        # token ids outside the vocabulary are refused by the pipeline (field "prompt")

    async def health(self, timeout_s: float = 10.0) -> tuple[bool, dict]:
        """(healthy, detail): every actor of the pipeline answers (its session counts) in time."""
        probe = getattr(self.pipeline, "session_counts", None)
        detail = {"model": self.name, "running": self.admission.running, "waiting": self.admission.waiting}
        try:
            if probe is not None:
                detail["sessions"] = await asyncio.wait_for(probe(), timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported, not raised: this is the health probe
            return False, {"status": "unhealthy", **detail, "error": f"{type(exc).__name__}: {exc}"}
        return True, {"status": "ok", **detail}
