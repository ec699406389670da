"""The coordinator: the engine's one step loop (viasd.scheduler) driving the drafter actor and the
verifier group through `ServedExecutor`, one batched RPC per phase of a step and backend
(prefill, propose, verify, release: docs/ARCHITECTURE.md, "One loop, two executors").

    executor = ServedExecutor(verifier_address, drafter_address, vocab_size=V, tls=..., ...)
    coordinator = AsyncEngine(Engine.over(executor, capacity, eos_token_ids=..., gates=...))
    async for chunk in coordinator.generate(request_id, prompt_ids, params): ...

A row's drafter commits the outcomes it has not seen with its next Propose (an `auto` row planned
`ar` sends nothing). Sampled blocks travel as their draft tokens' probabilities alone
(`draft_route` "probability", docs/SERVING.md "Draft data on the wire"): the verifier accepts on
p(x~) and returns q's row at a rejection, the drafter draws the last token from it (`Correct`,
after the Verify), and the verifier learns that token with its next call (`settles`). The calls
block (gRPC's synchronous channels) on the engine's step thread, each under a deadline. A call that fails fails exactly its rows (`BackendError`: the scheduler
lets a row whose drafter failed go on as `ar`), a row that failed alone on a backend fails alone,
and `on_unavailable(component)` hears of every backend found down or past its deadline (the
pipeline's supervisor rebuilds it; `set_backends` points new requests at it, requests keep the
backends they were opened on).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import grpc

from viasd.actors.rpc import InternalTLS, costs_from_proto, merge_outcomes, open_channel, times_from_proto
from viasd.costs import CostModel, StepTimes
from viasd.errors import BackendError
from viasd.executor import PrefillBatch, Prefilled, Proposal, ProposeRow, VerifyRow, point_route
from viasd.metrics import RequestStats
from viasd.sessions import Outcome, drafter_lag, valid_after
from viasd.v1 import internal_pb2 as ipb
from viasd.v1 import internal_pb2_grpc
from viasd.v1.convert import logprobs_from_proto, params_to_proto, stats_from_proto

log = logging.getLogger("viasd.actors.coordinator")

PROFILE_TIMEOUT_S = 600.0  # the deadline of a `Costs` call (a first profile of a large model on a slow device)


@dataclass
class RpcTotals:
    """What the engine's internal calls cost. Seconds are wall time seen from here (the service's
    time + serialisation + transport); the services report their own (`service_seconds`)."""

    requests: int = 0  # requests opened
    steps: int = 0  # verify phases: engine steps that decoded
    rows: int = 0  # verify rows over them (rows / steps: the mean batch)
    max_rows: int = 0  # the largest batch a Verify carried
    calls: dict[str, int] = field(default_factory=dict)  # "Prefill", "Propose", "Verify", "Correct", ... -> calls
    seconds: dict[str, float] = field(default_factory=dict)  # the same -> round-trip seconds
    phase_seconds: dict[str, float] = field(default_factory=dict)  # "prefill", ... -> wall (the sides' calls at once)
    # "drafter", "verifier": the seconds each service reported for its Propose, Verify calls
    service_seconds: dict[str, float] = field(default_factory=dict)
    bytes_sent: int = 0  # serialised request messages
    bytes_received: int = 0  # serialised replies
    probs_bytes: int = 0  # draft data from the drafter: p's rows (DraftProbs) or 8 bytes per p(x~) (sent on too)
    corrections: int = 0  # blocks whose last token the drafter drew (probability only)

    def to_dict(self) -> dict:
        return asdict(self)

    def phases(self) -> dict[str, float]:
        """Where the executor's time went, in seconds (`viasd_coordinator_seconds{phase}`): each
        service's own time on the step's Propose and Verify calls, each call's transport (its
        round trips less that), the prefill and release calls."""
        s, wall, own = self.seconds, self.phase_seconds, self.service_seconds
        return {
            "prefill": wall.get("prefill", 0.0),
            "drafter": own.get("drafter", 0.0),
            "propose_transport": s.get("Propose", 0.0) - own.get("drafter", 0.0),
            "verifier": own.get("verifier", 0.0),
            "verify_transport": s.get("Verify", 0.0) - own.get("verifier", 0.0),
            "correct": wall.get("correct", 0.0),
            "release": wall.get("release", 0.0),
        }


@dataclass(eq=False)
class _Row:
    """A request as the executor knows it: its key on the actors, the backends it was opened on,
    what its drafter has (the outcomes it has not committed, the positions its cache holds)."""

    wire: str  # its key on the actors (unique per executor: several engines may share the actors)
    verifier: internal_pb2_grpc.VerifierServiceStub
    drafter: internal_pb2_grpc.DrafterServiceStub | None  # None: it does not draft
    seq_len: int  # prompt + committed tokens
    point: bool  # its sampled blocks may travel as p(x~) alone (viasd.executor.point_route)
    fed: int = 0  # positions its drafter's cache holds (its last report, rolled back by the commits since)
    previous: ipb.Outcome | None = None  # outcomes its drafter has not committed
    settle: int | None = None  # the last token its verifier has not been told (drawn by the drafter)
    lost: BackendError | None = None  # its drafter failed its prefill: its first Propose fails with this


class ServedExecutor:
    """An engine's executor over the drafter and verifier services (module docstring).
    `draft_route`: "probability" (p(x~) alone, a rejected block's q row back to the drafter) or
    "rows" (p's rows through the engine, as every row of the staged rule or with logprobs)."""

    draft_route = "probability"

    def __init__(
        self,
        verifier_address: str,
        drafter_address: str | None = None,
        *,
        vocab_size: int,
        rpc_timeout_s: float = 60.0,
        on_unavailable: Callable[[str], None] | None = None,
        tls: InternalTLS | None = None,
    ):
        self.vocab_size = vocab_size
        self.rpc_timeout_s = rpc_timeout_s
        self.on_unavailable = on_unavailable
        self.tls = tls  # mutual TLS to both services (actors/rpc.py), or None: plaintext
        self.totals = RpcTotals()
        self._nonce = uuid.uuid4().hex[:8]
        self._rows: dict[str, _Row] = {}
        self._lock = threading.Lock()  # guards the backends (set_backends runs on another thread)
        self._channels: dict[int, tuple[object, grpc.Channel]] = {}  # id(stub) -> (the stub, its channel)
        self._verifier = self._drafter = None
        self.verifier_address = self.drafter_address = None
        self.set_backends(verifier_address, drafter_address)
        self.has_drafter = self.proposes = drafter_address is not None
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="viasd-rpc")  # a phase's calls to several backends

    # ---------------------------------------------------------------- backends

    def set_backends(self, verifier_address: str | None = None, drafter_address: str | None = None) -> None:
        """Point new requests at these services (a rebuilt actor). Requests in flight keep the
        ones they were opened on: calls to a dead one fail them (UNAVAILABLE); a replaced
        channel closes once no request uses it."""
        with self._lock:
            if verifier_address:
                self.verifier_address = verifier_address
                self._verifier = self._stub(internal_pb2_grpc.VerifierServiceStub, verifier_address)
            if drafter_address:
                self.drafter_address = drafter_address
                self._drafter = self._stub(internal_pb2_grpc.DrafterServiceStub, drafter_address)
            self._close_unused()

    def _stub(self, cls, address: str):
        channel = open_channel(address, self.tls, aio=False)
        stub = cls(channel)
        self._channels[id(stub)] = (stub, channel)
        return stub

    def _close_unused(self) -> None:
        """Close the replaced channels no request uses any more (under `_lock`)."""
        used = {id(self._verifier), id(self._drafter)}
        used |= {id(s) for r in list(self._rows.values()) for s in (r.verifier, r.drafter)}  # (a snapshot)
        for key in [k for k in self._channels if k not in used]:
            self._channels.pop(key)[1].close()

    def close(self) -> None:
        with self._lock:
            for _, channel in self._channels.values():
                channel.close()
            self._channels.clear()
        self._pool.shutdown(wait=False)

    # ---------------------------------------------------------------- calls

    def _call(self, stub, component: str, method: str, request, timeout: float | None = None):
        """One blocking call: its reply and round-trip seconds, or BackendError."""
        t0 = time.perf_counter()
        try:
            reply = getattr(stub, method)(request, timeout=timeout or self.rpc_timeout_s)
        except grpc.RpcError as exc:
            err = BackendError(component, exc.code().name, exc.details() or "")
        except ValueError as exc:  # its channel was closed: the backend was replaced
            err = BackendError(component, "UNAVAILABLE", f"{component} was replaced: {exc}")
        else:
            seconds, t = time.perf_counter() - t0, self.totals
            t.calls[method] = t.calls.get(method, 0) + 1
            t.seconds[method] = t.seconds.get(method, 0.0) + seconds
            t.bytes_sent += request.ByteSize()
            t.bytes_received += reply.ByteSize()
            return reply, seconds
        if err.unavailable and self.on_unavailable is not None:
            self.on_unavailable(component)
        raise err

    def _answers(self, calls: list[tuple], phase: str, times: StepTimes | None = None):
        """A phase's calls (stub, component, method, request, keys), all at once: (key, component,
        answer) for each row, the answer its reply row or the BackendError that failed its call or
        the row alone. The replies' figures join `times` (Propose, Verify: the cost model's)."""

        def one(call):
            try:
                return self._call(*call[:4])
            except BackendError as exc:
                return exc

        t0 = time.perf_counter()
        results = [one(calls[0])] if len(calls) == 1 else list(self._pool.map(one, calls))
        t = self.totals
        t.phase_seconds[phase] = t.phase_seconds.get(phase, 0.0) + time.perf_counter() - t0
        for (_, component, _, _, keys), result in zip(calls, results):
            if isinstance(result, BackendError):
                yield from ((key, component, result) for key in keys)
                continue
            reply, seconds = result
            if times is not None:  # (a call's round trip beyond its service's own seconds is transport)
                times.join(times_from_proto(reply, [self._key(row.request_id) for row in reply.rows]))
                times.transport[phase] = times.transport.get(phase, 0.0) + max(0.0, seconds - reply.times.seconds)
                t.service_seconds[component] = t.service_seconds.get(component, 0.0) + reply.times.seconds
            for row in reply.rows:
                # (a Release cannot fail alone: its rows have no error)
                failed = "error" in row.DESCRIPTOR.fields_by_name and row.HasField("error")
                error = BackendError(component, row.error.code, row.error.message) if failed else None
                yield self._key(row.request_id), component, error or row

    def _by_backend(self, keys, side: str) -> list[tuple[object, list[str]]]:
        """Requests by the backend of `side` they were opened on: (its stub, their keys) each,
        one call per backend; requests without one on that side are left out."""
        groups: dict[int, tuple[object, list[str]]] = {}
        for k in keys:
            stub = getattr(self._rows[k], side)
            if stub is not None:
                groups.setdefault(id(stub), (stub, []))[1].append(k)
        return list(groups.values())

    def _wire(self, key: str) -> str:
        return self._rows[key].wire

    @staticmethod
    def _key(wire: str) -> str:
        return wire.split("-", 1)[1]

    # ---------------------------------------------------------------- the phases

    def prefill(self, batch: PrefillBatch) -> dict[str, Prefilled | BackendError]:
        """Verifier rows that fail fail; a drafter that fails a row's prefill fails its first
        Propose (the scheduler then lets it go on as `ar`)."""
        with self._lock:
            verifier, drafter = self._verifier, self._drafter
        opens = {}
        for o in batch.opens:
            row = self._rows[o.key] = _Row(
                f"{self._nonce}-{o.key}", verifier, drafter if o.drafts else None, len(o.prompt), point_route(o.params)
            )
            opens[o.key] = ipb.Open(
                request_id=row.wire, prompt_token_ids=o.prompt, params=params_to_proto(o.params), seed=o.seed
            )
        self.totals.requests += len(opens)
        keys = list(dict.fromkeys([*opens, *(c.key for c in batch.chunks), *(c.key for c in batch.copies)]))
        calls = []
        for side in ("verifier", "drafter"):
            for stub, group in self._by_backend(keys, side):
                mine = set(group)
                request = ipb.PrefillBatch(
                    opens=[opens[k] for k in group if k in opens],
                    chunks=[
                        ipb.PrefillChunk(request_id=self._wire(c.key), upto=c.upto)
                        for c in batch.chunks
                        if c.key in mine and (side == "verifier" or c.drafter)
                    ],
                    copies=[
                        ipb.PrefillCopy(request_id=self._wire(c.key), leader=self._wire(c.leader))
                        for c in batch.copies
                        if c.key in mine
                    ],
                    settles=self._settles(stub) if side == "verifier" else None,
                )
                if request.opens or request.chunks or request.copies or request.settles:
                    calls.append((stub, side, "Prefill", request, group))
        out: dict[str, Prefilled | BackendError] = {k: Prefilled([], 0) for k in keys}
        for key, side, answer in self._answers(calls, "prefill"):
            if side == "verifier" and isinstance(answer, BackendError):
                out[key] = answer
            elif side == "verifier":
                out[key] = Prefilled(logprobs_from_proto(answer.prompt_logprobs), answer.fed)
            elif isinstance(answer, BackendError):
                self._rows[key].lost = answer
            else:
                self._rows[key].fed = answer.fed
        return out

    def propose(self, rows: Sequence[ProposeRow], times: StepTimes) -> list[Proposal | BackendError]:
        out: dict[str, Proposal | BackendError] = {}
        asked = {r.key: r for r in rows}
        for r in rows:
            row = self._rows[r.key]
            if row.lost is not None or row.drafter is None:
                out[r.key] = row.lost or BackendError("drafter", "FAILED_PRECONDITION", "the request has no drafter")
        calls = []
        for stub, group in self._by_backend([k for k in asked if k not in out], "drafter"):
            request = ipb.ProposeBatch(
                rows=[
                    ipb.ProposeRow(
                        request_id=self._wire(k),
                        previous=self._rows[k].previous,
                        k=asked[k].k,
                        proposer=asked[k].proposer.value if asked[k].proposer else "",
                        p_x=self.draft_route == "probability" and self._rows[k].point,
                    )
                    for k in group
                ]
            )
            for k in group:
                self._rows[k].previous = None  # (sent: the drafter commits it first)
            calls.append((stub, "drafter", "Propose", request, group))
        for key, _, answer in self._answers(calls, "propose", times):
            if not isinstance(answer, BackendError):
                self._rows[key].fed = answer.fed
                self.totals.probs_bytes += len(answer.probs.data) + 8 * len(answer.p_x)
                probs = answer.probs if answer.HasField("probs") else list(answer.p_x) or None  # (p(x~) alone: a list)
                answer = Proposal(list(answer.draft), probs)
            out[key] = answer
        return [out[r.key] for r in rows]

    def verify(self, rows: Sequence[VerifyRow], times: StepTimes) -> list[Outcome | BackendError]:
        asked = {r.key: r for r in rows}
        calls = []
        for stub, group in self._by_backend(asked, "verifier"):
            request = ipb.VerifyBatch(
                rows=[
                    ipb.VerifyRow(
                        request_id=self._wire(r.key),
                        draft=r.draft,
                        probs=r.probs if isinstance(r.probs, ipb.DraftProbs) else None,
                        p_x=r.probs if isinstance(r.probs, list) else [],
                        plan=r.plan,
                    )
                    for r in map(asked.get, group)
                ],
                settles=self._settles(stub),
            )
            calls.append((stub, "verifier", "Verify", request, group))
        self.totals.steps += 1
        self.totals.rows += len(rows)
        self.totals.max_rows = max(self.totals.max_rows, len(rows))
        out: dict[str, Outcome | BackendError] = {}
        pending: dict[str, ipb.Correction] = {}
        for key, _, answer in self._answers(calls, "verify", times):
            if not isinstance(answer, BackendError):
                if answer.HasField("correction"):
                    pending[key] = answer.correction
                answer = Outcome(
                    list(answer.outcome.tokens),
                    answer.outcome.num_draft_accepted,
                    logprobs_from_proto(answer.logprobs) or None,
                    answer.escalated,
                )
            out[key] = answer
        for key, token in self._correct(pending, out).items():
            if isinstance(token, BackendError):
                out[key] = token
            else:
                out[key].tokens.append(token)
                self._rows[key].settle = token
        for key, outcome in out.items():
            if isinstance(outcome, Outcome):
                self._commit(self._rows[key], outcome)
        return [out[r.key] for r in rows]

    def _correct(self, pending: dict[str, ipb.Correction], out: dict) -> dict[str, int | BackendError]:
        """The last token of each pending block, drawn by its drafter (one Correct per backend).
        A row whose drafter cannot draw it fails (component "correction": its verifier waits
        for a token that no other side can draw exactly)."""
        self.totals.corrections += len(pending)
        calls = [
            (
                stub,
                "drafter",
                "Correct",
                ipb.CorrectBatch(
                    rows=[
                        ipb.CorrectRow(
                            request_id=self._wire(k),
                            position=out[k].num_draft_accepted,
                            q=pending[k].q,
                            u=pending[k].u,
                        )
                        for k in group
                    ]
                ),
                group,
            )
            for stub, group in self._by_backend(pending, "drafter")
        ]
        tokens = {}
        for key, _, answer in self._answers(calls, "correct"):
            failed = isinstance(answer, BackendError)
            tokens[key] = BackendError("correction", answer.code, answer.details) if failed else answer.token
        return tokens

    def _settles(self, stub) -> dict[str, int]:
        """The tokens the verifier behind `stub` has not been told, for its next call (then sent)."""
        settles = {}
        for row in self._rows.values():
            if row.verifier is stub and row.settle is not None:
                settles[row.wire], row.settle = row.settle, None
        return settles

    def _commit(self, row: _Row, outcome: Outcome) -> None:
        """What the row's drafter will commit with its next Propose, and the positions its cache
        will still hold then (viasd.sessions.valid_after: as the drafter's commit computes them)."""
        if row.drafter is not None:
            message = ipb.Outcome(tokens=outcome.tokens, num_draft_accepted=outcome.num_draft_accepted)
            row.previous = merge_outcomes(row.previous, message)
            row.fed = valid_after(row.fed, row.seq_len, outcome)
        row.seq_len += len(outcome.tokens)

    def release(self, keys: Sequence[str]) -> dict[str, RequestStats]:
        keys = [k for k in keys if k in self._rows]
        calls = [
            (stub, side, "Release", ipb.ReleaseBatch(request_ids=[self._wire(k) for k in group]), group)
            for side in ("verifier", "drafter")
            for stub, group in self._by_backend(keys, side)
        ]
        out: dict[str, RequestStats] = {}
        failed = set()
        for key, side, answer in self._answers(calls, "release"):
            if isinstance(answer, BackendError):
                failed.add((side, str(answer)))
            elif answer.existed:
                out.setdefault(key, RequestStats()).add_counters(stats_from_proto(answer.stats))
        for side, error in failed:
            log.warning("release on the %s failed: %s", side, error)
        for k in keys:
            del self._rows[k]
        with self._lock:
            self._close_unused()
        return out

    def draft_lag(self, key: str) -> int:
        row = self._rows[key]
        return 0 if row.drafter is None else drafter_lag(row.seq_len, row.fed)

    def costs(self) -> CostModel:
        """The verifier's full and slim tiers' curves and the drafter's, each profiled on its own
        service (`Costs`: measured once, cached there), one after the other so that they do not
        share the cores; the engine corrects them online from the steps' calls."""
        parts = {}
        with self._lock:
            stubs = (("verifier", self._verifier), ("drafter", self._drafter))
        for name, stub in stubs:
            if stub is not None:
                timeout = max(self.rpc_timeout_s, PROFILE_TIMEOUT_S)
                reply, _ = self._call(stub, name, "Costs", ipb.CostsRequest(), timeout=timeout)
                parts[name] = costs_from_proto(reply)
        return CostModel.combine(parts)
