"""Per-request statistics: what each tier did, how often each model ran and what it cost.

Names follow vLLM's speculative-decoding metrics where they exist (num_drafts, num_draft_tokens,
num_accepted_tokens, num_accepted_tokens_per_pos). Vocabulary:

* accepted  — a draft token committed as drafted (by q' in region A, or by q's rule);
* rewritten — a token q' sampled in place of a region-B draft token;
* recovered — a token q sampled from the residual after rejecting a draft token;
* bonus     — a token sampled after a fully accepted block (from q, or from q' when enabled).

Mean acceptance length counts every token a cycle commits (accepted + the one rewritten,
recovered or bonus token), so it is 1 + accepted / drafts when every cycle ends with one.
Rejection rate is the paper's per-token rate (its rho_t = sum_v max(0, q_t(v) - p_t(v)) is the
probability that a verified draft token is rejected): rejected / (accepted + rejected), where a
draft token counts as rejected when the tier that decided on it replaced it (a region-B rewrite
or a rejection by q). Draft tokens after the first rejection are discarded without a decision.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

MODELS = ("drafter", "slim", "full")


@dataclass
class TokenLogprob:
    """The log-probability of one token (generated or prompt) under a verifier's raw logits."""

    token_id: int
    logprob: float  # log softmax(logits)[token_id]
    top: list[tuple[int, float]] = field(default_factory=list)  # the k most likely (token, logprob), best first
    tier: str = "full"  # whose logits: "full" (q) or "slim" (q', mode via with logprobs_tier 'slim')


@dataclass
class RequestStats:
    """Counters of one request; `to_dict()` gives a JSON-ready view with derived rates."""

    mode: str = "ar"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finish_reason: str | None = None
    # speculative cycles (sd, via)
    num_drafts: int = 0  # cycles that drafted a block
    num_draft_tokens: int = 0  # tokens proposed by the drafter
    ngram_draft_tokens: int = 0  # of which proposed by prompt lookup (proposer ngram / hybrid)
    overlap_draft_tokens: int = 0  # of which drafted ahead, during the previous verification (overlap)
    num_accepted_tokens: int = 0  # draft tokens committed as drafted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [gamma]: accepted at block position j
    num_rejected_tokens: int = 0  # draft tokens replaced (rewritten by q' or rejected by q)
    num_cycle_tokens: int = 0  # all tokens committed by speculative cycles
    num_bonus_tokens: int = 0
    # tiers (via)
    slim_accepted: int = 0  # draft tokens accepted by q' (region A)
    slim_rewritten: int = 0  # region-B rewrites by q'
    escalations: int = 0  # cycles handed to q (region C, or B in the pre-check variant)
    escalated_tokens: int = 0  # draft positions q had to decide on
    full_accepted: int = 0  # escalated draft tokens q accepted
    # cost
    forwards: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODELS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MODELS, 0.0))
    time_to_first_token: float | None = None
    total_seconds: float = 0.0
    drafter_fallback: bool = False  # served: the drafter failed and the request went on as `ar`
    prefill_forwards: int = 0  # prompt chunks through a tier (not in `forwards`)
    prefill_seconds: float = 0.0
    plans: dict[str, int] = field(default_factory=dict)  # `auto`: steps per plan ("ar", "sd:k=3", ...)
    queue_seconds: float = 0.0  # from submission to admission into the batch
    preemptions: int = 0  # times the scheduler preempted it for KV blocks (paged caches; recomputed on resume)
    kv_bytes: int = 0  # valid keys/values the request held in every tier when it finished
    cached_tokens: int = 0  # prompt positions the full verifier attached from the prefix cache instead of computing

    def count_accepted(self, positions: range) -> None:
        for j in positions:
            if j >= len(self.num_accepted_tokens_per_pos):
                self.num_accepted_tokens_per_pos.extend([0] * (j + 1 - len(self.num_accepted_tokens_per_pos)))
            self.num_accepted_tokens_per_pos[j] += 1
        self.num_accepted_tokens += len(positions)

    def add_counters(self, other: RequestStats) -> None:
        """Add the counters of another part of the same request (served: the drafter's and the
        verifier's sessions each count what they did); the request-level fields (mode, tokens,
        finish reason, times) stay this object's."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        per_pos = other.num_accepted_tokens_per_pos
        if len(per_pos) > len(self.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos.extend([0] * (len(per_pos) - len(self.num_accepted_tokens_per_pos)))
        for j, n in enumerate(per_pos):
            self.num_accepted_tokens_per_pos[j] += n
        for m, n in other.forwards.items():
            self.forwards[m] = self.forwards.get(m, 0) + n
        for m, sec in other.seconds.items():
            self.seconds[m] = self.seconds.get(m, 0.0) + sec
        self.drafter_fallback |= other.drafter_fallback

    @property
    def mean_acceptance_length(self) -> float | None:
        return self.num_cycle_tokens / self.num_drafts if self.num_drafts else None

    @property
    def rejection_rate(self) -> float | None:
        decided = self.num_accepted_tokens + self.num_rejected_tokens
        return self.num_rejected_tokens / decided if decided else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.generated_tokens / self.total_seconds if self.total_seconds > 0 else None

    def tier_fractions(self) -> dict[str, float] | None:
        """Share of verified draft positions settled by q' accept, q' rewrite and q (via only)."""
        settled = self.slim_accepted + self.slim_rewritten + self.escalations
        if not settled:
            return None
        return {
            "accepted_by_slim": self.slim_accepted / settled,
            "rewritten_by_slim": self.slim_rewritten / settled,
            "escalated_to_full": self.escalations / settled,
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_acceptance_length"] = self.mean_acceptance_length
        d["rejection_rate"] = self.rejection_rate
        d["tokens_per_second"] = self.tokens_per_second
        d["tier_fractions"] = self.tier_fractions()
        return d

    def summary(self) -> str:
        """A few human-readable lines for the CLI."""

        def fmt(x: float | None, spec: str = ".3f") -> str:
            return "-" if x is None else format(x, spec)

        lines = [
            f"mode={self.mode} prompt={self.prompt_tokens} generated={self.generated_tokens} "
            f"finish={self.finish_reason} time={self.total_seconds:.2f}s "
            f"tok/s={fmt(self.tokens_per_second, '.2f')} ttft={fmt(self.time_to_first_token, '.3f')}s",
        ]
        if self.num_drafts:
            lines.append(
                f"drafts={self.num_drafts} draft_tokens={self.num_draft_tokens} accepted={self.num_accepted_tokens} "
                f"mean_acceptance_length={fmt(self.mean_acceptance_length, '.2f')} "
                f"rejection_rate={fmt(self.rejection_rate)} accepted_per_pos={self.num_accepted_tokens_per_pos}"
            )
        if self.mode == "via":
            tf = self.tier_fractions() or {}
            lines.append(
                f"tiers: q' accept={self.slim_accepted} rewrite={self.slim_rewritten} escalate={self.escalations} "
                f"(q accepted {self.full_accepted}/{self.escalated_tokens} escalated positions) "
                + " ".join(f"{k}={v:.2f}" for k, v in tf.items())
            )
        lines.append(
            "forwards: "
            + " ".join(f"{m}={self.forwards[m]} ({self.seconds[m]:.2f}s)" for m in MODELS if self.forwards[m])
        )
        return "\n".join(lines)


# counters a request's parts add up (RequestStats.add_counters)
_SUMMED = (
    "num_drafts",
    "num_draft_tokens",
    "ngram_draft_tokens",
    "overlap_draft_tokens",
    "num_accepted_tokens",
    "num_rejected_tokens",
    "num_cycle_tokens",
    "num_bonus_tokens",
    "slim_accepted",
    "slim_rewritten",
    "escalations",
    "escalated_tokens",
    "full_accepted",
    "prefill_forwards",
    "prefill_seconds",
    "kv_bytes",
    "cached_tokens",
)
