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
p <= q / beta (residual replacement). The paper gives no (alpha, beta) for the search; the
defaults alpha = 0, beta = 1 are the lossless rule's (`Rule.LOSSLESS`), where
R = E_{q'}[ReLU(log q'/q)] + E_q[ReLU(log q'/q)] >= 0 with equality iff q'_z = q. Larger alpha /
smaller beta tolerate some overshoot (`--rule lossy`): choose the pair the service verifies with.

The full model's distributions are computed once (`build_reference`) and reused by every trial;
the result is a versioned JSON artifact (`build_artifact`, `MaskArtifact`) tied to the verifier by
`viasd.models.loader.model_fingerprint`; `load_artifact_mask` refuses a mismatch.

Modules, one job each: `space` (how many layers, which are free), `calibration` (the text),
`reference` (q's log-probabilities once; q'_z under a cache policy), `objectives` (RKL, KL, TV,
top-1, e2e), `search` (`MaskSearch`: proposals, successive halving), `artifact` (the versioned
JSON, the fingerprint check, shipped masks), `report` (tables, plots), `placement` (the device,
or the verifier's layers over several GPUs), `run` (`run_dimr`, the `viasd dimr` command). This
package re-exports their public names.
"""

from __future__ import annotations

from viasd.dimr.artifact import (  # noqa: F401
    ARTIFACT_KIND,
    SCHEMA_VERSION,
    MaskArtifact,
    build_artifact,
    check_artifact,
    files_match,
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
    host_sums,
    make_objective,
    measure_costs,
    rkl_per_position,
)
from viasd.dimr.placement import (  # noqa: F401
    PlacedLM,
    Placement,
    load_placed,
    parse_device,
    parse_devices,
    split_layers,
)
from viasd.dimr.reference import (  # noqa: F401
    Reference,
    build_reference,
    separate_policy_logits,
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
    "separate_policy_logits",
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
    "host_sums",
    "make_objective",
    "measure_costs",
    "rkl_per_position",
    "PlacedLM",
    "Placement",
    "load_placed",
    "parse_device",
    "parse_devices",
    "split_layers",
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
    "files_match",
    "load_artifact_mask",
    "parse_artifact",
    "read_artifact",
    "save_artifact",
    "shipped_artifacts",
    "shipped_mask",
    "run_dimr",
]
