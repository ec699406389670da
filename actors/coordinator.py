"""The coordinator: owns request state and runs the decode cycle across the drafter and the
verifier services over gRPC (DESIGN.md, "Distributed shape").

One request, as `Engine.generate` runs it in-process (and with the same code for the limits:
`viasd.engine.check_request`, `RequestLimits`, `request_seeds`):

    Open(drafter, drafter seed) and Open(verifier, verifier seed), concurrently
    loop:
        Propose(previous outcome, k)  -> draft [k] (+ p [k, V] when sampling)
        Verify(draft, p)              -> outcome: committed tokens, draft tokens accepted
        cut at stop tokens / max_tokens / the context; stream a Chunk
    Close both sides (also on cancellation and errors), merge both sides' RequestStats

The drafter commits the previous outcome at the start of the next Propose, so a cycle costs two
RPCs. `ar` requests talk to the verifier only (Verify with an empty draft decodes one token).
Every internal RPC has a deadline. When the drafter fails (any RPC error) and
`drafter_fallback` is on, the request goes on as `ar` against the verifier, whose session is
still consistent (it commits its own outcomes), and its stats say `drafter_fallback`.

Each request keeps the stubs it was opened with until it ends, so that a backend replaced while
it runs (`set_backends`, after the pipeline rebuilt a dead actor) never sees a request it did not
open: requests in flight on a dead verifier fail with UNAVAILABLE, later ones use the new one.
`on_unavailable(component)` is called whenever an RPC finds a backend down or past its deadline
(the pipeline's supervisor wakes up on it).

`Coordinator` is a plain asyncio class: usable in-process, in a Ray actor or a Serve replica.
Its gRPC channels are made on first use, in the event loop that uses them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field

import grpc

from viasd.actors.rpc import InternalTLS, open_channel
from viasd.config import GenerationParams, Mode
from viasd.engine import Chunk, RequestLimits, check_request, request_seeds, resolve_seed
from viasd.errors import InvalidParameterError, ViaSDError
from viasd.metrics import RequestStats
from viasd.v1 import internal_pb2 as ipb
from viasd.v1 import internal_pb2_grpc
from viasd.v1.convert import params_to_proto, stats_from_proto

log = logging.getLogger("viasd.actors.coordinator")


class BackendError(ViaSDError):
    """An internal RPC to the drafter or the verifier failed (`code`: the gRPC status name)."""

    def __init__(self, component: str, code: str, details: str):
        self.component, self.code, self.details = component, code, details
        super().__init__(f"{component} {code}: {details}")

    @property
    def unavailable(self) -> bool:
        """The backend is down or too slow (retry elsewhere), rather than broken."""
        return self.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


@dataclass
class RpcTotals:
    """What the coordinator's internal RPCs cost, summed over requests (seconds are wall time
    seen by the coordinator: model time + serialisation + transport + queueing)."""

    requests: int = 0
    cycles: int = 0
    propose_calls: int = 0
    verify_calls: int = 0
    bytes_sent: int = 0  # serialised request messages
    bytes_received: int = 0  # serialised response messages
    probs_bytes: int = 0  # DraftProbs payload (included in both of the above: received, then sent)
    propose_seconds: float = 0.0
    verify_seconds: float = 0.0
    open_close_seconds: float = 0.0
    drafter_fallbacks: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Request:
    request_id: str
    params: GenerationParams
    seq_len: int  # prompt + committed tokens
    drafted: bool  # the drafter takes part (sd, via) and has not failed
    drafter_open: bool = False
    verifier_open: bool = False
    opening: asyncio.Future | None = None  # the Open calls: never cancelled half-way (see _close)
    previous: ipb.Outcome | None = None  # the last outcome, committed by the drafter on the next Propose
    drafter_stats: ipb.RequestStats | None = None  # each side's counters as of its last reply
    verifier_stats: ipb.RequestStats | None = None
    fallback: bool = False
    rpc: RpcTotals = field(default_factory=RpcTotals)
    verifier: internal_pb2_grpc.VerifierServiceStub | None = None  # the backends it was opened on
    drafter: internal_pb2_grpc.DrafterServiceStub | None = None


class Coordinator:
    """Runs requests across a DrafterService and a VerifierService."""

    def __init__(
        self,
        verifier_address: str,
        drafter_address: str | None = None,
        *,
        vocab_size: int,
        max_context: int | None = None,
        eos_token_ids: Sequence[int] = (),
        rpc_timeout_s: float = 60.0,
        drafter_fallback: bool = True,
        on_unavailable: Callable[[str], None] | None = None,
        tls: InternalTLS | None = None,
    ):
        self.verifier_address = verifier_address
        self.tls = tls  # mutual TLS to both services (actors/rpc.py), or None: plaintext
        self.drafter_address = drafter_address
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.eos_token_ids = tuple(eos_token_ids)
        self.rpc_timeout_s = rpc_timeout_s
        self.drafter_fallback = drafter_fallback
        self.on_unavailable = on_unavailable
        self.totals = RpcTotals()
        self._active: dict[str, _Request] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}  # "verifier" / "drafter" -> its channel
        self._verifier: internal_pb2_grpc.VerifierServiceStub | None = None
        self._drafter: internal_pb2_grpc.DrafterServiceStub | None = None

    # ---------------------------------------------------------------- public API

    def active_requests(self) -> int:
        return len(self._active)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: GenerationParams
    ) -> AsyncIterator[Chunk]:
        """Stream the committed tokens of one request; the last chunk has the finish reason and the
        merged stats. Cancelling the consumer (or `aclose()`) closes both sessions."""
        prompt = check_request(prompt_ids, params, vocab_size=self.vocab_size, max_context=self.max_context,
                               has_drafter=self.drafter_address is not None)
        if params.mode == Mode.AUTO:
            raise InvalidParameterError(
                "mode", "mode 'auto' runs on the in-process engine (pipeline backend 'local'); the actor pipeline "
                "serves 'ar', 'sd' and 'via'")
        if params.mode != Mode.AR and self.drafter_address is None:  # (the n-gram proposer runs on the drafter too)
            raise InvalidParameterError("mode", f"mode {params.mode.value!r} needs the pipeline's drafter; it has none")
        if not request_id:
            raise InvalidParameterError("request_id", "must not be empty")
        if request_id in self._active:
            raise InvalidParameterError("request_id", f"{request_id!r} is already running")
        self._connect()
        req = _Request(request_id, params, len(prompt), drafted=params.mode != Mode.AR, verifier=self._verifier,
                       drafter=self._drafter)
        stats = RequestStats(mode=params.mode.value, prompt_tokens=len(prompt))
        limits = RequestLimits(params, len(prompt), self.max_context, self.eos_token_ids, stats)
        self._active[request_id] = req
        self.totals.requests += 1
        try:
            await self._open(req, prompt)
            while True:
                chunk = limits.chunk(await self._cycle(req, limits))
                if chunk.finished:
                    self._merge(stats, req)
                yield chunk
                if chunk.finished:
                    return
        finally:
            # finished, cancelled, failed or abandoned: free both sides' caches. After the last
            # chunk, so that a Close queued behind other requests' forwards does not delay it;
            # a consumer iterating to the end (or `aclose()`) sees the sessions closed. The id stays
            # taken until both Close calls are done (even when this task is cancelled meanwhile), so
            # that a new request reusing it cannot meet the old session on a backend.
            closing = asyncio.ensure_future(self._close(req))
            closing.add_done_callback(lambda _: self._active.pop(request_id, None))
            await asyncio.shield(closing)

    async def close(self) -> None:
        """Close the channels (requests still running fail)."""
        for channel in self._channels.values():
            await channel.close()
        self._channels, self._verifier, self._drafter = {}, None, None

    async def set_backends(self, verifier_address: str | None = None, drafter_address: str | None = None) -> None:
        """Point new requests at a rebuilt verifier and / or drafter. Requests in flight keep the
        stubs they were opened with; a replaced channel closes once they are done with it (or
        after the RPC deadline)."""
        old = []
        if verifier_address:
            self.verifier_address, self._verifier = verifier_address, None
            old.append(self._channels.pop("verifier", None))
        if drafter_address:
            self.drafter_address, self._drafter = drafter_address, None
            old.append(self._channels.pop("drafter", None))
        self._connect()
        for channel in old:
            if channel is not None:
                asyncio.ensure_future(channel.close(grace=self.rpc_timeout_s))

    # ---------------------------------------------------------------- one request

    def _connect(self) -> None:
        if self._verifier is None:
            channel = open_channel(self.verifier_address, self.tls)
            self._channels["verifier"] = channel
            self._verifier = internal_pb2_grpc.VerifierServiceStub(channel)
        if self.drafter_address and self._drafter is None:
            channel = open_channel(self.drafter_address, self.tls)
            self._channels["drafter"] = channel
            self._drafter = internal_pb2_grpc.DrafterServiceStub(channel)

    async def _call(self, req: _Request, component: str, method: str, request, timeout: float | None = None):
        stub = req.drafter if component == "drafter" else req.verifier
        t0 = time.perf_counter()
        try:
            response = await getattr(stub, method)(request, timeout=timeout or self.rpc_timeout_s)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            if isinstance(exc, grpc.aio.UsageError):  # its channel was closed: the backend was replaced
                err = BackendError(component, "UNAVAILABLE", f"{component} was replaced: {exc}")
            else:
                err = BackendError(component, exc.code().name, exc.details() or "")
            if err.unavailable and self.on_unavailable is not None:
                self.on_unavailable(component)
            raise err from None
        seconds = time.perf_counter() - t0
        sent, received = request.ByteSize(), response.ByteSize()
        for t in (req.rpc, self.totals):
            t.bytes_sent += sent
            t.bytes_received += received
            if method == "Propose":
                t.propose_calls += 1
                t.propose_seconds += seconds
                t.probs_bytes += len(response.probs.data)
            elif method == "Verify":
                t.verify_calls += 1
                t.verify_seconds += seconds
            else:
                t.open_close_seconds += seconds
        return response

    async def _open(self, req: _Request, prompt: list[int]) -> None:
        draft_seed, verify_seed = request_seeds(resolve_seed(req.params))
        params = params_to_proto(req.params)  # fully resolved: both sides see the same request

        def open_request(seed: int) -> ipb.OpenRequest:
            return ipb.OpenRequest(request_id=req.request_id, prompt_token_ids=prompt, params=params, seed=seed)

        calls = [self._call(req, "verifier", "Open", open_request(verify_seed))]
        if req.drafted:
            calls.append(self._call(req, "drafter", "Open", open_request(draft_seed)))
        # shielded: a request cancelled while opening must still learn what it opened, to close it
        req.opening = asyncio.ensure_future(asyncio.gather(*calls, return_exceptions=True))
        results = await asyncio.shield(req.opening)
        self._opened(req, results)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, BackendError):
                raise result
        if not req.verifier_open:
            raise results[0]
        if req.drafted and not req.drafter_open:
            self._fall_back(req, results[1])

    @staticmethod
    def _opened(req: _Request, results: list) -> None:
        req.verifier_open = not isinstance(results[0], BaseException)
        req.drafter_open = len(results) > 1 and not isinstance(results[1], BaseException)

    def _fall_back(self, req: _Request, exc: BackendError) -> None:
        """The drafter failed: go on as `ar` (or fail when fallback is off)."""
        if not self.drafter_fallback:
            raise exc
        log.warning("request %s: drafter failed (%s); continuing as 'ar'", req.request_id, exc)
        req.drafted, req.fallback = False, True
        req.rpc.drafter_fallbacks += 1
        self.totals.drafter_fallbacks += 1

    async def _cycle(self, req: _Request, limits: RequestLimits) -> list[int]:
        """One decode cycle; returns the committed tokens (the caller cuts them at stops/limits)."""
        verify = ipb.VerifyRequest(request_id=req.request_id)  # empty draft: `ar`, one token
        if req.drafted:
            propose = ipb.ProposeRequest(request_id=req.request_id, previous=req.previous,
                                         k=limits.draft_length(req.seq_len))
            try:
                proposal = await self._call(req, "drafter", "Propose", propose)
            except BackendError as exc:
                self._fall_back(req, exc)
            else:
                req.drafter_stats = proposal.stats
                verify = ipb.VerifyRequest(request_id=req.request_id, draft=proposal.draft,
                                           probs=proposal.probs if proposal.HasField("probs") else None)
        result = await self._call(req, "verifier", "Verify", verify)
        req.verifier_stats, req.previous = result.stats, result.outcome
        req.rpc.cycles += 1
        self.totals.cycles += 1
        tokens = list(result.outcome.tokens)
        req.seq_len += len(tokens)
        return tokens

    async def _close(self, req: _Request) -> None:
        """Close whatever is open, ignoring errors (Close is idempotent on both sides)."""
        if req.opening is not None:  # (cancelled while opening: let the Open calls finish first)
            try:
                self._opened(req, await asyncio.wait_for(asyncio.shield(req.opening), self.rpc_timeout_s))
            except Exception as exc:
                log.warning("request %s: open did not finish (%s); closing both sides anyway", req.request_id, exc)
                req.verifier_open, req.drafter_open = True, req.params.mode != Mode.AR
        calls = []
        if req.verifier_open:
            calls.append(self._call(req, "verifier", "Close", ipb.CloseRequest(request_id=req.request_id)))
        if req.drafter_open:
            calls.append(self._call(req, "drafter", "Close", ipb.CloseRequest(request_id=req.request_id)))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("request %s: close failed: %s", req.request_id, result)
        req.verifier_open = req.drafter_open = False

    @staticmethod
    def _merge(stats: RequestStats, req: _Request) -> None:
        """The request's stats: its own fields (tokens, times, finish) plus both sides' counters."""
        for side in (req.drafter_stats, req.verifier_stats):
            if side is not None:
                stats.add_counters(stats_from_proto(side))
        stats.drafter_fallback = req.fallback
