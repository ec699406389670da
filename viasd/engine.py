"""One engine, three modes: `ar` (q alone), `sd` (p -> q, two-tier), `via` (p -> q' -> q, VIA-SD).

`Engine` holds the continuous-batching scheduler (viasd.scheduler), the one step loop, over an
executor (viasd.executor): the models in this process (`Engine(verifier, drafter, ...)`), or
the served drafter and verifier actors (`Engine.over(ServedExecutor(...), ...)`). Every
request, in-process, through `LLM` or served, decodes through its steps. The cycle itself
(draft, slim verify, gate, escalate, roll back) is in viasd.sessions, the acceptance rules in
viasd.rules, the proposers in viasd.proposers. `AsyncEngine` streams an engine's requests to
asyncio callers (the request handler's backends).

    engine = Engine(verifier, drafter, mask=mask)
    engine.complete(prompt_ids, parse_params(mode="via"))        # one request, to the end
    for chunk in engine.generate(prompt_ids, params): ...        # streamed; threads may call
                                                                 # generate at once: they share steps
    h = engine.submit(ids, params); engine.step(); h.chunks       # driving steps yourself
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import torch

from viasd import model_thread
from viasd.attention import resolve_paged_attention
from viasd.config import DEFAULT_KV_BLOCK_SIZE, CachePolicy, EngineConfig, GenerationParams
from viasd.costs import CostModel
from viasd.errors import InvalidParameterError, MaskError, ModelLoadError
from viasd.executor import Capacity, Executor, LocalExecutor
from viasd.gates import Gates
from viasd.models.embedded import cache_root
from viasd.precision import cpu_memory
from viasd.runtime import LayerMask, MaskedLM
from viasd.scheduler import (
    Chunk,
    GenerationResult,
    RequestHandle,
    RequestLimits,
    Scheduler,
    check_request,
    context_limit,
    draft_length,
    resolve_seed,
)
from viasd.sessions import DraftSession, Outcome, VerifySession, request_seeds

__all__ = [
    "Engine",
    "AsyncEngine",
    "Chunk",
    "GenerationResult",
    "RequestHandle",
    "RequestLimits",
    "Capacity",
    "check_request",
    "context_limit",
    "draft_length",
    "resolve_seed",
    "kv_capacity",
    "engine_capacity",
    "DraftSession",
    "VerifySession",
    "Outcome",
    "request_seeds",
    "DEFAULT_KV_MEMORY_FRACTION",
]

DEFAULT_KV_MEMORY_FRACTION = 0.25  # of the memory available at start, when no KV budget is configured
MIN_DEFAULT_POSITIONS = 256  # a default budget that holds fewer positions per request is an error, not a tiny context


def cost_cache_dir() -> Path:
    """Where profiled cost curves are cached: beside the converted models."""
    return cache_root() / "costs"


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device` now (CUDA: the driver's figure; CPU: MemAvailable,
    viasd.precision.cpu_memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return cpu_memory()[0]


def kv_bytes_per_token(
    verifier: MaskedLM | None, drafter: MaskedLM | None, mask: LayerMask, policy: CachePolicy
) -> int:
    """KV bytes one position costs in every tier a `via` request holds on these models (served:
    each actor counts its own; a tensor-parallel rank, its shard)."""
    total = 0
    if verifier is not None:
        total += verifier.kv_bytes_per_token()
        if policy == CachePolicy.SEPARATE:
            total += verifier.kv_bytes_per_token(mask)
    if drafter is not None:
        total += drafter.kv_bytes_per_token()
    return total


def kv_capacity(
    per_token: int,
    device: torch.device,
    *,
    max_batch: int,
    max_seq_len: int | None,
    kv_cache_gib: float | None,
    model_context: int | None,
    max_context: int | None,
    block_size: int | None = None,
) -> tuple[int | None, str, int | None]:
    """Positions per request, the name of the limit that sets them (for the error a too long
    prompt gets), and the KV blocks of each tier (None: slot caches, `block_size` None or 0).

    Slot caches: without `max_seq_len`, what `kv_cache_gib` (default: a quarter of the memory
    available on `device` now) holds for `max_batch` rows of `per_token` bytes a position.
    Paged caches: the budget's blocks, blocks = budget // (per_token * block_size), any one
    request may fill (or, with `max_seq_len` and no budget, max_batch rows of it). Both capped by
    the models' context (`model_context`, with the configured `max_context` in it)."""
    block_size = block_size or None
    budget = kv_cache_gib * 2**30 if kv_cache_gib else None
    if max_seq_len is None:
        budget = budget or DEFAULT_KV_MEMORY_FRACTION * available_memory(device)
        if block_size is None:
            max_seq_len = int(budget // (max_batch * per_token))
            name = f"KV cache budget of {budget / 2**30:.2f} GiB for max_batch={max_batch} (kv_cache_gib)"
        else:
            max_seq_len = int(budget // (per_token * block_size)) * block_size
            name = f"KV cache budget of {budget / 2**30:.2f} GiB (kv_cache_gib)"
        if not kv_cache_gib and max_seq_len < min(model_context or MIN_DEFAULT_POSITIONS, MIN_DEFAULT_POSITIONS):
            raise ModelLoadError(
                f"only {budget / DEFAULT_KV_MEMORY_FRACTION / 2**30:.2f} GiB of memory is free after loading the "
                f"models: the default {name} holds {max_seq_len} positions per request; set "
                "kv_cache_gib or max_seq_len, lower max_batch, or turn packed_linears off"
            )
    else:
        name = "max_seq_len"
    limit = context_limit(model_context, max_seq_len)
    if model_context is not None and limit == model_context:
        name = "max_context" if max_context == model_context else "the models' max_position_embeddings"
    if limit is not None and limit < 2:
        raise ModelLoadError(f"{name} leaves {limit} positions per request; raise it")
    blocks = None
    if block_size is not None and limit is not None:
        per_block = per_token * block_size
        blocks = int(budget // per_block) if budget else max_batch * -(-limit // block_size)
        limit = min(limit, blocks * block_size)
    return limit, name, blocks


def engine_capacity(
    config: EngineConfig, per_token: int, device: torch.device | str, positions: Sequence[int | None]
) -> tuple[Capacity, str]:
    """The capacity an engine's config gives a process holding tiers of `per_token` KV bytes a
    position on `device`, whose models take `positions` (`kv_capacity`); served, each actor sizes
    its own caches this way (`kv_cache_gib`: its own budget), and the engine takes the least.
    Its caches are read by the kernel `paged_attention` resolves to on `device` (viasd.attention)."""
    context, name, blocks = kv_capacity(
        per_token,
        torch.device(device),
        max_batch=config.max_batch,
        max_seq_len=config.max_seq_len,
        kv_cache_gib=config.kv_cache_gib,
        model_context=context_limit(*positions, config.max_context),
        max_context=config.max_context,
        block_size=config.block_size,
    )
    kernel = resolve_paged_attention(config.paged_attention, device, config.block_size).kernel
    capacity = Capacity(
        config.max_batch, context, config.prefill_chunk, config.block_size, blocks, config.prefix_caching, kernel
    )
    return capacity, name


class Engine:
    """Decodes requests with a verifier q, an optional drafter p and the slim verifier q' = q masked by z.

    Capacity: `max_batch` requests decode together (cache rows per tier); requests past
    max_batch wait in the queue. By default the caches are paged (`kv_block_size` 16 positions a
    block, viasd.blocks): `kv_cache_gib` (default: a quarter of the memory available at start)
    buys each tier's blocks, requests are admitted against the blocks they hold and preempted
    when they outgrow them, and one request may hold up to all of them (`max_seq_len`, capped by
    the models' context). `kv_block_size=0` (or None): slot rows, each of `max_seq_len`
    positions; without `max_seq_len`, what the budget holds for max_batch rows of every tier,
    capped by the context (`kv_capacity`). Storage grows to what is used, up to that bound. Paged
    caches are read by the `paged_attention` kernel, "torch" or "flex" (viasd.attention; `LLM`
    resolves the config's).
    """

    def __init__(
        self,
        verifier: MaskedLM,
        drafter: MaskedLM | None = None,
        *,
        mask: LayerMask | None = None,
        skip_ratio: float = 0.45,
        cache_policy: CachePolicy | str = CachePolicy.SEPARATE,
        eos_token_ids: Sequence[int] = (),
        max_context: int | None = None,
        max_batch: int = 8,
        max_seq_len: int | None = None,
        kv_cache_gib: float | None = None,
        prefill_chunk: int = 512,
        kv_block_size: int | None = DEFAULT_KV_BLOCK_SIZE,
        prefix_caching: bool = True,
        paged_attention: str = "torch",
        costs: CostModel | None = None,
        cost_cache_dir: str | Path | None = None,
        gates: Gates | None = None,
    ):
        if drafter is not None and drafter.vocab_size != verifier.vocab_size:
            raise ModelLoadError(
                f"drafter vocabulary ({drafter.vocab_size}) differs from the verifier's ({verifier.vocab_size}); "
                "the pair must share a tokenizer"
            )
        mask = mask if mask is not None else LayerMask.evenly_spaced(skip_ratio, verifier.num_layers)
        if mask.num_layers != verifier.num_layers:
            raise MaskError(f"mask has {mask.num_layers} entries but the verifier has {verifier.num_layers} layers")
        cache_policy = CachePolicy(cache_policy)
        self.kv_bytes_per_token = kv_bytes_per_token(verifier, drafter, mask, cache_policy)
        kv_block_size = kv_block_size or None  # 0: slot rows
        limits = [getattr(m.config, "max_position_embeddings", None) for m in (verifier, drafter) if m is not None]
        context, context_name, blocks = kv_capacity(
            self.kv_bytes_per_token,
            verifier.device,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            kv_cache_gib=kv_cache_gib,
            model_context=context_limit(*limits, max_context),
            max_context=max_context,
            block_size=kv_block_size,
        )
        capacity = Capacity(max_batch, context, prefill_chunk, kv_block_size, blocks, prefix_caching, paged_attention)
        executor = LocalExecutor(verifier, drafter, mask, cache_policy, capacity, cost_cache_dir=cost_cache_dir)
        self._start(executor, capacity, eos_token_ids, context_name, costs, gates, thread=model_thread.MODELS)
        self.verifier, self.drafter, self.mask, self.cache_policy = verifier, drafter, mask, cache_policy

    @classmethod
    def over(
        cls,
        executor: Executor,
        capacity: Capacity,
        *,
        eos_token_ids: Sequence[int] = (),
        context_name: str = "max_context",
        costs: CostModel | None = None,
        gates: Gates | None = None,
        drafter_fallback: bool = False,
    ) -> Engine:
        """An engine on any executor (served: viasd.actors.coordinator.ServedExecutor), whose
        sides hold `capacity` each; `drafter_fallback`: a row whose drafter fails goes on as `ar`.
        Its steps run on a thread of its own (they wait on the executor, not on models here)."""
        engine = cls.__new__(cls)
        thread = model_thread.Worker("viasd-engine")
        engine._start(executor, capacity, eos_token_ids, context_name, costs, gates, drafter_fallback, thread)
        engine.verifier = engine.drafter = engine.mask = engine.cache_policy = None
        engine.kv_bytes_per_token = None
        return engine

    def _start(
        self, executor, capacity, eos_token_ids, context_name, costs, gates, drafter_fallback=False, thread=None
    ) -> None:
        self.executor = executor
        self.thread = thread  # where its steps run, one after the other (viasd.model_thread)
        self.capacity = capacity
        self.max_context = capacity.max_seq_len
        self.gates = gates  # `via` requests that choose no gate get these (calibrated for the mask; viasd.gates)
        self.eos_token_ids = tuple(eos_token_ids)
        self.scheduler = Scheduler(
            executor,
            capacity,
            eos_token_ids=self.eos_token_ids,
            context_name=context_name,
            costs=costs if costs is not None else executor.costs,  # `auto`: profiled on first use
            drafter_fallback=drafter_fallback,
        )

    @property
    def costs(self) -> CostModel | None:
        """The cost curves `auto` plans with (viasd.costs), None until an `auto` request needed them."""
        return self.scheduler.cost_model

    def cost_model(self) -> CostModel:
        """The forward cost curves of every tier (viasd.costs; profiled on first use where the tiers run)."""
        return self.scheduler.costs()

    def planner_state(self) -> dict:
        """What `auto` plans with now: the cost model (None until profiled) and the engine-wide
        running acceptance (model and n-gram drafts per position; via tokens and escalation), and the
        probe steps run and its forecasts (viasd.planner.Planner)."""
        return {
            "costs": self.costs.summary() if self.costs is not None else None,
            **self.scheduler.estimates.to_dict(),
            **self.scheduler.planner.to_dict(),
        }

    # ---------------------------------------------------------------- driving steps

    def submit(self, prompt_ids: Sequence[int], params: GenerationParams) -> RequestHandle:
        """Queue a request (validated: InvalidParameterError naming the field); steps produce its chunks.
        A three-tier request that sets none of alpha1 / alpha2 / region_b gets the engine's gates."""
        if self.gates is not None and isinstance(params, GenerationParams):
            params = self.gates.apply(params)
        return self.scheduler.submit(prompt_ids, params)

    def step(self) -> list[tuple[RequestHandle, Chunk]]:
        """Run one engine step (viasd.scheduler) for every request, on the engine's step thread (in
        process the model thread, viasd.model_thread: every step of the process runs there, one
        after the other); the chunks it committed."""
        return self.thread.run(self.scheduler.step)

    def _step_for(self, live: list[RequestHandle]) -> None:
        """On the step thread, for a `follow`er: one step, unless a step that ran since it looked
        (another follower's) already gave one of its requests a chunk or an end."""
        if any(h.chunks for h in live) or all(h.finished for h in live):
            return
        try:
            self.scheduler.step()
        except Exception:  # noqa: BLE001 - delivered through the handles it failed
            if all(h.error is None for h in live):
                raise

    def cancel(self, handle: RequestHandle) -> None:
        self.scheduler.cancel(handle)

    # ---------------------------------------------------------------- public API

    def generate(self, prompt_ids: Sequence[int], params: GenerationParams) -> Iterator[Chunk]:
        """Stream the committed tokens of one request, chunk by chunk; the last chunk has the stats.

        Callers on several threads share the steps: each asks the step thread for a step, which
        runs them in turn, one for every request, so a caller whose request got a chunk from
        another's step takes it without stepping again. Closing the iterator early cancels the
        request. n > 1: the chunks of every sample, interleaved as steps commit them
        (`chunk.index` says whose); each sample's last chunk has its finish reason and stats.
        """
        yield from self.follow(self.submit(prompt_ids, params).samples)

    def follow(self, samples: Sequence[RequestHandle]) -> Iterator[Chunk]:
        """`generate` for submitted requests (the samples of one request): their chunks as steps
        commit them, stepping the engine while none is ready. Closing it cancels what is unfinished."""
        live = list(samples)
        try:
            while live:
                for handle in list(live):
                    while handle.chunks:
                        chunk = handle.chunks.popleft()
                        yield chunk
                        if chunk.finished:
                            live.remove(handle)
                            break
                    else:
                        if handle.error is not None:
                            raise handle.error
                        if handle.finished:
                            live.remove(handle)
                if not live:
                    return
                # (first come, first served: a thread that just stepped queues behind the others,
                # so no caller's chunks pile up undelivered while another keeps stepping)
                self.thread.run(self._step_for, live)
        finally:
            for handle in samples:
                if not handle.finished:
                    self.cancel(handle)
            if any(h.cancelled for h in samples):  # (closed here, or by the caller: a stop string)
                self.thread.run(self.scheduler.reap)  # their rows go now, not at the next step (there may be none)

    def complete(self, prompt_ids: Sequence[int], params: GenerationParams) -> GenerationResult:
        """Run a request to the end and return all of its tokens (n = 1; `complete_n` for n > 1)."""
        if params.n != 1:
            raise InvalidParameterError("n", f"complete() returns one sample; use complete_n() for n={params.n}")
        return self.complete_n(prompt_ids, params)[0]

    def complete_n(self, prompt_ids: Sequence[int], params: GenerationParams) -> list[GenerationResult]:
        """Run a request to the end: the n samples' results, in sample order."""
        results = [
            GenerationResult(list(prompt_ids), [], "", None, [] if params.logprobs is not None else None, index=i)
            for i in range(params.n)
        ]
        for chunk in self.generate(prompt_ids, params):
            res = results[chunk.index]
            res.token_ids.extend(chunk.token_ids)
            if res.logprobs is not None:
                res.logprobs.extend(chunk.logprobs or ())
            if chunk.prompt_logprobs is not None:
                res.prompt_logprobs = chunk.prompt_logprobs
            if chunk.finished:
                res.finish_reason, res.stats = chunk.finish_reason, chunk.stats
        return results

    def close(self) -> None:
        """Close the executor's connections (served); nothing to stop in process."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()


class AsyncEngine:
    """An engine's requests as asyncio streams: the backend the request handler drives
    (viasd.cluster.handler), in process and served alike.

    A request is validated and queued on the caller's loop (InvalidParameterError naming the
    field); every `next()` of its stream runs on the engine's step thread (in process the model
    thread, viasd.model_thread; served, a thread that makes the step's RPCs): one engine step for
    every request in flight unless this stream already has a chunk waiting, so concurrent
    streams decode together and the event loop never blocks.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._pool = engine.thread.executor()  # (where the engine's steps run, one after the other)
        self._samples: dict[str, list[RequestHandle]] = {}  # a running request's sample handles, by its id

    def active_requests(self) -> int:
        return len(self._samples)

    def planner_state(self) -> dict:
        return self.engine.planner_state()

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: GenerationParams
    ) -> AsyncIterator[Chunk]:
        """The request's chunks (n > 1: every sample's, interleaved; `chunk.index` says whose),
        until every sample has finished; closing the stream cancels what is unfinished."""
        if not request_id:
            raise InvalidParameterError("request_id", "must not be empty")
        if request_id in self._samples:
            raise InvalidParameterError("request_id", f"{request_id!r} is already running")
        samples = self.engine.submit(list(prompt_ids), params).samples  # validated here (field named)
        loop = asyncio.get_running_loop()
        it = self.engine.follow(samples)
        self._samples[request_id] = samples
        try:
            while True:
                chunk = await loop.run_in_executor(self._pool, next, it, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            self._samples.pop(request_id, None)
            unfinished = [h for h in samples if not h.finished]
            for handle in unfinished:  # (also when its first step never started: `it` holds nothing then)
                self.engine.cancel(handle)
            if unfinished:  # their rows are released on the step thread before the stream ends
                await asyncio.shield(asyncio.wrap_future(self._pool.submit(self._close, it)))

    def _close(self, stream: Iterator[Chunk]) -> None:
        stream.close()
        self.engine.scheduler.reap()

    def stop_sample(self, request_id: str, index: int) -> None:
        """End one sample of a running request early (a stop string in its text): it leaves at the
        next step boundary; the others go on."""
        samples = self._samples.get(request_id, ())
        if 0 <= index < len(samples):
            self.engine.cancel(samples[index])

    def close(self) -> None:
        """Close the engine's executor (a stream still open closes its request on the step thread)."""
        self._pool.submit(self.engine.close)
