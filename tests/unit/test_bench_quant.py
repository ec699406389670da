"""`viasd bench --suite quant` (viasd/bench/quant.py): the CLI wiring, the parts, the child
process's entry point and the results file, without measuring for long."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from viasd.bench import quant, tables
from viasd.cli import SUITES, build_parser, main


def test_the_suite_and_its_options_parse():
    assert "quant" in SUITES
    args = build_parser().parse_args(
        ["bench", "--suite", "quant", "--parts", "kernels,e2e", "--kernel-rows", "1,4", "--e2e-tokens", "8"]
    )
    assert (args.suite, args.parts, args.kernel_rows, args.e2e_tokens) == ("quant", "kernels,e2e", "1,4", 8)
    assert (args.kernel_budget_s, args.gguf_scheme, args.e2e_repeats) == (2.0, "int4", 2)


def test_kernels_part_runs_one_small_shape_and_writes_results(tmp_path, capsys):
    out = tmp_path / "quant"
    argv = ["bench", "--suite", "quant", "--parts", "kernels", "--kernel-shapes", "k_v_proj"]
    assert main([*argv, "--kernel-rows", "1,2", "--kernel-budget-s", "0", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["command"].startswith("viasd bench --suite quant --parts kernels")
    assert res["parts"] == ["kernels"] and "gguf" not in res and "e2e" not in res
    assert res["environment"]["git_commit"] and res["environment"]["cpu_capability"]
    results = res["kernels"]["results"]
    assert [(r["shape"], r["K"], r["N"], r["M"]) for r in results] == [("k_v_proj", 1536, 256, m) for m in (1, 2)]
    from viasd.quant import a8w8_available, a8w8r_missing

    onednn = a8w8r_missing() is None  # (the kernel via-sd runs as a8w8r, recorded where it runs)
    assert (res["kernels"]["onednn_int8"], res["kernels"]["fbgemm_int8"]) == (onednn, a8w8_available())
    for r in results:
        assert {"bf16", "int8", "int8_chunked", "int4_g32", "int4_g128", "int4_dequant_g32"} <= set(r["kernels"])
        assert ("int8_onednn_a8w8" in r["kernels"]) == onednn
        assert all(v["rounds"] >= 5 and 0 < v["best_s"] <= v["median_s"] for v in r["kernels"].values())
    # the published table renders the suite's file as it renders the committed one
    lines = tables.quant_kernels([res])
    assert lines[2].startswith("| k / v 1536 -> 256 | 1 | ") and len(lines) == 5  # M = 2: no row
    assert "### Kernels" in (out / "results.md").read_text()
    assert tables.capability(res) == res["environment"]["cpu_capability"] and tables.dtype(res) == "bfloat16"


def test_gguf_and_e2e_parts_are_wired_to_their_measurements(tmp_path, monkeypatch):
    checked, spawned = [], []

    def check_gguf(model, scheme, dtype):
        checked.append((model, scheme, dtype))
        entry = {
            "tensors": 2,
            "mapped_to": ["int4 g32 (gguf Q4_K (exact))"],
            "max_abs_error": 0.0,
            "max_error_over_step": 0.0,
            "kernel_max_abs_error": 0.01,
            "kernel_max_rel_error": 0.004,
            "loaded_equal": True,
        }
        return {"model": model, "scheme": scheme, "dtype": dtype, "by_gguf_type": {"Q4_K": entry}}

    def spawn(q, tokens, repeats):
        spawned.append((q, tokens, repeats))
        return {
            "quantization": q,
            "load_s": 1.0,
            "ar_1_s_per_token": 0.1 if q == "none" else 0.05,
            "sd_1_s_per_token": 0.08,
            "sd_agrees_with_ar": 1.0,
            "ar_16_tokens_per_s": 10.0,
            "runtime": {"dtype": "bfloat16", "linear_method": "mkldnn_packed"},
        }

    monkeypatch.setattr(quant, "check_gguf", check_gguf)
    monkeypatch.setattr(quant, "spawn", spawn)
    out = tmp_path / "q"
    argv = ["bench", "--suite", "quant", "--parts", "gguf,e2e", "--gguf-models", "a,b", "--dtype", "float32"]
    argv += ["--e2e-quantization", "none,int4", "--e2e-tokens", "3", "--e2e-repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    assert checked == [("a", "int4", "float32"), ("b", "int4", "float32")]
    assert spawned == [("none", 3, 1), ("int4", 3, 1)]
    res = json.loads((out / "results.json").read_text())
    assert res["parts"] == ["gguf", "e2e"] and "kernels" not in res
    assert [g["model"] for g in res["gguf"]] == ["a", "b"] and res["e2e"]["tokens"] == 3
    gguf_rows = [line for line in tables.quant_gguf([res]) if line.startswith("| `")]
    assert gguf_rows[1].startswith("| `b` | Q4_K | 2 | int4 g32 (gguf Q4_K (exact)) | 0 | - | 0.0100 (0.40%) |")
    e2e_rows = tables.quant_e2e([res])
    assert (
        e2e_rows[3]
        == "| int4 (bfloat16, `mkldnn_packed`) | 1.0 | 50.0 (2.00x) | 80.0 (1.00x) | 100% | 10.0 (1.00x) | - |"
    )
    md = (out / "results.md").read_text()
    assert "### GGUF mapping" in md and "### End to end" in md and "### Kernels" not in md


def test_an_unknown_part_or_shape_is_refused(tmp_path, capsys):
    assert main(["bench", "--suite", "quant", "--parts", "kernels,nope", "--out", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err
    assert (
        main(["bench", "--suite", "quant", "--parts", "kernels", "--kernel-shapes", "x", "--out", str(tmp_path)]) == 2
    )
    assert not (tmp_path / "results.json").exists()


def test_the_e2e_child_is_a_module_entry_point(monkeypatch, capsys):
    cmd = quant.child_command("int4", 7, 3)
    assert cmd[:4] == [sys.executable, "-m", "viasd.bench.quant", "--child"] and cmd[4:] == [
        "int4",
        "--tokens",
        "7",
        "--repeats",
        "3",
    ]
    monkeypatch.setattr(quant, "one", lambda q, tokens, repeats: {"quantization": q, "n": tokens, "r": repeats})
    assert quant.main(cmd[3:]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"quantization": "int4", "n": 7, "r": 3}
    proc = subprocess.run([sys.executable, "-m", "viasd.bench.quant", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--child" in proc.stdout


@pytest.mark.parametrize("key", ["kernels", "e2e"])
def test_a_suite_record_without_a_part_renders_no_rows_of_it(key):
    record = {"command": "viasd bench --suite quant", "parts": ["gguf"], "gguf": []}
    assert tables._part(record, key) == []


def _llamacpp_run(system: str, rnd: int, scale: float) -> dict:
    """A child's record of the llamacpp part: 2 prompts, n = 4 tokens after the first."""
    systems = ["llama.cpp"] if system == "llama.cpp" else ["ar", "auto"]
    per_token = {"llama.cpp": 0.1, "ar": 0.08, "auto": 0.05}
    results = []
    for i in range(2):
        for s in systems:
            r = {"system": s, "prompt": i, "t_1": 0.5, "t_n": 0.5 + 4 * per_token[s] * scale}
            r["tokens"] = [1, 2, 3, 4, 5] if s != "auto" or i else [1, 2, 9, 4, 5]
            if s == "llama.cpp":
                r.update(t_p_eval_ms=100.0, n_p_eval=10, t_eval_ms=400.0, n_eval=4)
            results.append(r)
    run = {"system": "via-sd" if system != "llama.cpp" else "llama.cpp", "round": rnd, "results": results}
    if system == "llama.cpp":
        run.update(llama_cpp="0.3.0", system_info="AVX512 = 1", gguf="v.gguf", gguf_sha256="ab", threads=2)
    else:
        quant = [{"quantization": "int4", "quantization_reason": "auto-int4"}]
        run.update(quantization="auto", threads=2, runtime={"dtype": "bfloat16", "quantization": quant})
    return run


def test_llamacpp_summary_and_table_from_a_fixture_record():
    """The llamacpp part's figures and table, on a record such as the part writes (no llama_cpp needed)."""
    runs = [_llamacpp_run(s, i, scale) for i, scale in ((0, 1.0), (1, 1.25)) for s in ("llama.cpp", "via-sd")]
    summary = quant.llamacpp_summary(runs, tokens=4)
    assert list(summary) == ["llama.cpp", "ar", "auto"]
    ll, auto = summary["llama.cpp"], summary["auto"]
    assert ll["decode_tokens_per_s"]["rounds"] == pytest.approx([10.0, 8.0])  # 2 x 4 tokens / 2 x 0.4 s
    assert ll["decode_tokens_per_s"]["aa_spread"] == pytest.approx(2 / 9)
    assert ll["wall_tokens_per_s"]["rounds"] == pytest.approx([10 / 1.8, 10 / 2.0])  # (1 + 4) per prompt, prefill in
    assert (ll["llama_eval_tokens_per_s"], ll["llama_prompt_tokens_per_s"]) == pytest.approx((10.0, 100.0))
    assert auto["vs_llama_cpp"]["decode_tokens_per_s"] == pytest.approx(2.0)
    assert auto["tokens_equal_to_llama_cpp"] == [2, 5] and summary["ar"]["tokens_equal_to_llama_cpp"] == [5, 5]
    record = {
        "command": "viasd bench --suite quant --parts llamacpp",
        "parts": ["llamacpp"],
        "llamacpp": {
            "tokens": 4,
            "threads": 2,
            "quantization": "auto",
            "rounds": 2,
            "prompts": ["a", "b"],
            "prompt_ids": [[1], [1, 2]],
            "order": [r["system"] for r in runs],
            "llama_cpp": {"available": True, "llama_cpp": "0.3.0", "gguf": "v.gguf"},
            "runtime": runs[1]["runtime"],
            "runs": runs,
            "summary": summary,
        },
    }
    lines = tables.quant_llamacpp([record])
    assert lines[2] == "| llama.cpp, plain decoding | 10.00 / 8.00 | 22.2% | 9.00 | 1.00x | 5.28 | 1.00x | - |"
    assert lines[4].startswith("| via-sd `auto` | 20.00 / 16.00 | 22.2% | 18.00 | 2.00x | ") and lines[4].endswith(
        " | 2, 5 of 5 |"
    )
    assert "its own counters: 10.00 tokens/s decoding, 100 tokens/s on the prompts (1-2 tokens)" in lines[-1]
    assert "verifier served int4 (`auto-int4`)" in lines[-1]
    assert tables.dtype(record) == "bfloat16"
    assert "### Beside llama.cpp" in tables.quant_markdown(record)


def test_the_llamacpp_part_alternates_its_children_and_records_a_missing_llama_cpp(tmp_path, monkeypatch):
    spawned = []

    def run_child(cmd):
        system = cmd[cmd.index("--child") + 1]
        spawned.append((system, json.loads(cmd[cmd.index("--prompt-ids") + 1]), cmd[cmd.index("--quantization") + 1]))
        return _llamacpp_run("llama.cpp" if system == "llamacpp" else "via-sd", 0, 1.0)

    monkeypatch.setattr(quant, "run_child", run_child)
    monkeypatch.setattr(quant, "llamacpp_prompt_ids", lambda n: [[7] * (i + 1) for i in range(n)])
    monkeypatch.setattr(quant, "llama_cpp_installed", lambda: True)
    out = tmp_path / "l"
    argv = ["bench", "--suite", "quant", "--parts", "llamacpp", "--llamacpp-prompts", "2", "--llamacpp-tokens", "4"]
    assert main([*argv, "--quantization", "int4", "--out", str(out)]) == 0
    assert [s for s, _, _ in spawned] == ["llamacpp", "viasd", "llamacpp", "viasd"]  # ABAB
    assert all(ids == [[7], [7, 7]] and q == "int4" for _, ids, q in spawned)
    res = json.loads((out / "results.json").read_text())["llamacpp"]
    assert res["order"] == ["llama.cpp", "via-sd", "llama.cpp", "via-sd"] and res["llama_cpp"]["available"]
    assert res["summary"]["auto"]["vs_llama_cpp"]["decode_tokens_per_s"] == pytest.approx(2.0)
    assert "### Beside llama.cpp" in (out / "results.md").read_text()

    monkeypatch.setattr(quant, "llama_cpp_installed", lambda: False)
    spawned.clear()
    assert main([*argv, "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())["llamacpp"]
    assert not res["llama_cpp"]["available"] and "llama-cpp-python" in res["llama_cpp"]["error"] and not spawned
    assert "Not measured: llama_cpp is not installed" in (out / "results.md").read_text()


def test_the_llamacpp_children_are_module_entry_points(monkeypatch, capsys):
    cmd = quant.llamacpp_child_command("viasd", [[1, 2]], 5, 2, "auto")
    assert cmd[:5] == [sys.executable, "-m", "viasd.bench.quant", "--child", "viasd"]
    monkeypatch.setattr(quant, "viasd_one", lambda ids, tokens, q: {"ids": ids, "n": tokens, "q": q})
    monkeypatch.setattr(quant, "llamacpp_one", lambda ids, tokens, threads: {"ids": ids, "threads": threads})
    assert quant.main(cmd[3:]) == 0
    assert json.loads(capsys.readouterr().out.strip()) == {"ids": [[1, 2]], "n": 5, "q": "auto"}
    assert quant.main(quant.llamacpp_child_command("llamacpp", [[3]], 5, 2, "auto")[3:]) == 0
    assert json.loads(capsys.readouterr().out.strip()) == {"ids": [[3]], "threads": 2}


def test_the_quality_table_compares_each_quantization_with_the_first():
    """pass@1 of `ar` per quantization (quality-suite records): inside the first's interval or not,
    and the completions equal to the first's."""

    def record(q: str, passed: int, completions: list[str]) -> dict:
        from viasd.bench.report import wilson

        p = passed / len(completions)
        runs = [
            {"method": "ar", "corpus": "humaneval", "prompt": f"HumanEval/{i}", "completion": c}
            for i, c in enumerate(completions)
        ]
        quant = [{"quantization": q, "quantization_reason": "requested"}] if q != "none" else None
        return {
            "meta": {
                "command": f"viasd bench --suite quality --greedy ar --quantization {q}",
                "runtime": {"dtype": "bfloat16", "quantization": quant},
                "corpora": {"humaneval": [r["prompt"] for r in runs]},
                "max_tokens": 160,
                "max_batch": 8,
            },
            "summary": {
                "ar": {
                    "humaneval": {
                        "pass_at_1": {"pass_at_1": p, "n_samples": len(runs), "wilson95": wilson(p, len(runs))}
                    }
                }
            },
            "runs": runs,
        }

    base = record("none", 5, list("abcdefghij"))
    lines = tables.quant_quality([base, record("int4", 6, list("abcdefghiX")), record("int8", 0, list("XXXXXXXXXX"))])
    assert lines[0].startswith(
        "| quantization | verifier served | HumanEval pass@1 [95% Wilson] | passed | within `none`'s"
    )
    assert lines[2] == "| `none` | bfloat16 | 0.500 [0.24-0.76] | 5/10 | - | - |"
    assert lines[3] == "| `int4` | int4 (`requested`) | 0.600 [0.31-0.83] | 6/10 | yes | 9/10 |"
    assert lines[4].endswith("| 0/10 | NO | 0/10 |")
    assert "the first 10 HumanEval problems, at most 160 tokens, 8 requests" in lines[-1]
