"""The drafter p as a gRPC service (viasd.v1.DrafterService) and the Ray actor that hosts it.

`DrafterServicer` is the drafter's half of every request of one engine
(`viasd.executor.DraftWorker`: a `DraftSession` per request, on rows of one cache store of the
engine's capacity) behind one RPC per phase of an engine step: `Prefill` (open, feed prompt
chunks, copy samples' rows), `Propose` (commit each row's outcomes, catch lagging drafters up,
draft every block together: one batched drafter forward per round), `Correct` (probability
only: the last token of each rejected block, from p's rows), `Release`. Rows with
`overlap` whose blocks are likely accepted whole (`DraftSession.drafts_ahead`) then draft their
next blocks, on the same thread, until the next call arrives. Forwards run on the process's
model thread in arrival order (`InOrder`), so the event loop keeps answering; the servicer is
usable in any process with a running event loop, the actor only adds model loading and a port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import filelock
import ray
import torch

from viasd import model_thread
from viasd.actors.rpc import (
    InternalTLS,
    ModelActor,
    Side,
    SideServicer,
    actor_facts,
    cores_lock,
    decode_probs,
    encode_probs,
    row_error,
    rpc,
    serve_internal,
    times_to_proto,
)
from viasd.config import MAX_GAMMA, EngineConfig, Proposer
from viasd.costs import StepTimes
from viasd.errors import InvalidParameterError
from viasd.executor import Capacity, DraftWorker
from viasd.precision import LinearReport, engine_dtype
from viasd.quant import engine_linears
from viasd.runtime import MaskedLM
from viasd.sessions import Outcome, drive, settle, to_host
from viasd.v1 import internal_pb2 as ipb
from viasd.v1 import internal_pb2_grpc

log = logging.getLogger("viasd.actors.drafter")


class DrafterServicer(SideServicer, internal_pb2_grpc.DrafterServiceServicer):
    """The drafter's half of an engine's requests, one RPC per phase (module docstring); p leaves
    only when the rules need it (sampling)."""

    drafter = True

    def __init__(
        self,
        lm: MaskedLM,
        capacity: Capacity,
        *,
        probs_dtype: str = "auto",
        cost_cache_dir: str | None = None,
        cores: filelock.FileLock | None = None,
    ):
        tiers = {"drafter": (lm, None)}
        self.core = Side(DraftWorker(lm, capacity), tiers, cost_cache_dir=cost_cache_dir, cores=cores)
        self.worker = self.core.worker
        self.probs_dtype = probs_dtype
        self._ahead: list[str] = []  # rows drafting ahead since the last Propose

    def _stop_ahead(self) -> None:
        """Drafting ahead yields the thread to any call (the blocks it drafted so far are kept)."""
        self.worker.stop(self._ahead)
        self._ahead = []

    async def _run(self, op: str, *args):
        if op == "prefill":
            self._stop_ahead()
        elif op == "release":  # (a block being drafted ahead stops after its next token)
            self.worker.stop(args[0])
        return await super()._run(op, *args)

    @rpc
    async def Propose(self, request: ipb.ProposeBatch, context) -> ipb.ProposeReply:
        """Commit each row's outcomes, then draft every row's block together; a row that is not
        open here, named twice or asks for a bad k or proposer fails alone."""
        t0 = time.perf_counter()
        answers: list[ipb.Proposal | None] = [None] * len(request.rows)
        work, seen, point = [], set(), set()  # (row index, (key, k, proposer, previous)); keys; p(x~) alone
        for i, row in enumerate(request.rows):
            try:
                self.worker.session(row.request_id)
                if row.request_id in seen:
                    raise InvalidParameterError("request_id", f"{row.request_id!r} appears twice in one batch")
                if not 1 <= row.k <= MAX_GAMMA:
                    raise InvalidParameterError("k", f"must be in 1..{MAX_GAMMA}, got {row.k}")
                proposer = _proposer(row.proposer)
            except InvalidParameterError as exc:
                answers[i] = ipb.Proposal(request_id=row.request_id, error=row_error(exc))
                continue
            previous = (
                Outcome(list(row.previous.tokens), row.previous.num_draft_accepted)
                if row.HasField("previous")
                else None
            )
            work.append((i, (row.request_id, row.k, proposer, previous)))
            seen.add(row.request_id)
            if row.p_x:
                point.add(row.request_id)
        self._stop_ahead()
        times = StepTimes()  # what the engine's cost model learns from (viasd.costs)
        if work:
            for i, answer in await self.core.work.submit(self._propose, work, point, times):
                answers[i] = answer
            ahead = self.worker.ahead([key for i, (key, *_) in work if answers[i].draft])
            if ahead:  # draft the next blocks while the verifier checks these ones (rows likely accepted whole)
                # (beside the Verify, outside the cores lock: drafting ahead is overlap's point)
                self._ahead = list(ahead)
                self.core.work.submit(drive, ahead, exclusive=False).add_done_callback(_log_failure)
        return ipb.ProposeReply(rows=answers, times=times_to_proto(times, time.perf_counter() - t0))

    def _propose(self, work: list, point: set[str], times: StepTimes) -> list[tuple[int, ipb.Proposal]]:
        """On the model thread: the worker's propose phase, serialised (p can be megabytes; the
        `point` rows' p(x~) alone); the blocks come to the host with one read, p(x~) with another."""
        proposals = self.worker.propose([w for _, w in work], times)
        keys = [key for _, (key, *_) in work]
        p_x = [  # [k] p(x~) each, or None: p's rows
            p.gather(1, draft[:, None])[:, 0] if key in point and p is not None else None
            for key, (draft, p) in zip(keys, proposals)
        ]
        drafts = to_host([draft for draft, _ in proposals])
        read = [x for x in p_x if x is not None]
        values = iter(torch.cat(read).tolist() if read else [])  # (taken row by row below)
        settle()  # (the forwards' device times, for the reply)
        return [
            (
                i,
                ipb.Proposal(
                    request_id=key,
                    draft=draft,
                    probs=encode_probs(p, self.probs_dtype) if x is None else None,
                    p_x=[] if x is None else [next(values) for _ in range(len(draft))],
                    work_seconds=times.work.get(key, 0.0),
                    fed=self.worker.held(key),
                ),
            )
            for (i, _), key, draft, (_, p), x in zip(work, keys, drafts, proposals, p_x)
        ]

    @rpc
    async def Correct(self, request: ipb.CorrectBatch, context) -> ipb.CorrectReply:
        """Each pending block's last token (`DraftWorker.correct`); a row whose q does not decode
        to one row of the vocabulary, whose session is gone or position wrong fails alone."""
        t0 = time.perf_counter()
        answers: list = [None] * len(request.rows)
        work = []  # (row index, (key, position, q [V], u))
        vocab = self.worker.lm.vocab_size if self.worker.lm is not None else 0
        for i, row in enumerate(request.rows):
            try:
                q = decode_probs(row.q)  # [1, V]
                if q is None or tuple(q.shape) != (1, vocab) or not 0.0 <= row.u < 1.0:
                    raise InvalidParameterError("q", f"one row of the vocabulary ({vocab}) and u in [0, 1) expected")
            except InvalidParameterError as exc:
                answers[i] = exc
                continue
            work.append((i, (row.request_id, row.position, q[0], row.u)))
        self._stop_ahead()  # (the outcomes are in: blocks drafted ahead yield the thread)
        if work:
            tokens = await self.core.work.submit(self.worker.correct, [w for _, w in work])
            for (i, _), token in zip(work, tokens):
                answers[i] = token
        rows = [
            ipb.Corrected(request_id=r.request_id, error=row_error(a))
            if isinstance(a, Exception)
            else ipb.Corrected(request_id=r.request_id, token=a)
            for r, a in zip(request.rows, answers)
        ]
        return ipb.CorrectReply(rows=rows, times=ipb.CallTimes(seconds=time.perf_counter() - t0))

    def shutdown(self) -> None:
        self._stop_ahead()
        self.core.shutdown()


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


def set_threads(threads: int | None, ranks: int) -> int:
    """torch threads of an actor: the configured count (`engine.threads`), else this node's cores
    over the verifier's ranks (at least 1): the drafter and the verifier take turns within a step,
    the tensor-parallel ranks run at once and split the cores (docs/ARCHITECTURE.md, "Threads").
    Ray's CPU reservations place the actors; they are not thread counts."""
    import torch

    n = threads or max(1, (os.cpu_count() or 1) // max(1, ranks))
    torch.set_num_threads(n)
    return n


@ray.remote
class DrafterActor(ModelActor):
    """Loads the drafter of an EngineConfig and serves DrafterService on a free port."""

    async def start(
        self,
        engine: dict,
        *,
        host: str = "127.0.0.1",
        device: str = "cpu",
        ranks: int = 1,
        probs_dtype: str = "auto",
        tls: InternalTLS | None = None,
    ) -> dict:
        """Load the model, start the server (mutual TLS with `tls`); return its address and the
        model's facts (`actor_facts`)."""
        from viasd.engine import cost_cache_dir, engine_capacity
        from viasd.models.loader import load_causal_lm

        config = EngineConfig.model_validate(engine)

        def load() -> tuple[MaskedLM, int, LinearReport]:  # on the model thread, where it will run (viasd.model_thread)
            threads = set_threads(config.threads, ranks)
            dtype = engine_dtype(config, device).dtype
            model, _ = load_causal_lm(
                config.drafter, dtype=dtype, device=device, trust_remote_code=config.trust_remote_code
            )
            # the in-process engine's quantized and packed linears (before MaskedLM takes the modules)
            packed = engine_linears(model, config, device, config.drafter, dtype)
            return MaskedLM(model), threads, packed

        lm, threads, packed = await asyncio.get_running_loop().run_in_executor(model_thread.executor(), load)
        positions = getattr(lm.config, "max_position_embeddings", None)
        capacity, context_name = engine_capacity(config, lm.kv_bytes_per_token(), lm.device, [positions])
        self.core = DrafterServicer(
            lm,
            capacity,
            probs_dtype=probs_dtype,
            cost_cache_dir=str(cost_cache_dir()),
            cores=cores_lock(device, threads, ranks=1),
        )
        add = internal_pb2_grpc.add_DrafterServiceServicer_to_server
        self.server, address = await serve_internal(add, self.core, host, tls)
        log.info("drafter %s serving on %s (pid %d)", config.drafter, address, os.getpid())
        return {"address": address, **actor_facts(lm, capacity, context_name, threads, packed)}

    async def stop(self) -> None:
        await self.stop_server()
        if self.core is not None:
            self.core.shutdown()
