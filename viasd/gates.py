"""Calibrated gates: (alpha1, alpha2, region B behaviour) searched for one mask against a quality budget.

The paper's gates (alpha1 = 0.5, alpha2 = 0.3, region B rewrites) were tuned on another pair. On
ours the slim verifier's accept gate lets through tokens the full verifier would not write. This
DIMR step chooses, for a given mask, the gates with the most modelled tokens per second whose
teacher-forced agreement with q on calibration text is at least a budget X.

Signals, per calibration position t (one forward of p, q' and q over each text, teacher forced):
    d_t = argmax p_t (the greedy draft),  g_t = argmax q_t,  s_t = argmax q'_t,
    r_t = q'_t(d_t) / max_v q'_t(v)        (the gate ratio at temperature 1, as `Sampler.gate_probs`)
A cycle started at every t with gamma drafts d_t..d_{t+gamma-1} is simulated exactly as
`VerifySession._check_via_steps` does it: accept while region A; region B commits s_i (rewrite) or
escalates ("pre-check"); region C hands positions i.. to q, which keeps the drafts equal to g and
commits g at the first other one. Per cycle: tokens committed, whether it escalated, and wrong
tokens (an accepted d != g, or a rewritten s != g).
    agreement     = 1 - wrong / committed             (teacher-forced token agreement with q)
    tokens/s      = E[committed] / E[step seconds]
with the step seconds of the engine's own planner (`viasd.planner.step_seconds` for one `via`
row with E[tokens] and P(escalate) from the simulation, on the profiled cost curves of
`viasd.costs`): the same accounting `mode: auto` plans with, not a second model.

The result is stored in the mask artifact (`MaskArtifact.gates`) and used by `via` requests that
set none of alpha1, alpha2 and region_b (EngineConfig.gates = "calibrated", the default);
`gates: paper` keeps the paper's values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from viasd.config import GenerationParams, Mode, RegionB, Rule
from viasd.costs import Acceptance, CostModel
from viasd.planner import Plan, RowState, step_seconds
from viasd.rules import Region, regions_from_ratio
from viasd.runtime import LayerMask, MaskedLM

GATE_FIELDS = ("alpha1", "alpha2", "region_b")
ALPHA1_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
ALPHA2_GRID = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class Gates:
    """The slim verifier's gate thresholds and what region B does."""

    alpha1: float
    alpha2: float
    region_b: str = "rewrite"  # RegionB value

    def apply(self, params: GenerationParams) -> GenerationParams:
        """These gates for a three-tier request that chose none of alpha1 / alpha2 / region_b itself."""
        uses_gate = params.mode == Mode.VIA or (params.mode == Mode.AUTO and params.auto_lossy)
        if not uses_gate or params.rule == Rule.STAGED or set(GATE_FIELDS) & params.model_fields_set:
            return params
        return params.model_copy(
            update={"alpha1": self.alpha1, "alpha2": self.alpha2, "region_b": RegionB(self.region_b)}
        )

    def spec(self) -> str:
        """The method spec of these gates (viasd.bench.methods)."""
        return f"via:alpha1={self.alpha1:g}:alpha2={self.alpha2:g}:region_b={self.region_b}"


PAPER = Gates(0.5, 0.3, "rewrite")


@dataclass
class Signals:
    """Teacher-forced per-position signals of one calibration text (module docstring)."""

    draft: Tensor  # [T] long, d_t
    qtop: Tensor  # [T] long, g_t
    slim_top: Tensor  # [T] long, s_t
    ratio: Tensor  # [T] float64, r_t


@torch.inference_mode()
def signals(
    verifier: MaskedLM, drafter: MaskedLM, mask: LayerMask, sequences: Sequence[Sequence[int]]
) -> list[Signals]:
    """One forward of p, q' (the separate cache policy: an exact sub-model) and q per text."""
    out = []
    for seq in sequences:
        tok = torch.tensor(list(seq), dtype=torch.long)  # [T]
        d = drafter.forward(tok, 0).argmax(-1)  # [T]
        g = verifier.forward(tok, 0).argmax(-1)  # [T]
        logp = verifier.forward(tok, 0, None, mask).double().log_softmax(-1)  # [T, V]
        r = (logp.gather(-1, d[:, None].to(logp.device)).squeeze(-1) - logp.amax(-1)).exp()  # [T]
        out.append(Signals(d.cpu(), g.cpu(), logp.argmax(-1).cpu(), r.cpu()))
    return out


@dataclass
class GateScore:
    """What one gate setting does on the calibration text."""

    alpha1: float
    alpha2: float
    region_b: str
    agreement: float  # 1 - wrong / committed
    tokens_per_cycle: float
    escalation: float  # share of cycles that ran q
    regions_abc: list[float]  # share of positions in A, B, C
    tokens_per_second: float  # modelled, batch 1

    @property
    def gates(self) -> Gates:
        return Gates(self.alpha1, self.alpha2, self.region_b)


@dataclass(frozen=True)
class Cycle:
    """What one simulated greedy cycle commits."""

    committed: int  # tokens the cycle commits
    wrong: int  # of them, tokens that are not q's (teacher forced)
    escalated: bool  # the cycle ran q
    good: int  # tokens before the first wrong one (committed when none is wrong)


def cycle(regions: Sequence[int], ok: Sequence[bool], slim_ok: Sequence[bool], t: int, gamma: int) -> Cycle:
    """The greedy cycle whose drafts are d_t..d_{t+gamma-1} (`VerifySession._check_via_steps`):
    accept while region A; region B commits s (rewrite); region C hands positions i.. to q, which
    keeps the drafts equal to g and commits g at the first other one (or a bonus).

    Exact for the engine's cycle at that point while no wrong token was committed (the drafts
    and q' then see q's own greedy prefix); after the first wrong token the rest is modelled."""
    i = next((k for k in range(gamma) if regions[t + k] != Region.ACCEPT), gamma)
    bad = [k for k in range(i) if not ok[t + k]]  # accepted by q', not q's token
    if i == gamma:
        committed, escalated = gamma, False
    elif regions[t + i] == Region.REWRITE:
        committed, escalated = i + 1, False
        bad += [i] if not slim_ok[t + i] else []
    else:
        j = next((k for k in range(i, gamma) if not ok[t + k]), gamma) - i  # q keeps drafts equal to its argmax
        committed, escalated = i + j + 1, True
    return Cycle(committed, len(bad), escalated, bad[0] if bad else committed)


def simulate(sigs: Sequence[Signals], gates: Gates, gamma: int) -> dict[str, float]:
    """Sums over a cycle started at every position of every text: committed, wrong, cycles,
    escalations, and the positions in each region."""
    out = dict.fromkeys(("committed", "wrong", "cycles", "escalations", "a", "b", "c", "positions"), 0.0)
    for s in sigs:
        regions = regions_from_ratio(
            s.ratio, gates.alpha1, gates.alpha2, rewrite=gates.region_b == RegionB.REWRITE.value
        ).tolist()
        ok, slim_ok = (s.draft == s.qtop).tolist(), (s.slim_top == s.qtop).tolist()
        for name, reg in (("a", Region.ACCEPT), ("b", Region.REWRITE), ("c", Region.ESCALATE)):
            out[name] += sum(1 for x in regions if x == reg)
        out["positions"] += len(regions)
        for t in range(len(regions) - gamma + 1):
            c = cycle(regions, ok, slim_ok, t, gamma)
            out["committed"] += c.committed
            out["wrong"] += c.wrong
            out["escalations"] += c.escalated
            out["cycles"] += 1
    return out


def cycle_seconds(costs: CostModel, plan: Plan, escalation: float = 1.0) -> float:
    """Seconds of one engine step of one row running `plan` (the planner's accounting)."""
    row = RowState(fixed=plan, gamma=max(plan.k, 1), acceptance=Acceptance(), via_escalation=escalation)
    return step_seconds(costs, [row], [plan])


def score(sigs: Sequence[Signals], gates: Gates, gamma: int, costs: CostModel) -> GateScore:
    sums = simulate(sigs, gates, gamma)
    cycles = max(sums["cycles"], 1.0)
    tpc, esc = sums["committed"] / cycles, sums["escalations"] / cycles
    seconds = cycle_seconds(costs, Plan("via", gamma), esc)
    return GateScore(
        gates.alpha1,
        gates.alpha2,
        gates.region_b,
        agreement=1.0 - sums["wrong"] / max(sums["committed"], 1.0),
        tokens_per_cycle=tpc,
        escalation=esc,
        regions_abc=[sums[k] / max(sums["positions"], 1.0) for k in "abc"],
        tokens_per_second=tpc / seconds if seconds > 0 else 0.0,
    )


def grid(alpha1s: Sequence[float] = ALPHA1_GRID, alpha2s: Sequence[float] = ALPHA2_GRID) -> list[Gates]:
    """Every (alpha1, alpha2 < alpha1) with region B rewriting, and every alpha1 with region B
    escalating (alpha2 does not matter there: it is kept at the paper's 0.3 where it fits)."""
    out = [Gates(a1, a2, "rewrite") for a1 in alpha1s for a2 in alpha2s if a2 < a1]
    out += [Gates(a1, 0.3 if a1 > 0.3 else round(a1 / 2, 4), "escalate") for a1 in alpha1s]
    return out


def baselines(sigs: Sequence[Signals], gamma: int, costs: CostModel) -> dict[str, float]:
    """Modelled tokens/s of `ar`, two-tier `sd` and the staged lossless rule (greedy drafts, the
    same texts and accounting). Staged, greedy: q' keeps the drafts equal to its argmax s and
    writes s at the first other one (or a bonus s after gamma), q keeps that block's prefix equal
    to g and commits g; every cycle runs the drafter, q' and q."""
    sd = staged = cycles = 0
    for s in sigs:
        ok, d, g, st = (s.draft == s.qtop).tolist(), s.draft.tolist(), s.qtop.tolist(), s.slim_top.tolist()
        for t in range(len(ok) - gamma):
            sd += next((k for k in range(gamma) if not ok[t + k]), gamma) + 1
            j = next((k for k in range(gamma) if d[t + k] != st[t + k]), gamma)  # q' keeps d[:j]
            block = d[t : t + j] + [st[t + j]]  # y: j + 1 tokens
            staged += next((i for i, y in enumerate(block) if y != g[t + i]), len(block)) + 1
            cycles += 1
    cycles = max(cycles, 1)
    return {
        "ar_tokens_per_second": 1.0 / cycle_seconds(costs, Plan("ar")),
        "sd_tokens_per_cycle": sd / cycles,
        "sd_tokens_per_second": sd / cycles / cycle_seconds(costs, Plan("sd", gamma)),
        "staged_tokens_per_cycle": staged / cycles,
        "staged_tokens_per_second": staged / cycles / cycle_seconds(costs, Plan("via", gamma), 1.0),
        "top1_agreement": {
            "drafter": sum(sum(x.tolist()) for x in (s.draft == s.qtop for s in sigs)) / _n(sigs),
            "slim": sum(sum(x.tolist()) for x in (s.slim_top == s.qtop for s in sigs)) / _n(sigs),
        },
    }


def _n(sigs: Sequence[Signals]) -> int:
    return max(sum(len(s.draft) for s in sigs), 1)


def calibrate(
    sigs: Sequence[Signals],
    costs: CostModel,
    *,
    gamma: int = 5,
    min_agreement: float = 0.95,
    candidates: Sequence[Gates] | None = None,
) -> dict[str, Any]:
    """The gates with the most modelled tokens/s whose agreement >= min_agreement (the most
    agreeing ones when none meets it); the artifact's `gates` entry (JSON-ready)."""
    scores = [score(sigs, g, gamma, costs) for g in (candidates or grid())]
    feasible = [s for s in scores if s.agreement >= min_agreement]
    best = (
        max(feasible, key=lambda s: (s.tokens_per_second, s.agreement))
        if feasible
        else max(scores, key=lambda s: (s.agreement, s.tokens_per_second))
    )
    paper = score(sigs, PAPER, gamma, costs)
    return {
        "alpha1": best.alpha1,
        "alpha2": best.alpha2,
        "region_b": best.region_b,
        "budget": {
            "metric": "teacher-forced greedy token agreement with q",
            "min": min_agreement,
            "met": bool(feasible),
        },
        "gamma": gamma,
        "chosen": asdict(best),
        "paper": asdict(paper),
        **baselines(sigs, gamma, costs),
        "positions": int(sum(len(s.draft) for s in sigs)),
        "grid": [asdict(s) for s in scores],
        "throughput": "modelled: viasd.planner.step_seconds on the profiled cost curves (viasd.costs), batch 1",
    }


def gates_from_artifact(entry: dict[str, Any] | None) -> Gates | None:
    """The calibrated gates of an artifact's `gates` entry (None when it has none)."""
    if not entry:
        return None
    return Gates(float(entry["alpha1"]), float(entry["alpha2"]), str(entry.get("region_b", "rewrite")))
