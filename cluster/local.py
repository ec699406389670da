"""The in-process pipeline: `viasd.llm.LLM`'s engine inside the serving process, no actors.

The same `viasd.cluster.handler.Backend` as `viasd.cluster.pipeline.Pipeline`, for CPU
development and as the reference the served output is compared with; both stream their engine's
requests through `viasd.engine.AsyncEngine`, this one over the models in this process.
"""

from __future__ import annotations

import asyncio

from viasd.cluster.handler import Backend
from viasd.cluster.pipeline import PipelineConfig, pipeline_info
from viasd.engine import AsyncEngine
from viasd.errors import InvalidParameterError
from viasd.llm import LLM


class LocalPipeline(Backend):
    """A pipeline config's models (`viasd.llm.LLM`) served in-process, unsharded: nothing to
    probe or repair outside this process (`Backend`'s defaults)."""

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

    async def shutdown(self) -> None:
        self.coordinator.close()
