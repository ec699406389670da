"""DIMR: the offline search for the slim verifier's layer mask z (VIA-SD paper, section 3.4).

The slim verifier q'_z is the full verifier q with the layers l where z_l = 0 bypassed. DIMR looks
for the mask with exactly k = round(r L) skipped layers (the first and last layer kept, by default)
that keeps q'_z closest to q on calibration text:

    C(z) = sum_{t=1..tau} R^KL_{alpha,beta}(q || q'_z)|_t ,        z* = argmin_z C(z)

    R^KL_{alpha,beta}(q || p) = E_p[ ReLU(log((1 - alpha) p / q)) ] + E_q[ ReLU(log(beta p / q)) ]
                              = sum_v p(v) ReLU(log(1-alpha) + log p(v) - log q(v))
                              + sum_v q(v) ReLU(log(beta)    + log p(v) - log q(v))

Our reading of the paper (section 3.3): p is the distribution being checked and q the one that
checks it, so here p := q'_z (slim) and q := q (full model). The two terms are the log-margin
violations of the lossy rule's two constraints, q >= (1 - alpha) p (acceptance threshold) and
p <= q / beta (residual replacement): each ReLU is positive exactly where q'_z puts more mass on a
token than the rule tolerates. The paper gives no values of (alpha, beta) for the search; the
defaults here are alpha = 0, beta = 1, the constraints of the lossless rule the engine's full
verifier applies by default (`Rule.LOSSLESS`). Then R = E_{q'}[ReLU(log q'/q)] + E_q[ReLU(log q'/q)]
>= 0 with equality iff q'_z = q. Larger alpha / smaller beta tolerate some overshoot (the
`--rule lossy` settings): choose the pair the service will verify with.

The search (section 3.4): trial o proposes z = BayesOpt(.) when o mod theta = 0, else
RandomSearch(.). Trial 0 is the evenly spaced mask (the baseline to beat). Our reading of
RandomSearch: after `startup` uniformly random masks, a random neighbour of the best mask so far
(with probability `explore` a fresh uniform mask instead), so the best mask is carried forward.
A neighbour swaps m = 1..3 skipped layers for kept ones; half of the time the swapped layers are
drawn uniformly, otherwise weighted by a ridge-regression estimate of each layer's cost, fitted
on every earlier trial's first-rung value (loss ~ b + sum_l w_l z_l, z_l = 1 when l is skipped):
costly skipped layers are more likely to come back, cheap kept ones more likely to be skipped.
BayesOpt is optuna's TPE sampler (seeded, independent per layer) over one score s_l in [0, 1] per
free layer, decoded as "skip the k layers with the lowest scores"; every trial, random or not, is
told to TPE (pruned ones as pruned, with their rung values). Masks already scored are not
proposed again by the random steps; a TPE proposal of a known mask reuses its result.

Successive halving (the asynchronous ASHA rule): the calibration sequences are scored in a fixed
order; at rung fractions (default 1/4 and 1/2 of the tokens) a candidate continues only if its
running value is among the best 1/eta (eta = 2: the better half) of the values all earlier
trials had at that rung; otherwise it is dropped (pruned) and its remaining tokens are never run.

Objectives (`OBJECTIVES`; every value is a per-token mean over the same positions, so values on
different subsets of equal text are comparable):

    rkl   mean_t R^KL_{alpha,beta}(q_t || q'_t)  (C(z) / tau; artifact also records C(z))  minimise
    kl    mean_t KL(q_t || q'_t) = sum_v q log(q / q')                                         minimise
    tv    mean_t 1/2 sum_v |q_t(v) - q'_t(v)|                                                   minimise
    top1  mean_t 1{argmax q'_t = argmax q_t}                                                    maximise
    e2e   committed tokens that agree with q, per second of modelled cycle cost                 maximise

The e2e objective models the three-tier cycle of `viasd.engine` (greedy, block gamma) on the
calibration text, teacher-forced: at every position t the real drafter's greedy token d_t, q's
argmax g_t, q'_z's argmax s_t and the gate ratio r_t = q'_t(d_t) / max_v q'_t(v) (temperature 1,
as `Sampler.gate_probs`) give the region A / B / C of `rules.regions_from_ratio`. A cycle starting
at t looks at positions t..t+gamma-1; i = the first non-A position:

    cost   = gamma c_p + c_q' + 1{region C at i} c_q         (measured forward costs, seconds)
    all A: commits gamma draft tokens;  B at i: i + 1 (the rewrite);
    C at i: q accepts j more draft tokens (d = g) and commits i + j + 1.
    good   = committed tokens before the first one that differs from q's greedy choice
             (a slim-accepted d != g, or a rewrite s != g), so a slim verifier that waves every
             draft through does not score well.

    e2e = sum_cycles good / sum_cycles cost       (tokens per second; higher is better)

Every position starts one cycle. c_p is one drafter forward of one token, c_q' and c_q one
forward of a gamma + 1 block (the engine's slim and escalation forwards), measured once per
ratio (all masks with k skipped layers cost the same). The evaluation also reports the paper's
per-token expected cost (appendix B.3), with delta_1 = 1{A}, delta_2 = 1{C} for greedy drafts:

    E[C_t] = (1 - delta_2)((1 - delta_1) c_p + delta_1 c_q') + delta_2 c_q .

Teacher forcing is an approximation: positions after a draft token that differs from the text
condition on the text, not on the draft.

Cache policies (docs/ARCHITECTURE.md, "Caches"); masks are scored under the policy the service uses:

* separate: q' has its own cache of the kept layers, so q'_z over the text is one masked forward;
* shared:   q' writes into q's cache slots; older positions carry q's keys/values. Emulated as
            blocks of gamma + 1 positions [s, s + gamma + 1) (s a multiple of gamma + 1): q'_z
            attends to q's keys/values for positions < s and to its own for the block. One
            forward over the whole text does this with a [T, 2T] attention mask over
            [q's K/V ; q'_z's K/V] (`shared_policy_logits`; equal to the block-by-block loop).

The full model's distributions (and, for `shared`, its keys/values; for e2e, the drafter's greedy
tokens) are computed once (`build_reference`) and reused by every trial. The result is a
versioned JSON artifact (`build_artifact`, `MaskArtifact`) tied to the verifier by
`viasd.models.loader.model_fingerprint`; `load_artifact_mask` refuses a mismatch.

Modules, one job each: `space` (how many layers, which are free), `calibration` (the text),
`reference` (q's log-probabilities once; q'_z under a cache policy), `objectives` (RKL, KL, TV,
top-1, e2e), `search` (`MaskSearch`: proposals, successive halving), `artifact` (the versioned
JSON, the fingerprint check, shipped masks), `report` (tables, plots), `run` (`run_dimr`, the
`viasd dimr` command). This package re-exports their public names.
"""

from __future__ import annotations

from viasd.dimr.artifact import (  # noqa: F401
    ARTIFACT_KIND,
    SCHEMA_VERSION,
    MaskArtifact,
    build_artifact,
    check_artifact,
    load_artifact_mask,
    parse_artifact,
    read_artifact,
    save_artifact,
    shipped_artifacts,
    shipped_mask,
)
from viasd.dimr.calibration import (  # noqa: F401
    Calibration,
    file_calibration,
    humaneval_calibration,
    token_calibration,
)
from viasd.dimr.objectives import (  # noqa: F401
    OBJECTIVES,
    Costs,
    E2EObjective,
    KLObjective,
    Objective,
    RKLObjective,
    Top1Objective,
    TVObjective,
    evaluate_mask,
    make_objective,
    measure_costs,
    rkl_per_position,
)
from viasd.dimr.reference import (  # noqa: F401
    Reference,
    build_reference,
    shared_policy_logits,
    slim_logprobs,
)
from viasd.dimr.report import (  # noqa: F401
    heldout_table,
    plot_trials,
    summary_table,
    table4,
)
from viasd.dimr.run import (  # noqa: F401
    _default_out,
    run_dimr,
)
from viasd.dimr.search import (  # noqa: F401
    MaskSearch,
    SearchResult,
    SearchSettings,
    TrialRecord,
    _rung_ends,
    search_mask,
)
from viasd.dimr.space import (  # noqa: F401
    evenly_spaced_skips,
    normalize_keep,
    num_skipped,
)

__all__ = [
    "evenly_spaced_skips",
    "normalize_keep",
    "num_skipped",
    "Calibration",
    "file_calibration",
    "humaneval_calibration",
    "token_calibration",
    "Reference",
    "build_reference",
    "shared_policy_logits",
    "slim_logprobs",
    "Costs",
    "E2EObjective",
    "KLObjective",
    "OBJECTIVES",
    "Objective",
    "RKLObjective",
    "TVObjective",
    "Top1Objective",
    "evaluate_mask",
    "make_objective",
    "measure_costs",
    "rkl_per_position",
    "MaskSearch",
    "SearchResult",
    "SearchSettings",
    "TrialRecord",
    "search_mask",
    "heldout_table",
    "plot_trials",
    "summary_table",
    "table4",
    "ARTIFACT_KIND",
    "SCHEMA_VERSION",
    "MaskArtifact",
    "build_artifact",
    "check_artifact",
    "load_artifact_mask",
    "parse_artifact",
    "read_artifact",
    "save_artifact",
    "shipped_artifacts",
    "shipped_mask",
    "run_dimr",
]
