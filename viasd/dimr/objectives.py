"""Mask objectives: per-sequence sums that add over sequences, and the value they give.

Every value is a per-token mean over the same positions, so values on different subsets of equal
text are comparable (`OBJECTIVES`):

    rkl   mean_t R^KL_{alpha,beta}(q_t || q'_t)  (C(z) / tau; artifact also records C(z))  minimise
    kl    mean_t KL(q_t || q'_t) = sum_v q log(q / q')                                         minimise
    tv    mean_t 1/2 sum_v |q_t(v) - q'_t(v)|                                                   minimise
    top1  mean_t 1{argmax q'_t = argmax q_t}                                                    maximise
    e2e   committed tokens that agree with q, per second of modelled cycle cost                 maximise

e2e models the three-tier cycle of `viasd.engine` (greedy, block gamma) on the calibration text,
teacher-forced: at every position t the drafter's greedy token d_t, q's argmax g_t, q'_z's argmax
s_t and the gate ratio r_t = q'_t(d_t) / max_v q'_t(v) (temperature 1, as `Sampler.gate_probs`)
give the region A / B / C of `rules.regions_from_ratio`. Every position t starts one cycle over
t..t+gamma-1; i = the first non-A position:

    cost   = gamma c_p + c_q' + 1{region C at i} c_q         (measured forward costs, seconds)
    all A: commits gamma draft tokens;  B at i: i + 1 (the rewrite);
    C at i: q accepts j more draft tokens (d = g) and commits i + j + 1.
    good   = committed tokens before the first one that differs from q's greedy choice
             (a slim-accepted d != g, or a rewrite s != g)
    e2e    = sum_cycles good / sum_cycles cost

so a slim verifier that waves every draft through does not score well. c_p is one drafter forward
of one token, c_q' and c_q one forward of a gamma + 1 block, measured once per ratio (all masks
with k skipped layers cost the same). Also reported: the paper's per-token expected cost
(appendix B.3), delta_1 = 1{A}, delta_2 = 1{C} for greedy drafts,

    E[C_t] = (1 - delta_2)((1 - delta_1) c_p + delta_1 c_q') + delta_2 c_q .

Teacher forcing is an approximation: positions after a draft token that differs from the text
condition on the text, not on the draft.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from viasd.dimr.placement import synchronize
from viasd.dimr.reference import Reference, slim_logprobs
from viasd.errors import InvalidParameterError
from viasd.gates import cycle
from viasd.rules import Region, check_thresholds, regions_from_ratio
from viasd.runtime import LayerMask, MaskedLM

_ROW_CHUNK = 64  # positions per chunk when reducing over the vocabulary (bounds temporary memory)

# --------------------------------------------------------------------------------------------
# Objectives: per-sequence sums that add over sequences, and the value they give
# --------------------------------------------------------------------------------------------


class Objective:
    """A mask score. `stats` returns sums over one sequence; `value` turns summed stats into the score.

    A sum in `stats` is a number or a 0-d float64 tensor on the logits' device: a caller adds
    them up over sequences where they are and reads them back once (`host_sums`) when it needs
    the value, so scoring a mask on a GPU does not wait for the device after every sequence.
    `value` takes host numbers.
    """

    name: str = ""
    direction: str = "minimize"  # or "maximize"
    needs_drafter: bool = False

    def stats(self, logp: Tensor, ref: Reference, index: int) -> dict[str, float | Tensor]:
        raise NotImplementedError

    def value(self, sums: dict[str, float]) -> float:
        return sums["sum"] / sums["n"]

    def loss(self, value: float) -> float:
        """The number the search minimises: the value, or minus it for a maximised objective."""
        return value if self.direction == "minimize" else -value

    def params(self) -> dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in self.params().items())})"


def host_sums(sums: dict[str, float | Tensor]) -> dict[str, float]:
    """`sums` as Python floats, the tensors among them read back in one device-to-host copy
    (one wait for the device); float64, so the sum of float32 per-sequence sums is exactly what
    adding their Python floats gives."""
    keys = [k for k, v in sums.items() if isinstance(v, Tensor)]
    out = {k: float(v) for k, v in sums.items() if not isinstance(v, Tensor)}
    if keys:
        dev = sums[keys[0]].device
        values = torch.stack([sums[k].reshape(()).to(dev, torch.float64) for k in keys]).tolist()  # [K] -> host
        out.update(zip(keys, values))
    return {k: out[k] for k in sums}


def add_sums(acc: dict[str, float | Tensor], stats: dict[str, float | Tensor]) -> None:
    """acc[k] += stats[k] for every k, where the values are (on the device for tensors)."""
    for k, v in stats.items():
        acc[k] = acc.get(k, 0.0) + v


def _row_chunks(logp: Tensor, logq: Tensor):
    for a in range(0, logp.shape[0], _ROW_CHUNK):
        yield logp[a : a + _ROW_CHUNK], logq[a : a + _ROW_CHUNK].to(logp.dtype)  # [c, V] each


def rkl_per_position(logp: Tensor, logq: Tensor, alpha: float = 0.0, beta: float = 1.0) -> Tensor:
    """R^KL_{alpha,beta}(q_t || p_t) for every row t: logp (p = q'_z), logq [T, V] -> [T].

    sum_v p ReLU(log(1-alpha) + log p - log q) + sum_v q ReLU(log beta + log p - log q).
    """
    assert logp.shape == logq.shape and logp.ndim == 2, (logp.shape, logq.shape)
    a, b = math.log1p(-alpha), math.log(beta)
    out = []
    for lp, lq in _row_chunks(logp, logq):
        d = lp - lq  # [c, V] log(p / q)
        out.append((lp.exp() * (d + a).clamp_min(0)).sum(-1) + (lq.exp() * (d + b).clamp_min(0)).sum(-1))
    return torch.cat(out)  # [T]


@dataclass(frozen=True, repr=False)
class RKLObjective(Objective):
    """The paper's C(z) / tau: mean over positions of R^KL_{alpha,beta}(q || q'_z) (lower is better)."""

    alpha: float = 0.0
    beta: float = 1.0
    name = "rkl"
    direction = "minimize"

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha < 1.0:
            raise InvalidParameterError("rkl_alpha", f"must be in [0, 1), got {self.alpha}")
        if not 0.0 < self.beta <= 1.0:
            raise InvalidParameterError("rkl_beta", f"must be in (0, 1], got {self.beta}")

    def stats(self, logp, ref, index):
        r = rkl_per_position(logp, ref.logq[index], self.alpha, self.beta)  # [T]
        return {"sum": r.sum().double(), "n": float(r.shape[0])}

    def params(self):
        return {"alpha": self.alpha, "beta": self.beta}


class KLObjective(Objective):
    """Mean forward KL(q_t || q'_t) = sum_v q log(q / q') (lower is better)."""

    name = "kl"
    direction = "minimize"

    def stats(self, logp, ref, index):
        total = 0.0
        for lp, lq in _row_chunks(logp, ref.logq[index]):
            total = total + (lq.exp() * (lq - lp)).sum().double()  # 0-d, on the device
        return {"sum": total, "n": float(logp.shape[0])}


class TVObjective(Objective):
    """Mean total variation 1/2 sum_v |q_t - q'_t| (lower is better)."""

    name = "tv"
    direction = "minimize"

    def stats(self, logp, ref, index):
        total = 0.0
        for lp, lq in _row_chunks(logp, ref.logq[index]):
            total = total + 0.5 * (lq.exp() - lp.exp()).abs().sum().double()  # 0-d, on the device
        return {"sum": total, "n": float(logp.shape[0])}


class Top1Objective(Objective):
    """Share of positions where q'_z's argmax equals q's (higher is better)."""

    name = "top1"
    direction = "maximize"

    def stats(self, logp, ref, index):
        agree = (logp.argmax(-1) == ref.qtop[index]).sum()  # 0-d, on the device
        return {"sum": agree.double(), "n": float(logp.shape[0])}


@dataclass(frozen=True)
class Costs:
    """Measured forward costs in seconds (see `measure_costs`)."""

    drafter: float  # c_p: one drafter forward of one token
    slim: float  # c_q': one masked forward of a gamma + 1 block
    full: float  # c_q: one full forward of a gamma + 1 block
    full_token: float  # one full forward of one token (autoregressive decoding)

    def to_dict(self) -> dict[str, float]:
        return {"drafter": self.drafter, "slim": self.slim, "full": self.full, "full_token": self.full_token}


@dataclass(frozen=True, repr=False)
class E2EObjective(Objective):
    """Modelled good tokens per second of the three-tier cycle (higher is better); module docstring."""

    costs: Costs
    gamma: int = 5
    alpha1: float = 0.5
    alpha2: float = 0.3
    rewrite: bool = True  # region B rewrites (paper) or escalates ("pre-check")
    name = "e2e"
    direction = "maximize"
    needs_drafter = True

    def __post_init__(self) -> None:
        check_thresholds(self.alpha1, self.alpha2)
        if self.gamma < 1:
            raise InvalidParameterError("gamma", f"must be >= 1, got {self.gamma}")

    def stats(self, logp, ref, index):
        """Host sums: the cycle model runs on the host, one device-to-host copy per sequence."""
        if ref.draft is None:
            raise InvalidParameterError("drafter", "the e2e objective needs a drafter (build_reference(..., drafter=))")
        d, g = ref.draft[index], ref.qtop[index]  # [T], [T]
        s = logp.argmax(-1)  # [T]
        r = (logp.gather(-1, d[:, None]).squeeze(-1) - logp.amax(-1)).exp()  # [T] q'(d) / max q'
        regions_t = regions_from_ratio(r, self.alpha1, self.alpha2, rewrite=self.rewrite)  # [T] long
        regions, ok_i, slim_i = torch.stack([regions_t, (d == g).long(), (s == g).long()]).tolist()  # [3, T] -> host
        ok, slim_ok = [bool(x) for x in ok_i], [bool(x) for x in slim_i]
        c = self.costs
        gm = self.gamma
        out = dict.fromkeys(("good", "committed", "cost", "cycles", "escalations", "sd_tokens", "sd_cost"), 0.0)
        for t in range(len(regions) - gm + 1):
            cyc = cycle(regions, ok, slim_ok, t, gm)  # the engine's cycle (viasd.gates), teacher forced
            out["good"] += cyc.good
            out["committed"] += cyc.committed
            out["cost"] += gm * c.drafter + c.slim + (c.full if cyc.escalated else 0.0)
            out["escalations"] += cyc.escalated
            out["cycles"] += 1
            j_sd = next((k for k in range(gm) if not ok[t + k]), gm)  # two-tier SD on the same cycle
            out["sd_tokens"] += j_sd + 1
            out["sd_cost"] += gm * c.drafter + c.full
        # the paper's per-token expected cost (appendix B.3), delta_1 = 1{A}, delta_2 = 1{C}
        regs = torch.tensor(regions)
        d1, d2 = (regs == Region.ACCEPT).double(), (regs == Region.ESCALATE).double()
        e_cost = (1 - d2) * ((1 - d1) * c.drafter + d1 * c.slim) + d2 * c.full  # [T]
        out["paper_cost_sum"] = float(e_cost.sum())
        out["positions"] = float(len(regions))
        for name, reg_id in (("region_a", Region.ACCEPT), ("region_b", Region.REWRITE), ("region_c", Region.ESCALATE)):
            out[name] = float((regs == reg_id).sum())
        return out

    def value(self, sums):
        return sums["good"] / sums["cost"] if sums["cost"] else 0.0

    def params(self):
        return {
            "gamma": self.gamma,
            "alpha1": self.alpha1,
            "alpha2": self.alpha2,
            "region_b": "rewrite" if self.rewrite else "escalate",
            "costs": self.costs.to_dict(),
        }


OBJECTIVES = ("rkl", "kl", "tv", "top1", "e2e")


def make_objective(
    name: str,
    *,
    rkl_alpha: float = 0.0,
    rkl_beta: float = 1.0,
    costs: Costs | None = None,
    gamma: int = 5,
    alpha1: float = 0.5,
    alpha2: float = 0.3,
    rewrite: bool = True,
) -> Objective:
    """The objective called `name` (one of OBJECTIVES)."""
    if name == "rkl":
        return RKLObjective(rkl_alpha, rkl_beta)
    if name == "kl":
        return KLObjective()
    if name == "tv":
        return TVObjective()
    if name == "top1":
        return Top1Objective()
    if name == "e2e":
        if costs is None:
            raise InvalidParameterError("objective", "e2e needs measured forward costs (measure_costs)")
        return E2EObjective(costs, gamma, alpha1, alpha2, rewrite)
    raise InvalidParameterError("objective", f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")


def measure_costs(
    verifier: MaskedLM, drafter: MaskedLM, mask: LayerMask, *, gamma: int = 5, context: int = 128, repeats: int = 5
) -> Costs:
    """Wall time of the forwards a cycle makes, each after `context` cached positions.

    The four forwards are timed in interleaved rounds (after one warm-up round) and each cost is
    the minimum over `repeats` rounds: the least-disturbed figure on a shared machine. On a GPU
    each timed forward ends when every device of its model has finished it (`synchronize`).
    """
    ctx = torch.arange(context + gamma + 1) % verifier.vocab_size  # [context + gamma + 1]
    kinds = {
        "drafter": (drafter, None, 1),
        "slim": (verifier, mask, gamma + 1),
        "full": (verifier, None, gamma + 1),
        "full_token": (verifier, None, 1),
    }
    caches = {}
    for name, (lm, m, _) in kinds.items():
        caches[name] = lm.new_cache(m)
        lm.forward(ctx[:context], 0, caches[name], m)
        synchronize(lm)
    best = dict.fromkeys(kinds, float("inf"))
    for r in range(repeats + 1):
        for name, (lm, m, n) in kinds.items():
            caches[name].crop(context)
            t0 = time.perf_counter()
            lm.forward(ctx[context : context + n], context, caches[name], m)
            synchronize(lm)
            if r:  # round 0 warms up
                best[name] = min(best[name], time.perf_counter() - t0)
    return Costs(**best)


def evaluate_mask(
    verifier: MaskedLM, ref: Reference, mask: LayerMask, objectives: Sequence[Objective]
) -> dict[str, Any]:
    """Every objective's value for one mask over the whole reference (one slim forward per
    sequence; the sums read back from the device once per objective, at the end)."""
    sums: list[dict[str, float | Tensor]] = [{} for _ in objectives]
    for i in range(len(ref.tokens)):
        logp = slim_logprobs(verifier, ref, i, mask)
        for acc, obj in zip(sums, objectives):
            add_sums(acc, obj.stats(logp, ref, i))
    out: dict[str, Any] = {}
    for acc, obj in zip((host_sums(a) for a in sums), objectives):
        out[obj.name] = obj.value(acc)
        if obj.name == "rkl":
            out["rkl_total"] = acc["sum"]  # the paper's C(z), a sum over positions
        if obj.name == "e2e":
            c: Costs = obj.costs
            out["e2e_detail"] = {
                "good_tokens_per_s": acc["good"] / acc["cost"],
                "committed_tokens_per_s": acc["committed"] / acc["cost"],
                "good_tokens_per_cycle": acc["good"] / acc["cycles"],
                "escalation_rate": acc["escalations"] / acc["cycles"],
                "regions_abc": [acc[k] / acc["positions"] for k in ("region_a", "region_b", "region_c")],
                "paper_expected_cost_s": acc["paper_cost_sum"] / acc["positions"],
                "sd_tokens_per_s": acc["sd_tokens"] / acc["sd_cost"],
                "ar_tokens_per_s": 1.0 / c.full_token,
            }
    return out
