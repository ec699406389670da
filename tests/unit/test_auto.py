"""`mode: auto` (viasd.planner over viasd.costs): the plan each step is the one with the most
expected tokens per second, and lossless plans keep the output exact.

* greedy `auto` equals greedy `ar` token for token (float64), whatever the cost curves make it
  choose (sd with several k, n-gram drafts, plain ar), alone and batched beside fixed modes;
* sampled `auto` follows q (chi-square on the first committed token), the drafter's law is rejected;
* `auto` runs `via` only when the request allows a lossy plan;
* the planner: no speculation when it cannot pay, longer blocks as acceptance rises, shorter
  blocks when the batch makes the verifier's forward expensive; the profiled cost model.
"""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from viasd.config import parse_params
from viasd.costs import Acceptance, CostModel, StepTimes, monotone, profile
from viasd.engine import Engine
from viasd.errors import InvalidParameterError
from viasd.metrics import RequestStats
from viasd.planner import (
    MARGIN_DECAY,
    MARGIN_FLOOR,
    MARGIN_PRIOR_STEPS,
    PAYBACK_CYCLES,
    PROBE_EVERY,
    SPECULATE_MARGIN,
    Estimates,
    Plan,
    Planner,
    RowState,
    _Step,
    choose,
    drafts_from_the_start,
    expected_tokens,
    goodput,
    logit_rows,
    step_seconds,
)
from viasd.runtime import LayerMask

PROMPTS = [[5, 17, 3, 88, 41, 9], [33, 34, 35, 33, 34, 35, 33, 34, 35, 33], [1, 2, 3]]

# full forward dear and flat in tokens, drafter cheap: speculation pays
SPECULATE = CostModel({"full": [(1, 1.0), (64, 1.3)], "slim": [(1, 0.5), (64, 0.7)], "drafter": [(1, 0.05), (64, 0.6)]})
# every forward linear in tokens and the drafter as dear as the verifier: it never pays
NEVER = CostModel({"full": [(1, 1.0), (64, 64.0)], "slim": [(1, 0.6), (64, 38.0)], "drafter": [(1, 1.0), (64, 64.0)]})
# the drafter dear, the verifier flat: only the free n-gram drafts pay
NGRAM = CostModel({"full": [(1, 1.0), (64, 1.3)], "slim": [(1, 0.6), (64, 0.8)], "drafter": [(1, 5.0), (64, 300.0)]})


def _engine(pair, costs, **kw):
    verifier, drafter = pair
    return Engine(verifier, drafter, mask=LayerMask.from_skipped((1, 3), verifier.num_layers), costs=costs, **kw)


@pytest.mark.parametrize(
    "costs, expect", [(SPECULATE, "sd"), (NEVER, "ar"), (NGRAM, "ngram")], ids=["speculate", "never", "ngram"]
)
def test_greedy_auto_equals_greedy_ar(tiny_pair, costs, expect):
    engine = _engine(tiny_pair, costs)
    kinds = set()
    for prompt in PROMPTS:
        ar = engine.complete(prompt, parse_params(mode="ar", max_tokens=40)).token_ids
        auto = engine.complete(prompt, parse_params(mode="auto", max_tokens=40))
        assert auto.token_ids == ar
        kinds |= {label.split(":")[0] for label in auto.stats.plans}
        assert sum(auto.stats.plans.values()) == auto.stats.num_drafts + auto.stats.plans.get("ar", 0)
    assert expect in kinds
    if expect == "ar":
        assert kinds == {"ar"}


@pytest.mark.parametrize("costs", [SPECULATE, NEVER], ids=["speculate", "never"])
def test_auto_samples_copy_a_lazy_drafter_lazily(tiny_pair, costs):
    # n > 1: the samples copy sample 0's prefill, whose drafter an `auto` request leaves unfed
    engine = _engine(tiny_pair, costs)
    ar = engine.complete(PROMPTS[1], parse_params(mode="ar", max_tokens=20)).token_ids
    samples = engine.complete_n(PROMPTS[1], parse_params(mode="auto", max_tokens=20, n=3))
    assert [s.token_ids for s in samples] == [ar] * 3


def test_auto_batched_beside_fixed_modes_equals_ar(tiny_pair):
    engine = _engine(tiny_pair, SPECULATE, max_batch=6)
    alone = {
        i: _engine(tiny_pair, SPECULATE).complete(p, parse_params(mode="ar", max_tokens=30)).token_ids
        for i, p in enumerate(PROMPTS)
    }
    handles = {engine.submit(p, parse_params(mode="auto", max_tokens=30)): i for i, p in enumerate(PROMPTS)}
    others = [
        engine.submit(p, parse_params(mode=m, max_tokens=30, temperature=1.0, seed=3))
        for p in PROMPTS
        for m in ("via", "sd")
    ]
    while engine.scheduler.has_work():
        engine.step()
    for h, i in handles.items():
        assert sum((c.token_ids for c in h.chunks), []) == alone[i]
    assert all(h.chunks[-1].finished for h in others)


def test_sampled_auto_follows_q(tiny_pair):
    verifier, drafter = tiny_pair
    engine = _engine(tiny_pair, SPECULATE, max_batch=16)
    # two tokens: a draft block can pay (one token could not: it commits no more than `ar`); a
    # short prompt: the lazy drafter catches up within its first round, at no planned cost
    n, prompt = 3000, PROMPTS[0][:5]
    handles = [
        engine.submit(prompt, parse_params(mode="auto", max_tokens=2, gamma=2, temperature=1.0, seed=s))
        for s in range(n)
    ]
    while engine.scheduler.has_work():
        engine.step()
    assert sum(h.stats.plans.get("sd:k=1", 0) + h.stats.plans.get("sd:k=2", 0) for h in handles) > n // 2
    firsts = torch.tensor([h.chunks[0].token_ids[0] for h in handles])
    counts = torch.bincount(firsts, minlength=verifier.vocab_size).double()

    def pvalue(law):
        expected = law * n
        big = expected >= 5
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)

    q = torch.softmax(verifier.forward(torch.tensor(prompt), 0)[-1], -1)
    p = torch.softmax(drafter.forward(torch.tensor(prompt), 0)[-1], -1)
    assert pvalue(q) > 1e-3 and pvalue(p) < 1e-6


def test_auto_runs_via_only_when_lossy_plans_are_allowed(tiny_pair):
    # the slim verifier nearly free, q linear in its tokens, via cycles known to escalate rarely:
    # via is the best plan when allowed, sd never beats ar
    cheap_slim = CostModel(
        {"full": [(1, 1.0), (64, 64.0)], "slim": [(1, 0.01), (64, 0.02)], "drafter": [(1, 0.05), (64, 0.6)]}
    )
    engine = _engine(tiny_pair, cheap_slim)
    engine.scheduler.estimates.via_tokens, engine.scheduler.estimates.via_escalation = 3.0, 0.1
    lossless = engine.complete(PROMPTS[0], parse_params(mode="auto", max_tokens=30))
    lossy = engine.complete(PROMPTS[0], parse_params(mode="auto", max_tokens=30, auto_lossy=True))
    assert not any(k.startswith("via") for k in lossless.stats.plans) and lossless.stats.forwards["slim"] == 0
    assert any(k.startswith("via") for k in lossy.stats.plans) and lossy.stats.forwards["slim"] > 0


def test_auto_without_a_drafter_uses_ngram_or_ar(tiny_pair):
    verifier, _ = tiny_pair
    engine = Engine(verifier, None, costs=NGRAM)
    ar = engine.complete(PROMPTS[1], parse_params(mode="ar", max_tokens=30)).token_ids
    auto = engine.complete(PROMPTS[1], parse_params(mode="auto", max_tokens=30))
    assert auto.token_ids == ar and set(k.split(":")[0] for k in auto.stats.plans) <= {"ar", "ngram"}


def test_auto_refuses_overlap_and_adaptive_gamma():
    for extra in (dict(overlap=True), dict(adaptive_gamma=True)):
        with pytest.raises(InvalidParameterError) as info:
            parse_params(mode="auto", **extra)
        assert info.value.field == "mode"


# ------------------------------------------------------------------ the planner


def _row(rate: float, gamma: int = 5, evidence: float = 5.0, **kw) -> RowState:
    """An `auto` row whose drafter acceptance is `rate` a position, on `evidence` observations
    (running_mean's weight; 5 is its steady state, the prior counts 1)."""
    acc = Acceptance()
    acc.rates["model"], acc.weights["model"] = [rate] * 8, [evidence] * 8
    return RowState(fixed=None, gamma=gamma, acceptance=acc, **kw)


def test_planner_speculates_only_when_it_pays():
    assert choose(NEVER, [_row(0.9)]) == [Plan("ar")]
    assert choose(SPECULATE, [_row(0.9)])[0].kind == "sd"
    assert choose(SPECULATE, [_row(0.0)]) == [Plan("ar")]  # nothing is ever accepted


def test_acceptance_of_positions_never_reached_follows_the_deepest_reached():
    acc = Acceptance()
    acc.update("model", drafted=1, accepted=1)  # a k = 1 block, accepted: says nothing of position 1 ...
    assert acc.rates["model"][0] == pytest.approx(1.48 / 1.8) and acc.rates["model"][1:] == [acc.rates["model"][0]] * 7
    # a measured bf16 CPU curve: a drafter round is 40% of a verifier forward
    cpu = CostModel(
        {
            "full": [(1, 0.080), (8, 0.097), (64, 0.242)],
            "slim": [(1, 0.050), (64, 0.136)],
            "drafter": [(1, 0.032), (8, 0.036), (64, 0.083)],
        }
    )
    assert choose(cpu, [RowState(fixed=None, gamma=5, acceptance=Acceptance())]) == [Plan("sd", 1)]  # the prior
    for _ in range(20):  # ... so that k = 1 blocks that keep being accepted make longer blocks worth planning
        acc.update("model", drafted=1, accepted=1)
    assert choose(cpu, [RowState(fixed=None, gamma=5, acceptance=acc)]) == [Plan("sd", 5)]
    acc.update("model", drafted=5, accepted=1)  # positions 0 and 1 reached, 1 rejected; 2.. still follow 1
    deep = acc.rates["model"]
    assert deep[1] < deep[0] and deep[2:] == [deep[1]] * 6 and acc.depth["model"] == 2
    assert Acceptance(acc).rates == acc.rates and Acceptance(acc).depth == acc.depth  # a request's prior


def test_acceptance_weighs_the_prior_as_one_aging_observation():
    """running_mean: the prior counts as PRIOR_WEIGHT observations that age with the rest, so the
    first blocks move an estimate as far as their evidence says (a plain EMA from the prior would
    still read 0.80 after three accepted blocks); in steady state each new block weighs 1 - DECAY."""
    acc = Acceptance()
    for _ in range(3):
        acc.update("model", drafted=2, accepted=2)
    hits = sum(Acceptance.DECAY**i for i in range(3))  # the three blocks' weights, the newest 1
    prior = Acceptance.PRIOR_WEIGHT * Acceptance.DECAY**3
    assert acc.rates["model"][0] == pytest.approx((prior * 0.6 + hits) / (prior + hits)) and acc.rates["model"][0] > 0.9
    for _ in range(60):
        acc.update("model", drafted=1, accepted=1)
    before = acc.rates["model"][0]
    acc.update("model", drafted=1, accepted=0)  # a miss after many hits: as an EMA with decay 0.8
    assert acc.rates["model"][0] == pytest.approx(Acceptance.DECAY * before, rel=1e-3)
    est = Estimates()
    est.learn(Plan("via", 4), drafted=4, accepted=4, committed=5, escalated=False)
    assert est.via_tokens == pytest.approx((0.8 * 2.0 + 5) / 1.8) and est.via_escalation == pytest.approx(0.4 / 1.8)


def test_planner_block_length_grows_with_acceptance():
    ks = [choose(SPECULATE, [_row(rate)])[0].k for rate in (0.3, 0.6, 0.95)]
    assert ks == sorted(ks) and ks[-1] == 5 and ks[0] < ks[-1]


def test_planner_shortens_blocks_when_the_batch_makes_verification_dear():
    # the full forward's cost grows with its tokens: 16 rows of 6 tokens cost far more than 16 of 2
    linear_full = CostModel(
        {
            "full": [(1, 1.0), (16, 1.2), (96, 12.0)],
            "slim": [(1, 0.5), (96, 6.0)],
            "drafter": [(1, 0.05), (16, 0.1), (96, 1.0)],
        }
    )
    alone = choose(linear_full, [_row(0.7)])[0].k
    batch = choose(linear_full, [_row(0.7) for _ in range(16)])
    assert max(p.k for p in batch) < alone
    assert goodput(linear_full, [_row(0.7)] * 16, batch) >= goodput(
        linear_full, [_row(0.7)] * 16, [Plan("sd", alone)] * 16
    )


def test_cost_model_interpolates_and_profiles(tiny_pair, tmp_path):
    m = CostModel({"full": [(1, 1.0), (3, 2.0), (5, 6.0)]})  # one row at 1, 3 and 5 tokens
    assert m.seconds("full", 0, 1) == 0.0 and m.seconds("full", 1, 0) == 0.0
    assert m.seconds("full", 1, 2) == pytest.approx(1.5) and m.seconds("full", 1, 4) == pytest.approx(4.0)
    assert m.seconds("full", 1, 7) == pytest.approx(10.0)  # extrapolated from the last two points
    assert m.seconds("full", 2, 2) == m.seconds("full", 1, 4)  # no batch profiled: rows cost as their tokens
    assert m.seconds("full", 0.25, 3) == pytest.approx(0.25 * 2.0)  # a row that runs a quarter of the time
    verifier, drafter = tiny_pair
    mask = LayerMask.from_skipped((1, 3), verifier.num_layers)
    grid = ((1, 1), (1, 2), (1, 4), (2, 2))
    prof = profile(verifier, drafter, mask, grid=grid, repeats=1, cache_dir=tmp_path)
    assert set(prof.grid) == {"full", "slim", "drafter"}
    assert all([p[:2] for p in v] == sorted(grid) for v in prof.grid.values())
    assert all(s > 0 for v in prof.grid.values() for *_, s in v) and prof.profile_seconds > 0
    assert all(monotone(v) == v for v in prof.grid.values())
    # noise only adds time: a point dearer than one carrying as many rows and tokens or more is cut to it
    noisy = [(1, 1, 1.0), (1, 4, 1.2), (1, 8, 7.1), (1, 16, 3.2), (4, 1, 2.5), (4, 4, 1.1)]
    assert monotone(noisy) == [(1, 1, 1.0), (1, 4, 1.1), (1, 8, 3.2), (1, 16, 3.2), (4, 1, 1.1), (4, 4, 1.1)]
    again = profile(verifier, drafter, mask, grid=grid, repeats=1, cache_dir=tmp_path)
    assert again.grid == prof.grid and again.profile_seconds == prof.profile_seconds  # read from the cache
    other = profile(
        verifier,
        drafter,
        LayerMask.from_skipped((2,), verifier.num_layers),
        grid=grid,
        repeats=1,
        cache_dir=tmp_path,
    )
    assert len(list(tmp_path.glob("costs-*.json"))) == 2 and other.key["tiers"]["slim"]["skipped"] == [2]


def test_a_cost_profile_is_not_shared_by_cpus_with_and_without_native_bf16(tiny_pair, tmp_path, monkeypatch):
    """AVX-512 CPUs report the same capability with and without AVX-512 BF16, and their bf16
    forwards cost several times apart: a profile cache shared by both kinds (a volume mounted on
    every node) keys them apart, so each measures its own curve."""
    import viasd.precision

    verifier, drafter = tiny_pair
    mask = LayerMask.from_skipped((1, 3), verifier.num_layers)
    grid = ((1, 1), (1, 2))
    profiles = {}
    for native in (True, False, True):
        monkeypatch.setattr(viasd.precision, "native_bf16", lambda native=native: native)
        profiles[native] = profile(verifier, drafter, mask, grid=grid, repeats=1, cache_dir=tmp_path)
        assert profiles[native].key["native_bf16"] is native
    assert len(list(tmp_path.glob("costs-*.json"))) == 2  # the third read the first's file


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_a_cost_profile_is_not_shared_by_models_with_other_linear_kernels(tmp_path):
    """The same weights with packed linears cost other seconds than with plain ones (and mixed
    bf16 ones other again): the profile's key names each tier's kernels, so a profile measured
    with one set is not read for another."""
    import copy

    from conftest import tiny_model

    from viasd.precision import linear_kernels, optimize_linears
    from viasd.runtime import MaskedLM

    plain = tiny_model("llama", dtype=torch.float32).eval()
    packed = copy.deepcopy(plain)
    optimize_linears(packed, torch.float32, "cpu")
    mask = LayerMask.from_skipped((1,), plain.config.num_hidden_layers)
    grid = ((1, 1), (1, 2))
    keys = []
    for model in (plain, packed, plain):
        prof = profile(MaskedLM(model), None, mask, grid=grid, repeats=1, cache_dir=tmp_path)
        keys.append(prof.key["tiers"]["full"]["linears"])
    assert keys[0] == {"plain": len([m for m in plain.modules() if type(m) is torch.nn.Linear])} == keys[2]
    assert keys[1] == linear_kernels(packed) and set(keys[1]) == {"packed"}
    assert len(list(tmp_path.glob("costs-*.json"))) == 2  # the third read the first's file


def test_cost_grid_prices_rows_beyond_their_tokens():
    """grid(B, T) = one(B * T) * rho(B, T) (viasd.costs): rows cost more than their tokens in one
    row where the profile says so (the bf16 profile in docs/BENCHMARKS.md: four 1-token rows 1.33x
    one row of four), and a batch of rows dearer than its tokens makes a verified block relatively
    cheaper than `ar`'s step, so the planner drafts longer."""
    one = [(1, 1.0), (4, 1.06), (8, 1.25), (16, 1.6), (32, 2.4), (64, 4.0)]
    batches = [(4, 1, 1.30), (4, 4, 1.45), (16, 1, 1.9), (16, 4, 3.9)]
    flat = CostModel({"full": one, "slim": one, "drafter": [(1, 0.25), (64, 1.0)]})
    rows = CostModel({"full": one + batches, "slim": one, "drafter": [(1, 0.25), (64, 1.0)]})
    assert flat.seconds("full", 4, 1) == pytest.approx(1.06) and rows.seconds("full", 4, 1) == pytest.approx(1.30)
    assert rows.seconds("full", 16, 4) == pytest.approx(3.9) and rows.seconds("full", 1, 8) == pytest.approx(1.25)
    rho4, rho16 = 1.30 / 1.06, 1.9 / 1.6  # at one token a row; between batches: linear in the rows
    assert rows.seconds("full", 8, 1) == pytest.approx(1.25 * (rho4 + (rho16 - rho4) * 4 / 12))
    assert rows.seconds("full", 2, 1) == pytest.approx(1.02 * (1 + (rho4 - 1) / 3))  # from 1 at one row
    assert rows.seconds("full", 32, 1) == pytest.approx(2.4 * rho16)  # beyond the largest batch: its ratio
    assert rows.seconds("full", 4, 8) == pytest.approx(2.4 * 1.45 / 1.6)  # beyond a batch's tokens: its last
    assert rows.seconds("full", 4, 2) == pytest.approx(1.25 * (rho4 + (1.45 / 1.6 - rho4) / 3))
    i = rows._bucket("full", 4, 1)  # what a 4-row step teaches moves its own grid point
    assert rows.grid["full"][i][:2] == (4, 1) and flat.grid["full"][flat._bucket("full", 4, 1)][:2] == (1, 4)
    four = [_row(0.65) for _ in range(4)]
    assert [p.label for p in choose(flat, four)] == ["sd:k=1"] * 4
    assert [p.label for p in choose(rows, four)] == ["sd:k=2"] * 4
    with pytest.raises(ValueError, match="two 1-row points"):
        CostModel({"full": [(1, 1, 1.0), (4, 1, 2.0)]})


def test_a_batch_speculates_only_for_a_gain_beyond_the_cost_models_error():
    """SPECULATE_MARGIN: plans expected 7% above every row on `ar` are a bet on the cost model's
    error (at 8 rows in bf16 one was lost: `sd` measured 4% below `ar`), so the batch runs `ar`
    and a new row does not prefill its drafter; 27% above, it speculates."""
    one = [(1, 1.0), (4, 1.06), (8, 1.25), (16, 1.6), (32, 2.4), (64, 4.0)]
    flat = CostModel({"full": one, "slim": one, "drafter": [(1, 0.25), (64, 1.0)]})
    thin, clear = [_row(0.6) for _ in range(4)], [_row(0.8) for _ in range(4)]
    ar = [Plan("ar")] * 4
    assert choose(flat, thin) == ar and not drafts_from_the_start(flat, thin[:3], thin[3])
    assert [p.label for p in choose(flat, clear)] == ["sd:k=2"] * 4 and drafts_from_the_start(flat, clear[:3], clear[3])
    plans = choose(flat, thin, margin=1.0)  # without the margin: the thin bet
    assert [p.label for p in plans] == ["sd:k=1"] * 4
    assert 1.0 < goodput(flat, thin, plans) / goodput(flat, thin, ar) < 1.1


def test_step_cost_counts_padding_catch_up_and_overhead():
    flat = CostModel({"full": [(1, 1.0), (64, 64.0)], "slim": [(1, 1.0), (64, 64.0)], "drafter": [(1, 0.1), (64, 6.4)]})
    rows = [_row(0.5), _row(0.5)]
    # a batch is right-padded: one row of 6 tokens and one of 2 cost as 2 x 6 in the full forward
    mixed = step_seconds(flat, rows, [Plan("sd", 5), Plan("sd", 1)])
    drafting = flat.seconds("drafter", 2, 2) + 4 * flat.seconds("drafter", 1, 1)  # round 0 feeds 2 tokens a row
    assert mixed == pytest.approx(drafting + flat.seconds("full", 2, 6))
    # a lagging drafter pays for its catch-up, spread over the cycles the row has left
    lag = _row(0.5, draft_lag=20, remaining=10)
    cycles = 10 / expected_tokens(lag, Plan("sd", 2))
    assert step_seconds(flat, [lag], [Plan("sd", 2)]) == pytest.approx(
        step_seconds(flat, [_row(0.5)], [Plan("sd", 2)]) + flat.seconds("drafter", 1, 20) / cycles
    )
    assert step_seconds(flat, [lag], [Plan("ar")]) == flat.seconds("full", 1, 1)  # `ar` never catches up
    long = _row(0.5, draft_lag=20, remaining=1000)  # a long request: the catch-up must pay back within 16 cycles
    assert step_seconds(flat, [long], [Plan("sd", 2)]) == pytest.approx(
        step_seconds(flat, [_row(0.5)], [Plan("sd", 2)]) + flat.seconds("drafter", 1, 20) / PAYBACK_CYCLES
    )
    # per logit row and plan kind: sd judges 2 drafter rounds + a block of 3 positions, ar 1 each
    flat.overhead = {"sd": 0.25, "ar": 0.01}
    assert step_seconds(flat, [_row(0.5)], [Plan("sd", 2)]) == pytest.approx(
        flat.seconds("drafter", 1, 2) + flat.seconds("drafter", 1, 1) + flat.seconds("full", 1, 3) + 5 * 0.25
    )
    assert step_seconds(flat, [_row(0.5)] * 2, [Plan("ar")] * 2) == pytest.approx(flat.seconds("full", 2, 1) + 0.02)
    # a kind never observed takes the mean of the others (n-gram: a block of 3, no drafter rounds)
    assert step_seconds(flat, [_row(0.5)], [Plan("ngram", 2)]) == pytest.approx(flat.seconds("full", 1, 3) + 3 * 0.13)
    via = _row(0.5, via_escalation=0.5)  # the slim block, and q's half the time
    assert logit_rows(Plan("via", 2), via.via_escalation) == 2 + 3 * 1.5 and logit_rows(Plan("ar")) == 1


def test_planner_moves_rows_between_plans_at_the_cost_of_a_fresh_count():
    """choose moves one row at a time on running sums (planner._Step); after any sequence of
    moves they must price the batch exactly as counting it afresh does."""
    rng = random.Random(0)
    costs = CostModel(
        {"full": [(1, 1.0), (8, 1.5), (64, 9.0)], "slim": [(1, 0.5), (64, 5.0)], "drafter": [(1, 0.1), (64, 2.0)]},
        overhead={"ar": 0.01, "sd": 0.02, "via": 0.03},
    )
    rows = [
        _row(
            0.7, gamma=4, lossy=True, ngram_match=2, via_escalation=rng.choice((0.0, 0.4)), draft_lag=rng.choice((0, 9))
        )
        for _ in range(6)
    ]
    plans = [Plan("ar")] * len(rows)
    step, seen = _Step(costs, rows, plans), set()
    for _ in range(200):
        i = rng.randrange(len(rows))
        new = rng.choice(rows[i].candidates())
        step.add(rows[i], plans[i], -1)
        step.add(rows[i], new)
        plans[i] = new
        seen |= {(p.kind, r.draft_lag > 0) for r, p in zip(rows, plans)}
        assert step.seconds() == pytest.approx(step_seconds(costs, rows, plans), rel=1e-12)
        assert step.goodput() == pytest.approx(goodput(costs, rows, plans), rel=1e-12)
    assert seen == {(kind, lag) for kind in ("ar", "sd", "via", "ngram") for lag in (False, True)}


def test_served_calls_are_priced_per_call_and_the_propose_only_when_a_row_drafts():
    """transport (viasd.costs): a served step's Verify costs its round trip beyond the
    verifier's own seconds whatever it carries; its Propose only when a row drafts. A dear
    Propose turns a plan that speculated in-process into `ar`."""
    costs = CostModel(dict(SPECULATE.grid), online=True)
    rows = [_row(0.9), _row(0.9)]
    ar, sd = [Plan("ar")] * 2, [Plan("sd", 3), Plan("ar")]
    in_process = {"ar": step_seconds(costs, rows, ar), "sd": step_seconds(costs, rows, sd)}
    assert choose(costs, rows)[0].kind == "sd"
    for _ in range(40):
        costs.observe_transport("verify", 0.05)
        costs.observe_transport("propose", 20.0)
    assert costs.transport == pytest.approx({"verify": 0.05, "propose": 20.0})
    assert step_seconds(costs, rows, ar) == pytest.approx(in_process["ar"] + 0.05)
    assert step_seconds(costs, rows, sd) == pytest.approx(in_process["sd"] + 20.05)
    assert choose(costs, rows) == ar
    assert costs.summary()["transport_seconds"] == {"verify": 0.05, "propose": 20.0}
    offline = CostModel(dict(SPECULATE.grid))
    offline.observe_transport("propose", 1.0)  # a profile that does not learn keeps its prices
    assert offline.transport == {}


def test_planner_never_expects_more_tokens_than_the_request_may_produce():
    assert expected_tokens(_row(1.0, remaining=2), Plan("sd", 5)) == 2
    assert choose(SPECULATE, [_row(0.9, remaining=1)]) == [Plan("ar")]  # one token left: nothing to gain


def test_online_cost_model_learns_from_the_forwards_it_sees():
    grid = {"full": [(1, 1.0), (16, 2.0), (64, 8.0)]}
    fixed, slow, shape = CostModel(dict(grid)), CostModel(dict(grid), online=True), CostModel(dict(grid), online=True)
    for _ in range(200):
        for m in (fixed, slow):
            m.observe("full", 1, 1, 3.0)  # the whole machine 3x slower than when profiled ...
            m.observe("full", 1, 16, 6.0)
            m.observe_overhead("sd", 0.5, 10)
        shape.observe("full", 1, 1, 1.0)  # ... or only one size dearer than the profile
        shape.observe("full", 1, 16, 6.0)
    assert fixed.seconds("full", 1, 16) == 2.0 and fixed.overhead == {}  # an explicit model stays as given
    assert slow.seconds("full", 1, 1) == pytest.approx(3.0, rel=0.02)
    assert slow.seconds("full", 1, 16) == pytest.approx(6.0, rel=0.02)
    assert slow.seconds("full", 1, 64) == pytest.approx(24.0, rel=0.1)  # never observed: the profile's shape, scaled
    assert shape.seconds("full", 1, 1) == pytest.approx(1.0, rel=0.05)
    assert shape.seconds("full", 1, 16) == pytest.approx(6.0, rel=0.05)
    assert slow.overhead["sd"] == pytest.approx(0.05, rel=0.01) and slow.summary()["observed"] == 400


def test_a_price_is_memoised_until_the_next_observed_forward(monkeypatch):
    # the planner prices the same sizes hundreds of times a step: computed once, until a forward is observed
    costs, computed = CostModel({"full": [(1, 1.0), (16, 2.0)]}, online=True), []
    profiled = costs._seconds
    monkeypatch.setattr(costs, "_seconds", lambda *size: computed.append(size) or profiled(*size))
    assert costs.seconds("full", 2, 3) == costs.seconds("full", 2, 3) and len(computed) == 1
    costs.observe("full", 2, 3, 5.0)
    assert costs.seconds("full", 2, 3) > 1.0 and computed == [("full", 2, 3)] * 2
    # a price read while another thread observes a forward is never served after that forward
    racing = CostModel({"full": [(1, 1.0), (16, 2.0)]}, online=True)
    profiled = racing._seconds

    def observed_meanwhile(*size):
        price = profiled(*size)
        if size == ("full", 1, 8) and racing.observed == 0:
            racing.observe("full", 1, 1, 4.0)
        return price

    monkeypatch.setattr(racing, "_seconds", observed_meanwhile)
    stale = racing.seconds("full", 1, 8)
    assert racing.seconds("full", 1, 8) > stale  # the forward observed since: a fresh, dearer price
    monkeypatch.setattr(CostModel, "MEMO_SIZE", 4)
    for tokens in range(1, 10):
        costs.seconds("full", 1, tokens)
    assert len(costs._memo) <= 4


def test_a_step_teaches_each_forward_and_each_rows_work_around_them():
    # what `drive` measured of a step (in process; served, what the services sent back): two
    # forwards, and each row's own work; the rest of the step (0.02 s: planning, commits) is shared
    grid = {"full": [(1, 1.0), (64, 8.0)], "drafter": [(1, 0.1), (64, 1.0)]}
    costs = CostModel(dict(grid), online=True)
    times = StepTimes(work={"a": 0.01, "b": 0.07})
    drive_observer = times.observe  # (drive's `observe`)
    drive_observer("drafter", 2, 2, 0.3)
    drive_observer("full", 2, 4, 2.0)
    costs.observe_step(times, {"a": ("ar", 1.0), "b": ("sd", 7.0)}, seconds=2.4)
    assert times.forward_seconds == pytest.approx(2.3) and costs.observed == 2
    assert costs.scale["drafter"] > 1.0 and costs.scale["full"] > 1.0  # both forwards ran slower than profiled
    assert costs.overhead["ar"] == pytest.approx(0.01 + 0.01) and costs.overhead["sd"] == pytest.approx(0.08 / 7)
    offline = CostModel(dict(grid))  # a model that does not learn keeps its prices
    offline.observe_step(times, {"a": ("ar", 1.0)}, seconds=2.4)
    assert offline.observed == 0 and offline.overhead == {} and offline.scale == {}


# q nearly flat from 1 to 2 tokens, the drafter cheap: a k = 1 block at acceptance 0.5 is
# expected to beat `ar` by 15% (1.5 tokens in 1.3 s)
MARGINAL = {"full": [(1, 1.0), (2, 1.1), (64, 40.0)], "slim": [(1, 0.5), (64, 20.0)], "drafter": [(1, 0.1), (64, 6.4)]}


def test_a_mispriced_size_moves_its_own_price_not_ar_s():
    # the bf16 load run's failure: the profile underpriced the verifier's block (1.1 s, truly
    # 1.6 s: sd then loses to ar). What the blocks show first reads as the pace, which prices
    # `ar` as dear; one probe `ar` step measures it, and from then on `auto` runs `ar`
    costs, planner, ran = CostModel(dict(MARGINAL), online=True), Planner(), []
    for _ in range(64):
        (plan,) = planner.plans(costs, [_row(0.5, gamma=1)])
        ran.append(plan.kind)
        if plan.kind == "ar":
            costs.observe("full", 1, 1, 1.0)
        else:
            costs.observe("drafter", 1, 2, costs.seconds("drafter", 1, 2))
            costs.observe("full", 1, 2, 1.6)
    # (and `ar` it stays, but for one exploration every PROBE_EVERY steps: `sd` is expected within 0.8x)
    explored = ["ar"] + (["ar"] * (PROBE_EVERY - 1) + ["sd"]) * 3
    assert ran == ["sd"] * (PROBE_EVERY - 1) + explored and planner.probes == 1 and planner.explorations == 3
    assert costs.seconds("full", 1, 1) == pytest.approx(1.0, rel=0.02)
    assert costs.seconds("full", 1, 2) == pytest.approx(1.6, rel=0.1)


def _explored(row: RowState, steps: int, accepts: bool) -> tuple[list[str], Planner]:
    """Run `steps` planner steps of one row on MARGINAL; each block it drafts is accepted or not."""
    costs, planner, ran = CostModel(dict(MARGINAL)), Planner(), []
    for _ in range(steps):
        (plan,) = planner.plans(costs, [row])
        ran.append(plan.label)
        if plan.kind == "sd":
            row.acceptance.update("model", drafted=1, accepted=int(accepts))
    return ran, planner


def test_auto_explores_speculation_near_ar_whatever_its_evidence():
    # at acceptance 0.3 a k = 1 block is expected to tie `ar` (1.3 tokens in 1.3 s): `choose` stays on
    # `ar`, whose steps never measure the acceptance. So an all-`ar` step drafts instead, once every
    # PROBE_EVERY steps, on the prior as on a settled estimate; each block it runs is evidence
    ar = ["ar"] * (PROBE_EVERY - 1)
    for evidence in (Acceptance.PRIOR_WEIGHT, 5.0):
        row = _row(0.3, gamma=1, evidence=evidence)
        assert choose(CostModel(dict(MARGINAL)), [row]) == [Plan("ar")]
        ran, planner = _explored(row, 3 * PROBE_EVERY, accepts=False)  # (a drafter this poor stays near the fence)
        assert ran == ["sd:k=1", *ar] * 3 and planner.to_dict()["explorations"] == 3
    # an estimate pulled down by a rejected block, the drafter truly good: one exploration measures it
    ran, planner = _explored(_row(0.3, gamma=1), PROBE_EVERY, accepts=True)
    assert ran[0] == "sd:k=1" and ran[1:] == ["sd:k=1"] * (PROBE_EVERY - 1) and planner.explorations == 1
    # expected far below `ar` (nothing is ever accepted: 1 token in 1.3 s), or no drafter: nothing to explore
    costs = CostModel(dict(MARGINAL))
    for rows in ([_row(0.0, gamma=1)], [_row(0.3, evidence=1.0, has_drafter=False)]):
        assert Planner().plans(costs, rows) == [Plan("ar")]


def test_an_exploration_feeds_a_lagging_drafter_only_with_a_long_way_left():
    # an exploration is one step: it feeds a drafter lagging 40 tokens in full (4 s on MARGINAL),
    # where the goodput spreads that over 16 cycles (0.84x `ar`: near the fence, so it explores
    # whatever the rows have left). Paid only when within 5% of the time left at `ar`'s pace
    for remaining, explores in ((1000, True), (60, False)):
        row = _row(0.3, gamma=1, draft_lag=40, remaining=remaining)
        assert choose(CostModel(dict(MARGINAL)), [row]) == [Plan("ar")]
        ran, planner = _explored(row, PROBE_EVERY, accepts=False)
        assert ran == ["sd:k=1" if explores else "ar"] + ["ar"] * (PROBE_EVERY - 1)
        assert planner.explorations == int(explores)


def test_a_new_auto_row_feeds_its_drafter_at_once_only_when_it_plans_to_draft():
    speculating = _row(0.9, draft_lag=30, remaining=40)
    assert drafts_from_the_start(SPECULATE, [], speculating)
    assert not drafts_from_the_start(NEVER, [], speculating)
    assert not drafts_from_the_start(SPECULATE, [], _row(0.0, draft_lag=30))  # nothing is ever accepted
    # the catch-up priced: a request with two tokens left cannot pay for feeding 500
    assert not drafts_from_the_start(SPECULATE, [], _row(0.9, draft_lag=500, remaining=2))
    costs = CostModel({"full": [(1, 1.0), (4, 1.1), (64, 16.0)], "drafter": [(1, 0.01), (64, 0.5)]})
    ar = RowState(fixed=Plan("ar"), gamma=0, acceptance=Acceptance())
    assert drafts_from_the_start(costs, [], speculating) and not drafts_from_the_start(costs, [ar] * 7, speculating)


def test_auto_probes_ar_while_it_speculates_near_ar():
    def run(costs, rows, steps=2 * PROBE_EVERY):
        planner = Planner()
        probes = [i for i in range(steps) if all(p.kind == "ar" for p in planner.plans(costs, rows))]
        assert planner.probes == len(probes)
        return probes

    near = CostModel(dict(MARGINAL), online=True)
    assert choose(near, [_row(0.5, gamma=1)]) == [Plan("sd", 1)]
    assert run(near, [_row(0.5, gamma=1)]) == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1]
    assert run(CostModel(dict(MARGINAL)), [_row(0.5, gamma=1)]) == []  # a model that does not learn
    assert run(CostModel(dict(SPECULATE.grid), online=True), [_row(0.9)]) == []  # ar far behind: no probe
    fixed = RowState(fixed=Plan("sd", 1), gamma=1, acceptance=Acceptance())
    assert run(near, [_row(0.5, gamma=1), fixed]) == []  # a fixed block beside: q's forward is no ar step


def test_the_planner_forecasts_the_rows_that_step_and_settles_each_step_once():
    # one auto row speculates beside a request still prefilling (planned as an `ar` row it will
    # join as): the forecast prices the step the row runs now, not the batch it will run in
    planner, row = Planner(), _row(0.9)
    joining = RowState(fixed=Plan("ar"), gamma=0, acceptance=Acceptance())
    plans = planner.plans(SPECULATE, [row, joining], stepping=1)
    assert plans[0].kind == "sd"
    planner.settle(2.5, 3)
    planner.settle(9.0, 9)  # nothing planned since: not counted again
    spec = planner.forecasts["speculating"]
    assert spec.steps == 1 and (spec.seconds, spec.tokens) == (2.5, 3)
    assert spec.predicted_seconds == pytest.approx(step_seconds(SPECULATE, [row], plans[:1]))
    assert spec.predicted_seconds < step_seconds(SPECULATE, [row, joining], plans)
    assert spec.expected_tokens == pytest.approx(expected_tokens(row, plans[0]))
    planner.plans(NEVER, [row])
    planner.settle(1.0, 1)
    assert planner.to_dict()["forecasts"]["ar"] == {
        "steps": 1,
        "predicted_seconds": step_seconds(NEVER, [row], [Plan("ar")]),
        "seconds": 1.0,
        "expected_tokens": 1.0,
        "tokens": 1,
    }


def test_the_margin_is_the_planners_measured_error():
    """Planner.margin: SPECULATE_MARGIN before any step; `ar` steps whose forecasts hold take off
    their side's half, speculating steps that hold theirs, down to MARGIN_FLOOR; speculating
    steps that measure 20% slower than forecast raise it above SPECULATE_MARGIN. A step forecast
    by a model that does not learn (a fixed table, not this machine's seconds) changes nothing."""
    one = [(1, 1.0), (4, 1.06), (8, 1.25), (16, 1.6), (32, 2.4), (64, 4.0)]
    flat = CostModel({"full": one, "slim": one, "drafter": [(1, 0.25), (64, 1.0)]}, online=True)
    thin = [_row(0.6) for _ in range(4)]  # `sd` expected 1.0-1.1x every row on `ar`
    gain = goodput(flat, thin, choose(flat, thin, margin=1.0)) / goodput(flat, thin, [Plan("ar")] * 4)
    assert 1.03 < gain < SPECULATE_MARGIN

    def settle(planner, rows, steps, slower=1.0):
        for _ in range(steps):
            plans = planner.plans(flat, rows)
            n = len(rows)
            planner.settle(
                step_seconds(flat, rows, plans) * slower, round(sum(expected_tokens(r, p) for r, p in zip(rows, plans)))
            )
            assert planner._pending is None and len(plans) == n

    planner = Planner()
    assert planner.margin(flat) == planner.margin() == SPECULATE_MARGIN
    assert choose(flat, thin, margin=planner.margin(flat)) == [Plan("ar")] * 4
    settle(planner, [_row(0.0)] * 4, 200)  # `ar` steps (nothing is ever accepted), each as forecast
    assert planner.recent["ar"].steps == pytest.approx(1 / (1 - MARGIN_DECAY), rel=0.05)
    half = (SPECULATE_MARGIN - 1) / 2
    assert planner.margin(flat) == pytest.approx(
        1 + half + half * MARGIN_PRIOR_STEPS / (MARGIN_PRIOR_STEPS + 1 / (1 - MARGIN_DECAY)), rel=1e-3
    )
    assert planner.plans(flat, thin)[0].kind == "sd"  # the thin gain now beats the margin ...
    planner.settle(step_seconds(flat, thin, choose(flat, thin, margin=1.0)), 6)
    settle(planner, [_row(0.95)] * 4, 200)  # ... and speculating steps as forecast take it to the floor
    assert planner.margin(flat) == pytest.approx(
        max(MARGIN_FLOOR, 1 + 2 * half * MARGIN_PRIOR_STEPS / (MARGIN_PRIOR_STEPS + 50)), abs=0.01
    )
    settle(planner, [_row(0.95)] * 4, 200, slower=1.2)  # speculation 20% dearer than forecast: a bet lost
    assert (
        planner.margin(flat) > SPECULATE_MARGIN and choose(flat, thin, margin=planner.margin(flat)) == [Plan("ar")] * 4
    )
    assert planner.to_dict()["margin"] == round(planner.margin(), 4)
    fixed = Planner()
    fixed.recent = planner.recent
    assert fixed.margin(CostModel(dict(flat.grid))) == SPECULATE_MARGIN  # priced by a fixed table


def test_a_new_request_starts_from_the_mean_of_many_blocks_not_the_last_request_s_end():
    """The engine-wide estimate (population) remembers ~50 blocks of every request; a request's
    own follows its last ~5 and starts from the engine-wide one as its steady-state evidence.
    Replayed: HumanEval/0's `sd` blocks on a real AVX2 CPU (accepted at positions 1-5 in 12, 11,
    10, 9, 9 of 14 blocks; E[tokens] at k = 5: 4.64), its rejections last. With one memory for
    both, the engine-wide estimate is the request's end."""
    blocks = [5] * 9 + [3, 2, 1, 0, 0]
    engine, one_memory = Estimates(population=True), Estimates()
    for _ in range(2):  # two such requests
        for accepted in blocks:
            for e in (engine, one_memory):
                e.learn(Plan("sd", 5), drafted=5, accepted=accepted, committed=accepted + 1, escalated=False)
    truth = 1 + sum(n / 14 for n in (12, 11, 10, 9, 9))
    assert truth == pytest.approx(4.64, abs=0.01)
    assert one_memory.acceptance.expected_tokens("model", 5) < 0.7 * truth
    assert engine.acceptance.expected_tokens("model", 5) == pytest.approx(truth, rel=0.06)
    request = Estimates(engine)
    assert request.decay == Acceptance.DECAY < engine.decay == Acceptance.POPULATION_DECAY
    assert request.acceptance.rates == engine.acceptance.rates
    steady = 1 / (1 - Acceptance.DECAY)
    assert max(request.acceptance.weights["model"]) == pytest.approx(steady)
    assert steady < max(engine.acceptance.weights["model"])
    for e in (engine, request):  # a request's own blocks move it faster than the engine's
        e.learn(Plan("sd", 5), drafted=5, accepted=0, committed=1, escalated=False)
    assert request.acceptance.rates["model"][0] < engine.acceptance.rates["model"][0] - 0.1


def test_auto_plans_for_the_batch_that_is_still_filling(tiny_pair):
    # speculation pays for one row, not for eight (q flat up to 4 tokens, then linear): the first
    # request to decode, while seven others still prefill (one prompt chunk per step), plans for
    # the batch of eight it is about to run in, not for the one row it is in now
    costs = CostModel(
        {"full": [(1, 1.0), (4, 1.1), (64, 16.0)], "slim": [(1, 0.5), (64, 8.0)], "drafter": [(1, 0.01), (64, 0.5)]}
    )
    assert choose(costs, [_row(0.6)])[0].kind == "sd" and {p.kind for p in choose(costs, [_row(0.6)] * 8)} == {"ar"}
    engine = _engine(tiny_pair, costs, max_batch=8, prefill_chunk=10)
    handles = [engine.submit([7 + i] * 10 + [40, 41], parse_params(mode="auto", max_tokens=6)) for i in range(8)]
    steps = 0
    while not handles[0].stats.plans and steps < 20:
        engine.step()
        steps += 1
    assert handles[0].stats.plans == {"ar": 1} and any(not h.chunks for h in handles[1:])  # planned as a batch


def test_planner_state_reports_costs_and_acceptance(tiny_pair):
    """With fixed curves (not corrected online) the plans are the table's on every machine: this
    one speculates, and the state says what the drafts taught, what each step was forecast to
    cost and what planning them took."""
    engine = _engine(tiny_pair, CostModel(dict(SPECULATE.grid)))
    engine.complete(PROMPTS[0], parse_params(mode="sd", max_tokens=12))
    assert engine.planner_state()["planning"] == {"steps": 0, "seconds": 0.0}  # a fixed mode's steps: none planned
    before = engine.planner_state()
    result = engine.complete(PROMPTS[0], parse_params(mode="auto", max_tokens=12))
    after = engine.planner_state()
    assert any(label.startswith("sd") for label in result.stats.plans), result.stats.plans
    assert after["acceptance"]["model"] != before["acceptance"]["model"]  # the drafts taught it something
    forecasts = after["forecasts"]  # every step of the request, planned and settled once
    assert sum(f["tokens"] for f in forecasts.values()) == 12 and forecasts["speculating"]["steps"] > 0
    assert all(f["seconds"] > 0 and f["predicted_seconds"] > 0 for f in forecasts.values() if f["steps"])
    steps = sum(f["steps"] for f in forecasts.values())
    assert after["planning"]["steps"] == steps and after["planning"]["seconds"] > 0  # what auto's plans cost


def test_online_costs_learn_from_the_forwards_whatever_the_plans(tiny_pair):
    """Corrected online, the curves follow this machine's forwards (so the plans may differ from
    machine to machine): the state reports the corrections and each plan kind's work around the
    forwards, and the acceptance moves exactly when some step drafted."""
    engine = _engine(tiny_pair, CostModel(dict(SPECULATE.grid), online=True))
    before = engine.planner_state()
    result = engine.complete(PROMPTS[0], parse_params(mode="auto", max_tokens=12))
    after = engine.planner_state()
    assert after["costs"]["online"] and after["costs"]["observed"] > 0 and after["costs"]["correction"]["full"]
    assert sum(f["tokens"] for f in after["forecasts"].values()) == 12
    drafted = any(not label.startswith("ar") for label in result.stats.plans)
    assert (after["acceptance"] != before["acceptance"]) == drafted, result.stats.plans
    ran = {label.split(":")[0] for label in engine.complete(PROMPTS[1], parse_params(mode="auto")).stats.plans}
    assert ran <= set(engine.planner_state()["costs"]["overhead_seconds"])  # each kind's work around the forwards


def test_auto_prefills_the_drafter_only_when_a_plan_drafts(tiny_pair):
    # never worth it: the drafter of an auto request never runs, not even its prefill
    engine = _engine(tiny_pair, NEVER)
    prompt = PROMPTS[1] * 3  # 30 tokens: a lag far beyond CATCH_UP
    ar = engine.complete(prompt, parse_params(mode="ar", max_tokens=20))
    handle = engine.submit(prompt, parse_params(mode="auto", max_tokens=20))
    while not handle.finished:
        engine.step()
        draft, _ = engine.executor.sessions(handle.key) or (None, None)
        if draft is not None:
            assert draft.tier.pos == 0
    assert sum((c.token_ids for c in handle.chunks), []) == ar.token_ids
    assert handle.stats.forwards["drafter"] == 0 and handle.stats.prefill_forwards == ar.stats.prefill_forwards
    # worth it from the start: the drafter prefills with the prompt, chunk for chunk with the
    # verifier, then drafts without catching up
    engine, prompt = _engine(tiny_pair, SPECULATE, prefill_chunk=10), list(range(3, 33))  # (no n-gram matches)
    # (`ar` on an engine of its own: on this one its prompt blocks would be the verifier's prefix cache)
    ar = _engine(tiny_pair, SPECULATE, prefill_chunk=10).complete(prompt, parse_params(mode="ar", max_tokens=20))
    handle = engine.submit(prompt, parse_params(mode="auto", max_tokens=20))
    engine.step()  # the prompt's first chunk, through both models
    draft, verify = engine.executor.sessions(handle.key)
    assert draft.tier.pos == verify.full.pos == 10
    while not handle.finished:
        engine.step()
    assert sum((c.token_ids for c in handle.chunks), []) == ar.token_ids and handle.stats.forwards["drafter"] > 0
    assert handle.stats.prefill_forwards == 2 * ar.stats.prefill_forwards


def test_auto_catches_a_lazy_drafter_up_when_a_plan_first_drafts(tiny_pair):
    # speculation pays for one row, not for eight: admitted beside seven short requests, the long
    # one plans `ar` and leaves its drafter unfed; alone after they finish, it catches up once
    # (one more prefill forward than `ar`) and drafts
    costs = CostModel(
        {"full": [(1, 1.0), (4, 1.1), (64, 16.0)], "slim": [(1, 0.5), (64, 8.0)], "drafter": [(1, 0.01), (64, 0.5)]}
    )
    engine, prompt = _engine(tiny_pair, costs, max_batch=8), list(range(3, 33))
    ar = engine.complete(prompt, parse_params(mode="ar", max_tokens=20))
    handle = engine.submit(prompt, parse_params(mode="auto", max_tokens=20))
    others = [engine.submit([7 + i, 40, 41], parse_params(mode="auto", max_tokens=2)) for i in range(7)]
    while not all(h.finished for h in others):
        engine.step()
        draft, _ = engine.executor.sessions(handle.key)
        assert draft.tier.pos == 0
    while not handle.finished:
        engine.step()
    assert sum((c.token_ids for c in handle.chunks), []) == ar.token_ids and handle.stats.forwards["drafter"] > 0
    assert handle.stats.prefill_forwards == ar.stats.prefill_forwards + 1 and "ar" in handle.stats.plans


def test_auto_crosses_the_wire():
    from viasd.v1.convert import params_from_proto, params_to_proto, stats_from_proto, stats_to_proto

    params = parse_params(mode="auto", auto_lossy=True, max_tokens=7)
    assert params_from_proto(params_to_proto(params)) == params
    stats = RequestStats(mode="auto", plans={"ar": 3, "sd:k=4": 2})
    assert stats_from_proto(stats_to_proto(stats)).plans == stats.plans
