"""The in-process pipeline: `viasd.llm.LLM`'s engine inside the serving process, no actors.

Same interface as `viasd.cluster.pipeline.Pipeline` (`coordinator.generate`, `tokenizer`,
`info()`, `shutdown()`), for CPU development and as the reference the served output is compared
with. The engine's steps run on one worker thread: each `next()` of a stream runs one engine step
for every request in flight (continuous batching, viasd.scheduler) unless that stream already
has a chunk waiting, so concurrent streams decode together and the event loop never blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from viasd.config import GenerationParams
from viasd.engine import Chunk


class LocalCoordinator:
    """Streams an engine's chunks to asyncio callers, one decode step per worker-thread job."""

    def __init__(self, engine):
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="viasd-engine")
        self._active = 0

    def active_requests(self) -> int:
        return self._active

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: GenerationParams) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        it = self.engine.generate(list(prompt_ids), params)
        self._active += 1
        try:
            while True:
                chunk = await loop.run_in_executor(self._pool, next, it, None)
                if chunk is None:
                    return
                yield chunk
                if chunk.finished:
                    return
        finally:
            self._active -= 1
            self._pool.submit(it.close)  # drop the request's caches on the engine's thread

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class LocalPipeline:
    """A pipeline config's models (`viasd.llm.LLM`) served in-process, unsharded."""

    def __init__(self, llm, config):
        self.llm = llm
        self.config = config  # a viasd.cluster.pipeline.PipelineConfig
        self.tokenizer = llm.tokenizer
        self.coordinator = LocalCoordinator(llm.engine)

    @classmethod
    async def start(cls, config) -> "LocalPipeline":
        from viasd.errors import InvalidParameterError
        from viasd.llm import LLM

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
        }

    async def shutdown(self) -> None:
        self.coordinator.close()
