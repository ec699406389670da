"""Continuous batching: one engine step advances every running request by one cycle of its mode.

    step():
      1. admit      waiting requests take free cache rows (FIFO; a full engine queues, never fails);
      2. prefill    new requests' prompts go through every tier they use, at most `prefill_chunk`
                    prompt tokens per step in all (chunked prefill), without logits (q's, with
                    prompt_logprobs); the samples of an n > 1 request copy sample 0's rows;
      3. draft      one batched drafter forward per round over the rows still drafting (a row
                    leaves when its block ends: confidence stop, n-gram, adaptive gamma);
      4. verify     one batched slim forward over the `via` rows, the gate per row, then one
                    batched full forward over the `ar` rows, the `sd` blocks and the escalated
                    `via` rows; the acceptance rules per row with the row's own random stream;
                    (`overlap` rows likely accepted whole draft their next block on a second
                    thread meanwhile: DraftSession.drafts_ahead)
      5. commit     per row: append, roll back, stream the chunk; finished rows free their cache
                    rows at once, and the next step can admit in their place.

`ar`, `sd` and `via` requests, each with its own parameters, share one batch. Every request owns
its random generators and its cache rows, and a batched forward computes each row as it would
alone (viasd.runtime), so batch composition never changes a request's tokens. The per-request
logic lives in viasd.sessions; this module only decides what runs together. It imports neither
Ray nor gRPC: the served coordinator drives the same sessions over RPC.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from viasd import model_thread
from viasd.config import CachePolicy, GenerationParams, Mode, Proposer
from viasd.costs import CostModel, StepTimes
from viasd.errors import InvalidParameterError
from viasd.metrics import RequestStats, TokenLogprob
from viasd.planner import (
    Estimates,
    Plan,
    Planner,
    RowState,
    fixed_plan,
    learn_cycle,
    logit_rows,
)
from viasd.proposers import ngram_lookup
from viasd.runtime import LayerMask, MaskedLM
from viasd.sessions import (
    DraftSession,
    Outcome,
    VerifySession,
    drive,
    execute,
    request_seeds,
    sample_seed,
    uses_slim,
)


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
# Shared by the scheduler and the distributed coordinator (viasd.actors.coordinator), so that a
# served request is validated, drafted and cut exactly like an in-process one.


def context_limit(*limits: int | None) -> int | None:
    """The context a request may fill: the smallest of the given limits (models' position
    embeddings, a configured cap), None when none is known."""
    known = [int(x) for x in limits if x]
    return min(known) if known else None


def check_request(
    prompt_ids: Sequence[int],
    params: GenerationParams,
    *,
    vocab_size: int,
    max_context: int | None,
    has_drafter: bool,
    context_name: str = "max_context",
) -> list[int]:
    """Validate one request (InvalidParameterError naming the field); return the prompt as ints.
    `context_name` names the limit that sets `max_context` in the error a too-long prompt gets."""
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
    if params.mode not in (Mode.AR, Mode.AUTO) and not has_drafter and params.proposer != Proposer.NGRAM:
        raise InvalidParameterError(
            "mode", f"mode {params.mode.value!r} needs a drafter (or proposer 'ngram'); none is loaded"
        )
    return prompt


def resolve_seed(params: GenerationParams) -> int:
    """The request's seed, or a fresh random one when it has none."""
    return params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)


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


@dataclass(frozen=True)
class Capacity:
    """How much the engine runs at once (docs/BATCHING.md, "Caches")."""

    max_batch: int  # requests decoding together = cache rows per tier
    max_seq_len: int | None  # positions per cache row (prompt + generated + one draft block); None: unbounded
    prefill_chunk: int  # prompt tokens prefilled per step, over all new requests


class RequestHandle:
    """One submitted request: its chunks as steps commit them, its state, its error if one."""

    _ids = itertools.count()

    def __init__(
        self, prompt: list[int], params: GenerationParams, limits: RequestLimits, stats: RequestStats, index: int = 0
    ):
        self.id = next(self._ids)
        self.index = index  # sample index of an n > 1 request
        self.samples: list[RequestHandle] = [self]  # n > 1: every sample's handle (this one first)
        self.prompt = prompt
        self.params = params
        self.limits = limits
        self.stats = stats
        self.chunks: deque[Chunk] = deque()
        self.finished = False  # the last chunk has been produced (or the request failed / was cancelled)
        self.cancelled = False
        self.prompt_scored = False  # the prompt logprobs have been streamed (on the first chunk)
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()

    def __repr__(self) -> str:
        return f"RequestHandle(id={self.id}, mode={self.params.mode.value}, finished={self.finished})"


@dataclass(eq=False)
class _Running:
    """A request holding cache rows: its sessions and how far its prompt is prefilled."""

    handle: RequestHandle
    verify: VerifySession
    draft: DraftSession | None
    prefilled: bool = False
    estimates: Estimates | None = None  # `auto`: what each plan buys this request (viasd.planner)
    via_seen: int = 0  # escalations counted so far
    leader: _Running | None = None  # n > 1: the sample whose prefill this one copies
    feed_drafter: bool = True  # its drafter prefills with the prompt (`auto`: when planned to draft at once)

    @property
    def sessions(self) -> list:
        return [s for s in (self.draft, self.verify) if s is not None]


class Scheduler:
    """Queues requests, admits them into cache rows, and runs engine steps (module docstring)."""

    def __init__(
        self,
        verifier: MaskedLM,
        drafter: MaskedLM | None,
        mask: LayerMask,
        cache_policy: CachePolicy,
        eos_token_ids: Sequence[int],
        max_context: int | None,
        capacity: Capacity,
        context_name: str = "max_context",
        costs: CostModel | Callable[[], CostModel] | None = None,
    ):
        self.verifier, self.drafter, self.mask = verifier, drafter, mask
        self.cache_policy = CachePolicy(cache_policy)
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_context = max_context
        self.context_name = context_name
        self.capacity = capacity
        rows, length = capacity.max_batch, capacity.max_seq_len
        self.full_store = verifier.new_store(max_rows=rows, max_len=length)
        self.slim_store = verifier.new_store(mask, max_rows=rows, max_len=length)  # separate policy only
        self.drafter_store = drafter.new_store(max_rows=rows, max_len=length) if drafter is not None else None
        self._waiting: deque[RequestHandle] = deque()
        self._running: list[_Running] = []
        self._lock = threading.Lock()  # guards _waiting and cancellation; steps run one at a time on the model thread
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
        prompt = check_request(
            prompt_ids,
            params,
            vocab_size=self.verifier.vocab_size,
            max_context=self.max_context,
            has_drafter=self.drafter is not None,
            context_name=self.context_name,
        )
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

    def costs(self) -> CostModel:
        """The cost curves `auto` plans with (profiled on first use when given as a function)."""
        if callable(self._costs):
            self._costs = self._costs()
        if self._costs is None:
            raise InvalidParameterError("mode", "mode 'auto' needs the engine's cost model; none was given")
        return self._costs

    def sessions(self, handle: RequestHandle) -> tuple[DraftSession | None, VerifySession] | None:
        """The sessions of a request holding cache rows (None when it waits or has left)."""
        r = next((r for r in self._running if r.handle is handle), None)
        return None if r is None else (r.draft, r.verify)

    # ---------------------------------------------------------------- the step

    def step(self) -> list[tuple[RequestHandle, Chunk]]:
        """One engine step (module docstring); the chunks it committed, per request.

        Not reentrant: one caller at a time (Engine serialises its callers). If a forward fails,
        every request of the step gets the error on its handle, leaves, and the error propagates.
        """
        self._retire_cancelled()
        self._admit()
        batch = list(self._running)
        try:
            self._prefill()
            return self._finish_scored() + self._decode()
        except BaseException as exc:
            for r in batch:
                if r in self._running:
                    r.handle.error = exc
                    self._retire(r)
            raise

    def _retire_cancelled(self) -> None:
        with self._lock:
            self._waiting = deque(h for h in self._waiting if not h.cancelled)
        for r in [r for r in self._running if r.handle.cancelled]:
            self._retire(r)

    def _admit(self) -> None:
        admitted = []
        while len(self._running) < self.capacity.max_batch:
            with self._lock:
                if not self._waiting:
                    break
                handle = self._waiting.popleft()
            handle.stats.queue_seconds = time.perf_counter() - handle.submitted
            r = self._open(handle)
            if handle.index > 0:  # an n > 1 sample: prefilled from sample 0's rows while that one runs
                r.leader = next((x for x in self._running if x.handle is handle.samples[0]), None)
            self._running.append(r)
            admitted.append(r)
        for r in admitted:  # `auto`: with the batch they join known (a sample: as its leader, whose prefill it copies)
            if r.handle.params.mode == Mode.AUTO:
                has_model = r.draft is not None and r.draft.tier is not None
                r.feed_drafter = r.leader.feed_drafter if r.leader else has_model and self._drafts_at_once(r)

    def _open(self, handle: RequestHandle) -> _Running:
        """The request's sessions, on fresh rows of the tiers it uses."""
        params, prompt, stats = handle.params, handle.prompt, handle.stats
        draft_seed, verify_seed = request_seeds(resolve_seed(params))
        full = self.full_store.row(self.full_store.alloc())
        slim = None
        if uses_slim(params) and self.cache_policy == CachePolicy.SEPARATE:
            slim = self.slim_store.row(self.slim_store.alloc())
        verify = VerifySession(
            self.verifier,
            self.mask,
            self.cache_policy,
            prompt,
            params,
            verify_seed,
            stats,
            full_cache=full,
            slim_cache=slim,
        )
        draft = None
        if params.mode != Mode.AR:
            use_model = self.drafter is not None and params.proposer != Proposer.NGRAM
            row = self.drafter_store.row(self.drafter_store.alloc()) if use_model else None
            draft = DraftSession(self.drafter if use_model else None, prompt, params, draft_seed, stats, cache=row)
        estimates = Estimates(self.estimates) if params.mode == Mode.AUTO else None
        return _Running(handle, verify, draft, prefilled=len(prompt) == 1, estimates=estimates)

    def _retire(self, r: _Running) -> None:
        """The request leaves: its KV figure is recorded and its rows are freed."""
        r.handle.stats.kv_bytes = sum(s.kv_bytes() for s in r.sessions)
        for s in r.sessions:
            s.release()
        self._running.remove(r)
        r.handle.finished = True

    def _prefill(self) -> None:
        """Chunked prefill: the prompt but its last token, at most prefill_chunk tokens per step."""
        budget, forwards, owners = self.capacity.prefill_chunk, [], []
        for r in self._running:
            if r.leader is not None and r.leader not in self._running:
                r.leader = None  # sample 0 has left: this sample prefills itself
            if r.prefilled or r.leader is not None or budget <= 0:
                continue
            upto, done = len(r.handle.prompt) - 1, r.verify.full.pos
            n = min(budget, upto - done)
            # an `auto` request's drafter catches up when a plan drafts, unless planned to draft at once (viasd.planner)
            for s in r.sessions if r.feed_drafter else [r.verify]:
                steps = s.prefill_steps(done + n, n)
                forwards += steps
                owners += [s] * len(steps)
            budget -= n
            r.prefilled = done + n == upto
        if forwards:
            for s, f, logits in zip(owners, forwards, execute(forwards, prefill=True)):
                s.prefilled(f, logits)
        for r in self._running:
            if r.leader is not None and r.leader.prefilled and not r.prefilled:
                for s, lead in zip(r.sessions, r.leader.sessions):
                    s.copy_prefill(lead)
                r.prefilled, r.leader = True, None

    def _finish_scored(self) -> list[tuple[RequestHandle, Chunk]]:
        """Prefilled requests with no tokens to generate (max_tokens 0: prompt logprobs only) end here."""
        out = []
        for r in [r for r in self._running if r.prefilled and r.handle.limits.remaining <= 0]:
            out.append(self._deliver(r, r.handle.limits.chunk([])))
        return out

    def _deliver(self, r: _Running, chunk: Chunk) -> tuple[RequestHandle, Chunk]:
        """Stream a chunk of a request (the first carries the prompt logprobs); retire it when finished."""
        chunk.index = r.handle.index
        if r.verify.prompt_logprobs is not None and not r.handle.prompt_scored:
            chunk.prompt_logprobs, r.handle.prompt_scored = r.verify.prompt_logprobs, True
        with self._lock:
            if not r.handle.cancelled:
                r.handle.chunks.append(chunk)
        if chunk.finished:
            self._retire(r)
        return r.handle, chunk

    def _decode(self) -> list[tuple[RequestHandle, Chunk]]:
        """Steps 3-5 over every prefilled request: plan (auto rows), draft, verify, commit."""
        rows = [r for r in self._running if r.prefilled]
        if not rows:
            return []
        t0, times = time.perf_counter(), StepTimes()  # the step's forwards and each row's work (the cost model's)
        plans = dict(zip(rows, self._plans(rows)))
        drafting = [r for r in rows if plans[r].kind != "ar"]
        for r in rows:
            if r.draft is not None and plans[r].kind == "ar":
                r.draft.skip()
        catch_up = [f for r in drafting if plans[r].kind in ("sd", "via") for f in r.draft.catch_up_steps()]
        if catch_up:  # lazy drafters of `auto` rows: the context they have not seen, before drafting
            execute(catch_up, prefill=True, observe=times.observe)
        proposals = drive(
            {r: r.draft.propose_steps(plans[r].k, plans[r].proposer) for r in drafting},
            observe=times.observe,
            timing=times.work,
        )
        ahead = [r for r in drafting if r.draft.drafts_ahead()]
        running_ahead = None
        if ahead:  # overlap: draft the next blocks from the optimistic prefixes while the verifier works
            running_ahead = model_thread.Beside(drive, {r: r.draft.draft_ahead_steps() for r in ahead})
        try:
            outcomes: dict[_Running, Outcome] = drive(
                {
                    r: r.verify.check_steps(*proposals[r], plans[r].verify_mode)
                    if r in proposals
                    else r.verify.decode_one_steps()
                    for r in rows
                },
                observe=times.observe,
                timing=times.work,
            )
        finally:
            if running_ahead is not None:
                for r in ahead:
                    r.draft.stop.set()
                running_ahead.result()
        out, escalated = [], {}
        for r in rows:
            outcome = outcomes[r]
            if r.draft is not None:
                r.draft.commit(outcome)
            r.verify.commit(outcome)
            escalated[r] = self._learn(r, plans[r], proposals.get(r), outcome)
            out.append(self._deliver(r, r.handle.limits.chunk(outcome.tokens, outcome.logprobs)))
        self.planner.settle(time.perf_counter() - t0, sum(len(chunk.token_ids) for _, chunk in out))
        if isinstance(self._costs, CostModel):  # (a model not profiled yet: no `auto` row has run)
            kinds = {r: (plans[r].kind, logit_rows(plans[r], float(escalated[r]))) for r in rows}
            self._costs.observe_step(times, kinds, time.perf_counter() - t0)
        return out

    def _state(self, r: _Running) -> RowState:
        """What the planner knows of a row: its own mode's plan, or an `auto` row's estimates."""
        params, gamma = r.handle.params, r.handle.limits.draft_length(len(r.verify.seq))
        if params.mode != Mode.AUTO:
            return RowState(fixed=fixed_plan(params.mode, gamma), gamma=gamma, acceptance=self.estimates.acceptance)
        return r.estimates.row(
            gamma=gamma,
            ngram_match=len(ngram_lookup(r.verify.seq, gamma, params.ngram_max)),
            has_drafter=r.draft is not None and r.draft.tier is not None,
            lossy=params.auto_lossy,
            draft_lag=r.draft.lag if r.draft is not None else 0,
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

    def _learn(self, r: _Running, plan: Plan, proposal, outcome: Outcome) -> bool:
        """Update the running estimates the planner reads (the request's, and the engine-wide ones
        from every request), and count an `auto` request's plan in its stats. Returns whether the
        cycle escalated to q."""
        stats = r.handle.stats
        escalated, r.via_seen = stats.escalations > r.via_seen, stats.escalations
        learn_cycle(
            (self.estimates, r.estimates),
            plan,
            drafted=len(proposal[0]) if proposal is not None else 0,
            accepted=outcome.num_draft_accepted,
            committed=len(outcome.tokens),
            escalated=escalated,
            plans=stats.plans if r.handle.params.mode == Mode.AUTO else None,
        )
        return escalated

    def close(self) -> None:
        """Nothing to stop: a step's drafting ahead ends with the step."""
