"""One engine, three modes: `ar` (q alone), `sd` (p -> q, two-tier), `via` (p -> q' -> q, VIA-SD).

The whole VIA-SD decode cycle is `Engine._via_cycle`; the acceptance rules it applies live in
`viasd.rules`. One cycle, for a committed prefix x of length n (DESIGN.md, "The decode cycle"):

1. draft:        the drafter p samples x~_1..x~_gamma, keeping p_1..p_gamma;
2. slim verify:  one masked forward of q' over the block gives q'_1..q'_{gamma+1};
3. gate:         r_i = q'_i(x~_i) / max_v q'_i(v); accept while r_i >= alpha1; at the first
                 position i with alpha2 <= r_i < alpha1 commit a token from q'_i (rewrite); with
                 r_i < alpha2 escalate;
4. escalate:     one forward of q over everything it has not seen up to x~_gamma, then the
                 speculative-sampling rule from position i on;
5. roll back:    every cache is cut to the committed length; the new tokens are streamed.

Randomness comes from one `torch.Generator` per request, consumed in a fixed order (each
drafted token, then the rewrite or the verification), so the same seed gives the same output.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from viasd.config import CachePolicy, GenerationParams, Mode, RegionB
from viasd.errors import InvalidParameterError, ModelLoadError
from viasd.metrics import RequestStats
from viasd.rules import Region, first_non_accept, gate, rule_from_params, verify
from viasd.runtime import KVCache, LayerMask, MaskedLM
from viasd.sampling import Sampler


@dataclass
class Chunk:
    """Tokens committed by one step of a request; the last chunk carries the finish reason and stats."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" when finished
    stats: RequestStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    """The whole output of a request."""

    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats


@dataclass
class _Tier:
    """One model's view of a request: the layers it runs, its cache, how much of it is valid.

    `pos` counts the leading positions of the request's sequence whose keys/values in `cache`
    are valid for this tier; a forward first crops the tier's layers back to `pos`.
    """

    name: str  # "drafter" | "slim" | "full"
    lm: MaskedLM
    cache: KVCache
    mask: LayerMask | None = None
    pos: int = 0

    @property
    def layers(self) -> tuple[int, ...]:
        return self.lm.all_layers if self.mask is None else self.mask.kept

    def forward(self, seq: Sequence[int], num_logits: int, stats: RequestStats) -> Tensor:
        """Feed seq[pos:] and return logits [num_logits, V] for the last positions of seq."""
        assert 0 <= self.pos <= len(seq) - num_logits, (self.pos, len(seq), num_logits)
        self.cache.crop(self.pos, self.layers)
        tokens = torch.tensor(seq[self.pos :], dtype=torch.long)  # [T]
        t0 = time.perf_counter()
        logits = self.lm.forward(tokens, self.pos, self.cache, self.mask, num_logits=num_logits)  # [k, V]
        stats.seconds[self.name] += time.perf_counter() - t0
        stats.forwards[self.name] += 1
        self.pos = len(seq)
        return logits


@dataclass
class _Request:
    params: GenerationParams
    sampler: Sampler
    generator: torch.Generator
    seq: list[int]  # prompt + committed tokens
    stats: RequestStats
    drafter: _Tier | None = None
    slim: _Tier | None = None
    full: _Tier | None = None
    tiers: list[_Tier] = field(default_factory=list)

    def commit(self, tokens: list[int], valid: int) -> None:
        """Append committed tokens; every tier keeps at most the first `valid` positions.

        The last committed token is never counted as seen: the next forward must feed it to
        get the distribution of the token after it.
        """
        self.seq.extend(tokens)
        valid = min(valid, len(self.seq) - 1)
        for tier in self.tiers:
            tier.pos = min(tier.pos, valid)


class Engine:
    """Decodes requests with a verifier q, an optional drafter p and the slim verifier q' = q masked by z."""

    def __init__(
        self,
        verifier: MaskedLM,
        drafter: MaskedLM | None = None,
        *,
        mask: LayerMask | None = None,
        skip_ratio: float = 0.45,
        cache_policy: CachePolicy | str = CachePolicy.SEPARATE,
        eos_token_ids: Sequence[int] = (),
        max_context: int | None = None,
    ):
        self.verifier = verifier
        self.drafter = drafter
        if drafter is not None and drafter.vocab_size != verifier.vocab_size:
            raise ModelLoadError(
                f"drafter vocabulary ({drafter.vocab_size}) differs from the verifier's ({verifier.vocab_size}); "
                "the pair must share a tokenizer"
            )
        self.mask = mask if mask is not None else LayerMask.evenly_spaced(skip_ratio, verifier.num_layers)
        if self.mask.num_layers != verifier.num_layers:
            from viasd.errors import MaskError

            raise MaskError(f"mask has {self.mask.num_layers} entries but the verifier has {verifier.num_layers} layers")
        self.cache_policy = CachePolicy(cache_policy)
        self.eos_token_ids = tuple(eos_token_ids)
        limits = [getattr(m.config, "max_position_embeddings", None) for m in (verifier, drafter) if m is not None]
        limits = [x for x in limits if x] + ([max_context] if max_context else [])
        self.max_context = min(limits) if limits else None

    # ---------------------------------------------------------------- public API

    def generate(self, prompt_ids: Sequence[int], params: GenerationParams) -> Iterator[Chunk]:
        """Stream the committed tokens of one request, chunk by chunk; the last chunk has the stats."""
        req = self._new_request(prompt_ids, params)
        stats, n_prompt = req.stats, len(prompt_ids)
        t_start = time.perf_counter()
        step = {Mode.AR: self._ar_step, Mode.SD: self._sd_cycle, Mode.VIA: self._via_cycle}[params.mode]
        budget = params.max_tokens
        if self.max_context is not None:
            budget = min(budget, self.max_context - n_prompt)
        while True:
            n = len(req.seq)
            step(req, budget - (n - n_prompt))
            new = req.seq[n:]
            finish = None
            stops = params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids
            if not params.ignore_eos and stops:
                cut = next((j for j, t in enumerate(new) if t in stops), None)
                if cut is not None:
                    new, finish = new[: cut + 1], "stop"
            produced = n - n_prompt + len(new)
            if produced >= budget:
                new, finish = new[: len(new) - (produced - budget)], finish or "length"
            del req.seq[n + len(new) :]
            if stats.time_to_first_token is None and new:
                stats.time_to_first_token = time.perf_counter() - t_start
            stats.generated_tokens += len(new)
            if finish is not None:
                stats.finish_reason = finish
                stats.total_seconds = time.perf_counter() - t_start
                yield Chunk(new, finish, stats)
                return
            yield Chunk(new)

    def complete(self, prompt_ids: Sequence[int], params: GenerationParams) -> GenerationResult:
        """Run a request to the end and return all of its tokens."""
        tokens: list[int] = []
        for chunk in self.generate(prompt_ids, params):
            tokens.extend(chunk.token_ids)
            last = chunk
        return GenerationResult(list(prompt_ids), tokens, last.finish_reason, last.stats)

    # ---------------------------------------------------------------- setup

    def _new_request(self, prompt_ids: Sequence[int], params: GenerationParams) -> _Request:
        if not isinstance(params, GenerationParams):
            raise InvalidParameterError("params", f"expected GenerationParams, got {type(params).__name__}")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidParameterError("prompt", "must contain at least one token")
        bad = [t for t in prompt if not 0 <= t < self.verifier.vocab_size]
        if bad:
            raise InvalidParameterError("prompt", f"token ids {bad[:5]} outside the vocabulary (size {self.verifier.vocab_size})")
        if self.max_context is not None and len(prompt) >= self.max_context:
            raise InvalidParameterError("prompt", f"{len(prompt)} tokens leave no room in the context of {self.max_context}")
        if params.mode != Mode.AR and self.drafter is None:
            raise InvalidParameterError("mode", f"mode {params.mode.value!r} needs a drafter; this engine has none")
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        req = _Request(
            params=params,
            sampler=Sampler.from_params(params),
            generator=torch.Generator().manual_seed(seed),
            seq=prompt,
            stats=RequestStats(mode=params.mode.value, prompt_tokens=len(prompt)),
        )
        q = self.verifier
        req.full = _Tier("full", q, q.new_cache())
        if params.mode != Mode.AR:
            req.drafter = _Tier("drafter", self.drafter, self.drafter.new_cache())
        if params.mode == Mode.VIA:
            shared = self.cache_policy == CachePolicy.SHARED
            req.slim = _Tier("slim", q, req.full.cache if shared else q.new_cache(self.mask), self.mask)
        req.tiers = [t for t in (req.drafter, req.slim, req.full) if t is not None]
        return req

    # ---------------------------------------------------------------- decode steps

    def _ar_step(self, req: _Request, remaining: int) -> None:
        """Autoregressive decoding with q: one forward, one token."""
        logits = req.full.forward(req.seq, 1, req.stats)  # [1, V]
        token = int(req.sampler.sample(req.sampler.probs(logits), req.generator)[0])
        req.commit([token], len(req.seq))

    def _draft(self, req: _Request, remaining: int) -> tuple[list[int], Tensor]:
        """The drafter proposes min(gamma, remaining) tokens; returns them and p [k, V]."""
        k = max(1, min(req.params.gamma, remaining))
        if self.max_context is not None:  # the verifier scores k + 1 positions past the prefix
            k = max(1, min(k, self.max_context - len(req.seq) - 1))
        draft: list[int] = []
        p_rows = []
        for _ in range(k):
            logits = req.drafter.forward(req.seq + draft, 1, req.stats)  # [1, V]
            p = req.sampler.probs(logits)  # [1, V]
            draft.append(int(req.sampler.sample(p, req.generator)[0]))
            p_rows.append(p)
        req.stats.num_drafts += 1
        req.stats.num_draft_tokens += k
        return draft, torch.cat(p_rows)  # [k], [k, V]

    def _sd_cycle(self, req: _Request, remaining: int) -> None:
        """Two-tier speculative decoding: draft gamma tokens, one forward of q, the acceptance rule."""
        n, stats = len(req.seq), req.stats
        draft, p = self._draft(req, remaining)  # [k], [k, V]
        q = req.sampler.probs(req.full.forward(req.seq + draft, len(draft) + 1, stats))  # [k + 1, V]
        verdict = verify(rule_from_params(req.params), p, q, torch.tensor(draft), req.generator)
        k = verdict.num_accepted
        stats.count_accepted(range(k))
        stats.num_rejected_tokens += 0 if verdict.bonus else 1
        stats.num_bonus_tokens += int(verdict.bonus)
        stats.num_cycle_tokens += k + 1
        req.commit(draft[:k] + [verdict.token], n + k)

    def _via_cycle(self, req: _Request, remaining: int) -> None:
        """One VIA-SD cycle: draft, slim-verify with the gate, rewrite or escalate, commit."""
        n, params, stats, sampler = len(req.seq), req.params, req.stats, req.sampler
        draft, p = self._draft(req, remaining)  # [k], [k, V]
        k = len(draft)
        slim_logits = req.slim.forward(req.seq + draft, k + 1, stats)  # [k + 1, V]
        regions = gate(
            sampler.gate_probs(slim_logits[:k]),  # [k, V]
            torch.tensor(draft),
            params.alpha1,
            params.alpha2,
            rewrite=params.region_b == RegionB.REWRITE,
        )  # [k]
        i = first_non_accept(regions)  # draft[:i] accepted by q'
        stats.slim_accepted += i
        stats.count_accepted(range(i))

        if i == k:  # region A everywhere: the block is committed on q''s word
            tokens = list(draft)
            if params.slim_bonus:
                tokens.append(int(sampler.sample(sampler.probs(slim_logits[k:]), req.generator)[0]))
                stats.num_bonus_tokens += 1
            self._after_slim(req, tokens, n + k)
        elif regions[i] == Region.REWRITE:  # region B: q' writes position i itself
            stats.slim_rewritten += 1
            stats.num_rejected_tokens += 1
            token = int(sampler.sample(sampler.probs(slim_logits[i : i + 1]), req.generator)[0])
            self._after_slim(req, draft[:i] + [token], n + i)
        else:  # region C: q decides positions i..k with the speculative-sampling rule
            stats.escalations += 1
            stats.escalated_tokens += k - i
            q = sampler.probs(req.full.forward(req.seq + draft, k + 1, stats))  # [k + 1, V]
            verdict = verify(rule_from_params(params), p[i:], q[i:], torch.tensor(draft[i:]), req.generator)
            j = verdict.num_accepted
            stats.full_accepted += j
            stats.count_accepted(range(i, i + j))
            stats.num_rejected_tokens += 0 if verdict.bonus else 1
            stats.num_bonus_tokens += int(verdict.bonus)
            stats.num_cycle_tokens += i + j + 1
            req.commit(draft[: i + j] + [verdict.token], n + i + j)
            if self.cache_policy == CachePolicy.SHARED:  # kept layers now hold q's keys/values
                req.slim.pos = req.full.pos

    def _after_slim(self, req: _Request, tokens: list[int], valid: int) -> None:
        req.stats.num_cycle_tokens += len(tokens)
        req.commit(tokens, valid)
