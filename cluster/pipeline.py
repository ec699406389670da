"""One pipeline = drafter actor + tensor-parallel verifier group + coordinator (DESIGN.md).

    pipeline = await Pipeline.start(PipelineConfig(engine=EngineConfig(...), tp_size=2))
    async for chunk in pipeline.coordinator.generate("req-1", prompt_ids, params): ...
    await pipeline.shutdown()

`Pipeline.start` reserves one placement group (bundle 0: the drafter; bundles 1..N: verifier
ranks 0..N-1; STRICT_PACK by default, so the drafter and every rank share a node and the gRPC
hops stay on it), starts the actors, lets every verifier rank load and shard the model at once
(they rendezvous on rank 0's node), starts the gRPC services and connects a `Coordinator` to
them in the calling event loop. Ray must already be initialised (`ray.init`, or inside a Serve
replica). Autoscaling adds pipelines; each is independent.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from viasd.actors.coordinator import Coordinator
from viasd.actors.drafter import DrafterActor
from viasd.actors.verifier import VerifierWorker
from viasd.config import EngineConfig, Mode, invalid_from_validation
from viasd.engine import context_limit
from viasd.errors import InvalidParameterError

log = logging.getLogger("viasd.cluster.pipeline")


class PipelineConfig(BaseModel):
    """A pipeline's models (`engine`) and how it is laid out on Ray."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("default", min_length=1, description="Pipeline name: the `model` a request asks for (ListModels).")
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="Models, dtype, layer mask, cache policy, context cap, torch threads (viasd.config.EngineConfig).",
    )
    tp_size: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks of the verifier; 1 runs it unsharded.")
    tp_backend: Literal["torch", "deepspeed"] = Field(
        "torch", description="How the verifier is sharded when tp_size > 1: PyTorch native TP or DeepSpeed AutoTP."
    )
    drafter_cpus: float = Field(1.0, ge=0.0, description="CPUs reserved for the drafter actor (its torch threads).")
    drafter_gpus: float = Field(0.0, ge=0.0, description="GPUs reserved for the drafter actor; > 0 runs it on CUDA.")
    verifier_cpus_per_rank: float = Field(1.0, ge=0.0, description="CPUs reserved for each verifier rank.")
    verifier_gpus_per_rank: float = Field(
        0.0, ge=0.0, description="GPUs reserved for each verifier rank; > 0 runs the ranks on CUDA (NCCL)."
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="Ray placement strategy of the pipeline's bundles (drafter + one per rank)."
    )
    bind_host: str = Field(
        "127.0.0.1", description="Interface the internal gRPC servers bind; 0.0.0.0 advertises the node's IP."
    )
    rpc_timeout_s: float = Field(
        60.0, gt=0.0, description="Deadline of every internal RPC (Open, Propose, Verify, Close)."
    )
    start_timeout_s: float = Field(900.0, gt=0.0, description="Time allowed for placement, model loading and sharding.")
    default_mode: Mode | None = Field(
        None, description="Mode of requests that leave it unspecified; default 'via' with a drafter, else 'ar'."
    )
    draft_probs_dtype: Literal["auto", "bfloat16"] = Field(
        "auto",
        description="Wire dtype of draft probabilities: 'auto' = the drafter's own (exact), 'bfloat16' = half size, lossy.",
    )
    check_ranks: bool = Field(True, description="Rank 0 checks that every TP rank committed the same tokens.")
    drafter_fallback: bool = Field(
        True, description="When the drafter fails, finish the request as 'ar' instead of failing it."
    )

    @model_validator(mode="after")
    def _check(self) -> "PipelineConfig":
        if self.engine.drafter and self.drafter_cpus + self.drafter_gpus <= 0:
            raise ValueError("drafter_cpus: the drafter needs a CPU or GPU share (drafter_cpus or drafter_gpus > 0)")
        if self.verifier_cpus_per_rank + self.verifier_gpus_per_rank <= 0:
            raise ValueError("verifier_cpus_per_rank: each rank needs a CPU or GPU share")
        if self.tp_size > 1 and self.tp_backend == "deepspeed" and self.engine.dtype == "float64":
            raise ValueError("tp_backend: DeepSpeed inference supports float32, bfloat16 and float16, not float64")
        if self.default_mode not in (None, Mode.AR) and not self.engine.drafter:
            raise ValueError(f"default_mode: {self.default_mode.value!r} needs a drafter; engine.drafter is None")
        if self.engine.device != "cpu" and self.verifier_gpus_per_rank <= 0:
            raise ValueError("verifier_gpus_per_rank: engine.device is CUDA but no GPU is reserved for the ranks")
        return self

    @property
    def mode(self) -> Mode:
        """The mode of requests that leave it unspecified."""
        return self.default_mode or (Mode.VIA if self.engine.drafter else Mode.AR)

    @classmethod
    def parse(cls, values: dict[str, Any] | None = None, **overrides: Any) -> "PipelineConfig":
        """Validate, raising InvalidParameterError that names the bad field (dotted for engine.*)."""
        try:
            return cls.model_validate({**(values or {}), **overrides})
        except ValidationError as exc:
            first = exc.errors()[0]
            if not first.get("loc"):  # the cross-field check above: its message starts with the field
                field, _, message = first["msg"].removeprefix("Value error, ").partition(": ")
                raise InvalidParameterError(field, message) from None
            raise invalid_from_validation(exc) from None


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}


class Pipeline:
    """A running pipeline: its actors, their placement group, its coordinator and tokenizer."""

    def __init__(self, config: PipelineConfig, *, coordinator: Coordinator, tokenizer, drafter, ranks: list,
                 placement, drafter_info: dict | None, verifier_info: dict):
        self.config = config
        self.coordinator = coordinator
        self.tokenizer = tokenizer  # None for tokenizer-less (test) models: requests carry token ids
        self.drafter = drafter  # Ray handle of DrafterActor, or None (`ar` only)
        self.ranks = ranks  # Ray handles of VerifierWorker, rank 0 first
        self.placement = placement
        self.drafter_info = drafter_info
        self.verifier_info = verifier_info

    @classmethod
    async def start(cls, config: PipelineConfig) -> "Pipeline":
        if not ray.is_initialized():
            raise RuntimeError("Pipeline.start needs a running Ray (ray.init(...), or a Serve replica)")
        engine = config.engine.model_dump(mode="json")
        has_drafter = config.engine.drafter is not None
        bundles = ([_bundle(config.drafter_cpus, config.drafter_gpus)] if has_drafter else []) + [
            _bundle(config.verifier_cpus_per_rank, config.verifier_gpus_per_rank)
        ] * config.tp_size
        pg = placement_group(bundles, strategy=config.placement_strategy)
        actors: list = []
        try:
            await asyncio.wait_for(pg.ready(), config.start_timeout_s)

            def place(index: int, cpus: float, gpus: float):
                return dict(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=index))

            drafter = None
            first = 1 if has_drafter else 0
            if has_drafter:
                drafter = DrafterActor.options(**place(0, config.drafter_cpus, config.drafter_gpus)).remote()
                actors.append(drafter)
            ranks = [VerifierWorker.options(**place(first + r, config.verifier_cpus_per_rank,
                                                    config.verifier_gpus_per_rank)).remote()
                     for r in range(config.tp_size)]
            actors += ranks
            rdv = await ranks[0].rendezvous.remote() if config.tp_size > 1 else {}
            device = "cuda" if config.verifier_gpus_per_rank > 0 else "cpu"
            setups = [
                rank.setup.remote(engine, rank=r, world_size=config.tp_size, tp_backend=config.tp_backend, device=device,
                                  cpus=config.verifier_cpus_per_rank, **rdv)
                for r, rank in enumerate(ranks)
            ]
            if has_drafter:
                setups.append(drafter.start.remote(
                    engine, host=config.bind_host, device="cuda" if config.drafter_gpus > 0 else "cpu",
                    cpus=config.drafter_cpus, probs_dtype=config.draft_probs_dtype))
            infos = await asyncio.wait_for(asyncio.gather(*setups), config.start_timeout_s)
            verifier_info, drafter_info = infos[0], (infos[-1] if has_drafter else None)
            if drafter_info and drafter_info["vocab_size"] != verifier_info["vocab_size"]:
                raise ValueError(f"drafter vocabulary ({drafter_info['vocab_size']}) differs from the verifier's "
                                 f"({verifier_info['vocab_size']}); the pair must share a tokenizer")
            address = await ranks[0].serve.remote(ranks[1:], host=config.bind_host, check_ranks=config.check_ranks)
            tokenizer = await ranks[0].tokenizer.remote()
            max_context = context_limit(verifier_info["max_position_embeddings"],
                                        drafter_info["max_position_embeddings"] if drafter_info else None,
                                        config.engine.max_context)
            coordinator = Coordinator(
                address,
                drafter_info["address"] if drafter_info else None,
                vocab_size=verifier_info["vocab_size"],
                max_context=max_context,
                eos_token_ids=verifier_info["eos_token_ids"],
                rpc_timeout_s=config.rpc_timeout_s,
                drafter_fallback=config.drafter_fallback,
            )
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(pg)
            raise
        log.info("pipeline %r up: verifier %s (TP=%d, %s), drafter %s", config.name, address, config.tp_size,
                 config.tp_backend, drafter_info["address"] if drafter_info else None)
        return cls(config, coordinator=coordinator, tokenizer=tokenizer, drafter=drafter, ranks=ranks, placement=pg,
                   drafter_info=drafter_info, verifier_info=verifier_info)

    def info(self) -> dict:
        """What ListModels reports about this pipeline."""
        e = self.config.engine
        return {
            "name": self.config.name,
            "verifier": e.verifier,
            "drafter": e.drafter or "",
            "num_layers": self.verifier_info["num_layers"],
            "skipped_layers": list(self.verifier_info["skipped_layers"]),
            "tensor_parallel_size": self.config.tp_size,
            "max_context": self.coordinator.max_context or 0,
            "default_mode": self.config.mode.value,
        }

    async def session_counts(self) -> dict:
        """Open sessions on each actor: {"drafter": n, "verifier": [n per rank]} (0 when idle)."""
        ranks = await asyncio.gather(*(r.num_sessions.remote() for r in self.ranks))
        drafter = await self.drafter.num_sessions.remote() if self.drafter is not None else 0
        return {"drafter": drafter, "verifier": list(ranks)}

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the servers, leave the process group, kill the actors, free the placement group."""
        await self.coordinator.close()
        actors = ([self.drafter] if self.drafter is not None else []) + self.ranks
        try:
            await asyncio.wait_for(asyncio.gather(*(a.stop.remote() for a in actors), return_exceptions=True), timeout_s)
        except asyncio.TimeoutError:
            log.warning("pipeline %r: actors did not stop within %.0fs; killing them", self.config.name, timeout_s)
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(self.placement)
