"""The engine equals the independent reference decoder (tests/reference.py) for every option.

Only the public API: ``Engine(verifier, drafter, mask=..., cache_policy=...).complete(prompt_ids,
params)``, on the float64 tiny pair of tests/conftest.py. The reference has its own gate, rules,
block verification, n-gram lookup, adaptive block length, confidence stop and drafting ahead, and
consumes randomness in the documented order, so with the same seed every token must agree: a
wrong acceptance probability, residual, gate threshold, proposal or random-stream order in the
engine shows up here. Each test also checks, from the request's statistics, that the option it
covers was exercised (a rejection happened, an n-gram was copied, a block was cut short, ...).

The shared cache policy is the exception: q' then reads q's keys and values for the layers it
keeps wherever q has computed them, a mixture of two models' states that a cache-free reference
cannot recompute. What is provable is tested instead: with an all-ones mask (q' = q) the shared
policy gives exactly the tokens of the separate one and of the reference, and greedy `via` with
alpha1 = 1 over the all-ones mask equals greedy `ar` (every committed token is q's argmax), so any
stale or misplaced slot in the shared cache changes the output.
"""

from __future__ import annotations

import pytest
from reference import reference_decode

from viasd.config import parse_params
from viasd.engine import Engine
from viasd.runtime import LayerMask

PROMPTS = [[5, 17, 3, 88, 41, 9], [60] * 12]
# repeated phrases, so that prompt lookup finds matches (the tiny models also repeat themselves)
REPEATING = [[5, 17, 3, 88, 41, 9, 5, 17, 3, 88, 41, 9, 5, 17], [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]]
VIA = dict(mode="via", gamma=4, alpha1=0.9, alpha2=0.7)  # thresholds that reach all three tiers
MAX_TOKENS = 32


def engine(pair, policy: str = "separate", skipped=(1, 3)) -> Engine:
    verifier, drafter = pair
    return Engine(verifier, drafter, mask=LayerMask.from_skipped(skipped, verifier.num_layers), cache_policy=policy)


def run_both(pair, eng: Engine, prompts, **params) -> list:
    """Each prompt through the engine and the reference; assert equal tokens; return the stats."""
    verifier, drafter = pair
    p = parse_params(max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    stats = []
    for prompt in prompts:
        got = eng.complete(prompt, p)
        assert got.token_ids == reference_decode(verifier, drafter, eng.mask, prompt, p), (prompt, params)
        assert len(got.token_ids) == MAX_TOKENS
        stats.append(got.stats)
    return stats


def total(stats, name: str) -> int:
    return sum(getattr(s, name) for s in stats)


# ------------------------------------------------------------------ the acceptance rules

RULES = [
    dict(rule="lossless"),
    dict(rule="lossy", lossy_alpha=0.3, lossy_beta=0.6),
    dict(rule="overshoot", overshoot_ceiling=0.9),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r["rule"])
@pytest.mark.parametrize("mode", ["sd", "via"])
def test_sampled_rules_equal_the_reference(tiny_pair, rule, mode):
    """Acceptance probability, residual and the order of the draws of every rule, sampled."""
    settings = dict(mode="sd", gamma=4) if mode == "sd" else dict(VIA)
    stats = []
    for seed in (1, 2):
        stats += run_both(tiny_pair, engine(tiny_pair), PROMPTS, temperature=1.0, seed=seed, **settings, **rule)
    assert total(stats, "num_rejected_tokens") > 0 and total(stats, "num_accepted_tokens") > 0
    if mode == "via":
        assert total(stats, "escalations") > 0 and total(stats, "full_accepted") > 0


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r["rule"])
def test_greedy_rules_and_top_k_top_p_equal_the_reference(tiny_pair, rule):
    stats = run_both(tiny_pair, engine(tiny_pair), PROMPTS, seed=0, **VIA, **rule)
    stats += run_both(
        tiny_pair, engine(tiny_pair), PROMPTS, seed=3, temperature=0.8, top_k=20, top_p=0.9, **VIA, **rule
    )
    assert total(stats, "escalations") > 0 and total(stats, "slim_accepted") > 0


def test_region_b_escalate_and_slim_bonus_equal_the_reference(tiny_pair):
    stats = run_both(tiny_pair, engine(tiny_pair), PROMPTS, temperature=1.0, seed=5, region_b="escalate", **VIA)
    assert total(stats, "slim_rewritten") == 0 and total(stats, "escalations") > 0
    stats = run_both(
        tiny_pair,
        engine(tiny_pair),
        PROMPTS,
        temperature=1.0,
        seed=6,
        slim_bonus=True,
        **dict(VIA, alpha1=0.3, alpha2=0.1),
    )
    assert total(stats, "num_bonus_tokens") > 0


# ------------------------------------------------------------------ the proposers


@pytest.mark.parametrize("proposer", ["ngram", "hybrid"])
@pytest.mark.parametrize("mode", ["sd", "via"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_ngram_and_hybrid_proposers_equal_the_reference(tiny_pair, proposer, mode, temperature):
    settings = dict(mode="sd", gamma=4) if mode == "sd" else dict(VIA)
    stats = run_both(
        tiny_pair,
        engine(tiny_pair),
        REPEATING,
        proposer=proposer,
        ngram_max=3,
        temperature=temperature,
        seed=11,
        **settings,
    )
    copied, drafted = total(stats, "ngram_draft_tokens"), total(stats, "num_draft_tokens")
    assert copied > 0
    if proposer == "hybrid":
        assert drafted > copied  # the model drafted where the lookup found nothing
    else:
        assert drafted == copied


# ------------------------------------------------------------------ block length policies


@pytest.mark.parametrize("mode", ["sd", "via"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_draft_confidence_stop_equals_the_reference(tiny_pair, mode, temperature):
    settings = dict(mode="sd", gamma=5) if mode == "sd" else dict(VIA, gamma=5)
    stats = run_both(
        tiny_pair, engine(tiny_pair), PROMPTS, draft_confidence=0.3, temperature=temperature, seed=21, **settings
    )
    full_blocks = total(stats, "num_drafts") * 5
    assert total(stats, "num_draft_tokens") < full_blocks - 10  # blocks were cut short (not only at the budget's end)


@pytest.mark.parametrize("mode", ["sd", "via"])
def test_adaptive_gamma_equals_the_reference(tiny_pair, mode):
    settings = dict(mode="sd", gamma=6) if mode == "sd" else dict(VIA, gamma=6)
    fixed = run_both(tiny_pair, engine(tiny_pair), PROMPTS, temperature=1.0, seed=31, **settings)
    adaptive = run_both(
        tiny_pair, engine(tiny_pair), PROMPTS, temperature=1.0, seed=31, adaptive_gamma=True, **settings
    )
    mean = total(adaptive, "num_draft_tokens") / total(adaptive, "num_drafts")
    assert mean < total(fixed, "num_draft_tokens") / total(fixed, "num_drafts")  # shorter blocks after rejections


# ------------------------------------------------------------------ overlap (drafting ahead)


@pytest.mark.parametrize("mode", ["sd", "via"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("ahead_min", [None, 0.0], ids=["rows-likely-accepted", "every-row"])
def test_overlap_equals_the_reference(tiny_pair, mode, temperature, ahead_min, monkeypatch):
    """The drafter drafts the next block during the verification, each block on its own seeded
    stream: the tokens do not depend on how far it got, and equal the reference's, with the
    shipped rule for which rows draft ahead, and with every row drafting ahead beside a slow
    verifier (where drafted-ahead tokens are surely used: conftest.slow_forwards)."""
    import reference
    from conftest import slow_forwards

    from viasd import sessions

    if ahead_min is not None:
        monkeypatch.setattr(sessions, "AHEAD_MIN", ahead_min)
        monkeypatch.setattr(reference, "AHEAD_MIN", ahead_min)
        slow_forwards(monkeypatch, tiny_pair[0])
    assert sessions.AHEAD_MIN == reference.AHEAD_MIN
    settings = dict(mode="sd", gamma=4) if mode == "sd" else dict(VIA)
    stats = []
    for seed in (41, 42):
        stats += run_both(
            tiny_pair, engine(tiny_pair), PROMPTS, overlap=True, temperature=temperature, seed=seed, **settings
        )
    if ahead_min == 0.0:
        assert total(stats, "overlap_draft_tokens") > 0  # drafted-ahead tokens were used


def test_sampled_overlap_reference_is_not_the_plain_one(tiny_pair):
    """The reference really models overlap's per-block streams (else the test above proves nothing
    beyond the plain decoder): sampled, the two differ."""
    verifier, drafter = tiny_pair
    mask = LayerMask.from_skipped((1, 3), verifier.num_layers)
    outs = [
        reference_decode(
            verifier,
            drafter,
            mask,
            PROMPTS[0],
            parse_params(max_tokens=MAX_TOKENS, temperature=1.0, seed=41, overlap=overlap, **VIA),
        )
        for overlap in (False, True)
    ]
    assert outs[0] != outs[1]


# ------------------------------------------------------------------ the shared cache policy


@pytest.mark.parametrize(
    "settings",
    [
        dict(VIA, temperature=1.0, seed=51),
        dict(VIA, temperature=1.0, seed=52, rule="lossy", lossy_alpha=0.3, lossy_beta=0.6),
        dict(VIA, seed=0),
        dict(VIA, temperature=1.0, seed=53, overlap=True, adaptive_gamma=True),
    ],
    ids=["sampled", "lossy", "greedy", "overlap-adaptive"],
)
def test_shared_cache_with_an_all_ones_mask_equals_separate_and_the_reference(tiny_pair, settings):
    """q' = q: the shared policy holds q's own keys and values, so it must give the separate
    policy's tokens, and the reference's."""
    verifier, _ = tiny_pair
    shared, separate = engine(tiny_pair, "shared", skipped=()), engine(tiny_pair, "separate", skipped=())
    stats = run_both(tiny_pair, shared, PROMPTS, **settings)
    p = parse_params(max_tokens=MAX_TOKENS, ignore_eos=True, **settings)
    for prompt in PROMPTS:
        assert shared.complete(prompt, p).token_ids == separate.complete(prompt, p).token_ids
    assert total(stats, "slim_accepted") > 0


@pytest.mark.parametrize("region_b", ["rewrite", "escalate"])
def test_greedy_shared_via_with_alpha1_one_equals_ar(tiny_pair, region_b):
    """With q' = q and alpha1 = 1, q' accepts a draft token only when it is q's argmax, rewrites
    with q's argmax, or escalates to q: greedy `via` over the shared cache must equal greedy `ar`."""
    shared = engine(tiny_pair, "shared", skipped=())
    stats = []
    for prompt in PROMPTS + REPEATING:
        via = shared.complete(
            prompt,
            parse_params(
                mode="via", gamma=4, alpha1=1.0, alpha2=0.5, region_b=region_b, max_tokens=MAX_TOKENS, ignore_eos=True
            ),
        )
        ar = shared.complete(prompt, parse_params(mode="ar", max_tokens=MAX_TOKENS, ignore_eos=True))
        assert via.token_ids == ar.token_ids, prompt
        stats.append(via.stats)
    assert total(stats, "slim_accepted") > 0  # q' committed tokens from the shared cache ...
    assert total(stats, "escalations") + total(stats, "slim_rewritten") > 0  # ... and rejected some drafts
