"""The engine against its definitions: greedy sd == greedy ar, via == a slow reference decoder,
caches after a rejected block == a fresh prefill, and bad input gets a clear, typed error."""

from __future__ import annotations

import pytest
import torch
from reference import reference_decode

from viasd.config import parse_params
from viasd.engine import Engine
from viasd.errors import InvalidParameterError, MaskError
from viasd.runtime import LayerMask

PROMPTS = [[5, 17, 3, 88, 41, 9], [1, 2, 3], [60] * 12]


def make_engine(pair, policy="separate", skipped=(1, 3)):
    verifier, drafter = pair
    mask = LayerMask.from_skipped(skipped, verifier.num_layers)
    return Engine(verifier, drafter, mask=mask, cache_policy=policy)


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_sd_equals_greedy_ar(tiny_pair, gamma):
    engine = make_engine(tiny_pair)
    accepted = rejected = 0
    for prompt in PROMPTS:
        ar = engine.complete(prompt, parse_params(mode="ar", max_tokens=40))
        sd = engine.complete(prompt, parse_params(mode="sd", max_tokens=40, gamma=gamma))
        assert sd.token_ids == ar.token_ids
        accepted += sd.stats.num_accepted_tokens
        rejected += sd.stats.num_rejected_tokens
        assert sd.stats.forwards["full"] < ar.stats.forwards["full"]
    assert accepted > 0 and rejected > 0  # both paths of the rule ran


@pytest.mark.parametrize("policy", ["separate", "shared"])
def test_greedy_ar_equals_hf_generate(tiny_pair, policy):
    verifier, _ = tiny_pair
    engine = make_engine(tiny_pair, policy)
    prompt = PROMPTS[0]
    ref = verifier.model.generate(
        torch.tensor([prompt]), max_new_tokens=25, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert engine.complete(prompt, parse_params(mode="ar", max_tokens=25)).token_ids == ref


VIA_SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=0.0, region_b="escalate"),
    dict(temperature=1.0, seed=7),
    dict(temperature=0.8, top_k=20, top_p=0.9, seed=15),
    dict(temperature=1.0, seed=3, slim_bonus=True),
    dict(temperature=1.0, seed=5, rule="lossy", lossy_alpha=0.3, lossy_beta=0.8),
    dict(temperature=1.0, seed=9, rule="overshoot", overshoot_ceiling=0.5),
]


@pytest.mark.parametrize("setting", VIA_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_via_equals_reference_decoder(tiny_pair, setting):
    verifier, drafter = tiny_pair
    engine = make_engine(tiny_pair)
    params = parse_params(
        mode="via",
        max_tokens=48,
        gamma=4,
        alpha1=0.9,
        alpha2=0.7,
        seed=setting.get("seed", 0),
        **{k: v for k, v in setting.items() if k != "seed"},
    )
    seen = {"slim_accepted": 0, "slim_rewritten": 0, "escalations": 0}
    for prompt in PROMPTS:
        res = engine.complete(prompt, params)
        assert res.token_ids == reference_decode(verifier, drafter, engine.mask, prompt, params)
        assert len(res.token_ids) == 48 and res.finish_reason == "length"
        for k in seen:
            seen[k] += getattr(res.stats, k)
    assert seen["slim_accepted"] > 0 and seen["escalations"] > 0  # the test covers the tiers
    if setting.get("region_b") != "escalate":
        assert seen["slim_rewritten"] > 0
    else:
        assert seen["slim_rewritten"] == 0


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_sampled_ar_and_sd_equal_reference(tiny_pair, mode):
    verifier, drafter = tiny_pair
    engine = make_engine(tiny_pair)
    params = parse_params(mode=mode, max_tokens=30, temperature=1.0, seed=42)
    assert engine.complete(PROMPTS[0], params).token_ids == reference_decode(
        verifier, drafter, engine.mask, PROMPTS[0], params
    )


def test_same_seed_same_output_different_seed_differs(tiny_pair):
    engine = make_engine(tiny_pair)
    a = engine.complete(PROMPTS[0], parse_params(mode="via", temperature=1.0, seed=1, max_tokens=40))
    b = engine.complete(PROMPTS[0], parse_params(mode="via", temperature=1.0, seed=1, max_tokens=40))
    c = engine.complete(PROMPTS[0], parse_params(mode="via", temperature=1.0, seed=2, max_tokens=40))
    assert a.token_ids == b.token_ids != c.token_ids


def test_shared_policy_uses_one_cache_and_matches_separate_when_slim_is_exact(tiny_pair):
    """With an all-ones mask q' = q, so both policies must give the same tokens."""
    verifier, drafter = tiny_pair
    full = LayerMask.full(verifier.num_layers)
    params = parse_params(mode="via", max_tokens=40, temperature=1.0, seed=8, alpha1=0.9, alpha2=0.7)
    sep = Engine(verifier, drafter, mask=full, cache_policy="separate").complete(PROMPTS[0], params)
    sha = Engine(verifier, drafter, mask=full, cache_policy="shared").complete(PROMPTS[0], params)
    assert sep.token_ids == sha.token_ids
    engine = Engine(verifier, drafter, mask=full, cache_policy="shared")
    handle = engine.submit(PROMPTS[0], params)
    engine.step()
    _, verify = engine.executor.sessions(handle.key)
    assert verify.slim.cache is verify.full.cache


def test_stop_tokens_and_stats(tiny_pair):
    verifier, drafter = tiny_pair
    engine = make_engine(tiny_pair)
    free = engine.complete(PROMPTS[0], parse_params(mode="via", max_tokens=40))
    stop = free.token_ids[10]
    res = Engine(verifier, drafter, mask=engine.mask, eos_token_ids=[stop]).complete(
        PROMPTS[0], parse_params(mode="via", max_tokens=40)
    )
    first = free.token_ids.index(stop)
    assert res.token_ids == free.token_ids[: first + 1] and res.finish_reason == "stop"
    ignored = Engine(verifier, drafter, mask=engine.mask, eos_token_ids=[stop]).complete(
        PROMPTS[0], parse_params(mode="via", max_tokens=40, ignore_eos=True)
    )
    assert ignored.token_ids == free.token_ids
    s = free.stats
    assert s.generated_tokens == 40 and s.num_cycle_tokens >= 40
    assert s.slim_accepted + s.full_accepted == s.num_accepted_tokens
    assert sum(s.num_accepted_tokens_per_pos) == s.num_accepted_tokens
    assert 0.0 <= s.rejection_rate <= 1.0 and s.mean_acceptance_length >= 1.0
    assert s.forwards["drafter"] == s.num_draft_tokens and s.forwards["slim"] == s.num_drafts
    assert s.forwards["full"] == s.escalations


def test_streaming_chunks_concatenate_to_complete(tiny_pair):
    engine = make_engine(tiny_pair)
    params = parse_params(mode="via", max_tokens=33, temperature=1.0, seed=3)
    chunks = list(engine.generate(PROMPTS[1], params))
    assert all(not c.finished for c in chunks[:-1]) and chunks[-1].finished and chunks[-1].stats
    assert sum((c.token_ids for c in chunks), []) == engine.complete(PROMPTS[1], params).token_ids


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "values, field",
    [
        (dict(mode="beam"), "mode"),
        (dict(alpha1=0.3, alpha2=0.3), "alpha2"),
        (dict(alpha1=0.3, alpha2=0.5), "alpha2"),
        (dict(gamma=0), "gamma"),
        (dict(gamma=33), "gamma"),
        (dict(temperature=-0.1), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-5), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(unknown_knob=1), "unknown_knob"),
    ],
)
def test_bad_params_name_the_field(values, field):
    with pytest.raises(InvalidParameterError) as info:
        parse_params(values)
    assert info.value.field == field and field in str(info.value)


@pytest.mark.parametrize(
    "error", [InvalidParameterError("gamma", "must be <= 32"), MaskError("7 layers, model has 6", "engine.mask")]
)
def test_typed_errors_survive_pickling(error):
    """Ray and multiprocessing carry errors by pickle: the field and message must come through."""
    import pickle

    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert (back.field, back.message, str(back)) == (error.field, error.message, str(error))


def test_bad_requests_to_the_engine(tiny_pair):
    verifier, drafter = tiny_pair
    engine = make_engine(tiny_pair)
    with pytest.raises(InvalidParameterError, match="prompt"):
        engine.complete([], parse_params(mode="ar"))
    with pytest.raises(InvalidParameterError, match="prompt"):
        engine.complete([verifier.vocab_size + 3], parse_params(mode="ar"))
    with pytest.raises(InvalidParameterError, match="mode"):
        Engine(verifier, None).complete([1, 2], parse_params(mode="sd"))
    with pytest.raises(InvalidParameterError, match="prompt"):
        Engine(verifier, drafter, max_context=8).complete(list(range(8)), parse_params(mode="ar"))
    with pytest.raises(MaskError, match="mask"):
        Engine(verifier, drafter, mask=LayerMask.full(verifier.num_layers + 1))


def test_context_limit_ends_with_length(tiny_pair):
    verifier, drafter = tiny_pair
    engine = Engine(verifier, drafter, mask=LayerMask.from_skipped([2], verifier.num_layers), max_context=20)
    for mode in ("ar", "sd", "via"):
        res = engine.complete(list(range(1, 11)), parse_params(mode=mode, max_tokens=100))
        assert len(res.token_ids) == 10 and res.finish_reason == "length"
