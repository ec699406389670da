"""Continuous batching: the one step loop. Each step advances every running request by one cycle
of its mode, on an executor (viasd.executor: the models in this process, or the served actors).

    step():
      0. preempt    paged caches: every running request must be able to grow by what this step may
                    append in every tier; while the blocks they need exceed the cache's, the one
                    admitted last is preempted: its blocks go back, it waits at the head of the
                    queue with what it has produced, and is resumed by recomputing its caches;
      1. admit      waiting requests take free cache rows, and with paged caches the blocks their
                    sequence and one step's growth need (FIFO; a full engine queues, never fails);
      2. prefill    admitted requests open their sessions (resumed ones kept theirs); prompts (and
                    resumed requests' committed tokens) go through every tier they use, at most
                    `prefill_chunk` tokens per step in all (chunked prefill); the samples of an
                    n > 1 request copy sample 0's rows; preempted requests' caches roll back to 0;
      3. plan       every row's plan this step: its own mode's, or the planner's for `auto` rows;
      4. propose    one propose phase over the drafting rows (one batched drafter forward per
                    round; a row leaves when its block ends: confidence stop, n-gram, adaptive gamma);
      5. verify     one verify phase over every row: one batched slim forward over the `via` rows,
                    one batched full forward over the `ar` rows, the `sd` blocks and the escalated
                    `via` rows; each row's rule with its own random stream;
      6. commit     per row: learn, cut at stop tokens / max_tokens / the context, stream the
                    chunk; rows that finished leave, and their cache rows are released at the
                    end of the step, so the next step can admit in their place.

`ar`, `sd`, `via` and `auto` requests, each with its own parameters, share one batch. Every
request owns its random generators and its cache rows, and a batched forward computes each row as
it would alone (viasd.runtime), so batch composition never changes a request's tokens. The
per-request cycle lives in viasd.sessions; this module decides what runs together and when. It
imports neither Ray nor gRPC: served, the same loop drives the actors through
viasd.actors.coordinator.ServedExecutor.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from viasd.config import GenerationParams, Mode, Proposer
from viasd.costs import CostModel, StepTimes
from viasd.errors import BackendError, CapacityError, InvalidParameterError
from viasd.executor import (
    Capacity,
    Copy,
    Executor,
    Open,
    PrefillBatch,
    PrefillChunk,
    Proposal,
    ProposeRow,
    VerifyRow,
)
from viasd.metrics import RequestStats, TokenLogprob
from viasd.planner import Estimates, Plan, Planner, RowState, fixed_plan, learn_cycle, logit_rows
from viasd.proposers import ngram_lookup
from viasd.sessions import Outcome, drafter_lag, sample_seed

log = logging.getLogger("viasd.scheduler")

__all__ = ["Capacity", "Chunk", "GenerationResult", "RequestHandle", "RequestLimits", "Scheduler", "step_growth"]

KV_WATERMARK = 0.01  # paged caches: the share of blocks admission keeps free while requests run (their growth's slack)


@dataclass
class Chunk:
    """Tokens committed by one step of a request; the last chunk carries the finish reason and stats."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" when finished
    stats: RequestStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first chunk only (params.prompt_logprobs)
    index: int = 0  # which sample of an n > 1 request

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    """The whole output of a request."""

    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per generated token (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # None first, then one per prompt token
    index: int = 0  # which sample of an n > 1 request


# ---------------------------------------------------------------- request checks and limits


def context_limit(*limits: int | None) -> int | None:
    """The context a request may fill: the smallest of the given limits (models' position
    embeddings, a configured cap, the cache rows' length), None when none is known."""
    known = [int(x) for x in limits if x]
    return min(known) if known else None


def check_request(
    prompt_ids: Sequence[int],
    params: GenerationParams,
    *,
    vocab_size: int,
    max_context: int | None,
    has_drafter: bool,
    proposes: bool = True,
    context_name: str = "max_context",
) -> list[int]:
    """Validate one request (InvalidParameterError naming the field); return the prompt as ints.
    `has_drafter`: a drafter model is loaded; `proposes`: drafts can be proposed at all (the
    n-gram lookup runs where the drafter does). `context_name` names the limit that sets
    `max_context` in the error a too-long prompt gets."""
    if not isinstance(params, GenerationParams):
        raise InvalidParameterError("params", f"expected GenerationParams, got {type(params).__name__}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise InvalidParameterError("prompt", "must contain at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidParameterError("prompt", f"token ids {bad[:5]} outside the vocabulary (size {vocab_size})")
    if max_context is not None and len(prompt) >= max_context:
        raise InvalidParameterError(
            "prompt", f"{len(prompt)} tokens leave no room in the context of {max_context} ({context_name})"
        )
    bad = sorted(t for t in params.logit_bias or () if t >= vocab_size)
    if bad:
        raise InvalidParameterError("logit_bias", f"token ids {bad[:5]} outside the vocabulary (size {vocab_size})")
    if params.mode not in (Mode.AR, Mode.AUTO) and not (
        proposes and (has_drafter or params.proposer == Proposer.NGRAM)
    ):
        raise InvalidParameterError(
            "mode", f"mode {params.mode.value!r} needs a drafter (or proposer 'ngram'); none is loaded"
        )
    return prompt


def resolve_seed(params: GenerationParams) -> int:
    """The request's seed, or a fresh random one when it has none."""
    return params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)


def step_growth(params: GenerationParams) -> int:
    """Positions past its committed sequence a request's caches may hold during one step, in any
    tier: `ar` feeds its last token (1); a drafting mode a block of up to gamma tokens, the bonus
    and the staged rule's corrected token (gamma + 2), and with `overlap` the next block drafted
    ahead beside the verification (gamma more). A cache holds no more from the step before: each
    step commits at least one token."""
    if params.mode == Mode.AR:
        return 1
    return 2 * params.gamma + 2 if params.overlap else params.gamma + 2


def draft_length(gamma: int, remaining: int, seq_len: int, max_context: int | None) -> int:
    """Tokens to draft this cycle: gamma, cut to the tokens still allowed and to the context
    (the verifier scores k + 1 positions past the prefix of seq_len tokens); at least 1."""
    k = max(1, min(gamma, remaining))
    if max_context is not None:
        k = max(1, min(k, max_context - seq_len - 1))
    return k


class RequestLimits:
    """Stop tokens, max_tokens and the context limit of one request, applied to what each cycle commits."""

    def __init__(
        self,
        params: GenerationParams,
        prompt_len: int,
        max_context: int | None,
        eos_token_ids: Sequence[int],
        stats: RequestStats,
    ):
        self.params = params
        self.max_context = max_context
        self.stats = stats  # generated_tokens, time_to_first_token, finish_reason, total_seconds are kept here
        self.budget = params.max_tokens if max_context is None else min(params.max_tokens, max_context - prompt_len)
        self.stops = tuple(params.stop_token_ids if params.stop_token_ids is not None else eos_token_ids)
        self.t_start = time.perf_counter()

    @property
    def remaining(self) -> int:
        """New tokens still allowed."""
        return self.budget - self.stats.generated_tokens

    def draft_length(self, seq_len: int) -> int:
        return draft_length(self.params.gamma, self.remaining, seq_len, self.max_context)

    def chunk(self, new: list[int], logprobs: list[TokenLogprob] | None = None) -> Chunk:
        """Cut a cycle's committed tokens (and their logprobs) at the first stop token and at the
        budget; the chunk to stream."""
        stats, finish = self.stats, None
        if not self.params.ignore_eos and self.stops:
            cut = next((j for j, t in enumerate(new) if t in self.stops), None)
            if cut is not None:
                new, finish = new[: cut + 1], "stop"
        produced = stats.generated_tokens + len(new)
        if produced >= self.budget:
            new, finish = new[: len(new) - (produced - self.budget)], finish or "length"
        if stats.time_to_first_token is None and new:
            stats.time_to_first_token = time.perf_counter() - self.t_start
        stats.generated_tokens += len(new)
        logprobs = None if logprobs is None else logprobs[: len(new)]
        if finish is None:
            return Chunk(new, logprobs=logprobs)
        stats.finish_reason = finish
        stats.total_seconds = time.perf_counter() - self.t_start
        return Chunk(new, finish, stats, logprobs=logprobs)


# ---------------------------------------------------------------- the scheduler


class RequestHandle:
    """One submitted request: its chunks as steps commit them, its state, its error if one."""

    _ids = itertools.count()

    def __init__(
        self, prompt: list[int], params: GenerationParams, limits: RequestLimits, stats: RequestStats, index: int = 0
    ):
        self.id = next(self._ids)
        self.key = str(self.id)  # how the executor knows it
        self.index = index  # sample index of an n > 1 request
        self.samples: list[RequestHandle] = [self]  # n > 1: every sample's handle (this one first)
        self.prompt = prompt
        self.params = params
        self.limits = limits
        self.stats = stats
        self.chunks: deque[Chunk] = deque()
        self.finished = False  # the last chunk has been produced (or the request failed / was cancelled)
        self.cancelled = False
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()

    def __repr__(self) -> str:
        return f"RequestHandle(id={self.id}, mode={self.params.mode.value}, finished={self.finished})"


@dataclass(eq=False)
class _Running:
    """A request holding cache rows: its committed sequence, how far its prompt is prefilled,
    what the planner knows of it."""

    handle: RequestHandle
    seq: list[int]  # the prompt and the committed tokens
    drafts: bool  # it has a drafter side that works (every mode but `ar`, until a served drafter fails)
    target: int  # positions to prefill before it decodes: the prompt but its last token (resumed: the sequence's)
    fed: int = 0  # positions prefilled (`target`: done)
    opened: bool = False  # its sessions exist on the executor
    estimates: Estimates | None = None  # `auto`: what each plan buys this request (viasd.planner)
    leader: _Running | None = None  # n > 1: the sample whose prefill this one copies
    feed_drafter: bool = True  # its drafter prefills with the prompt (`auto`: when planned to draft at once)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None], then one per scored prompt token
    prompt_sent: bool = False  # the prompt logprobs went out (on the first chunk)

    @property
    def key(self) -> str:
        return self.handle.key

    @property
    def prefilled(self) -> bool:
        return self.fed >= self.target


class Scheduler:
    """Queues requests, admits them into cache rows, and runs engine steps on an executor (module docstring).

    `drafter_fallback`: a row whose drafter failed (served: its actor is down) goes on as `ar`
    (its verifier side is consistent) instead of failing.

    Paged caches (`capacity.kv_blocks`): the scheduler counts for each running request the most
    blocks it holds in a tier through its next step (`kv_blocks_for`: its sequence and one step's
    growth) and keeps their sum (`kv_blocks_needed`) within the blocks each tier has, so no forward
    ever finds its pool full. Admission takes the head of the queue while the sum leaves a small
    watermark free; before each step, while the sum exceeds the blocks, the request admitted last
    is preempted (vLLM's recompute preemption). A preempted request keeps its sessions on the
    executor (its random streams, drafter state and counters go on as if it had never stopped)
    and gives back every block (a prefill chunk to 0); resumed from the head of the queue, its
    prompt and committed tokens are prefilled again and it decodes on: its tokens are the ones it
    would have produced. A request that cannot fit alone is refused at submission (CapacityError).
    """

    def __init__(
        self,
        executor: Executor,
        capacity: Capacity,
        *,
        eos_token_ids: Sequence[int],
        context_name: str = "max_context",
        costs: CostModel | Callable[[], CostModel] | None = None,
        drafter_fallback: bool = False,
    ):
        self.executor = executor
        self.capacity = capacity
        self.kv_watermark = math.ceil(KV_WATERMARK * capacity.kv_blocks) if capacity.kv_blocks else 0
        self.preemptions = 0  # requests preempted so far (paged caches)
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_context = capacity.max_seq_len  # the context a request may fill (`context_name` names its limit)
        self.context_name = context_name
        self.drafter_fallback = drafter_fallback
        self._waiting: deque[RequestHandle] = deque()
        self._running: list[_Running] = []  # in the order they were admitted (or resumed)
        self._suspended: dict[RequestHandle, _Running] = {}  # preempted, waiting in the queue with their sessions
        self._preempted: list[_Running] = []  # preempted this step: their caches roll back in its prefill phase
        self._left: list[_Running] = []  # left this step: their rows are released at its end
        self._lock = threading.Lock()  # guards _waiting and cancellation; steps run one at a time (Engine.thread)
        # engine-wide running estimates: the prior of new `auto` requests
        self.estimates = Estimates(population=True)
        self.planner = Planner()  # `auto`'s plans, step after step
        self._costs = costs  # the profiled cost curves, or a function that profiles them on first use

    # ---------------------------------------------------------------- requests

    def submit(self, prompt_ids: Sequence[int], params: GenerationParams) -> RequestHandle:
        """Validate a request and queue it (InvalidParameterError naming the field).

        n > 1: n requests of one sample each, sample i seeded `sample_seed(seed, i)`, queued
        together; the first prefills the prompt and the others copy its cache rows. The handle
        returned is sample 0's; `handle.samples` lists all n.
        """
        prompt = self.check(prompt_ids, params)
        self._check_fits_alone(prompt, params)
        samples = [params]
        if params.n > 1:
            seed = resolve_seed(params)
            samples = [params.model_copy(update={"n": 1, "seed": sample_seed(seed, i)}) for i in range(params.n)]
        handles = []
        for i, sample in enumerate(samples):
            stats = RequestStats(mode=sample.mode.value, prompt_tokens=len(prompt))
            limits = RequestLimits(sample, len(prompt), self.max_context, self.eos_token_ids, stats)
            handles.append(RequestHandle(prompt, sample, limits, stats, index=i))
        for h in handles:
            h.samples = handles
        with self._lock:
            self._waiting.extend(handles)
        return handles[0]

    def check(self, prompt_ids: Sequence[int], params: GenerationParams) -> list[int]:
        """A request checked against this engine (`check_request`; InvalidParameterError naming the
        field), before it is queued: its prompt as ints."""
        return check_request(
            prompt_ids,
            params,
            vocab_size=self.executor.vocab_size,
            max_context=self.max_context,
            has_drafter=self.executor.has_drafter,
            proposes=self.executor.proposes,
            context_name=self.context_name,
        )

    def _check_fits_alone(self, prompt: list[int], params: GenerationParams) -> None:
        """Paged caches: a request whose last step may need more blocks than a tier has is refused
        (CapacityError naming `kv_blocks`); any other one runs, alone if it must."""
        blocks = self.capacity.kv_blocks
        if blocks is None:
            return
        budget = (
            params.max_tokens if self.max_context is None else min(params.max_tokens, self.max_context - len(prompt))
        )
        most = self.kv_blocks_for(len(prompt) + max(0, budget - 1), params)
        if most > blocks:
            raise CapacityError(
                "kv_blocks",
                f"a prompt of {len(prompt)} tokens with max_tokens {params.max_tokens} may hold {most} KV blocks "
                f"of {self.capacity.block_size} positions; each tier has {blocks}",
            )

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request: it leaves at the next step boundary and frees its rows."""
        with self._lock:
            handle.cancelled = True
            handle.finished = True

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def num_preempted(self) -> int:
        """Preempted requests waiting to resume (counted in `num_waiting` too)."""
        return len(self._suspended)

    @property
    def cost_model(self) -> CostModel | None:
        """The cost curves `auto` plans with, None until an `auto` request needed them."""
        return self._costs if isinstance(self._costs, CostModel) else None

    def costs(self) -> CostModel:
        """The cost curves `auto` plans with (profiled on first use when given as a function)."""
        if callable(self._costs):
            self._costs = self._costs()
        if self._costs is None:
            raise InvalidParameterError("mode", "mode 'auto' needs the engine's cost model; none was given")
        return self._costs

    # ---------------------------------------------------------------- the step

    def step(self) -> list[tuple[RequestHandle, Chunk]]:
        """One engine step (module docstring); the chunks it committed, per request.

        Not reentrant: one caller at a time (Engine serialises its callers). If the executor
        raises, every request of the step gets the error on its handle, leaves, and the error
        propagates; a row that failed alone (a `BackendError` in its place) leaves alone.
        """
        self._retire_cancelled()
        self._release()  # (the cancelled ones' rows: free before admitting in their place)
        self._preempt()
        batch = self._admit()
        try:
            self._prefill(batch)
            return self._finish_scored() + self._decode()
        except BaseException as exc:
            for r in [*self._running, *self._preempted]:  # (a preempted one's caches may not have rolled back)
                self._fail(r, exc)
            raise
        finally:
            self._preempted = []
            self._release()

    def reap(self) -> None:
        """Release the rows of cancelled requests now, between steps (an idle engine takes no
        next step to do it). On the step thread, as steps are."""
        self._retire_cancelled()
        self._release()

    def _retire_cancelled(self) -> None:
        with self._lock:
            cancelled = [h for h in self._waiting if h.cancelled]
            self._waiting = deque(h for h in self._waiting if not h.cancelled)
        for handle in cancelled:  # a preempted one still holds its sessions
            r = self._suspended.pop(handle, None)
            if r is not None and r.opened:
                self._left.append(r)
        for r in [r for r in self._running if r.handle.cancelled]:
            self._leave(r)

    # ---------------------------------------------------------------- KV blocks: admission and preemption

    def kv_blocks_for(self, seq_len: int, params: GenerationParams) -> int:
        """Paged caches: the most blocks a request whose sequence (prompt and committed tokens) is
        `seq_len` long holds in any one tier through its next step (0: slot caches): its sequence
        and one step's growth (`step_growth`), within a row's positions. An upper bound, CoW
        included: n > 1 samples sharing prompt blocks count them each."""
        if self.capacity.kv_blocks is None:
            return 0
        positions = seq_len + step_growth(params)
        if self.capacity.max_seq_len is not None:
            positions = min(positions, self.capacity.max_seq_len)
        return -(-positions // self.capacity.block_size)

    def _blocks(self, r: _Running) -> int:
        return self.kv_blocks_for(len(r.seq), r.handle.params)

    @property
    def kv_blocks_needed(self) -> int:
        """Paged caches: the blocks the running requests may hold in a tier through the next step
        (the sum of `kv_blocks_for`): every tier's pool holds at most this many in use."""
        return sum(self._blocks(r) for r in self._running)

    def _preempt(self) -> None:
        """Paged caches: while the running requests' next step may need more blocks than a tier
        has, preempt the one admitted (or resumed) last; the first one always fits alone."""
        blocks = self.capacity.kv_blocks
        if blocks is None:
            return
        needed = self.kv_blocks_needed
        while needed > blocks and len(self._running) > 1:
            r = self._running[-1]
            needed -= self._blocks(r)
            self._suspend(r)

    def _suspend(self, r: _Running) -> None:
        """Preempt a running request: its caches roll back to nothing in this step's prefill phase
        (its sessions stay open), and it waits at the head of the queue to be resumed by
        prefilling its prompt and committed tokens again."""
        self._running.remove(r)
        r.fed, r.target, r.leader = 0, len(r.seq) - 1, None
        r.handle.stats.preemptions += 1
        self.preemptions += 1
        self._suspended[r.handle] = r
        if r.opened:
            self._preempted.append(r)
        with self._lock:
            self._waiting.appendleft(r.handle)
        log.debug("request %s preempted with %d tokens in its sequence", r.key, len(r.seq))

    def _fits(self, handle: RequestHandle, needed: int) -> bool:
        """Paged caches: whether the head of the queue may join running requests that need `needed`
        blocks: its own (its prompt, or resumed its sequence, and one step's growth) leave the
        watermark free, or nothing runs (a request that fits alone always runs)."""
        blocks = self.capacity.kv_blocks
        if blocks is None:
            return True
        r = self._suspended.get(handle)
        own = self.kv_blocks_for(len(r.seq) if r is not None else len(handle.prompt), handle.params)
        return needed + own <= blocks - (self.kv_watermark if self._running else 0)

    def _admit(self) -> PrefillBatch:
        """Waiting requests, first come first served, into free rows (and, paged, free blocks:
        `_fits`; none in a step that preempted); preempted ones, at the head of the queue, resume
        with their sessions; the prefill batch opens the others."""
        admitted = []
        needed = self.kv_blocks_needed
        while len(self._running) < self.capacity.max_batch and not self._preempted:
            with self._lock:
                if not self._waiting or not self._fits(self._waiting[0], needed):
                    break  # (the head of the queue waits for blocks)
                handle = self._waiting.popleft()
            resumed = self._suspended.pop(handle, None)
            if resumed is not None:
                self._running.append(resumed)
                admitted.append(resumed)
                needed += self._blocks(resumed)
                continue
            handle.stats.queue_seconds = time.perf_counter() - handle.submitted
            params = handle.params
            r = _Running(
                handle,
                list(handle.prompt),
                drafts=params.mode != Mode.AR and self.executor.proposes,
                target=len(handle.prompt) - 1,
                estimates=Estimates(self.estimates) if params.mode == Mode.AUTO else None,
                prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            )
            if handle.index > 0:  # an n > 1 sample: prefilled from sample 0's rows while that one runs
                r.leader = next((x for x in self._running if x.handle is handle.samples[0]), None)
            self._running.append(r)
            admitted.append(r)
            needed += self._blocks(r)
        new = [r for r in admitted if not r.opened]
        for r in new:  # `auto`: with the batch they join known (a sample: as its leader, whose prefill it copies)
            if r.handle.params.mode == Mode.AUTO:
                model = self.executor.has_drafter and r.handle.params.proposer != Proposer.NGRAM
                r.feed_drafter = r.leader.feed_drafter if r.leader else model and self._drafts_at_once(r)
        opens = [Open(r.key, r.handle.prompt, r.handle.params, resolve_seed(r.handle.params), r.drafts) for r in new]
        return PrefillBatch(opens=opens)

    def _leave(self, r: _Running) -> None:
        """The request leaves the batch; its rows are released at the end of the step."""
        self._running.remove(r)
        r.handle.finished = True
        if r.opened:
            self._left.append(r)

    def _fail(self, r: _Running, exc: BaseException) -> None:
        """The request fails (running, or preempted and waiting to resume) and leaves."""
        if r in self._running:
            r.handle.error = exc
            self._leave(r)
        elif self._suspended.get(r.handle) is r:
            del self._suspended[r.handle]
            with self._lock:
                if r.handle in self._waiting:
                    self._waiting.remove(r.handle)
            r.handle.error, r.handle.finished = exc, True
            if r.opened:
                self._left.append(r)

    def _release(self) -> None:
        """Free the rows of the requests that left this step; each side's counters join their stats."""
        left, self._left = self._left, []
        if not left:
            return
        counters = self.executor.release([r.key for r in left])
        for r in left:
            if r.key in counters:
                r.handle.stats.add_counters(counters[r.key])

    def _prefill(self, batch: PrefillBatch) -> None:
        """Chunked prefill: the prompt but its last token, at most prefill_chunk tokens per step;
        n > 1 samples copy their leader's rows once it is prefilled."""
        budget = self.capacity.prefill_chunk
        batch.chunks += [PrefillChunk(r.key, 0, r.drafts) for r in self._preempted]  # (before any forward)
        for r in self._running:
            if r.leader is not None and r.leader not in self._running:
                r.leader = None  # sample 0 has left (or was preempted): this sample prefills itself
            if r.prefilled or r.leader is not None or budget <= 0:
                continue
            upto = min(r.target, r.fed + budget)
            # an `auto` request's drafter catches up when a plan drafts, unless planned to draft at once (viasd.planner)
            batch.chunks.append(PrefillChunk(r.key, upto, r.drafts and r.feed_drafter))
            budget -= upto - r.fed
            r.fed = upto
        copies = [r for r in self._running if r.leader is not None and r.leader.prefilled and not r.prefilled]
        batch.copies = [Copy(r.key, r.leader.key) for r in copies]
        if not batch:
            return
        opening = {o.key for o in batch.opens}
        for r in self._running:
            r.opened = r.opened or r.key in opening
        results = self.executor.prefill(batch)
        for r in [*self._running, *self._preempted]:
            result = results.get(r.key)
            if isinstance(result, BaseException):
                self._row_failed(r, result)
            elif result is not None:
                if r.prompt_logprobs is not None:
                    r.prompt_logprobs += result.logprobs
                if r in self._running and r.leader is None:  # a cached prefix attached: prefill goes on past it
                    r.fed = max(r.fed, min(result.held, r.target))
        for r in copies:
            if r.prompt_logprobs is not None:
                r.prompt_logprobs = list(r.leader.prompt_logprobs)
            r.fed, r.leader = r.target, None

    def _finish_scored(self) -> list[tuple[RequestHandle, Chunk]]:
        """Prefilled requests with no tokens to generate (max_tokens 0: prompt logprobs only) end here."""
        out = []
        for r in [r for r in self._running if r.prefilled and r.handle.limits.remaining <= 0]:
            out.append(self._deliver(r, r.handle.limits.chunk([])))
        return out

    def _deliver(self, r: _Running, chunk: Chunk) -> tuple[RequestHandle, Chunk]:
        """Stream a chunk of a request (the first carries the prompt logprobs); it leaves when finished."""
        chunk.index = r.handle.index
        if r.prompt_logprobs is not None and not r.prompt_sent:
            chunk.prompt_logprobs, r.prompt_sent = r.prompt_logprobs, True
        with self._lock:
            if not r.handle.cancelled:
                r.handle.chunks.append(chunk)
        if chunk.finished:
            self._leave(r)
        return r.handle, chunk

    def _row_failed(self, r: _Running, exc: BaseException) -> None:
        """A row that failed alone: its drafter (it goes on as `ar`, with `drafter_fallback`) or
        its verifier (it fails)."""
        drafter = isinstance(exc, BackendError) and exc.component == "drafter"
        if drafter and self.drafter_fallback and (r in self._running or self._suspended.get(r.handle) is r):
            log.warning("request %s: drafter failed (%s); continuing as 'ar'", r.key, exc)
            r.drafts = False
            r.handle.stats.drafter_fallback = True
            return
        self._fail(r, exc)

    def _decode(self) -> list[tuple[RequestHandle, Chunk]]:
        """Steps 3-6 over every prefilled request: plan (auto rows), propose, verify, commit."""
        rows = [r for r in self._running if r.prefilled]
        if not rows:
            return []
        t0, times = time.perf_counter(), StepTimes()  # the step's forwards and each row's work (the cost model's)
        plans = dict(zip(rows, self._plans(rows)))
        drafting = [r for r in rows if plans[r].kind != "ar"]
        proposals: dict[_Running, Proposal] = {}
        if drafting:
            results = self.executor.propose([ProposeRow(r.key, plans[r].k, plans[r].proposer) for r in drafting], times)
            for r, result in zip(drafting, results):
                if isinstance(result, BaseException):
                    self._row_failed(r, result)
                    plans[r] = Plan("ar")
                else:
                    proposals[r] = result
        rows = [r for r in rows if r in self._running]
        checks = [
            VerifyRow(r.key, *proposals[r], plans[r].kind if r.estimates is not None else "")
            if r in proposals
            else VerifyRow(r.key, [], None, "")
            for r in rows
        ]
        out, kinds = [], {}
        for r, outcome in zip(rows, self.executor.verify(checks, times)):
            if isinstance(outcome, BaseException):
                self._row_failed(r, outcome)
                continue
            r.seq.extend(outcome.tokens)
            self._learn(r, plans[r], proposals.get(r), outcome)
            kinds[r.key] = (plans[r].kind, logit_rows(plans[r], float(outcome.escalated)))
            out.append(self._deliver(r, r.handle.limits.chunk(outcome.tokens, outcome.logprobs)))
        seconds = time.perf_counter() - t0
        self.planner.settle(seconds, sum(len(chunk.token_ids) for _, chunk in out))
        model = self.cost_model
        if model is not None:  # (a model not profiled yet: no `auto` row has run)
            for call, transport in times.transport.items():
                model.observe_transport(call, transport)
            model.observe_step(times, kinds, seconds - sum(times.transport.values()))
        return out

    def _state(self, r: _Running) -> RowState:
        """What the planner knows of a row: its own mode's plan, or an `auto` row's estimates."""
        params, gamma = r.handle.params, r.handle.limits.draft_length(len(r.seq))
        if params.mode != Mode.AUTO or not r.drafts:
            plan = fixed_plan(params.mode if r.drafts else Mode.AR, gamma)
            return RowState(fixed=plan, gamma=gamma, acceptance=self.estimates.acceptance)
        return r.estimates.row(
            gamma=gamma,
            ngram_match=len(ngram_lookup(r.seq, gamma, params.ngram_max)),
            has_drafter=self.executor.has_drafter and params.proposer != Proposer.NGRAM,
            lossy=params.auto_lossy,
            draft_lag=self.executor.draft_lag(r.key) if r.opened else drafter_lag(len(r.seq), 0),
            remaining=r.handle.limits.remaining,
        )

    def _joining(self, new: _Running | None = None) -> list[RowState]:
        """Requests still prefilling but `new` decode with the prefilled rows from the next steps:
        plans are for the batch they will run in, where they count as `ar` rows."""
        n = sum(1 for r in self._running if not r.prefilled and r is not new)
        return [RowState(fixed=Plan("ar"), gamma=0, acceptance=self.estimates.acceptance)] * n

    def _plans(self, rows: list[_Running]) -> list[Plan]:
        """This step's plan of every row: its own mode's, or the planner's for `auto` rows."""
        started = time.perf_counter()
        states = [self._state(r) for r in rows]
        if all(s.fixed is not None for s in states):
            return [s.fixed for s in states]
        prepared = time.perf_counter() - started  # (before `costs()`: the first `auto` row's profile is no planning)
        return self.planner.plans(self.costs(), states + self._joining(), len(states), prepared)[: len(states)]

    def _drafts_at_once(self, new: _Running) -> bool:
        """Whether a new `auto` request's drafter prefills with its prompt (viasd.planner.drafts_from_the_start)."""
        batch = [self._state(r) for r in self._running if r.prefilled and r is not new] + self._joining(new)
        return self.planner.drafts_from_the_start(self.costs(), batch, self._state(new))

    def _learn(self, r: _Running, plan: Plan, proposal: Proposal | None, outcome: Outcome) -> None:
        """Update the running estimates the planner reads (the request's, and the engine-wide ones
        from every request); count the block drafted (the drafter's side may be lost: served, a
        dead actor's counters go with it) and an `auto` request's plan in its stats."""
        stats = r.handle.stats
        if proposal is not None and len(proposal.draft):
            stats.num_drafts += 1
            stats.num_draft_tokens += len(proposal.draft)
        learn_cycle(
            (self.estimates, r.estimates),
            plan,
            drafted=len(proposal.draft) if proposal is not None else 0,
            accepted=outcome.num_draft_accepted,
            committed=len(outcome.tokens),
            escalated=outcome.escalated,
            plans=stats.plans if r.handle.params.mode == Mode.AUTO else None,
        )
