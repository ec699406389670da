"""The quality evaluation (viasd.bench.quality, `viasd bench --suite quality`) on tiny float64 models:

* a batched evaluation decodes each prompt as it decodes alone, and a stop sequence cancels the
  request that wrote it;
* agreement with `ar` is the share of tokens before the first difference and the identical share;
* pass@1 comes with its Wilson interval, and a lossy sampled setting is compared with its matched
  baseline (the verifier with min-p = alpha1 at the same temperature).
"""

from __future__ import annotations

import pytest

from viasd.bench.methods import parse_method
from viasd.bench.quality import Setting, decode_batched, evaluate, markdown, settings_from, summarize
from viasd.bench.workloads import Prompt
from viasd.config import parse_params
from viasd.engine import Engine

PROMPTS = [[5, 17, 3, 88, 41, 9], [60] * 8, [7, 7, 12, 30, 2, 44, 61]]


class DigitTokenizer:
    """Token i is the text "<i>" (no tokenizer files in these tests)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [int(t) for t in text.replace(">", "").split("<") if t]


def test_a_batched_evaluation_decodes_each_prompt_as_alone(tiny_pair):
    verifier, drafter = tiny_pair
    engine = Engine(verifier, drafter, max_batch=2)  # three prompts: one waits for a row
    params = [parse_params(mode="sd", gamma=3, max_tokens=12, temperature=1.0, seed=s) for s in (1, 2, 3)]
    records, seconds = decode_batched(engine, DigitTokenizer(), PROMPTS, params, stops=())
    alone = [Engine(verifier, drafter).complete(ids, p).token_ids for ids, p in zip(PROMPTS, params)]
    assert [r["tokens"] for r in records] == alone and seconds > 0
    assert all(r["finish_reason"] == "length" and r["generated_tokens"] == 12 for r in records)


def test_a_stop_sequence_cancels_the_request_that_wrote_it(tiny_pair):
    verifier, drafter = tiny_pair
    engine = Engine(verifier, drafter)
    params = parse_params(mode="ar", max_tokens=20)
    full = engine.complete(PROMPTS[0], params).token_ids
    stop = DigitTokenizer().decode(full[3:5])  # a stretch the greedy output is known to contain
    (record,), _ = decode_batched(engine, DigitTokenizer(), [PROMPTS[0]], [params], stops=(stop,))
    assert record["finish_reason"] == "stop_sequence" and stop not in record["completion"]
    assert record["tokens"] == full[: len(record["tokens"])] and len(record["tokens"]) < len(full)


def test_agreement_with_ar_counts_the_shared_prefix(tiny_pair):
    verifier, drafter = tiny_pair
    base = parse_params(max_tokens=10)
    settings = [Setting(parse_method(s, base)) for s in ("ar", "sd:gamma=3", "via:alpha1=0.05:alpha2=0.01")]
    corpus = {"toy": [Prompt(f"p{i}", text=DigitTokenizer().decode(ids)) for i, ids in enumerate(PROMPTS)]}
    result = evaluate(Engine(verifier, drafter), DigitTokenizer(), settings, corpus)
    summary = result["summary"]
    assert summary["sd:gamma=3"]["toy"]["agreement_with_ar"]["identical"] == 1.0  # lossless: float64 == ar
    lossy = summary["via:alpha1=0.05:alpha2=0.01"]["toy"]["agreement_with_ar"]
    runs = {(r["method"], r["prompt"]): r["tokens"] for r in result["runs"]}
    shares = []
    for p in corpus["toy"]:
        a, b = runs[("via:alpha1=0.05:alpha2=0.01", p.id)], runs[("ar", p.id)]
        n = min(len(a), len(b))
        shares.append(next((i for i in range(n) if a[i] != b[i]), n) / n)
    assert lossy["prefix_share"] == pytest.approx(sum(shares) / len(shares)) and lossy["n"] == 3
    assert "agreement_with_ar" not in summary["ar"]["toy"] and "toy agree" in markdown(summary, ["toy"])


def test_a_lossy_sampled_setting_is_compared_with_its_matched_baseline():
    base = parse_params(max_tokens=8)
    settings = settings_from("ar:temperature=1;via:alpha1=0.5:alpha2=0.3:temperature=1", (0, 1), base)
    labels = [s.label for s in settings]
    assert labels == ["ar:temperature=1", "via:alpha1=0.5:alpha2=0.3:temperature=1", "ar:min_p=0.5:temperature=1"]
    assert settings[1].baseline == "ar:min_p=0.5:temperature=1" and settings[0].baseline is None

    def run(method, i, seed, passed):
        return {"method": method, "corpus": "he", "prompt": f"p{i}", "prompt_index": i, "seed": seed,
                "repeat": 0, "temperature": 1.0, "ok": True, "passed": passed, "tokens": [1],
                "completion": "x", "generated_tokens": 1}  # fmt: skip

    runs = [run(labels[1], i, s, i == 0) for i in range(4) for s in (0, 1)]  # 1 of 4 problems
    runs += [run(labels[2], i, s, i < 3) for i in range(4) for s in (0, 1)]  # 3 of 4
    summary = summarize(runs, settings)
    via = summary[labels[1]]["he"]
    assert via["pass_at_1"]["pass_at_1"] == 0.25 and via["pass_at_1"]["n_samples"] == 8
    lo, hi = via["pass_at_1"]["wilson95"]
    assert lo < 0.25 < hi
    assert summary[labels[1]]["matched_baseline"] == labels[2]
    assert via["baseline_pass_at_1"] == 0.75 and via["delta_pass_at_1"] == pytest.approx(-0.5)
