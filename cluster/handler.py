"""The request handler: one request's lifecycle, the same for every transport (docs/ARCHITECTURE.md,
"The request path").

`RequestHandler` owns one pipeline backend (`Backend`: the Ray actors of `cluster/pipeline.py`
or the in-process engine of `cluster/local.py`) and knows nothing of HTTP or gRPC:

* input: a `Request` (a prompt, chat messages or token ids, plus parameter overrides);
* output: a `Job`, an async iterator of `Piece` (text delta, token ids; the last one has the
  finish reason and the statistics); closing it aborts the request in the pipeline;
* errors: `RequestError`, whose `ErrorKind` is one row of the error table `ERRORS` (HTTP status,
  gRPC status code name, metrics label, OpenAI error type); `error_of` maps any exception to it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from viasd.cluster.guard import MAX_REQUEST_ID_CHARS, SHUTTING_DOWN, Aborted, Calls, until_aborted
from viasd.cluster.pipeline import PipelineConfig
from viasd.cluster.serving_metrics import ServingMetrics
from viasd.config import GenerationParams, parse_params
from viasd.engine import AsyncEngine, Chunk
from viasd.errors import BackendError, InvalidParameterError
from viasd.llm import IncrementalDetokenizer, StopStrings, encode_prompt
from viasd.metrics import RequestStats, TokenLogprob

#: Seconds a client refused with 429 / RESOURCE_EXHAUSTED (the queue is full) should wait before it
#: tries again: HTTP's ``Retry-After`` header and gRPC's trailing metadata (viasd.client.errors.RETRY_AFTER_KEY, ms).
RETRY_AFTER_S = 1


# ------------------------------------------------------------------------------- the error table


@dataclass(frozen=True)
class ErrorKind:
    """One row of the error table: how each transport and the metrics report an error."""

    label: str  # `request_errors_total{status=...}`
    http: int  # HTTP status
    grpc: str  # grpc.StatusCode name
    openai_type: str  # OpenAI's `error.type`


INVALID = ErrorKind("invalid", 400, "INVALID_ARGUMENT", "invalid_request_error")  # a bad field (named)
MODEL_NOT_FOUND = ErrorKind("invalid", 404, "INVALID_ARGUMENT", "model_not_found")  # `model` names no pipeline
UNAUTHENTICATED = ErrorKind("unauthenticated", 401, "UNAUTHENTICATED", "authentication_error")  # no or a wrong token
REJECTED = ErrorKind("rejected", 429, "RESOURCE_EXHAUSTED", "rate_limit_exceeded")  # the queue is full: retry later
SHUTTING = ErrorKind("unavailable", 503, "UNAVAILABLE", "service_unavailable")  # draining: go elsewhere
UNAVAILABLE = ErrorKind("unavailable", 503, "UNAVAILABLE", "server_error")  # a pipeline actor is down or too slow
INTERNAL = ErrorKind("internal", 500, "INTERNAL", "server_error")  # a bug or a broken backend
ERRORS = (INVALID, MODEL_NOT_FOUND, UNAUTHENTICATED, REJECTED, SHUTTING, UNAVAILABLE, INTERNAL)


class RequestError(Exception):
    """A request that cannot be served: its row of the error table, a message, the field at fault."""

    def __init__(self, kind: ErrorKind, message: str, field: str | None = None):
        super().__init__(message)
        self.kind, self.field = kind, field

    @property
    def status(self) -> int:
        """The HTTP status."""
        return self.kind.http


class DrainedError(RequestError):
    """The server drained while the request waited for admission: HTTP 503; the gRPC stream ends with
    a last message of finish reason `abort`, as that of a request drained while running."""

    def __init__(self, request_id: str):
        super().__init__(SHUTTING, SHUTTING_DOWN)
        self.request_id = request_id


def error_of(exc: BaseException) -> RequestError:
    """The table's view of an error raised while serving: INVALID for a bad field (InvalidParameterError),
    UNAVAILABLE when a pipeline actor is down or too slow, INTERNAL otherwise."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, InvalidParameterError):
        return RequestError(INVALID, str(exc), exc.field)
    if isinstance(exc, BackendError):
        return RequestError(UNAVAILABLE if exc.unavailable else INTERNAL, str(exc))
    return RequestError(INTERNAL, f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------- the backends


class Backend(Protocol):
    """A running pipeline as the handler and the deployments use it (`pipeline.Pipeline`,
    `local.LocalPipeline`); the defaults suit one living and dying with this process."""

    config: PipelineConfig
    tokenizer: Any  # a transformers tokenizer, or None for tokenizer-less (test) models
    coordinator: AsyncEngine  # the pipeline's engine as asyncio streams

    def info(self) -> dict:
        """What ListModels and /v1/models report (the ModelInfo fields)."""
        ...

    async def session_counts(self) -> dict:
        """Open sessions per component; raises when a component does not answer (the health probe)."""
        return {}

    async def supervise(self, on_health=None) -> None:
        """Repair the backend while it runs (returns at once when there is nothing to repair)."""

    def wake(self) -> None:
        """Make `supervise` check now."""

    def status(self) -> dict:
        """For operators: process ids, rebuilds, requests taken."""
        return {"pids": {}, "rebuilds": {}, "requests": None}

    async def shutdown(self) -> None: ...


def model_names(config: PipelineConfig) -> tuple[str, ...]:
    """The names a pipeline answers to, the served name first: `served_model_name`, else the
    verifier's name for the unnamed pipeline `default` (as vLLM serves the model path), else the
    pipeline's name; then the pipeline's name and the aliases."""
    served = config.served_model_name or (config.engine.verifier if config.name == "default" else config.name)
    return tuple(dict.fromkeys((served, config.name, *config.aliases)))


# ------------------------------------------------------------------------------- admission


class Admission:
    """At most `max_running` requests decode at once; at most `max_waiting` wait for a slot.

    A request past both limits is refused at once (429 / RESOURCE_EXHAUSTED) rather than queued
    without bound: the router and the autoscaler then see the pressure.
    """

    def __init__(self, max_running: int, max_waiting: int, on_change=None):
        self.max_running, self.max_waiting = max_running, max_waiting
        self.running = self.waiting = 0
        self._sem: asyncio.Semaphore | None = None
        self._on_change = on_change or (lambda running, waiting: None)

    async def enter(self) -> None:
        if self._sem is None:  # bound to the loop that serves requests
            self._sem = asyncio.Semaphore(self.max_running)
        if self.running >= self.max_running and self.waiting >= self.max_waiting:
            raise RequestError(
                REJECTED,
                f"server busy: {self.running} requests decoding and {self.waiting} queued "
                f"(limits.max_concurrent_requests={self.max_running}, limits.max_queued_requests={self.max_waiting})",
            )
        self.waiting += 1
        self._on_change(self.running, self.waiting)
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        self._on_change(self.running, self.waiting)

    def leave(self) -> None:
        self.running -= 1
        self._sem.release()
        self._on_change(self.running, self.waiting)


UNLIMITED = 1 << 30  # admission of a handler given no limits (Serve's router bounds what reaches it)


# ------------------------------------------------------------------------------- requests


@dataclass
class Request:
    """What a transport hands the handler: one input and the parameters the client set."""

    prompt: str | list[int] | None = None  # text, or token ids
    messages: list[dict] | None = None  # chat messages {"role", "content"}, rendered with the chat template
    params: dict[str, Any] = field(default_factory=dict)  # GenerationParams fields the client set
    model: str | None = None  # a name the pipeline answers to; None / "": this one
    request_id: str | None = None  # echoed; None: a fresh one (prefixed with `id_prefix`)
    id_prefix: str = ""
    fill_context: bool = False  # no max_tokens anywhere: the rest of the context, within limits.max_tokens_default


@dataclass
class Piece:
    """One streamed step of one sample; a sample's last piece has its finish reason and statistics."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict | None = None  # JSON view (RequestStats.to_dict, or the counts of a request cut short)
    request_stats: RequestStats | None = None  # the pipeline's statistics when it finished the request
    index: int = 0  # which sample (choice) of an n > 1 request
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # a sample's first piece (params.prompt_logprobs)


class _Sample:
    """What the handler tracks of one sample: its detokenizer and stop strings, how far it is."""

    def __init__(self, tokenizer, params: GenerationParams):
        self.stops = StopStrings(params.stop or ())
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.generated = 0
        self.finish_reason: str | None = None
        self.stats: dict | None = None
        self.request_stats: RequestStats | None = None


def prompt_ids_of(
    tokenizer, prompt: str | Sequence[int] | None = None, messages: list[dict] | None = None
) -> list[int]:
    """Token ids of a text prompt, pre-tokenized ids, or chat messages (the model's chat template),
    through `viasd.llm.encode_prompt` as in the in-process engine: every entry point tokenizes alike."""
    if messages is not None:
        if tokenizer is not None and not tokenizer.chat_template:
            raise InvalidParameterError("messages", "this model has no chat template; send a prompt instead")
        return encode_prompt(tokenizer, None, messages)
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt)
    return list(prompt or [])  # (checked with the parameters: `RequestHandler.prepare`)


class Job:
    """One admitted request's output stream (async iterator of `Piece`); `aclose()` ends it.

    n > 1: the pieces of every sample, interleaved as the pipeline commits them (`piece.index`);
    the job ends when every sample has; `stats` is then the whole request's (usage: the prompt
    once, the tokens of every sample) with each sample's statistics under "samples"."""

    def __init__(self, handler: RequestHandler, request_id: str, prompt_ids: list[int], params: GenerationParams):
        self.handler = handler
        self.id = request_id
        self.model = handler.name
        self.created = int(time.time())
        self.prompt_ids = prompt_ids
        self.params = params
        self.stats: dict | None = None
        self.finish_reason: str | None = None  # set when every sample has finished (sample 0's reason)
        self.samples = [_Sample(handler.tokenizer, params) for _ in range(params.n)]
        self._timer = handler.metrics.timer()
        self._gen: AsyncIterator[Chunk] | None = None
        self._first: Piece | None = None
        self._admitted = False
        self._closed = False
        self._held = 0  # KV positions this request holds (prompt + generated)
        self._queued = 0.0  # seconds waited for admission
        self._abort = handler.calls.enter()  # set when a drain runs out of time: end with `abort`
        self._queue: list[Piece] = []  # last pieces of samples ended together, not yet handed out

    async def start(self) -> None:
        """Admit the request and wait for its first step, so that a request the pipeline refuses
        fails before any response header is sent (and streams then start with real tokens)."""
        try:
            await until_aborted(self.handler.admission.enter(), self._abort)
            self._admitted = True
            self._timer.admitted()
            self._queued = self._timer.start - self._timer.arrival  # seconds waited for a decoding slot
            self._hold(len(self.prompt_ids))
            self._gen = self.handler.backend.coordinator.generate(self.id, self.prompt_ids, self.params)
            self._first = await self._step()
        except BaseException as exc:
            await self.aclose(record=False)
            if isinstance(exc, Aborted):  # drained while waiting for a slot
                exc = DrainedError(self.id)
            if not isinstance(exc, Exception):
                raise
            raise self.handler.refuse(exc) from None

    def _end(self, index: int, reason: str, stats: dict | None, request_stats: RequestStats | None = None) -> Piece:
        """A sample's last piece is made: record it, and the request's end once every sample has ended."""
        sample = self.samples[index]
        sample.finish_reason, sample.stats, sample.request_stats = reason, stats, request_stats
        if all(s.finish_reason is not None for s in self.samples):
            first = self.samples[0]
            self.finish_reason = first.finish_reason
            if len(self.samples) == 1:
                self.stats = first.stats
            else:
                generated = sum(s.generated for s in self.samples)
                self.stats = self._counts(generated, first.finish_reason, samples=[s.stats for s in self.samples])
            self._timer.finish([s.request_stats for s in self.samples], self.finish_reason)
            coordinator = self.handler.backend.coordinator
            self.handler.metrics.set_planner(coordinator.planner_state())
            totals = getattr(coordinator.engine.executor, "totals", None)  # (the served executor's calls)
            if totals is not None:
                self.handler.metrics.set_steps(totals.steps, totals.phases())
        return Piece("", [], reason, stats, request_stats, index=index)

    def _counts(self, generated: int, reason: str, **more) -> dict:
        """The statistics the handler gives what the pipeline sent none for: the token counts."""
        return {"prompt_tokens": len(self.prompt_ids), "generated_tokens": generated, "finish_reason": reason, **more}

    def _cut(self, index: int, reason: str, stopped_by: str) -> Piece:
        """The last piece of a sample the handler ended itself (a stop string, a drain)."""
        return self._end(index, reason, self._counts(self.samples[index].generated, reason, stopped_by=stopped_by))

    def _abort_all(self, stopped_by: str | None) -> Piece | None:
        """End every sample still running (the pipeline ended, or the drain's time is up): their
        last pieces; the first is returned, the others are queued."""
        pieces = []
        for i, s in enumerate(self.samples):
            if s.finish_reason is None:
                pieces.append(self._cut(i, "abort", stopped_by) if stopped_by else self._end(i, "abort", None))
        self._queue.extend(pieces[1:])
        return pieces[0] if pieces else None

    async def _step(self) -> Piece | None:
        if self._queue:
            return self._queue.pop(0)
        if self.finish_reason is not None:
            return None
        while True:
            try:
                chunk = await until_aborted(self._gen.__anext__(), self._abort)
            except StopAsyncIteration:  # the pipeline ended without a final chunk: aborted
                return self._abort_all(None)
            except Aborted:  # the server drained and this request's time is up
                return self._abort_all("drain")
            sample = self.samples[chunk.index]
            if sample.finish_reason is None:  # (a sample already cut by a stop string sends no more)
                return self._piece(chunk.index, sample, chunk)

    def _piece(self, index: int, sample: _Sample, chunk: Chunk) -> Piece:
        ids = [int(t) for t in chunk.token_ids]
        sample.generated += len(ids)
        self._hold(len(ids))
        self._timer.tokens(len(ids))
        text = sample.detok.push(ids, final=chunk.finished) if sample.detok is not None else ""
        text, hit = sample.stops.push(text, final=chunk.finished)
        piece = Piece(text, ids, index=index, logprobs=chunk.logprobs, prompt_logprobs=chunk.prompt_logprobs)
        if hit:  # a stop string: cut the text, end the sample in the pipeline
            last = self._cut(index, "stop", "stop string")
            if self.finish_reason is None:  # other samples go on
                self.handler.backend.coordinator.stop_sample(self.id, index)
        elif chunk.finished:
            if chunk.stats is not None:
                chunk.stats.queue_seconds += self._queued  # admission here + (in-process) the scheduler's queue
            stats = chunk.stats.to_dict() if chunk.stats is not None else None
            last = self._end(index, chunk.finish_reason, stats, chunk.stats)
        else:
            return piece
        piece.finish_reason, piece.stats, piece.request_stats = last.finish_reason, last.stats, last.request_stats
        return piece

    def _hold(self, positions: int) -> None:
        self._held += positions
        self.handler.hold_kv(positions)

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

    async def fail(self, exc: BaseException) -> RequestError:
        """An error after the stream started: counted, the request ended; the error to report."""
        err = self.handler.refuse(exc)
        await self.aclose()
        return err

    async def aclose(self, record: bool = True) -> None:
        """End the request: close its stream (the pipeline aborts it and frees its caches)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._gen is not None:
                await self._gen.aclose()
        finally:
            if record and self.finish_reason is None:  # the client went away mid-stream
                self._timer.finish([], "abort")
            if self._admitted:
                self._hold(-self._held)
                self.handler.admission.leave()
            self.handler.calls.leave(self._abort)


class RequestHandler:
    """Serves one pipeline backend: defaults, validation, admission, tokenization, streaming, metrics, drain.

    `admission` and `calls` may be shared by the handlers of one server (the standalone server's
    pipelines share one limit and one drain); by default each handler has its own.
    """

    def __init__(
        self,
        backend: Backend,
        name: str | None = None,
        *,
        default_params: dict[str, Any] | None = None,
        max_concurrent_requests: int = 4,
        max_queued_requests: int = 16,
        max_tokens_default: int = 2048,
        metrics: ServingMetrics | None = None,
        admission: Admission | None = None,
        calls: Calls | None = None,
    ):
        self.backend = backend
        self.names = model_names(backend.config)
        self.name = name or self.names[0]
        self.aliases = backend.config.aliases
        if name and name not in self.names:
            self.names = (name, *self.names)
        self.tokenizer = backend.tokenizer
        info = backend.info()
        self.max_context = info.get("max_context") or None
        base = {"mode": info["default_mode"]} if info.get("default_mode") else {}
        self.default_params = {**base, **(default_params or {})}
        parse_params(self.default_params)  # fail at start-up, not on the first request
        self.max_tokens_default = max_tokens_default
        self.metrics = metrics or ServingMetrics(self.name)
        self.admission = admission or Admission(max_concurrent_requests, max_queued_requests, self.metrics.set_queue)
        self.metrics.set_queue(0, 0)
        # KV usage: positions the requests in flight hold over the pipeline's capacity (its own
        # figure, else one context per decoding slot)
        self.kv_capacity = info.get("kv_capacity_tokens") or (self.admission.max_running * (self.max_context or 0))
        self.kv_held = 0
        self.calls = calls if calls is not None else Calls()  # requests in flight, HTTP and gRPC: for `drain`

    def hold_kv(self, positions: int) -> None:
        """A request took (or, negative, gave back) KV-cache positions."""
        self.kv_held += positions
        if self.kv_capacity and self.kv_capacity < UNLIMITED:
            self.metrics.set_kv_usage(min(1.0, self.kv_held / self.kv_capacity))

    def refuse(self, exc: BaseException) -> RequestError:
        """The table's error of a request that failed (`error_of`), counted."""
        err = error_of(exc)
        self.metrics.error(err.kind.label)
        return err

    def info(self) -> dict:
        """The backend's ModelInfo fields, named by the served name."""
        return {**self.backend.info(), "name": self.name, "max_concurrent_requests": self.admission.max_running}

    def answers_to(self, model: str | None) -> bool:
        return not model or model in self.names

    def check_model(self, model: str | None) -> None:
        """RequestError MODEL_NOT_FOUND (field `model`) unless this pipeline answers to `model`."""
        if not self.answers_to(model):
            raise RequestError(
                MODEL_NOT_FOUND, f"model: {model!r} is not served here; /v1/models lists {self.name!r}", "model"
            )

    def params(self, values: dict[str, Any]) -> GenerationParams:
        """The server's defaults overridden by the request's values; InvalidParameterError names the field."""
        return parse_params({**self.default_params, **values})

    async def open(self, request: Request) -> Job:
        """Validate a request, admit it and start it (its first piece is ready); RequestError when refused."""
        job = await self.prepare(request)
        await job.start()
        return job

    async def prepare(self, request: Request) -> Job:
        """A validated request's job, not admitted or started yet (`Job.start`); RequestError when refused."""
        try:
            if self.calls.draining:
                raise RequestError(SHUTTING, SHUTTING_DOWN)
            self.check_model(request.model)
            values = request.params
            params = self.params(values)
            if request.request_id is not None and len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise InvalidParameterError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
            prompt_ids = await asyncio.to_thread(prompt_ids_of, self.tokenizer, request.prompt, request.messages)
            # the engine's own checks (token ids, the context, a drafter), before the request waits for a slot
            prompt_ids = self.backend.coordinator.engine.scheduler.check(prompt_ids, params)
            if request.fill_context and "max_tokens" not in values and "max_tokens" not in self.default_params:
                room = self.max_context - len(prompt_ids) if self.max_context else self.max_tokens_default
                params = params.model_copy(update={"max_tokens": min(room, self.max_tokens_default)})
        except Exception as exc:
            raise self.refuse(exc) from None
        return Job(self, request.request_id or request.id_prefix + uuid.uuid4().hex, prompt_ids, params)

    def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt or chat messages, as a request would be tokenized."""
        if (prompt is None) == (messages is None):
            raise InvalidParameterError("prompt", "give exactly one of prompt or messages")
        return prompt_ids_of(self.tokenizer, prompt, messages)

    def tokenizer_info(self) -> dict:
        """The tokenizer's special tokens, chat template and context (vLLM's /tokenizer_info: what
        lm-eval's `remote` tokenizer reads)."""
        tok = self.tokenizer
        if tok is None:
            raise InvalidParameterError("model", "this model has no tokenizer")
        tokens = {k: getattr(tok, k) for k in ("eos_token", "bos_token", "pad_token", "unk_token", "chat_template")}
        return {"tokenizer_class": type(tok).__name__, **tokens, "model_max_length": self.max_context}

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (special tokens kept, as vLLM's /detokenize)."""
        if self.tokenizer is None:
            raise InvalidParameterError("tokens", "this model has no tokenizer")
        vocab = len(self.tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameterError("tokens", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        return self.tokenizer.decode(list(token_ids))

    async def health(self, timeout_s: float = 10.0) -> tuple[bool, dict]:
        """(healthy, detail): every component of the pipeline answers (its session counts) in time."""
        detail = {"model": self.name, "running": self.admission.running, "waiting": self.admission.waiting}
        try:
            sessions = await asyncio.wait_for(self.backend.session_counts(), timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported, not raised: this is the health probe
            return False, {"status": "unhealthy", **detail, "error": f"{type(exc).__name__}: {exc}"}
        if sessions:
            detail["sessions"] = sessions
        return True, {"status": "ok", **detail}
