"""`mode: auto`: each step, pick every auto row's plan for the most expected committed tokens per
second of step time (vLLM's dynamic speculative decoding / SmartSpec goodput, over three tiers).

Plans (`Plan`): `ar`, `sd` with k model-drafted tokens, `ngram` with k looked-up tokens (when the
context has a match) and, only when the request allows a lossy plan (`auto_lossy`), `via` with k
drafted tokens gated by the slim verifier. Every lossless plan commits tokens distributed exactly
as q (greedy: exactly `ar`'s tokens), so the choice only changes speed. A batch's goodput is
sum_rows E[tokens] / E[step seconds], with
  E[tokens]       = 1 + sum_{i=1..k} prod_{j<=i} a_j        (a: the row's running acceptance)
  E[step seconds] = sum_r C_drafter(n_r, T_r)               (n_r: rows drafting in round r; T_0 = 2, else 1)
                    + C_slim(n_via, T_via) + C_full(n_full, T_full)
                    + C_drafter(n_lag, max lag) * mean(1 / min(E[cycles left], PAYBACK_CYCLES))
                    + sum_rows overhead[kind] * logit rows + transport   (viasd.costs)
where C(n, T) is the cost grid of a batched forward of n rows at padded length T (T = k + 1 for a
block, 1 for `ar`) and n_full = n_ar + n_sd + sum_via P_esc. An `auto` request's drafter is not
prefilled at admission: its catch-up is priced over the cycles it has left, so where speculation
does not pay the drafter never runs (`drafts_from_the_start` prefills it when its plan drafts).

Plans are chosen by coordinate ascent (two passes) from the best uniform assignment, since a
drafting round costs about the same for one row as for all. The batch speculates only when that
beats every auto row on `ar` by the planner's measured forecast error (`Planner.margin`):
    margin = max(MARGIN_FLOOR, 1 + e_ar + e_speculating)
    e_kind = (MARGIN_PRIOR_STEPS * (SPECULATE_MARGIN - 1) / 2 + n * max(0, s_kind log(G_measured / G_forecast)))
             / (MARGIN_PRIOR_STEPS + n)
over each kind's recent steps (decayed by MARGIN_DECAY a step; n: their decayed count), G = tokens
/ seconds, s_ar = +1, s_speculating = -1: only errors that favoured speculation wrongly count.
Prices and acceptance are learnt only from forwards that run, so after PROBE_EVERY speculating
steps one `ar` step runs (a probe), and after PROBE_EVERY all-`ar` steps the best uniform `sd`
plan runs once (an exploration, only if its catch-up costs at most EXPLORE_CATCH_UP_SHARE of the
rows' time left), each only when expected within PROBE_MARGIN of the chosen plans' goodput.
`Forecast` keeps the seconds and tokens the plans expected beside those measured.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from viasd.config import Mode, Proposer
from viasd.costs import Acceptance, CostModel, running_mean

# A lagging drafter's catch-up must pay for itself within this many cycles (or the cycles the
# request has left): under load the batch changes every few cycles, and with it the best plan, so
# a catch-up spread over a long request's every cycle is a bet the planner rarely wins.
PAYBACK_CYCLES = 16
# How often and how close: a probe `ar` step, and an exploration (module docstring)
PROBE_EVERY = 16
PROBE_MARGIN = 0.8
# The most an exploration's drafter catch-up may cost, as a share of the rows' time left (module docstring)
EXPLORE_CATCH_UP_SHARE = 0.05
# How much a speculating batch must be expected to beat `ar` by to be chosen: before any forecast
# was measured, the least once they hold, the steps the prior counts as and the decay of the
# measured steps' weight a step (module docstring)
SPECULATE_MARGIN = 1.1
MARGIN_FLOOR = 1.02
MARGIN_PRIOR_STEPS = 16
MARGIN_DECAY = 0.98
# A drafter's first round feeds what its last block left unfed: the cycle's last token, and the
# last draft token too when the block was accepted whole (drafted k, fed k - 1): 2 tokens a row
# in most steps of a batch (it is right-padded to its longest row).
FIRST_ROUND_TOKENS = 2


PLANS = ("sd", "ngram", "via")  # the plan kinds that draft (`ar` aside): what a verify row may name


@dataclass(frozen=True)
class Plan:
    """What one row does this step."""

    kind: str  # "ar" | "sd" | "ngram" | "via"
    k: int = 0  # draft tokens (0 for ar)

    @property
    def label(self) -> str:
        return self.kind if self.kind == "ar" else f"{self.kind}:k={self.k}"

    @property
    def proposer(self) -> Proposer | None:
        """Who drafts the block: the n-gram lookup, or (None) the request's own proposer."""
        return Proposer.NGRAM if self.kind == "ngram" else None

    @property
    def verify_mode(self) -> Mode:
        """How the verifier checks the block: the slim tier first (`via`) or q alone."""
        return {"ar": Mode.AR, "via": Mode.VIA}.get(self.kind, Mode.SD)


def fixed_plan(mode: Mode, k: int) -> Plan:
    """The plan of a request with an explicit mode, drafting k tokens."""
    return Plan("ar") if mode == Mode.AR else Plan(mode.value, k)


class Estimates:
    """Running estimates of what each plan buys one request: the acceptance per draft position of
    model and n-gram drafts (`Acceptance`), and the tokens a `via` cycle commits and how often it
    escalates to q (`running_mean`s). A request's estimates start from the engine-wide ones
    (`population`), which learn from every request with a longer memory (`Acceptance`)."""

    def __init__(self, prior: Estimates | None = None, population: bool = False):
        self.decay = Acceptance.POPULATION_DECAY if population else Acceptance.DECAY
        self.acceptance = Acceptance(prior.acceptance if prior else None, decay=self.decay)
        self.via_tokens = prior.via_tokens if prior else 2.0
        self.via_escalation = prior.via_escalation if prior else 0.5
        start = Acceptance.steady_weight()  # (as Acceptance: a request starts from `prior` as this much evidence)
        self.via_weight = min(prior.via_weight, start) if prior else Acceptance.PRIOR_WEIGHT  # (running_mean)

    def learn(self, plan: Plan, drafted: int, accepted: int, committed: int, escalated: bool) -> None:
        """A cycle of `plan` drafted `drafted` tokens, `accepted` of them were accepted, it
        committed `committed` tokens and (`via`) escalated or not. A cycle that drafted nothing
        (no n-gram match) says nothing."""
        if drafted == 0:
            return
        if plan.kind in ("sd", "ngram"):
            self.acceptance.update("ngram" if plan.kind == "ngram" else "model", drafted, accepted)
        elif plan.kind == "via":
            self.via_tokens, _ = running_mean(self.via_tokens, self.via_weight, committed, self.decay)
            self.via_escalation, self.via_weight = running_mean(
                self.via_escalation, self.via_weight, escalated, self.decay
            )

    def row(self, **state) -> RowState:
        """The planner's view of an `auto` row with these estimates (`state`: RowState's other fields)."""
        return RowState(
            fixed=None,
            acceptance=self.acceptance,
            via_tokens=self.via_tokens,
            via_escalation=self.via_escalation,
            **state,
        )

    def to_dict(self) -> dict:
        """What the stats and /metrics report."""
        return {
            "acceptance": self.acceptance.to_dict(),
            "via": {"tokens_per_cycle": round(self.via_tokens, 4), "escalation_rate": round(self.via_escalation, 4)},
        }


def learn_cycle(
    estimates: Sequence[Estimates | None],
    plan: Plan,
    *,
    drafted: int,
    accepted: int,
    committed: int,
    escalated: bool,
    plans: dict[str, int] | None = None,
) -> None:
    """One cycle's evidence for every estimate given (None: skipped); `plans` (an `auto`
    request's stats) counts the plan."""
    if plans is not None:
        plans[plan.label] = plans.get(plan.label, 0) + 1
    for e in estimates:
        if e is not None:
            e.learn(plan, drafted, accepted, committed, escalated)


@dataclass
class RowState:
    """What the planner knows of one row."""

    fixed: Plan | None  # a request with an explicit mode: its plan, not chosen
    gamma: int  # the most draft tokens allowed this step
    acceptance: Acceptance
    ngram_match: int = 0  # tokens the n-gram lookup would propose now (0: no match)
    has_drafter: bool = True
    lossy: bool = False  # the request allows `via`
    via_tokens: float = 2.0  # running mean of tokens a via cycle commits
    via_escalation: float = 0.5  # running probability that a via cycle escalates to q
    draft_lag: int = 0  # tokens the drafter must feed (a catch-up prefill) before it can draft
    remaining: int = 1 << 30  # tokens the request may still produce

    def candidates(self) -> list[Plan]:
        if self.fixed is not None:
            return [self.fixed]
        plans = [Plan("ar")]
        if self.has_drafter:
            plans += [Plan("sd", k) for k in range(1, self.gamma + 1)]
            if self.lossy:
                plans.append(Plan("via", self.gamma))
        if self.ngram_match:
            plans += [Plan("ngram", k) for k in range(1, min(self.gamma, self.ngram_match) + 1)]
        return plans


def expected_tokens(row: RowState, plan: Plan) -> float:
    """Tokens the row expects to commit with `plan` this step (never more than it may produce)."""
    if plan.kind == "ar":
        return 1.0
    if plan.kind == "via":
        return min(row.via_tokens, row.remaining)
    return min(row.acceptance.expected_tokens("ngram" if plan.kind == "ngram" else "model", plan.k), row.remaining)


def logit_rows(plan: Plan, escalation: float = 0.0) -> float:
    """Positions a row running `plan` samples or judges in a step: one per drafting round, k + 1
    for a verified block (`via`: the slim tier's, and q's with probability `escalation`), 1 for `ar`."""
    if plan.kind == "ar":
        return 1.0
    rounds = plan.k if plan.kind in ("sd", "via") else 0  # (n-gram drafts need no forward)
    return rounds + (plan.k + 1) * (1.0 + escalation if plan.kind == "via" else 1.0)


def _drafts(plan: Plan) -> bool:
    """Whether `plan` runs the drafter model (n-gram drafts need no forward)."""
    return plan.kind in ("sd", "via")


def _cycles_left(row: RowState, plan: Plan) -> float:
    """The cycles a lagging drafter's catch-up is spread over (module docstring)."""
    return min(PAYBACK_CYCLES, max(1.0, row.remaining / expected_tokens(row, plan)))


class _Step:
    """The sums one step's expected seconds and tokens are made of (module docstring), kept so
    that moving one row to another plan costs O(1) instead of a pass over the batch: the
    planner tries every candidate of every row against the rest. Counters of the padded lengths
    give each forward's longest row as rows come and go."""

    def __init__(self, costs: CostModel, rows: Sequence[RowState], plans: Sequence[Plan]):
        self.costs = costs
        self.drafting: Counter[int] = Counter()  # k -> rows drafting k tokens with the model
        self.proposing = 0  # rows that draft (with the model or the n-gram lookup): a served Propose
        self.rows = 0  # rows in the step: a served step makes one Verify call whatever they run
        self.lags: Counter[int] = Counter()  # lag -> drafting rows that must catch up so far
        self.inverse_cycles = 0.0  # sum over lagging rows of 1 / cycles left
        self.slim: Counter[int] = Counter()  # block tokens -> via rows
        self.full: Counter[int] = Counter()  # tokens -> rows q may run (escalation > 0 for via)
        self.full_rows = 0.0  # expected rows of q's forward
        self.overhead = 0.0  # seconds of the work around the forwards
        self.tokens = 0.0  # expected committed tokens
        self._expected: dict[tuple, tuple[float, float]] = {}  # (id(row), kind, k) -> (E[tokens], 1 / cycles left)
        for row, plan in zip(rows, plans):
            self.add(row, plan)

    def add(self, row: RowState, plan: Plan, sign: int = 1) -> None:
        """Count row running `plan` in the step (sign -1: take it out again)."""
        key = (id(row), plan.kind, plan.k)
        if key not in self._expected:  # (the planner moves each row through its candidates many times)
            self._expected[key] = (expected_tokens(row, plan), 1 / _cycles_left(row, plan))
        tokens, inverse_cycles = self._expected[key]
        self.rows += sign
        self.proposing += sign * (plan.kind != "ar")
        if _drafts(plan):
            self.drafting[plan.k] += sign
            if row.draft_lag > 0:
                self.lags[row.draft_lag] += sign
                self.inverse_cycles += sign * inverse_cycles
        if plan.kind == "via":
            self.slim[plan.k + 1] += sign
        weight = row.via_escalation if plan.kind == "via" else 1.0
        if weight > 0:
            self.full[1 if plan.kind == "ar" else plan.k + 1] += sign
            self.full_rows += sign * weight
        self.overhead += sign * self.costs.overhead_of(plan.kind) * logit_rows(plan, row.via_escalation)
        self.tokens += sign * tokens

    def seconds(self) -> float:
        """E[step seconds] (module docstring)."""
        costs, seconds = self.costs, self.overhead
        if self.rows:  # a served step's calls (in-process: no transport)
            seconds += costs.transport.get("verify", 0.0) + (
                costs.transport.get("propose", 0.0) if self.proposing else 0.0
            )
        drafting = [(k, n) for k, n in self.drafting.items() if n > 0]
        for r in range(max((k for k, _ in drafting), default=0)):  # drafting round r: rows with k > r
            n = sum(c for k, c in drafting if k > r)
            seconds += costs.seconds("drafter", n, FIRST_ROUND_TOKENS if r == 0 else 1)
        lagging = sum(self.lags.values())
        if lagging:  # one batched catch-up forward, its cost spread over the rows' cycles left
            longest = max(lag for lag, n in self.lags.items() if n > 0)
            seconds += costs.seconds("drafter", lagging, longest) * self.inverse_cycles / lagging
        slim = sum(self.slim.values())
        if slim:
            seconds += costs.seconds("slim", slim, max(t for t, n in self.slim.items() if n > 0))
        if sum(self.full.values()):
            seconds += costs.seconds("full", self.full_rows, max(t for t, n in self.full.items() if n > 0))
        return seconds

    def goodput(self) -> float:
        """Expected committed tokens per second of step time."""
        seconds = self.seconds()
        return self.tokens / seconds if seconds > 0 else 0.0


def step_seconds(costs: CostModel, rows: Sequence[RowState], plans: Sequence[Plan]) -> float:
    """Expected seconds of one step in which row i runs plans[i] (module docstring)."""
    return _Step(costs, rows, plans).seconds()


def goodput(costs: CostModel, rows: Sequence[RowState], plans: Sequence[Plan]) -> float:
    """Expected committed tokens per second of step time."""
    return _Step(costs, rows, plans).goodput()


def choose(costs: CostModel, rows: Sequence[RowState], passes: int = 2, margin: float = SPECULATE_MARGIN) -> list[Plan]:
    """Every row's plan for this step; the batch speculates only when that beats every auto row on
    `ar` by `margin` (module docstring)."""
    plans = _best_uniform(costs, rows)
    step = _Step(costs, rows, plans)
    candidates = [row.candidates() for row in rows]
    for _ in range(passes):
        moved = False
        for i, row in enumerate(rows):
            if row.fixed is not None:
                continue
            step.add(row, plans[i], -1)
            best, best_value = plans[i], -1.0
            for plan in candidates[i]:
                step.add(row, plan)
                value = step.goodput()
                step.add(row, plan, -1)
                if value > best_value + 1e-12:
                    best, best_value = plan, value
            moved |= best != plans[i]
            plans[i] = best
            step.add(row, best)
        if not moved:  # a pass that moved no row leaves the next one where it started
            break
    ar = _all_ar(rows)
    if plans != ar and step.goodput() < margin * goodput(costs, rows, ar):
        return ar
    return plans


def _all_ar(rows: Sequence[RowState]) -> list[Plan]:
    """Every auto row on `ar` (rows with a fixed mode keep their own plan)."""
    return [row.fixed if row.fixed is not None else Plan("ar") for row in rows]


def drafts_from_the_start(
    costs: CostModel, batch: Sequence[RowState], new: RowState, margin: float = SPECULATE_MARGIN
) -> bool:
    """Whether a new `auto` row (`new`: its drafter lagging the whole prompt) should prefill its
    drafter at admission: its plan in `batch` + [new] drafts (module docstring)."""
    return _drafts(choose(costs, [*batch, new], margin=margin)[-1])


def _best_uniform(costs: CostModel, rows: Sequence[RowState], kinds: Sequence[str] | None = None) -> list[Plan]:
    """The best assignment that gives every auto row the same plan (or `ar` where it lacks it),
    among the plans of `kinds` (default: all, `ar` among them; none of them: every row on `ar`)."""
    candidates = [set(r.candidates()) for r in rows]
    options = {p for r, c in zip(rows, candidates) if r.fixed is None for p in c if kinds is None or p.kind in kinds}
    if kinds is None or not options:
        options.add(Plan("ar"))
    best, best_value = None, -1.0
    for option in sorted(options, key=lambda p: (p.kind, p.k)):
        plans = [
            r.fixed if r.fixed is not None else (option if option in c else Plan("ar"))
            for r, c in zip(rows, candidates)
        ]
        value = goodput(costs, rows, plans)
        if value > best_value:
            best, best_value = plans, value
    return best


@dataclass
class Forecast:
    """What the planner expected of the steps it planned, beside what they did: a step's
    predicted seconds (`step_seconds` at planning time) and expected committed tokens
    (`expected_tokens`), summed, against its measured seconds (planning to commit) and committed
    tokens. predicted / measured and expected / committed near 1 say the plans were chosen on
    true prices; one side off says which input misled them. (A step that catches lagging
    drafters up is predicted only its share of the catch-up, spread over the cycles the rows have
    left: that step measures more than its forecast by design.)"""

    steps: int = 0
    predicted_seconds: float = 0.0
    seconds: float = 0.0
    expected_tokens: float = 0.0
    tokens: int = 0

    def add(self, predicted: float, seconds: float, expected: float, tokens: int, decay: float = 1.0) -> None:
        """One step more, the past's weight times `decay` (1: plain sums)."""
        if decay != 1.0:
            self.steps, self.predicted_seconds, self.seconds, self.expected_tokens, self.tokens = (
                decay * x for x in (self.steps, self.predicted_seconds, self.seconds, self.expected_tokens, self.tokens)
            )
        self.steps += 1
        self.predicted_seconds += predicted
        self.seconds += seconds
        self.expected_tokens += expected
        self.tokens += tokens

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "predicted_seconds": round(self.predicted_seconds, 4),
            "seconds": round(self.seconds, 4),
            "expected_tokens": round(self.expected_tokens, 3),
            "tokens": self.tokens,
        }


@dataclass
class Recent(Forecast):
    """A `Forecast` whose steps' weight decays by MARGIN_DECAY a step (`add(..., MARGIN_DECAY)`):
    the planner's recent error, which sets its margin (module docstring). `sign`: +1 for `ar`
    steps, -1 for speculating ones (s_kind)."""

    sign: int = 1

    def error(self) -> float:
        """e_kind (module docstring): max(0, s_kind log(G_measured / G_forecast)), shrunk toward
        the prior's half of SPECULATE_MARGIN by the evidence (its decayed steps)."""
        prior = (SPECULATE_MARGIN - 1) / 2
        sums = (self.predicted_seconds, self.seconds, self.expected_tokens, self.tokens)
        if self.steps == 0 or min(sums) <= 0:  # (no step yet, or one that committed nothing: no ratio)
            return prior
        measured = math.log(self.tokens * self.predicted_seconds / (self.seconds * self.expected_tokens))
        observed = max(0.0, self.sign * measured)
        return (MARGIN_PRIOR_STEPS * prior + self.steps * observed) / (MARGIN_PRIOR_STEPS + self.steps)


class Planner:
    """`choose` with what it keeps across steps: the steps `auto` has speculated since its last
    `ar` step, for the probes (module docstring), and its `Forecast`s of the steps it planned,
    apart for steps that speculated and steps that did not."""

    def __init__(self):
        self.since_ar = 0  # steps since every row last ran `ar`
        self.probes = 0  # probe steps run
        self.since_explored = PROBE_EVERY  # all-`ar` steps since a row last drafted (the first may explore)
        self.explorations = 0  # exploration steps run
        self.forecasts = {"speculating": Forecast(), "ar": Forecast()}
        self.recent = {"speculating": Recent(sign=-1), "ar": Recent(sign=1)}
        self._pending: tuple[str, float, float] | None = None  # the planned step's (kind, seconds, tokens)
        self.planned_steps = 0  # steps planned ...
        self.planning_seconds = 0.0  # ... and the wall time planning took (steps and admissions): `auto`'s own cost

    def plans(
        self, costs: CostModel, rows: Sequence[RowState], stepping: int | None = None, prepared: float = 0.0
    ) -> list[Plan]:
        """Every row's plan for this step: `choose`'s, or a probe's. The first `stepping` rows
        (default all; the rest join later) run it: its forecast waits for `settle`. `prepared`:
        the seconds the caller took to build `rows` (each row's state: its estimates and n-gram
        lookup), counted with the search as the step's planning time."""
        started = time.perf_counter()
        plans = self._plans(costs, rows)
        n = len(rows) if stepping is None else stepping
        kind = "ar" if all(p.kind == "ar" for p in plans[:n]) else "speculating"
        tokens = sum(expected_tokens(r, p) for r, p in zip(rows[:n], plans[:n]))
        self._pending = (kind, step_seconds(costs, rows[:n], plans[:n]), tokens)
        self.planned_steps += 1
        self.planning_seconds += prepared + time.perf_counter() - started
        return plans

    def settle(self, seconds: float, tokens: int) -> None:
        """The step last planned took `seconds` and committed `tokens` (nothing planned: no-op)."""
        if self._pending is None:
            return
        kind, predicted, expected = self._pending
        self._pending = None
        self.forecasts[kind].add(predicted, seconds, expected, tokens)
        self.recent[kind].add(predicted, seconds, expected, tokens, MARGIN_DECAY)

    def margin(self, costs: CostModel | None = None) -> float:
        """How much a speculating batch must be expected to beat `ar` by: the planner's measured
        error (module docstring). Priced by a model that does not learn (`costs` not online: a
        fixed table, not this machine's seconds), SPECULATE_MARGIN."""
        if costs is not None and not costs.online:
            return SPECULATE_MARGIN
        return max(MARGIN_FLOOR, 1 + sum(r.error() for r in self.recent.values()))

    def drafts_from_the_start(self, costs: CostModel, batch: Sequence[RowState], new: RowState) -> bool:
        """`drafts_from_the_start` at this planner's margin (its search counted as planning time)."""
        started = time.perf_counter()
        drafts = drafts_from_the_start(costs, batch, new, self.margin(costs))
        self.planning_seconds += time.perf_counter() - started
        return drafts

    def to_dict(self) -> dict:
        """What the stats and /metrics report: the probes and explorations run, the margin, the
        forecasts, and the steps planned with the seconds planning them took."""
        return {
            "probes": self.probes,
            "explorations": self.explorations,
            "margin": round(self.margin(), 4),
            "forecasts": {kind: f.to_dict() for kind, f in self.forecasts.items()},
            "planning": {"steps": self.planned_steps, "seconds": round(self.planning_seconds, 6)},
        }

    def _plans(self, costs: CostModel, rows: Sequence[RowState]) -> list[Plan]:
        plans = choose(costs, rows, margin=self.margin(costs))
        if all(p.kind == "ar" for p in plans):
            self.since_ar = 0
            return self._explore(costs, rows, plans)
        self.since_ar, self.since_explored = self.since_ar + 1, 0
        if not costs.online or self.since_ar < PROBE_EVERY:  # (a model that does not learn needs no probe)
            return plans
        ar = _all_ar(rows)
        if any(p.kind != "ar" for p in ar):  # a fixed row's block: q's forward is no `ar` step
            return plans
        if goodput(costs, rows, ar) < PROBE_MARGIN * goodput(costs, rows, plans):
            return plans
        self.since_ar, self.probes = 0, self.probes + 1
        return ar

    def _explore(self, costs: CostModel, rows: Sequence[RowState], ar: list[Plan]) -> list[Plan]:
        """An all-`ar` step (`ar`), or the best uniform `sd` plan: an exploration (module docstring)."""
        self.since_explored += 1
        if self.since_explored < PROBE_EVERY or not any(r.fixed is None and r.has_drafter for r in rows):
            return ar
        plans = _best_uniform(costs, rows, kinds=("sd",))
        if plans == ar or goodput(costs, rows, plans) < PROBE_MARGIN * goodput(costs, rows, ar):
            return ar
        lagging = [r for r, p in zip(rows, plans) if _drafts(p) and r.draft_lag > 0]
        if lagging:  # one batched feed of every lagging drafter, against the time the rows have left
            catch_up = costs.seconds("drafter", len(lagging), max(r.draft_lag for r in lagging))
            left = step_seconds(costs, rows, ar) * sum(r.remaining for r in lagging) / len(lagging)
            if catch_up > EXPLORE_CATCH_UP_SHARE * left:
                return ar
        self.since_explored, self.explorations = 0, self.explorations + 1
        return plans
