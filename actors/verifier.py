"""The verifier group: q (and q' = q masked) on N tensor-parallel Ray actors, served over gRPC.

    coordinator --gRPC--> rank 0: VerifierServicer --.remote()--> ranks 1..N-1
                          every rank: VerifierCore (VerifySession per request, one worker thread)

Every rank loads the verifier, resolves the slim verifier's mask on the unsharded weights (so
a DIMR mask's fingerprint check sees the real model), then shards it with
`viasd.parallel.shard_model` (rank, world size and rendezvous handed explicitly; TP backend
"torch" or "deepspeed"; N = 1 is no TP). Every rank ends a forward with the same full logits,
so sampling, the gate and the acceptance rules run unchanged, and identically, on every rank.

Lockstep: rank 0 numbers each Open / Verify / Close, sends it to ranks 1..N-1 with that number
and runs it itself at the same time. Each rank executes its calls in number order on one
thread (`viasd.actors.rpc.InOrder`), so all ranks run identical forwards, with identical inputs
and identical random streams (the request's verifier seed), and reach every collective
together. With `check_ranks`, rank 0 compares every rank's outcome with its own and fails the
call (INTERNAL) if they differ. Logits never leave a rank: the reply is the committed tokens.
"""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
import ray

from viasd.actors.drafter import set_threads
from viasd.actors.rpc import (
    InOrder,
    PeerUnavailable,
    SessionNotFound,
    advertised_host,
    decode_probs,
    internal_tls,
    outcome_to_proto,
    rpc,
    start_server,
)
from viasd.config import CachePolicy, EngineConfig, GenerationParams, Proposer
from viasd.engine import VerifySession
from viasd.errors import InvalidParameterError
from viasd.metrics import RequestStats
from viasd.runtime import LayerMask, MaskedLM
from viasd.v1 import internal_pb2 as ipb
from viasd.v1 import internal_pb2_grpc
from viasd.v1.convert import params_from_proto, stats_to_proto

log = logging.getLogger("viasd.actors.verifier")


class VerifierCore:
    """One rank's sessions. Its methods are blocking and run on the rank's worker thread, in order."""

    def __init__(self, lm: MaskedLM, mask: LayerMask, cache_policy: CachePolicy | str):
        self.lm = lm
        self.mask = mask
        self.cache_policy = CachePolicy(cache_policy)
        self.sessions: dict[str, VerifySession] = {}
        self.work = InOrder("verifier")

    def open(self, request_id: str, prompt: list[int], params: GenerationParams, seed: int) -> None:
        if request_id in self.sessions:
            raise InvalidParameterError("request_id", f"{request_id!r} is already open on the verifier")
        stats = RequestStats(mode=params.mode.value, prompt_tokens=len(prompt))
        session = VerifySession(self.lm, self.mask, self.cache_policy, prompt, params, seed, stats)
        session.prefill()  # the prompt but its last token, as the in-process scheduler prefills it
        self.sessions[request_id] = session

    def verify(self, request_id: str, draft: list[int], probs: bytes | None, with_stats: bool = False):
        """Check a draft block (decode one token when `draft` is empty) and commit the outcome.

        Returns (outcome, the session's stats message or None)."""
        session = self.sessions.get(request_id)
        if session is None:
            raise SessionNotFound(f"verifier has no session {request_id!r}")
        if draft:
            bad = [t for t in draft if not 0 <= t < self.lm.vocab_size]
            if bad:
                raise InvalidParameterError("draft", f"token ids {bad[:5]} outside the vocabulary "
                                                     f"({self.lm.vocab_size})")
            p = decode_probs(ipb.DraftProbs.FromString(probs)) if probs else None  # [k, V] or None (greedy)
            if p is not None and tuple(p.shape) != (len(draft), self.lm.vocab_size):
                raise InvalidParameterError(
                    "probs", f"shape {tuple(p.shape)} does not match {len(draft)} draft tokens x {self.lm.vocab_size}")
            if p is None and not session.sampler.greedy and session.params.proposer == Proposer.MODEL:
                # (n-gram blocks come without p: it is a point mass at the draft tokens)
                raise InvalidParameterError("probs", "a sampled request's draft needs its probabilities")
            outcome = session.check(draft, p)
        else:
            outcome = session.decode_one()
        session.commit(outcome)
        return outcome, (stats_to_proto(session.stats) if with_stats else None)

    def close(self, request_id: str) -> bool:
        return self.sessions.pop(request_id, None) is not None

    def shutdown(self) -> None:
        self.sessions.clear()
        self.work.shutdown()


def _future(ref) -> asyncio.Future:
    """An asyncio future of a Ray ObjectRef (or of anything awaitable, e.g. a test's stand-in)."""
    return asyncio.wrap_future(ref.future()) if hasattr(ref, "future") else asyncio.ensure_future(ref)


def _actor_died(exc: BaseException | None) -> bool:
    if exc is None:
        return False
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


def _comparable(op: str, result):
    """What must agree across ranks: the outcome of a Verify (tokens, accepted draft count)."""
    if op == "verify":
        outcome = result[0]
        return list(outcome.tokens), outcome.num_draft_accepted
    return result


class VerifierServicer(internal_pb2_grpc.VerifierServiceServicer):
    """Rank 0's VerifierService: runs every call on itself and, in lockstep, on the other ranks."""

    def __init__(self, core: VerifierCore, followers=(), *, check_ranks: bool = True):
        self.core = core
        self.followers = list(followers)  # Ray handles of VerifierWorker ranks 1..N-1
        self.check_ranks = check_ranks

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
                raise RuntimeError(f"verifier ranks disagree on {op}: rank 0 {_comparable(op, mine)}, "
                                   f"rank {rank} {other}")
        return mine

    @rpc
    async def Open(self, request: ipb.OpenRequest, context) -> ipb.OpenResponse:
        params = params_from_proto(request.params)
        await self._lockstep("open", request.request_id, list(request.prompt_token_ids), params, request.seed)
        return ipb.OpenResponse(request_id=request.request_id)

    @rpc
    async def Verify(self, request: ipb.VerifyRequest, context) -> ipb.VerifyResponse:
        probs = request.probs.SerializeToString() if request.HasField("probs") else None
        outcome, stats = await self._lockstep("verify", request.request_id, list(request.draft), probs,
                                              local_args=(True,))
        return ipb.VerifyResponse(request_id=request.request_id, outcome=outcome_to_proto(outcome), stats=stats)

    @rpc
    async def Close(self, request: ipb.CloseRequest, context) -> ipb.CloseResponse:
        existed = await self._lockstep("close", request.request_id)
        return ipb.CloseResponse(existed=existed)


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

    async def setup(self, engine: dict, *, rank: int, world_size: int, master_addr: str = "127.0.0.1",
                    master_port: int = 29500, tp_backend: str = "torch", device: str = "cpu",
                    cpus: float = 1.0) -> dict:
        """Load q, resolve the mask, shard across the group (every rank calls this at once)."""
        from viasd.llm import eos_ids, resolve_mask
        from viasd.models.loader import load_causal_lm
        from viasd.parallel import TPBackend, TPGroup, shard_model
        from viasd.precision import resolve_dtype

        config = EngineConfig.model_validate(engine)
        set_threads(config.threads, cpus)
        self.rank = rank
        # sharded ranks load on the host and move only their shards to the device (shard_model)
        model, tokenizer = load_causal_lm(config.verifier, dtype=config.dtype,
                                          device=device if world_size == 1 else "cpu",
                                          trust_remote_code=config.trust_remote_code)
        mask, mask_source = resolve_mask(config, model)  # on the unsharded weights (fingerprint)
        eos = eos_ids(tokenizer, model)
        if world_size > 1:
            cuda = device.startswith("cuda")
            group = TPGroup(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                            backend="nccl" if cuda else "gloo", local_rank=0 if cuda else None)
            model = shard_model(model, TPBackend(tp_backend), group)
        lm = MaskedLM(model)
        self.core = VerifierCore(lm, mask, config.cache_policy)
        self._tokenizer = tokenizer if rank == 0 else None
        return {
            "rank": rank,
            "vocab_size": lm.vocab_size,
            "num_layers": lm.num_layers,
            "skipped_layers": list(mask.skipped),
            "mask_source": mask_source,
            "max_position_embeddings": getattr(lm.config, "max_position_embeddings", None),
            "eos_token_ids": list(eos),
            "local_q_proj_rows": int(model.model.layers[0].self_attn.q_proj.weight.shape[0]),  # this rank's shard
            "pid": os.getpid(),
            "runtime": resolve_dtype(config.dtype, device).as_dict(),  # the dtype choice, the CPU capability
        }

    async def serve(self, followers: list, *, host: str = "127.0.0.1", check_ranks: bool = True,
                    tls: dict | None = None) -> str:
        """Rank 0: start VerifierService (mutual TLS with `tls`, an InternalTLS), driving
        `followers` (ranks 1..N-1); return its address."""
        servicer = VerifierServicer(self.core, followers, check_ranks=check_ranks)
        self.server, port = await start_server(
            lambda s: internal_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, s), host,
            tls=internal_tls(tls))
        address = f"{advertised_host(host)}:{port}"
        log.info("verifier rank 0 serving on %s with %d follower rank(s)", address, len(followers))
        return address

    async def call(self, seq: int, op: str, *args):
        """Ranks 1..N-1: run rank 0's call number `seq` in number order; return what must agree."""
        if op not in ("open", "verify", "close"):
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

