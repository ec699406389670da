"""A slow reference decoder: every distribution recomputed from scratch, no caches, and none of
the engine's decision code.

The gate (r = q'(x) / max q', regions by alpha1 / alpha2), the three acceptance rules (lossless,
lossy, overshoot ceiling: acceptance probability and residual), the verification of a block, the
n-gram lookup, the adaptive block length, the confidence stop and the drafting ahead of `overlap`
are written again here in a few lines each, from their definitions in docs/ARCHITECTURE.md and in the
docstrings of viasd/rules.py and viasd/proposers.py — so that a bug in viasd/rules.py,
viasd/proposers.py or viasd/engine.py makes the engine part from this decoder. Only the logits
processing (temperature, top-k, top-p) is taken from `viasd.sampling.Sampler`.

Randomness is consumed in the order the engine documents, so that with the same seed the engine
must produce exactly these tokens:

* two streams per request, seeded from the request seed s: the drafter's (s) and the verifier's
  (s + 0x9E3779B97F4A7C15 mod 2^63); with `overlap` the drafter's stream of draft block b is
  seeded (s * 0x100000001B3 + b) mod 2^63 instead;
* a token drawn from a law (a drafted token, a rewrite, a slim bonus, an `ar` step, the token a
  verification commits): its argmax when the request is greedy (no draw), else one
  `torch.rand(1, float64)` u on the side's stream and the first token whose cumulative mass
  exceeds u times the total (the inverse of the law's CDF, in float64);
* verifying a block (viasd/rules.py `verify_rows`): one `torch.rand(T, float64)` when the request
  samples (none when greedy), then the committed token's draw.

The shared cache policy is not modelled: this decoder has no caches (see
tests/unit/test_reference_decoder.py for what is proved about `shared`).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from viasd.config import GenerationParams, Mode, Proposer, RegionB, Rule
from viasd.runtime import LayerMask, MaskedLM
from viasd.sampling import Sampler

VERIFY_SEED_OFFSET = 0x9E3779B97F4A7C15
BLOCK_SEED_MULTIPLIER = 0x100000001B3


def _logits(lm: MaskedLM, seq: list[int], rows: int, mask: LayerMask | None = None) -> Tensor:
    return lm.forward(torch.tensor(seq), 0, None, mask)[-rows:]  # [rows, V], no cache


# ------------------------------------------------------------------ the gate and the rules


def regions(q_slim: Tensor, draft: list[int], alpha1: float, alpha2: float, rewrite: bool) -> list[str]:
    """ "A" (r >= alpha1), "B" (alpha2 <= r < alpha1; "C" when rewrite is off) or "C" per position,
    with r_i = q'_i(x_i) / max_v q'_i(v): q_slim [T, V]."""
    out = []
    for i, x in enumerate(draft):
        r = q_slim[i, x] / q_slim[i].max()
        out.append("A" if r >= alpha1 else "B" if rewrite and r >= alpha2 else "C")
    return out


def _scale(params: GenerationParams) -> float:
    """The c of a = min(1, q / (c p)): 1 (lossless), 1 - alpha (lossy), l (overshoot ceiling)."""
    rule = Rule(params.rule)
    return {Rule.LOSSLESS: 1.0, Rule.LOSSY: 1.0 - params.lossy_alpha}.get(rule, params.overshoot_ceiling)


def accept_prob(params: GenerationParams, p_x: Tensor, q_x: Tensor) -> Tensor:
    """a = min(1, q(x) / (c p(x))); 1 when p(x) = 0 < q(x); 0 when q(x) = 0: [T], [T] -> [T]."""
    a = (q_x / (_scale(params) * p_x)).clamp(max=1.0)
    return torch.where(q_x > 0, a, torch.zeros_like(a))


def residual(params: GenerationParams, p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, q - b p)), b = lossy_beta for the lossy rule and 1 otherwise; q when its mass is 0: [V]."""
    beta = params.lossy_beta if Rule(params.rule) == Rule.LOSSY else 1.0
    res = (q - beta * p).clamp(min=0.0)
    mass = res.sum()
    return res / mass if mass > 0 else q


def draw(law: Tensor, gen: torch.Generator, greedy: bool) -> int:
    """One token from law [V] (not necessarily normalised): its argmax when greedy (no
    randomness), else the inverse of its CDF at one uniform."""
    if greedy:
        return int(law.argmax())
    u = float(torch.rand(1, generator=gen, dtype=torch.float64)[0])
    cdf = law.to(torch.float64).cumsum(0)  # [V]
    return int((cdf > u * cdf[-1]).nonzero()[0, 0])


def sample(sampler: Sampler, logits: Tensor, gen: torch.Generator) -> int:
    """One token from the sampler's law of logits [1, V]."""
    return draw(sampler.probs(logits)[0], gen, sampler.greedy)


def verify_block(
    params: GenerationParams, p: Tensor, q: Tensor, draft: list[int], gen: torch.Generator, greedy: bool
) -> tuple[int, int]:
    """(accepted draft tokens, the committed token after them): p [T, V], q [T + 1, V]."""
    t = len(draft)
    idx = torch.tensor(draft)
    a = accept_prob(params, p[torch.arange(t), idx], q[torch.arange(t), idx])  # [T]
    if greedy:  # a is 0 or 1
        accepted = (a >= 1).tolist()
    else:
        accepted = (torch.rand(t, generator=gen, dtype=torch.float64) < a.to(torch.float64)).tolist()
    n = next((j for j, ok in enumerate(accepted) if not ok), t)
    law = q[t] if n == t else residual(params, p[n], q[n])
    return n, draw(law, gen, greedy)


# ------------------------------------------------------------------ the drafter side


def ngram(seq: list[int], k: int, ngram_max: int) -> list[int]:
    """Up to k tokens after the latest earlier occurrence of seq's longest matching suffix (n <= ngram_max)."""
    for n in range(min(ngram_max, len(seq) - 1), 0, -1):
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i : i + n] == seq[len(seq) - n :]:
                return seq[i + n : i + n + k]
    return []


#: overlap drafts ahead only while at least this share of blocks was accepted whole (the rate below)
AHEAD_MIN = 0.5


def _block_generator(seed: int, block: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * BLOCK_SEED_MULTIPLIER + block) % 2**63)


class _Drafter:
    """The drafter's side: proposals, the block length, the confidence stop, drafting ahead."""

    def __init__(self, lm: MaskedLM | None, params: GenerationParams, seed: int, sampler: Sampler):
        self.lm, self.params, self.seed, self.sampler = lm, params, seed, sampler
        self.gen = _block_generator(seed, 0) if params.overlap else torch.Generator().manual_seed(seed)
        self.current = params.gamma  # adaptive block length
        self.blocks = 0
        self.pending: list[int] = []  # overlap: drafted ahead and agreed with by the committed tokens
        self.pending_p: list[Tensor] = []
        self.pending_ended = False
        self.last: list[int] = []
        self.last_p: list[Tensor] = []
        self.from_model = False
        # overlap drafts ahead only while blocks are accepted whole at least half the time: a mean
        # with weights 0.8^age over the blocks so far and a prior of 1 counting as one block
        self.whole_sum, self.whole_weight = 1.0, 1.0

    def _length(self, k: int) -> int:
        return min(k, self.current) if self.params.adaptive_gamma else k

    def _extend(self, prefix: list[int], draft: list[int], rows: list[Tensor], k: int, gen) -> bool:
        """Draft with the model after prefix + draft up to k tokens; True if the confidence stop ended the block."""
        while len(draft) < k:
            logits = _logits(self.lm, prefix + draft, 1)
            p = self.sampler.probs(logits)  # [1, V]
            draft.append(draw(p[0], gen, self.sampler.greedy))
            if not self.sampler.greedy:
                rows.append(p)
            if len(draft) < k and self.params.draft_confidence > 0.0:
                if float(torch.softmax(logits[0].float(), dim=-1)[draft[-1]]) < self.params.draft_confidence:
                    return True
        return False

    def propose(self, seq: list[int], k: int) -> tuple[list[int], Tensor | None]:
        """The block to verify and its p rows [k', V] (None: a point mass at the draft tokens)."""
        params, k = self.params, self._length(k)
        self.blocks += 1
        if params.proposer != Proposer.MODEL:
            looked_up = ngram(seq, k, params.ngram_max)
            if looked_up or params.proposer == Proposer.NGRAM:
                self.pending, self.pending_p, self.pending_ended = [], [], False
                self.last, self.last_p, self.from_model = looked_up, [], False
                return looked_up, None
        draft, rows, ended = self.pending[:k], self.pending_p[:k], self.pending_ended
        self.pending, self.pending_p, self.pending_ended = [], [], False
        if len(draft) < k and not ended:
            self._extend(seq, draft, rows, k, self.gen)
        self.last, self.last_p, self.from_model = draft, rows, bool(draft)
        return draft, torch.cat(rows) if rows else None

    def commit(self, seq: list[int], committed: list[int], accepted: int) -> None:
        """After the verdict (seq: the prefix the block was drafted on). With overlap the next
        block was drafted ahead from seq + last (here: always to its full length, which the engine
        reaches or continues later with the same stream) if the blocks before this one were
        accepted whole often enough; it is kept where the committed tokens agree with that
        optimistic continuation."""
        params = self.params
        length_now = self._length(params.gamma)
        drafted_ahead = self.whole_sum / self.whole_weight >= AHEAD_MIN
        if self.last:
            self.whole_sum = 0.8 * self.whole_sum + float(accepted == len(self.last))
            self.whole_weight = 0.8 * self.whole_weight + 1.0
        if params.adaptive_gamma and self.last:
            self.current = (
                min(params.gamma, self.current + 2) if accepted == len(self.last) else max(1, self.current - 1)
            )
        if not params.overlap:
            return
        gen = _block_generator(self.seed, self.blocks)
        if self.from_model and drafted_ahead:
            ahead, ahead_p = [], []
            ended = self._extend(seq + self.last, ahead, ahead_p, length_now, gen)
            optimistic, optimistic_p = self.last + ahead, self.last_p + ahead_p
            if optimistic[: len(committed)] == committed:
                self.pending = optimistic[len(committed) :]
                self.pending_p = optimistic_p[len(committed) :] if optimistic_p else []
                self.pending_ended = ended and bool(self.pending)
                self.gen = gen
                return
        self.gen = _block_generator(self.seed, self.blocks)


# ------------------------------------------------------------------ the decode loop


def reference_decode(
    verifier: MaskedLM, drafter: MaskedLM | None, mask: LayerMask, prompt: list[int], params: GenerationParams
) -> list[int]:
    """The tokens of one request (no stop tokens: run until max_tokens)."""
    sampler = Sampler.from_params(params)
    seed = params.seed
    gen = torch.Generator().manual_seed((seed + VERIFY_SEED_OFFSET) % 2**63)  # the verifier's stream
    side = _Drafter(drafter, params, seed, sampler) if params.mode != Mode.AR else None
    seq, out = list(prompt), []
    while len(out) < params.max_tokens:
        remaining = params.max_tokens - len(out)
        draft, p = side.propose(seq, min(params.gamma, remaining)) if side is not None else ([], None)
        k = len(draft)
        accepted = 0
        if not draft:  # ar, or no n-gram match: one token from q
            new = [sample(sampler, _logits(verifier, seq, 1), gen)]
        else:
            if p is None:  # a point mass at each draft token (greedy, n-gram)
                p = torch.zeros(k, verifier.vocab_size, dtype=torch.float64)
                p[torch.arange(k), torch.tensor(draft)] = 1.0
            start = 0
            new = None
            if params.mode == Mode.VIA:
                s = _logits(verifier, seq + draft, k + 1, mask)
                gate = regions(
                    sampler.gate_probs(s[:k]),
                    draft,
                    params.alpha1,
                    params.alpha2,
                    rewrite=params.region_b == RegionB.REWRITE,
                )
                i = next((j for j, g in enumerate(gate) if g != "A"), k)
                if i == k:
                    new, accepted = list(draft), k
                    if params.slim_bonus:
                        new.append(sample(sampler, s[k:], gen))
                elif gate[i] == "B":
                    new, accepted = draft[:i] + [sample(sampler, s[i : i + 1], gen)], i
                start = i
            if new is None:  # sd, or via escalated at position `start`
                q = sampler.probs(_logits(verifier, seq + draft, k + 1))
                n, token = verify_block(params, p[start:].to(q.dtype), q[start:], draft[start:], gen, sampler.greedy)
                new, accepted = draft[: start + n] + [token], start + n
        if side is not None:
            side.commit(seq, new, accepted)
        new = new[:remaining]
        seq += new
        out += new
    return out


def physically_removed(model, mask: LayerMask):
    """A deep copy of `model` whose skipped decoder layers are deleted (re-indexed for its cache)."""
    m = copy.deepcopy(model)
    m.model.layers = torch.nn.ModuleList([m.model.layers[i] for i in mask.kept])
    for j, layer in enumerate(m.model.layers):
        layer.self_attn.layer_idx = j
    m.config.num_hidden_layers = len(mask.kept)
    if getattr(m.config, "layer_types", None) is not None:
        m.config.layer_types = [m.config.layer_types[i] for i in mask.kept]
    return m
