"""One engine, three modes: `ar` (q alone), `sd` (p -> q, two-tier), `via` (p -> q' -> q, VIA-SD).

The whole VIA-SD decode cycle is `Engine._cycle`; the acceptance rules it applies live in
`viasd.rules`, the draft proposers and block-length policy in `viasd.proposers`. One cycle, for a committed prefix x of length n (DESIGN.md, "The decode cycle"):

1. draft:        the drafter p samples x~_1..x~_gamma, keeping p_1..p_gamma (or prompt lookup
                 proposes them, p a point mass; `overlap`: drafted ahead during the last verify);
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
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from viasd.config import CachePolicy, GenerationParams, Mode, Proposer, RegionB
from viasd.errors import InvalidParameterError, MaskError, ModelLoadError
from viasd.metrics import RequestStats
from viasd.proposers import GammaPolicy, ngram_lookup
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


def request_seeds(seed: int) -> tuple[int, int]:
    """Seeds of the drafter's and the verifier's random streams for a request seed.

    Each side owns its stream, so the same seed gives the same tokens whether the two sides run
    in one process (this engine) or in separate actors (the service).
    """
    return seed, (seed + 0x9E3779B97F4A7C15) % 2**63


# ---------------------------------------------------------------- request checks and limits
# Shared by Engine.generate and the distributed coordinator (viasd.actors.coordinator), so that
# a served request is validated, drafted and cut exactly like an in-process one.


def context_limit(*limits: int | None) -> int | None:
    """The context a request may fill: the smallest of the given limits (models' position
    embeddings, a configured cap), None when none is known."""
    known = [int(x) for x in limits if x]
    return min(known) if known else None


def check_request(
    prompt_ids: Sequence[int], params: GenerationParams, *, vocab_size: int, max_context: int | None, has_drafter: bool
) -> list[int]:
    """Validate one request (InvalidParameterError naming the field); return the prompt as ints."""
    if not isinstance(params, GenerationParams):
        raise InvalidParameterError("params", f"expected GenerationParams, got {type(params).__name__}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise InvalidParameterError("prompt", "must contain at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidParameterError("prompt", f"token ids {bad[:5]} outside the vocabulary (size {vocab_size})")
    if max_context is not None and len(prompt) >= max_context:
        raise InvalidParameterError("prompt", f"{len(prompt)} tokens leave no room in the context of {max_context}")
    if params.mode != Mode.AR and not has_drafter and params.proposer != Proposer.NGRAM:
        raise InvalidParameterError("mode", f"mode {params.mode.value!r} needs a drafter (or proposer 'ngram'); none is loaded")
    return prompt


def resolve_seed(params: GenerationParams) -> int:
    """The request's seed, or a fresh random one when it has none."""
    return params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)


def draft_length(gamma: int, remaining: int, seq_len: int, max_context: int | None) -> int:
    """Tokens to draft this cycle: gamma, cut to the tokens still allowed and to the context
    (the verifier scores k + 1 positions past the prefix of seq_len tokens); at least 1."""
    k = max(1, min(gamma, remaining))
    if max_context is not None:
        k = max(1, min(k, max_context - seq_len - 1))
    return k


class RequestLimits:
    """Stop tokens, max_tokens and the context limit of one request, applied to what each cycle commits."""

    def __init__(
        self,
        params: GenerationParams,
        prompt_len: int,
        max_context: int | None,
        eos_token_ids: Sequence[int],
        stats: RequestStats,
    ):
        self.params = params
        self.max_context = max_context
        self.stats = stats  # generated_tokens, time_to_first_token, finish_reason, total_seconds are kept here
        self.budget = params.max_tokens if max_context is None else min(params.max_tokens, max_context - prompt_len)
        self.stops = tuple(params.stop_token_ids if params.stop_token_ids is not None else eos_token_ids)
        self.t_start = time.perf_counter()

    @property
    def remaining(self) -> int:
        """New tokens still allowed."""
        return self.budget - self.stats.generated_tokens

    def draft_length(self, seq_len: int) -> int:
        return draft_length(self.params.gamma, self.remaining, seq_len, self.max_context)

    def chunk(self, new: list[int]) -> Chunk:
        """Cut a cycle's committed tokens at the first stop token and at the budget; the chunk to stream."""
        stats, finish = self.stats, None
        if not self.params.ignore_eos and self.stops:
            cut = next((j for j, t in enumerate(new) if t in self.stops), None)
            if cut is not None:
                new, finish = new[: cut + 1], "stop"
        produced = stats.generated_tokens + len(new)
        if produced >= self.budget:
            new, finish = new[: len(new) - (produced - self.budget)], finish or "length"
        if stats.time_to_first_token is None and new:
            stats.time_to_first_token = time.perf_counter() - self.t_start
        stats.generated_tokens += len(new)
        if finish is None:
            return Chunk(new)
        stats.finish_reason = finish
        stats.total_seconds = time.perf_counter() - self.t_start
        return Chunk(new, finish, stats)


@dataclass
class Outcome:
    """What the verifier decided for one block (or one `ar` step)."""

    tokens: list[int]  # committed: the accepted draft prefix, then the rewritten / recovered / bonus token(s)
    num_draft_accepted: int  # how many of `tokens` are draft tokens: caches stay valid up to n + this


def _commit(seq: list[int], tiers: Sequence[_Tier], outcome: Outcome) -> None:
    """Append committed tokens and roll every tier back to the positions that are still valid.

    The last committed token is never counted as seen: the next forward must feed it to get
    the distribution of the token after it.
    """
    valid = len(seq) + outcome.num_draft_accepted
    seq.extend(outcome.tokens)
    valid = min(valid, len(seq) - 1)
    for tier in tiers:
        tier.pos = min(tier.pos, valid)


def block_generator(seed: int, block: int, device) -> torch.Generator:
    """The drafter's random stream for draft block `block` of a request (used with `overlap`):
    a block drafted ahead and a block drafted on demand draw the same numbers, so the output
    depends on the seed only, never on how far the drafter got ahead."""
    return torch.Generator(device=device).manual_seed((seed * 0x100000001B3 + block) % 2**63)


class DraftSession:
    """The drafter's side of one request: its proposer (viasd.proposers), its cache, its random
    stream, its block-length policy, its copy of the sequence. `lm` may be None for `ngram`.

    With `overlap` (PEARL-style), `draft_ahead` drafts the next block from the optimistic prefix
    (the committed sequence + the block under verification) while the verifier works; `commit`
    keeps the drafted-ahead tokens that the committed tokens agree with, as the start of the next
    block. Each kept token was drawn from p given exactly the prefix it ends up on, so the rules
    see a correct draft; each block has its own seeded stream (`block_generator`), so the output
    does not depend on timing.
    """

    def __init__(
        self, lm: MaskedLM | None, prompt: Sequence[int], params: GenerationParams, seed: int, stats: RequestStats
    ):
        if lm is None and params.proposer != Proposer.NGRAM:
            raise InvalidParameterError("proposer", f"proposer {params.proposer.value!r} needs a drafter model")
        self.params = params
        self.tier = _Tier("drafter", lm, lm.new_cache()) if lm is not None else None
        self.device = lm.device if lm is not None else "cpu"
        self.seq = list(prompt)
        self.sampler = Sampler.from_params(params)
        self.seed = seed
        self.blocks = 0  # blocks proposed so far
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        if params.overlap:
            self.generator = block_generator(seed, 0, self.device)
        self.gamma = GammaPolicy(params.gamma, params.adaptive_gamma)
        self.stats = stats
        self.last: list[int] = []  # the block under verification ...
        self.last_p: list[Tensor] = []  # ... and its p rows [1, V] (sampled only)
        self.last_from_model = False
        self.ahead: list[int] = []  # drafted past `last` by draft_ahead ...
        self.ahead_p: list[Tensor] = []
        self.ahead_generator: torch.Generator | None = None
        self.ahead_ended = False  # the drafted-ahead block ended on draft_confidence
        self.pending: list[int] = []  # drafted tokens the committed sequence agreed with: the next block's start
        self.pending_p: list[Tensor] = []
        self.pending_ended = False
        self.stop = threading.Event()  # set by the verifier side when its outcome is in

    def propose(self, k: int) -> tuple[list[int], Tensor | None]:
        """Propose at most k draft tokens; return them and p [k', V], or None when p is a point
        mass at the draft tokens (greedy sampling, or an n-gram proposal). Fewer than k under
        adaptive drafting or a short n-gram match; none when the `ngram` proposer finds no match
        (the verifier then decodes one token itself)."""
        params, k = self.params, self.gamma.length(k)
        if params.proposer != Proposer.MODEL:
            looked_up = ngram_lookup(self.seq, k, params.ngram_max)
            if looked_up or params.proposer == Proposer.NGRAM:
                self.stats.ngram_draft_tokens += len(looked_up)
                self._drop_pending()
                return self._proposed(looked_up, [], from_model=False)
        draft, p_rows, ended = self.pending[:k], self.pending_p[:k], self.pending_ended
        self.stats.overlap_draft_tokens += len(draft)
        if len(self.pending) > k:  # the rest is not used: it must be fed again later
            self._drop_pending(keep=k)
        self.pending, self.pending_p, self.pending_ended = [], [], False
        if len(draft) < k and not ended:
            self._draft(draft, p_rows, k, self.generator)
        return self._proposed(draft, p_rows)

    def _draft(self, draft: list[int], p_rows: list[Tensor], k: int, generator: torch.Generator,
               stop: threading.Event | None = None) -> bool:
        """Extend `draft` (after self.seq, or self.seq + self.last when drafting ahead) to k tokens
        with the drafter model, in place; stop early when `stop` is set (drafting ahead) or below
        `draft_confidence` (then return True: the block has ended)."""
        prefix = self.seq + self.last if stop is not None else self.seq
        # ahead, the first token is always drafted: whether the next block can start from the
        # drafted-ahead tokens must not depend on timing (the later ones come out the same
        # whether drafted ahead or on demand: same prefix, same stream)
        while len(draft) < k and not (stop is not None and stop.is_set() and draft):
            logits = self.tier.forward(prefix + draft, 1, self.stats)  # [1, V]
            p = self.sampler.probs(logits)  # [1, V]
            draft.append(int(self.sampler.sample(p, generator)[0]))
            if not self.sampler.greedy:
                p_rows.append(p)
            if len(draft) < k and self.params.draft_confidence > 0.0:
                confidence = float(torch.softmax(logits[0].float(), dim=-1)[draft[-1]])  # p_{T=1}(x~_j)
                if confidence < self.params.draft_confidence:
                    return True
        return False

    def _proposed(self, draft: list[int], p_rows: list[Tensor], from_model: bool = True
                  ) -> tuple[list[int], Tensor | None]:
        self.last, self.last_p, self.last_from_model = draft, p_rows, from_model and bool(draft)
        if draft:
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += len(draft)
        self.blocks += 1
        return draft, torch.cat(p_rows) if p_rows else None  # [k'], [k', V] (None: a point mass)

    def draft_ahead(self) -> None:
        """Overlap: draft the next block from self.seq + self.last, until `stop` is set (the
        outcome of `last` is in) or the block is full. Runs beside the verifier's forward."""
        self.ahead, self.ahead_p = [], []
        self.ahead_generator = block_generator(self.seed, self.blocks, self.device)
        if not self.last_from_model:  # (n-gram blocks have no p rows to continue; the lookup is free anyway)
            return
        self.ahead_ended = self._draft(self.ahead, self.ahead_p, self.gamma.length(self.params.gamma),
                                       self.ahead_generator, self.stop)

    def _drop_pending(self, keep: int = 0) -> None:
        """Forget pending tokens past `keep`: the cache must not count them as fed."""
        if self.tier is not None:
            self.tier.pos = min(self.tier.pos, len(self.seq) + keep - 1)
        self.pending, self.pending_p = self.pending[:keep], self.pending_p[:keep]
        self.pending_ended = False

    def commit(self, outcome: Outcome) -> None:
        """Append the committed tokens. With overlap, keep what was drafted past them if they
        agree with the drafter's own optimistic continuation (last block + drafted ahead)."""
        self.gamma.update(len(self.last), outcome.num_draft_accepted)
        committed = outcome.tokens
        optimistic, optimistic_p = self.last + self.ahead, self.last_p + self.ahead_p
        if self.params.overlap:
            if self.ahead and optimistic[: len(committed)] == committed:  # every fed token stays valid
                self.seq.extend(committed)
                self.pending = optimistic[len(committed) :]
                self.pending_p = optimistic_p[len(committed) :] if optimistic_p else []
                # the next block goes on with the stream it was drafted ahead with; it has ended only
                # if its low-confidence last token is still pending (not committed already)
                self.generator, self.pending_ended = self.ahead_generator, self.ahead_ended and bool(self.pending)
                self._clear_ahead()
                return
            self.generator = block_generator(self.seed, self.blocks, self.device)
        self._clear_ahead()
        self.pending, self.pending_p, self.pending_ended = [], [], False
        _commit(self.seq, [self.tier] if self.tier is not None else [], outcome)

    def _clear_ahead(self) -> None:
        self.ahead, self.ahead_p, self.ahead_generator, self.ahead_ended = [], [], None, False
        self.stop.clear()


class VerifySession:
    """The verifier's side of one request: q and q' (q masked, same weights), the gate and the rules.

    Logits never leave this object: it returns decisions and sampled tokens only.
    """

    def __init__(
        self,
        lm: MaskedLM,
        mask: LayerMask,
        cache_policy: CachePolicy,
        prompt: Sequence[int],
        params: GenerationParams,
        seed: int,
        stats: RequestStats,
    ):
        self.params = params
        self.full = _Tier("full", lm, lm.new_cache())
        self.slim = None
        if params.mode == Mode.VIA:
            shared = cache_policy == CachePolicy.SHARED  # q' writes into q's slots of the kept layers
            self.slim = _Tier("slim", lm, self.full.cache if shared else lm.new_cache(mask), mask)
        self.tiers = [t for t in (self.slim, self.full) if t is not None]
        self.seq = list(prompt)
        self.sampler = Sampler.from_params(params)
        self.rule = rule_from_params(params)
        self.generator = torch.Generator(device=lm.device).manual_seed(seed)
        self.stats = stats

    def decode_one(self) -> Outcome:
        """`ar`: one forward of q, one token."""
        logits = self.full.forward(self.seq, 1, self.stats)  # [1, V]
        return Outcome([int(self.sampler.sample(self.sampler.probs(logits), self.generator)[0])], 0)

    def check(self, draft: list[int], p: Tensor | None) -> Outcome:
        """Verify a draft block (p [k, V], or None when it is a point mass at the draft tokens:
        greedy or n-gram drafts) with the request's mode; an empty draft decodes one token."""
        if not draft:
            return self.decode_one()
        if p is None:  # p is one-hot at the draft tokens
            draft_t = torch.tensor(draft, device=self.full.lm.device)  # [k]
            p = torch.nn.functional.one_hot(draft_t, self.full.lm.vocab_size).float()  # [k, V]
        return self._check_sd(draft, p) if self.params.mode == Mode.SD else self._check_via(draft, p)

    def _full_verify(self, draft: list[int], p: Tensor, start: int) -> Outcome:
        """q scores the whole block in one forward; its rule decides positions start..k-1."""
        k, stats = len(draft), self.stats
        q = self.sampler.probs(self.full.forward(self.seq + draft, k + 1, stats))  # [k + 1, V]
        draft_t = torch.tensor(draft[start:], device=q.device)  # [k - start]
        verdict = verify(self.rule, p[start:].to(device=q.device, dtype=q.dtype), q[start:], draft_t, self.generator)
        j = verdict.num_accepted
        stats.count_accepted(range(start, start + j))
        stats.num_rejected_tokens += 0 if verdict.bonus else 1
        stats.num_bonus_tokens += int(verdict.bonus)
        stats.num_cycle_tokens += start + j + 1
        return Outcome(draft[: start + j] + [verdict.token], start + j)

    def _check_sd(self, draft: list[int], p: Tensor) -> Outcome:
        """Two-tier speculative decoding: one forward of q over the block, the acceptance rule."""
        return self._full_verify(draft, p, 0)

    def _check_via(self, draft: list[int], p: Tensor) -> Outcome:
        """Steps 2-4 of the VIA-SD cycle: slim-verify with the gate, then rewrite or escalate."""
        k, params, stats, sampler = len(draft), self.params, self.stats, self.sampler
        slim_logits = self.slim.forward(self.seq + draft, k + 1, stats)  # [k + 1, V]
        regions = gate(
            sampler.gate_probs(slim_logits[:k]),  # [k, V]
            torch.tensor(draft, device=slim_logits.device),
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
                tokens.append(int(sampler.sample(sampler.probs(slim_logits[k:]), self.generator)[0]))
                stats.num_bonus_tokens += 1
            stats.num_cycle_tokens += len(tokens)
            return Outcome(tokens, k)
        if regions[i] == Region.REWRITE:  # region B: q' writes position i itself
            stats.slim_rewritten += 1
            stats.num_rejected_tokens += 1
            stats.num_cycle_tokens += i + 1
            token = int(sampler.sample(sampler.probs(slim_logits[i : i + 1]), self.generator)[0])
            return Outcome(draft[:i] + [token], i)
        # region C: q decides positions i..k-1 with the speculative-sampling rule
        stats.escalations += 1
        stats.escalated_tokens += k - i
        outcome = self._full_verify(draft, p, i)
        stats.full_accepted += outcome.num_draft_accepted - i
        return outcome

    def commit(self, outcome: Outcome) -> None:
        """Append the tokens; roll q and q' back. Under the shared policy an escalation made q
        rewrite the kept layers' slots from its own position on, so after it both tiers hold q's
        keys/values up to the same valid length."""
        _commit(self.seq, self.tiers, outcome)


@dataclass
class _Request:
    params: GenerationParams
    seq: list[int]  # prompt + committed tokens
    stats: RequestStats
    verify: VerifySession
    draft: DraftSession | None = None


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
            raise MaskError(f"mask has {self.mask.num_layers} entries but the verifier has {verifier.num_layers} layers")
        self.cache_policy = CachePolicy(cache_policy)
        self.eos_token_ids = tuple(eos_token_ids)
        limits = [getattr(m.config, "max_position_embeddings", None) for m in (verifier, drafter) if m is not None]
        self.max_context = context_limit(*limits, max_context)
        # `overlap`: the drafter drafts ahead on this thread while the verifier checks a block
        self._drafter_thread = ThreadPoolExecutor(1, thread_name_prefix="viasd-drafter")

    # ---------------------------------------------------------------- public API

    def generate(self, prompt_ids: Sequence[int], params: GenerationParams) -> Iterator[Chunk]:
        """Stream the committed tokens of one request, chunk by chunk; the last chunk has the stats."""
        req = self._new_request(prompt_ids, params)
        limits = RequestLimits(params, len(req.seq), self.max_context, self.eos_token_ids, req.stats)
        while True:
            chunk = limits.chunk(self._cycle(req, limits.remaining))
            yield chunk
            if chunk.finished:
                return

    def complete(self, prompt_ids: Sequence[int], params: GenerationParams) -> GenerationResult:
        """Run a request to the end and return all of its tokens."""
        tokens: list[int] = []
        for chunk in self.generate(prompt_ids, params):
            tokens.extend(chunk.token_ids)
            last = chunk
        return GenerationResult(list(prompt_ids), tokens, last.finish_reason, last.stats)

    # ---------------------------------------------------------------- the decode cycle

    def _cycle(self, req: _Request, remaining: int) -> list[int]:
        """One decode cycle; returns the committed tokens (the caller cuts them at stops/limits).

        1. draft: p proposes k = min(gamma, remaining) tokens (sd, via);
        2-4. verify: q' gates and rewrites or escalates to q (via), q alone scores the block (sd),
             or q decodes one token (ar) — all inside the verifier, which returns only tokens;
        5. commit: both sides append the tokens and roll their caches back to what is valid.
        """
        if req.draft is None:
            outcome = req.verify.decode_one()
        else:
            draft, p = req.draft.propose(draft_length(req.params.gamma, remaining, len(req.seq), self.max_context))
            ahead = self._drafter_thread.submit(req.draft.draft_ahead) if req.params.overlap else None
            outcome = req.verify.check(draft, p)  # (an empty draft: one token from q)
            if ahead is not None:  # overlap: the drafter went on from the optimistic prefix meanwhile
                req.draft.stop.set()
                ahead.result()
            req.draft.commit(outcome)
        req.verify.commit(outcome)
        req.seq.extend(outcome.tokens)
        return outcome.tokens

    # ---------------------------------------------------------------- setup

    def _new_request(self, prompt_ids: Sequence[int], params: GenerationParams) -> _Request:
        prompt = check_request(prompt_ids, params, vocab_size=self.verifier.vocab_size, max_context=self.max_context,
                               has_drafter=self.drafter is not None)
        draft_seed, verify_seed = request_seeds(resolve_seed(params))
        stats = RequestStats(mode=params.mode.value, prompt_tokens=len(prompt))
        verify_session = VerifySession(self.verifier, self.mask, self.cache_policy, prompt, params, verify_seed, stats)
        draft_session = None
        if params.mode != Mode.AR:
            draft_session = DraftSession(self.drafter, prompt, params, draft_seed, stats)
        return _Request(params, prompt, stats, verify_session, draft_session)
