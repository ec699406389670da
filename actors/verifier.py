"""The verifier group: q (and q' = q masked) on N tensor-parallel Ray actors, served over gRPC.

    coordinator --gRPC--> rank 0: VerifierServicer --.remote()--> ranks 1..N-1
                          every rank: VerifierCore (VerifySession per request, one worker thread)

Every rank loads the verifier, resolves the slim verifier's mask on the unsharded weights (so
a DIMR mask's fingerprint check sees the real model), then shards it with
`viasd.parallel.shard_model` (rank, world size and rendezvous handed explicitly; TP backend
"torch" or "deepspeed"; N = 1 is no TP). Every rank ends a forward with the same full logits,
so sampling, the gate and the acceptance rules run unchanged, and identically, on every rank.

Lockstep: rank 0 numbers each Open / Verify / Close, sends it to ranks 1..N-1 with that number
and runs it itself at the same time. A Verify is one engine step over every verifying row of
the coordinator's batch, so rank 0 numbers steps, not requests, and every rank runs the same
batched forwards (`VerifierCore.verify`: `viasd.sessions.drive` over the rows). Each rank executes its calls in number order on one
thread (`viasd.actors.rpc.InOrder`), so all ranks run identical forwards, with identical inputs
and identical random streams (the request's verifier seed), and reach every collective
together. With `check_ranks`, rank 0 compares every rank's outcome with its own and fails the
call (INTERNAL) if they differ. Logits never leave a rank: the reply is the committed tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import NamedTuple

import filelock
import grpc
import ray

from viasd import model_thread
from viasd.actors.drafter import pack_linears, set_threads
from viasd.actors.rpc import (
    Batched,
    InOrder,
    PeerUnavailable,
    SessionNotFound,
    advertised_host,
    cores_lock,
    costs_to_proto,
    decode_probs,
    forwards_to_proto,
    free_row,
    internal_tls,
    outcome_to_proto,
    row_error,
    rows_of,
    rpc,
    start_server,
)
from viasd.config import CachePolicy, EngineConfig, GenerationParams, Mode, Proposer
from viasd.costs import CostModel, StepTimes, profile_tiers, verifier_tiers
from viasd.engine import VerifySession
from viasd.errors import InvalidParameterError
from viasd.gates import Gates
from viasd.metrics import RequestStats
from viasd.planner import Plan
from viasd.precision import LinearReport, engine_dtype
from viasd.runtime import LayerMask, MaskedLM
from viasd.sessions import drive, prefill_together, uses_slim
from viasd.v1 import internal_pb2 as ipb
from viasd.v1 import internal_pb2_grpc
from viasd.v1.convert import logprobs_to_proto, params_from_proto, stats_to_proto

log = logging.getLogger("viasd.actors.verifier")


class RowFailed(NamedTuple):
    """One row of a batch that failed alone (its session is gone, a bad draft); the others run."""

    error: SessionNotFound | InvalidParameterError


class VerifierCore:
    """One rank's sessions, on rows of one full (and, under the separate cache policy, one slim)
    cache of `max_rows` rows, so that a step's rows run as one batched forward per tier. Its
    methods are blocking and run on the rank's worker thread, in order."""

    def __init__(
        self,
        lm: MaskedLM,
        mask: LayerMask,
        cache_policy: CachePolicy | str,
        max_rows: int = 64,
        *,
        world_size: int = 1,
        cost_cache_dir: str | None = None,
        prefill_tokens: int = 512,
        cores: filelock.FileLock | None = None,
    ):
        self.lm = lm
        self.prefill_tokens = prefill_tokens  # padded tokens per batched prefill forward (engine.prefill_chunk)
        self.mask = mask
        self.cache_policy = CachePolicy(cache_policy)
        self.full_store = lm.new_store(max_rows=max_rows)
        self.slim_store = lm.new_store(mask, max_rows=max_rows)  # (the separate policy only)
        self.sessions: dict[str, VerifySession] = {}
        self.work = InOrder("verifier", cores)  # (cores: the node's cores lock, `cores_lock`)
        self.world_size = world_size
        self.cost_cache_dir = cost_cache_dir if world_size == 1 else None  # ranks must all measure, or none
        self._costs: CostModel | None = None

    def open(self, requests: list[tuple[str, list[int], GenerationParams, int, str]]) -> list:
        """Open each request's session, (request_id, prompt, params, seed, prefill_from) per
        request: the Opens that arrived while the previous ones ran, their prompts prefilled
        together (`viasd.sessions.prefill_together`, at most `prefill_tokens` padded tokens per
        forward), or the prefill of the open session `prefill_from` copied (same prompt: the
        samples of an n > 1 request). Returns per request (its prompt logprobs, stats message),
        or RowFailed (a duplicate id, an unknown `prefill_from`)."""
        out: list = [None] * len(requests)
        opened: dict[str, VerifySession] = {}
        for i, (request_id, prompt, params, seed, prefill_from) in enumerate(requests):
            try:
                if request_id in self.sessions or request_id in opened:
                    raise InvalidParameterError("request_id", f"{request_id!r} is already open on the verifier")
                if prefill_from and prefill_from not in opened:
                    self._session(prefill_from)
                opened[request_id] = self._new_session(prompt, params, seed)
            except (SessionNotFound, InvalidParameterError) as exc:
                out[i] = RowFailed(exc)
        leaders = {r[0]: r[4] for r in requests if r[0] in opened and r[4]}
        try:
            prefill_together([s for rid, s in opened.items() if rid not in leaders], self.prefill_tokens)
            for rid, leader in leaders.items():
                opened[rid].copy_prefill(opened.get(leader) or self.sessions[leader])
        except BaseException:
            for session in opened.values():
                session.release()
            raise
        for i, (request_id, *_) in enumerate(requests):
            if out[i] is None:
                session = self.sessions[request_id] = opened[request_id]
                out[i] = (session.prompt_logprobs, stats_to_proto(session.stats))
        return out

    def _new_session(self, prompt: list[int], params: GenerationParams, seed: int) -> VerifySession:
        """A session on rows of the shared caches (private ones when every row is taken)."""
        stats = RequestStats(mode=params.mode.value, prompt_tokens=len(prompt))
        slim = None
        if uses_slim(params) and self.cache_policy == CachePolicy.SEPARATE:
            slim = free_row(self.slim_store) or self.lm.new_cache(self.mask)
        full = free_row(self.full_store) or self.lm.new_cache()
        return VerifySession(
            self.lm, self.mask, self.cache_policy, prompt, params, seed, stats, full_cache=full, slim_cache=slim
        )

    def verify(
        self,
        rows: list[tuple[str, list[int], bytes | None, str]],
        with_stats: bool = False,
        times: StepTimes | None = None,
    ) -> list:
        """One step: check every row's draft block (decode one token where the draft is empty),
        all rows together (`viasd.sessions.drive`: one slim forward over the `via` rows, one full
        forward over the rest and the escalated rows), and commit each outcome. A row's plan
        (`auto`: "sd", "ngram" or "via"; empty: its own mode) says how its block is checked.
        `times` (rank 0) gets the forwards and each row's work between them, by row index.

        Returns per row (outcome, the session's stats message or None), or RowFailed."""
        out: list = [None] * len(rows)
        steps, sessions = {}, {}
        for i, (request_id, draft, probs, plan) in enumerate(rows):
            try:
                sessions[i] = self._session(request_id)
                steps[i] = self._steps(sessions[i], draft, probs, plan)
            except (SessionNotFound, InvalidParameterError) as exc:
                out[i] = RowFailed(exc)
        outcomes = drive(steps, observe=times.observe if times else None, timing=times.work if times else None)
        for i, outcome in outcomes.items():
            session = sessions[i]
            session.commit(outcome)
            out[i] = (outcome, stats_to_proto(session.stats) if with_stats else None)
        return out

    def _session(self, request_id: str) -> VerifySession:
        session = self.sessions.get(request_id)
        if session is None:
            raise SessionNotFound(f"verifier has no session {request_id!r}")
        return session

    def costs(self) -> CostModel:
        """The full and slim tiers' cost curves (viasd.costs): profiled once, on every rank at
        once under tensor parallelism (their forwards are collectives; no cache, so that no rank
        skips them), cached on disk otherwise."""
        if self._costs is None:
            tiers = verifier_tiers(self.lm, self.mask)
            self._costs = profile_tiers(tiers, cache_dir=self.cost_cache_dir, ranks=self.world_size)
        return self._costs

    def _steps(self, session: VerifySession, draft: list[int], probs: bytes | None, plan: str = ""):
        """A row's step generator, its draft, p and plan checked first (InvalidParameterError)."""
        mode = _plan_mode(session.params, plan, bool(draft))
        if not draft:
            return session.decode_one_steps()
        bad = [t for t in draft if not 0 <= t < self.lm.vocab_size]
        if bad:
            raise InvalidParameterError("draft", f"token ids {bad[:5]} outside the vocabulary ({self.lm.vocab_size})")
        p = decode_probs(ipb.DraftProbs.FromString(probs)) if probs else None  # [k, V] or None (greedy)
        if p is not None and tuple(p.shape) != (len(draft), self.lm.vocab_size):
            raise InvalidParameterError(
                "probs", f"shape {tuple(p.shape)} does not match {len(draft)} draft tokens x {self.lm.vocab_size}"
            )
        if p is None and not session.sampler.greedy and session.params.proposer == Proposer.MODEL and plan != "ngram":
            # (n-gram blocks come without p: it is a point mass at the draft tokens)
            raise InvalidParameterError("probs", "a sampled request's draft needs its probabilities")
        return session.check_steps(draft, p, mode)

    def close(self, request_id: str) -> bool:
        session = self.sessions.pop(request_id, None)
        if session is not None:
            session.release()
        return session is not None

    def shutdown(self) -> None:
        self.sessions.clear()
        self.work.shutdown()


PLANS = ("sd", "ngram", "via")  # the plans a Verify row may name (viasd.planner.Plan.kind, `ar` aside)


def _plan_mode(params: GenerationParams, plan: str, drafted: bool) -> Mode | None:
    """How a row's block is checked: its plan's mode (`auto` rows; viasd.planner.Plan.verify_mode),
    or None: the request's own mode."""
    if not plan:
        if params.mode == Mode.AUTO and drafted:
            raise InvalidParameterError("plan", "an `auto` request's draft block needs its plan (sd, ngram or via)")
        return None
    if params.mode != Mode.AUTO:
        raise InvalidParameterError("plan", f"only `auto` requests take a plan; this one is {params.mode.value!r}")
    if plan not in PLANS:
        raise InvalidParameterError("plan", f"unknown plan {plan!r}: expected one of {list(PLANS)}")
    if plan == "via" and not uses_slim(params):
        raise InvalidParameterError("plan", "plan 'via' is lossy: the request did not allow it (auto_lossy)")
    return Plan(plan).verify_mode


def _future(ref) -> asyncio.Future:
    """An asyncio future of a Ray ObjectRef (or of anything awaitable, e.g. a test's stand-in)."""
    return asyncio.wrap_future(ref.future()) if hasattr(ref, "future") else asyncio.ensure_future(ref)


def _actor_died(exc: BaseException | None) -> bool:
    if exc is None:
        return False
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


def _comparable(op: str, result):
    """What must agree across ranks: the outcome of each row of a Verify (tokens, accepted draft
    count; a failed row's error)."""
    if op == "verify":
        return [
            repr(r.error) if isinstance(r, RowFailed) else (list(r[0].tokens), r[0].num_draft_accepted) for r in result
        ]
    if op == "costs":  # each rank's own timings
        return None
    if op == "open":  # prompt logprobs: floats, compared through the tokens they score
        return [
            repr(r.error) if isinstance(r, RowFailed) else (None if r[0] is None else [e and e.token_id for e in r[0]])
            for r in result
        ]
    return result


class VerifierServicer(internal_pb2_grpc.VerifierServiceServicer):
    """Rank 0's VerifierService: runs every call on itself and, in lockstep, on the other ranks."""

    def __init__(self, core: VerifierCore, followers=(), *, check_ranks: bool = True):
        self.core = core
        self.followers = list(followers)  # Ray handles of VerifierWorker ranks 1..N-1
        self.check_ranks = check_ranks
        self._opens = Batched(lambda requests: self._lockstep("open", requests))

    async def _lockstep(self, op: str, *args, local_args: tuple = ()):
        work = self.core.work
        seq = work.issue()
        refs = [f.call.remote(seq, op, *args) for f in self.followers]
        local = work.enqueue(seq, getattr(self.core, op), *args, *local_args)  # no await since issue(): no gap
        calls = [local, *(_future(ref) for ref in refs)]
        if refs:  # a dead rank fails the call at once: rank 0 may wait forever in a collective with it
            await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
            for rank, call in enumerate(calls[1:], start=1):
                if call.done() and _actor_died(call.exception()):
                    raise PeerUnavailable(f"verifier rank {rank} is down ({type(call.exception()).__name__})")
        results = await asyncio.gather(*calls, return_exceptions=True)
        mine, others = results[0], results[1:]
        for rank, other in enumerate(others, start=1):  # (rank 0's collective may fail first: the peer is gone)
            if _actor_died(other if isinstance(other, BaseException) else None):
                raise PeerUnavailable(f"verifier rank {rank} is down ({type(other).__name__})")
        if isinstance(mine, BaseException):
            raise mine
        for rank, other in enumerate(others, start=1):
            if isinstance(other, BaseException):
                raise RuntimeError(f"verifier rank {rank} failed where rank 0 did not: {other}") from other
            if self.check_ranks and _comparable(op, mine) != other:
                raise RuntimeError(
                    f"verifier ranks disagree on {op}: rank 0 {_comparable(op, mine)}, rank {rank} {other}"
                )
        return mine

    @rpc
    async def Open(self, request: ipb.OpenRequest, context) -> ipb.OpenResponse:
        """Open and prefill a request's session on every rank, in one lockstep call with the Opens
        that arrive while earlier ones run (`Batched`: their prompts prefill together)."""
        params = params_from_proto(request.params)
        result = await self._opens.submit(
            (request.request_id, list(request.prompt_token_ids), params, request.seed, request.prefill_from)
        )
        if isinstance(result, RowFailed):
            raise result.error
        scored, stats = result
        return ipb.OpenResponse(request_id=request.request_id, prompt_logprobs=logprobs_to_proto(scored), stats=stats)

    @rpc
    async def Verify(self, request: ipb.VerifyRequest, context) -> ipb.VerifyResponse:
        """One step over every row of the request, on every rank in lockstep."""
        t0 = time.perf_counter()
        rows, batched = rows_of(request)
        args = [
            (r.request_id, list(r.draft), r.probs.SerializeToString() if r.HasField("probs") else None, r.plan)
            for r in rows
        ]
        answers, times = [], StepTimes()  # `times`: what the coordinator's cost model learns from (viasd.costs)
        for i, (row, result) in enumerate(zip(rows, await self._lockstep("verify", args, local_args=(True, times)))):
            if isinstance(result, RowFailed):
                if not batched:
                    raise result.error
                answers.append(ipb.VerifyResponse(request_id=row.request_id, error=row_error(result.error)))
            else:
                outcome, stats = result
                answers.append(
                    ipb.VerifyResponse(
                        request_id=row.request_id,
                        outcome=outcome_to_proto(outcome),
                        stats=stats,
                        logprobs=logprobs_to_proto(outcome.logprobs),
                        work_seconds=times.work.get(i, 0.0),
                    )
                )
        response = ipb.VerifyResponse(rows=answers) if batched else answers[0]
        response.forwards.extend(forwards_to_proto(times))
        response.seconds = time.perf_counter() - t0
        return response

    @rpc
    async def Close(self, request: ipb.CloseRequest, context) -> ipb.CloseResponse:
        existed = await self._lockstep("close", request.request_id)
        return ipb.CloseResponse(existed=existed)

    @rpc
    async def Costs(self, request: ipb.CostsRequest, context) -> ipb.CostsResponse:
        return costs_to_proto(await self._lockstep("costs"))


class _Loaded(NamedTuple):
    """What a verifier rank loads (`VerifierWorker._load`)."""

    lm: MaskedLM
    mask: LayerMask
    mask_source: str
    gates: Gates | None
    gates_source: str
    eos: tuple[int, ...]
    tokenizer: object  # (None for a directory without one)
    threads: int
    linears: LinearReport  # what pack_linears packed


@ray.remote
class VerifierWorker:
    """One tensor-parallel rank of the verifier; rank 0 also serves VerifierService."""

    def __init__(self):
        self.core: VerifierCore | None = None
        self.server: grpc.aio.Server | None = None
        self.rank = 0
        self._tokenizer = None

    async def rendezvous(self) -> dict:
        """Rank 0's node address and a free port on it, for the process group's tcp:// store."""
        from viasd.parallel import free_port

        return {"master_addr": ray.util.get_node_ip_address(), "master_port": free_port()}

    async def setup(
        self,
        engine: dict,
        *,
        rank: int,
        world_size: int,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        tp_backend: str = "torch",
        device: str = "cpu",
    ) -> dict:
        """Load q, resolve the mask, shard across the group (every rank calls this at once)."""
        from viasd.engine import cost_cache_dir

        config = EngineConfig.model_validate(engine)
        self.rank = rank
        # on the model thread, where its forwards will run (viasd.model_thread)
        loaded = await asyncio.get_running_loop().run_in_executor(
            model_thread.executor(),
            lambda: self._load(config, rank, world_size, master_addr, master_port, tp_backend, device),
        )
        lm, mask, gates = loaded.lm, loaded.mask, loaded.gates
        self.core = VerifierCore(
            lm,
            mask,
            config.cache_policy,
            world_size=world_size,
            cost_cache_dir=str(cost_cache_dir()),
            prefill_tokens=config.prefill_chunk,
            cores=cores_lock(device, loaded.threads, world_size),
        )
        self._tokenizer = loaded.tokenizer if rank == 0 else None
        return {
            "rank": rank,
            "vocab_size": lm.vocab_size,
            "num_layers": lm.num_layers,
            "skipped_layers": list(mask.skipped),
            "mask_source": loaded.mask_source,
            "gates": dataclasses.asdict(gates) if gates is not None else None,
            "gates_source": loaded.gates_source,
            "max_position_embeddings": getattr(lm.config, "max_position_embeddings", None),
            "eos_token_ids": list(loaded.eos),
            "local_q_proj_rows": int(lm.layers[0].self_attn.q_proj.weight.shape[0]),  # this rank's shard
            "pid": os.getpid(),
            "threads": loaded.threads,
            "linears": loaded.linears,
            "runtime": engine_dtype(config, device).as_dict(),  # the dtype choice, the CPU capability
        }

    @staticmethod
    def _load(
        config: EngineConfig,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        tp_backend: str,
        device: str,
    ) -> _Loaded:
        """Load q, resolve its mask and gates, join the group and shard (`setup`, on the model thread)."""
        from viasd.llm import eos_ids, resolve_gates, resolve_mask
        from viasd.models.loader import load_causal_lm
        from viasd.parallel import TPBackend, TPGroup, shard_model

        threads = set_threads(config.threads, world_size)
        # sharded ranks load on the host and move only their shards to the device (shard_model)
        model, tokenizer = load_causal_lm(
            config.verifier,
            dtype=engine_dtype(config, device).dtype,  # the target device's, also where the host loads
            device=device if world_size == 1 else "cpu",
            trust_remote_code=config.trust_remote_code,
        )
        mask, mask_source = resolve_mask(config, model)  # on the unsharded weights (fingerprint)
        gates, gates_source = resolve_gates(config, mask)  # what `via` requests choosing none get
        eos = eos_ids(tokenizer, model)
        if world_size > 1:
            cuda = device.startswith("cuda")
            group = TPGroup(
                rank=rank,
                world_size=world_size,
                master_addr=master_addr,
                master_port=master_port,
                backend="nccl" if cuda else "gloo",
                local_rank=0 if cuda else None,
            )
            model = shard_model(model, TPBackend(tp_backend), group)
            packed = LinearReport("off: sharded (its linears keep their own kernels)")
        else:
            packed = pack_linears(model, config, device)
        return _Loaded(MaskedLM(model), mask, mask_source, gates, gates_source, eos, tokenizer, threads, packed)

    async def serve(
        self, followers: list, *, host: str = "127.0.0.1", check_ranks: bool = True, tls: dict | None = None
    ) -> str:
        """Rank 0: start VerifierService (mutual TLS with `tls`, an InternalTLS), driving
        `followers` (ranks 1..N-1); return its address."""
        servicer = VerifierServicer(self.core, followers, check_ranks=check_ranks)
        self.server, port = await start_server(
            lambda s: internal_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, s), host, tls=internal_tls(tls)
        )
        address = f"{advertised_host(host)}:{port}"
        log.info("verifier rank 0 serving on %s with %d follower rank(s)", address, len(followers))
        return address

    async def call(self, seq: int, op: str, *args):
        """Ranks 1..N-1: run rank 0's call number `seq` in number order; return what must agree."""
        if op not in ("open", "verify", "close", "costs"):
            raise ValueError(f"unknown verifier operation {op!r}")
        result = await self.core.work.enqueue(seq, getattr(self.core, op), *args)
        return _comparable(op, result)

    async def tokenizer(self):
        """Rank 0: the verifier's tokenizer (None for a directory without one), for the coordinator's
        process, which need not hold the model files."""
        return self._tokenizer

    async def num_sessions(self) -> int:
        return len(self.core.sessions) if self.core else 0

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
            self.server = None
        if self.core is not None:
            self.core.shutdown()
        from viasd.parallel import shutdown_tp

        shutdown_tp()
