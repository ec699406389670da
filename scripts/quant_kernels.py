#!/usr/bin/env python
"""Weight-only quantized matmul kernels against bf16 on this CPU, per linear shape and row count.

For each (K -> N) shape of the embedded verifier (Qwen2.5-Coder-1.5B: q/o 1536 -> 1536, k/v
1536 -> 256, gate/up 1536 -> 8960, down 8960 -> 1536, lm_head 1536 -> 151936) and each row count
M of ``--rows``, times ``y [M, N] = x [M, K] @ W^T`` in bf16 activations with

* ``bf16``: ``F.linear`` on the bf16 weight;
* ``bf16_packed``: oneDNN's prepacked bf16 linear (what ``viasd.precision.optimize_linears``
  swaps in on a CPU with native bf16);
* ``int8``: ``torch._weight_int8pack_mm`` (int8 weight, one bf16 scale per output channel);
* ``int8_chunked``: the int8 weight widened to bf16 a slice of output channels at a time (a
  slice fits the caches), ``F.linear`` per slice, scaled: a dequantizing fallback that keeps no
  bf16 copy;
* ``int4_g{32,64,128}``: ``torch._weight_int4pack_mm_for_cpu`` (4-bit weight packed by
  ``torch._convert_weight_to_int4pack_for_cpu``, a scale and a zero per group of g weights);
* ``int4_dequant_g32``: the int4 weight unpacked and dequantized to bf16 in full, then ``F.linear``;
* ``torchao_int8`` / ``torchao_int4_g{32,128}``: torchao's weight-only configurations where
  torchao imports (``Int8WeightOnlyConfig``; ``Int4WeightOnlyConfig`` with its CPU packing,
  ``Int4OpaqueTensor``).

Weights are random (the kernels' speed does not depend on the values). Each (shape, M) runs every
kernel interleaved, one call of each per round after a warm-up (a pause of the machine slows one
round of all of them, not all rounds of one); the best and the median seconds are recorded.

    flock /tmp/viasd-heavy.lock .venv/bin/python scripts/quant_kernels.py --out docs/benchmarks/cpu/quant/kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {
    "q_o_proj": (1536, 1536),
    "k_v_proj": (1536, 256),
    "gate_up_proj": (1536, 8960),
    "down_proj": (8960, 1536),
    "lm_head": (1536, 151936),
}
ROWS = (1, 2, 4, 8, 16)
CHUNK_N = 512  # output channels a slice of int8_chunked widens at a time


def int4_pack(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit group quantization of w [N, K]: (q int32 [N, K] in 0..15, scale [K/g, N],
    zero [K/g, N]) with w ~ (q - 8) * scale + zero (the CPU int4 kernel's formula)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)  # [N, K/g]
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    return q, scale.t().contiguous(), zero.t().contiguous()


def runners(k: int, n: int, m: int, torchao_ok: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)  # [N, K]
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)  # [M, K]
    out = {"bf16": lambda: F.linear(x, w)}
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out["bf16_packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    scale8 = (w.float().abs().amax(1) / 127).clamp(min=1e-8)  # [N]
    q8 = (w.float() / scale8[:, None]).round().clamp(-127, 127).to(torch.int8)  # [N, K]
    s8 = scale8.to(torch.bfloat16)
    out["int8"] = lambda: torch._weight_int8pack_mm(x, q8, s8)

    def chunked():
        parts = [F.linear(x, q8[i : i + CHUNK_N].to(torch.bfloat16)) for i in range(0, n, CHUNK_N)]
        return torch.cat(parts, -1) * s8

    out["int8_chunked"] = chunked
    for group in (32, 64, 128):
        q, scale, zero = int4_pack(w, group)
        packed4 = torch._convert_weight_to_int4pack_for_cpu(q, 2)
        sz = torch.stack([scale, zero], -1).to(torch.bfloat16)  # [K/g, N, 2]
        out[f"int4_g{group}"] = (lambda p, gs, z: lambda: torch._weight_int4pack_mm_for_cpu(x, p, gs, z))(
            packed4, group, sz
        )
        if group == 32:
            nib = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)  # [N, K/2], plain layout
            sc, ze = scale.t().to(torch.bfloat16), zero.t().to(torch.bfloat16)  # [N, K/g]

            def dequant(nib=nib, sc=sc, ze=ze):
                qq = torch.stack([nib & 15, nib >> 4], -1).reshape(n, k // 32, 32).to(torch.bfloat16)
                wd = ((qq - 8) * sc[..., None] + ze[..., None]).reshape(n, k)
                return F.linear(x, wd)

            out["int4_dequant_g32"] = dequant
    if torchao_ok:
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w)
        quantize_(lin, Int8WeightOnlyConfig())
        out["torchao_int8"] = lambda: lin(x)
        for group in (32, 128):
            wt = Int4OpaqueTensor.from_hp(w, [1, group])
            out[f"torchao_int4_g{group}"] = (lambda t: lambda: F.linear(x, t))(wt)
    return out


def measure(k: int, n: int, m: int, torchao_ok: bool, budget_s: float) -> dict:
    """Best and median seconds of each kernel over interleaved rounds, about budget_s in all."""
    run = runners(k, n, m, torchao_ok)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for f in run.values():
            f()
        one_round = time.perf_counter() - t0
        rounds = max(5, min(200, int(budget_s / max(one_round, 1e-6))))
        times = {name: [] for name in run}
        for _ in range(rounds):
            for name, f in run.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
    return {
        name: {"best_s": min(ts), "median_s": statistics.median(ts), "rounds": len(ts)} for name, ts in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget-s", type=float, default=2.0, help="seconds of rounds per (shape, rows)")
    args = ap.parse_args(argv)
    torchao: dict = {"available": False}
    try:
        import torchao as ao

        torchao = {"available": True, "version": ao.__version__}
    except Exception as exc:  # noqa: BLE001 - recorded
        torchao["error"] = f"{type(exc).__name__}: {exc}"
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        for m in rows:
            seconds = measure(k, n, m, torchao["available"], args.budget_s)
            results.append({"shape": shape, "K": k, "N": n, "M": m, "kernels": seconds})
            base = seconds["bf16"]["best_s"]
            line = "  ".join(
                f"{name} {v['best_s'] * 1e3:.3f}ms({base / v['best_s']:.2f}x)" for name, v in seconds.items()
            )
            print(f"{shape} M={m}: {line}", file=sys.stderr, flush=True)
    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    doc = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "dirty": bool(
            subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
        ),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "torchao": torchao,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "activations": "bfloat16",
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


if __name__ == "__main__":
    sys.exit(main())
