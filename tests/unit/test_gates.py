"""Calibrated gates (viasd.gates): the cycle simulation against the engine, the constrained
choice, the defaults a `via` request gets, and artifacts with and without gates."""

from __future__ import annotations

import json
from dataclasses import astuple

import pytest
import torch

from viasd.config import parse_engine_config, parse_params
from viasd.costs import CostModel
from viasd.dimr import parse_artifact, read_artifact, save_artifact, shipped_artifacts
from viasd.engine import Engine
from viasd.gates import PAPER, Cycle, Gates, Signals, calibrate, cycle, grid, score, signals
from viasd.llm import resolve_gates
from viasd.rules import regions_from_ratio
from viasd.runtime import LayerMask

PROMPTS = [[5, 17, 3, 88, 41, 9], [1, 2, 3], [60] * 12, [7, 8, 9, 10], [33, 34, 35, 33, 34]]
GAMMA = 4
COSTS = CostModel({"drafter": [(1, 0.01), (64, 0.2)], "slim": [(1, 0.03), (64, 0.6)], "full": [(1, 0.05), (64, 1.0)]})


@pytest.mark.parametrize("gates", [PAPER, Gates(0.9, 0.7, "rewrite"), Gates(0.7, 0.3, "escalate")])
def test_the_simulated_cycle_is_the_engines_first_cycle(tiny_pair, gates):
    """Teacher forced on q's own greedy output, the simulated cycle at the prompt's end commits
    what the engine's first via cycle commits, escalates when it does, and is wrong iff the
    engine's first cycle left q's greedy output."""
    verifier, drafter = tiny_pair
    mask = LayerMask.from_skipped((1, 3), verifier.num_layers)
    engine = Engine(verifier, drafter, mask=mask)
    seen = {"wrong": 0, "escalated": 0, "exact": 0, "short": 0}
    rng = torch.Generator().manual_seed(5)
    prompts = PROMPTS + [torch.randint(0, verifier.vocab_size, (6,), generator=rng).tolist() for _ in range(15)]
    for prompt in prompts:
        ar = engine.complete(prompt, parse_params(mode="ar", max_tokens=GAMMA + 2)).token_ids
        via = parse_params(
            mode="via",
            gamma=GAMMA,
            max_tokens=GAMMA + 1,
            alpha1=gates.alpha1,
            alpha2=gates.alpha2,
            region_b=gates.region_b,
        )
        handle = engine.submit(prompt, via)
        while not handle.chunks:
            engine.step()
        first = handle.chunks[0].token_ids  # the first cycle's tokens
        engine.cancel(handle)
        while engine.scheduler.has_work():
            engine.step()
        (sig,) = signals(verifier, drafter, mask, [prompt + ar])
        regions = regions_from_ratio(
            sig.ratio, gates.alpha1, gates.alpha2, rewrite=gates.region_b == "rewrite"
        ).tolist()
        committed, wrong, escalated, _ = astuple(
            cycle(
                regions, (sig.draft == sig.qtop).tolist(), (sig.slim_top == sig.qtop).tolist(), len(prompt) - 1, GAMMA
            )
        )
        assert (wrong > 0) == (first != ar[: len(first)]), prompt
        if wrong == 0:
            assert committed == len(first), prompt
            assert escalated == (handle.stats.escalations > 0), prompt
            seen["exact"] += 1
            seen["short"] += not escalated and committed < GAMMA  # a rewrite ended the cycle
            seen["escalated"] += escalated
        seen["wrong"] += wrong > 0
    assert seen["exact"] > 0
    if gates.region_b == "rewrite" and gates.alpha1 > 0.5:
        assert seen["short"] > 0 and seen["escalated"] > 0, seen


def _synthetic(seed: int, n: int = 400) -> list[Signals]:
    g = torch.Generator().manual_seed(seed)
    qtop = torch.randint(0, 5, (n,), generator=g)
    draft = torch.where(torch.rand(n, generator=g) < 0.7, qtop, (qtop + 1) % 5)
    slim_top = torch.where(torch.rand(n, generator=g) < 0.85, qtop, (qtop + 2) % 5)
    # q' tends to like the draft when it is right
    ratio = torch.where(draft == qtop, torch.rand(n, generator=g) * 0.5 + 0.5, torch.rand(n, generator=g) * 0.8)
    return [Signals(draft, qtop, slim_top, ratio.double())]


def test_calibrate_takes_the_fastest_gates_within_the_budget():
    sigs = _synthetic(0)
    scores = [score(sigs, g, GAMMA, COSTS) for g in grid()]
    budget = sorted(s.agreement for s in scores)[len(scores) // 2]  # half the grid meets it
    out = calibrate(sigs, COSTS, gamma=GAMMA, min_agreement=budget)
    assert out["budget"]["met"] and out["chosen"]["agreement"] >= budget
    assert out["chosen"]["tokens_per_second"] == max(s.tokens_per_second for s in scores if s.agreement >= budget)
    assert any(s.tokens_per_second > out["chosen"]["tokens_per_second"] for s in scores)  # the budget binds
    impossible = calibrate(sigs, COSTS, gamma=GAMMA, min_agreement=1.01)
    assert not impossible["budget"]["met"]
    assert impossible["chosen"]["agreement"] == max(s.agreement for s in scores)
    # a stricter accept gate can only trade speed for agreement on these signals
    assert (
        score(sigs, Gates(0.99, 0.9, "escalate"), GAMMA, COSTS).agreement > score(sigs, PAPER, GAMMA, COSTS).agreement
    )


def test_hand_computed_cycles():
    A, B, C = 0, 1, 2
    ok = [True, False, True, True, True]
    slim_ok = [True, True, False, True, True]
    assert cycle([A, A, A, A, A], ok, slim_ok, 0, 3) == Cycle(3, 1, False, 1)  # d_1 accepted though q disagrees
    assert cycle([A, B, A, A, A], ok, slim_ok, 0, 3) == Cycle(2, 0, False, 2)  # rewrite at 1 with q''s (right) token
    assert cycle([A, A, B, A, A], ok, slim_ok, 1, 3) == Cycle(2, 2, False, 0)  # wrong accept, then a wrong rewrite
    assert cycle([A, C, A, A, A], ok, slim_ok, 0, 3) == Cycle(2, 0, True, 2)  # q rejects d_1, commits its own
    assert cycle([A, A, C, A, A], ok, slim_ok, 2, 3) == Cycle(4, 0, True, 4)  # q accepts all three: bonus


def test_gates_apply_only_where_no_gate_was_chosen():
    g = Gates(0.8, 0.4, "escalate")
    got = g.apply(parse_params(mode="via"))
    assert (got.alpha1, got.alpha2, got.region_b.value) == (0.8, 0.4, "escalate")
    for kept in (
        parse_params(mode="via", alpha1=0.6),
        parse_params(mode="via", region_b="rewrite"),
        parse_params(mode="sd"),
        parse_params(mode="via", rule="staged"),
    ):
        assert g.apply(kept) == kept


def test_an_engine_with_gates_decodes_like_the_explicit_request(tiny_pair):
    verifier, drafter = tiny_pair
    mask = LayerMask.from_skipped((1, 3), verifier.num_layers)
    g = Gates(0.9, 0.6, "escalate")
    gated = Engine(verifier, drafter, mask=mask, gates=g)
    plain = Engine(verifier, drafter, mask=mask)
    for prompt in PROMPTS[:3]:
        default = gated.complete(prompt, parse_params(mode="via", max_tokens=24)).token_ids
        explicit = plain.complete(
            prompt, parse_params(mode="via", max_tokens=24, alpha1=0.9, alpha2=0.6, region_b="escalate")
        ).token_ids
        assert default == explicit
        chosen = parse_params(mode="via", max_tokens=24, alpha1=0.5)  # a request's own gate wins
        assert gated.complete(prompt, chosen).token_ids == plain.complete(prompt, chosen).token_ids


def test_artifacts_with_and_without_gates_load(tmp_path):
    shipped = shipped_artifacts()
    assert shipped  # every shipped artifact parses (old ones have no gates)
    name, art = shipped[0]
    mask = art.mask
    config = parse_engine_config(verifier=art.verifier)
    with_gates = art.model_copy(update={"gates": {"alpha1": 0.8, "alpha2": 0.2, "region_b": "escalate"}})
    path = save_artifact(with_gates, tmp_path / "m.json")
    assert read_artifact(path).gates["alpha1"] == 0.8
    assert parse_artifact(json.loads(path.read_text())).mask == mask
    gates, why = resolve_gates(config, mask, str(path))
    assert gates == Gates(0.8, 0.2, "escalate") and "calibrated" in why
    assert resolve_gates(parse_engine_config(verifier=art.verifier, gates="paper"), mask, str(path))[0] is None
    assert resolve_gates(config, mask, ",".join(map(str, mask.skipped)))[0] is None  # layers by hand: paper
    old = art.model_copy(update={"gates": None})
    assert resolve_gates(config, mask, str(save_artifact(old, tmp_path / "old.json")))[0] is None


def test_bad_gates_setting_names_the_field():
    from viasd.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError) as err:
        parse_engine_config(gates="literal")
    assert err.value.field == "gates"


def test_the_modelled_staged_cycle_follows_q_and_q_prime():
    # d: drafts, s: q''s argmax, g: q's argmax, one text of 6 positions, gamma 2
    sig = Signals(
        draft=torch.tensor([1, 2, 3, 4, 5, 6]),
        qtop=torch.tensor([1, 9, 3, 4, 5, 6]),
        slim_top=torch.tensor([1, 9, 3, 7, 5, 6]),
        ratio=torch.ones(6, dtype=torch.float64),
    )
    out = calibrate([sig], COSTS, gamma=2, candidates=[PAPER])
    # t=0: q' keeps d0, writes 9 at 1; q keeps both, commits g2 -> 3 (sd: d0 then g1 -> 2)
    # t=1: q' writes 9 at 1 -> y=[9]; q keeps it -> 2 (sd: 1)
    # t=2: q' keeps d2, writes 7 at 3; q keeps d2 only -> 2 (sd: d2, d3 then bonus -> 3)
    # t=3: q' writes 7 -> q rejects at 0 -> 1 (sd: 3)
    assert out["staged_tokens_per_cycle"] == (3 + 2 + 2 + 1) / 4
    assert out["sd_tokens_per_cycle"] == (2 + 1 + 3 + 3) / 4
    assert out["top1_agreement"] == {"drafter": 5 / 6, "slim": 5 / 6}
