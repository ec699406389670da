"""The per-request pieces of the decode cycle, written once for a batch of any size.

One cycle of VIA-SD, for a committed prefix x of length n:

1. draft:        the drafter p samples x~_1..x~_gamma, keeping p_1..p_gamma (or prompt lookup
                 proposes them, p a point mass; `overlap`: drafted ahead during the last verify);
2. slim verify:  one masked forward of q' over the block gives q'_1..q'_{gamma+1};
3. gate:         r_i = q'_i(x~_i) / max_v q'_i(v); accept while r_i >= alpha1; at the first
                 position i with alpha2 <= r_i < alpha1 commit a token from q'_i (rewrite); with
                 r_i < alpha2 escalate;
4. escalate:     one forward of q over everything it has not seen up to x~_gamma, then the
                 speculative-sampling rule from position i on;
5. roll back:    every cache is cut to the committed length; the new tokens are streamed.

`DraftSession` (steps 1 and 5, drafter side) and `VerifySession` (steps 2-5, verifier side)
are written as *step generators*: where a model must run they ``yield`` a `Forward` (which tier,
which tokens) and receive its logits. Whoever drives them decides how forwards are batched:
`drive` runs many requests' generators together, one batched forward per tier and round
(drafter rounds first, then slim, then full: viasd.executor), and `run_alone` one request by
itself. The rules (viasd.rules) and the sampling order are the same either way, so a request's
tokens do not depend on what it was batched with.

Penalties and logit_bias (docs/REQUEST_OPTIONS.md) process every tier's rows alike, row t of a
block conditioned on the committed tokens + draft[:t]. Randomness comes from one
`torch.Generator` per request and side, consumed in a fixed order, so the same seed gives the
same output alone, in any batch, in-process or served.

Between forwards a generator does no per-row maths and reads nothing to the host: it yields
`Draw`, `Check`, `Gate` or `Read`, which `drive` answers for every waiting row at once on the
device; a step reads the host once for its committed tokens (a `via` step once more for the gate).
"""

from __future__ import annotations

import itertools
import struct
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from viasd.config import CachePolicy, GenerationParams, LogprobTier, Mode, Proposer, RegionB, Rule
from viasd.costs import running_mean
from viasd.errors import InvalidParameterError
from viasd.metrics import RequestStats, TokenLogprob
from viasd.proposers import GammaPolicy, ngram_lookup
from viasd.rules import (
    AcceptanceRule,
    Lossless,
    Region,
    gate_ratio,
    gate_rows,
    rule_from_params,
    skip_verify_draws,
    verify_greedy,
    verify_rows,
)
from viasd.runtime import Lap, LayerMask, MaskedLM, Row, RowCache
from viasd.sampling import (
    Penalised,
    Penalties,
    Sampler,
    batch_logprobs,
    batch_probs,
    penalise_rows,
    sample_rows,
    token_logprobs,
)

TIER_ORDER = {"drafter": 0, "slim": 1, "full": 2}  # the order of a step's forwards (`drive`)
CATCH_UP = 4  # a lazy drafter lagging more tokens than this catches up in a prefill forward (DraftSession.lag)
AHEAD_MIN = 0.5  # overlap drafts ahead while a request's blocks are accepted whole at least this often (drafts_ahead)


@dataclass
class Forward:
    """One request's ask for one forward of one tier: feed `tokens` then `tail` (device tokens)
    at `start`, return the logits [num_logits, V] of the last positions."""

    tier: _Tier
    tokens: list[int]  # [T - n_tail]
    start: int
    num_logits: int
    stats: RequestStats = field(repr=False)
    tail: Tensor | None = None  # [n_tail] long, on the device

    def __len__(self) -> int:
        return len(self.tokens) + (0 if self.tail is None else self.tail.shape[0])

    def __repr__(self) -> str:
        return f"Forward({self.tier.name}, T={len(self)}, start={self.start}, logits={self.num_logits})"


@dataclass
class Draw:
    """Sample one token from each row of logits [T, V] (raw: processed by `context`'s penalties,
    when the request has any) with the request's sampler and stream; answered with (tokens [T]
    long, probabilities [T, V] or None for a greedy request) on the device."""

    logits: Tensor  # [T, V]
    sampler: Sampler
    generator: torch.Generator
    context: Penalised | None = None


@dataclass
class Check:
    """Verify a block with an acceptance rule (viasd.rules.verify_rows): p [k, V] against the
    sampler's distributions of the verifier's logits [k + 1, V] (penalised by `context`); answered with
    ([4] long on the device: accepted count, committed token (-1: pending), bonus as 0/1, the bits
    of the token's float64 uniform; q [k + 1, V], or None for a greedy request, whose block is
    checked against the logits' argmax: rules.verify_greedy)."""

    rule: AcceptanceRule
    p: Tensor | None  # [k, V] (one-hot at the draft tokens for a point mass), or [k]: p(x~) alone; None: greedy
    logits: Tensor  # [k + 1, V]
    draft: Tensor  # [k] long
    sampler: Sampler
    generator: torch.Generator
    context: Penalised | None = None  # (the request's penalties: row t follows seq + draft[:first + t])


@dataclass
class Gate:
    """The slim verifier's gate over a block (viasd.rules.gate_rows) from its logits [k, V]
    (penalised by `context`); answered with [2] long on the device: the first position not
    accepted, its region."""

    logits: Tensor  # [k, V]
    draft: Tensor  # [k] long
    alpha1: float
    alpha2: float
    rewrite: bool
    sampler: Sampler
    context: Penalised | None = None


@dataclass
class Read:
    """Values to the host: answered with `values` [n] (an integer or bool tensor) as a list of
    ints. `decides`: what the request does next depends on them (a `via` row's gate), so they are
    read before the next forward; other reads wait for every row's (one read a step)."""

    values: Tensor
    decides: bool = False


@dataclass
class Score:
    """Logprobs of committed tokens (viasd.sampling.batch_logprobs): raw logits [T, V], the T
    tokens, the top k; answered with T `TokenLogprob`s. Read after every `Read` of the step."""

    logits: Tensor  # [T, V]
    tokens: list[int]
    k: int
    tier: str


@dataclass(frozen=True)
class Absent:
    """Draft probabilities p [rows, V] or [rows] this process does not hold, only their shape: on
    a tensor-parallel follower, whose `Check` verdicts rank 0 decides and shares (`VerdictShare`)."""

    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, rows: slice) -> Absent:  # (a block checked from position `start` on)
        return Absent((len(range(*rows.indices(self.shape[0]))), *self.shape[1:]))


class VerdictShare:
    """How the ranks of a tensor-parallel group agree on sampled `Check` verdicts without every
    rank holding the drafter's p: the leader (rank 0) decides each batched call and `lead`s its
    verdicts [B, 4] to the others, which `follow` (receive them) after consuming the same random
    draws (`rules.skip_verify_draws`). Every rank holds the same logits, so greedy checks, gates
    and draws need no sharing. Implementations: `viasd.parallel.VerdictBroadcast`."""

    leader: bool = True

    def lead(self, verdicts: Tensor) -> None:  # [B, 4] long
        raise NotImplementedError

    def follow(self, rows: int, device: torch.device) -> Tensor:  # -> [rows, 4] long
        raise NotImplementedError


# A step generator: yields Forwards and the requests above, is sent their answers, returns its result.
Steps = Generator["Forward | Draw | Check | Gate | Read | Score", object, object]
# Hears of one batched forward: (tier name, rows, padded tokens B * T_max, seconds).
Observer = Callable[[str, int, int, float], None]


@dataclass
class _Tier:
    """One model's view of a request: the layers it runs, its cache row, how much of it is valid.

    `pos` counts the leading positions of the request's sequence whose keys/values in `cache`
    are valid for this tier; a forward first crops the tier's layers back to `pos`.
    """

    name: str  # "drafter" | "slim" | "full"
    lm: MaskedLM
    cache: RowCache
    mask: LayerMask | None = None
    pos: int = 0

    @property
    def layers(self) -> tuple[int, ...]:
        return self.lm.all_layers if self.mask is None else self.mask.kept

    def ask(self, seq: Sequence[int], num_logits: int, stats: RequestStats, tail: Tensor | None = None) -> Forward:
        """The forward that feeds (seq + tail)[pos:] and returns logits for the last num_logits
        positions; `tail` [n] long stays on the device."""
        n = len(seq) + (0 if tail is None else tail.shape[0])
        assert 0 <= self.pos <= n - max(num_logits, 1), (self.pos, n, num_logits)
        self.cache.crop(self.pos, self.layers)
        if tail is not None:
            tail = tail[max(self.pos - len(seq), 0) :]
        fwd = Forward(self, list(seq[self.pos :]), self.pos, num_logits, stats, tail)
        self.pos = n
        return fwd

    def prefill(
        self, seq: Sequence[int], upto: int, budget: int, stats: RequestStats, score_from: int | None = None
    ) -> Forward | None:
        """A prefill chunk: the tier comes to hold the first `upto` positions of `seq`. Below them it
        feeds seq[pos : min(upto, len(seq), pos + budget)], with no logits or (`score_from`) the
        logits of the fed positions from `score_from` on; at or past them it rolls back to `upto`
        and feeds nothing (its cache drops what it held further: a chunk to 0 gives back every
        block of the row, which is how a preempted request frees its caches). An empty row first
        attaches the cached blocks of the longest prefix of seq[:-1] a paged cache holds
        (viasd.blocks, prefix caching), short of the positions to score: it may then hold more
        than `upto`. None: no forward."""
        if upto <= self.pos:
            self.pos = upto
            self.cache.crop(upto, self.layers)
            return None
        if self.pos == 0:
            self.pos = self.cache.attach(seq[: len(seq) - 1 if score_from is None else min(score_from, len(seq) - 1)])
            if self.name == "full":
                stats.cached_tokens += self.pos
            if self.pos >= upto:
                return None
        end = min(upto, len(seq), self.pos + budget)
        if end <= self.pos:
            return None
        scored = 0 if score_from is None else max(0, end - max(self.pos, score_from))
        return self.ask(seq[:end], scored, stats)


# ---------------------------------------------------------------- driving step generators


def execute(forwards: Sequence[Forward], *, prefill: bool = False, observe: Observer | None = None) -> list[Tensor]:
    """Run forwards, one `MaskedLM.forward_batch` per (model, mask, cache): the logits of each,
    in order. Each request's stats get one forward and the batch's time for that tier (`prefill`:
    counted as prefill instead, so `forwards` counts decode forwards only). `observe(tier, rows B,
    padded length T_max, seconds)` hears of every batched forward. Times are the device's own
    (`runtime.Lap`): on a GPU they are taken with events and delivered at the next `settle`."""
    out: list[Tensor | None] = [None] * len(forwards)
    groups: dict[tuple, list[int]] = {}
    for i, f in enumerate(forwards):
        groups.setdefault((id(f.tier.lm), f.tier.mask, id(f.tier.cache.store)), []).append(i)
    for idx in groups.values():
        idx.sort(key=lambda i: forwards[i].tier.cache.row)  # adjacent rows: the cache returns views
        first = forwards[idx[0]].tier
        rows = [Row(f.tokens, f.start, f.num_logits, f.tier.cache.row, f.tail) for f in (forwards[i] for i in idx)]
        lap = Lap(first.lm.device)
        logits = first.lm.forward_batch(rows, first.cache.store, first.mask)
        _when_timed(lap.stop(), _timed_forward(first.name, rows, [forwards[i].stats for i in idx], prefill, observe))
        for i, lg in zip(idx, logits):
            out[i] = lg
    return out  # type: ignore[return-value]


def _timed_forward(tier: str, rows: list[Row], stats: list[RequestStats], prefill: bool, observe: Observer | None):
    def record(seconds: float) -> None:
        if observe is not None:
            observe(tier, len(rows), max(len(r) for r in rows), seconds)
        for st in stats:
            if prefill:
                st.prefill_seconds += seconds
                st.prefill_forwards += 1
            else:
                st.seconds[tier] += seconds
                st.forwards[tier] += 1

    return record


_unsettled: list[tuple[Lap, Callable[[float], None]]] = []  # device laps whose seconds are not read yet
_unsettled_lock = threading.Lock()


def _when_timed(lap: Lap, record: Callable[[float], None]) -> None:
    """record(lap.seconds) now when the clock is the host's, at the next `settle` when it is the device's."""
    if not lap.events:
        record(lap.seconds)
        return
    with _unsettled_lock:
        _unsettled.append((lap, record))


def settle() -> None:
    """Deliver the device-timed forwards' seconds (`execute`). Called after a step's host read,
    when the device has done the work, so it waits for nothing."""
    with _unsettled_lock:
        laps = list(_unsettled)
        _unsettled.clear()
    for lap, record in laps:
        record(lap.seconds)


def drive(
    generators: dict,
    *,
    observe: Observer | None = None,
    timing: dict | None = None,
    verdicts: VerdictShare | None = None,
) -> dict:
    """Run step generators together (key -> generator); return key -> result. `timing` (key ->
    seconds) accumulates the host time each generator takes between its forwards, and its share
    of the batched requests (sampling, the gate, the rules: the per-row work the planner prices,
    viasd.costs). `verdicts`: a tensor-parallel rank's share of sampled `Check` verdicts.

    Each round answers, over every generator waiting for it, the first of:
      1. `Draw`, `Check` and `Gate` requests: one batched call per kind (on the device);
      2. `Read`s that decide what a row does next: one read of them all;
      3. the pending forwards of the earliest tier in TIER_ORDER: one batched forward per cache
         (drafting rounds first, rows leaving as their blocks end; then one slim forward over the
         `via` rows; then one full forward over the `ar` rows, the `sd` blocks and the escalated
         `via` rows);
      4. every other `Read`: one read of them all (a step's committed tokens and counts);
      5. then every `Score`: one read of them all (the logprobs rows asked for).
    """
    results, pending = {}, {}
    read = False
    for key, gen in generators.items():
        _advance(key, gen, None, pending, results, timing, first=True)
    while pending:
        asks = [k for k, x in pending.items() if isinstance(x, (Draw, Check, Gate))]
        decides = [k for k, x in pending.items() if isinstance(x, Read) and x.decides]
        forwards = [k for k, x in pending.items() if isinstance(x, Forward)]  # (the rest: Read, Score)
        if asks:
            answers = {}
            check = _check if verdicts is None else lambda asks: _check(asks, verdicts)
            for kind, answer in ((Draw, _draw), (Check, check), (Gate, _gate)):
                keys = [k for k in asks if isinstance(pending[k], kind)]
                if keys:
                    t0 = time.perf_counter()
                    answers.update(zip(keys, answer([pending[k] for k in keys])))
                    _share(timing, keys, time.perf_counter() - t0)
        elif decides or not forwards:
            keys = decides or [k for k, x in pending.items() if isinstance(x, Read)]
            if keys:
                answers = dict(zip(keys, _read([pending[k] for k in keys])))
            else:
                keys = list(pending)
                parts = [(x.logits, x.tokens, x.k, x.tier) for x in (pending[k] for k in keys)]
                answers = dict(zip(keys, batch_logprobs(parts)))
            read = True
        else:
            tier = min(TIER_ORDER[pending[k].tier.name] for k in forwards)
            keys = [k for k in forwards if TIER_ORDER[pending[k].tier.name] == tier]
            answers = dict(zip(keys, execute([pending[k] for k in keys], observe=observe)))
        for key, answer in answers.items():
            _advance(key, generators[key], answer, pending, results, timing)
    if read:
        settle()
    return results


def _share(timing: dict | None, keys: list, seconds: float) -> None:
    if timing is not None:
        for key in keys:
            timing[key] = timing.get(key, 0.0) + seconds / len(keys)


def _draw(asks: list[Draw]) -> list[tuple[Tensor, Tensor | None]]:
    """Every `Draw` at once: one token per row; greedy rows take the argmax of their logits (no
    distribution is built: their answer's probabilities are None), the others draw from their
    sampler's distribution (`sampling.batch_probs`, `sampling.sample_rows`)."""
    out: list = [None] * len(asks)
    for greedy, idx in _by_greed(asks):
        group = [asks[i] for i in idx]
        sizes = [a.logits.shape[0] for a in group]
        logits = _penalised(group, _rows([a.logits for a in group]), sizes)  # [N, V]
        if greedy:
            answers = zip(logits.argmax(dim=-1).split(sizes), [None] * len(group))
        else:
            samplers = [a.sampler for a, n in zip(group, sizes) for _ in range(n)]
            probs = batch_probs(logits, samplers)  # [N, V]
            gens = [a.generator for a, n in zip(group, sizes) for _ in range(n)]
            answers = zip(sample_rows(probs, [False] * len(samplers), gens).split(sizes), probs.split(sizes))
        for i, answer in zip(idx, answers):
            out[i] = answer
    return out


def _check(asks: list[Check], share: VerdictShare | None = None) -> list[tuple[Tensor, Tensor | None]]:
    """Every `Check` at once over the ragged blocks: greedy blocks compare the draft with the
    argmax of the verifier's logits (`rules.verify_greedy`; no distribution is built, the answer's
    q is None), the others run their rules on their sampler's distributions (`rules.verify_rows`;
    on a follower of `share`, rank 0's verdicts, p unread)."""
    out: list = [None] * len(asks)
    for greedy, idx in _by_greed(asks):
        group = [asks[i] for i in idx]
        lengths = [a.draft.shape[0] for a in group]
        logits = _penalised(group, _rows([a.logits for a in group]), [n + 1 for n in lengths])  # [M + B, V]
        draft = torch.cat([a.draft for a in group])  # [M]
        if greedy:
            verdicts, q = _stacked(verify_greedy(logits.argmax(dim=-1), draft, lengths)), [None] * len(group)
        else:
            samplers = [a.sampler for a, n in zip(group, lengths) for _ in range(n + 1)]
            probs = batch_probs(logits, samplers)  # [M + B, V]
            verdicts, q = _sampled_verdicts(group, probs, draft, lengths, share), probs.split([n + 1 for n in lengths])
        for i, answer in zip(idx, zip(verdicts.unbind(0), q)):
            out[i] = answer
    return out


def _sampled_verdicts(
    group: list[Check], probs: Tensor, draft: Tensor, lengths: list[int], share: VerdictShare | None
) -> Tensor:
    """[B, 4] verdicts of sampled blocks (q = probs [M + B, V], draft [M]): decided here by their
    rules against p (`rules.verify_rows`), or, on a follower of `share`, rank 0's, received after
    consuming the same random draws. Blocks whose p is p(x~) alone ([k]) are left pending where
    rejected; beside blocks with whole rows they run as rows holding p(x~) alone, token masked."""
    generators = [a.generator for a in group]
    if share is not None and not share.leader:
        skip_verify_draws(lengths, generators, probs.device)
        return share.follow(len(group), probs.device)
    point = [a.p.ndim == 1 for a in group]
    parts = [a.p.to(device=probs.device, dtype=probs.dtype) for a in group]  # [k, V] or [k] each
    if any(point) and not all(point):
        parts = [
            torch.zeros(a.draft.shape[0], probs.shape[1], dtype=probs.dtype, device=probs.device).scatter_(
                1, a.draft[:, None], x[:, None]
            )  # [k, V]: p(x~) at the draft tokens
            if pt
            else x
            for a, x, pt in zip(group, parts, point)
        ]
    rules = [a.rule for a in group]
    verdict = verify_rows(rules, torch.cat(parts), probs, draft, lengths, [False] * len(group), generators)
    verdicts = _stacked(verdict)
    if any(point) and not all(point):
        pending = torch.tensor(point, device=probs.device) & ~verdict.bonus  # [B]
        verdicts[:, 1] = torch.where(pending, -1, verdicts[:, 1])
    if share is not None:
        share.lead(verdicts)
    return verdicts


def _stacked(v) -> Tensor:
    """A `rules.BatchVerdict` as [B, 4] long: accepted count, committed token (-1: pending),
    bonus as 0/1, the bits of the token's float64 uniform (0 for greedy blocks)."""
    u = torch.zeros_like(v.num_accepted) if v.u is None else v.u.view(torch.long)  # [B]
    return torch.stack([v.num_accepted, v.token, v.bonus.long(), u], dim=-1)


def _gate(asks: list[Gate]) -> list[Tensor]:
    """Every `Gate` at once (`rules.gate_rows`). The ratio r = q'(x) / max q' comes straight from
    the logits, exp((z_x - max z) / t), when no row filters its gate distribution (top-k, top-p,
    min-p), else from the distributions (`Sampler.gate_probs`)."""
    order = sorted(range(len(asks)), key=lambda i: asks[i].logits.data_ptr())  # (memory order: `_by_greed`)
    asks = [asks[i] for i in order]
    lengths = [a.draft.shape[0] for a in asks]
    samplers = [a.sampler.for_gate for a, n in zip(asks, lengths) for _ in range(n)]
    logits = _penalised(asks, _rows([a.logits for a in asks]), lengths)  # [M, V]
    draft = torch.cat([a.draft for a in asks])  # [M]
    if all(s.top_k == 0 and s.top_p == 1.0 and s.min_p == 0.0 for s in samplers):
        z = logits.gather(-1, draft[:, None])[:, 0] - logits.amax(dim=-1)  # [M] log r * t
        t = torch.tensor([s.temperature for s in samplers], dtype=z.dtype, device=z.device)  # [M]
        ratio = torch.exp(z / t)  # [M]
    else:
        ratio = gate_ratio(batch_probs(logits, samplers), draft)  # [M]
    alpha1, alpha2, rewrite = [a.alpha1 for a in asks], [a.alpha2 for a in asks], [a.rewrite for a in asks]
    decisions = gate_rows(ratio, lengths, alpha1, alpha2, rewrite).unbind(0)  # [2] per ask
    out: list = [None] * len(asks)
    for i, decision in zip(order, decisions):
        out[i] = decision
    return out


def _penalised(asks: list, logits: Tensor, sizes: list[int]) -> Tensor:
    """The asks' logits rows [N, V] with each request's penalties applied (`sampling.penalise_rows`)."""
    if all(a.context is None for a in asks):
        return logits
    return penalise_rows(logits, [a.context for a in asks], sizes)


def _by_greed(asks: list) -> list[tuple[bool, list[int]]]:
    """The indices of the greedy asks and of the others (each group non-empty), each in the order
    their logits lie in memory (so that `_rows` can view a forward's rows instead of copying them)."""
    groups: dict[bool, list[int]] = {}
    for i in sorted(range(len(asks)), key=lambda i: asks[i].logits.data_ptr()):
        groups.setdefault(asks[i].sampler.greedy, []).append(i)
    return list(groups.items())


def _read(asks: list[Read]) -> list[list[int]]:
    """Every `Read` with one transfer to the host."""
    flat = torch.cat([a.values.reshape(-1).long() for a in asks]).tolist()
    ends = list(itertools.accumulate(a.values.numel() for a in asks))
    return [flat[end - a.values.numel() : end] for a, end in zip(asks, ends)]


def _rows(parts: list[Tensor]) -> Tensor:
    """Logits rows of many requests as one [N, V] tensor (float64 if any is): a view when they lie
    one after the other in one tensor (a forward's rows, asked for in order), else a copy."""
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
    parts = [p.to(dtype) for p in parts]
    first, n = parts[0], sum(p.shape[0] for p in parts)
    step = first.stride(0) * first.element_size()
    adjacent = all(
        p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts
    )
    adjacent = adjacent and all(b.data_ptr() == a.data_ptr() + a.shape[0] * step for a, b in zip(parts, parts[1:]))
    if adjacent:
        return first.as_strided((n, first.shape[1]), first.stride())
    return torch.cat(parts)


def _advance(key, gen: Steps, value, pending: dict, results: dict, timing: dict | None, first: bool = False) -> None:
    t0 = time.perf_counter()
    try:
        pending[key] = next(gen) if first else gen.send(value)
    except StopIteration as done:
        pending.pop(key, None)
        results[key] = done.value
    if timing is not None:
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - t0


def to_host(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Integer tensors to lists with one read (served: drafted blocks to the wire)."""
    return _read([Read(t) for t in tensors]) if tensors else []


def run_alone(steps: Steps):
    """Run one step generator by itself (batch of one); return its result."""
    return drive({0: steps})[0]


# ---------------------------------------------------------------- outcomes, commits, seeds


def request_seeds(seed: int) -> tuple[int, int]:
    """Seeds of the drafter's and the verifier's random streams for a request seed.

    Each side owns its stream, so the same seed gives the same tokens whether the two sides run
    in one process (this engine) or in separate actors (the service).
    """
    return seed, (seed + 0x9E3779B97F4A7C15) % 2**63


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of an n > 1 request with seed `seed`: sample 0 keeps the seed, so
    n = 1 is the request itself; each sample equals the same request alone with this seed."""
    return (seed + index * 0xD1B54A32D192ED03) % 2**63


@dataclass
class Correction:
    """The last token of a block rejected on its draft tokens' probabilities alone (probability
    only, docs/SERVING.md "Draft data on the wire"): drawn where the drafter's rows are
    (`rules.correct_rows`) from q's row at the rejection, at the block's uniform u."""

    q: Tensor  # [V] the verifier's distribution at the rejected position
    u: float  # in [0, 1)


@dataclass
class Outcome:
    """What the verifier decided for one block (or one `ar` step)."""

    tokens: list[int]  # committed: the accepted draft prefix, then the rewritten / recovered / bonus token(s)
    num_draft_accepted: int  # how many of `tokens` are draft tokens: caches stay valid up to n + this
    logprobs: list[TokenLogprob] | None = None  # one per token when the request asks for logprobs
    escalated: bool = False  # the block went to q (a `via` cycle's region C, `staged`)
    correction: Correction | None = None  # the last token is still to be drawn: `tokens` lacks it


def valid_after(pos: int, seq_len: int, outcome: Outcome) -> int:
    """A tier's valid positions after a commit: it held `pos` of a sequence of `seq_len`
    committed tokens; what it fed stays valid up to the accepted draft tokens, and never past
    the new last token (the next forward must feed it to get the distribution after it)."""
    count = len(outcome.tokens) + (outcome.correction is not None)
    return min(pos, seq_len + outcome.num_draft_accepted, seq_len + count - 1)


def drafter_lag(seq_len: int, fed: int) -> int:
    """Context tokens a drafter that fed `fed` positions of `seq_len` has not fed beyond the one
    its next round feeds, when more than CATCH_UP (else 0: they ride along in that round)."""
    lag = seq_len - 1 - fed
    return lag if lag > CATCH_UP else 0


def _float64(bits: int) -> float:
    """The float64 whose bit pattern is the int64 `bits` (a uniform read with a verdict)."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _commit(seq: list[int], tiers: Sequence[_Tier], outcome: Outcome) -> None:
    """Append committed tokens and roll every tier back to the positions that are still valid."""
    for tier in tiers:
        tier.pos = valid_after(tier.pos, len(seq), outcome)
    seq.extend(outcome.tokens)


def block_generator(seed: int, block: int, device) -> torch.Generator:
    """The drafter's random stream for draft block `block` of a request (used with `overlap`):
    a block drafted ahead and a block drafted on demand draw the same numbers, so the output
    depends on the seed only, never on how far the drafter got ahead."""
    return torch.Generator(device=device).manual_seed((seed * 0x100000001B3 + block) % 2**63)


class _Session:
    """What both sides share: the committed sequence, the tiers, their prefill and release."""

    seq: list[int]
    tiers: list[_Tier]
    stats: RequestStats

    def prefill_steps(self, upto: int, budget: int) -> list[Forward]:
        """Prefill chunks (no logits) of every tier of this side up to `upto` positions, at most
        `budget` tokens each; [] when prefilled."""
        return [f for t in self.tiers if (f := t.prefill(self.seq, upto, budget, self.stats)) is not None]

    def prefilled(self, forward: Forward, logits: Tensor) -> list[TokenLogprob]:
        """What a prefill forward of this side scored (logits [num_logits, V]); nothing by default."""
        return []

    def copy_prefill(self, leader: _Session) -> None:
        """Take the prefilled prompt of another request's session of this side (same prompt, same
        tiers): its keys/values are copied row to row instead of recomputed (n > 1 samples)."""
        prefilled, done = len(self.seq) - 1, set()  # the prompt but its last token (the leader may be further)
        assert leader.seq[:prefilled] == self.seq[:prefilled]
        for tier, lead in zip(self.tiers, leader.tiers):
            assert tier.name == lead.name and lead.pos >= prefilled, (tier.name, lead.name, lead.pos, prefilled)
            if (id(tier.cache.store), tier.cache.row) not in done:  # a shared q / q' row is copied once
                tier.cache.copy_from(lead.cache, prefilled)
                done.add((id(tier.cache.store), tier.cache.row))
            tier.pos = prefilled

    def release(self) -> None:
        """Give the tiers' cache rows back (once per distinct row)."""
        for cache in {(id(t.cache.store), t.cache.row): t.cache for t in self.tiers}.values():
            cache.release()

    def kv_bytes(self) -> int:
        """Bytes of valid keys/values this side holds (shared rows counted once)."""
        return sum(c.nbytes() for c in {(id(t.cache.store), t.cache.row): t.cache for t in self.tiers}.values())


class DraftSession(_Session):
    """The drafter's side of one request: its proposer (viasd.proposers), its cache row, its
    random stream, its block-length policy, its copy of the sequence. `lm` may be None for `ngram`.

    With `overlap` (PEARL-style), `draft_ahead_steps` drafts the next block from the optimistic
    prefix (the committed sequence + the block under verification) while the verifier works;
    `commit` keeps the drafted-ahead tokens that the committed tokens agree with, as the start of
    the next block. Each kept token was drawn from p given exactly the prefix it ends up on, so
    the rules see a correct draft; each block has its own seeded stream (`block_generator`), so
    the output does not depend on timing; which blocks are drafted ahead at all (`drafts_ahead`:
    the rows likely to be accepted whole) follows the request's own outcomes.
    """

    def __init__(
        self,
        lm: MaskedLM | None,
        prompt: Sequence[int],
        params: GenerationParams,
        seed: int,
        stats: RequestStats,
        cache: RowCache | None = None,
    ):
        if lm is None and params.proposer != Proposer.NGRAM and params.mode != Mode.AUTO:
            raise InvalidParameterError("proposer", f"proposer {params.proposer.value!r} needs a drafter model")
        self.params = params
        self.tier = None
        if lm is not None and params.proposer != Proposer.NGRAM:
            self.tier = _Tier("drafter", lm, cache if cache is not None else lm.new_cache())
        self.tiers = [self.tier] if self.tier is not None else []
        self.device = lm.device if lm is not None else "cpu"
        self.seq = list(prompt)
        self.sampler = Sampler.from_params(params)
        self.penalties = None if lm is None else Penalties.for_request(params, prompt, lm.vocab_size, lm.device)
        self.seed = seed
        self.blocks = 0  # blocks proposed so far
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        if params.overlap:
            self.generator = block_generator(seed, 0, self.device)
        self.gamma = GammaPolicy(params.gamma, params.adaptive_gamma)
        self.stats = stats
        # drafted tokens live on the device, one [1] long tensor each (never read to draft or verify)
        self.last: list[Tensor] = []  # the block under verification ...
        self.last_p: list[Tensor] = []  # ... and its p rows [1, V] (sampled only)
        self.last_from_model = False
        self.ahead: list[Tensor] = []  # drafted past `last` by draft_ahead ...
        self.ahead_p: list[Tensor] = []
        self.ahead_generator: torch.Generator | None = None
        self.ahead_ended = False  # the drafted-ahead block ended on draft_confidence
        self.pending: list[Tensor] = []  # drafted tokens the committed sequence agreed with: the next block's start
        self.pending_p: list[Tensor] = []
        self.pending_ended = False
        self.stop = threading.Event()  # set by the verifier side when its outcome is in
        # running P(a block is accepted whole) and its evidence (costs.running_mean), from an
        # optimistic prior: overlap drafts ahead from the first block on (drafts_ahead)
        self.whole, self.whole_weight = 1.0, 1.0

    def propose(self, k: int) -> tuple[Tensor, Tensor | None]:
        """`propose_steps` alone."""
        return run_alone(self.propose_steps(k))

    def propose_steps(self, k: int, proposer: Proposer | None = None) -> Steps:
        """Propose at most k draft tokens; return them ([k'] long, on the device) and p [k', V], or
        None when p is a point mass at the draft tokens (greedy sampling, or an n-gram proposal). Fewer than k under
        adaptive drafting or a short n-gram match; none when the `ngram` proposer finds no match
        (the verifier then decodes one token itself). `proposer` overrides the request's (the
        plan of an `auto` request)."""
        params, k, proposer = self.params, self.gamma.length(k), proposer or self.params.proposer
        if proposer != Proposer.MODEL or self.tier is None:
            looked_up = ngram_lookup(self.seq, k, params.ngram_max)
            if looked_up or proposer == Proposer.NGRAM or self.tier is None:
                self.stats.ngram_draft_tokens += len(looked_up)
                self._drop_pending()
                tokens = torch.tensor(looked_up, dtype=torch.long, device=self.device)  # [k']
                return self._proposed(list(tokens.split(1)), [], from_model=False)
        draft, p_rows, ended = self.pending[:k], self.pending_p[:k], self.pending_ended
        self.stats.overlap_draft_tokens += len(draft)
        if len(self.pending) > k:  # the rest is not used: it must be fed again later
            self._drop_pending(keep=k)
        self.pending, self.pending_p, self.pending_ended = [], [], False
        if len(draft) < k and not ended:
            yield from self._draft_steps(draft, p_rows, k, self.generator)
        return self._proposed(draft, p_rows)

    def _draft_steps(
        self,
        draft: list[Tensor],
        p_rows: list[Tensor],
        k: int,
        generator: torch.Generator,
        stop: threading.Event | None = None,
    ) -> Steps:
        """Extend `draft` (after self.seq, or self.seq + self.last when drafting ahead) to k tokens
        with the drafter model, in place; stop early when `stop` is set (drafting ahead) or below
        `draft_confidence` (then return True: the block has ended; that test reads the host once
        a round)."""
        before = self.last if stop is not None else []
        # ahead, the first token is always drafted: whether the next block can start from the
        # drafted-ahead tokens must not depend on timing (the later ones come out the same
        # whether drafted ahead or on demand: same prefix, same stream)
        while len(draft) < k and not (stop is not None and stop.is_set() and draft):
            tail = torch.cat(before + draft) if before or draft else None  # [n] the drafted context
            logits = yield self.tier.ask(self.seq, 1, self.stats, tail)  # [1, V]
            context = None  # (with penalties, row 0 follows seq + the whole drafted context)
            if self.penalties is not None:
                context = Penalised(self.penalties, self.seq, () if tail is None else tail, len(before) + len(draft))
            token, p = yield Draw(logits, self.sampler, generator, context)  # [1], [1, V]
            draft.append(token)
            if not self.sampler.greedy:
                p_rows.append(p)
            if len(draft) < k and self.params.draft_confidence > 0.0:
                confidence = torch.softmax(logits[0].float(), dim=-1)[token]  # [1] p_{T=1}(x~_j)
                (low,) = yield Read(confidence < self.params.draft_confidence, decides=True)
                if low:
                    return True
        return False

    def _proposed(
        self, draft: list[Tensor], p_rows: list[Tensor], from_model: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        self.last, self.last_p, self.last_from_model = draft, p_rows, from_model and bool(draft)
        self.blocks += 1
        # [k'], [k', V] (None: a point mass)
        tokens = torch.cat(draft) if draft else torch.zeros(0, dtype=torch.long, device=self.device)
        return tokens, torch.cat(p_rows) if p_rows else None

    @property
    def lag(self) -> int:
        """Context tokens the drafter has not fed beyond the one its next round feeds, when more
        than CATCH_UP (else 0): an `auto` request's drafter is fed only when a plan drafts, and
        a long lag is fed by one catch-up prefill forward (`catch_up_steps`) before drafting;
        fewer ride along in the first drafting round."""
        return 0 if self.tier is None else drafter_lag(len(self.seq), self.tier.pos)

    def catch_up_steps(self) -> list[Forward]:
        """The catch-up prefill of a lagging drafter ([] when it does not lag)."""
        return self.prefill_steps(len(self.seq) - 1, len(self.seq)) if self.lag else []

    def copy_prefill(self, leader: DraftSession) -> None:
        """As for every side; a leader whose drafter was never fed (`auto`: lazy) leaves this
        one lazy too."""
        if self.tier is None or leader.tier.pos >= len(self.seq) - 1:
            super().copy_prefill(leader)

    def skip(self) -> None:
        """This cycle proposes nothing (an `auto` request's `ar` step): the verifier decodes alone."""
        self.last, self.last_p, self.last_from_model = [], [], False

    def draft_ahead(self) -> None:
        """`draft_ahead_steps` alone."""
        run_alone(self.draft_ahead_steps())

    def drafts_ahead(self) -> bool:
        """Overlap: whether to draft the next block while this one is verified. A block drafted
        ahead is kept only when the block under verification is accepted whole (and the
        verifier's next token is the drafter's first guess); otherwise the drafter's forwards
        beside the verifier's were spent for nothing. So only a model-drafted block of a request
        whose blocks are accepted whole at least AHEAD_MIN of the time (running mean) drafts ahead."""
        return self.params.overlap and self.last_from_model and self.whole >= AHEAD_MIN

    def draft_ahead_steps(self) -> Steps:
        """Overlap: draft the next block from self.seq + self.last, until `stop` is set (the
        outcome of `last` is in) or the block is full. Runs beside the verifier's forward."""
        self.ahead, self.ahead_p = [], []
        self.ahead_generator = block_generator(self.seed, self.blocks, self.device)
        if not self.last_from_model:  # (n-gram blocks have no p rows to continue; the lookup is free anyway)
            return
        self.ahead_ended = yield from self._draft_steps(
            self.ahead, self.ahead_p, self.gamma.length(self.params.gamma), self.ahead_generator, self.stop
        )

    def _drop_pending(self, keep: int = 0) -> None:
        """Forget pending tokens past `keep`: the cache must not count them as fed."""
        if self.tier is not None:
            self.tier.pos = min(self.tier.pos, len(self.seq) + keep - 1)
        self.pending, self.pending_p = self.pending[:keep], self.pending_p[:keep]
        self.pending_ended = False

    def commit(self, outcome: Outcome) -> None:
        """Append the committed tokens. With overlap, keep what was drafted past them if they
        agree with the drafter's own optimistic continuation (last block + drafted ahead; read
        to the host once to compare)."""
        self.gamma.update(len(self.last), outcome.num_draft_accepted)
        if self.last:
            whole = float(outcome.num_draft_accepted >= len(self.last))
            self.whole, self.whole_weight = running_mean(self.whole, self.whole_weight, whole)
        committed = outcome.tokens
        optimistic, optimistic_p = self.last + self.ahead, self.last_p + self.ahead_p
        if self.params.overlap:
            agree = self.ahead and torch.cat(optimistic).tolist()[: len(committed)] == committed
            if agree:  # every fed token stays valid
                self.seq.extend(committed)
                self.pending = optimistic[len(committed) :]
                self.pending_p = optimistic_p[len(committed) :] if optimistic_p else []
                # the next block goes on with the stream it was drafted ahead with; it has ended only
                # if its low-confidence last token is still pending (not committed already)
                self.generator, self.pending_ended = self.ahead_generator, self.ahead_ended and bool(self.pending)
                self._clear_ahead()
                return
            self.generator = block_generator(self.seed, self.blocks, self.device)
        self._clear_ahead()
        self.pending, self.pending_p, self.pending_ended = [], [], False
        _commit(self.seq, self.tiers, outcome)

    def _clear_ahead(self) -> None:
        self.ahead, self.ahead_p, self.ahead_generator, self.ahead_ended = [], [], None, False
        self.stop.clear()


class VerifySession(_Session):
    """The verifier's side of one request: q and q' (q masked, same weights), the gate and the rules.

    Logits never leave this object: it returns decisions and sampled tokens only. `full_cache`
    and `slim_cache` are its cache rows (new one-row caches by default); under the shared policy
    q' uses q's row for the layers it keeps.
    """

    def __init__(
        self,
        lm: MaskedLM,
        mask: LayerMask,
        cache_policy: CachePolicy,
        prompt: Sequence[int],
        params: GenerationParams,
        seed: int,
        stats: RequestStats,
        full_cache: RowCache | None = None,
        slim_cache: RowCache | None = None,
    ):
        self.params = params
        self.full = _Tier("full", lm, full_cache if full_cache is not None else lm.new_cache())
        self.slim = None
        self.shared = CachePolicy(cache_policy) == CachePolicy.SHARED  # q' writes into q's slots of the kept layers
        if uses_slim(params):
            if self.shared:
                slim_cache = self.full.cache
            self.slim = _Tier("slim", lm, slim_cache if slim_cache is not None else lm.new_cache(mask), mask)
        self.tiers = [t for t in (self.slim, self.full) if t is not None]
        self.seq = list(prompt)
        self.prompt_len = len(prompt)
        self.scored = 0  # prompt positions whose logprobs a prefill chunk returned (prompt_logprobs)
        self.sampler = Sampler.from_params(params)
        self.penalties = Penalties.for_request(params, prompt, lm.vocab_size, lm.device)
        self.rule = rule_from_params(params)
        self.generator = torch.Generator(device=lm.device).manual_seed(seed)
        self.stats = stats
        self.unsettled = False  # its last committed block's token is still being drawn (`settle`)

    def prefill_steps(self, upto: int, budget: int) -> list[Forward]:
        """Prefill q (and q' under the separate policy), or roll them back (`_Tier.prefill`). Under
        the shared policy q' reads q's keys/values of the prompt for the layers it keeps: its
        position follows q's. With prompt logprobs, the full tier returns the logits of the prompt
        positions it feeds that no chunk scored before (a preempted request's recomputed prefill
        scores nothing twice)."""
        scoring = self.params.prompt_logprobs is not None and self.scored < self.prompt_len - 1
        full = self.full.prefill(self.seq, upto, budget, self.stats, score_from=self.scored if scoring else None)
        if full is not None and full.num_logits:
            self.scored = full.start + len(full)
        slim = None
        if self.slim is not None and not self.shared:
            slim = self.slim.prefill(self.seq, upto, budget, self.stats)
        elif self.slim is not None:
            self.slim.pos = self.full.pos
        return [f for f in (slim, full) if f is not None]

    def prefilled(self, forward: Forward, logits: Tensor) -> list[TokenLogprob]:
        """Prompt logprobs: the logits of the last num_logits fed positions i score prompt tokens i + 1."""
        if not forward.num_logits or self.params.prompt_logprobs is None:
            return []
        first = forward.start + len(forward) - forward.num_logits
        scored = self.seq[first + 1 : first + 1 + forward.num_logits]
        return token_logprobs(logits, scored, self.params.prompt_logprobs)

    def copy_prefill(self, leader: VerifySession) -> None:
        """As for every side; the prompt counts as scored (the scheduler copies the leader's logprobs)."""
        super().copy_prefill(leader)
        self.scored = len(self.seq) - 1

    def _context(self, block: Sequence[int] | Tensor = (), first: int = 0) -> Penalised | None:
        """The logits the request samples from: penalised given self.seq + block[:t] for row t."""
        return None if self.penalties is None else Penalised(self.penalties, self.seq, block, first)

    def _logprobs(self, logits: Tensor, tokens: list[int], tier: str = "full") -> Steps:
        """The committed tokens' logprobs from raw logits [len(tokens), V], when the request asks for them."""
        k = self.params.logprobs
        return None if k is None else (yield Score(logits[: len(tokens)], tokens, k, tier))

    def decode_one(self) -> Outcome:
        """`decode_one_steps` alone."""
        return run_alone(self.decode_one_steps())

    def check(self, draft: Sequence[int] | Tensor, p: Tensor | None) -> Outcome:
        """`check_steps` alone."""
        return run_alone(self.check_steps(torch.as_tensor(draft, dtype=torch.long, device=self.full.lm.device), p))

    def decode_one_steps(self) -> Steps:
        """`ar`: one forward of q, one token."""
        logits = yield self.full.ask(self.seq, 1, self.stats)  # [1, V]
        token, _ = yield Draw(logits, self.sampler, self.generator, self._context())  # [1]
        tokens = yield Read(token)
        return Outcome(tokens, 0, (yield from self._logprobs(logits, tokens)))

    def check_steps(self, draft: Tensor, p: Tensor | None, mode: Mode | None = None) -> Steps:
        """Verify a draft block (draft [k] long on the device; p [k, V], or None when it is a point
        mass at the draft tokens: greedy or n-gram drafts) with the request's mode (or `mode`, the
        plan of an `auto` request: sd or via); an empty draft decodes one token."""
        if not draft.shape[0]:
            return (yield from self.decode_one_steps())
        if p is None and not self.sampler.greedy:  # p is one-hot at the draft tokens (greedy blocks need no p)
            p = torch.zeros(draft.shape[0], self.full.lm.vocab_size, device=draft.device)
            p = p.scatter_(1, draft[:, None], 1.0)  # [k, V]
        if (mode or self.params.mode) == Mode.SD:
            return (yield from self._full_verify_steps(draft, p, 0))
        if self.params.rule == Rule.STAGED:
            return (yield from self._check_staged_steps(draft, p))
        return (yield from self._check_via_steps(draft, p))

    def _full_verify_steps(self, draft: Tensor, p: Tensor, start: int) -> Steps:
        """q scores the whole block in one forward; its rule decides positions start..k-1."""
        k, stats = draft.shape[0], self.stats
        logits = yield self.full.ask(self.seq, k + 1, stats, draft)  # [k + 1, V]
        rows = None if p is None else p[start:]  # [k - start, V]
        context = self._context(draft, start)
        verdict, q = yield Check(self.rule, rows, logits[start:], draft[start:], self.sampler, self.generator, context)
        *block, j, token, bonus, u = yield Read(torch.cat([draft, verdict]))  # the step's one read
        stats.count_accepted(range(start, start + j))
        stats.num_rejected_tokens += 0 if bonus else 1
        stats.num_bonus_tokens += bonus
        stats.num_cycle_tokens += start + j + 1
        if token < 0:  # probability only: the drafter draws the correction (`Outcome.correction`)
            return Outcome(block[: start + j], start + j, correction=Correction(q[j], _float64(u)))
        tokens = block[: start + j] + [token]
        return Outcome(tokens, start + j, (yield from self._logprobs(logits, tokens)))

    def _check_via_steps(self, draft: Tensor, p: Tensor) -> Steps:
        """Steps 2-4 of the VIA-SD cycle: slim-verify with the gate, then rewrite or escalate."""
        k, params, stats = draft.shape[0], self.params, self.stats
        slim_raw = yield self.slim.ask(self.seq, k + 1, stats, draft)  # [k + 1, V]
        rewrite = params.region_b == RegionB.REWRITE
        decision = yield Gate(
            slim_raw[:k], draft, params.alpha1, params.alpha2, rewrite, self.sampler, self._context(draft)
        )
        i, region = yield Read(decision, decides=True)  # draft[:i] accepted by q'; the region at i
        stats.slim_accepted += i
        stats.count_accepted(range(i))

        if i == k:  # region A everywhere: the block is committed on q''s word
            extra = []
            if params.slim_bonus:
                bonus, _ = yield Draw(slim_raw[k:], self.sampler, self.generator, self._context(draft, k))  # [1]
                extra, stats.num_bonus_tokens = [bonus], stats.num_bonus_tokens + 1
            tokens = yield Read(torch.cat([draft, *extra]))
            stats.num_cycle_tokens += len(tokens)
            return (yield from self._slim_outcome(Outcome(tokens, k), slim_raw))
        if region == Region.REWRITE:  # region B: q' writes position i itself
            stats.slim_rewritten += 1
            stats.num_rejected_tokens += 1
            stats.num_cycle_tokens += i + 1
            token, _ = yield Draw(slim_raw[i : i + 1], self.sampler, self.generator, self._context(draft, i))  # [1]
            tokens = yield Read(torch.cat([draft[:i], token]))
            return (yield from self._slim_outcome(Outcome(tokens, i), slim_raw))
        # region C: q decides positions i..k-1 with the speculative-sampling rule
        stats.escalations += 1
        stats.escalated_tokens += k - i
        outcome = yield from self._full_verify_steps(draft, p, i)
        stats.full_accepted += outcome.num_draft_accepted - i
        outcome.escalated = True
        return outcome

    def _check_staged_steps(self, draft: Tensor, p: Tensor) -> Steps:
        """The staged (cascade) cycle, lossless: q' filters and corrects the draft, q verifies the result.

        Stage 1, q' against p: speculative sampling with a = min(1, q'/p) keeps a prefix
        x~_1..x~_j, then commits y_{j+1} from norm(max(0, q'_{j+1} - p_{j+1})), or the bonus y_{k+1}
        ~ q'_{k+1} when all k pass. Every y_i of the filtered block y = x~_1..x~_j, y_{j+1} is
        therefore distributed as q'_i given y_{<i} (the lossless rule's output law), and whether
        the block goes on after y_i depends only on y_{<=i} and stage 1's coins.
        Stage 2, q against q': the lossless rule with proposal r_i = q'_i over y, bonus q_{j+2}.
        Speculative sampling is exact for any proposal whose i-th token follows a known law given
        the tokens before it, with a block length decided from the past, so the committed tokens
        follow q exactly. Greedy: y is q''s greedy continuation up to its first disagreement
        with the draft, plus that correction; q keeps its agreeing prefix (output == ar).
        Costs per cycle: k drafter forwards, one q' forward over k + 1 positions and one q forward
        over j + 2 positions; it can pay over `sd` only where q accepts y for longer than it would
        accept x~ by enough to cover the slim forward. Reads the host twice: j, then the outcome.
        """
        k, stats, sampler = draft.shape[0], self.stats, self.sampler
        slim_raw = yield self.slim.ask(self.seq, k + 1, stats, draft)  # [k + 1, V]
        first, slim = yield Check(Lossless(), p, slim_raw, draft, sampler, self.generator, self._context(draft))
        j, _, first_bonus, _ = yield Read(first, decides=True)
        block = torch.cat([draft[:j], first[1:2]])  # [j + 1] y
        stats.slim_accepted += j
        stats.slim_rewritten += 0 if first_bonus else 1
        stats.escalations += 1
        stats.escalated_tokens += j + 1
        logits = yield self.full.ask(self.seq, j + 2, stats, block)  # [j + 2, V]
        proposal = None if slim is None else slim[: j + 1]  # [j + 1, V] q' (None: greedy, a point mass)
        second, _ = yield Check(Lossless(), proposal, logits, block, sampler, self.generator, self._context(block))
        *y, a, token, bonus, _ = yield Read(torch.cat([block, second]))
        stats.full_accepted += a
        stats.count_accepted(range(a))
        stats.num_rejected_tokens += 0 if bonus else 1
        stats.num_bonus_tokens += bonus
        stats.num_cycle_tokens += a + 1
        # the drafter and q' saw x~, q saw y: caches stay valid where the committed tokens are draft tokens
        tokens = y[:a] + [token]
        return Outcome(tokens, min(a, j), (yield from self._logprobs(logits, tokens)), escalated=True)

    def _slim_outcome(self, outcome: Outcome, slim_logits: Tensor) -> Steps:
        """A cycle q' committed alone: its logprobs from q' ('slim', free) or from q recomputed
        over the cycle's tokens ('full': one full forward, feeding what q would feed next anyway)."""
        if self.params.logprobs is None:
            return outcome
        tokens = outcome.tokens
        if self.params.logprobs_tier == LogprobTier.SLIM:
            outcome.logprobs = yield from self._logprobs(slim_logits, tokens, "slim")
            return outcome
        logits = yield self.full.ask(self.seq + tokens[:-1], len(tokens), self.stats)  # [len(tokens), V]
        outcome.logprobs = yield from self._logprobs(logits, tokens)
        return outcome

    def commit(self, outcome: Outcome) -> None:
        """Append the tokens; roll q and q' back. Under the shared policy an escalation made q
        rewrite the kept layers' slots from its own position on, so after it both tiers hold q's
        keys/values up to the same valid length. An outcome with a `correction` leaves the
        session unsettled until `settle` hands it the drawn token."""
        _commit(self.seq, self.tiers, outcome)
        self.unsettled = outcome.correction is not None

    def settle(self, token: int) -> None:
        """The drawn last token of the block committed unsettled."""
        if not self.unsettled:
            raise InvalidParameterError("settles", "the request has no token to settle")
        self.seq.append(token)
        self.unsettled = False


def uses_slim(params: GenerationParams) -> bool:
    """Whether a request may run the slim verifier: `via`, or `auto` allowed lossy plans."""
    return params.mode == Mode.VIA or (params.mode == Mode.AUTO and params.auto_lossy)
