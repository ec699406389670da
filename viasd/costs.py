"""The engine's own cost curve: forward seconds per tier, profiled at start and corrected online,
and the running acceptance estimates that say what a speculative plan buys.

A batched forward of B rows is right-padded to its longest row, T tokens, so every weight matmul
is [M, H] x [H, H'] with M = B * T; attention, the cache's gathers and the per-row work grow with
B apart from M. The profile measures a rows x tokens grid (GRID, after PREFIX cached positions):

    grid(tier, B, T) = one(tier, B * T) * rho(tier, B, T)
    one(M)      the 1-row points, interpolated linearly, extrapolated from the last two
    rho(B, T)   grid(b, T) / one(b * T) at the profiled batches b (1 at b = 1): linear in T
                between a batch's points (the nearest one outside them), linear in B between
                batches, the largest batch's beyond it
    grid(B < 1, T) = B * grid(1, T)     (the expected cost of a row that runs with probability B)

Each point is a best-of-2, made `monotone` (a point dearer than one with as many rows and tokens
or more is noise). The grid is cached as JSON under the model cache, keyed by model fingerprint,
device, dtype, threads, mask, CPU capability and native bf16. An `online` model then learns from
the forwards the engine runs (long contexts, per-row work the grid does not see):

    seconds(tier, B, T) = grid(tier, B, T) * g[tier] * r[tier][bucket(B, T)]
    step seconds       += sum_rows overhead[plan kind] * logit rows   (overhead: EMA per kind)
                        + transport[call] per served call             (served: EMA per call kind)

A logit row is a position the step samples or judges (viasd.planner.logit_rows). g[tier] is an
EMA of observed / predicted over every forward of the tier (a uniformly slower machine); r is a
running mean (`running_mean`, decay SHAPE_DECAY) of the residual observed / (grid * g) at the
grid point nearest (B, T) in (log B * T, log B). After each update the observed sizes' r are
divided by their evidence-weighted geometric mean and g multiplied by it, so sizes never observed
keep the profile's shape, scaled by g. A call's transport is its round trip less the seconds the
service reports (`StepTimes`), learnt apart from the forwards so a fixed cost is not read as a
slower forward.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from viasd.runtime import Lap, LayerMask, MaskedLM, Row

#: (rows, tokens per row) of every profiled forward: the 1-row curve, and two batches at 1 and 4 tokens
GRID = ((1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (1, 32), (1, 64), (4, 1), (4, 4), (16, 1), (16, 4))
PREFIX = 128  # cached positions each profiled row attends to (a served request's context, roughly)

Point = tuple[int, int, float]  # (rows, tokens per row, seconds)
PROFILE_METHOD = "best-of, one prefill per row count, monotone"  # (in the cache key: a new method measures afresh)


def _line(points: Sequence[tuple[float, float]], x: float) -> float:
    """y at x on the polyline through `points` (x ascending), extended from its last two points
    (from its first below the first x: clamped)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (max(x, x0) - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def _clamped(points: Sequence[tuple[float, float]], x: float) -> float:
    """y at x on the polyline through `points` (x ascending), the nearest end's y outside it."""
    if x <= points[0][0]:
        return points[0][1]
    return _line(points, x) if x < points[-1][0] else points[-1][1]


@dataclass
class StepTimes:
    """What `viasd.sessions.drive` measured of one step: each batched forward (tier, rows, padded
    tokens per row, seconds; `observe` is drive's observer) and each row's work between its
    forwards (request key -> seconds; drive's `timing`). The scheduler's cost model learns from
    it; served, each service sends its own with its answer (`Forward`, `work_seconds`), and each
    call's round trip beyond the seconds its service spent is `transport`."""

    forwards: list[tuple[str, int, int, float]] = field(default_factory=list)
    work: dict = field(default_factory=dict)
    transport: dict[str, float] = field(default_factory=dict)  # served: call -> seconds outside its service

    def observe(self, tier: str, rows: int, tokens: int, seconds: float) -> None:
        self.forwards.append((tier, rows, tokens, seconds))

    def join(self, other: StepTimes) -> None:
        """Add another part's figures (served: each call's answer): its forwards and rows' work."""
        self.forwards += other.forwards
        for key, seconds in other.work.items():
            self.work[key] = self.work.get(key, 0.0) + seconds

    @property
    def forward_seconds(self) -> float:
        return sum(f[3] for f in self.forwards)


@dataclass
class CostModel:
    """Seconds of one forward of each tier ("drafter", "slim", "full") against its rows and
    tokens per row (module docstring)."""

    grid: dict[str, list[Point]]  # tier -> profiled points (a (tokens, seconds) pair: one row)
    key: dict = field(default_factory=dict)  # what the figures were measured for
    profile_seconds: float = 0.0  # wall time the profile took (0 when read from the cache)
    online: bool = False  # learn corrections from observed forwards (module docstring)
    scale: dict[str, float] = field(default_factory=dict)  # tier -> g (module docstring)
    correction: dict[str, list[float]] = field(default_factory=dict)  # tier -> r per grid point
    evidence: dict[str, list[float]] = field(default_factory=dict)  # tier -> r's weight per grid point (running_mean)
    overhead: dict[str, float] = field(default_factory=dict)  # plan kind -> seconds per logit row (EMA)
    transport: dict[str, float] = field(default_factory=dict)  # served call ("propose", "verify") -> seconds (EMA)
    observed: int = 0  # forwards observed

    DECAY = 0.8  # weight of the past in each online update of g: the machine's pace moves fast ...
    SHAPE_DECAY = 0.95  # ... and of r, once observed: the shape only where g cannot explain it
    MEMO_SIZE = 4096  # prices memoised between two observed forwards, at most

    def __post_init__(self):
        self.grid = {
            tier: sorted((1, *p) if len(p) == 2 else tuple(p) for p in points) for tier, points in self.grid.items()
        }
        # tier -> (one, batches, [rho_b per batch], [(log M, log rows) per point]): the grid's curves
        # (module docstring) and bucket coordinates, computed once (the planner prices many steps)
        self._shape: dict[str, tuple] = {}
        for tier, points in self.grid.items():
            one = [(t, sec) for b, t, sec in points if b == 1]
            if len(one) < 2:
                raise ValueError(f"cost grid of {tier!r}: needs two 1-row points at least, got {points}")
            batches = sorted({b for b, _, _ in points if b > 1})
            rho = [[(t, sec / _line(one, b * t)) for b2, t, sec in points if b2 == b] for b in batches]
            logs = [(math.log(b * t), math.log(b)) for b, t, _ in points]
            self._shape[tier] = (one, batches, rho, logs)
        self._memo: dict[tuple, tuple[int, float]] = {}  # (tier, rows, tokens) -> (observed, seconds)

    def seconds(self, tier: str, rows: float, tokens: float) -> float:
        """Forward seconds of `tier` over `rows` rows padded to `tokens` tokens each (no rows or
        tokens: 0 s): the grid, interpolated, times the online corrections (module docstring).

        Memoised until the next observed forward (the planner prices the same few sizes hundreds
        of times a step); a price is kept with the count of forwards observed when it was read, so
        one computed while another thread observes is never served after."""
        key, observed = (tier, rows, tokens), self.observed
        hit = self._memo.get(key)
        if hit is not None and hit[0] == observed:
            return hit[1]
        if len(self._memo) >= self.MEMO_SIZE:  # (via rows price fractional sizes: keep it bounded)
            self._memo.clear()
        value = self._seconds(tier, rows, tokens)
        self._memo[key] = (observed, value)
        return value

    def _seconds(self, tier: str, rows: float, tokens: float) -> float:
        if rows <= 0 or tokens <= 0:
            return 0.0
        if rows < 1:  # a row that runs with probability `rows`
            return rows * self._seconds(tier, 1, tokens)
        base = self._profiled(tier, rows, tokens) * self.scale.get(tier, 1.0)
        r = self.correction.get(tier)
        return base * r[self._bucket(tier, rows, tokens)] if r else base

    def observe(self, tier: str, rows: int, tokens: int, seconds: float) -> None:
        """One forward of `tier` over `rows` rows padded to `tokens` tokens took `seconds` (online
        only): the pace g moves by observed / predicted, the size's residual r by what g does not
        explain, then the observed sizes' common factor moves into g (module docstring)."""
        predicted = self.seconds(tier, rows, tokens)
        if not self.online or tier not in self.grid or rows < 1 or tokens <= 0 or predicted <= 0:
            return
        d = self.DECAY
        self.scale[tier] = self.scale.get(tier, 1.0) * (d + (1 - d) * seconds / predicted)
        r = self.correction.setdefault(tier, [1.0] * len(self.grid[tier]))
        w = self.evidence.setdefault(tier, [0.0] * len(self.grid[tier]))
        i = self._bucket(tier, rows, tokens)
        residual = seconds / (self._profiled(tier, rows, tokens) * self.scale[tier])
        r[i], w[i] = running_mean(r[i], w[i], residual, self.SHAPE_DECAY)
        common = math.exp(sum(wj * math.log(rj) for rj, wj in zip(r, w)) / sum(w))  # (what the sizes share: the pace)
        self.correction[tier] = [rj / common if wj > 0 else rj for rj, wj in zip(r, w)]
        self.scale[tier] *= common
        self.observed += 1  # (last: the prices memoised before it are stale from here on)

    def observe_step(self, times: StepTimes, kinds: dict, seconds: float) -> None:
        """A step took `seconds` (its calls' transport left out: `observe_transport`'s), of which
        `times` measured the batched forwards and each row's work between them; `kinds` maps each
        row's key to (plan kind, logit rows). Every forward is observed; each row's overhead is its
        own work plus an equal share of the rest of the step (planning, commits, serialisation)."""
        for forward in times.forwards:
            self.observe(*forward)
        if not kinds:
            return
        shared = max(0.0, seconds - times.forward_seconds - sum(times.work.values())) / len(kinds)
        for key, (kind, logit_rows) in kinds.items():
            self.observe_overhead(kind, times.work.get(key, 0.0) + shared, logit_rows)

    def observe_overhead(self, kind: str, seconds: float, logit_rows: float) -> None:
        """A row running a plan of `kind` spent `seconds` of a step outside the forwards, over
        `logit_rows` logit rows (online only)."""
        if self.online and logit_rows > 0:
            d, per_row = self.DECAY, max(0.0, seconds) / logit_rows
            self.overhead[kind] = d * self.overhead.get(kind, per_row) + (1 - d) * per_row

    def observe_transport(self, call: str, seconds: float) -> None:
        """A served step's `call` ("propose", "verify") spent `seconds` outside the service that
        answered it: serialisation, the network and gRPC, a cost per call whatever its rows
        (online only)."""
        if self.online:
            d, seconds = self.DECAY, max(0.0, seconds)
            self.transport[call] = d * self.transport.get(call, seconds) + (1 - d) * seconds

    def overhead_of(self, kind: str) -> float:
        """Seconds per logit row of a plan kind's work around the forwards (module docstring)."""
        if kind in self.overhead:
            return self.overhead[kind]
        return sum(self.overhead.values()) / len(self.overhead) if self.overhead else 0.0

    def _bucket(self, tier: str, rows: float, tokens: float) -> int:
        """The grid point nearest (rows, tokens) in (log M, log rows), M = rows * tokens: a grid
        of one row only buckets by the tokens a forward carries."""
        lm, lb = math.log(rows * tokens), math.log(rows)
        logs = self._shape[tier][3]
        return min(range(len(logs)), key=lambda i: (logs[i][0] - lm) ** 2 + (logs[i][1] - lb) ** 2)

    def _profiled(self, tier: str, rows: float, tokens: float) -> float:
        """grid(tier, rows >= 1, tokens) (module docstring)."""
        one, batches, rho, _ = self._shape[tier]
        seconds = _line(one, rows * tokens)
        if not rho or rows <= 1:
            return seconds
        i = bisect.bisect_left(batches, rows)
        if i == len(rho):  # beyond the largest batch
            return seconds * _clamped(rho[-1], tokens)
        b0, r0 = (1, 1.0) if i == 0 else (batches[i - 1], _clamped(rho[i - 1], tokens))
        b1, r1 = batches[i], _clamped(rho[i], tokens)
        return seconds * (r0 + (r1 - r0) * (rows - b0) / (b1 - b0))

    def to_dict(self) -> dict:
        return {
            "grid": self.grid,
            "key": self.key,
            "profile_seconds": self.profile_seconds,
            "online": self.online,
            "scale": self.scale,
            "correction": self.correction,
            "evidence": self.evidence,
            "overhead": self.overhead,
            "transport": self.transport,
            "observed": self.observed,
        }

    @classmethod
    def combine(cls, parts: dict[str, CostModel]) -> CostModel:
        """One online model of the tiers of several profiles (served: the drafter's and the
        verifier's, each measured on its own actor); `key` holds each part's."""
        return cls(
            {t: list(c) for m in parts.values() for t, c in m.grid.items()},
            {name: m.key for name, m in parts.items()},
            sum(m.profile_seconds for m in parts.values()),
            online=True,
        )

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        """The profiled grid (what the cache file holds; corrections start afresh)."""
        return cls(
            {k: [tuple(p) for p in v] for k, v in d["grid"].items()}, d.get("key", {}), d.get("profile_seconds", 0.0)
        )

    def summary(self) -> dict:
        """What the stats and /metrics report: each tier's predicted seconds at its grid's points
        (the profile with the online corrections), the corrections, the overhead."""
        return {
            "key": self.key,
            "online": self.online,
            "observed": self.observed,
            "overhead_seconds": {kind: round(o, 6) for kind, o in self.overhead.items()},
            "transport_seconds": {call: round(t, 6) for call, t in self.transport.items()},
            "seconds": {
                t: [{"rows": b, "tokens": n, "seconds": round(self.seconds(t, b, n), 6)} for b, n, _ in pts]
                for t, pts in self.grid.items()
            },
            "scale": {t: round(g, 4) for t, g in self.scale.items()},
            "correction": {t: [round(x, 3) for x in c] for t, c in self.correction.items()},
        }

    def break_even(self, tier_draft: str, tier_verify: str, k: int) -> float:
        """Tokens one cycle of k drafted tokens must commit to beat `ar` at batch 1:
        (k drafter forwards + one verify forward of k + 1 tokens) / one full forward of 1 token."""
        cycle = k * self.seconds(tier_draft, 1, 1) + self.seconds(tier_verify, 1, k + 1)
        return cycle / self.seconds("full", 1, 1)


def _time_forwards(lm: MaskedLM, mask: LayerMask | None, rows: int, tokens: Sequence[int], repeats: int) -> list[float]:
    """Best-of-`repeats` seconds of one forward of `rows` rows of t tokens, for each t in
    `tokens`, each row after PREFIX cached positions of its own (one prefill, copied to every row)."""
    store = lm.new_store(mask, max_rows=rows, max_len=PREFIX + max(tokens))
    slots = [store.alloc() for _ in range(rows)]
    lm.forward_batch([Row([(7 * i + 3) % lm.vocab_size for i in range(PREFIX)], 0, 0, slots[0])], store, mask)
    for s in slots[1:]:
        store.copy_row(slots[0], s, PREFIX)
    out = []
    for t in tokens:
        block = [(11 * i + 5) % lm.vocab_size for i in range(t)]
        best = float("inf")
        for _ in range(repeats):
            for s in slots:
                store.crop(s, PREFIX)
            lap = Lap(lm.device)  # (the device's own time: events on a GPU)
            lm.forward_batch([Row(block, PREFIX, 1, s) for s in slots], store, mask)
            best = min(best, lap.stop().seconds)
        out.append(best)
    return out


def monotone(points: Sequence[Point]) -> list[Point]:
    """A forward of as many rows and tokens or more costs at least as much: a profiled point
    dearer than one that carries more is noise (a shared machine only ever adds time, which is
    why each point is a best-of) and takes the cheapest such point's seconds."""
    seconds = {(b, t): sec for b, t, sec in points}
    for b, t in sorted(seconds, reverse=True):  # (every point dominating (b, t) is settled before it)
        larger = [sec for (b2, t2), sec in seconds.items() if b2 >= b and t2 >= t and (b2, t2) != (b, t)]
        seconds[b, t] = min([seconds[b, t], *larger])
    return [(b, t, seconds[b, t]) for b, t, _ in points]


def _profile_tier(lm: MaskedLM, mask: LayerMask | None, grid: Sequence[tuple[int, int]], repeats: int) -> list[Point]:
    """One tier's grid: one store and prefill per row count, `monotone`."""
    points = []
    for b in sorted({b for b, _ in grid}):
        tokens = sorted(t for b2, t in grid if b2 == b)
        points += [(b, t, sec) for t, sec in zip(tokens, _time_forwards(lm, mask, b, tokens, repeats))]
    return monotone(points)


def profile_key(tiers: dict[str, tuple[MaskedLM, LayerMask | None]], grid: Sequence[tuple[int, int]], **extra) -> dict:
    """What a cost profile depends on: each tier's model (fingerprint), mask and linear kernels
    (viasd.precision.linear_kernels: packed, mixed or plain), the device,
    dtype, threads, CPU capability and whether it computes bf16 natively (AVX-512 CPUs report
    the same capability with and without it, and a bf16 forward costs several times more
    without: a profile cache shared by nodes of both kinds must not mix them), grid and how it
    is measured (`extra`: more, e.g. the tensor-parallel ranks)."""
    from viasd.models.loader import model_fingerprint
    from viasd.precision import linear_kernels, native_bf16

    lm = next(iter(tiers.values()))[0]
    return {
        "tiers": {
            name: {
                "model": model_fingerprint(m.model)[:16],
                "skipped": list(mask.skipped) if mask else [],
                "linears": linear_kernels(m.model),
            }
            for name, (m, mask) in tiers.items()
        },
        "device": str(lm.device),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "grid": [list(p) for p in grid],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16() if lm.device.type == "cpu" else None,
        "prefix": PREFIX,
        "method": PROFILE_METHOD,
        **extra,
    }


def verifier_tiers(verifier: MaskedLM, mask: LayerMask) -> dict[str, tuple[MaskedLM, LayerMask | None]]:
    """The verifier's two tiers: q, and q' = q masked."""
    return {"full": (verifier, None), "slim": (verifier, mask)}


def profile(
    verifier: MaskedLM,
    drafter: MaskedLM | None,
    mask: LayerMask,
    *,
    grid: Sequence[tuple[int, int]] = GRID,
    repeats: int = 2,
    cache_dir: Path | None = None,
) -> CostModel:
    """Measure (or read from the cache) the forward seconds of every tier over `grid` (rows, tokens)."""
    tiers = verifier_tiers(verifier, mask)
    if drafter is not None:
        tiers["drafter"] = (drafter, None)
    return profile_tiers(tiers, grid=grid, repeats=repeats, cache_dir=cache_dir)


def profile_tiers(
    tiers: dict[str, tuple[MaskedLM, LayerMask | None]],
    *,
    grid: Sequence[tuple[int, int]] = GRID,
    repeats: int = 2,
    cache_dir: Path | None = None,
    **key_extra,
) -> CostModel:
    """`profile` for the tiers one process holds (a served actor: the drafter, or the verifier's
    q and q'), keyed by `profile_key(tiers, grid, **key_extra)`. Without `cache_dir`, always
    measured (tensor-parallel ranks: every rank must run the same forwards)."""
    key = profile_key(tiers, grid, **key_extra)
    path = None
    if cache_dir is not None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        path = Path(cache_dir) / f"costs-{digest}.json"
        if path.exists():
            try:
                model = CostModel.from_dict(json.loads(path.read_text()))
                model.online = True
                return model
            except (OSError, ValueError, KeyError):
                pass  # a damaged cache file is measured again
    t0 = time.perf_counter()
    for lm, m in tiers.values():  # one untimed forward each: first-call allocations stay out of the figures
        _time_forwards(lm, m, 1, [1], 1)
    table = {name: _profile_tier(lm, m, grid, repeats) for name, (lm, m) in tiers.items()}
    model = CostModel(table, key, time.perf_counter() - t0, online=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(model.to_dict(), indent=1))
    return model


def running_mean(mean: float, weight: float, x: float, decay: float | None = None) -> tuple[float, float]:
    """One observation x for an exponentially weighted mean: the past's weight decays by `decay`
    (default Acceptance.DECAY), x counts 1, and the prior it started from counts `weight`
    observations (aging with the rest; 0: none, x sets the mean). Returns the new (mean, weight).

        mean' = (decay * weight * mean + x) / (decay * weight + 1),  weight' = decay * weight + 1

    A plain EMA started at the prior (mean' = decay * mean + (1 - decay) * x) would weigh it
    like an infinite past: after three accepted blocks a position would still read half prior."""
    weight = (Acceptance.DECAY if decay is None else decay) * weight
    return (weight * mean + x) / (weight + 1.0), weight + 1.0


class Acceptance:
    """Running estimates of what speculation buys one request (exponentially weighted means,
    `running_mean`, starting from the engine-wide estimate): per draft position j, the
    probability that the verifier accepts the drafted token given it reached j, for model
    drafts and n-gram drafts.

    A position no block has reached yet takes the estimate of the deepest one reached (before
    any evidence: the prior). Otherwise a plan that starts short would never learn what longer
    blocks buy: a k = 1 block says nothing about position 2, whose prior would keep k at 1.

    Two memories. A request's own estimate (DECAY) follows its last ~5 blocks. The engine-wide
    one (`decay` POPULATION_DECAY), which every new request starts from, counted as a request's
    steady-state evidence (1 / (1 - DECAY) blocks), is the mean over the last ~50 blocks of
    every request, so that one short or unlucky request does not set the next one's start."""

    DECAY = 0.8  # a request's own: weight of the past in each update (steady state: the last ~5 blocks)
    POPULATION_DECAY = 0.98  # the engine-wide estimate's (the last ~50 blocks of every request)
    PRIOR = {"model": 0.6, "ngram": 0.5}
    PRIOR_WEIGHT = 1.0  # observations the prior counts as

    def __init__(self, prior: Acceptance | None = None, positions: int = 8, decay: float | None = None):
        """The engine-wide estimate (`decay` POPULATION_DECAY), starting from PRIOR, or a request's
        (default DECAY) starting from the engine-wide `prior` (None: from PRIOR)."""
        self.decay = self.DECAY if decay is None else decay
        start = self.steady_weight()
        self.rates = {  # kind -> [positions]
            kind: list(prior.rates[kind]) if prior else [a] * positions for kind, a in self.PRIOR.items()
        }
        self.weights = {  # kind -> [positions]: the evidence behind each rate (running_mean)
            kind: [min(w, start) for w in prior.weights[kind]] if prior else [self.PRIOR_WEIGHT] * positions
            for kind in self.PRIOR
        }
        self.depth = dict(prior.depth) if prior else dict.fromkeys(self.PRIOR, 0)  # positions ever reached

    @classmethod
    def steady_weight(cls) -> float:
        """A request's evidence in steady state, 1 / (1 - DECAY) blocks (running_mean's weight):
        what a request counts the engine-wide estimate it starts from as."""
        return 1 / (1 - cls.DECAY)

    def update(self, kind: str, drafted: int, accepted: int) -> None:
        """A block of `drafted` tokens of which the first `accepted` were accepted: positions
        0..accepted were reached (all accepted but the last, unless the whole block was)."""
        rates, weights = self.rates[kind], self.weights[kind]
        reached = min(drafted, accepted + 1, len(rates))
        for j in range(reached):
            rates[j], weights[j] = running_mean(rates[j], weights[j], 1.0 if j < accepted else 0.0, self.decay)
        depth = self.depth[kind] = max(self.depth[kind], reached)
        for j in range(depth, len(rates)):  # never reached: as the deepest position reached
            rates[j], weights[j] = rates[depth - 1], weights[depth - 1]

    def expected_tokens(self, kind: str, k: int) -> float:
        """E[tokens committed by a cycle of k drafts] = 1 + sum_{i=1..k} prod_{j<=i} a_j."""
        rates, total, reach = self.rates[kind], 1.0, 1.0
        for j in range(k):
            reach *= rates[min(j, len(rates) - 1)]
            total += reach
        return total

    def to_dict(self) -> dict:
        return {kind: [round(a, 4) for a in rates] for kind, rates in self.rates.items()}
