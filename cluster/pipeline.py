"""One pipeline = drafter actor + tensor-parallel verifier group + coordinator (docs/ARCHITECTURE.md, "Distributed shape").

    pipeline = await Pipeline.start(PipelineConfig(engine=EngineConfig(...), tp_size=2))
    async for chunk in pipeline.coordinator.generate("req-1", prompt_ids, params): ...
    await pipeline.shutdown()

`Pipeline.start` reserves one placement group (bundle 0: the drafter; then one per verifier rank;
STRICT_PACK by default, so the gRPC hops stay on one node), starts the actors (the ranks load
and shard at once, rendezvousing on rank 0's node) and their gRPC services, and runs the
engine's step loop over them (`Engine.over(ServedExecutor)`, `AsyncEngine`) at the capacity every
actor's caches hold. Ray must already be initialised (`ray.init`, or inside a Serve replica).

Faults: `probe()` asks every actor for its session count under a deadline; `heal()` replaces a
dead drafter, or the whole verifier group when a rank died, and points the coordinator at the
new services; `supervise(on_health)` runs both in a loop, woken at once when a request finds a
backend UNAVAILABLE (docs/SERVING.md, "The pipeline and the standalone gRPC server").
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from typing import Any, Literal, TypeVar

import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from viasd.actors.coordinator import ServedExecutor
from viasd.actors.drafter import DrafterActor
from viasd.actors.rpc import InternalTLS
from viasd.actors.verifier import VerifierWorker
from viasd.config import EngineConfig, Mode, validate_named
from viasd.engine import AsyncEngine, Capacity, Engine
from viasd.gates import Gates
from viasd.precision import LinearReport, kernels

log = logging.getLogger("viasd.cluster.pipeline")
M = TypeVar("M", bound="StrictModel")


class StrictModel(BaseModel):
    """A configuration model: unknown fields refused, immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def parse(cls: type[M], values: dict[str, Any] | None = None, **overrides: Any) -> M:
        """Validate, raising InvalidParameterError that names the bad field (dotted for nested ones)."""
        return validate_named(cls, {**(values or {}), **overrides})


class PipelineConfig(StrictModel):
    """A pipeline's models (`engine`) and how it is laid out on Ray."""

    name: str = Field(
        "default", min_length=1, description="Pipeline name: the `model` a request asks for (ListModels)."
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="The model name responses, /v1/models and metrics show; default: the "
        "pipeline's name, or the verifier's for the unnamed pipeline `default` (which still answers to `default`).",
    )
    aliases: tuple[str, ...] = Field((), description="More names a request's `model` may use for this pipeline.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="Models, dtype, layer mask, cache policy, context cap, torch threads (viasd.config.EngineConfig).",
    )
    tp_size: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks of the verifier; 1 runs it unsharded.")
    tp_backend: Literal["torch", "deepspeed"] = Field(
        "torch", description="How the verifier is sharded when tp_size > 1: PyTorch native TP or DeepSpeed AutoTP."
    )
    drafter_cpus: float = Field(
        1.0,
        ge=0.0,
        description="CPUs Ray reserves for the drafter actor (placement; its torch threads: engine.threads, else the node's cores over tp_size).",
    )
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
    internal_tls: InternalTLS | None = Field(
        None,
        description="Mutual TLS on the internal drafter / verifier services (certificate, key, CA, server name); "
        "None: plaintext, for loopback or a trusted pod network.",
    )
    rpc_timeout_s: float = Field(
        60.0, gt=0.0, description="Deadline of every internal RPC (Prefill, Propose, Verify, Release)."
    )
    start_timeout_s: float = Field(900.0, gt=0.0, description="Time allowed for placement, model loading and sharding.")
    default_mode: Mode | None = Field(
        None,
        description="Mode of requests that leave it unspecified; default 'auto' (per step the plan with the most "
        "expected tokens per second; lossless unless a request allows lossy plans).",
    )
    draft_probs_dtype: Literal["auto", "bfloat16"] = Field(
        "auto",
        description="Wire dtype of draft probabilities: 'auto' = the drafter's own (exact), 'bfloat16' = half size, lossy.",
    )
    check_ranks: bool = Field(True, description="Rank 0 checks that every TP rank committed the same tokens.")
    drafter_fallback: bool = Field(
        True, description="When the drafter fails, finish the request as 'ar' instead of failing it."
    )
    rebuild_actors: bool = Field(
        True,
        description="Under `Pipeline.supervise`: replace a drafter or verifier rank that died (a new actor in its "
        "bundle; a dead rank rebuilds the whole verifier group).",
    )
    health_check_period_s: float = Field(
        5.0,
        gt=0.0,
        description="How often `Pipeline.supervise` probes every actor; a backend found down by a request wakes it "
        "at once.",
    )

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
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
        return self.default_mode or Mode.AUTO


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}


#: The model actors' environment: niceness 0, not the 15 Ray starts its workers at, which would
#: put the forwards below every daemon of the node (docs/ARCHITECTURE.md, "Threads").
MODEL_ACTOR_ENV = {"RAY_worker_niceness": "0"}


def _place(pg, index: int, cpus: float, gpus: float) -> dict:
    """Options of a model actor in bundle `index` of the pipeline's placement group."""
    return dict(
        num_cpus=cpus,
        num_gpus=gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        runtime_env={"env_vars": MODEL_ACTOR_ENV},
    )


@ray.remote(num_cpus=0)
def _dtype_choice(engine: dict, device: str) -> dict:
    from viasd.precision import engine_dtype

    return engine_dtype(EngineConfig.model_validate(engine), device).as_dict()


async def _resolve_dtype(config: PipelineConfig, pg) -> tuple[PipelineConfig, dict | None]:
    """`dtype: auto` resolved once for every actor of the pipeline, on the node of the verifier's
    first rank: each process choosing alone could choose differently (on a CPU the choice rests
    on a timed probe), and tensor-parallel ranks must agree. The config with the chosen dtype,
    and the choice (why: what /v1/models reports); a concrete dtype is kept as it is."""
    if config.engine.dtype != "auto":
        return config, None
    device = "cuda" if config.verifier_gpus_per_rank > 0 else "cpu"
    first = 1 if config.engine.drafter is not None else 0
    choice = await _dtype_choice.options(**_place(pg, first, 0, 0)).remote(
        config.engine.model_dump(mode="json"), device
    )
    return config.model_copy(update={"engine": config.engine.model_copy(update={"dtype": choice["dtype"]})}), choice


def _engine(config: PipelineConfig, verifier_address: str, verifier: dict, drafter: dict | None) -> Engine:
    """The engine's step loop over the started actors: its capacity is what every actor's caches
    hold (each sized its own from the engine config: `engine_capacity`), its context the least
    of theirs."""
    if drafter and drafter["vocab_size"] != verifier["vocab_size"]:
        raise ValueError(
            f"drafter vocabulary ({drafter['vocab_size']}) differs from the verifier's "
            f"({verifier['vocab_size']}); the pair must share a tokenizer"
        )
    sides = [i for i in (verifier, drafter) if i is not None and i["max_seq_len"] is not None]
    least = min(sides, key=lambda i: i["max_seq_len"], default=None)
    e = config.engine
    executor = ServedExecutor(
        verifier_address,
        drafter["address"] if drafter else None,
        vocab_size=verifier["vocab_size"],
        rpc_timeout_s=config.rpc_timeout_s,
        tls=config.internal_tls,
    )
    return Engine.over(
        executor,
        Capacity(
            e.max_batch,
            least and least["max_seq_len"],
            e.prefill_chunk,
            e.block_size,
            min((i["kv_blocks"] for i in sides if i.get("kv_blocks")), default=None),
            e.prefix_caching,
        ),
        eos_token_ids=verifier["eos_token_ids"],
        context_name=least["context_name"] if least else "max_context",
        gates=Gates(**verifier["gates"]) if verifier.get("gates") else None,
        drafter_fallback=config.drafter_fallback,
    )


def pipeline_info(config: PipelineConfig, engine: Engine, num_layers: int, skipped: list[int], runtime: dict) -> dict:
    """What ListModels and /v1/models report about a pipeline (the ModelInfo fields) whose engine
    is `engine`."""
    return {
        "name": config.name,
        "verifier": config.engine.verifier,
        "drafter": config.engine.drafter or "",
        "num_layers": num_layers,
        "skipped_layers": list(skipped),
        "tensor_parallel_size": config.tp_size,
        "max_context": engine.max_context or 0,
        "default_mode": config.mode.value,
        "kv_capacity_tokens": engine.capacity.tokens,  # 0: unbounded
        "capacity": engine.capacity.describe(),
        "runtime": runtime,  # the dtype choice and the CPU capability
    }


class Pipeline:
    """A running pipeline: its actors, their placement group, its coordinator (the engine over the
    actors, as asyncio streams) and tokenizer."""

    def __init__(self, config: PipelineConfig, placement):
        """A pipeline with no actors yet (`start` starts them; `heal` replaces them)."""
        self.config = config
        self.placement = placement
        self.coordinator: AsyncEngine | None = None  # the engine over the actors, once both sides are up
        self.executor: ServedExecutor | None = None
        self.tokenizer = None  # None for tokenizer-less (test) models: requests carry token ids
        self.drafter = None  # Ray handle of DrafterActor, or None (`ar` only)
        self.drafter_info: dict | None = None
        self.ranks: list = []  # Ray handles of VerifierWorker, rank 0 first
        self.verifier_info: dict = {}
        self.verifier_address = ""
        self.rebuilds = {"drafter": 0, "verifier": 0}  # actors replaced by `heal`
        self._wake = asyncio.Event()  # a request found a backend down: probe now
        self._healing = asyncio.Lock()
        self._stopping = False  # set by shutdown: nothing is rebuilt any more

    @classmethod
    async def start(cls, config: PipelineConfig) -> Pipeline:
        if not ray.is_initialized():
            raise RuntimeError("Pipeline.start needs a running Ray (ray.init(...), or a Serve replica)")
        has_drafter = config.engine.drafter is not None
        bundles = ([_bundle(config.drafter_cpus, config.drafter_gpus)] if has_drafter else []) + [
            _bundle(config.verifier_cpus_per_rank, config.verifier_gpus_per_rank)
        ] * config.tp_size
        pipeline = cls(config, placement_group(bundles, strategy=config.placement_strategy))
        try:
            await asyncio.wait_for(pipeline.placement.ready(), config.start_timeout_s)
            pipeline.config, dtype = await _resolve_dtype(config, pipeline.placement)
            starts = [pipeline._start_verifier] + ([pipeline._start_drafter] if has_drafter else [])
            await asyncio.gather(*(pipeline._start_in_place(start) for start in starts))
            info = pipeline.verifier_info
            info["runtime"] = dtype or info["runtime"]  # (auto: why it chose, not "requested")
            pipeline.coordinator = AsyncEngine(
                _engine(pipeline.config, pipeline.verifier_address, info, pipeline.drafter_info)
            )
        except BaseException:
            for actor in pipeline._actors():
                ray.kill(actor)
            remove_placement_group(pipeline.placement)
            raise
        log.info(
            "pipeline %r up: verifier %s (TP=%d, %s), drafter %s",
            config.name,
            pipeline.verifier_address,
            config.tp_size,
            config.tp_backend,
            pipeline.drafter_info["address"] if has_drafter else None,
        )
        pipeline.executor = pipeline.coordinator.engine.executor
        loop = asyncio.get_running_loop()  # (the engine's calls run on its step thread)
        pipeline.executor.on_unavailable = lambda component: loop.call_soon_threadsafe(pipeline._wake.set)
        return pipeline

    async def _start_verifier(self, actors: list) -> None:
        """The verifier ranks in their bundles, loaded, sharded, rank 0 serving (`start`, and `heal`
        after a rank died; `actors`: every one created); the executor, once there is one, sends
        new requests to it."""
        config = self.config
        first = 1 if config.engine.drafter is not None else 0
        ranks = [
            VerifierWorker.options(
                **_place(self.placement, first + r, config.verifier_cpus_per_rank, config.verifier_gpus_per_rank)
            ).remote()
            for r in range(config.tp_size)
        ]
        actors += ranks
        rdv = await ranks[0].rendezvous.remote() if config.tp_size > 1 else {}
        device = "cuda" if config.verifier_gpus_per_rank > 0 else "cpu"
        group = dict(world_size=config.tp_size, tp_backend=config.tp_backend, device=device, **rdv)
        engine = config.engine.model_dump(mode="json")
        infos = await asyncio.gather(*(rank.setup.remote(engine, rank=r, **group) for r, rank in enumerate(ranks)))
        address = await ranks[0].serve.remote(
            ranks[1:], host=config.bind_host, check_ranks=config.check_ranks, tls=config.internal_tls
        )
        self.tokenizer = await ranks[0].tokenizer.remote()
        self.ranks, self.verifier_address = ranks, address
        # rank 0's facts; every rank's process
        self.verifier_info = {**infos[0], "rank_pids": [i["pid"] for i in infos]}
        if self.executor is not None:
            self.executor.set_backends(verifier_address=address)

    async def _start_drafter(self, actors: list) -> None:
        """A DrafterActor in bundle 0, loaded and serving (`start`, and `heal` after it died), as
        `_start_verifier`."""
        config = self.config
        drafter = DrafterActor.options(**_place(self.placement, 0, config.drafter_cpus, config.drafter_gpus)).remote()
        actors.append(drafter)
        self.drafter_info = await drafter.start.remote(
            config.engine.model_dump(mode="json"),
            host=config.bind_host,
            device="cuda" if config.drafter_gpus > 0 else "cpu",
            ranks=config.tp_size,
            probs_dtype=config.draft_probs_dtype,
            tls=config.internal_tls,
        )
        self.drafter = drafter
        if self.executor is not None:
            self.executor.set_backends(drafter_address=self.drafter_info["address"])

    def _actors(self) -> list:
        return ([self.drafter] if self.drafter is not None else []) + self.ranks

    def info(self) -> dict:
        """What ListModels reports about this pipeline."""
        v = self.verifier_info  # (runtime: its dtype choice and CPU capability, and what both models packed)
        runtime = {**v["runtime"], **kernels(self._linears())}
        return pipeline_info(self.config, self.coordinator.engine, v["num_layers"], v["skipped_layers"], runtime)

    def _linears(self) -> list[LinearReport]:
        """What each model's actor packed: the verifier's rank 0, then the drafter."""
        infos = [self.verifier_info] + ([self.drafter_info] if self.drafter_info else [])
        return [info["linears"] for info in infos if "linears" in info]

    def status(self) -> dict:
        """For operators: the actors' processes, what `heal` rebuilt, requests the coordinator opened."""
        pids = {"verifier": self.verifier_info.get("rank_pids", [])}
        if self.drafter_info is not None:
            pids["drafter"] = self.drafter_info["pid"]
        return {"pids": pids, "rebuilds": dict(self.rebuilds), "requests": self.executor.totals.requests}

    async def session_counts(self) -> dict:
        """Open sessions on each actor: {"drafter": n, "verifier": [n per rank]} (0 when idle)."""
        ranks = await asyncio.gather(*(r.num_sessions.remote() for r in self.ranks))
        drafter = await self.drafter.num_sessions.remote() if self.drafter is not None else 0
        return {"drafter": drafter, "verifier": list(ranks)}

    def wake(self) -> None:
        """Make `supervise` probe (and rebuild what is down) now instead of at its next period."""
        self._wake.set()

    async def probe(self, timeout_s: float = 10.0) -> dict[str, str | None]:
        """{"drafter": error or None, "verifier": error or None}: every actor answers in time."""

        async def ask(actors: list) -> str | None:
            try:
                await asyncio.wait_for(asyncio.gather(*(a.num_sessions.remote() for a in actors)), timeout_s)
            except Exception as exc:  # noqa: BLE001 - a dead or stuck actor: reported
                return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            return None

        drafter, verifier = await asyncio.gather(
            ask([self.drafter]) if self.drafter is not None else asyncio.sleep(0), ask(self.ranks)
        )
        return {"drafter": drafter, "verifier": verifier}

    async def _start_in_place(self, start) -> None:
        """`start(actors)` (`_start_verifier`, `_start_drafter`) within start_timeout_s; on failure
        the actors it created are killed."""
        actors: list = []
        try:
            await asyncio.wait_for(start(actors), self.config.start_timeout_s)
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            raise

    async def heal(self, probe: dict[str, str | None] | None = None) -> list[str]:
        """Replace what `probe` found down (probing first when not given); returns what was rebuilt."""
        async with self._healing:
            if self._stopping:
                return []
            probe = probe or await self.probe()
            rebuilt = []
            if probe["verifier"]:
                log.warning("pipeline %r: verifier group down (%s); rebuilding it", self.config.name, probe["verifier"])
                for rank in self.ranks:
                    ray.kill(rank)
                await self._start_in_place(self._start_verifier)
                self.rebuilds["verifier"] += 1
                rebuilt.append("verifier")
            if probe["drafter"] and self.drafter is not None:
                log.warning("pipeline %r: drafter down (%s); restarting it", self.config.name, probe["drafter"])
                ray.kill(self.drafter)
                await self._start_in_place(self._start_drafter)
                self.rebuilds["drafter"] += 1
                rebuilt.append("drafter")
            return rebuilt

    async def supervise(self, on_health=None) -> None:
        """Probe every `health_check_period_s` (or at once when a request found a backend down) and
        rebuild what died; `on_health(False)` before a rebuild of the verifier group (requests would
        fail), `on_health(True)` after it. Runs until cancelled."""
        on_health = on_health or (lambda healthy: None)
        while True:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.health_check_period_s)
            self._wake.clear()
            if self._stopping:
                return
            probe = await self.probe()
            if not (probe["drafter"] or probe["verifier"]):
                continue
            if probe["verifier"]:
                on_health(False)
            if not self.config.rebuild_actors:
                continue
            try:
                await self.heal(probe)
            except Exception:  # noqa: BLE001 - stay down, try again on the next period
                log.exception("pipeline %r: rebuild failed", self.config.name)
                continue
            on_health(True)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the servers, leave the process group, kill the actors, free the placement group."""
        self._stopping = True
        self._wake.set()
        self.coordinator.close()
        actors = self._actors()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(a.stop.remote() for a in actors), return_exceptions=True), timeout_s
            )
        except TimeoutError:
            log.warning("pipeline %r: actors did not stop within %.0fs; killing them", self.config.name, timeout_s)
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(self.placement)
