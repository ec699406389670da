"""The verifier group: q (and q' = q masked) on N tensor-parallel Ray actors, served over gRPC.

    engine (ServedExecutor) --gRPC--> rank 0: VerifierServicer --ControlChannel--> ranks 1..N-1 (follow)
                                      every rank: VerifierRank (viasd.executor.VerifyWorker)

Every rank loads its shard of the verifier (torch TP: only its slices of the checkpoint;
DeepSpeed: the whole model, then sharded; N = 1 is no TP) and resolves the slim verifier's mask.
Every rank ends a forward with the same full logits; only rank 0 holds the drafter's probability
rows, decides the sampled checks and broadcasts the verdicts (`viasd.parallel.VerdictBroadcast`).

Lockstep: rank 0 numbers each call (one phase of an engine step over every row of it) and runs
them in that order on its model thread (`InOrder`), each first sent to ranks 1..N-1
(`viasd.parallel.ControlChannel`), which run them in the order received (`follow`); each rank
sends back what it committed and, with `check_ranks`, rank 0 fails a call (INTERNAL) where they
differ. A follower that dies ends its `follow` Ray call, which fails rank 0's call at once
(PeerUnavailable: the pipeline rebuilds the group). docs/TENSOR_PARALLEL.md has the details.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from typing import NamedTuple

import filelock
import ray
import torch

from viasd import model_thread
from viasd.actors.drafter import set_threads
from viasd.actors.rpc import (
    InternalTLS,
    ModelActor,
    PeerUnavailable,
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
from viasd.config import CachePolicy, EngineConfig
from viasd.costs import StepTimes, verifier_tiers
from viasd.errors import InvalidParameterError
from viasd.executor import Capacity, VerifyRow, VerifyWorker
from viasd.precision import engine_dtype
from viasd.runtime import LayerMask, MaskedLM
from viasd.sessions import Absent, Outcome
from viasd.v1 import internal_pb2 as ipb
from viasd.v1 import internal_pb2_grpc
from viasd.v1.convert import logprobs_to_proto

log = logging.getLogger("viasd.actors.verifier")

#: How long a stopping rank waits for its loop (or rank 0 for the STOP to go out) before it leaves.
STOP_WAIT_S = 10.0
#: How long rank 0, its call failed, waits to learn whether a peer died (its collectives notice
#: first; Ray reports the death within about a second).
PEER_DEATH_S = 10.0


class VerifierRank(Side):
    """One rank's half of every request (`viasd.executor.VerifyWorker`, on caches of the engine's
    capacity). Its methods are blocking and run on the rank's model thread, in the order rank 0
    numbered them (`work`). Its full and slim tiers' cost curves are profiled on every rank at
    once under tensor parallelism (their forwards are collectives; no cache, so that no rank
    skips them), cached on disk otherwise."""

    def __init__(
        self,
        lm: MaskedLM,
        mask: LayerMask,
        cache_policy: CachePolicy | str,
        capacity: Capacity,
        *,
        world_size: int = 1,
        cost_cache_dir: str | None = None,
        cores: filelock.FileLock | None = None,
    ):
        super().__init__(
            VerifyWorker(lm, mask, cache_policy, capacity),
            verifier_tiers(lm, mask),
            cost_cache_dir=cost_cache_dir if world_size == 1 else None,  # ranks must all measure, or none
            cores=cores,
            ranks=world_size,
        )

    def verify(self, rows: list[VerifyRow], settles: dict[str, int], times: StepTimes | None = None) -> list:
        """One step over every row after `settles`: the worker's verify phase (a follower's rows
        carry `Absent` for p: rank 0 shares the sampled verdicts). `times` (rank 0) gets the
        forwards and each row's work."""
        return self.worker.verify(rows, times or StepTimes(), settles)


#: What rank 0 sends the other ranks when it stops.
STOP = None


class Failed(NamedTuple):
    """A rank's call that raised (what it sends back instead of its result)."""

    error: str


def lead(channel, op: str, sent: tuple, fn, args: tuple):
    """Rank 0, on its model thread: send call `op` (with `sent`, what the other ranks need of its
    arguments) to the other ranks, run it here as fn(*args), and gather what they made of it:
    (this rank's result, the others' `_comparable` results or `Failed`, in rank order)."""
    channel.send((op, sent))
    try:
        result = fn(*args)
    except BaseException as exc:
        channel.gather(Failed(repr(exc)))  # (the others wait in this gather too)
        raise
    return result, channel.gather(_comparable(op, result))


def follow(core: VerifierRank, channel) -> None:
    """Ranks 1..N-1, on the model thread: run every call rank 0 sends (`lead`), in the order it
    sends them, and send back what must agree, until it sends STOP."""
    while (call := channel.receive()) is not STOP:
        op, args = call
        try:
            out = _comparable(op, getattr(core, op)(*args))
        except Exception as exc:  # noqa: BLE001 - rank 0 reports it (it did not fail: a bug)
            out = Failed(repr(exc))
        channel.gather(out)


def _comparable(op: str, result):
    """What must agree across ranks: each row's outcome (tokens, accepted draft count) or error;
    the prompt logprobs' tokens (floats may differ in the last bits) and the positions held; which
    sessions existed."""

    def row(r):
        if isinstance(r, BaseException):
            return repr(r)
        if isinstance(r, Outcome):
            return list(r.tokens), r.num_draft_accepted
        return [e.token_id for e in r.logprobs], r.held  # Prefilled

    if op == "verify":
        return [row(r) for r in result]
    if op == "prefill":
        return {key: row(r) for key, r in result.items()}
    if op == "release":
        return [r is not None for r in result]
    return None  # costs: each rank's own timings


class VerifierServicer(SideServicer, internal_pb2_grpc.VerifierServiceServicer):
    """Rank 0's VerifierService: runs every call on itself and, in lockstep, on the other ranks
    (`channel`: `viasd.parallel.ControlChannel`; `loops`: futures of their `follow` loops, which
    end only when a rank stops or dies)."""

    drafter = False

    def __init__(self, core: VerifierRank, channel=None, loops=(), *, check_ranks: bool = True):
        self.core = core
        self.channel = channel
        self.loops = list(loops)
        self.check_ranks = check_ranks

    async def _run(self, op: str, *args, local_args: tuple = (), follower_args: tuple | None = None):
        """The rank's method `op` on every rank in lockstep (the others get `follower_args` when
        given, else `args`; this rank also `local_args`)."""
        work = self.core.work
        seq = work.number()
        if self.channel is None:
            return await work.enqueue(seq, getattr(self.core, op), *args, *local_args)
        sent = args if follower_args is None else follower_args
        local = work.enqueue(seq, lead, self.channel, op, sent, getattr(self.core, op), (*args, *local_args))
        # a dead rank fails the call at once: rank 0 may wait forever in a collective with it
        await asyncio.wait([local, *self.loops], return_when=asyncio.FIRST_COMPLETED)
        if local.done() and local.exception() is not None:  # (a collective fails as a peer dies: is one dead?)
            await asyncio.wait(self.loops, timeout=PEER_DEATH_S, return_when=asyncio.FIRST_COMPLETED)
        for rank, loop in enumerate(self.loops, start=1):
            if loop.done():
                why = type(loop.exception()).__name__ if loop.exception() else "its loop ended"
                raise PeerUnavailable(f"verifier rank {rank} is down ({why})")
        mine, others = await local  # (rank 0's own error is raised here)
        for rank, other in enumerate(others, start=1):
            if isinstance(other, Failed):
                raise RuntimeError(f"verifier rank {rank} failed where rank 0 did not: {other.error}")
            if self.check_ranks and _comparable(op, mine) != other:
                raise RuntimeError(
                    f"verifier ranks disagree on {op}: rank 0 {_comparable(op, mine)}, rank {rank} {other}"
                )
        return mine

    @rpc
    async def Verify(self, request: ipb.VerifyBatch, context) -> ipb.VerifyReply:
        """One step over every row of the batch, on every rank in lockstep. Only this rank decodes
        the drafter's p (a row whose p does not decode fails alone, on no rank); the others get
        its shape (`Absent`) and the sampled verdicts (`viasd.parallel.VerdictBroadcast`). A block
        rejected on p(x~) alone answers with its `Correction` in place of its last token."""
        t0 = time.perf_counter()
        results: list = [None] * len(request.rows)
        rows, where = [], []
        for i, r in enumerate(request.rows):
            try:
                p = decode_probs(r.probs) if r.HasField("probs") else _p_x(r)  # [k, V], [k] or None
            except InvalidParameterError as exc:
                results[i] = exc
                continue
            rows.append(VerifyRow(r.request_id, list(r.draft), p, r.plan))
            where.append(i)
        shapes = [row._replace(probs=Absent(tuple(row.probs.shape))) if row.probs is not None else row for row in rows]
        times = StepTimes()  # what the engine's cost model learns from (viasd.costs)
        settles = dict(request.settles)
        ran = await self._run("verify", rows, settles, local_args=(times,), follower_args=(shapes, settles))
        for i, result in zip(where, ran):
            results[i] = result
        answers = []
        for r, result in zip(request.rows, results):
            key = r.request_id
            if isinstance(result, Exception):
                answers.append(ipb.Verdict(request_id=key, error=row_error(result)))
                continue
            answers.append(
                ipb.Verdict(
                    request_id=key,
                    outcome=ipb.Outcome(tokens=result.tokens, num_draft_accepted=result.num_draft_accepted),
                    logprobs=logprobs_to_proto(result.logprobs),
                    escalated=result.escalated,
                    work_seconds=times.work.get(key, 0.0),
                    correction=_correction(result.correction),
                )
            )
        return ipb.VerifyReply(rows=answers, times=times_to_proto(times, time.perf_counter() - t0))


def _p_x(row: ipb.VerifyRow) -> torch.Tensor | None:
    """A row's p(x~) [k] (probability only), or None: none sent."""
    if not row.p_x:
        return None
    if len(row.p_x) != len(row.draft) or not all(0.0 < x <= 1.0 for x in row.p_x):
        raise InvalidParameterError("p_x", f"{len(row.draft)} probabilities in (0, 1] expected, one per draft token")
    return torch.tensor(list(row.p_x), dtype=torch.float64)  # [k]


def _correction(correction) -> ipb.Correction | None:
    """An outcome's pending last token on the wire (q's row exact, its uniform)."""
    if correction is None:
        return None
    return ipb.Correction(q=encode_probs(correction.q[None]), u=correction.u)


def _q_proj_rows(linear) -> int:
    """Output rows a projection holds on this rank: its weight's, or a quantized one's integers' (viasd.quant)."""
    return (linear.weight if hasattr(linear, "weight") else linear.qweight).shape[0]


@ray.remote
class VerifierWorker(ModelActor):
    """One tensor-parallel rank of the verifier; rank 0 also serves VerifierService."""

    def __init__(self):
        self.rank = 0
        self._tokenizer = None
        self.channel = None  # rank 0's calls to the others (viasd.parallel.ControlChannel), under TP
        self._following: asyncio.Future | None = None  # ranks 1..N-1: their `follow` loop

    async def rendezvous(self) -> dict:
        """Rank 0's node address and a free port on it, for the process group's tcp:// store."""
        from viasd.parallel import free_port

        return {"master_addr": ray.util.get_node_ip_address(), "master_port": free_port()}

    async def setup(self, engine: dict, **group) -> dict:
        """Load q, resolve the mask, shard across the group (every rank calls this at once, `group`:
        `_setup`'s rank and group), on the model thread, where its forwards will run; returns what
        the rank loaded."""
        config = EngineConfig.model_validate(engine)
        self.rank = group["rank"]
        return await asyncio.get_running_loop().run_in_executor(
            model_thread.executor(), functools.partial(self._setup, config, **group)
        )

    def _setup(
        self,
        config: EngineConfig,
        *,
        rank: int,
        world_size: int,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        tp_backend: str = "torch",
        device: str = "cpu",
    ) -> dict:
        """Load q, resolve its mask and gates, join the group and shard (`setup`, on the model thread);
        its caches hold the engine's capacity (`engine_capacity`: this rank's share of the keys and
        values, for the full tier and the slim one under the separate policy).

        Torch tensor parallelism reads only this rank's slices of the checkpoint (`load_causal_lm_shard`)
        unless a DIMR artifact that applies was not searched on these files (its checkpoint
        fingerprint): then every weight is read, its fingerprint checked, and sharded after.
        DeepSpeed shards a model loaded on the host."""
        from viasd.attention import resolve_paged_attention
        from viasd.engine import cost_cache_dir, engine_capacity, kv_bytes_per_token
        from viasd.llm import eos_ids, mask_needs_weights, resolve_gates, resolve_mask
        from viasd.models.loader import load_causal_lm, load_causal_lm_shard, resolve_model_dir
        from viasd.parallel import ControlChannel, TPBackend, TPGroup, shard_model
        from viasd.quant import engine_linears  # (a rank quantizes its own slices: viasd.parallel.quantize_shard)

        threads = set_threads(config.threads, world_size)
        dtype = engine_dtype(config, device).dtype  # the target device's, also where the host loads
        cuda = device.startswith("cuda")
        group = None
        if world_size > 1:
            group = TPGroup(
                rank=rank,
                world_size=world_size,
                master_addr=master_addr,
                master_port=master_port,
                backend="nccl" if cuda else "gloo",
                local_rank=0 if cuda else None,
            )
        checkpoint = resolve_model_dir(config.verifier, dtype)
        sliced = (
            world_size > 1 and TPBackend(tp_backend) == TPBackend.TORCH and not mask_needs_weights(config, checkpoint)
        )
        if sliced:
            model, tokenizer = load_causal_lm_shard(
                config.verifier, group, dtype=dtype, trust_remote_code=config.trust_remote_code
            )
        else:  # sharded ranks load on the host and move only their shards to the device (shard_model)
            model, tokenizer = load_causal_lm(
                config.verifier,
                dtype=dtype,
                device=device if world_size == 1 else "cpu",
                trust_remote_code=config.trust_remote_code,
            )
        mask, mask_source = resolve_mask(config, model, checkpoint=checkpoint)  # (an artifact: files or weights)
        gates, gates_source = resolve_gates(config, mask)  # what `via` requests choosing none get
        eos = eos_ids(tokenizer, model)
        if world_size > 1:
            if not sliced:
                model = shard_model(model, TPBackend(tp_backend), group)
            packed = engine_linears(model, config, device, config.verifier, dtype, tp=group, tp_backend=tp_backend)
        else:  # the in-process engine's quantized and packed linears
            packed = engine_linears(model, config, device, config.verifier, dtype)
        lm = MaskedLM(model)
        positions = getattr(lm.config, "max_position_embeddings", None)
        per_token = kv_bytes_per_token(lm, None, mask, config.cache_policy) // world_size  # (heads are sharded)
        capacity, context_name = engine_capacity(config, per_token, lm.device, [positions])
        attention = resolve_paged_attention(config.paged_attention, lm.device, config.block_size)
        self.core = VerifierRank(
            lm,
            mask,
            config.cache_policy,
            capacity,
            world_size=world_size,
            cost_cache_dir=str(cost_cache_dir()),
            cores=cores_lock(device, threads, world_size),
        )
        if world_size > 1:  # rank 0 decides sampled checks from the drafter's p; the others receive verdicts
            from viasd.parallel import VerdictBroadcast

            self.channel = ControlChannel(rank, world_size)  # rank 0's calls to the others (every rank at once)
            self.core.worker.verdicts = VerdictBroadcast(rank)
        self._tokenizer = tokenizer if rank == 0 else None  # (None for a directory without one)
        return {
            **actor_facts(lm, capacity, context_name, threads, packed),
            "rank": rank,
            "skipped_layers": list(mask.skipped),
            "mask_source": mask_source,
            "gates": dataclasses.asdict(gates) if gates is not None else None,
            "gates_source": gates_source,
            "eos_token_ids": list(eos),
            "local_q_proj_rows": int(_q_proj_rows(lm.layers[0].self_attn.q_proj)),  # this rank's shard
            "weight_bytes": sum(p.numel() * p.element_size() for p in lm.model.parameters()),  # this rank's
            "checkpoint_read": "its slices" if sliced else "every weight",  # what it read of the checkpoint
            # the dtype choice, the CPU capability, the kernel that reads paged caches
            "runtime": {**engine_dtype(config, device).as_dict(), **attention.as_dict()},
        }

    async def serve(
        self, followers: list, *, host: str = "127.0.0.1", check_ranks: bool = True, tls: InternalTLS | None = None
    ) -> str:
        """Rank 0: start VerifierService (mutual TLS with `tls`), driving `followers` (the handles
        of ranks 1..N-1, each following in its `follow` loop); return its address."""
        loops = [asyncio.wrap_future(f.follow.remote().future()) for f in followers]
        servicer = VerifierServicer(self.core, self.channel, loops, check_ranks=check_ranks)
        add = internal_pb2_grpc.add_VerifierServiceServicer_to_server
        self.server, address = await serve_internal(add, servicer, host, tls)
        log.info("verifier rank 0 serving on %s with %d follower rank(s)", address, len(followers))
        return address

    async def follow(self) -> None:
        """Ranks 1..N-1: run rank 0's calls on the model thread until it stops (`follow`); a
        rank that dies ends this call with an error, which is how rank 0 learns it."""
        self._following = asyncio.get_running_loop().run_in_executor(
            model_thread.executor(), follow, self.core, self.channel
        )
        await self._following

    async def tokenizer(self):
        """Rank 0: the verifier's tokenizer (None for a directory without one), for the serving
        process, which need not hold the model files."""
        return self._tokenizer

    async def stop(self) -> None:
        """Stop serving; rank 0 releases the other ranks from their loops (STOP), and a rank
        leaves the group once its loop has ended (one still waiting in a collective is killed)."""
        await self.stop_server()
        ended = True
        if self.channel is not None and self.rank == 0 and self.core is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.core.work.submit(self.channel.send, STOP), STOP_WAIT_S)
        if self._following is not None:
            done, _ = await asyncio.wait([self._following], timeout=STOP_WAIT_S)
            ended = bool(done)
        if self.core is not None:
            self.core.shutdown()
        if ended:
            from viasd.parallel import shutdown_tp

            shutdown_tp()
