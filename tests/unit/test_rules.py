"""Acceptance rules: statistical exactness of verification, gate boundaries and properties.

Every statistical test is seeded, so it is deterministic: a pass here is a pass everywhere.
Chi-square thresholds: p > 1e-3 to accept the right law, p < 1e-6 to reject a wrong one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from viasd.config import parse_params
from viasd.errors import InvalidParameterError
from viasd.rules import (
    AcceptanceRule,
    Lossless,
    Lossy,
    OvershootCeiling,
    Region,
    Verdict,
    correct_rows,
    gate,
    gate_ratio,
    gate_rows,
    leading,
    output_distribution,
    rule_from_params,
    skip_verify_draws,
    three_tier_mixture,
    verify,
    verify_batch,
    verify_greedy,
    verify_rows,
)

V = 8
N = 40_000
A, B, C = int(Region.ACCEPT), int(Region.REWRITE), int(Region.ESCALATE)


def dist(seed: int, *shape: int, scale: float = 1.5) -> torch.Tensor:
    """A random distribution over the last axis, float64, every entry >= 0.2 / V."""
    g = torch.Generator().manual_seed(seed)
    soft = torch.softmax(scale * torch.randn(*shape, generator=g, dtype=torch.float64), -1)
    return 0.8 * soft + 0.2 / shape[-1]


def pvalue(tokens: torch.Tensor, law: torch.Tensor) -> float:
    """Chi-square goodness of fit of sampled tokens [N] to the law [V]."""
    counts = torch.bincount(tokens, minlength=law.shape[0]).numpy().astype(np.float64)
    expected = (law / law.sum()).numpy() * tokens.shape[0]
    support = expected > 0
    assert counts[~support].sum() == 0, "a token with zero probability was sampled"
    return float(chisquare(counts[support], expected[support]).pvalue)


def first_committed(rule: AcceptanceRule, p: torch.Tensor, q: torch.Tensor, seed: int, n: int = N) -> torch.Tensor:
    """n independent single-token verifications (T = 1, draft ~ p): the first committed token."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(p, n, replacement=True, generator=g)  # [n]
    q_rows = torch.stack([q, q])  # [2, V]; row 1 (bonus) is never the first committed token
    out = verify_batch(rule, p.expand(n, 1, -1), q_rows.expand(n, 2, -1), draft[:, None], g)
    return torch.where(out.num_accepted == 1, draft, out.token)  # [n]


@dataclass(frozen=True)
class ResidualIsQ(Lossless):
    """Wrong: on rejection, samples from q instead of norm(max(0, q - p))."""

    def residual(self, p, q):
        return q.clone()


@dataclass(frozen=True)
class SwappedRatio(Lossless):
    """Wrong: accepts with min(1, p/q) instead of min(1, q/p)."""

    def accept_prob(self, p_x, q_x):
        return (p_x / q_x).clamp(max=1.0)


# --- 1. lossless reproduces q -----------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_lossless_reproduces_the_target_distribution(seed):
    p, q = dist(100 + seed, V), dist(200 + seed, V)
    assert torch.allclose(output_distribution(Lossless(), p, q), q, atol=1e-12)
    assert pvalue(first_committed(Lossless(), p, q, seed), q) > 1e-3


@pytest.mark.parametrize("wrong", [ResidualIsQ(), SwappedRatio()])
def test_the_same_statistic_rejects_a_wrong_rule(wrong):
    p, q = dist(100, V), dist(200, V)
    assert pvalue(first_committed(wrong, p, q, 0), q) < 1e-6


def test_lossless_float32_reproduces_the_target_distribution():
    p, q = dist(7, V).float(), dist(8, V).float()
    assert pvalue(first_committed(Lossless(), p, q, 3), q.double()) > 1e-3


# --- 2. lossy rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rule", [Lossy(alpha=0.4, beta=0.5), Lossy(alpha=0.2, beta=1.0), OvershootCeiling(ceiling=0.5)], ids=repr
)
def test_lossy_rules_sample_their_output_distribution(rule):
    p, q = dist(300, V, scale=2.5), dist(400, V, scale=2.5)
    law = output_distribution(rule, p, q)
    assert torch.isclose(law.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert (law - q).abs().sum() > 0.02  # the rule really is lossy on this pair
    tokens = first_committed(rule, p, q, 5)
    assert pvalue(tokens, law) > 1e-3
    assert pvalue(tokens, q) < 1e-6  # and the test can tell


def test_overshoot_law_has_the_documented_closed_form():
    p, q, ceiling = dist(11, V, scale=2.5), dist(12, V, scale=2.5), 0.6
    capped = torch.minimum(p, q / ceiling)  # [V]
    residual = (q - p).clamp(min=0)
    expected = capped + (1 - capped.sum()) * residual / residual.sum()
    assert torch.allclose(output_distribution(OvershootCeiling(ceiling), p, q), expected, atol=1e-12)


def test_lossy_law_has_the_documented_closed_form():
    p, q, alpha, beta = dist(13, V, scale=2.5), dist(14, V, scale=2.5), 0.3, 0.6
    capped = torch.minimum(p, q / (1 - alpha))  # [V] = p a
    residual = (q - beta * p).clamp(min=0)
    expected = capped + (1 - capped.sum()) * residual / residual.sum()
    assert torch.allclose(output_distribution(Lossy(alpha, beta), p, q), expected, atol=1e-12)


def test_accept_prob_and_residual_values():
    p_x = torch.tensor([0.5, 0.2, 0.4, 0.0, 0.0, 0.3])
    q_x = torch.tensor([0.25, 0.3, 0.4, 0.1, 0.0, 0.0])
    # q >= p: always accept; q < p: q/p; p = 0 < q: 1; q = 0: never
    assert torch.allclose(Lossless().accept_prob(p_x, q_x), torch.tensor([0.5, 1.0, 1.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(Lossy(alpha=0.5).accept_prob(p_x, q_x), torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(Lossy(alpha=0.2).accept_prob(p_x, q_x), torch.tensor([0.625, 1.0, 1.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(OvershootCeiling(0.8).accept_prob(p_x, q_x), torch.tensor([0.625, 1.0, 1.0, 1.0, 0.0, 0.0]))
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.2, 0.3, 0.5]])
    assert torch.allclose(Lossless().residual(p, q), torch.tensor([[0.0, 0.0, 0.3]]))
    assert torch.allclose(Lossy(beta=0.5).residual(p, q), torch.tensor([[0.0, 0.15, 0.4]]))
    assert torch.allclose(OvershootCeiling(0.5).residual(p, q), torch.tensor([[0.0, 0.0, 0.3]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lossy_rules_at_their_lossless_values_are_exactly_lossless(dtype):
    p, q = dist(21, 3, V).to(dtype), dist(22, 4, V).to(dtype)
    draft = torch.tensor([1, 5, 2])
    p_x, q_x = p[torch.arange(3), draft], q[torch.arange(3), draft]
    for rule in (Lossy(), Lossy(alpha=0.0, beta=1.0), OvershootCeiling(), OvershootCeiling(ceiling=1.0)):
        assert torch.equal(rule.accept_prob(p_x, q_x), Lossless().accept_prob(p_x, q_x))
        assert torch.equal(rule.residual(p, q[:3]), Lossless().residual(p, q[:3]))
        for seed in range(20):
            got = verify(rule, p, q, draft, torch.Generator().manual_seed(seed))
            assert got == verify(Lossless(), p, q, draft, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Lossy(alpha=1.0), "lossy_alpha"),
        (lambda: Lossy(alpha=-0.1), "lossy_alpha"),
        (lambda: Lossy(beta=0.0), "lossy_beta"),
        (lambda: Lossy(beta=1.5), "lossy_beta"),
        (lambda: Lossy(alpha=math.nan), "lossy_alpha"),
        (lambda: OvershootCeiling(ceiling=0.0), "overshoot_ceiling"),
        (lambda: OvershootCeiling(ceiling=1.1), "overshoot_ceiling"),
    ],
)
def test_invalid_rule_parameters_name_the_field(make, field):
    with pytest.raises(InvalidParameterError) as err:
        make()
    assert err.value.field == field


def test_rule_from_params():
    assert rule_from_params(parse_params()) == Lossless()
    assert rule_from_params(parse_params(rule="lossy", lossy_alpha=0.2, lossy_beta=0.7)) == Lossy(alpha=0.2, beta=0.7)
    assert rule_from_params(parse_params(rule="overshoot", overshoot_ceiling=0.4)) == OvershootCeiling(ceiling=0.4)


# --- 3. multi-token blocks --------------------------------------------------------------------


def test_block_acceptance_counts_match_the_analytic_probabilities():
    t, n = 3, N
    p, q = dist(500, t, V), dist(600, t + 1, V)  # [3, V], [4, V]
    g = torch.Generator().manual_seed(9)
    draft = torch.stack([torch.multinomial(p[j], n, replacement=True, generator=g) for j in range(t)], -1)  # [n, 3]
    out = verify_batch(Lossless(), p.expand(n, t, V), q.expand(n, t + 1, V), draft, g)
    beta = torch.minimum(p, q[:t]).sum(-1)  # [3] P(accept position j | reached j) = sum_v min(p_j, q_j)
    reach = torch.cat([torch.ones(1, dtype=torch.float64), beta.cumprod(0)])  # [4] P(num_accepted >= j)
    hist_law = reach - torch.cat([reach[1:], torch.zeros(1, dtype=torch.float64)])  # [4] P(num_accepted = j)
    assert pvalue(out.num_accepted, hist_law) > 1e-3
    # P(num_accepted >= 1) = sum_v min(p_1, q_1), within 5 standard errors
    frac = (out.num_accepted >= 1).double().mean()
    assert abs(frac - beta[0]) < 5 * math.sqrt(beta[0] * (1 - beta[0]) / n)
    assert torch.equal(out.bonus, out.num_accepted == t)
    # recovered tokens at a rejection j follow norm(max(0, q_j - p_j)); bonus tokens follow q_T
    for j in range(t):
        rejected_here = out.num_accepted == j
        residual = (q[j] - p[j]).clamp(min=0)
        assert pvalue(out.token[rejected_here], residual) > 1e-3
    assert pvalue(out.token[out.bonus], q[t]) > 1e-3
    # the token committed at position 0 (draft[0] if accepted, else the recovered one) follows q_0
    first = torch.where(out.num_accepted >= 1, draft[:, 0], out.token)
    assert pvalue(first, q[0]) > 1e-3


def test_verify_is_reproducible_and_matches_the_batched_form():
    p, q = dist(31, 4, V).float(), dist(32, 5, V).float()
    draft = torch.tensor([0, 3, 3, 7])
    for seed in range(30):
        one = verify(Lossless(), p, q, draft, torch.Generator().manual_seed(seed))
        assert one == verify(Lossless(), p, q, draft, torch.Generator().manual_seed(seed))
        batch = verify_batch(Lossless(), p[None], q[None], draft[None], torch.Generator().manual_seed(seed))
        assert one == Verdict(int(batch.num_accepted[0]), int(batch.token[0]), bool(batch.bonus[0]))
        assert 0 <= one.num_accepted <= 4 and one.bonus == (one.num_accepted == 4)


def test_verify_randomness_order_is_u_then_one_uniform_for_the_token():
    p, q = dist(41, 2, V), dist(42, 3, V)
    draft = torch.tensor([1, 2])
    seed = 17
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(2, generator=g, dtype=torch.float64)
    a = Lossless().accept_prob(p[[0, 1], draft], q[[0, 1], draft])
    n_acc = int((u < a).long().cumprod(0).sum())
    law = q[2] if n_acc == 2 else (q[n_acc] - p[n_acc]).clamp(min=0)
    cdf = law.cumsum(0)
    token = int((cdf > torch.rand(1, generator=g, dtype=torch.float64) * cdf[-1]).nonzero()[0, 0])
    assert verify(Lossless(), p, q, draft, torch.Generator().manual_seed(seed)) == Verdict(n_acc, token, n_acc == 2)


def test_verify_rows_equals_each_block_alone():
    """Blocks of different lengths, rules and streams (greedy among them) verified together get
    exactly what each gets alone: nothing of a block depends on its neighbours."""
    rules = [Lossless(), Lossy(alpha=0.3, beta=0.6), OvershootCeiling(0.5), Lossless(), ResidualIsQ()]
    lengths, greedy = [3, 1, 4, 2, 2], [False, False, False, True, False]
    blocks = []
    for b, (n, hot) in enumerate(zip(lengths, greedy)):
        p, q = dist(80 + b, n, V), dist(90 + b, n + 1, V)
        if hot:
            p, q = one_hot([5, 1]), one_hot([5, 2, 0])
        draft = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(b))[:, 0]
        blocks.append((p, q, draft))
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed * 10 + b) for b in range(5)]
        out = verify_rows(rules, *(torch.cat(parts) for parts in zip(*blocks)), lengths, greedy, gens)
        for b, (p, q, draft) in enumerate(blocks):
            alone = verify(rules[b], p, q, draft, torch.Generator().manual_seed(seed * 10 + b), greedy=greedy[b])
            assert (int(out.num_accepted[b]), int(out.token[b]), bool(out.bonus[b])) == (
                alone.num_accepted,
                alone.token,
                alone.bonus,
            ), (seed, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_probability_only_blocks_finished_elsewhere_commit_what_whole_rows_commit(dtype):
    """p(x~) alone (p [M]) gives every block the acceptance, bonus and uniform that p's whole rows
    give; a rejected block is left pending (token -1) and `correct_rows` draws, from its p row and
    q row at the rejection and that uniform, the token `verify_rows` commits given the whole rows,
    bit for bit: all pending rows at once, each alone, in reverse order. A rule whose residual has
    zero mass (p == q at the rejection) falls back to q on both sides."""
    rules = [Lossless(), Lossy(alpha=0.3, beta=0.6), OvershootCeiling(0.5), Lossless(), Lossless()]
    lengths = [3, 1, 4, 2, 5]
    V2 = 4096  # (a vocabulary wide enough for summation order to matter, were it to)
    p = torch.cat([dist(80 + b, n, V2, scale=4.0) for b, n in enumerate(lengths)]).to(dtype)  # [M, V]
    q = torch.cat([dist(90 + b, n + 1, V2, scale=4.0) for b, n in enumerate(lengths)]).to(dtype)  # [M + B, V]
    q[-6:-1] = p[-5:]  # the last block: p == q, residual mass 0
    starts = [0, 3, 4, 8, 10]
    pending_seen = 0
    for seed in range(30):
        draft = torch.multinomial(p.double(), 1, generator=torch.Generator().manual_seed(seed))[:, 0]  # [M]
        gens = [torch.Generator().manual_seed(seed * 10 + b) for b in range(5)]
        whole = verify_rows(rules, p, q, draft, lengths, [False] * 5, gens)
        gens = [torch.Generator().manual_seed(seed * 10 + b) for b in range(5)]
        p_x = p.gather(-1, draft[:, None])[:, 0]  # [M]
        point = verify_rows(rules, p_x, q, draft, lengths, [False] * 5, gens)
        assert torch.equal(point.num_accepted, whole.num_accepted) and torch.equal(point.bonus, whole.bonus)
        assert torch.equal(point.u, whole.u) and bool((point.u > 0).all())
        assert torch.equal(point.token[whole.bonus], whole.token[whole.bonus])
        pending = (~whole.bonus).nonzero()[:, 0].tolist()
        assert point.token[pending].tolist() == [-1] * len(pending)
        if not pending:
            continue
        pending_seen += len(pending)
        q_start = [s + b for b, s in enumerate(starts)]
        p_rows = torch.stack([p[starts[b] + int(whole.num_accepted[b])] for b in pending])  # [N, V]
        q_rows = torch.stack([q[q_start[b] + int(whole.num_accepted[b])] for b in pending])  # [N, V]
        u, mine = point.u[pending], [rules[b] for b in pending]
        want = whole.token[pending]
        assert torch.equal(correct_rows(mine, p_rows, q_rows, u), want), seed
        order = list(range(len(pending)))[::-1]
        assert torch.equal(correct_rows([mine[i] for i in order], p_rows[order], q_rows[order], u[order]), want[order])
        for i in range(len(pending)):
            assert torch.equal(
                correct_rows(mine[i : i + 1], p_rows[i : i + 1], q_rows[i : i + 1], u[i : i + 1]), want[i : i + 1]
            )
    assert pending_seen > 30  # (the test exercised corrections)


def test_probability_only_blocks_are_sampled():
    with pytest.raises(AssertionError, match="sampled"):
        verify_rows([Lossless()], torch.tensor([1.0]), one_hot([1, 2]), torch.tensor([1]), [1], [True], [None])


def test_skip_verify_draws_consumes_exactly_what_verify_rows_draws():
    """A tensor-parallel follower handed rank 0's verdicts (skip_verify_draws) leaves every block's
    stream where verify_rows leaves it, a stream shared by neighbouring blocks included."""
    lengths = [3, 1, 4, 2]
    shared = torch.Generator().manual_seed(7)
    for seed in range(5):
        streams = [torch.Generator().manual_seed(seed * 10 + b) for b in range(3)]
        gens = [*streams, streams[-1]]  # (the last two blocks draw from one stream, as n > 1 samples can)
        twins = [torch.Generator().set_state(g.get_state()) for g in streams]
        p = torch.cat([dist(40 + b, n, V) for b, n in enumerate(lengths)])  # [M, V]
        q = torch.cat([dist(50 + b, n + 1, V) for b, n in enumerate(lengths)])  # [M + B, V]
        draft = torch.multinomial(p, 1, generator=shared)[:, 0]  # [M]
        verify_rows([Lossless()] * 4, p, q, draft, lengths, [False] * 4, gens)
        skip_verify_draws(lengths, [*twins, twins[-1]], "cpu")
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(streams, twins)), seed


def test_zero_mass_residual_falls_back_to_q():
    p = q_row = dist(61, V)
    q = torch.stack([q_row, q_row])  # p == q: always accepted, residual mass 0
    out = output_distribution(Lossless(), p, q_row)
    assert torch.allclose(out, q_row)
    got = verify(Lossless(), p[None], q, torch.tensor([3]), torch.Generator().manual_seed(0))
    assert got.num_accepted == 1 and got.bonus


# --- 4. greedy --------------------------------------------------------------------------------


def one_hot(ids: list[int]) -> torch.Tensor:
    return torch.eye(V)[ids]  # [len(ids), V]


@pytest.mark.parametrize(
    ("q_ids", "expect"),
    [
        ([4, 2, 6, 1], Verdict(3, 1, True)),  # every draft matches argmax q: bonus argmax q_T
        ([4, 2, 5, 1], Verdict(2, 5, False)),  # first mismatch at 2: commit argmax q_2
        ([0, 2, 6, 1], Verdict(0, 0, False)),
        ([4, 7, 6, 1], Verdict(1, 7, False)),
    ],
)
def test_greedy_accepts_the_matching_prefix_and_commits_argmax_q(q_ids, expect):
    """verify_greedy, from argmax q alone, agrees with every rule run on the one-hot distributions."""
    draft = [4, 2, 6]
    p, q = one_hot(draft), one_hot(q_ids)
    g = torch.Generator().manual_seed(123)
    state = g.get_state()
    assert verify(Lossless(), p, q, torch.tensor(draft), g, greedy=True) == expect
    # documented: a greedy block draws no u and samples nothing: the generator is untouched
    assert torch.equal(g.get_state(), state)
    assert verify(Lossless(), p, q, torch.tensor(draft), None) == expect  # sampled: the same, as a is 0 or 1
    for rule in (Lossy(alpha=0.4, beta=0.5), OvershootCeiling(0.3)):
        assert verify(rule, p, q, torch.tensor(draft), None, greedy=True) == expect
    fast = verify_greedy(torch.tensor(q_ids), torch.tensor(draft), [3])
    assert Verdict(int(fast.num_accepted[0]), int(fast.token[0]), bool(fast.bonus[0])) == expect


def test_non_greedy_verification_does_consume_randomness():
    p, q = dist(71, 2, V), dist(72, 3, V)
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    verify(Lossless(), p, q, torch.tensor([0, 1]), g)
    assert not torch.equal(g.get_state(), state)


# --- 5. the gate ------------------------------------------------------------------------------

# powers of two: every ratio below is exact in float32 and float64
Q_SLIM = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]])  # r = 1, .5, .25, .125, .125


def regions_of(q_slim: torch.Tensor, alpha1: float, alpha2: float, **kw) -> list[int]:
    vocab = q_slim.shape[-1]
    return gate(q_slim.expand(vocab, vocab), torch.arange(vocab), alpha1, alpha2, **kw).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gate_edges(dtype):
    q_slim = Q_SLIM.to(dtype)
    assert gate_ratio(q_slim.expand(5, 5), torch.arange(5)).tolist() == [1.0, 0.5, 0.25, 0.125, 0.125]
    # r exactly alpha1 -> A, exactly alpha2 -> B, below alpha2 -> C
    assert regions_of(q_slim, 0.5, 0.25) == [A, A, B, C, C]
    assert regions_of(q_slim, 0.5, 0.25, rewrite=False) == [A, A, C, C, C]


def test_gate_just_below_alpha2_escalates():
    below = torch.nextafter(torch.tensor(0.125, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    q_slim = torch.tensor([[0.5, 0.25, float(below), 0.125]], dtype=torch.float64)  # r(2) just below 0.25
    assert regions_of(q_slim, 0.5, 0.25) == [A, A, C, B]


def test_gate_ties_at_the_max_and_alpha_extremes():
    q_slim = torch.tensor([[0.375, 0.375, 0.25, 0.0]])  # two tokens tie at the max; one has r = 0
    assert gate_ratio(q_slim.expand(4, 4), torch.arange(4))[:2].tolist() == [1.0, 1.0]
    # alpha1 = 1 accepts exactly the argmax tokens (all of them on ties)
    assert regions_of(q_slim, 1.0, 0.5) == [A, A, B, C]
    # alpha2 = 0 never escalates, not even a token q' gives probability 0
    assert regions_of(q_slim, 0.7, 0.0) == [A, A, B, B]
    assert regions_of(q_slim, 0.7, 0.0, rewrite=False) == [A, A, C, C]
    rand = dist(81, 6, V).float()  # [6, V]
    draft = torch.arange(6)
    accepted = gate(rand, draft, 1.0, 0.3) == A
    assert torch.equal(accepted, rand[torch.arange(6), draft] == rand.amax(-1))


@pytest.mark.parametrize(
    ("alpha1", "alpha2", "field"),
    [
        (1.5, 0.3, "alpha1"),
        (0.0, 0.0, "alpha1"),
        (math.nan, 0.3, "alpha1"),
        (0.5, -0.1, "alpha2"),
        (0.5, 0.5, "alpha2"),
        (0.3, 0.5, "alpha2"),
        (0.5, math.nan, "alpha2"),
    ],
)
def test_invalid_thresholds_name_the_field(alpha1, alpha2, field):
    with pytest.raises(InvalidParameterError) as err:
        gate(Q_SLIM, torch.tensor([0]), alpha1, alpha2)
    assert err.value.field == field


def test_gate_rows_equals_each_block_alone():
    g = torch.Generator().manual_seed(6)
    lengths = [3, 1, 4, 2]
    probs = torch.softmax(2 * torch.randn(sum(lengths), V, generator=g, dtype=torch.float64), -1)
    draft = torch.randint(0, V, (sum(lengths),), generator=g)
    alpha1, alpha2, rewrite = [0.9, 0.5, 0.7, 0.3], [0.4, 0.1, 0.2, 0.05], [True, False, True, True]
    out = gate_rows(gate_ratio(probs, draft), lengths, alpha1, alpha2, rewrite).tolist()
    start = 0
    for b, n in enumerate(lengths):
        regions = gate(probs[start : start + n], draft[start : start + n], alpha1[b], alpha2[b], rewrite=rewrite[b])
        i = int(leading(regions == A, [n])[0])
        assert out[b] == [i, A if i == n else int(regions[i])], b
        start += n
    # every position accepted: i = T and region ACCEPT
    top = probs.argmax(-1)
    assert gate_rows(gate_ratio(probs, top), lengths, alpha1, alpha2, rewrite).tolist() == [[n, A] for n in lengths]


def test_leading_counts_each_rows_run_of_true():
    flags = torch.tensor([True, True, False, True, False, True, True, True, True])  # rows of 4, 2, 3
    assert leading(flags, [4, 2, 3]).tolist() == [2, 0, 3]
    assert leading(flags, [4, 0, 5]).tolist() == [2, 0, 0]
    assert leading(torch.tensor([], dtype=torch.bool), [0, 0]).tolist() == [0, 0]


@st.composite
def gate_case(draw):
    t = draw(st.integers(1, 6))
    vocab = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logits = draw(st.sampled_from([0.5, 3.0, 10.0])) * torch.randn(t, vocab, generator=g)  # [T, V]
    if draw(st.booleans()):  # exact ties and zeros
        logits = logits.round().masked_fill(logits < -1, float("-inf"))
        logits[:, 0] = logits[:, 0].clamp(min=0)
    q_slim = torch.softmax(logits, -1)  # [T, V]
    draft = torch.randint(0, vocab, (t,), generator=g)  # [T]
    return q_slim, draft


alphas = st.floats(0.0, 1.0, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(case=gate_case(), a=alphas, b=alphas, c=alphas, rewrite=st.booleans())
def test_gate_properties(case, a, b, c, rewrite):
    q_slim, draft = case
    lo, mid, hi = sorted([a, b, c])
    assume(mid < hi and hi > 0)
    r = gate_ratio(q_slim, draft)
    assert bool(((r >= 0) & (r <= 1)).all())
    regions = gate(q_slim, draft, hi, mid, rewrite=rewrite)
    # a partition, consistent with the thresholds
    assert set(regions.tolist()) <= {A, B, C}
    assert torch.equal(regions == A, r >= hi)
    assert torch.equal(regions == C, r < mid if rewrite else r < hi)
    assert torch.equal(regions == B, (r >= mid) & (r < hi) if rewrite else torch.zeros_like(r, dtype=torch.bool))
    # the argmax token is always accepted
    top = q_slim.argmax(-1)
    assert bool((gate(q_slim, top, hi, mid, rewrite=rewrite) == A).all())
    # raising alpha2 (lo -> mid) never reduces escalations
    assert bool(((gate(q_slim, draft, hi, lo) == C) <= (gate(q_slim, draft, hi, mid) == C)).all())
    # raising alpha1 (mid -> hi) never adds accepts
    if lo < mid:
        assert bool(((gate(q_slim, draft, hi, lo) == A) <= (gate(q_slim, draft, mid, lo) == A)).all())
    # pre-check keeps region A and escalates the rest
    assert torch.equal(gate(q_slim, draft, hi, mid, rewrite=False) == A, gate(q_slim, draft, hi, mid) == A)


# --- 6. the three-tier mixture ----------------------------------------------------------------


def simulate_one_position(p, q_slim, q, alpha1, alpha2, rewrite, seed, n=N):
    """Monte Carlo of the engine at one position: v ~ p; A keeps v, B draws from q', C verifies v against q."""
    g = torch.Generator().manual_seed(seed)
    v = torch.multinomial(p, n, replacement=True, generator=g)  # [n]
    regions = gate(q_slim.expand(n, -1), v, alpha1, alpha2, rewrite=rewrite)  # [n]
    rewritten = torch.multinomial(q_slim, n, replacement=True, generator=g)  # [n]
    out = verify_batch(Lossless(), p.expand(n, 1, -1), torch.stack([q, q]).expand(n, 2, -1), v[:, None], g)
    escalated = torch.where(out.num_accepted == 1, v, out.token)  # [n]
    return torch.where(regions == A, v, torch.where(regions == B, rewritten, escalated))


@pytest.mark.parametrize("rewrite", [True, False])
def test_three_tier_mixture_matches_a_simulation(rewrite):
    p, q = dist(901, V, scale=2.0), dist(903, V, scale=2.0)
    # r = 1, .8, .6 (A), .4, .35 (B), .2, .1, .05 (C), shuffled over the ids
    ratios = torch.tensor([0.4, 1.0, 0.05, 0.6, 0.2, 0.35, 0.8, 0.1], dtype=torch.float64)
    q_slim = ratios / ratios.sum()
    alpha1, alpha2 = 0.5, 0.3
    regions = torch.tensor(regions_of(q_slim[None], alpha1, alpha2))
    for region in (A, B, C):  # all three regions carry real draft mass on this case
        assert p[regions == region].sum() > 0.05
    law = three_tier_mixture(p, q_slim, q, alpha1, alpha2, rewrite=rewrite)
    assert torch.isclose(law.sum(), torch.tensor(1.0, dtype=torch.float64))
    tokens = simulate_one_position(p, q_slim, q, alpha1, alpha2, rewrite, seed=7)
    assert pvalue(tokens, law) > 1e-3
    # the paper's idealised mixture (B.7) delta_p p + delta1_bar q' + delta2 q is not what the engine does
    in_b = (regions == B) if rewrite else torch.zeros(V, dtype=torch.bool)
    in_c = (regions == C) | ((regions == B) & (not rewrite))
    paper = p[regions == A].sum() * p + p[in_b].sum() * q_slim + p[in_c].sum() * q
    assert pvalue(tokens, paper) < 1e-6


def test_three_tier_mixture_special_cases():
    p, q = dist(911, V), dist(912, V)
    uniform = torch.full((V,), 1.0 / V, dtype=torch.float64)
    # q' uniform: r = 1 everywhere, every draft is accepted -> pi = p
    assert torch.allclose(three_tier_mixture(p, uniform, q, 0.5, 0.3), p)
    # q' sure of token 0 (r = 0.01 / 0.93 < alpha2 elsewhere): token 0 is accepted, every other
    # draft escalates: pi = 1[A] p + 1[C] min(p, q) + (sum_C max(0, p - q)) norm(max(0, q - p))
    peaked = torch.tensor([0.93] + [0.01] * (V - 1), dtype=torch.float64)
    pi = three_tier_mixture(p, peaked, q, 0.5, 0.3)
    in_c = torch.ones(V, dtype=torch.bool)
    in_c[0] = False
    expected = torch.where(in_c, torch.minimum(p, q), p)
    rejected = (p - q).clamp(min=0)[in_c].sum()
    residual = (q - p).clamp(min=0)
    expected = expected + rejected * residual / residual.sum()
    assert torch.allclose(pi, expected)
    # q == p and no rewrite: accepted or losslessly escalated, every draft stands -> pi = p
    assert torch.allclose(three_tier_mixture(p, q, p, 0.5, 0.3, rewrite=False), p)
    # ... but a rewrite replaces the B drafts by q': pi = p on A and C, P_B q' elsewhere
    regions = torch.tensor(regions_of(q[None], 0.5, 0.3))
    in_b = regions == B
    assert in_b.any()
    expected = torch.where(in_b, torch.zeros_like(p), p) + p[in_b].sum() * q
    assert torch.allclose(three_tier_mixture(p, q, p, 0.5, 0.3), expected)
