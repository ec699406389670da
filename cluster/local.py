"""The in-process pipeline: `viasd.llm.LLM`'s engine inside the serving process, no actors.

The same `viasd.cluster.handler.Backend` as `viasd.cluster.pipeline.Pipeline`, for CPU
development and as the reference the served output is compared with. The engine's steps run on
the process's model thread (viasd.model_thread): each `next()` of a stream runs there, one engine
step for every request in flight (continuous batching, viasd.scheduler) unless that stream
already has a chunk waiting, so concurrent streams decode together and the event loop never
blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from viasd import model_thread
from viasd.cluster.pipeline import PipelineConfig
from viasd.config import GenerationParams
from viasd.engine import Chunk
from viasd.errors import InvalidParameterError
from viasd.llm import LLM


class LocalCoordinator:
    """Streams an engine's chunks to asyncio callers, one decode step per worker-thread job."""

    def __init__(self, engine):
        self.engine = engine
        self._pool = model_thread.executor()  # (shared: the process's models run on it alone)
        self._active = 0
        self._samples: dict[str, list] = {}  # a running request's sample handles, by its id

    def active_requests(self) -> int:
        return self._active

    def planner_state(self) -> dict:
        return self.engine.planner_state()

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: GenerationParams
    ) -> AsyncIterator[Chunk]:
        """The request's chunks (n > 1: every sample's, interleaved; `chunk.index` says whose),
        until every sample has finished."""
        loop = asyncio.get_running_loop()
        samples = self.engine.submit(list(prompt_ids), params).samples  # validated here (field named)
        it = self.engine.follow(samples)
        self._samples[request_id] = samples
        self._active += 1
        try:
            while True:
                chunk = await loop.run_in_executor(self._pool, next, it, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            self._active -= 1
            self._samples.pop(request_id, None)
            self._pool.submit(it.close)  # drop the request's caches on the model thread

    def stop_sample(self, request_id: str, index: int) -> None:
        samples = self._samples.get(request_id, ())
        if 0 <= index < len(samples):
            self._pool.submit(self.engine.cancel, samples[index])  # between steps, on the model thread

    def close(self) -> None:
        """Nothing to stop: the model thread outlives the backend (a stream still open closes its
        request on it)."""


class LocalPipeline:
    """A pipeline config's models (`viasd.llm.LLM`) served in-process, unsharded."""

    def __init__(self, llm: LLM, config: PipelineConfig):
        self.llm = llm
        self.config = config
        self.tokenizer = llm.tokenizer
        self.coordinator = LocalCoordinator(llm.engine)

    @classmethod
    async def start(cls, config: PipelineConfig) -> LocalPipeline:
        if config.tp_size != 1:
            raise InvalidParameterError("tp_size", "the local backend runs the verifier unsharded (tp_size 1)")
        return cls(await asyncio.to_thread(LLM, config.engine), config)

    def info(self) -> dict:
        e, cfg = self.llm.engine, self.config
        return {
            "name": cfg.name,
            "verifier": cfg.engine.verifier,
            "drafter": cfg.engine.drafter or "",
            "num_layers": e.verifier.num_layers,
            "skipped_layers": list(e.mask.skipped),
            "tensor_parallel_size": 1,
            "max_context": e.max_context or 0,
            "default_mode": cfg.mode.value,
            "runtime": self.llm.runtime_info(),  # the dtype choice and the CPU capability
            "kv_capacity_tokens": e.capacity.max_batch * (e.capacity.max_seq_len or 0),  # 0: unbounded
        }

    async def session_counts(self) -> dict:
        """Nothing runs outside this process: no sessions to count (the health probe always answers)."""
        return {}

    async def supervise(self, on_health=None) -> None:
        """Nothing to repair: the engine lives and dies with this process."""

    def wake(self) -> None:
        """Nothing to wake (see `supervise`)."""

    def status(self) -> dict:
        return {"pids": {}, "rebuilds": {}, "requests": None}

    async def shutdown(self) -> None:
        self.coordinator.close()
