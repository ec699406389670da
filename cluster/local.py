"""The in-process pipeline: `viasd.llm.LLM`'s engine inside the serving process, no actors.

The same `viasd.cluster.handler.Backend` as `viasd.cluster.pipeline.Pipeline`, for CPU
development and as the reference the served output is compared with; both stream their engine's
requests through `viasd.engine.AsyncEngine`, this one over the models in this process.
"""

from __future__ import annotations

import asyncio

from viasd.cluster.pipeline import PipelineConfig, pipeline_info
from viasd.engine import AsyncEngine
from viasd.errors import InvalidParameterError
from viasd.llm import LLM


class LocalPipeline:
    """A pipeline config's models (`viasd.llm.LLM`) served in-process, unsharded."""

    def __init__(self, llm: LLM, config: PipelineConfig):
        self.llm = llm
        self.config = config
        self.tokenizer = llm.tokenizer
        self.coordinator = AsyncEngine(llm.engine)

    @classmethod
    async def start(cls, config: PipelineConfig) -> LocalPipeline:
        if config.tp_size != 1:
            raise InvalidParameterError("tp_size", "the local backend runs the verifier unsharded (tp_size 1)")
        return cls(await asyncio.to_thread(LLM, config.engine), config)

    def info(self) -> dict:
        e = self.llm.engine
        return pipeline_info(self.config, e, e.verifier.num_layers, e.mask.skipped, self.llm.runtime_info())

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
