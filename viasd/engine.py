"""One engine, three modes: `ar` (q alone), `sd` (p -> q, two-tier), `via` (p -> q' -> q, VIA-SD).

`Engine` holds the models, the slim verifier's mask and the continuous-batching scheduler
(viasd.scheduler); every request, in-process or through `LLM`, decodes through its steps, so
there is one decode path. The cycle itself (draft, slim verify, gate, escalate, roll back) is
in viasd.sessions, the acceptance rules in viasd.rules, the proposers in viasd.proposers.

    engine = Engine(verifier, drafter, mask=mask)
    engine.complete(prompt_ids, parse_params(mode="via"))        # one request, to the end
    for chunk in engine.generate(prompt_ids, params): ...        # streamed; threads may call
                                                                 # generate at once: they share steps
    h = engine.submit(ids, params); engine.step(); h.chunks       # driving steps yourself
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from viasd import model_thread
from viasd.config import CachePolicy, GenerationParams
from viasd.costs import CostModel, profile
from viasd.errors import InvalidParameterError, MaskError, ModelLoadError
from viasd.gates import Gates
from viasd.models.embedded import cache_root
from viasd.precision import cpu_memory
from viasd.runtime import LayerMask, MaskedLM
from viasd.scheduler import (
    Capacity,
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
    "Chunk",
    "GenerationResult",
    "RequestHandle",
    "RequestLimits",
    "Capacity",
    "check_request",
    "context_limit",
    "draft_length",
    "resolve_seed",
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


class Engine:
    """Decodes requests with a verifier q, an optional drafter p and the slim verifier q' = q masked by z.

    Capacity: `max_batch` requests decode together (cache rows per tier); each row holds up to
    `max_seq_len` positions. Without `max_seq_len`, it is what `kv_cache_gib` (default: a quarter
    of the memory available at start) holds for max_batch rows of every tier, capped by the
    models' context. Storage grows to what is used, up to that bound; requests past max_batch
    wait in the queue.
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
        costs: CostModel | None = None,
        cost_cache_dir: str | Path | None = None,
        gates: Gates | None = None,
    ):
        self.verifier = verifier
        self.drafter = drafter
        if drafter is not None and drafter.vocab_size != verifier.vocab_size:
            raise ModelLoadError(
                f"drafter vocabulary ({drafter.vocab_size}) differs from the verifier's ({verifier.vocab_size}); "
                "the pair must share a tokenizer"
            )
        self.mask = mask if mask is not None else LayerMask.evenly_spaced(skip_ratio, verifier.num_layers)
        if self.mask.num_layers != verifier.num_layers:
            raise MaskError(
                f"mask has {self.mask.num_layers} entries but the verifier has {verifier.num_layers} layers"
            )
        self.cache_policy = CachePolicy(cache_policy)
        self.gates = gates  # `via` requests that choose no gate get these (calibrated for the mask; viasd.gates)
        self.eos_token_ids = tuple(eos_token_ids)
        limits = [getattr(m.config, "max_position_embeddings", None) for m in (verifier, drafter) if m is not None]
        model_context = context_limit(*limits, max_context)
        self.kv_bytes_per_token = self._kv_bytes_per_token()
        if max_seq_len is None:
            budget = (
                kv_cache_gib * 2**30 if kv_cache_gib else DEFAULT_KV_MEMORY_FRACTION * available_memory(verifier.device)
            )
            max_seq_len = int(budget // (max_batch * self.kv_bytes_per_token))
            context_name = f"KV cache budget of {budget / 2**30:.2f} GiB for max_batch={max_batch} (kv_cache_gib)"
            if not kv_cache_gib and max_seq_len < min(model_context or MIN_DEFAULT_POSITIONS, MIN_DEFAULT_POSITIONS):
                raise ModelLoadError(
                    f"only {budget / DEFAULT_KV_MEMORY_FRACTION / 2**30:.2f} GiB of memory is free after loading the "
                    f"models: the default {context_name} holds {max_seq_len} positions per request; set "
                    "kv_cache_gib or max_seq_len, lower max_batch, or turn packed_linears off"
                )
        else:
            context_name = "max_seq_len"
        self.max_context = context_limit(model_context, max_seq_len)
        if model_context is not None and self.max_context == model_context:
            context_name = "max_context" if max_context == model_context else "the models' max_position_embeddings"
        if self.max_context is not None and self.max_context < 2:
            raise ModelLoadError(f"{context_name} leaves {self.max_context} positions per request; raise it")
        self.capacity = Capacity(max_batch=max_batch, max_seq_len=self.max_context, prefill_chunk=prefill_chunk)
        self.costs = costs  # `auto`: profiled on first use (a few seconds, cached in cost_cache_dir)
        self._cost_cache_dir = cost_cache_dir
        self.scheduler = Scheduler(
            verifier,
            drafter,
            self.mask,
            self.cache_policy,
            self.eos_token_ids,
            self.max_context,
            self.capacity,
            context_name=context_name,
            costs=costs if costs is not None else self.cost_model,
        )

    def cost_model(self) -> CostModel:
        """The forward cost curves of every tier on this device and dtype (viasd.costs; measured on
        the model thread)."""
        if self.costs is None:
            self.costs = model_thread.run(
                profile, self.verifier, self.drafter, self.mask, cache_dir=self._cost_cache_dir
            )
        return self.costs

    def planner_state(self) -> dict:
        """What `auto` plans with now: the cost model (None until profiled) and the engine-wide
        running acceptance (model and n-gram drafts per position; via tokens and escalation), and the
        probe steps run and its forecasts (viasd.planner.Planner)."""
        return {
            "costs": self.costs.summary() if self.costs is not None else None,
            **self.scheduler.estimates.to_dict(),
            **self.scheduler.planner.to_dict(),
        }

    def _kv_bytes_per_token(self) -> int:
        """KV bytes one position costs in every tier a `via` request holds."""
        total = self.verifier.kv_bytes_per_token()
        if self.cache_policy == CachePolicy.SEPARATE:
            total += self.verifier.kv_bytes_per_token(self.mask)
        if self.drafter is not None:
            total += self.drafter.kv_bytes_per_token()
        return total

    # ---------------------------------------------------------------- driving steps

    def submit(self, prompt_ids: Sequence[int], params: GenerationParams) -> RequestHandle:
        """Queue a request (validated: InvalidParameterError naming the field); steps produce its chunks.
        A three-tier request that sets none of alpha1 / alpha2 / region_b gets the engine's gates."""
        if self.gates is not None and isinstance(params, GenerationParams):
            params = self.gates.apply(params)
        return self.scheduler.submit(prompt_ids, params)

    def step(self) -> list[tuple[RequestHandle, Chunk]]:
        """Run one engine step (viasd.scheduler) for every request, on the model thread
        (viasd.model_thread: every step of the process runs there, one after the other); the chunks
        it committed."""
        return model_thread.run(self.scheduler.step)

    def _step_for(self, live: list[RequestHandle]) -> None:
        """On the model thread, for a `follow`er: one step, unless a step that ran since it looked
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

        Callers on several threads share the steps: each asks the model thread for a step, which
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
                model_thread.run(self._step_for, live)
        finally:
            for handle in samples:
                if not handle.finished:
                    self.cancel(handle)

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
        self.scheduler.close()
