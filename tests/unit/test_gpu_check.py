"""scripts/gpu_check.py in its tiny CPU mode: every section runs, greedy sd equals ar, host reads are
counted, the flex and torch paged kernels agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def test_gpu_check_tiny_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert json.loads(res.stdout) == doc
    assert {
        "environment",
        "exactness",
        "host_reads",
        "throughput",
        "shard_load",
        "fp8",
        "paged_attention",
    } <= doc.keys()

    env = doc["environment"]
    assert env["device"] == "cpu" and env["torch"] and env["cpu_capability"] and env["wall_seconds"] > 0

    exact = doc["exactness"]
    assert "error" not in exact, exact.get("traceback")
    assert exact["sd_equals_ar"] is True and exact["first_mismatch"] is None
    assert exact["tokens_compared"] == exact["requests"] * exact["max_tokens"] > 0
    assert exact["sd_acceptance"] is not None and 0 < exact["sd_acceptance"] < 1  # drafts accepted and rejected

    reads = doc["host_reads"]
    assert "error" not in reads, reads.get("traceback")
    assert reads["rows"]
    for cases in reads["rows"].values():
        assert set(cases) == {f"{m}_{s}" for m in ("ar", "sd", "via") for s in ("greedy", "sampled")}
        for case in cases.values():
            assert isinstance(case["median"], int)
            assert case["per_step"] and all(isinstance(n, int) for n in case["per_step"])

    assert len(doc["throughput"]) == 2
    for pair in doc["throughput"].values():
        assert "error" not in pair, pair.get("traceback")
        assert pair["rows"]
        for rec in pair["rows"].values():
            assert rec["roofline"]["max_tokens_per_s"] is None  # no bandwidth on CPU
            assert rec["roofline"]["weight_bytes"] > 0
            for name in (
                "forward_batch",
                "transformers",
                "engine_ar",
                "engine_sd",
                "engine_ar_paged",
                "engine_sd_paged",
            ):
                assert rec[name]["tokens_per_s"] > 0, name

    shard = doc["shard_load"]  # rank 0 of 8 read its slices of a 2-layer checkpoint of 80-layer shapes
    assert "error" not in shard, shard.get("traceback")
    assert shard["tp"] == 8 and shard["layers_written"] == 2 and shard["cold_seconds"] > 0
    assert 1 / 8 < shard["rank_share"] < 0.5  # its eighth of the layers and the head, the embedding whole
    assert shard["full_checkpoint_bytes"] > 20 * shard["checkpoint_bytes"]  # (78 more layers)

    fp8 = doc["fp8"]  # one layer's linears (rank 0 of 2 here, of 8 on a GPU) in bf16 and fp8
    assert "error" not in fp8, fp8.get("traceback")
    assert fp8["tp"] == 2 and set(fp8["linears"]) == {
        *(f"{name}/2" for name in ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj")),
        "gate_proj",
    }
    for lin in fp8["linears"].values():
        assert lin["fp8_bytes"] < 0.6 * lin["bf16_bytes"]
        assert set(lin["rows"]) == {"1", "4"}
        for rec in lin["rows"].values():
            assert rec["bf16_seconds"] > 0 and rec["fp8_seconds"] > 0
            assert 0 < rec["rel_err"] < 0.1  # fp8's rounding of both operands, not a wrong product

    paged = doc["paged_attention"]  # flex (eager here) and the torch path reading the same paged caches
    assert "error" not in paged, paged.get("traceback")
    assert paged["rows"] and paged["flex"].startswith("eager")
    for steps in paged["rows"].values():
        assert set(steps) == {"decode", "verify"}
        for rec in steps.values():
            assert rec["max_rel_logit_diff"] < 1e-4 and rec["argmax_agreement"] == 1.0  # float32: rounding only
            assert rec["torch_seconds"] > 0 and rec["flex_seconds"] > 0 and rec["flex_first_call_seconds"] > 0
