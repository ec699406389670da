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
    for r in results:
        assert {"bf16", "int8", "int8_chunked", "int4_g32", "int4_g128", "int4_dequant_g32"} <= set(r["kernels"])
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
