"""The coordinator: owns request state and drives engine steps across the drafter and the
verifier services over gRPC (docs/ARCHITECTURE.md, "Distributed shape"; docs/SERVING.md, "Batching").

A request, with the same code for the limits as in-process (`viasd.engine.check_request`,
`RequestLimits`, `request_seeds`):

    Open(drafter, drafter seed) and Open(verifier, verifier seed), concurrently (each service
    prefills the Opens that arrive while one runs together); then it joins
    the batch, and each time its consumer asks for the next chunk it takes part in a step;
    Close both sides (also on cancellation and errors), merge both sides' RequestStats.

A step, for every request asking for its next chunk (the step driver, `_drive`):

    plan every row: its own mode's, or the planner's for `auto` rows (viasd.planner, as in-process)
    Propose(rows: previous outcome, k per drafting row)  -> a draft [k] (+ p [k, V] when sampling) per row
    Verify(rows: draft, p per row; an empty draft for `ar`) -> an outcome per row
    per row: cut at stop tokens / max_tokens / the context; hand the chunk to its consumer

`auto` rows plan with the cost curves each service profiles of its own tiers (`Costs`, fetched
for the first `auto` request; corrected online from the forwards and the rows' work each service
measured of its Propose and Verify, as in-process, with each call's transport priced apart) and
the running acceptance. A row planned `ar` sends no Propose: its drafter (fed only when a plan
drafts, as in-process) commits the outcomes it missed with its next one.

so a step costs two RPCs whatever the batch, and the drafter and the verifier each run the
step's rows with one batched forward per tier and round (viasd.sessions.drive). Requests join
and leave between steps; a cycle only starts when its consumer asks for it (a slow consumer
holds its own request back, not the others), and a step waits up to `batch_wait_s` for the
rows of the batch to ask again. The batch is every request the coordinator runs: admission
in front of it (cluster/handler.py, `limits.max_concurrent_requests`) is the batch capacity.

Every internal RPC has a deadline. A failed Propose falls back (with `drafter_fallback`: the
request goes on as `ar` against the verifier, whose session is still consistent, and its stats
say `drafter_fallback`) or fails exactly the rows it carried; a failed Verify fails exactly its
rows; a row that failed alone on a backend (`RowError`) fails or falls back alone.

Each request keeps the stubs it was opened with until it ends, so that a backend replaced while
it runs (`set_backends`, after the pipeline rebuilt a dead actor) never sees a request it did not
open: requests in flight on a dead verifier fail with UNAVAILABLE, later ones use the new one (a
step makes one call per backend its rows were opened on). `on_unavailable(component)` is called
whenever an RPC finds a backend down or past its deadline (the pipeline's supervisor wakes up).

`Coordinator` is a plain asyncio class: usable in-process, in a Ray actor or a Serve replica.
Its gRPC channels and its step driver are made on first use, in the event loop that uses them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass

import grpc

from viasd.actors.rpc import InternalTLS, costs_from_proto, merge_outcomes, open_channel, times_from_proto
from viasd.config import GenerationParams, Mode, Proposer
from viasd.costs import CostModel, StepTimes
from viasd.engine import Chunk, RequestLimits, check_request, request_seeds, resolve_seed
from viasd.errors import InvalidParameterError, ViaSDError
from viasd.gates import Gates
from viasd.metrics import RequestStats, TokenLogprob
from viasd.planner import (
    Estimates,
    Plan,
    Planner,
    RowState,
    fixed_plan,
    learn_cycle,
    logit_rows,
)
from viasd.proposers import ngram_lookup
from viasd.sessions import CATCH_UP, sample_seed
from viasd.v1 import internal_pb2 as ipb
from viasd.v1 import internal_pb2_grpc
from viasd.v1.convert import logprobs_from_proto, params_to_proto, stats_from_proto

log = logging.getLogger("viasd.actors.coordinator")

PROFILE_TIMEOUT_S = 600.0  # the deadline of a `Costs` call (a first profile of a large model on a slow device)


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
    """What the coordinator's internal RPCs cost (seconds are wall time seen by the coordinator:
    model time + serialisation + transport + queueing). `rows` counts request rows over the
    Verify calls: rows / verify_calls is the mean batch."""

    requests: int = 0
    steps: int = 0
    cycles: int = 0  # request cycles (one per row of a step)
    rows: int = 0
    max_rows: int = 0  # the largest batch a Verify carried
    propose_calls: int = 0
    verify_calls: int = 0
    bytes_sent: int = 0  # serialised request messages
    bytes_received: int = 0  # serialised response messages
    probs_bytes: int = 0  # DraftProbs payload (included in both of the above: received, then sent)
    propose_seconds: float = 0.0
    verify_seconds: float = 0.0
    open_close_seconds: float = 0.0
    drafter_fallbacks: int = 0
    drafter_seconds: float = 0.0  # what the drafter reported it spent on the Proposes (`seconds`)
    verifier_seconds: float = 0.0  # what verifier rank 0 reported it spent on the Verifies
    coordinator_seconds: float = 0.0  # the steps' wall time outside their calls: planning, handing out
    wait_consumers_seconds: float = 0.0  # the driver waited, rows open, for any of them to ask again
    wait_batch_seconds: float = 0.0  # from the first row asking to the step's start (`batch_wait_s`)

    def to_dict(self) -> dict:
        return asdict(self)

    def phases(self) -> dict[str, float]:
        """Where the step driver's time went, in seconds: the services' own time on their calls,
        each call's transport (its round trip less that), the coordinator's own work in the steps,
        and its waits between steps (`viasd_coordinator_seconds{phase}`)."""
        return {
            "drafter": self.drafter_seconds,
            "propose_transport": self.propose_seconds - self.drafter_seconds,
            "verifier": self.verifier_seconds,
            "verify_transport": self.verify_seconds - self.verifier_seconds,
            "coordinator": self.coordinator_seconds,
            "wait_consumers": self.wait_consumers_seconds,
            "wait_batch": self.wait_batch_seconds,
        }


@dataclass(eq=False)
class _Request:
    request_id: str
    params: GenerationParams
    limits: RequestLimits
    seq_len: int  # prompt + committed tokens
    drafted: bool  # the drafter takes part (sd, via) and has not failed
    drafter_open: bool = False
    verifier_open: bool = False
    opening: asyncio.Future | None = None  # the Open calls: never cancelled half-way (see _close)
    previous: ipb.Outcome | None = None  # the last outcome, committed by the drafter on the next Propose
    drafter_stats: ipb.RequestStats | None = None  # each side's counters as of its last reply
    verifier_stats: ipb.RequestStats | None = None
    fallback: bool = False
    verifier: internal_pb2_grpc.VerifierServiceStub | None = None  # the backends it was opened on
    drafter: internal_pb2_grpc.DrafterServiceStub | None = None
    asked: asyncio.Future | None = None  # the consumer waits for this chunk (or error): join the next step
    stepping: asyncio.Future | None = None  # done when the step this request takes part in has ended
    left: bool = False  # finished, failed or abandoned: in no later step
    index: int = 0  # which sample of an n > 1 request
    stopped: bool = False  # ended early by stop_sample
    prompt_logprobs: list[TokenLogprob | None] | None = None  # for its first chunk (params.prompt_logprobs)
    estimates: Estimates | None = None  # `auto`: what each plan buys this request (viasd.planner) ...
    tokens: list[int] | None = None  # ... its prompt and committed tokens (the n-gram lookup) ...
    fed: int = 0  # ... positions its drafter's cache holds (lazy: 0 until a plan drafts; DraftSession.lag)
    via_seen: int = 0  # the verifier's escalation count at the last step


class Coordinator:
    """Runs requests across a DrafterService and a VerifierService, stepping them as one batch."""

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
        batch_wait_s: float = 0.02,
        gates: Gates | None = None,
        costs: CostModel | None = None,
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
        self.batch_wait_s = batch_wait_s  # how long a step waits for the last step's rows to ask again
        self.gates = gates  # `via` requests that choose no gate get these, as in-process (Engine.submit)
        self.costs = costs  # `auto`: both services' cost curves, fetched (`Costs`) for the first auto request
        # running estimates over every request: the prior of new `auto` ones
        self.estimates = Estimates(population=True)
        self.planner = Planner()  # `auto`'s plans, step after step
        self._costs_lock: asyncio.Lock | None = None
        self.totals = RpcTotals()
        self._active: dict[str, _Request] = {}  # by the id the backends know (a sample's: "<id>#<i>")
        self._groups: dict[str, list[_Request]] = {}  # a request's samples, by its id
        self._rows: list[_Request] = []  # opened requests that may join a step
        self._wake: asyncio.Event | None = None  # a request asked for its next chunk
        self._driver: asyncio.Task | None = None
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
        merged stats. Cancelling the consumer (or `aclose()`) closes both sessions.

        n > 1: n samples, sample i seeded `sample_seed(seed, i)` as in-process; samples 1..n-1 open
        after sample 0 and copy its prefill on both sides (`OpenRequest.prefill_from`), then all n
        step as rows of the batch. Their chunks interleave as steps commit them (`chunk.index` says
        whose; each sample's last chunk has its stats); `stop_sample` ends one early."""
        if self.gates is not None:  # the mask's calibrated gates (viasd.gates), as Engine.submit applies them
            params = self.gates.apply(params)
        prompt = check_request(
            prompt_ids,
            params,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            has_drafter=self.drafter_address is not None,
        )
        if params.mode not in (Mode.AR, Mode.AUTO) and self.drafter_address is None:
            # (the n-gram proposer runs on the drafter too; `auto` without one plans `ar` only)
            raise InvalidParameterError("mode", f"mode {params.mode.value!r} needs the pipeline's drafter; it has none")
        if not request_id:
            raise InvalidParameterError("request_id", "must not be empty")
        samples = [params]
        if params.n > 1:
            seed = resolve_seed(params)
            samples = [params.model_copy(update={"n": 1, "seed": sample_seed(seed, i)}) for i in range(params.n)]
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if request_id in self._groups or any(i in self._active for i in ids):
            raise InvalidParameterError("request_id", f"{request_id!r} is already running")
        self._connect()
        if params.mode == Mode.AUTO:
            await self.cost_model()
        reqs = [self._new_request(i, sample, prompt, index) for index, (i, sample) in enumerate(zip(ids, samples))]
        self._groups[request_id] = reqs
        self._active.update((r.request_id, r) for r in reqs)
        self.totals.requests += 1
        pending: dict[_Request, asyncio.Future] = {}  # sample -> its next chunk
        try:
            await self._open(reqs[0], prompt)
            if len(reqs) > 1:  # the others copy sample 0's prefill (it stays open until they are)
                await asyncio.gather(*(self._open(r, prompt, prefill_from=reqs[0].request_id) for r in reqs[1:]))
            await self._company(reqs)
            self._rows.extend(reqs)  # they join the next step
            pending = {r: asyncio.ensure_future(self._next(r)) for r in reqs}
            while pending:
                await asyncio.wait(pending.values(), return_when=asyncio.FIRST_COMPLETED)
                for r in [r for r, f in pending.items() if f.done()]:  # in sample order
                    chunk = pending.pop(r).result()
                    if r.stopped:  # ended by stop_sample: nothing more of it
                        continue
                    chunk.index = r.index
                    if r.prompt_logprobs is not None:  # each sample's first chunk scores the prompt
                        chunk.prompt_logprobs, r.prompt_logprobs = r.prompt_logprobs, None
                    if chunk.finished:
                        self._merge(r)
                    else:
                        pending[r] = asyncio.ensure_future(self._next(r))
                    yield chunk
        finally:
            # finished, cancelled, failed or abandoned: leave the batch, free both sides' caches.
            # After the last chunk, so that a Close queued behind other requests' forwards does not
            # delay it; a consumer iterating to the end (or `aclose()`) sees the sessions closed. The
            # ids stay taken until every Close call is done (even when this task is cancelled
            # meanwhile), so that a new request reusing one cannot meet the old session on a backend.
            for future in pending.values():
                future.cancel()
            for r in reqs:
                self._leave(r)
            closing = asyncio.ensure_future(asyncio.gather(*(self._close(r) for r in reqs)))
            closing.add_done_callback(lambda _: self._forget(request_id, reqs))
            await asyncio.shield(closing)

    def stop_sample(self, request_id: str, index: int) -> None:
        """End one sample of a running request early (a stop string in its text): it leaves the
        batch and its stream yields nothing more of it; its sessions close with the request's."""
        reqs = self._groups.get(request_id, ())
        if 0 <= index < len(reqs):
            r = reqs[index]
            r.stopped = True
            self._leave(r)
            _settle(r.asked, Chunk([], "abort"))

    def _new_request(self, request_id: str, params: GenerationParams, prompt: list[int], index: int) -> _Request:
        stats = RequestStats(mode=params.mode.value, prompt_tokens=len(prompt))
        auto = params.mode == Mode.AUTO
        return _Request(
            request_id,
            params,
            RequestLimits(params, len(prompt), self.max_context, self.eos_token_ids, stats),
            len(prompt),
            drafted=params.mode != Mode.AR and self._drafter is not None,
            verifier=self._verifier,
            drafter=self._drafter,
            index=index,
            estimates=Estimates(self.estimates) if auto else None,
            tokens=list(prompt) if auto else None,
        )

    async def cost_model(self) -> CostModel:
        """The cost curves `auto` plans with: the verifier's full and slim tiers and the drafter's,
        each profiled on its own service (`Costs`: measured once, cached there), one after the
        other so that they do not share the cores; then corrected online from the steps'
        Propose and Verify calls."""
        if self.costs is None:
            if self._costs_lock is None:
                self._costs_lock = asyncio.Lock()
            async with self._costs_lock:
                if self.costs is None:
                    timeout = max(self.rpc_timeout_s, PROFILE_TIMEOUT_S)
                    parts = {}
                    for name, stub in (("verifier", self._verifier), ("drafter", self._drafter)):
                        if stub is not None:
                            reply = await self._call(stub, name, "Costs", ipb.CostsRequest(), timeout=timeout)
                            parts[name] = costs_from_proto(reply)
                    self.costs = CostModel.combine(parts)
        return self.costs

    def planner_state(self) -> dict:
        """What `auto` plans with now (as `Engine.planner_state`): the cost model (None until the
        first `auto` request), the running estimates over every request, the probe steps run and the
        forecasts."""
        return {
            "costs": self.costs.summary() if self.costs is not None else None,
            **self.estimates.to_dict(),
            **self.planner.to_dict(),
        }

    def _forget(self, request_id: str, reqs: list[_Request]) -> None:
        self._groups.pop(request_id, None)
        for r in reqs:
            self._active.pop(r.request_id, None)

    async def close(self) -> None:
        """Stop the step driver and close the channels (requests still running fail)."""
        if self._driver is not None:
            self._driver.cancel()
            self._driver = None
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

    # ---------------------------------------------------------------- requests joining and leaving

    def _connect(self) -> None:
        if self._verifier is None:
            channel = open_channel(self.verifier_address, self.tls)
            self._channels["verifier"] = channel
            self._verifier = internal_pb2_grpc.VerifierServiceStub(channel)
        if self.drafter_address and self._drafter is None:
            channel = open_channel(self.drafter_address, self.tls)
            self._channels["drafter"] = channel
            self._drafter = internal_pb2_grpc.DrafterServiceStub(channel)

    async def _next(self, req: _Request) -> Chunk:
        """The request's next chunk: it joins the next step (a cycle only starts when the consumer
        asks for it, as for a request alone). One with nothing to generate (max_tokens 0: prompt
        logprobs only) ends at once."""
        if req.limits.remaining <= 0:
            self._leave(req)
            return req.limits.chunk([])
        req.asked = asyncio.get_running_loop().create_future()
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())
        self._wake.set()
        return await req.asked

    async def _company(self, reqs: list[_Request]) -> None:
        """A request opened into an empty batch waits for the Opens in flight (those of requests that
        arrived with it) and steps with them, instead of running steps alone meanwhile. Alone it
        would gain nothing: each service runs its calls in order, so its first Propose and Verify
        queue behind those Opens anyway, and the step they make is one the others then wait for
        (docs/SERVING.md, "A burst steps together"). A batch already stepping takes the request at
        once; only the Opens already in flight count, so arrivals that keep coming cannot hold it
        back."""
        if self._rows:
            return
        opening = [
            r.opening for r in self._active.values() if r not in reqs and r.opening is not None and not r.opening.done()
        ]
        if opening:
            await asyncio.wait(opening)

    def _leave(self, req: _Request) -> None:
        req.left = True
        if req in self._rows:
            self._rows.remove(req)

    def _waiting(self) -> list[_Request]:
        return [r for r in self._rows if r.asked is not None and not r.asked.done()]

    async def _drive(self) -> None:
        """The step driver: whenever requests ask for their next chunk, run one step over all of
        them. A step waits up to `batch_wait_s` for the other rows to ask again (their consumers
        run between steps), so that streams that keep up stay in one batch."""
        loop, t = asyncio.get_running_loop(), self.totals
        while True:
            idle, t0 = bool(self._rows), loop.time()  # (no row open: nobody waits)
            await self._wake.wait()
            t1 = loop.time()
            if idle:
                t.wait_consumers_seconds += t1 - t0
            deadline = t1 + self.batch_wait_s
            while len(self._waiting()) < len(self._rows) and loop.time() < deadline:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), deadline - loop.time())
                except TimeoutError:
                    break
            self._wake.clear()
            rows = self._waiting()
            if rows:
                t2, calls = loop.time(), t.propose_seconds + t.verify_seconds
                t.wait_batch_seconds += t2 - t1
                try:
                    await self._step(rows)
                except Exception as exc:  # a bug: the step's rows fail, the driver goes on
                    log.exception("step failed")
                    for r in rows:
                        _settle(r.asked, exc)
                # (the calls of several backends run at once: what is left may be below 0)
                t.coordinator_seconds += max(0.0, loop.time() - t2 - (t.propose_seconds + t.verify_seconds - calls))

    # ---------------------------------------------------------------- one step

    async def _call(self, stub, component: str, method: str, request, timeout: float | None = None):
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
        seconds, t = time.perf_counter() - t0, self.totals
        t.bytes_sent += request.ByteSize()
        t.bytes_received += response.ByteSize()
        if method == "Propose":
            t.propose_calls += 1
            t.propose_seconds += seconds
            t.probs_bytes += sum(len(r.probs.data) for r in response.rows)
        elif method == "Verify":
            t.verify_calls += 1
            t.verify_seconds += seconds
            t.rows += len(request.rows)
            t.max_rows = max(t.max_rows, len(request.rows))
        else:
            t.open_close_seconds += seconds
        return response

    async def _step(self, rows: list[_Request]) -> None:
        """One engine step over `rows`: one Propose for every drafting row, then one Verify for
        every row (per backend: requests opened before a rebuild keep their old one). A failed
        call fails (verifier) or falls back (drafter) exactly the rows it carried; a row that
        failed alone fails alone."""
        done = asyncio.get_running_loop().create_future()
        for r in rows:
            r.stepping = done
        self.totals.steps += 1
        t0 = time.perf_counter()
        times = _CallTimes()  # what the services measured of the step's calls (the cost model's)
        try:
            plans = self._plans(rows)
            verify: dict[_Request, ipb.VerifyRequest] = {}
            failed: dict[_Request, BaseException] = {}
            drafting = [r for r in rows if r.drafted and plans[r].kind != "ar"]
            await asyncio.gather(
                *(
                    self._propose(group, plans, verify, failed, times)
                    for group in _by_backend(drafting, "drafter").values()
                )
            )
            checking = [r for r in rows if r not in failed]
            outcomes: dict[_Request, ipb.VerifyResponse] = {}
            await asyncio.gather(
                *(
                    self._verify(group, verify, outcomes, failed, times)
                    for group in _by_backend(checking, "verifier").values()
                )
            )
            escalated = {r: r in outcomes and outcomes[r].stats.escalations > r.via_seen for r in rows}
            committed = 0
            for r in rows:
                if r in failed:
                    self._leave(r)
                    _settle(r.asked, failed[r])
                    continue
                result = outcomes[r]
                r.verifier_stats = result.stats
                if r.drafted:  # the drafter commits it with its next Propose (`auto` rows may skip some)
                    r.previous = merge_outcomes(r.previous, result.outcome)
                self.totals.cycles += 1
                tokens = list(result.outcome.tokens)
                r.seq_len += len(tokens)
                self._learn(r, plans[r], verify.get(r), result, escalated[r])
                chunk = r.limits.chunk(
                    tokens, logprobs_from_proto(result.logprobs) if r.params.logprobs is not None else None
                )
                committed += len(chunk.token_ids)
                if chunk.finished:
                    self._leave(r)
                _settle(r.asked, chunk)
            self.planner.settle(time.perf_counter() - t0, committed)
            if self.costs is not None:  # as in-process (`Scheduler._decode`), the calls' transport apart
                kinds = {  # (a row whose Propose failed went on as `ar`)
                    r: (plan.kind, logit_rows(plan, float(escalated[r])))
                    for r in outcomes
                    for plan in [plans[r] if r in verify else Plan("ar")]
                }
                self.costs.observe_step(times, kinds, time.perf_counter() - t0 - times.transport)
        finally:
            done.set_result(None)

    def _plans(self, rows: list[_Request]) -> dict[_Request, Plan]:
        """This step's plan of every row: its own mode's, or the planner's for `auto` rows
        (viasd.planner, as in-process: `Scheduler._plans`)."""
        started = time.perf_counter()
        states = [self._state(r) for r in rows]
        if all(s.fixed is not None for s in states):
            return {r: s.fixed for r, s in zip(rows, states)}
        prepared = time.perf_counter() - started
        return dict(zip(rows, self.planner.plans(self.costs, states + self._joining(), len(states), prepared)))

    def _state(self, r: _Request) -> RowState:
        """What the planner knows of a row: its own mode's plan, or an `auto` row's estimates."""
        gamma = r.limits.draft_length(r.seq_len)
        if r.estimates is None:  # (a row whose drafter failed goes on as `ar`)
            plan = fixed_plan(r.params.mode if r.drafted else Mode.AR, gamma)
            return RowState(fixed=plan, gamma=gamma, acceptance=self.estimates.acceptance)
        lag = len(r.tokens) - 1 - r.fed
        return r.estimates.row(
            gamma=gamma,
            ngram_match=len(ngram_lookup(r.tokens, gamma, r.params.ngram_max)) if r.drafted else 0,
            has_drafter=r.drafted and r.params.proposer != Proposer.NGRAM,
            lossy=r.params.auto_lossy,
            draft_lag=lag if lag > CATCH_UP else 0,
            remaining=r.limits.remaining,
        )

    def _joining(self, new: _Request | None = None) -> list[RowState]:
        """Requests still opening (prefilling) but `new` join the next steps: plans are for the
        batch they will run in, where they count as `ar` rows (as in-process)."""
        n = sum(1 for r in self._active.values() if not r.left and r not in self._rows and r is not new)
        return [RowState(fixed=Plan("ar"), gamma=0, acceptance=self.estimates.acceptance)] * n

    def _drafts_at_once(self, new: _Request) -> bool:
        """Whether a new `auto` request's drafter prefills with its prompt at Open
        (viasd.planner.drafts_from_the_start; as in-process: `Scheduler._drafts_at_once`)."""
        if not new.drafted or new.params.proposer == Proposer.NGRAM:
            return False
        batch = [self._state(r) for r in self._rows] + self._joining(new)
        return self.planner.drafts_from_the_start(self.costs, batch, self._state(new))

    def _learn(self, r: _Request, plan: Plan, sent: ipb.VerifyRequest | None, result, escalated: bool) -> None:
        """Update the running estimates the planner reads (the request's, and those over every
        request), and count an `auto` request's plan in its stats."""
        r.via_seen = result.stats.escalations
        if r.tokens is not None:  # the drafter's cache keeps what was fed and committed (sessions._commit)
            r.fed = min(r.fed, len(r.tokens) + result.outcome.num_draft_accepted)
            r.tokens.extend(result.outcome.tokens)
        learn_cycle(
            (self.estimates, r.estimates),
            plan,
            drafted=len(sent.draft) if sent is not None else 0,
            accepted=result.outcome.num_draft_accepted,
            committed=len(result.outcome.tokens),
            escalated=escalated,
            plans=r.limits.stats.plans if r.estimates is not None else None,
        )

    def _observe_call(self, call: str, group: list[_Request], response, seconds: float, times: _CallTimes) -> None:
        """A Propose's or Verify's forwards and rows' work join the step's `times`; its round trip
        beyond the seconds its service spent is transport (viasd.costs), learnt per call."""
        if self.costs is None:
            return
        times.join(times_from_proto(response, group))
        times.transport += seconds - response.seconds
        self.costs.observe_transport(call, seconds - response.seconds)

    async def _propose(self, group: list[_Request], plans: dict, verify: dict, failed: dict, times: _CallTimes) -> None:
        """One Propose for the drafting rows of one drafter (after committing what each row's
        drafter has not seen); their Verify rows go to `verify`."""
        for r in group:
            if r.tokens is not None and plans[r].kind != "ngram":
                r.fed = len(r.tokens) + plans[r].k - 1  # the context and every draft token but the last
        request = ipb.ProposeRequest(
            rows=[
                ipb.ProposeRequest(
                    request_id=r.request_id,
                    previous=r.previous,
                    k=plans[r].k,
                    proposer=plans[r].proposer.value if r.tokens is not None and plans[r].proposer else "",
                )
                for r in group
            ]
        )
        for r in group:
            r.previous = None  # (sent: the drafter commits it first)
        t0 = time.perf_counter()
        try:
            response = await self._call(group[0].drafter, "drafter", "Propose", request)
            self.totals.drafter_seconds += response.seconds
            answers: list = list(response.rows)
            self._observe_call("propose", group, response, time.perf_counter() - t0, times)
        except BackendError as exc:
            answers = [exc] * len(group)
        for r, answer in zip(group, answers):
            if isinstance(answer, ipb.ProposeResponse) and answer.HasField("error"):
                answer = BackendError("drafter", answer.error.code, answer.error.message)
            if isinstance(answer, BackendError):
                try:
                    self._fall_back(r, answer)
                except BackendError as exc:
                    failed[r] = exc
                continue
            r.drafter_stats = answer.stats
            verify[r] = ipb.VerifyRequest(
                request_id=r.request_id,
                draft=answer.draft,
                probs=answer.probs if answer.HasField("probs") else None,
                plan=plans[r].kind if r.estimates is not None else "",  # (`auto`: how to check it)
            )

    async def _verify(
        self, group: list[_Request], verify: dict, outcomes: dict, failed: dict, times: _CallTimes
    ) -> None:
        """One Verify for the rows of one verifier (an empty draft: `ar`, one token)."""
        request = ipb.VerifyRequest(rows=[verify.get(r) or ipb.VerifyRequest(request_id=r.request_id) for r in group])
        t0 = time.perf_counter()
        try:
            response = await self._call(group[0].verifier, "verifier", "Verify", request)
        except BackendError as exc:
            failed.update((r, exc) for r in group)
            return
        self.totals.verifier_seconds += response.seconds
        self._observe_call("verify", group, response, time.perf_counter() - t0, times)
        for r, answer in zip(group, response.rows):
            if answer.HasField("error"):
                failed[r] = BackendError("verifier", answer.error.code, answer.error.message)
            else:
                outcomes[r] = answer

    # ---------------------------------------------------------------- open, fall back, close

    async def _open(self, req: _Request, prompt: list[int], prefill_from: str = "") -> None:
        draft_seed, verify_seed = request_seeds(resolve_seed(req.params))
        params = params_to_proto(req.params)  # fully resolved: both sides see the same request

        leader = self._active.get(prefill_from)
        if req.tokens is not None:  # `auto`: fed now, or at its first drafting step (a sample: as its leader)
            fed_now = leader.fed > 0 if leader is not None else self._drafts_at_once(req)
            req.fed = len(prompt) - 1 if fed_now else 0

        def open_request(seed: int) -> ipb.OpenRequest:
            return ipb.OpenRequest(
                request_id=req.request_id,
                prompt_token_ids=prompt,
                params=params,
                seed=seed,
                prefill_from=prefill_from,
                feed_drafter=req.fed > 0,
            )

        calls = [self._call(req.verifier, "verifier", "Open", open_request(verify_seed))]
        if req.drafted:
            calls.append(self._call(req.drafter, "drafter", "Open", open_request(draft_seed)))
        # shielded: a request cancelled while opening must still learn what it opened, to close it
        req.opening = asyncio.ensure_future(asyncio.gather(*calls, return_exceptions=True))
        results = await asyncio.shield(req.opening)
        self._opened(req, results)
        if req.verifier_open:  # each side's counters so far (its prefill), until its first step
            req.verifier_stats = results[0].stats
        if req.drafter_open:
            req.drafter_stats = results[1].stats
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, BackendError):
                raise result
        if not req.verifier_open:
            raise results[0]
        if req.params.prompt_logprobs is not None:
            req.prompt_logprobs = [None, *logprobs_from_proto(results[0].prompt_logprobs)]
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
        self.totals.drafter_fallbacks += 1

    async def _close(self, req: _Request) -> None:
        """Close whatever is open, ignoring errors (Close is idempotent on both sides)."""
        if req.opening is not None:  # (cancelled while opening: let the Open calls finish first)
            try:
                self._opened(req, await asyncio.wait_for(asyncio.shield(req.opening), self.rpc_timeout_s))
            except Exception as exc:
                log.warning("request %s: open did not finish (%s); closing both sides anyway", req.request_id, exc)
                req.verifier_open, req.drafter_open = True, req.params.mode != Mode.AR
        if req.stepping is not None and not req.stepping.done():  # its step ends first (within the RPC deadlines)
            await asyncio.wait([req.stepping], timeout=3 * self.rpc_timeout_s)
        calls = []
        if req.verifier_open:
            calls.append(self._call(req.verifier, "verifier", "Close", ipb.CloseRequest(request_id=req.request_id)))
        if req.drafter_open:
            calls.append(self._call(req.drafter, "drafter", "Close", ipb.CloseRequest(request_id=req.request_id)))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("request %s: close failed: %s", req.request_id, result)
        req.verifier_open = req.drafter_open = False

    @staticmethod
    def _merge(req: _Request) -> None:
        """The request's stats: its own fields (tokens, times, finish) plus both sides' counters."""
        stats = req.limits.stats
        for side in (req.drafter_stats, req.verifier_stats):
            if side is not None:
                stats.add_counters(stats_from_proto(side))
        stats.drafter_fallback = req.fallback


def _by_backend(rows: list[_Request], component: str) -> dict[int, list[_Request]]:
    """Rows grouped by the stub of `component` they were opened on (one call per backend)."""
    groups: dict[int, list[_Request]] = {}
    for r in rows:
        groups.setdefault(id(getattr(r, component)), []).append(r)
    return groups


@dataclass
class _CallTimes(StepTimes):
    """A served step's `StepTimes`, gathered from the answers of its calls (a row's work in its
    Propose and its Verify adds up), and the seconds of its calls' transport."""

    transport: float = 0.0

    def join(self, call: StepTimes) -> None:
        self.forwards += call.forwards
        for key, seconds in call.work.items():
            self.work[key] = self.work.get(key, 0.0) + seconds


def _settle(future: asyncio.Future | None, result) -> None:
    """Hand a step's chunk (or error) to the consumer waiting for it, unless it gave up."""
    if future is None or future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
