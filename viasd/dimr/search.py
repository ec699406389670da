"""The search: TPE proposals, random and local moves, successive halving (VIA-SD section 3.4).

Trial o proposes z = BayesOpt(.) when o mod theta = 0, else RandomSearch(.). Trial 0 is the
evenly spaced mask (the baseline to beat). Our reading of RandomSearch: after `startup` uniformly
random masks, a random neighbour of the best mask so far (with probability `explore` a fresh
uniform mask instead), so the best mask is carried forward. A neighbour swaps m = 1..3 skipped
layers for kept ones; half of the time the swapped layers are drawn uniformly, otherwise weighted
by a ridge-regression estimate of each layer's cost, fitted on every earlier trial's first-rung
value (loss ~ b + sum_l w_l z_l, z_l = 1 when l is skipped): costly skipped layers are more likely
to come back, cheap kept ones more likely to be skipped. BayesOpt is optuna's TPE sampler (seeded,
independent per layer) over one score s_l in [0, 1] per free layer, decoded as "skip the k layers
with the lowest scores"; every trial, random or not, is told to TPE (pruned ones as pruned, with
their rung values). Masks already scored are not proposed again by the random steps; a TPE
proposal of a known mask reuses its result.

Successive halving (the asynchronous ASHA rule): the calibration sequences are scored in a fixed
order; at rung fractions (default 1/4 and 1/2 of the tokens) a candidate continues only if its
running value is among the best 1/eta (eta = 2: the better half) of the values all earlier trials
had at that rung; otherwise it is dropped (pruned) and its remaining tokens are never run.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from viasd.dimr.objectives import Objective, RKLObjective, add_sums, host_sums
from viasd.dimr.reference import Reference, slim_logprobs
from viasd.dimr.space import evenly_spaced_skips, normalize_keep, num_skipped
from viasd.errors import InvalidParameterError, MaskError, require
from viasd.runtime import LayerMask, MaskedLM


@dataclass
class TrialRecord:
    """One proposal and what became of it."""

    number: int
    proposal: str  # "evenly" | "random" | "local" | "bo"
    skipped: tuple[int, ...]
    value: float | None = None  # the objective on all calibration tokens (None when pruned)
    rung_values: list[float] = field(default_factory=list)  # running value at each rung reached
    tokens: int = 0  # calibration tokens this trial scored
    pruned: bool = False
    duplicate: bool = False  # a mask seen before: its earlier result was reused, nothing run
    seconds: float = 0.0


@dataclass
class SearchResult:
    """The best mask and the whole trial history."""

    mask: LayerMask
    value: float
    objective: Objective
    ratio: float
    seed: int
    trials: list[TrialRecord]
    seconds: float
    keep: tuple[int, ...]
    settings: dict[str, Any]
    baseline: TrialRecord | None = None  # the evenly spaced mask, when it was trial 0

    @property
    def num_pruned(self) -> int:
        return sum(r.pruned and not r.duplicate for r in self.trials)

    @property
    def num_duplicates(self) -> int:
        return sum(r.duplicate for r in self.trials)

    def __repr__(self) -> str:
        return (
            f"SearchResult({self.objective.name}={self.value:.6g}, skipped={list(self.mask.skipped)}, "
            f"trials={len(self.trials)}, pruned={self.num_pruned}, seconds={self.seconds:.1f})"
        )


def _rung_ends(lengths: Sequence[int], fractions: Sequence[float]) -> list[int]:
    """For each rung fraction, the number of leading sequences holding >= that share of the tokens
    (rungs that would cover every sequence, or repeat an earlier rung, are dropped)."""
    total, ends = sum(lengths), []
    cum = [sum(lengths[: i + 1]) for i in range(len(lengths))]
    for f in sorted(fractions):
        end = next(i + 1 for i, c in enumerate(cum) if c >= f * total)
        if end < len(lengths) and (not ends or end > ends[-1]):
            ends.append(end)
    return ends


@dataclass(frozen=True)
class SearchSettings:
    """How a search proposes and prunes (see `search_mask`)."""

    ratio: float = 0.45
    trials: int = 100
    seed: int = 0
    theta: int = 5  # a TPE proposal every theta-th trial
    keep: Sequence[int] = (0, -1)  # layers never skipped (negative: from the end)
    rungs: Sequence[float] = (0.25, 0.5)  # successive-halving rungs, as fractions of the calibration tokens
    eta: float = 2.0  # keep the best 1/eta of the trials at each rung
    min_rung_trials: int = 4  # no pruning at a rung before this many trials reached it
    startup: int | None = None  # uniform random masks first (default theta)
    explore: float = 0.25  # probability of a uniform random mask after the startup
    ridge: float = 1.0  # ridge penalty of the per-layer cost fit that guides local moves
    include_evenly: bool = True  # trial 0 is the evenly spaced mask


class MaskSearch:
    """One DIMR search over masks with exactly round(ratio * L) skipped layers, none in `keep`.

    Trial o: the evenly spaced mask (o = 0, when `include_evenly`); a TPE proposal when
    o mod theta = 0; a uniform random mask for the first `startup` trials or with probability
    `explore`; otherwise a random neighbour of the best mask so far (`neighbour`). `score` runs
    successive halving: at the `rungs` fractions of the calibration tokens a trial outside the
    best 1/eta so far stops. The same seed gives the same trials.
    """

    def __init__(self, verifier: MaskedLM, ref: Reference, objective: Objective, settings: SearchSettings):
        import numpy as np

        optuna = require("optuna", "dimr")
        FloatDistribution = optuna.distributions.FloatDistribution

        s = settings
        if objective.needs_drafter and ref.draft is None:
            raise InvalidParameterError("drafter", f"objective {objective.name!r} needs a drafter in the reference")
        if s.trials < 1:
            raise InvalidParameterError("trials", f"must be >= 1, got {s.trials}")
        if s.theta < 1:
            raise InvalidParameterError("theta", f"must be >= 1, got {s.theta}")
        if s.eta <= 1:
            raise InvalidParameterError("eta", f"must be > 1, got {s.eta}")
        self.verifier, self.ref, self.objective, self.settings = verifier, ref, objective, s
        self.num_layers = verifier.num_layers
        self.keep = normalize_keep(s.keep, self.num_layers)
        self.free = [i for i in range(self.num_layers) if i not in self.keep]
        self.k = num_skipped(s.ratio, self.num_layers)
        if self.k > len(self.free):
            raise MaskError(
                f"cannot skip {self.k} of {self.num_layers} layers with layers {list(self.keep)} kept", field="ratio"
            )
        self.startup = s.theta if s.startup is None else s.startup
        self.space = math.comb(len(self.free), self.k)
        self.np, self.optuna = np, optuna
        self.rng = np.random.default_rng(s.seed)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(seed=s.seed, n_startup_trials=max(1, s.theta))
        self.study = optuna.create_study(direction="minimize", sampler=sampler)
        self.dists = {f"l{i}": FloatDistribution(0.0, 1.0) for i in self.free}
        self.ends = _rung_ends(ref.lengths, s.rungs)
        self.records: list[TrialRecord] = []
        self.seen: dict[tuple[int, ...], TrialRecord] = {}
        self.best: TrialRecord | None = None

    # ------------------------------------------------------------------ proposals

    def scores_for(self, skipped: tuple[int, ...]) -> dict[str, float]:
        """A TPE point that decodes to `skipped`."""
        rng = self.rng
        return {f"l{i}": float(rng.uniform(0.0, 0.5) if i in skipped else rng.uniform(0.5, 1.0)) for i in self.free}

    def decode(self, params: dict[str, float]) -> tuple[int, ...]:
        ranked = sorted(self.free, key=lambda i: (params[f"l{i}"], i))
        return tuple(sorted(ranked[: self.k]))

    def uniform(self) -> tuple[int, ...]:
        return tuple(sorted(int(x) for x in self.rng.choice(self.free, size=self.k, replace=False)))

    def layer_costs(self):
        """Ridge fit loss ~ b + sum_l w_l z_l over every trial's first-rung value (z_l = 1: skipped): [F]."""
        np, obj = self.np, self.objective
        rows = [r for r in self.records if not r.duplicate and (r.rung_values or r.value is not None)]
        if len(rows) < 3:
            return np.zeros(len(self.free))
        x = np.array([[float(i in r.skipped) for i in self.free] for r in rows])  # [n, F]
        y = np.array([obj.loss(r.rung_values[0] if r.rung_values else r.value) for r in rows])  # [n]
        x, y = x - x.mean(0), y - y.mean()
        y = y / (y.std() or 1.0)
        return np.linalg.solve(x.T @ x + self.settings.ridge * np.eye(len(self.free)), x.T @ y)  # [F]

    def pick(self, pool: list[int], weight, m: int) -> set[int]:
        """m layers of pool: half the time uniformly, else with probability ~ exp(weight / std)."""
        np, rng = self.np, self.rng
        if rng.random() < 0.5 or not weight.std():
            return set(int(x) for x in rng.choice(pool, size=m, replace=False))
        p = np.exp((weight - weight.max()) / weight.std())
        return set(int(x) for x in rng.choice(pool, size=m, replace=False, p=p / p.sum()))

    def neighbour(self, skipped: tuple[int, ...]) -> tuple[int, ...]:
        """Swap m = 1..3 skipped layers of the incumbent for kept ones, favouring costly skipped
        layers and cheap kept ones by the ridge estimate."""
        np = self.np
        kept = [i for i in self.free if i not in skipped]
        m = min(int(self.rng.choice([1, 1, 1, 2, 2, 3])), len(skipped), len(kept))
        if m == 0:
            return skipped
        w = dict(zip(self.free, self.layer_costs()))
        out_ = self.pick(list(skipped), np.array([w[i] for i in skipped]), m)  # costly skipped layers go back in
        in_ = self.pick(kept, -np.array([w[i] for i in kept]), m)  # cheap kept layers get skipped
        return tuple(sorted((set(skipped) - out_) | in_))

    def propose(self, o: int) -> tuple[str, tuple[int, ...] | None]:
        s = self.settings
        if o == 0 and s.include_evenly:
            return "evenly", evenly_spaced_skips(self.free, self.k)
        if o % s.theta == 0:
            return "bo", None
        for _ in range(64):  # a new mask, if the space has one left
            if o < self.startup or self.best is None or self.rng.random() < s.explore:
                kind, z = "random", self.uniform()
            else:
                kind, z = "local", self.neighbour(self.best.skipped)
            if z not in self.seen or len(self.seen) >= self.space:
                return kind, z
        return kind, z

    # ------------------------------------------------------------------ scoring

    def score(self, rec: TrialRecord) -> None:
        """Score rec.skipped sequence by sequence; stop at a rung where it is not in the best 1/eta.

        The per-sequence sums stay on the device (`Objective.stats`); the host reads them once
        at each rung and once at the end, so on a GPU the forwards of a trial queue back to back
        (the e2e objective reads once per sequence)."""
        obj, ref, s = self.objective, self.ref, self.settings
        mask = LayerMask.from_skipped(rec.skipped, self.num_layers)
        sums: dict[str, Any] = {}
        for n_done, i in enumerate(range(len(ref.tokens)), 1):
            add_sums(sums, obj.stats(slim_logprobs(self.verifier, ref, i, mask), ref, i))
            rec.tokens += ref.lengths[i]
            if n_done in self.ends:
                r = self.ends.index(n_done)
                value = obj.value(host_sums(sums))  # one device-to-host read per rung
                loss = obj.loss(value)
                earlier = sorted(
                    obj.loss(p.rung_values[r]) for p in self.records if not p.duplicate and len(p.rung_values) > r
                )
                rec.rung_values.append(value)
                if len(earlier) >= s.min_rung_trials:
                    cutoff = earlier[max(0, math.ceil(len(earlier) / s.eta) - 1)]
                    if loss > cutoff:
                        rec.pruned = True
                        return
        rec.value = obj.value(host_sums(sums))

    def trial(self, o: int) -> TrialRecord:
        """Propose, score (or reuse a duplicate's score) and tell the study about trial o."""
        obj, study = self.objective, self.study
        kind, skipped = self.propose(o)
        if kind == "bo":
            trial = study.ask(self.dists)
            skipped = self.decode(trial.params)
        else:
            study.enqueue_trial(self.scores_for(skipped))
            trial = study.ask(self.dists)
        t0 = time.perf_counter()
        if skipped in self.seen:
            prev = self.seen[skipped]
            rec = TrialRecord(o, kind, skipped, prev.value, list(prev.rung_values), 0, prev.pruned, True)
        else:
            rec = TrialRecord(o, kind, skipped)
            self.score(rec)
            self.seen[skipped] = rec
        rec.seconds = time.perf_counter() - t0
        self.records.append(rec)
        for step, v in enumerate(rec.rung_values):
            trial.report(obj.loss(v), step)
        if rec.pruned:
            study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, obj.loss(rec.value))
            if self.best is None or obj.loss(rec.value) < obj.loss(self.best.value):
                self.best = rec
        return rec

    def run(self, *, progress: bool = False, log: Callable[[str], None] | None = None) -> SearchResult:
        s, ref = self.settings, self.ref
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(
                total=s.trials, desc=f"DIMR r={s.ratio:g} {self.objective.name}", file=sys.stderr, dynamic_ncols=True
            )
        t_start = time.perf_counter()
        for o in range(s.trials):
            rec = self.trial(o)
            best = self.best
            if bar is not None:
                bar.set_postfix(best=f"{best.value:.4g}", pruned=sum(r.pruned for r in self.records), refresh=False)
                bar.update(1)
            if log is not None:
                state = "pruned" if rec.pruned else f"{rec.value:.5g}"
                line = (
                    f"trial {o:3d} {rec.proposal:6s} {state:>10s} {rec.seconds:6.1f}s best {best.value:.5g} "
                    f"skipped {list(rec.skipped)}"
                )
                bar.write(line, file=sys.stderr) if bar is not None else log(line)
        if bar is not None:
            bar.close()
        seconds = time.perf_counter() - t_start
        settings = {
            "theta": s.theta,
            "rungs": [sum(ref.lengths[:e]) / ref.num_tokens for e in self.ends],
            "eta": s.eta,
            "min_rung_trials": s.min_rung_trials,
            "startup": self.startup,
            "explore": s.explore,
            "include_evenly": s.include_evenly,
            "space": self.space,
            "calibration_tokens": ref.num_tokens,
        }
        baseline = self.records[0] if s.include_evenly else None
        return SearchResult(
            LayerMask.from_skipped(self.best.skipped, self.num_layers),
            self.best.value,
            self.objective,
            s.ratio,
            s.seed,
            self.records,
            seconds,
            self.keep,
            settings,
            baseline,
        )


def search_mask(
    verifier: MaskedLM,
    ref: Reference,
    *,
    objective: Objective | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    **settings: Any,
) -> SearchResult:
    """Search a mask with exactly round(ratio * L) skipped layers, none of them in `keep`
    (`MaskSearch`; `settings` are the fields of `SearchSettings`)."""
    unknown = set(settings) - set(SearchSettings.__dataclass_fields__)
    if unknown:
        raise TypeError(f"search_mask() got unexpected keyword arguments {sorted(unknown)}")
    search = MaskSearch(verifier, ref, objective or RKLObjective(), SearchSettings(**settings))
    return search.run(progress=progress, log=log)
