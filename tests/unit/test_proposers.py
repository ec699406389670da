"""Proposers and adaptive drafting (viasd.proposers) keep the engine exact.

* prompt lookup equals a brute-force search (hypothesis);
* the gamma policy stays within [1, gamma];
* greedy `sd` with every proposer / adaptive option equals greedy `ar`, token for token;
* `ngram` needs no drafter model;
* sampled `sd` with `ngram` and `hybrid` proposals: the first two tokens follow the verifier's
  distribution (chi-square against the exact q marginals), although the n-gram's p is a point mass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import slow_forwards, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from viasd.config import parse_params
from viasd.engine import Engine
from viasd.errors import InvalidParameterError
from viasd.proposers import GammaPolicy, ngram_lookup
from viasd.runtime import LayerMask, MaskedLM

REPEATING = [5, 17, 3, 88, 41, 9, 5, 17, 3, 88, 41, 9, 5, 17]  # prompt lookup has plenty to copy
PROMPTS = [REPEATING, [5, 17, 3, 88, 41, 9], [60] * 12]
OPTIONS = {
    "ngram": dict(proposer="ngram"),
    "hybrid": dict(proposer="hybrid"),
    "hybrid-ngram1": dict(proposer="hybrid", ngram_max=1),
    "confidence": dict(draft_confidence=0.5),
    "adaptive": dict(adaptive_gamma=True, gamma=8),
    "all": dict(proposer="hybrid", draft_confidence=0.3, adaptive_gamma=True, gamma=6),
    "overlap-all": dict(proposer="hybrid", draft_confidence=0.3, adaptive_gamma=True, gamma=6, overlap=True),
}


def brute_force_lookup(seq, k, ngram_max):
    for n in range(min(ngram_max, len(seq) - 1), 0, -1):
        starts = [i for i in range(len(seq) - n) if seq[i : i + n] == seq[-n:]]
        if starts:
            i = max(starts)
            return seq[i + n : i + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 8), st.integers(1, 5))
def test_ngram_lookup_equals_brute_force(seq, k, ngram_max):
    assert ngram_lookup(seq, k, ngram_max) == brute_force_lookup(seq, k, ngram_max)


def test_ngram_lookup_prefers_the_longest_then_latest_match():
    seq = [1, 2, 3, 9, 7, 3, 8, 2, 3]  # "2 3" matches at 1 (followed by 9); "3" alone latest at 5 (-> 8)
    assert ngram_lookup(seq, 3, 2) == [9, 7, 3]
    assert ngram_lookup(seq, 3, 1) == [8, 2, 3]
    assert ngram_lookup([4, 5, 6], 3, 3) == []


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 32), st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60))
def test_gamma_policy_stays_in_bounds(gamma, blocks):
    policy = GammaPolicy(gamma, adaptive=True)
    for caller_k, accepted_seed in blocks:
        k = policy.length(max(1, caller_k))
        assert 1 <= k <= gamma
        policy.update(k, accepted_seed % (k + 1))
    fixed = GammaPolicy(gamma, adaptive=False)
    fixed.update(3, 0)
    assert fixed.length(gamma) == gamma


def test_adaptive_gamma_grows_after_full_acceptance_and_shrinks_after_rejection():
    policy = GammaPolicy(8, adaptive=True)
    policy.update(8, 2)
    assert policy.length(8) == 7
    policy.update(7, 7)
    assert policy.length(8) == 8
    assert policy.length(3) == 3  # the caller's cut (budget, context) still applies


@pytest.mark.parametrize("option", list(OPTIONS))
def test_greedy_sd_with_every_proposer_equals_greedy_ar(tiny_pair, option):
    verifier, drafter = tiny_pair
    engine = Engine(verifier, drafter, mask=LayerMask.from_skipped((1, 3), verifier.num_layers))
    lookups = 0
    for prompt in PROMPTS:
        ar = engine.complete(prompt, parse_params(mode="ar", max_tokens=40))
        sd = engine.complete(prompt, parse_params(mode="sd", max_tokens=40, **OPTIONS[option]))
        assert sd.token_ids == ar.token_ids, (option, prompt)
        lookups += sd.stats.ngram_draft_tokens
        assert sd.stats.num_draft_tokens >= sd.stats.ngram_draft_tokens
    if OPTIONS[option].get("proposer") in ("ngram", "hybrid"):
        assert lookups > 0
    else:
        assert lookups == 0


def test_confidence_and_adaptive_gamma_shorten_blocks(tiny_pair):
    verifier, drafter = tiny_pair
    engine = Engine(verifier, drafter, mask=LayerMask.from_skipped((1, 3), verifier.num_layers))

    def mean_block(**option) -> float:
        runs = [
            engine.complete(p, parse_params(mode="sd", max_tokens=60, gamma=8, **option)).stats
            for p in ([5, 17, 3, 88, 41, 9], [1, 2, 3], [60] * 12)
        ]
        assert sum(s.num_rejected_tokens for s in runs) > 0  # there is something to adapt to
        return sum(s.num_draft_tokens for s in runs) / sum(s.num_drafts for s in runs)

    fixed = mean_block()
    assert fixed > 7  # (blocks are cut only by the budget)
    assert mean_block(draft_confidence=0.9) < fixed
    assert mean_block(adaptive_gamma=True) < fixed


def test_ngram_needs_no_drafter_model(tiny_pair):
    verifier, _ = tiny_pair
    engine = Engine(verifier, None)
    ar = engine.complete(REPEATING, parse_params(mode="ar", max_tokens=30))
    sd = engine.complete(REPEATING, parse_params(mode="sd", proposer="ngram", max_tokens=30))
    assert sd.token_ids == ar.token_ids
    assert sd.stats.forwards["drafter"] == 0 and sd.stats.ngram_draft_tokens > 0
    assert sd.stats.forwards["full"] < ar.stats.forwards["full"]
    with pytest.raises(InvalidParameterError) as info:
        engine.complete(REPEATING, parse_params(mode="sd", proposer="hybrid", max_tokens=3))
    assert info.value.field == "mode"


def _exact_marginals(verifier, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """q(x1 | prompt) and sum_x1 q(x1) q(x2 | prompt, x1), at temperature 1 (float64)."""
    with torch.no_grad():
        q1 = torch.softmax(verifier.forward(torch.tensor(prompt), 0, None, None)[-1], -1)  # [V]
        batch = torch.tensor([prompt + [x] for x in range(verifier.vocab_size)])  # [V, n + 1]
        logits = verifier.model(input_ids=batch).logits[:, -1]  # [V, V]
        q2 = (q1[:, None] * torch.softmax(logits.double(), -1)).sum(0)  # [V]
    return q1.numpy(), q2.numpy()


def _pvalue(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


LOOKUP_PROMPT = [29, 71, 70, 12, 29, 71, 70]  # the lookup proposes 12, 29, 71, ...; q(12 | prompt) = 0.26


@pytest.mark.parametrize("proposer, n", [("ngram", 1500), ("hybrid", 1000)])
def test_sampled_sd_with_lookup_follows_the_verifier(proposer, n):
    """Lossless with a point-mass p: tokens 1 and 2 ~ q's exact marginals (chi-square over n
    seeded requests). The prompt is chosen so that the proposed token has q(x) = 0.26 and q is
    spread (entropy 2.6 nats): the near-miss implementation that accepts x with probability q(x)
    but samples the rejection from q instead of norm(max(0, q - 1_x)) commits x with probability
    q(x) (2 - q(x)) = 0.45 and must be rejected, as must copying the draft. `hybrid` with a
    drafter model: blocks after a rejection find no match and are drafted by the model, so both
    kinds of block are verified and the marginals must still be q's."""
    from conftest import drafter_from

    v = tiny_model("llama")
    verifier = MaskedLM(v)
    engine = Engine(verifier, MaskedLM(drafter_from(v)) if proposer == "hybrid" else None)
    q1, q2 = _exact_marginals(verifier, LOOKUP_PROMPT)
    x = LOOKUP_PROMPT[3]
    assert 0.2 < q1[x] < 0.4 and q1.max() < 0.5  # the case above (the tiny model is seeded)
    counts = np.zeros((2, verifier.vocab_size))
    lookups = model_drafted = 0
    for seed in range(n):
        out = engine.complete(
            LOOKUP_PROMPT,
            parse_params(
                mode="sd", proposer=proposer, temperature=1.0, seed=seed, max_tokens=2, gamma=2, ignore_eos=True
            ),
        )
        counts[0, out.token_ids[0]] += 1
        counts[1, out.token_ids[1]] += 1
        lookups += out.stats.ngram_draft_tokens
        model_drafted += out.stats.num_draft_tokens - out.stats.ngram_draft_tokens
    assert lookups >= n  # every request's first block was a lookup
    if proposer == "hybrid":
        assert model_drafted > n // 10  # and the model drafted blocks too
    assert _pvalue(counts[0], q1) > 1e-3
    assert _pvalue(counts[1], q2) > 1e-3
    # near misses must be rejected: the test has power against the bugs that matter
    resample_from_q = q1 * (1.0 - q1[x])
    resample_from_q[x] += q1[x]
    assert _pvalue(counts[0], resample_from_q) < 1e-6
    assert counts[0, x] < n * 0.4  # the draft is not simply copied: q decides
    assert _pvalue(counts[1], q1) < 1e-6  # (token 2 is not token 1's law)


# ------------------------------------------------------------------ overlap (PEARL-style)


@pytest.mark.parametrize("mode", ["sd", "via"])
def test_greedy_overlap_changes_no_token(tiny_pair, mode, monkeypatch):
    """Greedy: drafting ahead only moves work earlier; sd == ar and via == via without overlap.
    (Every row drafts ahead here, beside a slow verifier, so that drafted-ahead tokens are surely
    used; the shipped choice of rows: test_overlap_drafts_ahead_only_for_rows_likely_accepted_whole.)"""
    from viasd import sessions

    monkeypatch.setattr(sessions, "AHEAD_MIN", 0.0)
    verifier, drafter = tiny_pair
    slow_forwards(monkeypatch, verifier)
    engine = Engine(verifier, drafter, mask=LayerMask.from_skipped((1, 3), verifier.num_layers))
    reused = 0
    for prompt in PROMPTS:
        base = dict(mode=mode, max_tokens=40, gamma=4, alpha1=0.9, alpha2=0.7)
        plain = engine.complete(prompt, parse_params(**base))
        ahead = engine.complete(prompt, parse_params(overlap=True, **base))
        assert ahead.token_ids == plain.token_ids, prompt
        if mode == "sd":
            assert ahead.token_ids == engine.complete(prompt, parse_params(mode="ar", max_tokens=40)).token_ids
        reused += ahead.stats.overlap_draft_tokens
        assert ahead.stats.forwards["full"] == plain.stats.forwards["full"]
    assert reused > 0  # blocks really started from tokens drafted ahead


def test_sampled_overlap_is_reproducible_and_its_pending_rows_are_the_drafters(tiny_pair):
    """Sampled: same seed -> same tokens whatever the timing; after every commit the kept
    drafted-ahead tokens carry p rows equal to the drafter's distribution given their prefix."""
    from viasd.engine import DraftSession, VerifySession, request_seeds
    from viasd.metrics import RequestStats

    verifier, drafter = tiny_pair
    engine = Engine(verifier, drafter)
    params = parse_params(mode="sd", overlap=True, temperature=1.0, seed=5, max_tokens=48, gamma=3)
    runs = [engine.complete(PROMPTS[1], params).token_ids for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]

    stats = RequestStats()
    draft_seed, verify_seed = request_seeds(7)
    params = parse_params(mode="sd", overlap=True, temperature=1.0, seed=7, gamma=3)
    ds = DraftSession(drafter, PROMPTS[1], params, draft_seed, stats)
    vs = VerifySession(
        verifier, LayerMask.full(verifier.num_layers), "separate", PROMPTS[1], params, verify_seed, stats
    )
    checked = 0
    for _ in range(20):
        draft, p = ds.propose(3)
        ds.draft_ahead()  # (sequentially here: the stop flag is never set, the block is drafted whole)
        outcome = vs.check(draft, p)
        ds.commit(outcome)
        vs.commit(outcome)
        assert ds.seq == vs.seq
        for j, (token, row) in enumerate(zip(ds.pending, ds.pending_p)):
            with torch.no_grad():
                logits = drafter.forward(torch.tensor(ds.seq + ds.pending[:j]), 0, None, None)[-1:]  # [1, V]
            want = ds.sampler.probs(logits)  # [1, V]
            torch.testing.assert_close(row, want)
            assert row[0, token] > 0
            checked += 1
    assert checked > 0


def test_overlap_drafts_ahead_only_for_rows_likely_accepted_whole(tiny_pair, monkeypatch):
    """A drafted-ahead block is kept only when the block under verification is accepted whole, so
    a request drafts ahead while its running rate of whole blocks is at least AHEAD_MIN (from an
    optimistic prior): a rejected block stops it, whole blocks bring it back. The choice follows
    the request's own outcomes, never timing."""
    from viasd.engine import DraftSession
    from viasd.metrics import RequestStats
    from viasd.sessions import AHEAD_MIN, Outcome

    verifier, drafter = tiny_pair
    ds = DraftSession(drafter, PROMPTS[0], parse_params(mode="sd", overlap=True, gamma=3), 1, RequestStats())
    assert not ds.drafts_ahead()  # no block under verification yet
    seen = []
    for accepted in (0, 3, 0, 0, 3, 3):
        draft, _ = ds.propose(3)
        seen.append(ds.drafts_ahead())
        ds.commit(Outcome([*draft[:accepted], 5], accepted))
    # the prior; one rejection stops it, one whole block brings it back; after two rejections it
    # takes two whole blocks
    assert seen == [True, False, True, False, False, False]
    draft, _ = ds.propose(3)
    assert ds.drafts_ahead() and ds.whole >= AHEAD_MIN
    plain = DraftSession(drafter, PROMPTS[0], parse_params(mode="sd", gamma=3), 1, RequestStats())
    plain.propose(3)
    assert not plain.drafts_ahead()  # (no overlap asked for)

    # through the engine: a drafter that is not the verifier's (blocks often rejected) drafts
    # ahead for some blocks only; the choice follows the request's own outcomes, so sampled
    # tokens are reproducible and greedy ones are `ar`'s
    calls = []
    original = DraftSession.draft_ahead_steps
    monkeypatch.setattr(DraftSession, "draft_ahead_steps", lambda self: calls.append(1) or original(self))
    engine = Engine(verifier, drafter)
    params = parse_params(mode="sd", max_tokens=40, gamma=4, temperature=1.0, seed=3, overlap=True)
    chosen = [engine.complete(prompt, params) for prompt in PROMPTS]
    blocks = sum(r.stats.num_drafts for r in chosen)
    assert 0 < len(calls) < blocks, (len(calls), blocks)
    assert [r.token_ids for r in chosen] == [engine.complete(prompt, params).token_ids for prompt in PROMPTS]
    greedy = dict(mode="sd", max_tokens=40, gamma=4)
    for prompt in PROMPTS:
        ahead = engine.complete(prompt, parse_params(overlap=True, **greedy)).token_ids
        assert ahead == engine.complete(prompt, parse_params(mode="ar", max_tokens=40)).token_ids


@pytest.mark.parametrize("mode", ["sd", "via"])
def test_overlap_tokens_do_not_depend_on_how_far_the_drafter_got_ahead(tiny_pair, mode):
    """The two extremes of timing, played sequentially: the outcome arrives before drafting ahead
    starts (stop already set) or after the whole next block was drafted (never set). Same seed,
    same tokens."""
    from viasd.engine import DraftSession, VerifySession, request_seeds
    from viasd.metrics import RequestStats

    verifier, drafter = tiny_pair
    mask = LayerMask.from_skipped((1, 3), verifier.num_layers)
    params = parse_params(mode=mode, overlap=True, temperature=1.0, seed=3, gamma=3, alpha1=0.9, alpha2=0.7)

    def run(verifier_first: bool) -> tuple[list[int], int]:
        stats = RequestStats()
        draft_seed, verify_seed = request_seeds(params.seed)
        ds = DraftSession(drafter, PROMPTS[1], params, draft_seed, stats)
        vs = VerifySession(verifier, mask, "separate", PROMPTS[1], params, verify_seed, stats)
        for _ in range(25):
            draft, p = ds.propose(3)
            if verifier_first:
                ds.stop.set()
            ds.draft_ahead()
            outcome = vs.check(draft, p)
            ds.commit(outcome)
            vs.commit(outcome)
        return vs.seq, stats.overlap_draft_tokens

    fast, fast_reused = run(verifier_first=True)
    slow, slow_reused = run(verifier_first=False)
    assert fast == slow
    assert slow_reused > fast_reused  # the slow verifier really let the drafter run ahead further
