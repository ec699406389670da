"""Logits processing shared by p, q' and q: greedy, top-k, top-p, min-p, seeding."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from viasd.config import parse_params
from viasd.errors import InvalidParameterError
from viasd.sampling import Penalties, Sampler, batch_probs, sample_rows

# A hand-made distribution, deliberately not sorted by token id.
#          id:   0     1     2     3     4
BASE = [0.15, 0.45, 0.1, 0.25, 0.05]  # ranks: 1 > 3 > 0 > 2 > 4


def logits_of(probs: list[float], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor([probs], dtype=dtype).log()  # [1, V]


def kept(probs: torch.Tensor) -> set[int]:
    return set((probs[0] > 0).nonzero().flatten().tolist())


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_is_one_hot_with_lowest_id_tie_break():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 2.0, 2.0]])  # [3, 4]
    probs = Sampler().probs(logits)
    assert torch.equal(probs, torch.eye(4)[[1, 0, 2]])
    assert Sampler().greedy and not Sampler(temperature=0.7).greedy


def test_greedy_ignores_filters_and_keeps_dtype():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    probs = Sampler(top_k=2, top_p=0.3, min_p=0.5).probs(logits)
    assert probs.dtype == torch.float64
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(3, dtype=torch.float64))
    assert Sampler().probs(logits.to(torch.bfloat16)).dtype == torch.float32
    assert Sampler(temperature=1.0).probs(logits.to(torch.bfloat16)).dtype == torch.float32


def test_greedy_sample_is_argmax_and_consumes_no_randomness():
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    probs = torch.tensor([[0.2, 0.5, 0.3], [0.4, 0.4, 0.2]])
    assert Sampler().sample(probs, g).tolist() == [1, 0]
    assert torch.equal(g.get_state(), state)
    Sampler(temperature=1.0).sample(probs, g)  # the sampled path does consume randomness
    assert not torch.equal(g.get_state(), state)


# --- filters ----------------------------------------------------------------------------------


def test_temperature_one_without_filters_is_softmax():
    logits = logits_of(BASE)
    assert torch.allclose(Sampler(temperature=1.0).probs(logits), torch.tensor([BASE], dtype=torch.float64))
    hot = Sampler(temperature=2.0).probs(logits)
    assert torch.allclose(hot, torch.softmax(logits / 2.0, -1))


@pytest.mark.parametrize(
    ("k", "expect"), [(1, {1}), (2, {1, 3}), (3, {0, 1, 3}), (4, {0, 1, 2, 3}), (5, set(range(5))), (9, set(range(5)))]
)
def test_top_k_keeps_the_k_most_likely(k, expect):
    probs = Sampler(temperature=1.0, top_k=k).probs(logits_of(BASE))
    assert kept(probs) == expect
    base = torch.tensor(BASE, dtype=torch.float64)
    idx = sorted(expect)
    assert torch.allclose(probs[0, idx], base[idx] / base[idx].sum())  # renormalised, proportions kept


def test_top_k_keeps_ties_at_the_kth_value():
    probs = Sampler(temperature=1.0, top_k=2).probs(logits_of([0.4, 0.2, 0.2, 0.2]))
    assert kept(probs) == {0, 1, 2, 3}
    probs = Sampler(temperature=1.0, top_k=1).probs(logits_of([0.3, 0.3, 0.4]))
    assert kept(probs) == {2}


@pytest.mark.parametrize(
    ("top_p", "expect"),
    [
        (0.3, {1}),
        (0.44, {1}),
        (0.46, {1, 3}),
        (0.69, {1, 3}),
        (0.71, {0, 1, 3}),
        (0.84, {0, 1, 3}),
        (0.86, {0, 1, 2, 3}),
        (0.96, set(range(5))),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p, expect):
    # sorted: 0.45 (id 1), 0.25 (id 3), 0.15 (id 0), 0.10 (id 2), 0.05 (id 4); prefix masses .45 .70 .85 .95 1
    probs = Sampler(temperature=1.0, top_p=top_p).probs(logits_of(BASE))
    assert kept(probs) == expect


def test_top_p_always_keeps_the_top_token_and_breaks_ties_to_lower_ids():
    assert kept(Sampler(temperature=1.0, top_p=1e-9).probs(logits_of(BASE))) == {1}
    # ties: 0.25 x 4; top_p 0.6 needs three of them -> the three lowest ids
    assert kept(Sampler(temperature=1.0, top_p=0.6).probs(logits_of([0.25, 0.25, 0.25, 0.25]))) == {0, 1, 2}
    # 1024 equal logits: every prefix mass k / 1024 is exact. top_p = 0.5 is reached by exactly
    # 512 tokens (mass >= top_p, not >), and the ties go to the 512 lowest ids (stable sort)
    flat = Sampler(temperature=1.0, top_p=0.5).probs(torch.zeros(1, 1024))
    assert kept(flat) == set(range(512))
    assert kept(Sampler(temperature=1.0, top_p=0.5).probs(torch.zeros(1, 4))) == {0, 1}


@pytest.mark.parametrize(
    ("min_p", "expect"), [(0.1, set(range(5))), (0.2, {0, 1, 2, 3}), (0.3, {0, 1, 3}), (0.5, {1, 3}), (0.6, {1})]
)
def test_min_p_drops_tokens_below_min_p_times_max(min_p, expect):
    # thresholds min_p * 0.45: .045 .09 .135 .225 .27
    assert kept(Sampler(temperature=1.0, min_p=min_p).probs(logits_of(BASE))) == expect


def test_filters_apply_in_order_each_on_the_renormalised_distribution():
    # top_k=2 keeps ids {1, 3} -> renormalised 0.643 / 0.357; top_p=0.6 then keeps only id 1.
    # (Applied to the raw distribution, top_p=0.6 would have kept both.)
    assert kept(Sampler(temperature=1.0, top_k=2, top_p=0.6).probs(logits_of(BASE))) == {1}
    assert kept(Sampler(temperature=1.0, top_p=0.6).probs(logits_of(BASE))) == {1, 3}
    # temperature first: at T=0.25 the distribution sharpens, min_p=0.2 then keeps id 1 only
    cold = Sampler(temperature=0.25, min_p=0.2).probs(logits_of(BASE))
    assert kept(cold) == {1}
    assert kept(Sampler(temperature=1.0, min_p=0.2).probs(logits_of(BASE))) == {0, 1, 2, 3}


def test_masked_tokens_are_exactly_zero_and_kept_ones_positive():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))  # [6, 50]
    probs = Sampler(temperature=0.9, top_k=3, top_p=0.95, min_p=0.05).probs(logits)
    assert ((probs == 0) | (probs > 1e-12)).all()
    assert ((probs > 0).sum(-1) <= 3).all()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(1, 40),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 0.99),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_probs_are_distributions(seed, vocab, temperature, top_k, top_p, min_p, dtype):
    logits = (3 * torch.randn(4, vocab, generator=torch.Generator().manual_seed(seed))).to(dtype)  # [4, V]
    sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = sampler.probs(logits)
    assert probs.shape == logits.shape and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(4, dtype=probs.dtype), atol=1e-5)
    # the most likely token (lowest id on ties) survives every filter
    top = logits.to(probs.dtype).argmax(-1, keepdim=True)  # [4, 1]
    assert bool((probs.gather(-1, top) > 0).all())
    if top_k and dtype != torch.bfloat16:  # continuous logits: no ties at the k-th value
        assert bool(((probs > 0).sum(-1) <= top_k).all())
    if temperature > 0:  # min-p is the last filter: every survivor passes it
        floor = min_p * probs.amax(-1, keepdim=True) * (1 - 1e-5)  # [4, 1]
        assert bool(((probs == 0) | (probs >= floor)).all())


# --- sampling ---------------------------------------------------------------------------------


def test_same_seed_same_samples():
    probs = Sampler(temperature=1.0).probs(torch.randn(64, 100, generator=torch.Generator().manual_seed(5)))
    s = Sampler(temperature=1.0)
    a = s.sample(probs, torch.Generator().manual_seed(42))
    b = s.sample(probs, torch.Generator().manual_seed(42))
    c = s.sample(probs, torch.Generator().manual_seed(43))
    assert a.shape == (64,) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert bool((probs.gather(-1, a[:, None]) > 0).all())


def test_sample_rows_greedy_rows_take_argmax_without_randomness():
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    probs = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.5, 0.0]])  # ties: the lowest id
    assert sample_rows(probs, [True, True], [g, g]).tolist() == [1, 0]
    assert torch.equal(g.get_state(), state)
    sample_rows(probs, [True, False], [g, g])
    assert not torch.equal(g.get_state(), state)


def test_sample_rows_inverts_the_cdf_of_one_uniform_per_row():
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3], [0.0, 0.0, 0.0, 2.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    u = torch.rand(3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    cdf = probs.cumsum(-1)
    expect = [int((cdf[i] > u[i] * cdf[i, -1]).nonzero()[0, 0]) for i in range(3)]
    g = torch.Generator().manual_seed(5)
    assert sample_rows(probs, [False] * 3, [g] * 3).tolist() == expect


def test_sample_rows_follows_the_law_and_never_draws_a_zero():
    law = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.0, 0.3], dtype=torch.float64)
    n, g = 20_000, torch.Generator().manual_seed(1)
    tokens = sample_rows(law.expand(n, -1).float(), [False] * n, [g] * n)  # float32 rows, as the engine's
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[1] == 0 and counts[4] == 0
    support = law > 0
    assert chisquare(counts[support].numpy(), (law[support] * n).numpy()).pvalue > 1e-3


def test_sample_rows_each_row_draws_from_its_own_stream():
    """A row's token depends on its own generator only: alone or between other rows, the same."""
    probs = torch.softmax(torch.randn(5, 50, generator=torch.Generator().manual_seed(3)), -1)
    alone = [int(sample_rows(probs[i : i + 1], [False], [torch.Generator().manual_seed(i)])[0]) for i in range(5)]
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    assert sample_rows(probs, [False, True, False, False, False], gens).tolist()[2:] == alone[2:]


SAMPLERS = [
    Sampler(),
    Sampler(temperature=1.0),
    Sampler(temperature=0.7, top_k=3),
    Sampler(temperature=1.3, top_p=0.6),
    Sampler(temperature=0.9, min_p=0.2),
    Sampler(temperature=1.0, top_k=5, top_p=0.8, min_p=0.05),
    Sampler(top_k=2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_probs_equals_each_rows_own_sampler(dtype):
    """Rows with different samplers in one batch get exactly their own sampler's distribution."""
    logits = 2.0 * torch.randn(len(SAMPLERS) * 2, 40, generator=torch.Generator().manual_seed(4), dtype=dtype)
    samplers = SAMPLERS + SAMPLERS[::-1]
    together = batch_probs(logits, samplers)
    for i, s in enumerate(samplers):
        alone = batch_probs(logits[i : i + 1], [s])
        assert torch.equal(together[i : i + 1], alone), s
        if s.greedy:
            assert torch.equal(alone, torch.nn.functional.one_hot(logits[i].argmax(), 40)[None].to(alone.dtype))
        else:
            assert torch.allclose(alone.sum(-1), torch.ones(1, dtype=alone.dtype))


def test_penalties_rows_follow_their_own_prefix_with_device_blocks():
    """Row t of a block sees block[:first + t]; a tensor block equals a list block."""
    params = parse_params(frequency_penalty=0.5, presence_penalty=0.25)
    pen = Penalties(params, [1, 2], 10, "cpu")
    logits = torch.zeros(3, 10)
    block = [4, 4, 7, 2]
    as_list = pen(logits, [1, 2, 4], block, first=1)
    assert torch.equal(as_list, pen(logits, [1, 2, 4], torch.tensor(block), first=1))
    # row 0 follows output [4] + block[:1] = [4, 4]: token 4 twice
    assert as_list[0, 4] == -(0.5 * 2 + 0.25) and as_list[0, 7] == 0
    assert as_list[2, 7] == -(0.5 + 0.25) and as_list[2, 4] == -(0.5 * 3 + 0.25)


# --- gate distribution ------------------------------------------------------------------------


def test_gate_probs_at_greedy_is_the_temperature_one_distribution():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(Sampler().gate_probs(logits), torch.softmax(logits, -1))
    assert torch.equal(Sampler(top_k=4).gate_probs(logits), Sampler(temperature=1.0, top_k=4).probs(logits))
    hot = Sampler(temperature=0.5, min_p=0.1)
    assert torch.equal(hot.gate_probs(logits), hot.probs(logits))


# --- parameters -------------------------------------------------------------------------------


def test_from_params():
    params = parse_params(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05)
    assert Sampler.from_params(params) == Sampler(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05)
    assert Sampler.from_params(parse_params()).greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
    ],
)
def test_invalid_sampler_names_the_field(kwargs, field):
    with pytest.raises(InvalidParameterError) as err:
        Sampler(**kwargs)
    assert err.value.field == field
