"""What an engine step runs on: the models, their caches and every request's sessions
(docs/ARCHITECTURE.md, "One loop, two executors").

The scheduler (viasd.scheduler) is the only step loop: it admits, plans, cuts and streams. An
executor runs the phases of a step, each over every row that takes part and at most once a step:

    prefill(batch)  open the sessions of admitted requests on fresh cache rows of every tier they
                    use, feed prompt chunks (the drafter's only when asked: `auto` feeds it when a
                    plan drafts) or roll preempted requests' caches back to nothing, copy n > 1
                    samples' prefilled rows from their leader; returns the prompt logprobs each
                    chunk scored
    propose(rows)   every drafting row's block: its drafter commits what it has not seen, catches
                    up when it lags, drafts k tokens (one batched forward per round)
    verify(rows)    every row's block checked by its plan's rule, or one token decoded: its
                    Outcome, committed on the verifier's side (served, probability only: a
                    rejected block's last token is drawn by the drafter, `DraftWorker.correct`,
                    and handed to the verifier with its next call, `VerifyWorker.settle`)
    release(keys)   free the rows of requests that left; each side's counters come back

`LocalExecutor` runs the drafter's half (`DraftWorker`) and the verifier's half (`VerifyWorker`)
in this process. The served executor (viasd.actors.coordinator.ServedExecutor) makes one
batched RPC per phase to the drafter actor and to verifier rank 0, whose ranks run the same
workers. A row that fails alone (its backend is down, its session is gone) comes back as a
`BackendError` in place of its result, and the scheduler fails it, or lets it go on as `ar`
when only its drafter failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from viasd import model_thread
from viasd.config import CachePolicy, GenerationParams, Mode, Proposer, Rule
from viasd.costs import CostModel, StepTimes, profile
from viasd.errors import BackendError, InvalidParameterError
from viasd.metrics import RequestStats, TokenLogprob
from viasd.planner import PLANS, Plan
from viasd.rules import correct_rows, rule_from_params
from viasd.runtime import LayerMask, MaskedLM
from viasd.sessions import (
    DraftSession,
    Forward,
    Outcome,
    VerdictShare,
    VerifySession,
    drive,
    execute,
    request_seeds,
    settle,
    uses_slim,
)


@dataclass(frozen=True)
class Capacity:
    """How much an engine runs at once (docs/BATCHING.md, "Caches"): every tier's cache holds
    `max_batch` rows of up to `max_seq_len` positions, over `kv_blocks` blocks of `block_size`
    (paged, the default) or as slot rows (`block_size` None), in process and on every served actor."""

    max_batch: int  # requests decoding together = cache rows per tier
    max_seq_len: int | None  # positions per cache row (prompt + generated + one draft block); None: unbounded
    prefill_chunk: int = 512  # prompt tokens prefilled per step, over all new requests
    block_size: int | None = None  # positions per KV block of a paged cache (viasd.blocks); None: slot rows
    kv_blocks: int | None = None  # blocks per tier (paged); requests are admitted against them
    prefix_caching: bool = True  # paged: requests with a common prompt prefix share its full blocks (viasd.blocks)
    paged_attention: str = "torch"  # paged: the kernel that reads the blocks, "torch" or "flex" (viasd.attention)

    @property
    def tokens(self) -> int:
        """Positions each tier's cache holds in all (0: unbounded)."""
        if self.kv_blocks is not None:
            return self.kv_blocks * self.block_size
        return self.max_batch * (self.max_seq_len or 0)

    @property
    def concurrency(self) -> int:
        """Requests of a full context (`max_seq_len` positions) the caches hold at once: the rows,
        or (paged) as many as the blocks hold, at most the rows and at least 1 (vLLM's "maximum
        concurrency for N tokens per request"). A figure, not a limit: with blocks up to
        `max_batch` requests run at once, admitted against the blocks they hold (shorter ones fit
        more), the rest queued, the newest preempted when the running ones outgrow the blocks."""
        if self.kv_blocks is None or self.max_seq_len is None:
            return self.max_batch
        return max(1, min(self.max_batch, self.kv_blocks // -(-self.max_seq_len // self.block_size)))

    def describe(self) -> dict:
        """For /v1/models and the start-up log: rows, positions per request, blocks, tokens in all,
        full-context requests at once (the attention kernel is in the runtime info)."""
        sizes = {k: v for k, v in dataclasses.asdict(self).items() if k != "paged_attention"}
        return {**sizes, "kv_tokens": self.tokens, "concurrency": self.concurrency}

    def new_store(self, lm: MaskedLM, mask: LayerMask | None = None):
        """A tier's cache of this capacity: max_batch rows of max_seq_len positions, or (paged)
        max_batch rows over kv_blocks blocks."""
        return lm.new_store(
            mask,
            max_rows=self.max_batch,
            max_len=self.max_seq_len,
            block_size=self.block_size,
            num_blocks=self.kv_blocks,
            prefix_caching=self.prefix_caching,
            attention=self.paged_attention,
        )


# ---------------------------------------------------------------- what a phase carries


class Open(NamedTuple):
    """An admitted request, as each side opens its sessions: the side draws its own random stream
    from the request's seed (viasd.sessions.request_seeds)."""

    key: str
    prompt: list[int]
    params: GenerationParams
    seed: int
    drafts: bool  # it has a drafter side (every mode but `ar`)


class PrefillChunk(NamedTuple):
    """Every verifier tier of `key` (and its drafter, when `drafter`) comes to hold the first `upto`
    positions of the request's sequence: the prompt, or for a resumed request the prompt and the
    tokens committed before it was preempted. A tier holding fewer feeds up to there; one holding
    as many or more rolls back to there (viasd.sessions._Tier.prefill): a chunk to 0 gives back
    every KV block the request holds and keeps its sessions, random streams and counters
    (preemption; the chunks that resume it recompute the caches). An empty paged row first
    attaches what the prefix cache holds of the sequence, and may then hold more (`Prefilled.held`)."""

    key: str
    upto: int
    drafter: bool


class Copy(NamedTuple):
    """Give `key` the prefilled rows of `leader` (same prompt: the samples of an n > 1 request)."""

    key: str
    leader: str


@dataclass
class PrefillBatch:
    """A step's prefill phase, applied in this order: settles (a verifier's), opens, chunks, copies."""

    opens: list[Open] = field(default_factory=list)
    chunks: list[PrefillChunk] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    settles: dict[str, int] = field(default_factory=dict)  # key -> the drawn last token (`VerifyWorker.settle`)

    def __bool__(self) -> bool:
        return bool(self.opens or self.chunks or self.copies)


class Prefilled(NamedTuple):
    """A row's prefill phase: the prompt logprobs its chunk scored ([] when none), and the
    positions of its sequence the verifier's cache holds now (served drafter: the drafter's). A
    paged cache that attaches a cached prefix (viasd.blocks, prefix caching) holds more than the
    chunk asked for; the scheduler's next chunk starts there."""

    logprobs: list[TokenLogprob]
    held: int


class ProposeRow(NamedTuple):
    key: str
    k: int  # tokens to draft at most
    proposer: Proposer | None  # who drafts (an `auto` plan's); None: the request's own proposer


class Proposal(NamedTuple):
    """A drafted block in the executor's own form: the tokens (in process a [k] long tensor on the
    device, served a list) and p, the drafter's rows [k, V] (a tensor in process, its wire message
    served), or None: a point mass at the draft tokens."""

    draft: Tensor | list[int]
    probs: object


class VerifyRow(NamedTuple):
    key: str
    draft: Tensor | list[int]  # the Proposal's; empty: decode one token (`ar`)
    probs: object  # the Proposal's
    plan: str  # an `auto` row's plan kind ("sd", "ngram", "via"); "": the request's own mode


class Executor(Protocol):
    """The phases of a step (module docstring). Results come in the order of the rows; a row that
    failed alone holds its error instead (a `BackendError` served; in process only a malformed
    row can, and the scheduler's rows never are)."""

    vocab_size: int
    has_drafter: bool  # a drafter model is loaded (n-gram drafts need none)
    proposes: bool  # drafts can be proposed at all (served: there is a drafter actor, where the lookup runs)

    def prefill(self, batch: PrefillBatch) -> dict[str, Prefilled | BackendError]:
        """Every row of the batch: what its chunk scored and how much its caches hold."""
        ...

    def propose(self, rows: Sequence[ProposeRow], times: StepTimes) -> list[Proposal | BackendError]:
        """Every drafting row's block; `times` gets the forwards and each row's work, by key."""
        ...

    def verify(self, rows: Sequence[VerifyRow], times: StepTimes) -> list[Outcome | BackendError]:
        """Every row's outcome, committed on the verifier's side (the drafter's commits it with
        its next propose at the latest); `times` as for `propose`."""
        ...

    def release(self, keys: Sequence[str]) -> dict[str, RequestStats]:
        """Free the requests' rows; the counters each side kept (missing where a side is gone)."""
        ...

    def draft_lag(self, key: str) -> int:
        """Context tokens the request's drafter has not fed beyond the next round's (viasd.sessions.CATCH_UP)."""
        ...

    def costs(self) -> CostModel:
        """Every tier's forward cost curves (viasd.costs), profiled where the tiers run."""
        ...


# ---------------------------------------------------------------- the two halves


class _Side:
    """What both halves share: their sessions by request key, prefill, copies and release."""

    name: str
    sessions: dict

    def session(self, key: str):
        try:
            return self.sessions[key]
        except KeyError:
            raise SessionNotFound(f"{self.name} has no session {key!r}") from None

    def _new(self, key: str) -> None:
        if key in self.sessions:
            raise InvalidParameterError("request_id", f"{key!r} is already open on the {self.name}")

    def prefill_steps(self, key: str, upto: int) -> list[Forward]:
        return self.session(key).prefill_steps(upto, upto)

    def held(self, key: str) -> int:
        """Positions of the request's sequence its cache holds (the drafter's; the verifier's full tier)."""
        raise NotImplementedError

    def prefilled(self, key: str, forward: Forward, logits: Tensor) -> list[TokenLogprob]:
        """What a prefill forward of the request scored (the verifier's prompt logprobs); the
        blocks it filled are published for later requests with the same prefix (prefix caching)."""
        session = self.session(key)
        forward.tier.cache.publish(session.seq[: forward.start + len(forward)])
        return session.prefilled(forward, logits)

    def copy(self, key: str, leader: str) -> None:
        self.session(key).copy_prefill(self.session(leader))

    def release(self, key: str) -> RequestStats | None:
        """Free the request's rows; the counters its session kept (None: it held none here)."""
        session = self.sessions.pop(key, None)
        if session is None:
            return None
        settle()  # (every forward's device time is in its stats)
        session.stats.kv_bytes = session.kv_bytes()
        session.release()
        return session.stats


class DraftWorker(_Side):
    """The drafter's half: a `DraftSession` per request key, on rows of one cache store of
    `capacity.max_batch` rows x `capacity.max_seq_len` positions. `lm` None: n-gram drafts only."""

    name = "drafter"

    def __init__(self, lm: MaskedLM | None, capacity: Capacity):
        self.lm = lm
        self.store = None if lm is None else capacity.new_store(lm)
        self.sessions: dict[str, DraftSession] = {}

    def open(self, key: str, prompt: list[int], params: GenerationParams, seed: int) -> None:
        """A session on a fresh row (a full store is a CapacityError: the scheduler never asks past it)."""
        self._new(key)
        model = self.lm is not None and params.proposer != Proposer.NGRAM
        row = self.store.row(self.store.alloc()) if model else None
        stats = RequestStats(mode=params.mode.value, prompt_tokens=len(prompt))
        draft_seed, _ = request_seeds(seed)
        self.sessions[key] = DraftSession(self.lm if model else None, prompt, params, draft_seed, stats, cache=row)

    def held(self, key: str) -> int:
        """Positions the request's drafter cache holds (0 without a drafter model)."""
        tier = self.session(key).tier
        return 0 if tier is None else tier.pos

    def propose(
        self, rows: Sequence[tuple[str, int, Proposer | None, Outcome | None]], times: StepTimes
    ) -> list[tuple[Tensor, Tensor | None]]:
        """Each row (key, k, proposer, the outcomes it has not committed or None; one row per
        key): commit, catch a lagging drafter up (one batched prefill forward), then draft every
        block together (one batched drafter forward per round, rows leaving as their blocks
        end). Each block stays on the device ([k] long; nothing is read to the host).
        `times` gets the forwards and each row's work between them, by key."""
        sessions = {key: self.session(key) for key, *_ in rows}
        for key, _, _, previous in rows:
            if previous is not None:
                sessions[key].commit(previous)
        catch_up = [f for key, _, proposer, _ in rows if proposer is None for f in sessions[key].catch_up_steps()]
        if catch_up:
            execute(catch_up, prefill=True, observe=times.observe)
        proposals = drive(
            {key: sessions[key].propose_steps(k, proposer) for key, k, proposer, _ in rows},
            observe=times.observe,
            timing=times.work,
        )
        return [proposals[key] for key, *_ in rows]

    def correct(self, rows: Sequence[tuple[str, int, Tensor, float]]) -> list[int | InvalidParameterError]:
        """Probability only: the last token of each block its verifier left pending (key, the
        rejected position in the block last proposed, q's row there [V], the block's uniform),
        drawn from this side's p rows (`rules.correct_rows`, all rows at once). A row whose
        session is gone or whose position its block does not have fails alone."""
        out: list = [None] * len(rows)
        asks = []
        for i, (key, position, q, u) in enumerate(rows):
            try:
                session = self.session(key)
                if not 0 <= position < len(session.last_p):
                    raise InvalidParameterError(
                        "position", f"{position} outside the {len(session.last_p)} sampled rows of its last block"
                    )
            except InvalidParameterError as exc:
                out[i] = exc
                continue
            asks.append((i, session, session.last_p[position], q, u))
        if asks:
            _, sessions, p, q, u = zip(*asks)
            tokens = correct_rows(
                [rule_from_params(s.params) for s in sessions],
                torch.cat(p),  # [N, V]
                torch.stack(q).to(p[0].device),  # [N, V]
                torch.tensor(u, dtype=torch.float64, device=p[0].device),  # [N]
            )
            for (i, *_), token in zip(asks, tokens.tolist()):
                out[i] = token
        return out

    def ahead(self, keys: Sequence[str]) -> dict:
        """`overlap`: the step generators that draft the next blocks of the rows likely accepted
        whole (DraftSession.drafts_ahead), to run beside the verification; `stop` ends them."""
        return {k: s.draft_ahead_steps() for k in keys if (s := self.sessions.get(k)) is not None and s.drafts_ahead()}

    def stop(self, keys) -> None:
        for key in keys:
            if (s := self.sessions.get(key)) is not None:
                s.stop.set()

    def release(self, key: str) -> RequestStats | None:
        self.stop([key])  # (a block being drafted ahead ends after its next token)
        return super().release(key)


class VerifyWorker(_Side):
    """The verifier's half: a `VerifySession` per request key (q, and q' = q masked), on rows of
    the full store and, under the separate cache policy, the slim one, each `capacity.max_batch`
    rows x `capacity.max_seq_len` positions. Logits never leave it: it returns outcomes."""

    name = "verifier"

    def __init__(self, lm: MaskedLM, mask: LayerMask, cache_policy: CachePolicy | str, capacity: Capacity):
        self.lm, self.mask = lm, mask
        self.cache_policy = CachePolicy(cache_policy)
        self.full_store = capacity.new_store(lm)
        self.slim_store = capacity.new_store(lm, mask)  # (the separate policy only)
        self.sessions: dict[str, VerifySession] = {}
        self.verdicts: VerdictShare | None = None  # a tensor-parallel rank's (viasd.parallel.VerdictBroadcast)

    def open(self, key: str, prompt: list[int], params: GenerationParams, seed: int) -> None:
        self._new(key)
        full = self.full_store.row(self.full_store.alloc())
        slim = None
        if uses_slim(params) and self.cache_policy == CachePolicy.SEPARATE:
            try:
                slim = self.slim_store.row(self.slim_store.alloc())
            except BaseException:
                full.release()
                raise
        stats = RequestStats(mode=params.mode.value, prompt_tokens=len(prompt))
        _, verify_seed = request_seeds(seed)
        self.sessions[key] = VerifySession(
            self.lm, self.mask, self.cache_policy, prompt, params, verify_seed, stats, full_cache=full, slim_cache=slim
        )

    def held(self, key: str) -> int:
        return self.session(key).full.pos

    def settle(self, settles: dict[str, int]) -> None:
        """Hand requests left unsettled by a probability-only block their drawn last token
        (`VerifySession.settle`); requests released since are skipped."""
        for key, token in settles.items():
            if key in self.sessions:
                if not 0 <= token < self.lm.vocab_size:
                    raise InvalidParameterError(
                        "settles", f"token {token} outside the vocabulary ({self.lm.vocab_size})"
                    )
                self.sessions[key].settle(token)

    def verify(
        self, rows: Sequence[VerifyRow], times: StepTimes, settles: dict[str, int] | None = None
    ) -> list[Outcome | InvalidParameterError]:
        """One step over every row (`viasd.sessions.drive`: one slim forward over the `via` rows,
        one full forward over the rest and the escalated rows), each outcome committed, after
        `settles` (`settle`). A row whose session is gone or unsettled, named twice or whose
        block is malformed fails alone (its error in its place); `times` gets the forwards and
        each row's work between them, by key."""
        self.settle(settles or {})
        out: list = [None] * len(rows)
        steps, index = {}, {}
        for i, row in enumerate(rows):
            try:
                if row.key in steps:
                    raise InvalidParameterError("request_id", f"{row.key!r} appears twice in one verify batch")
                steps[row.key] = self._steps(self.session(row.key), row)
                index[row.key] = i
            except InvalidParameterError as exc:
                out[i] = exc
        for key, outcome in drive(steps, observe=times.observe, timing=times.work, verdicts=self.verdicts).items():
            self.sessions[key].commit(outcome)
            out[index[key]] = outcome
        corrections = [o.correction for o in out if isinstance(o, Outcome) and o.correction is not None]
        if corrections:  # q's rows to the host together (they leave for the drafter), one copy a step
            for c, q in zip(corrections, torch.stack([c.q for c in corrections]).cpu()):
                c.q = q
        return out

    def _steps(self, session: VerifySession, row: VerifyRow):
        """A row's step generator, its draft, p and plan checked first (InvalidParameterError)."""
        if session.unsettled:
            raise InvalidParameterError("settles", "the request's last token was drawn elsewhere and not settled")
        mode = plan_mode(session.params, row.plan, len(row.draft) > 0)
        if not len(row.draft):
            return session.decode_one_steps()
        draft = row.draft
        if not isinstance(draft, Tensor):  # (served: from the wire; in process the drafter's own tensor)
            bad = [t for t in draft if not 0 <= t < self.lm.vocab_size]
            if bad:
                raise InvalidParameterError(
                    "draft", f"token ids {bad[:5]} outside the vocabulary ({self.lm.vocab_size})"
                )
            draft = torch.tensor(draft, dtype=torch.long, device=self.lm.device)  # [k]
        p = row.probs  # [k, V], [k] (probability only) or None (a point mass)
        if p is not None and tuple(p.shape) not in ((len(row.draft), self.lm.vocab_size), (len(row.draft),)):
            raise InvalidParameterError(
                "probs", f"shape {tuple(p.shape)} does not match {len(row.draft)} draft tokens x {self.lm.vocab_size}"
            )
        if p is not None and p.ndim == 1 and (session.sampler.greedy or not point_route(session.params)):
            raise InvalidParameterError(
                "p_x", "only sampled requests without logprobs or the staged rule take draft probabilities alone"
            )
        model = session.params.proposer == Proposer.MODEL and row.plan != "ngram"  # (n-gram blocks have no p)
        if p is None and not session.sampler.greedy and model:
            raise InvalidParameterError("probs", "a sampled request's draft needs its probabilities")
        return session.check_steps(draft, p, mode)


class SessionNotFound(InvalidParameterError):
    """No session with this key on a side (never opened, already released, or its actor restarted)."""

    def __init__(self, message: str):
        super().__init__("request_id", message)

    def __reduce__(self):
        return (SessionNotFound, (self.message,))


def point_route(params: GenerationParams) -> bool:
    """Whether a request's sampled blocks may travel as their draft tokens' probabilities alone
    (served, probability only): not when it asks for logprobs (a pending token has none yet) or
    runs the staged rule (its first stage draws from p's whole rows on the verifier)."""
    return params.logprobs is None and params.rule != Rule.STAGED


def plan_mode(params: GenerationParams, plan: str, drafted: bool) -> Mode | None:
    """How a row's block is checked: its plan's mode (`auto` rows; viasd.planner.Plan.verify_mode),
    or None: the request's own mode (InvalidParameterError naming `plan` for a plan the request
    does not take)."""
    if not plan:
        if params.mode == Mode.AUTO and drafted:
            raise InvalidParameterError("plan", "an `auto` request's draft block needs its plan (sd, ngram or via)")
        return None
    if params.mode != Mode.AUTO:
        raise InvalidParameterError("plan", f"only `auto` requests take a plan; this one is {params.mode.value!r}")
    if plan not in PLANS:
        raise InvalidParameterError("plan", f"unknown plan {plan!r}: expected one of {list(PLANS)}")
    if plan == "via" and not uses_slim(params):
        raise InvalidParameterError("plan", "plan 'via' is lossy: the request did not allow it (auto_lossy)")
    return Plan(plan).verify_mode


def prefill(
    sides: Sequence[DraftWorker | VerifyWorker], batch: PrefillBatch
) -> dict[str, Prefilled | InvalidParameterError]:
    """The prefill phase on the sides one process holds (both in process; one a served actor):
    open, feed every chunk with one batched forward per tier (`viasd.sessions.execute`), copy.
    Per row of the batch: the prompt logprobs its chunk scored and the positions the verifier's
    side (or the only side) holds, or the error that failed it alone (a duplicate key, a full
    store, an unknown session or leader)."""
    out: dict = {}

    def applies(side, drafter_too: bool) -> bool:
        return drafter_too or not isinstance(side, DraftWorker)

    for side in sides:
        if isinstance(side, VerifyWorker):
            side.settle(batch.settles)
    for o in batch.opens:
        for side in sides:
            if applies(side, o.drafts) and o.key not in out:
                try:
                    side.open(o.key, o.prompt, o.params, o.seed)
                except InvalidParameterError as exc:
                    out[o.key] = exc
        out.setdefault(o.key, [])
    forwards, owners = [], []
    for c in batch.chunks:
        if isinstance(out.setdefault(c.key, []), Exception):
            continue
        try:
            steps = [(side, side.prefill_steps(c.key, c.upto)) for side in sides if applies(side, c.drafter)]
        except InvalidParameterError as exc:
            out[c.key] = exc
            continue
        for side, fs in steps:
            forwards += fs
            owners += [(side, c.key)] * len(fs)
    for (side, key), f, logits in zip(owners, forwards, execute(forwards, prefill=True)):
        out[key] += side.prefilled(key, f, logits)
    for c in batch.copies:
        if isinstance(out.setdefault(c.key, []), Exception):
            continue
        try:
            for side in sides:
                if not isinstance(side, DraftWorker) or c.key in side.sessions:
                    side.copy(c.key, c.leader)
        except InvalidParameterError as exc:
            out[c.key] = exc
    last = sides[-1]  # (the verifier's side in process)
    return {
        key: got if isinstance(got, Exception) else Prefilled(got, last.held(key) if key in last.sessions else 0)
        for key, got in out.items()
    }


# ---------------------------------------------------------------- in process


class LocalExecutor:
    """Both halves in this process, on the process's model thread (viasd.model_thread).

    A drafter commits each outcome as soon as it is known. `overlap` rows likely accepted whole
    draft their next blocks on a thread of their own while the verifier checks these ones
    (`model_thread.Beside`), stopped when the verification ends.
    """

    def __init__(
        self,
        verifier: MaskedLM,
        drafter: MaskedLM | None,
        mask: LayerMask,
        cache_policy: CachePolicy | str,
        capacity: Capacity,
        cost_cache_dir: str | Path | None = None,
    ):
        self.verifier = VerifyWorker(verifier, mask, cache_policy, capacity)
        self.drafter = DraftWorker(drafter, capacity)
        self.vocab_size = verifier.vocab_size
        self.has_drafter = drafter is not None
        self.proposes = True  # (without a drafter model, n-gram drafts)
        self._cost_cache_dir = cost_cache_dir
        self._proposed: set[str] = set()  # rows that drafted this step (the others' drafters skip it)
        self._ahead: tuple[list[str], model_thread.Beside] | None = None

    def sessions(self, key: str) -> tuple[DraftSession | None, VerifySession] | None:
        """A request's sessions (None when it holds no rows)."""
        verify = self.verifier.sessions.get(key)
        return None if verify is None else (self.drafter.sessions.get(key), verify)

    def prefill(self, batch: PrefillBatch) -> dict[str, Prefilled | InvalidParameterError]:
        return prefill([self.drafter, self.verifier], batch)

    def propose(self, rows: Sequence[ProposeRow], times: StepTimes) -> list[Proposal]:
        out = self.drafter.propose([(r.key, r.k, r.proposer, None) for r in rows], times)
        self._proposed = {r.key for r in rows}
        ahead = self.drafter.ahead([r.key for r in rows])
        if ahead:  # overlap: draft the next blocks from the optimistic prefixes while the verifier works
            self._ahead = (list(ahead), model_thread.Beside(drive, ahead))
        return [Proposal(draft, p) for draft, p in out]

    def verify(self, rows: Sequence[VerifyRow], times: StepTimes) -> list[Outcome | InvalidParameterError]:
        try:
            out = self.verifier.verify(rows, times)
        finally:
            if self._ahead is not None:
                keys, running = self._ahead
                self._ahead = None
                self.drafter.stop(keys)
                running.result()
        for row, outcome in zip(rows, out):
            draft = self.drafter.sessions.get(row.key)
            if draft is not None and isinstance(outcome, Outcome):
                if row.key not in self._proposed:
                    draft.skip()  # (an `auto` row's `ar` step: its drafter proposed nothing)
                draft.commit(outcome)
        self._proposed = set()
        return out

    def release(self, keys: Sequence[str]) -> dict[str, RequestStats]:
        out = {}
        for key in keys:
            parts = [s for s in (self.drafter.release(key), self.verifier.release(key)) if s is not None]
            if parts:
                out[key] = _merged(parts)
        return out

    def draft_lag(self, key: str) -> int:
        session = self.drafter.sessions.get(key)
        return 0 if session is None else session.lag

    def costs(self) -> CostModel:
        """Every tier's cost curves on this device and dtype (viasd.costs; measured on the model thread)."""
        v = self.verifier
        return model_thread.run(profile, v.lm, self.drafter.lm, v.mask, cache_dir=self._cost_cache_dir)


def _merged(parts: list[RequestStats]) -> RequestStats:
    """One side's counters, or both sides' added (the request-level fields are the scheduler's)."""
    total = RequestStats()
    for part in parts:
        total.add_counters(part)
    return total
