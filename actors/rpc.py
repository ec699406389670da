"""What the pipeline's gRPC servers and their client share: server/channel options, status
mapping, the wire format of draft probabilities, outcomes and costs, and in-order execution of
blocking model calls.

Sampled blocks travel as each draft token's probability alone (docs/SERVING.md, "Draft data on
the wire"). Where p's rows travel (``DraftProbs``: rows that ask for logprobs, the staged rule,
and q's row of a rejected block on its way to the drafter), they are raw little-endian bytes,
row-major [rows, V], in the sender's own dtype (float32, or float64 for float64 models: exact,
``"auto"``), or, opt-in for the drafter's rows, ``"bfloat16"``: half the bytes, but the lossless
rule is then only approximately lossless. Rows that are zero outside a few tokens (top-k, top-p,
min-p) travel sparse: the nonzero values and their columns, still exact.

The internal servers are plaintext on `PipelineConfig.bind_host` (loopback by default) unless the
pipeline sets `internal_tls` (`InternalTLS`): then every server requires a client certificate
signed by the pipeline's CA and every channel presents one (mutual TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import filelock
import grpc
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from viasd import model_thread
from viasd.costs import CostModel, StepTimes, profile_tiers
from viasd.errors import CapacityError, InvalidParameterError
from viasd.executor import Copy, Open, PrefillBatch, PrefillChunk, SessionNotFound, prefill
from viasd.v1 import internal_pb2 as ipb
from viasd.v1.convert import logprobs_to_proto, params_from_proto, stats_to_proto

log = logging.getLogger("viasd.actors")

#: gRPC options of every pipeline server and channel: draft probabilities of a 32-token block of a
#: 152k vocabulary in float64 are ~39 MB, past gRPC's 4 MB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
PROBS_DTYPES = ("auto", "bfloat16")
_WIRE = {"float32": ("<f4", torch.float32), "float64": ("<f8", torch.float64), "bfloat16": ("<i2", torch.bfloat16)}


class PeerUnavailable(RuntimeError):
    """A process this call depends on (another verifier rank) is dead: the caller sees UNAVAILABLE."""


class InternalTLS(BaseModel):
    """Mutual TLS between the coordinator and the drafter / verifier services.

    One identity for the pipeline: every internal server presents `cert_file` and requires the
    client to present a certificate signed by `ca_file`; every channel presents `cert_file` and
    verifies the server against `ca_file` under the name `server_name` (not the dialled IP, which
    changes whenever Ray places an actor on another node). The certificate therefore needs both
    extended key usages (serverAuth, clientAuth) and `server_name` as a DNS SAN. The files are
    read by each actor on its own node (a Kubernetes Secret mounted on every Ray pod).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: Path = Field(..., description="PEM certificate chain every internal server and client presents.")
    key_file: Path = Field(..., description="PEM private key of cert_file.")
    ca_file: Path = Field(..., description="PEM CA bundle that verifies the peer's certificate, in both directions.")
    server_name: str = Field(
        "viasd-internal",
        min_length=1,
        description="DNS name the servers' certificate carries; clients check it instead of the dialled address.",
    )

    def _read(self, name: str) -> bytes:
        return read_file(getattr(self, name), f"internal_tls.{name}")

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self._read("key_file"), self._read("cert_file"))],
            root_certificates=self._read("ca_file"),
            require_client_auth=True,
        )

    def channel(self, address: str, aio: bool = True) -> grpc.aio.Channel | grpc.Channel:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self._read("ca_file"),
            private_key=self._read("key_file"),
            certificate_chain=self._read("cert_file"),
        )
        options = [*GRPC_OPTIONS, ("grpc.ssl_target_name_override", self.server_name)]
        return (grpc.aio if aio else grpc).secure_channel(address, credentials, options=options)


def read_file(path: str | Path, field: str) -> bytes:
    """A file's bytes (a certificate, a key); InvalidParameterError names `field` when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidParameterError(field, f"cannot read {path}: {exc.strerror}") from None


def open_channel(address: str, tls: InternalTLS | None = None, aio: bool = True) -> grpc.aio.Channel | grpc.Channel:
    """A channel to an internal service (asyncio, or blocking with `aio` False): plaintext, or
    mutual TLS with `tls`."""
    if tls is not None:
        return tls.channel(address, aio)
    return (grpc.aio if aio else grpc).insecure_channel(address, options=GRPC_OPTIONS)


async def start_server(
    add: Callable[[grpc.aio.Server], None],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    credentials: grpc.ServerCredentials | None = None,
    options: list = GRPC_OPTIONS,
    interceptors: list = (),
):
    """A started grpc.aio server with the servicers `add` registers on host:port (0: a free port),
    plaintext or TLS with `credentials`; returns (server, bound port)."""
    server = grpc.aio.server(options=options, interceptors=interceptors)
    add(server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if not bound:
        raise RuntimeError(f"cannot bind a gRPC server to {host}:{port}")
    await server.start()
    return server, bound


async def serve_internal(add: Callable, servicer, host: str, tls: InternalTLS | None) -> tuple[grpc.aio.Server, str]:
    """Start a pipeline service (`add`: its generated add_*_to_server) on a free port of `host`,
    mutual TLS with `tls`: (the server, the address other processes dial: this node's IP for a
    wildcard bind)."""
    credentials = tls.server_credentials() if tls else None
    server, port = await start_server(lambda s: add(servicer, s), host, credentials=credentials)
    if host in ("0.0.0.0", "::", "[::]", ""):
        import ray

        host = ray.util.get_node_ip_address()
    return server, f"{host}:{port}"


class ModelActor:
    """What the drafter and verifier actors share: the side they run (`core`: its `sessions`, its
    `shutdown`) and the internal server they serve it on (rank 0's alone under TP)."""

    core = None  # DrafterServicer or VerifierRank, once loaded
    server: grpc.aio.Server | None = None

    async def num_sessions(self) -> int:
        return len(self.core.sessions) if self.core is not None else 0

    async def stop_server(self) -> None:
        """Stop serving (calls in flight get a second to finish)."""
        if self.server is not None:
            await self.server.stop(grace=1.0)
            self.server = None


def actor_facts(lm, capacity, context_name: str, threads: int, linears) -> dict:
    """What a model actor reports when it has loaded: its model's shape and context, what its
    caches hold (`engine_capacity`), its process, torch threads and packed linears."""
    return {
        "vocab_size": lm.vocab_size,
        "num_layers": lm.num_layers,
        "max_position_embeddings": getattr(lm.config, "max_position_embeddings", None),
        "max_seq_len": capacity.max_seq_len,  # what its caches hold per row
        "kv_blocks": capacity.kv_blocks,  # paged: blocks per tier
        "context_name": context_name,
        "pid": os.getpid(),
        "threads": threads,
        "linears": linears,  # (viasd.precision.LinearReport)
    }


def row_error(exc: Exception) -> ipb.RowError:
    """The error of one row of a batch (the status the row would get alone)."""
    return ipb.RowError(code=status_of(exc).name, message=str(exc))


def status_of(exc: Exception) -> grpc.StatusCode:
    """The gRPC status of an error a service raised: a session it does not hold, a full cache, a
    bad field, a dead peer rank, or a bug."""
    if isinstance(exc, SessionNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, InvalidParameterError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, PeerUnavailable):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def rpc(method):
    """Map a servicer method's exceptions to gRPC status codes (`status_of`)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            code = status_of(exc)
            if code == grpc.StatusCode.INTERNAL:  # a bug or a broken model: the caller sees the cause
                log.exception("%s failed", method.__name__)
                await context.abort(code, f"{type(exc).__name__}: {exc}")
            await context.abort(code, str(exc))

    return wrapper


class Side:
    """One process's half of every request of an engine (`viasd.executor.DraftWorker`, or a verifier
    rank's `VerifyWorker`): its blocking methods run on the process's model thread in order
    (`work`, `InOrder`; `cores`: the node's cores lock, `cores_lock`); its tiers' cost curves are
    profiled once (`key_extra`: what else keys their profile)."""

    def __init__(self, worker, tiers: dict, *, cost_cache_dir: str | None = None, cores=None, **key_extra):
        self.worker = worker
        self.work = InOrder(worker.name, cores)
        self.tiers = tiers
        self.cost_cache_dir = cost_cache_dir  # where `costs` caches the profile (None: measured each start)
        self.key_extra = key_extra
        self._costs: CostModel | None = None

    @property
    def sessions(self) -> dict:
        return self.worker.sessions

    def prefill(self, batch: PrefillBatch) -> dict:
        return prefill([self.worker], batch)

    def release(self, keys: list[str]) -> list:
        return [self.worker.release(key) for key in keys]

    def costs(self) -> CostModel:
        """The side's tiers' cost curves (viasd.costs), profiled on first call."""
        if self._costs is None:
            self._costs = profile_tiers(self.tiers, cache_dir=self.cost_cache_dir, **self.key_extra)
        return self._costs

    def shutdown(self) -> None:
        self.work.shutdown()


class SideServicer:
    """The RPCs the drafter's and the verifier's services share, each one phase over every row of
    it, run on the side (`core`) by `_run`."""

    core: Side
    drafter: bool  # whose rows a Prefill opens and feeds

    @property
    def sessions(self) -> dict:
        return self.core.sessions

    async def _run(self, op: str, *args):
        """The side's method `op`, on its model thread."""
        return await self.core.work.submit(getattr(self.core, op), *args)

    @rpc
    async def Prefill(self, request: ipb.PrefillBatch, context) -> ipb.PrefillReply:
        """Open sessions, feed prompt chunks, copy samples' rows; each row's error, or the prompt
        logprobs it scored (none on the drafter's side) and the positions its side's cache holds."""
        t0 = time.perf_counter()
        batch = PrefillBatch(
            [
                Open(o.request_id, list(o.prompt_token_ids), params_from_proto(o.params), o.seed, self.drafter)
                for o in request.opens
            ],
            [PrefillChunk(c.request_id, c.upto, self.drafter) for c in request.chunks],
            [Copy(c.request_id, c.leader) for c in request.copies],
            dict(request.settles),
        )
        rows = [
            ipb.Prefilled(request_id=key, error=row_error(done))
            if isinstance(done, Exception)
            else ipb.Prefilled(request_id=key, prompt_logprobs=logprobs_to_proto(done.logprobs), fed=done.held)
            for key, done in (await self._run("prefill", batch)).items()
        ]
        return ipb.PrefillReply(rows=rows, times=ipb.CallTimes(seconds=time.perf_counter() - t0))

    @rpc
    async def Release(self, request: ipb.ReleaseBatch, context) -> ipb.ReleaseReply:
        """Whether each session existed, and its counters (they travel once, here)."""
        keys = list(request.request_ids)
        released = await self._run("release", keys)
        return ipb.ReleaseReply(
            rows=[
                ipb.Released(request_id=key, existed=stats is not None, stats=stats and stats_to_proto(stats))
                for key, stats in zip(keys, released)
            ]
        )

    @rpc
    async def Costs(self, request: ipb.CostsRequest, context) -> ipb.CostsResponse:
        """The side's tiers' cost curves (`Side.costs`)."""
        return costs_to_proto(await self._run("costs"))


# ------------------------------------------------------------------ wire formats


def encode_probs(p: torch.Tensor | None, dtype: str = "auto") -> ipb.DraftProbs | None:
    """p [k, V] -> DraftProbs (None stays None: greedy). Rows go sparse (the nonzero values and
    their columns) when that is under half the dense bytes: exact either way, since the
    drafter's top-k / top-p / min-p leave p exactly 0 elsewhere."""
    if p is None:
        return None
    assert p.ndim == 2, f"p must be [k, V], got {tuple(p.shape)}"
    if dtype not in PROBS_DTYPES:
        raise InvalidParameterError("draft_probs_dtype", f"must be one of {PROBS_DTYPES}, got {dtype!r}")
    name = ("float64" if p.dtype == torch.float64 else "float32") if dtype == "auto" else dtype
    t = p.detach().to("cpu", _WIRE[name][1]).contiguous()  # [k, V]
    if name == "bfloat16":
        t = t.view(torch.int16)  # numpy has no bfloat16: ship the bit patterns
    a = t.numpy()  # [k, V] (numpy's nonzero count is much faster than torch's on CPU)
    nnz = int(np.count_nonzero(a))
    sparse = nnz * (a.itemsize + 4) < a.size * a.itemsize // 2
    msg = ipb.DraftProbs(rows=p.shape[0], vocab_size=p.shape[1], dtype=name)
    if sparse:
        rows, cols = np.nonzero(a)  # row-major
        msg.data = a[rows, cols].astype(_WIRE[name][0], copy=False).tobytes()
        msg.indices = cols.astype("<i4").tobytes()
        msg.row_nnz.extend(np.count_nonzero(a, axis=1).tolist())
    else:
        msg.data = a.astype(_WIRE[name][0], copy=False).tobytes()
    return msg


def decode_probs(msg: ipb.DraftProbs | None) -> torch.Tensor | None:
    """DraftProbs -> p [rows, V] (float32 or float64; bfloat16 is widened to float32)."""
    if msg is None or not msg.data:
        return None
    if msg.dtype not in _WIRE:
        raise InvalidParameterError("probs.dtype", f"must be one of {sorted(_WIRE)}, got {msg.dtype!r}")
    np_dtype, torch_dtype = _WIRE[msg.dtype]
    sparse = bool(msg.indices)
    count = sum(msg.row_nnz) if sparse else msg.rows * msg.vocab_size
    if len(msg.data) != count * np.dtype(np_dtype).itemsize:
        raise InvalidParameterError(
            "probs.data",
            f"{len(msg.data)} bytes for {count} {msg.dtype} values "
            f"({msg.rows} x {msg.vocab_size}{' sparse' if sparse else ''})",
        )
    t = torch.from_numpy(np.frombuffer(msg.data, dtype=np_dtype).astype(np_dtype[1:], copy=True))
    if msg.dtype == "bfloat16":
        t = t.view(torch.bfloat16).float()
    if not sparse:
        return t.view(msg.rows, msg.vocab_size)  # [k, V]
    if len(msg.row_nnz) != msg.rows or len(msg.indices) != 4 * count:
        raise InvalidParameterError(
            "probs.indices",
            f"{len(msg.indices) // 4} indices and {len(msg.row_nnz)} row counts for {count} values in {msg.rows} rows",
        )
    cols = np.frombuffer(msg.indices, dtype="<i4")  # [nnz]
    if count and not 0 <= int(cols.min()) <= int(cols.max()) < msg.vocab_size:
        raise InvalidParameterError("probs.indices", f"a column outside the vocabulary ({msg.vocab_size})")
    rows = np.repeat(np.arange(msg.rows), np.asarray(msg.row_nnz, dtype=np.int64))  # [nnz]
    dense = np.zeros((msg.rows, msg.vocab_size), dtype=t.numpy().dtype)  # [k, V] (numpy: faster than torch here)
    dense[rows, cols] = t.numpy()
    p = torch.from_numpy(dense)
    return p


def merge_outcomes(first: ipb.Outcome | None, then: ipb.Outcome) -> ipb.Outcome:
    """Two cycles' outcomes as one for a drafter that saw neither (an `auto` row's `ar` steps
    do not call it): their tokens in order; the accepted count is the first's, which judged
    the block the drafter last proposed."""
    if first is None:
        return then
    return ipb.Outcome(tokens=[*first.tokens, *then.tokens], num_draft_accepted=first.num_draft_accepted)


def costs_to_proto(model: CostModel) -> ipb.CostsResponse:
    return ipb.CostsResponse(
        curves=[
            ipb.CostCurve(
                tier=tier,
                rows=[b for b, _, _ in points],
                tokens=[n for _, n, _ in points],
                seconds=[sec for _, _, sec in points],
            )
            for tier, points in model.grid.items()
        ],
        key_json=json.dumps(model.key, sort_keys=True),
        profile_seconds=model.profile_seconds,
    )


def times_to_proto(times: StepTimes, seconds: float) -> ipb.CallTimes:
    return ipb.CallTimes(
        seconds=seconds,
        forwards=[ipb.Forward(tier=t, rows=b, tokens=n, seconds=sec) for t, b, n, sec in times.forwards],
    )


def times_from_proto(reply, keys: list) -> StepTimes:
    """A batched Propose's or Verify's `StepTimes`: its forwards, and each row's work under the
    caller's key for that row (`keys`, in the rows' order)."""
    return StepTimes(
        [(f.tier, f.rows, f.tokens, f.seconds) for f in reply.times.forwards],
        {key: row.work_seconds for key, row in zip(keys, reply.rows)},
    )


def costs_from_proto(msg: ipb.CostsResponse) -> CostModel:
    grid = {c.tier: list(zip(c.rows or [1] * len(c.tokens), c.tokens, c.seconds)) for c in msg.curves}
    return CostModel(grid, json.loads(msg.key_json or "{}"), msg.profile_seconds, online=True)


# ------------------------------------------------------------------ blocking model calls


def cores_lock(device: str, threads: int, ranks: int) -> filelock.FileLock | None:
    """The node's cores lock, for an actor whose torch threads span every core of its node: every
    call it runs (`InOrder`) holds it, so such actors on one node take turns on the cores instead
    of two OpenMP teams spinning on them at once (docs/ARCHITECTURE.md, "Threads"). None on a GPU,
    with fewer threads than cores, and for tensor-parallel ranks, which must run at once."""
    if device != "cpu" or ranks > 1 or threads < (os.cpu_count() or 1):
        return None
    return filelock.FileLock(os.path.join(tempfile.gettempdir(), f"viasd-cores-{os.getuid()}.lock"))


class InOrder:
    """Runs blocking calls (model forwards) on the process's model thread (viasd.model_thread), in
    the order of their sequence numbers.

    The verifier's rank 0 numbers every call (`number`) and runs them in that order, sending
    each to the other ranks as it starts (viasd.actors.verifier.lead), so all ranks reach their
    collectives in the same order. `enqueue` registers a call synchronously (no await between
    numbering and registering, so a cancelled caller cannot leave a gap), and a call whose caller
    gave up still runs: the other ranks run it too. With
    `cores` (`cores_lock`) each call holds the node's cores lock while it runs, unless submitted
    as `exclusive=False` (work that may as well run beside another process's).
    """

    def __init__(self, name: str, cores: filelock.FileLock | None = None):
        self.name = name
        self.cores = cores
        self._stopped = False  # `shutdown`: calls not yet started fail instead of running
        self._next = 0  # the next sequence number to hand to the thread
        self._numbered = 0  # numbers handed out by `number`
        self._pending: dict[int, tuple[asyncio.Future, Callable, tuple, bool]] = {}

    def number(self) -> int:
        seq, self._numbered = self._numbered, self._numbered + 1
        return seq

    def enqueue(self, seq: int, fn: Callable, *args: Any, exclusive: bool = True) -> asyncio.Future:
        """Register call number `seq`; it runs once every smaller number has been handed over."""
        loop = asyncio.get_running_loop()
        if seq < self._next or seq in self._pending:
            raise RuntimeError(f"call number {seq} arrived twice (next is {self._next})")
        result = loop.create_future()
        self._pending[seq] = (result, fn, args, exclusive)
        while self._next in self._pending:
            res, f, a, x = self._pending.pop(self._next)
            loop.run_in_executor(model_thread.executor(), self._run, f, a, x).add_done_callback(
                functools.partial(_settle, res)
            )
            self._next += 1
        return result

    def submit(self, fn: Callable, *args: Any, exclusive: bool = True) -> asyncio.Future:
        """Run in submission order (a single process with no peers)."""
        return self.enqueue(self.number(), fn, *args, exclusive=exclusive)

    def _run(self, fn: Callable, args: tuple, exclusive: bool) -> Any:
        if self._stopped:
            raise RuntimeError(f"{self.name} is shutting down")
        with self.cores if self.cores is not None and exclusive else contextlib.nullcontext():
            return fn(*args)

    def shutdown(self) -> None:
        """Calls not started yet fail (the model thread is the process's: it goes on)."""
        self._stopped = True


def _settle(result: asyncio.Future, done: asyncio.Future) -> None:
    if result.cancelled():  # the caller gave up; the call ran anyway
        if not done.cancelled():
            done.exception()  # retrieved: no "exception never retrieved" warning
        return
    if done.cancelled():
        result.cancel()
    elif done.exception() is not None:
        result.set_exception(done.exception())
    else:
        result.set_result(done.result())
