"""The drafter p as a gRPC service (viasd.v1.DrafterService) and the Ray actor that hosts it.

`DrafterServicer` holds one `viasd.engine.DraftSession` (cache + random stream + its copy of
the sequence) per request id. A cycle is one `Propose`: commit the previous cycle's outcome,
then draft k tokens. Forwards run on one worker thread, so the event loop keeps answering
Open / Close (and other requests queue in arrival order); the servicer is usable in any
process with a running event loop, the actor only adds model loading and a port.
"""

from __future__ import annotations

import logging
import os

import grpc
import ray

from viasd.actors.rpc import (
    InOrder,
    SessionNotFound,
    advertised_host,
    encode_probs,
    internal_tls,
    outcome_from_proto,
    rpc,
    start_server,
)
from viasd.config import MAX_GAMMA, EngineConfig
from viasd.engine import DraftSession, Outcome
from viasd.errors import InvalidParameterError
from viasd.metrics import RequestStats
from viasd.runtime import MaskedLM
from viasd.v1 import internal_pb2 as ipb
from viasd.v1 import internal_pb2_grpc
from viasd.v1.convert import params_from_proto, stats_to_proto

log = logging.getLogger("viasd.actors.drafter")


class DrafterServicer(internal_pb2_grpc.DrafterServiceServicer):
    """Draft sessions by request id; p leaves only when the rules need it (sampling)."""

    def __init__(self, lm: MaskedLM, *, probs_dtype: str = "auto"):
        self.lm = lm
        self.probs_dtype = probs_dtype
        self.sessions: dict[str, DraftSession] = {}
        self._work = InOrder("drafter")

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
        session = DraftSession(self.lm, prompt, params, request.seed, stats)
        await self._work.submit(session.prefill)  # the prompt but its last token, as in-process
        self.sessions[request.request_id] = session
        return ipb.OpenResponse(request_id=request.request_id)

    @rpc
    async def Propose(self, request: ipb.ProposeRequest, context) -> ipb.ProposeResponse:
        session = self._session(request.request_id)
        if not 1 <= request.k <= MAX_GAMMA:
            raise InvalidParameterError("k", f"must be in 1..{MAX_GAMMA}, got {request.k}")
        previous = outcome_from_proto(request.previous) if request.HasField("previous") else None
        for other in self.sessions.values():  # drafting ahead (overlap) yields the thread to any Propose
            other.stop.set()
        response = await self._work.submit(self._propose, request.request_id, session, previous, request.k)
        if session.params.overlap and response.draft:  # draft the next block while the verifier checks this one
            self._work.submit(session.draft_ahead).add_done_callback(_log_failure)
        return response

    def _propose(self, request_id: str, session: DraftSession, previous: Outcome | None, k: int) -> ipb.ProposeResponse:
        """On the worker thread: commit, draft, serialise (p can be megabytes)."""
        if previous is not None:
            session.commit(previous)
        draft, p = session.propose(k)  # [k], [k, V] or None
        probs = encode_probs(p, self.probs_dtype)
        return ipb.ProposeResponse(request_id=request_id, draft=draft, probs=probs, stats=stats_to_proto(session.stats))

    @rpc
    async def Close(self, request: ipb.CloseRequest, context) -> ipb.CloseResponse:
        # a Propose still running keeps its own reference; the cache goes when it finishes
        session = self.sessions.pop(request.request_id, None)
        if session is not None:
            session.stop.set()  # (a block being drafted ahead stops after its next token)
        return ipb.CloseResponse(existed=session is not None)

    def shutdown(self) -> None:
        self.sessions.clear()
        self._work.shutdown()


def _log_failure(done) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("drafting ahead failed: %s", done.exception())


def set_threads(threads: int | None, cpus: float) -> None:
    """torch threads of an actor: the configured count, else its CPU share (at least 1)."""
    import torch

    torch.set_num_threads(threads or max(1, int(cpus)))


@ray.remote
class DrafterActor:
    """Loads the drafter of an EngineConfig and serves DrafterService on a free port."""

    def __init__(self):
        self.server: grpc.aio.Server | None = None
        self.servicer: DrafterServicer | None = None

    async def start(self, engine: dict, *, host: str = "127.0.0.1", device: str = "cpu", cpus: float = 1.0,
                    probs_dtype: str = "auto", tls: dict | None = None) -> dict:
        """Load the model, start the server (mutual TLS with `tls`, an InternalTLS); return its
        address and the model's facts."""
        from viasd.models.loader import load_causal_lm

        config = EngineConfig.model_validate(engine)
        set_threads(config.threads, cpus)
        model, _ = load_causal_lm(config.drafter, dtype=config.dtype, device=device,
                                  trust_remote_code=config.trust_remote_code)
        lm = MaskedLM(model)
        self.servicer = DrafterServicer(lm, probs_dtype=probs_dtype)
        self.server, port = await start_server(
            lambda s: internal_pb2_grpc.add_DrafterServiceServicer_to_server(self.servicer, s), host,
            tls=internal_tls(tls))
        address = f"{advertised_host(host)}:{port}"
        log.info("drafter %s serving on %s (pid %d)", config.drafter, address, os.getpid())
        return {
            "address": address,
            "vocab_size": lm.vocab_size,
            "num_layers": lm.num_layers,
            "max_position_embeddings": getattr(lm.config, "max_position_embeddings", None),
            "pid": os.getpid(),
        }

    async def num_sessions(self) -> int:
        return len(self.servicer.sessions) if self.servicer else 0

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
            self.server = None
        if self.servicer is not None:
            self.servicer.shutdown()
