"""Protobuf <-> Python conversions of the viasd.v1 API, in one place for servers and client SDK.

* ``GenerationParams`` message <-> :class:`viasd.config.GenerationParams`. An unset optional
  field (proto3 ``optional``) takes the pydantic default; an ``*_UNSPECIFIED`` enum value the
  default too (``MODE_UNSPECIFIED``: the server's default mode, passed in); an empty
  ``logit_bias`` map or ``stop`` list means none. Decoding validates
  through :func:`viasd.config.parse_params`, so a bad value raises
  :class:`~viasd.errors.InvalidParameterError` naming the field. ``stop_token_ids``: an empty
  list means "the model's EOS tokens" (None); "no stop tokens at all" is ``ignore_eos``; the
  same for ``stop`` (strings). `params_values_from_proto` gives only the fields the client set,
  so that a server can lay them over its own defaults.
* ``TokenLogprob`` messages <-> :class:`viasd.sampling.TokenLogprob` lists (prompt logprobs: the
  first prompt token has none, so the message list starts at the second).
* ``RequestStats`` message <-> :class:`viasd.metrics.RequestStats`. The derived rates
  (mean acceptance length, rejection rate) are written for readers of the message and
  recomputed from the counters when decoding; 0 stands for "none" in ``time_to_first_token``.

Imports protobuf and pydantic only (no grpc, no torch): the light client install can use it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from viasd.config import GenerationParams, LogprobTier, Mode, Proposer, RegionB, Rule, parse_params
from viasd.errors import InvalidParameterError
from viasd.metrics import MODELS, RequestStats, TokenLogprob
from viasd.v1 import generation_pb2 as pb

__all__ = [
    "MODE_TO_PB",
    "FINISH_TO_PB",
    "params_to_proto",
    "params_from_proto",
    "params_values_from_proto",
    "stats_to_proto",
    "stats_from_proto",
    "mode_from_proto",
    "finish_from_proto",
    "logprobs_to_proto",
    "logprobs_from_proto",
]

MODE_TO_PB = {Mode.AR: pb.MODE_AR, Mode.SD: pb.MODE_SD, Mode.VIA: pb.MODE_VIA, Mode.AUTO: pb.MODE_AUTO}
REGION_B_TO_PB = {RegionB.REWRITE: pb.REGION_B_REWRITE, RegionB.ESCALATE: pb.REGION_B_ESCALATE}
PROPOSER_TO_PB = {
    Proposer.MODEL: pb.PROPOSER_MODEL,
    Proposer.NGRAM: pb.PROPOSER_NGRAM,
    Proposer.HYBRID: pb.PROPOSER_HYBRID,
}
RULE_TO_PB = {
    Rule.LOSSLESS: pb.RULE_LOSSLESS,
    Rule.LOSSY: pb.RULE_LOSSY,
    Rule.OVERSHOOT: pb.RULE_OVERSHOOT,
    Rule.STAGED: pb.RULE_STAGED,
}
LOGPROB_TIER_TO_PB = {LogprobTier.FULL: pb.LOGPROB_TIER_FULL, LogprobTier.SLIM: pb.LOGPROB_TIER_SLIM}
FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
_MODE_FROM_PB = {v: k for k, v in MODE_TO_PB.items()}
_REGION_B_FROM_PB = {v: k for k, v in REGION_B_TO_PB.items()}
_RULE_FROM_PB = {v: k for k, v in RULE_TO_PB.items()}
_PROPOSER_FROM_PB = {v: k for k, v in PROPOSER_TO_PB.items()}
_LOGPROB_TIER_FROM_PB = {v: k for k, v in LOGPROB_TIER_TO_PB.items()}
_FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}

# proto3 `optional` scalars of GenerationParams: presence says whether the client set them
_OPTIONAL = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "gamma",
    "alpha1",
    "alpha2",
    "slim_bonus",
    "lossy_alpha",
    "lossy_beta",
    "overshoot_ceiling",
    "ignore_eos",
    "ngram_max",
    "draft_confidence",
    "adaptive_gamma",
    "overlap",
    "auto_lossy",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
    "n",
)
# RequestStats counters with the same name on both sides
_STATS_INTS = (
    "prompt_tokens",
    "generated_tokens",
    "num_drafts",
    "num_draft_tokens",
    "ngram_draft_tokens",
    "overlap_draft_tokens",
    "num_accepted_tokens",
    "num_rejected_tokens",
    "num_bonus_tokens",
    "num_cycle_tokens",
    "slim_accepted",
    "slim_rewritten",
    "escalations",
    "escalated_tokens",
    "full_accepted",
    "prefill_forwards",
    "kv_bytes",
    "preemptions",
    "cached_tokens",
)


def mode_from_proto(value: int, default: Mode | str = Mode.AUTO) -> Mode:
    if value == pb.MODE_UNSPECIFIED:
        return Mode(default)
    return _enum(value, _MODE_FROM_PB, "mode")


def _enum(value: int, table: dict, field: str):
    try:
        return table[value]
    except KeyError:
        raise InvalidParameterError(field, f"unknown value {value}") from None


def params_to_proto(params: GenerationParams, only: Collection[str] | None = None) -> pb.GenerationParams:
    """Every field set explicitly (the message of a fully resolved request), or with `only` just
    the named fields (a client's request: the fields it left out take the server's defaults)."""
    names = set(GenerationParams.model_fields) if only is None else set(only)
    msg = pb.GenerationParams(
        mode=MODE_TO_PB[params.mode] if "mode" in names else pb.MODE_UNSPECIFIED,
        region_b=REGION_B_TO_PB[params.region_b] if "region_b" in names else pb.REGION_B_UNSPECIFIED,
        rule=RULE_TO_PB[params.rule] if "rule" in names else pb.RULE_UNSPECIFIED,
        proposer=PROPOSER_TO_PB[params.proposer] if "proposer" in names else pb.PROPOSER_UNSPECIFIED,
        stop_token_ids=list(params.stop_token_ids or ()) if "stop_token_ids" in names else [],
        logprobs_tier=LOGPROB_TIER_TO_PB[params.logprobs_tier]
        if "logprobs_tier" in names
        else pb.LOGPROB_TIER_UNSPECIFIED,
        stop=list(params.stop or ()) if "stop" in names else [],
    )
    if "logit_bias" in names:
        msg.logit_bias.update(params.logit_bias or {})
    for name in _OPTIONAL:
        value = getattr(params, name)
        if value is not None and name in names:
            setattr(msg, name, value)
    return msg


def params_from_proto(msg: pb.GenerationParams, default_mode: Mode | str = Mode.AUTO) -> GenerationParams:
    """Validated parameters; unset fields take the defaults (InvalidParameterError names a bad field)."""
    return parse_params({"mode": Mode(default_mode), **params_values_from_proto(msg)})


def params_values_from_proto(msg: pb.GenerationParams) -> dict:
    """The GenerationParams fields the message sets (enums decoded; InvalidParameterError names a bad one)."""
    values: dict = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    if msg.mode != pb.MODE_UNSPECIFIED:
        values["mode"] = _enum(msg.mode, _MODE_FROM_PB, "mode")
    if msg.region_b != pb.REGION_B_UNSPECIFIED:
        values["region_b"] = _enum(msg.region_b, _REGION_B_FROM_PB, "region_b")
    if msg.rule != pb.RULE_UNSPECIFIED:
        values["rule"] = _enum(msg.rule, _RULE_FROM_PB, "rule")
    if msg.proposer != pb.PROPOSER_UNSPECIFIED:
        values["proposer"] = _enum(msg.proposer, _PROPOSER_FROM_PB, "proposer")
    if msg.stop_token_ids:
        values["stop_token_ids"] = tuple(msg.stop_token_ids)
    if msg.logprobs_tier != pb.LOGPROB_TIER_UNSPECIFIED:
        values["logprobs_tier"] = _enum(msg.logprobs_tier, _LOGPROB_TIER_FROM_PB, "logprobs_tier")
    if msg.logit_bias:
        values["logit_bias"] = dict(msg.logit_bias)
    if msg.stop:
        values["stop"] = tuple(msg.stop)
    return values


def logprobs_to_proto(entries: Sequence[TokenLogprob | None] | None) -> list[pb.TokenLogprob]:
    """TokenLogprob entries as messages (a None entry, the first prompt token's, is left out)."""
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            tier=e.tier,
            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top],
        )
        for e in entries or ()
        if e is not None
    ]


def logprobs_from_proto(msgs: Sequence[pb.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top], m.tier) for m in msgs]


def finish_from_proto(value: int) -> str | None:
    return _FINISH_FROM_PB.get(value)


def stats_to_proto(stats: RequestStats) -> pb.RequestStats:
    msg = pb.RequestStats(
        mode=stats.mode,
        num_accepted_tokens_per_pos=stats.num_accepted_tokens_per_pos,
        mean_acceptance_length=stats.mean_acceptance_length or 0.0,
        rejection_rate=stats.rejection_rate or 0.0,
        time_to_first_token=stats.time_to_first_token or 0.0,
        total_seconds=stats.total_seconds,
        drafter_fallback=stats.drafter_fallback,
        queue_seconds=stats.queue_seconds,
        prefill_seconds=stats.prefill_seconds,
    )
    for name in _STATS_INTS:
        setattr(msg, name, getattr(stats, name))
    msg.forwards.update(stats.forwards)
    msg.seconds.update(stats.seconds)
    msg.plans.update(stats.plans)
    return msg


def stats_from_proto(msg: pb.RequestStats, finish_reason: str | None = None) -> RequestStats:
    stats = RequestStats(
        mode=msg.mode,
        finish_reason=finish_reason,
        num_accepted_tokens_per_pos=list(msg.num_accepted_tokens_per_pos),
        forwards={**dict.fromkeys(MODELS, 0), **msg.forwards},
        seconds={**dict.fromkeys(MODELS, 0.0), **msg.seconds},
        time_to_first_token=msg.time_to_first_token or None,
        total_seconds=msg.total_seconds,
        drafter_fallback=msg.drafter_fallback,
        queue_seconds=msg.queue_seconds,
        prefill_seconds=msg.prefill_seconds,
        plans=dict(msg.plans),
    )
    for name in _STATS_INTS:
        setattr(stats, name, getattr(msg, name))
    return stats
