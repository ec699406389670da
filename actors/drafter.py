"""The drafter p as a gRPC service (viasd.v1.DrafterService) and the Ray actor that hosts it.

`DrafterServicer` holds one `viasd.engine.DraftSession` (a row of the drafter's cache + random
stream + its copy of the sequence) per request id. A step is one `Propose` for every drafting
row of the coordinator's batch: commit each row's previous outcome, then draft every block
together with `viasd.sessions.drive` (one batched drafter forward per round; a row leaves when
its block ends). Rows with `overlap` whose blocks are likely accepted whole
(`DraftSession.drafts_ahead`) then draft their next blocks together, on the same
thread, until the next Propose arrives. Forwards run on one worker thread, so the event loop
keeps answering Open / Close (and calls queue in arrival order); the servicer is usable in
any process with a running event loop, the actor only adds model loading and a port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import filelock
import grpc
import ray

from viasd import model_thread
from viasd.actors.rpc import (
    Batched,
    InOrder,
    SessionNotFound,
    advertised_host,
    cores_lock,
    costs_to_proto,
    encode_probs,
    forwards_to_proto,
    free_row,
    internal_tls,
    outcome_from_proto,
    row_error,
    rows_of,
    rpc,
    start_server,
)
from viasd.config import MAX_GAMMA, EngineConfig, Mode, Proposer
from viasd.costs import CostModel, StepTimes, profile_tiers
from viasd.engine import DraftSession
from viasd.errors import InvalidParameterError
from viasd.metrics import RequestStats
from viasd.precision import LinearReport, engine_dtype, optimize_linears
from viasd.runtime import MaskedLM
from viasd.sessions import drive, execute, prefill_together
from viasd.v1 import internal_pb2 as ipb
from viasd.v1 import internal_pb2_grpc
from viasd.v1.convert import params_from_proto, stats_to_proto

log = logging.getLogger("viasd.actors.drafter")


class DrafterServicer(internal_pb2_grpc.DrafterServiceServicer):
    """Draft sessions by request id, on rows of one drafter cache (`max_rows` rows, so that a
    step's rows run as one batched forward); p leaves only when the rules need it (sampling)."""

    def __init__(
        self,
        lm: MaskedLM,
        *,
        probs_dtype: str = "auto",
        max_rows: int = 64,
        cost_cache_dir: str | None = None,
        prefill_tokens: int = 512,
        cores: filelock.FileLock | None = None,
    ):
        self.lm = lm
        self.probs_dtype = probs_dtype
        self.store = lm.new_store(max_rows=max_rows)
        self.sessions: dict[str, DraftSession] = {}
        self._work = InOrder("drafter", cores)  # (cores: the node's cores lock, `cores_lock`)
        self._opens = Batched(lambda items: self._work.submit(self._prefill, items))
        self.prefill_tokens = prefill_tokens  # padded tokens per batched prefill forward (engine.prefill_chunk)
        self.cost_cache_dir = cost_cache_dir  # where `Costs` caches the profile (None: measured each start)
        self.costs: CostModel | None = None

    def _session(self, request_id: str) -> DraftSession:
        try:
            return self.sessions[request_id]
        except KeyError:
            raise SessionNotFound(f"drafter has no session {request_id!r}") from None

    @rpc
    async def Open(self, request: ipb.OpenRequest, context) -> ipb.OpenResponse:
        if request.request_id in self.sessions:
            raise InvalidParameterError("request_id", f"{request.request_id!r} is already open on the drafter")
        params = params_from_proto(request.params)
        prompt = list(request.prompt_token_ids)
        stats = RequestStats(mode=params.mode.value, prompt_tokens=len(prompt))
        row = None
        if params.proposer != Proposer.NGRAM:  # a row of the shared cache; a private one when all are taken
            row = free_row(self.store) or self.lm.new_cache()
        session = DraftSession(self.lm, prompt, params, request.seed, stats, cache=row)
        # a sample of an n > 1 request copies sample 0's prefill; `auto` is fed when a plan drafts
        # unless the coordinator planned it to draft at once (as in-process); the others prefill
        # the prompt but its last token, together with the Opens that arrive while earlier ones run
        leader = self._session(request.prefill_from) if request.prefill_from else None
        if leader is not None or params.mode != Mode.AUTO or request.feed_drafter:
            try:
                await self._opens.submit((session, leader))
            except BaseException:
                session.release()
                raise
        self.sessions[request.request_id] = session
        return ipb.OpenResponse(request_id=request.request_id, stats=stats_to_proto(stats))

    def _prefill(self, items: list[tuple[DraftSession, DraftSession | None]]) -> list[None]:
        """On the worker thread: the Opens' prefills, those without a leader together."""
        prefill_together([session for session, leader in items if leader is None], self.prefill_tokens)
        for session, leader in items:
            if leader is not None:
                session.copy_prefill(leader)
        return [None] * len(items)

    @rpc
    async def Propose(self, request: ipb.ProposeRequest, context) -> ipb.ProposeResponse:
        """Commit each row's previous outcome, then draft every row's block together."""
        t0 = time.perf_counter()
        rows, batched = rows_of(request)
        answers: list[ipb.ProposeResponse | None] = [None] * len(rows)
        work = {}  # row index -> (session, previous outcome, k, proposer)
        for i, row in enumerate(rows):
            try:
                session = self._session(row.request_id)
                if not 1 <= row.k <= MAX_GAMMA:
                    raise InvalidParameterError("k", f"must be in 1..{MAX_GAMMA}, got {row.k}")
                proposer = _proposer(row.proposer)
            except (SessionNotFound, InvalidParameterError) as exc:
                if not batched:
                    raise
                answers[i] = ipb.ProposeResponse(request_id=row.request_id, error=row_error(exc))
                continue
            previous = outcome_from_proto(row.previous) if row.HasField("previous") else None
            work[i] = (session, previous, row.k, proposer)
        for other in self.sessions.values():  # drafting ahead (overlap) yields the thread to any Propose
            other.stop.set()
        times = StepTimes()  # what the coordinator's cost model learns from (viasd.costs)
        if work:
            done = await self._work.submit(self._propose, {i: (rows[i].request_id, *w) for i, w in work.items()}, times)
            for i, answer in done.items():
                answers[i] = answer
            ahead = {i: w[0] for i, w in work.items() if w[0].drafts_ahead() and answers[i].draft}
            if ahead:  # draft the next blocks while the verifier checks these ones (rows likely accepted whole)
                # (beside the Verify, outside the cores lock: drafting ahead is overlap's point)
                self._work.submit(self._draft_ahead, ahead, exclusive=False).add_done_callback(_log_failure)
        response = ipb.ProposeResponse(rows=answers) if batched else answers[0]
        response.forwards.extend(forwards_to_proto(times))
        response.seconds = time.perf_counter() - t0
        return response

    def _propose(self, work: dict, times: StepTimes) -> dict[int, ipb.ProposeResponse]:
        """On the worker thread: commit, catch lazy drafters up (`auto`: one batched prefill
        forward), draft (one batched drafter forward per round), serialise (p can be megabytes).
        `times` gets the forwards and each row's work between them."""
        for _, session, previous, _, _ in work.values():
            if previous is not None:
                session.commit(previous)
        catch_up = [
            f for _, session, _, _, proposer in work.values() if proposer is None for f in session.catch_up_steps()
        ]
        if catch_up:
            execute(catch_up, prefill=True, observe=times.observe)
        proposals = drive(
            {i: session.propose_steps(k, proposer) for i, (_, session, _, k, proposer) in work.items()},
            observe=times.observe,
            timing=times.work,
        )
        out = {}
        for i, (request_id, session, *_) in work.items():
            draft, p = proposals[i]  # [k], [k, V] or None
            out[i] = ipb.ProposeResponse(
                request_id=request_id,
                draft=draft,
                probs=encode_probs(p, self.probs_dtype),
                stats=stats_to_proto(session.stats),
                work_seconds=times.work.get(i, 0.0),
            )
        return out

    @rpc
    async def Costs(self, request: ipb.CostsRequest, context) -> ipb.CostsResponse:
        """The drafter tier's cost curve (viasd.costs), profiled on the worker thread on first call."""
        if self.costs is None:
            tiers = {"drafter": (self.lm, None)}
            self.costs = await self._work.submit(lambda: profile_tiers(tiers, cache_dir=self.cost_cache_dir))
        return costs_to_proto(self.costs)

    @staticmethod
    def _draft_ahead(sessions: dict) -> None:
        drive({i: s.draft_ahead_steps() for i, s in sessions.items()})

    @rpc
    async def Close(self, request: ipb.CloseRequest, context) -> ipb.CloseResponse:
        # a Propose still running keeps its own reference; the cache row goes when it finishes
        session = self.sessions.pop(request.request_id, None)
        if session is not None:
            session.stop.set()  # (a block being drafted ahead stops after its next token)
            self._work.submit(session.release)  # after every forward already queued with the row
        return ipb.CloseResponse(existed=session is not None)

    def shutdown(self) -> None:
        self.sessions.clear()
        self._work.shutdown()


def _proposer(name: str) -> Proposer | None:
    """A Propose row's proposer override (`auto` plans); empty: the request's own."""
    if not name:
        return None
    try:
        return Proposer(name)
    except ValueError:
        raise InvalidParameterError("proposer", f"unknown proposer {name!r}") from None


def _log_failure(done) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("drafting ahead failed: %s", done.exception())


def pack_linears(model, config: EngineConfig, device: str) -> LinearReport:
    """The prepacked CPU linears the in-process engine uses (`EngineConfig.packed_linears`,
    viasd.precision), so that a served request runs the kernels of an in-process one; what was
    packed (reported with the runtime in /v1/models: packing stops where memory runs short)."""
    if not config.packed_linears:
        return LinearReport("off")
    return optimize_linears(model, engine_dtype(config, device).dtype, device)


def set_threads(threads: int | None, ranks: int) -> int:
    """torch threads of an actor: the configured count (`engine.threads`), else this node's cores
    over the verifier's ranks (at least 1). The drafter and the verifier take turns within a step
    (one Propose, then one Verify), so each may use every core the pipeline holds, as the
    in-process engine does; the tensor-parallel ranks run at once and split them. (Ray's CPU
    reservations, `drafter_cpus` / `verifier_cpus_per_rank`, place the actors; they are not
    thread counts.) Actors with every core take turns on the node (`cores_lock`); `overlap`
    drafting during the verification is better off with `engine.threads` set."""
    import torch

    n = threads or max(1, (os.cpu_count() or 1) // max(1, ranks))
    torch.set_num_threads(n)
    return n


@ray.remote
class DrafterActor:
    """Loads the drafter of an EngineConfig and serves DrafterService on a free port."""

    def __init__(self):
        self.server: grpc.aio.Server | None = None
        self.servicer: DrafterServicer | None = None

    async def start(
        self,
        engine: dict,
        *,
        host: str = "127.0.0.1",
        device: str = "cpu",
        ranks: int = 1,
        probs_dtype: str = "auto",
        tls: dict | None = None,
    ) -> dict:
        """Load the model, start the server (mutual TLS with `tls`, an InternalTLS); return its
        address and the model's facts."""
        from viasd.engine import cost_cache_dir
        from viasd.models.loader import load_causal_lm

        config = EngineConfig.model_validate(engine)

        def load() -> tuple[MaskedLM, int, LinearReport]:  # on the model thread, where it will run (viasd.model_thread)
            threads = set_threads(config.threads, ranks)
            model, _ = load_causal_lm(
                config.drafter,
                dtype=engine_dtype(config, device).dtype,
                device=device,
                trust_remote_code=config.trust_remote_code,
            )
            packed = pack_linears(model, config, device)  # (before MaskedLM takes the modules)
            return MaskedLM(model), threads, packed

        lm, threads, packed = await asyncio.get_running_loop().run_in_executor(model_thread.executor(), load)
        self.servicer = DrafterServicer(
            lm,
            probs_dtype=probs_dtype,
            cost_cache_dir=str(cost_cache_dir()),
            prefill_tokens=config.prefill_chunk,
            cores=cores_lock(device, threads, ranks=1),
        )
        self.server, port = await start_server(
            lambda s: internal_pb2_grpc.add_DrafterServiceServicer_to_server(self.servicer, s),
            host,
            tls=internal_tls(tls),
        )
        address = f"{advertised_host(host)}:{port}"
        log.info("drafter %s serving on %s (pid %d)", config.drafter, address, os.getpid())
        return {
            "address": address,
            "vocab_size": lm.vocab_size,
            "num_layers": lm.num_layers,
            "max_position_embeddings": getattr(lm.config, "max_position_embeddings", None),
            "pid": os.getpid(),
            "threads": threads,
            "linears": packed,  # (viasd.precision.LinearReport)
        }

    async def num_sessions(self) -> int:
        return len(self.servicer.sessions) if self.servicer else 0

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
            self.server = None
        if self.servicer is not None:
            self.servicer.shutdown()
