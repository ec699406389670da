"""What the sync and the asyncio client share: options, request building, results, health codec.

Imports grpcio, protobuf, pydantic and the light parts of viasd only (config, errors, metrics,
v1): never torch, Ray or transformers.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from viasd.config import GenerationParams, parse_params
from viasd.errors import InvalidParameterError
from viasd.metrics import RequestStats, TokenLogprob
from viasd.v1 import generation_pb2 as pb
from viasd.v1 import generation_pb2_grpc
from viasd.v1.convert import finish_from_proto, logprobs_from_proto, mode_from_proto, params_to_proto, stats_from_proto

from .errors import DeadlineExceeded

DEFAULT_TARGET = "127.0.0.1:9000"
TOKEN_ENV = "VIASD_API_TOKEN"  # read by the CLI (the SDK takes `token=` explicitly)
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


# ------------------------------------------------------------------ options


@dataclass(frozen=True)
class TLSConfig:
    """Channel security. ``TLSConfig()`` trusts the system roots; ``ca_file`` a private CA;
    ``cert_file`` + ``key_file`` present a client certificate (mutual TLS)."""

    ca_file: str | Path | None = None  # PEM roots that verify the server; None: the system roots
    cert_file: str | Path | None = None  # PEM client certificate chain (mutual TLS)
    key_file: str | Path | None = None  # PEM private key of cert_file
    server_name: str | None = None  # name checked against the server certificate instead of the target's host

    def __post_init__(self):
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidParameterError("tls.key_file", "mutual TLS needs both cert_file and key_file")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path, name):
            if path is None:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise InvalidParameterError(f"tls.{name}", f"cannot read {path}: {exc.strerror}") from None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file, "ca_file"),
            private_key=read(self.key_file, "key_file"),
            certificate_chain=read(self.cert_file, "cert_file"),
        )


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of a call that failed before any response arrived with UNAVAILABLE, or with
    RESOURCE_EXHAUSTED carrying the server's retry hint (its queue is full).

    A stream is retried only while it has yielded nothing, so no token is ever produced twice;
    unary calls (models, health) are read-only and retried the same way. The n-th retry waits
    ``min(max_backoff_s, initial_backoff_s * multiplier ** (n - 1))`` scaled by a random factor in
    ``[1 - jitter, 1]``, and at least the server's hint (trailing metadata ``viasd-retry-after-ms``),
    never past the call's deadline. A RESOURCE_EXHAUSTED without the hint (gRPC's own refusal of a
    message past the size limit) would fail again and is not retried.
    """

    max_attempts: int = 4  # attempts in all, the first included; 1 disables retries
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 4.0
    multiplier: float = 2.0
    jitter: float = 0.5  # 0: fixed delays; 1: "full jitter", anywhere in [0, delay]

    def __post_init__(self):
        if self.max_attempts < 1:
            raise InvalidParameterError("retry.max_attempts", "must be at least 1")
        if not (0 < self.initial_backoff_s <= self.max_backoff_s):
            raise InvalidParameterError("retry.initial_backoff_s", "must be positive and at most max_backoff_s")
        if self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise InvalidParameterError("retry.jitter", "multiplier must be >= 1 and jitter within [0, 1]")

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1 = the second attempt)."""
        delay = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry - 1))
        return delay * (1.0 - self.jitter * random.random())


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 keepalive pings, so that a dead connection (a node gone, a NAT dropping it) fails
    calls instead of hanging them. The standalone server accepts pings every 30 s; Ray Serve's
    proxy keeps gRPC's default of 5 minutes, so use ``time_s >= 300`` (or None) there."""

    time_s: float | None = 60.0  # ping after this long without activity; None: no pings
    timeout_s: float = 20.0  # close the connection when a ping is not answered in time
    permit_without_calls: bool = False  # also ping while no call is open


def channel_options(
    retry: RetryPolicy, keepalive: Keepalive | None, tls: TLSConfig | None, extra: Iterable[tuple[str, Any]] = ()
) -> list[tuple[str, Any]]:
    """gRPC channel arguments: message sizes, keepalive, reconnect backoff matched to `retry`."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        # the channel's own reconnection backoff (default: 1 s growing to 120 s) would otherwise
        # fail our retries at once while it waits, long after the server came back
        ("grpc.initial_reconnect_backoff_ms", int(retry.initial_backoff_s * 1000)),
        ("grpc.min_reconnect_backoff_ms", int(retry.initial_backoff_s * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(retry.max_backoff_s * 1000)),
    ]
    if keepalive is not None and keepalive.time_s is not None:
        options += [
            ("grpc.keepalive_time_ms", int(keepalive.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(keepalive.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", int(keepalive.permit_without_calls)),
            ("grpc.http2.max_pings_without_data", 0),
        ]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options + list(extra)


def resolve_tls(tls: bool | TLSConfig | None) -> TLSConfig | None:
    if tls is True:
        return TLSConfig()
    return tls or None


def call_metadata(token: str | None, metadata: Iterable[tuple[str, str]] | Mapping[str, str]) -> tuple:
    """Metadata of every call: the bearer token plus the caller's own pairs (e.g. ``application``)."""
    pairs = list(metadata.items() if isinstance(metadata, Mapping) else metadata)
    if token:
        pairs.append(("authorization", f"Bearer {token}"))
    return tuple(pairs)


class Deadline:
    """The absolute deadline of one call across its attempts."""

    def __init__(self, timeout: float | None):
        if timeout is not None and timeout <= 0:
            raise InvalidParameterError("timeout", "must be positive seconds (or None: no deadline)")
        self.end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left for the next attempt (raises DeadlineExceeded when none are left)."""
        if self.end is None:
            return None
        left = self.end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("DEADLINE_EXCEEDED", "deadline exceeded before the call could be (re)tried")
        return left

    def allows(self, delay: float) -> bool:
        return self.end is None or time.monotonic() + delay < self.end


# ------------------------------------------------------------------ requests


Message = Mapping[str, str] | tuple[str, str]


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Message] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    model: str = "",
    request_id: str | None = None,
    params: GenerationParams | Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> pb.GenerateRequest:
    """A validated GenerateRequest; InvalidParameterError names a bad field before any network I/O.

    Exactly one input: `prompt` (text), `messages` (chat: dicts with ``role`` and ``content``, or
    (role, content) pairs) or `prompt_token_ids`. Parameters are GenerationParams fields, given
    as `params` and/or keywords (keywords win); the fields left out are not sent, so they take
    the server's defaults (its configured defaults, then GenerationParams').
    """
    given = [
        name
        for name, v in (("prompt", prompt), ("messages", messages), ("prompt_token_ids", prompt_token_ids))
        if v is not None
    ]
    if len(given) != 1:
        raise InvalidParameterError(
            "prompt",
            "give exactly one of prompt, messages or prompt_token_ids"
            + (f" (got {', '.join(given)})" if given else ""),
        )
    values = params.model_dump(exclude_unset=True) if isinstance(params, GenerationParams) else dict(params or {})
    values.update(kwargs)
    validated = parse_params(values)
    request = pb.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex,
        model=model or "",
        params=params_to_proto(validated, only=validated.model_fields_set),
    )
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise InvalidParameterError("prompt", "must be a non-empty string")
        request.prompt = prompt
    elif messages is not None:
        request.messages.CopyFrom(pb.ChatMessages(messages=[_chat_message(i, m) for i, m in enumerate(messages)]))
        if not messages:
            raise InvalidParameterError("messages", "at least one message")
    else:
        ids = list(prompt_token_ids)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in ids):
            raise InvalidParameterError("prompt_token_ids", "a non-empty list of token ids (integers >= 0)")
        request.prompt_token_ids.CopyFrom(pb.TokenIds(ids=ids))
    return request


def _chat_message(i: int, message: Message) -> pb.ChatMessage:
    role, content = (message.get("role"), message.get("content")) if isinstance(message, Mapping) else message
    if role not in ("system", "user", "assistant", "tool") or not isinstance(content, str):
        raise InvalidParameterError(f"messages.{i}", "needs a role (system, user, assistant, tool) and string content")
    return pb.ChatMessage(role=role, content=content)


# ------------------------------------------------------------------ results


@dataclass
class Chunk:
    """One streamed response: the tokens one decoding step committed (of one sample)."""

    request_id: str
    text: str  # decoded text of token_ids (empty for models served without a tokenizer)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" on a sample's last chunk, else None
    stats: RequestStats | None = None  # the sample's statistics, on its last chunk only
    index: int = 0  # which sample of an n > 1 request
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry (logprobs set)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # a sample's first chunk: prompt tokens 2..n

    @classmethod
    def from_proto(cls, msg: pb.GenerateResponse) -> Chunk:
        finish = finish_from_proto(msg.finish_reason)
        stats = stats_from_proto(msg.stats, finish) if msg.HasField("stats") else None
        return cls(
            msg.request_id,
            msg.text,
            list(msg.token_ids),
            finish,
            stats,
            msg.index,
            logprobs_from_proto(msg.logprobs),
            logprobs_from_proto(msg.prompt_logprobs),
        )


@dataclass
class Completion:
    """A whole generation of one sample: its chunks concatenated."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats | None = None
    chunks: int = 0  # responses streamed
    index: int = 0  # which sample of an n > 1 request
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 2..n (prompt_logprobs set)

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs = chunk.prompt_logprobs or self.prompt_logprobs
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.stats = chunk.stats or self.stats
        self.chunks += 1

    @staticmethod
    def of_samples(request_id: str, n: int, chunks) -> list[Completion]:
        """The n samples' completions of a request's chunks (in sample order)."""
        out = [Completion(request_id, index=i) for i in range(n)]
        for chunk in chunks:
            out[chunk.index].add(chunk)
        return out

    def to_dict(self) -> dict:
        d = {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict() if self.stats else None,
        }
        if self.logprobs:
            d["logprobs"] = [asdict(e) for e in self.logprobs]
        if self.prompt_logprobs:
            d["prompt_logprobs"] = [asdict(e) for e in self.prompt_logprobs]
        return d


@dataclass(frozen=True)
class ModelInfo:
    """One served pipeline (ListModels)."""

    name: str
    verifier: str
    drafter: str  # empty: the pipeline serves `ar` only
    num_layers: int
    skipped_layers: tuple[int, ...]  # the slim verifier's mask
    tensor_parallel_size: int
    max_context: int
    default_mode: str  # "ar" | "sd" | "via"
    dtype: str = ""  # the verifier's dtype, and why it was chosen (viasd.precision.DtypeChoice)
    dtype_reason: str = ""
    device: str = ""
    cpu_capability: str = ""  # torch.backends.cpu.get_cpu_capability() of the verifier's host (CPU)

    @classmethod
    def from_proto(cls, msg: pb.ModelInfo) -> ModelInfo:
        mode = mode_from_proto(msg.default_mode).value if msg.default_mode else ""
        return cls(
            msg.name,
            msg.verifier,
            msg.drafter,
            msg.num_layers,
            tuple(msg.skipped_layers),
            msg.tensor_parallel_size,
            msg.max_context,
            mode,
            msg.dtype,
            msg.dtype_reason,
            msg.device,
            msg.cpu_capability,
        )


# ------------------------------------------------------------------ health (grpc.health.v1, no extra package)

# The standard health service's two messages are one field each, so they are encoded here rather
# than by grpcio-health-checking, which the light install does not have:
#   HealthCheckRequest {string service = 1;}   HealthCheckResponse {ServingStatus status = 1;}
HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


class Endpoint:
    """What `Client` and `AsyncClient` share: one channel to `target` with its options, the call
    metadata, the stubs. `_grpc` is where the channel comes from (grpc, or grpc.aio)."""

    _grpc: Any = grpc

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        tls: bool | TLSConfig | None = None,
        token: str | None = None,
        timeout: float | None = None,
        retry: RetryPolicy = RetryPolicy(),
        keepalive: Keepalive | None = Keepalive(),
        metadata: Mapping[str, str] | Iterable = (),
        options: Iterable[tuple[str, Any]] = (),
    ):
        self.target = target
        self.timeout = timeout
        self.retry = retry
        self._metadata = call_metadata(token, metadata)
        tls = resolve_tls(tls)
        opts = channel_options(retry, keepalive, tls, options)
        self._channel = (
            self._grpc.secure_channel(target, tls.credentials(), opts)
            if tls
            else self._grpc.insecure_channel(target, opts)
        )
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._health = self._channel.unary_unary(
            HEALTH_CHECK, request_serializer=encode_health_request, response_deserializer=decode_health_response
        )


def encode_health_request(service: str) -> bytes:
    data = service.encode()
    return b"\x0a" + _varint(len(data)) + data if data else b""


def decode_health_response(data: bytes) -> str:
    status, i = 0, 0
    while i < len(data):
        key, i = _read_varint(data, i)
        if key >> 3 == 1 and key & 7 == 0:
            status, i = _read_varint(data, i)
        elif key & 7 == 0:
            _, i = _read_varint(data, i)
        elif key & 7 == 2:
            n, i = _read_varint(data, i)
            i += n
        else:
            raise ValueError("unexpected field in HealthCheckResponse")
    return HEALTH_STATUS.get(status, str(status))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i
