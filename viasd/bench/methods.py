"""The methods a benchmark compares: a small registry parsed from spec strings.

A method spec is a head followed by ``:key=value`` overrides::

    ar | sd | via                  our engine in that mode
    hf                             transformers' plain ``model.generate`` (the verifier alone)
    hf-assisted                    transformers' assisted generation (``assistant_model`` = our drafter)
    hf-lookup                      transformers' prompt lookup decoding (``prompt_lookup_num_tokens`` =
                                   gamma, ``max_matching_ngram_size`` = ngram_max): the peer of
                                   ``sd:proposer=ngram``

    via:region_b=escalate:gamma=3  any GenerationParams field
    via:mask=random:skip_ratio=0.35  engine overrides: mask, skip_ratio, cache_policy
    hf-assisted:draft=fixed        HF drafts exactly `gamma` tokens a cycle (default: HF's own
                                   schedule, 20 tokens with its confidence-based early stop)
    ar:min_p=0.5                   the verifier with min-p truncation: the matched baseline of seed 003

Masks (``mask=``): ``default`` (the mask the models were loaded with: the searched mask when one
is available for the verifier, else the evenly spaced placeholder), ``searched`` (a searched mask
at the method's skip ratio; an error when none exists), ``even`` (evenly spaced), ``random`` or
``random@SEED`` (uniformly random inner layers, first and last kept, as in the paper's Table 6),
``3+5+9`` (the skipped layers), or a JSON file (``viasd.llm.load_mask``).

Several specs are separated by ``,`` (or by ``;`` when a spec itself contains a comma). The
label of a method is its spec string as written.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from viasd.config import GenerationParams, Mode, parse_params
from viasd.errors import InvalidParameterError

KINDS = ("engine", "hf_generate", "hf_assisted", "hf_lookup")
HEADS = {
    "ar": ("engine", Mode.AR),
    "sd": ("engine", Mode.SD),
    "via": ("engine", Mode.VIA),
    "auto": ("engine", Mode.AUTO),
    "hf": ("hf_generate", Mode.AR),
    "hf-generate": ("hf_generate", Mode.AR),
    "hf-assisted": ("hf_assisted", Mode.SD),
    "hf-lookup": ("hf_lookup", Mode.SD),
}
ENGINE_KEYS = ("mask", "skip_ratio", "cache_policy")
HF_DRAFT = ("default", "fixed")
# Parameters a greedy decode never reads in these kinds (the argmax ignores every truncation).
# In `via` they still shape the gate (which reads q' at temperature 1), so they are kept there.
_GREEDY_IGNORED = ("top_k", "top_p", "min_p", "seed")


@dataclass(frozen=True)
class Method:
    """One way of decoding: what runs, with which request parameters and engine settings."""

    label: str
    kind: str  # "engine" | "hf_generate" | "hf_assisted" | "hf_lookup"
    params: GenerationParams
    mask: str = "default"
    skip_ratio: float | None = None  # None: the loaded engine's ratio
    cache_policy: str | None = None  # None: the loaded engine's policy
    hf_draft: str = "default"
    overrides: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def mode(self) -> Mode:
        return self.params.mode

    @property
    def lossy(self) -> bool:
        """Methods whose output is not the verifier's distribution (seed 003's matched-baseline rule)."""
        if self.kind != "engine" or self.params.rule.value == "staged":  # staged: both stages lossless
            return False
        return self.mode == Mode.VIA or self.params.rule.value != "lossless"

    def key(self, skipped_layers: tuple[int, ...] | None = None) -> str:
        """Equal for two methods that decode identically (used to run each distinct method once).

        `skipped_layers`: the resolved mask of a `via` method, so that two spellings of one mask
        (``mask=even`` when the default mask is evenly spaced, say) count as one method."""
        params = self.params.model_dump(mode="json")
        params.pop("seed", None)  # the runner sets the seed
        if self.params.greedy and self.mode != Mode.VIA:
            for name in _GREEDY_IGNORED:
                params.pop(name, None)
        if self.kind == "engine" and self.mode == Mode.AR:  # ar never reads the drafting/gate knobs
            for name in (
                "gamma",
                "alpha1",
                "alpha2",
                "region_b",
                "slim_bonus",
                "rule",
                "lossy_alpha",
                "lossy_beta",
                "overshoot_ceiling",
            ):
                params.pop(name, None)
        engine = {}
        if self.kind == "engine" and self.mode == Mode.VIA:
            mask = list(skipped_layers) if skipped_layers is not None else [self.mask, self.skip_ratio]
            engine = {"mask": mask, "cache_policy": self.cache_policy}
        if self.kind == "hf_assisted":
            engine = {"draft": self.hf_draft}
            if self.hf_draft == "default":
                params.pop("gamma", None)
        if self.kind != "engine":
            params.pop("mode", None)
        return json.dumps({"kind": self.kind, "params": params, "engine": engine}, sort_keys=True)

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description (every setting that differs from the base parameters)."""
        return {
            "label": self.label,
            "kind": self.kind,
            "mode": self.mode.value,
            "overrides": dict(self.overrides),
            "params": self.params.model_dump(mode="json"),
            "mask": self.mask if self.kind == "engine" and self.mode == Mode.VIA else None,
            "skip_ratio": self.skip_ratio,
            "cache_policy": self.cache_policy,
            "hf_draft": self.hf_draft if self.kind == "hf_assisted" else None,
        }


def split_specs(spec: str) -> list[str]:
    sep = ";" if ";" in spec else ","
    return [s.strip() for s in spec.split(sep) if s.strip()]


def parse_method(spec: str, base: GenerationParams) -> Method:
    """One spec string -> Method; InvalidParameterError naming the bad part otherwise."""
    head, *parts = spec.strip().split(":")
    if head not in HEADS:
        raise InvalidParameterError("methods", f"unknown method {head!r} in {spec!r}; known: {', '.join(HEADS)}")
    kind, mode = HEADS[head]
    overrides: dict[str, str] = {}
    for part in parts:
        if "=" not in part:
            raise InvalidParameterError("methods", f"{part!r} in {spec!r} is not key=value")
        k, v = part.split("=", 1)
        overrides[k.strip()] = v.strip()
    extra = {k: overrides.pop(k) for k in list(overrides) if k in ENGINE_KEYS or k == "draft"}
    unknown = [k for k in overrides if k not in GenerationParams.model_fields or k == "mode"]
    if unknown:
        raise InvalidParameterError("methods", f"unknown key {unknown[0]!r} in {spec!r}")
    values = base.model_dump(exclude_unset=True)
    values.update(overrides, mode=mode)
    params = parse_params(values)
    draft = extra.get("draft", "default")
    if draft not in HF_DRAFT or ("draft" in extra and kind != "hf_assisted"):
        raise InvalidParameterError(
            "methods", f"draft={draft!r} in {spec!r}: only hf-assisted takes draft=default|fixed"
        )
    skip_ratio = None
    if "skip_ratio" in extra:
        try:
            skip_ratio = float(extra["skip_ratio"])
        except ValueError:
            raise InvalidParameterError("methods", f"skip_ratio in {spec!r} is not a number") from None
        if not 0.0 <= skip_ratio < 1.0:
            raise InvalidParameterError("methods", f"skip_ratio in {spec!r} must be in [0, 1)")
    policy = extra.get("cache_policy")
    if policy is not None and policy not in ("separate", "shared"):
        raise InvalidParameterError("methods", f"cache_policy in {spec!r} must be separate or shared")
    mask = extra.get("mask", "default")
    if skip_ratio is not None and mask == "default":
        mask = "auto"  # a ratio other than the loaded one: searched at that ratio if known, else even
    if (mask != "default" or skip_ratio is not None or policy is not None) and mode != Mode.VIA:
        raise InvalidParameterError("methods", f"mask, skip_ratio and cache_policy apply to via only: {spec!r}")
    return Method(spec.strip(), kind, params, mask, skip_ratio, policy, draft, {**overrides, **extra})


def parse_methods(spec: str | list[str], base: GenerationParams) -> list[Method]:
    """Comma-separated specs (or a list) -> methods, in order, duplicates by label dropped."""
    specs = split_specs(spec) if isinstance(spec, str) else list(spec)
    if not specs:
        raise InvalidParameterError("methods", "no method given")
    out: dict[str, Method] = {}
    for s in specs:
        m = parse_method(s, base)
        out.setdefault(m.label, m)
    return list(out.values())


def matched_baseline(method: Method, base: GenerationParams) -> Method | None:
    """The matched baseline of a lossy `via` method (seed 003): the verifier alone, decoded with
    the truncation the accept gate implies.

    The gate accepts a draft token x when q'(x) / max q' >= alpha1: the allowed set is min-p's
    with p_base = alpha1 (applied after the request's own truncation, so a request min-p m gives
    max(m, alpha1)). Read as the paper's (1 - alpha) M form of the gate (docs/ARCHITECTURE.md) it
    would be min-p = 1 - alpha1; the two agree at the default alpha1 = 0.5, and this module follows
    the gate as implemented. At temperature 0 min-p changes nothing (the argmax is always kept), so
    the matched baseline decodes exactly like `ar`; it matters for sampled runs.
    """
    if not (method.kind == "engine" and method.mode == Mode.VIA and method.lossy):
        return None
    p = method.params
    min_p = max(p.min_p, p.alpha1)
    min_p = min(min_p, 0.999999)  # GenerationParams.min_p < 1 (alpha1 = 1 keeps only the top token)
    label = f"ar:min_p={min_p:g}"
    if p.temperature != base.temperature:
        label += f":temperature={p.temperature:g}"
    for name in ("top_k", "top_p"):
        if getattr(p, name) != getattr(base, name):
            label += f":{name}={getattr(p, name)}"
    return parse_method(label, base)


def random_mask_skipped(num_layers: int, ratio: float, seed: int = 0) -> list[int]:
    """round(ratio * L) layers drawn uniformly from 1..L-2 (first and last kept), seeded."""
    n_skip = min(round(ratio * num_layers), max(num_layers - 2, 0))
    return sorted(random.Random(seed).sample(range(1, num_layers - 1), n_skip))


# ------------------------------------------------------------------------------ suites


@dataclass(frozen=True)
class Group:
    """Methods plotted together: an ablation sweep (x = a parameter) or a bar comparison."""

    name: str
    title: str
    plot: str  # "bar" | "line" | "heatmap"
    methods: tuple[str, ...]
    x: str | None = None  # the swept parameter (line, heatmap)
    y: str | None = None  # heatmap rows
    series: str | None = None  # line: one curve per value of this attribute ("mode")
    paper: str = ""  # the paper's figure or table this reproduces


MAIN_METHODS = ("ar", "sd", "via", "via:region_b=escalate", "hf", "hf-assisted", "hf-assisted:draft=fixed")

SKIP_RATIOS = (0.25, 0.35, 0.45, 0.55)
ALPHA_GRID = (
    (0.3, 0.1),
    (0.3, 0.2),
    (0.5, 0.1),
    (0.5, 0.2),
    (0.5, 0.3),
    (0.5, 0.4),
    (0.7, 0.1),
    (0.7, 0.3),
    (0.7, 0.5),
)
GAMMAS = (2, 3, 4, 5, 6, 8)


def _via(**kv: Any) -> str:
    return "via" + "".join(f":{k}={v}" for k, v in kv.items())


def ablation_groups() -> list[Group]:
    def ratio_spec(r: float) -> str:
        return "via" if r == 0.45 else _via(skip_ratio=r)

    def alpha_spec(a1: float, a2: float) -> str:
        return "via" if (a1, a2) == (0.5, 0.3) else _via(alpha1=a1, alpha2=a2)

    def gamma_spec(mode: str, g: int) -> str:
        return mode if g == 5 else f"{mode}:gamma={g}"

    return [
        Group(
            "mask",
            "Searched vs random vs evenly spaced mask at the same ratio",
            "bar",
            ("sd", "via", "via:mask=random", "via:mask=random@1", "via:mask=even"),
            paper="Table 6 / Table 5",
        ),
        Group(
            "skip_ratio",
            "Skip ratio of the slim verifier",
            "line",
            tuple(ratio_spec(r) for r in SKIP_RATIOS),
            x="skip_ratio",
            paper="Figure 4",
        ),
        Group(
            "alpha",
            "Gate thresholds (alpha1, alpha2)",
            "heatmap",
            tuple(alpha_spec(a1, a2) for a1, a2 in ALPHA_GRID),
            x="alpha2",
            y="alpha1",
            paper="Figures 6-8",
        ),
        Group(
            "gamma",
            "Draft length gamma",
            "line",
            tuple(gamma_spec(m, g) for m in ("sd", "via") for g in GAMMAS),
            x="gamma",
            series="mode",
            paper="Figure 9",
        ),
        Group(
            "cache_policy",
            "Slim-verifier cache policy",
            "bar",
            ("via", "via:cache_policy=shared"),
            paper="ARCHITECTURE.md, Caches",
        ),
        Group(
            "bonus",
            "Bonus token from q' after a fully accepted block",
            "bar",
            ("via", "via:slim_bonus=true"),
            paper="ARCHITECTURE.md, The decode cycle",
        ),
        # the project's reading of the gates (thresholds on r, region B rewrites), the
        # paper's appendix B.1 read literally (accept iff r >= 0.7, else escalate), and the staged
        # lossless rule (q' filters, q verifies: output ~ q)
        Group(
            "gates",
            "Readings of the gates and the staged lossless rule",
            "bar",
            ("sd", "via", "via:alpha1=0.7:region_b=escalate", "via:rule=staged"),
            paper="appendix B.1",
        ),
    ]


# what makes a third tier pay on a pair like ours, against the paper's `via` and the peers
PROPOSER_METHODS = (
    "ar",
    "sd",
    "via",
    "via:region_b=escalate",
    "hf-assisted",
    "hf-lookup",
    "sd:proposer=ngram",
    "sd:proposer=hybrid",
    "sd:draft_confidence=0.4:adaptive_gamma=true",
    "sd:proposer=hybrid:draft_confidence=0.4:adaptive_gamma=true",
    "sd:proposer=hybrid:draft_confidence=0.4:adaptive_gamma=true:overlap=true",
    "sd:overlap=true",
    "via:proposer=hybrid:region_b=escalate:draft_confidence=0.4:adaptive_gamma=true",
)


def suite_methods(name: str) -> tuple[list[str], list[Group]]:
    """The method specs and plot groups of a named suite: main, ablations, proposers, quick."""
    main = Group("main", "Methods side by side", "bar", MAIN_METHODS, paper="Table 2")
    if name == "main":
        return list(MAIN_METHODS), [main]
    if name == "proposers":
        return list(PROPOSER_METHODS), [Group("proposers", "Proposers and adaptive drafting", "bar", PROPOSER_METHODS)]
    if name == "quick":
        return ["ar", "sd", "via", "hf", "hf-assisted"], [
            Group("main", main.title, "bar", ("ar", "sd", "via", "hf", "hf-assisted"))
        ]
    if name == "ablations":
        groups = ablation_groups()
        specs = ["ar"] + [s for g in groups for s in g.methods]
        return list(dict.fromkeys(specs)), groups
    raise InvalidParameterError("suite", f"unknown suite {name!r}; known: main, ablations, proposers, quick")
