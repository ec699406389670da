"""`viasd bench --suite quant`: weight-only quantization on this CPU, in four parts (`--parts`,
default all of them).

**kernels**: weight-only quantized matmul kernels against bf16, per linear shape and row count.
For each (K -> N) shape of the embedded verifier (Qwen2.5-Coder-1.5B: q/o 1536 -> 1536, k/v
1536 -> 256, gate/up 1536 -> 8960, down 8960 -> 1536, lm_head 1536 -> 151936; `--kernel-shapes`)
and each row count M of `--kernel-rows`, times ``y [M, N] = x [M, K] @ W^T`` in bf16 activations
with

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
* ``int4_g32_again``: ``int4_g32`` a second time in each round, on a copy of its weight, last
  (an A/A pair: the spread of the measurement);
* ``int8_a8w8``: ``viasd.quant.a8w8_matmul``, FBGEMM's dynamic int8 linear
  (``torch.ops.quantized.linear_dynamic``: the activations quantized to 8 bits as it runs, one
  scale for the call, u8 x s8 integer sums); via-sd runs it on one row at a time;
* ``int8_onednn_a8w8``: ``viasd.quant.a8w8r_matmul``, oneDNN's int8 linear
  (``torch.ops.onednn.qlinear_pointwise`` on the weight packed by ``qlinear_prepack``) on the
  activations quantized to 8 bits with a scale per row (symmetric, zero point 128): the kernel
  via-sd runs as a8w8r, at any row count;
* ``dyn_quant_4bit_g32``: torch's ``_dyn_quant_matmul_4bit`` (8-bit activations, 4-bit weights;
  KleidiAI's kernels on Arm, a reference loop elsewhere);
* ``torchao_int8`` / ``torchao_a8w8`` / ``torchao_int4_g{32,128}`` / ``torchao_da8w4_g32``:
  torchao's configurations where torchao imports (``Int8WeightOnlyConfig``;
  ``Int8DynamicActivationInt8WeightConfig``; ``Int4WeightOnlyConfig`` with its CPU packing,
  ``Int4OpaqueTensor``; ``Int8DynamicActivationInt4WeightConfig``'s ``da8w4_linear_cpu``, only
  where that kernel is built: torchao's PyPI wheels lack its CPU kernels, `--kernel-extra-ops`
  loads a build of them).

Weights are random (the kernels' speed does not depend on the values). Each (shape, M) runs every
kernel interleaved, one call of each per round after a warm-up (a pause of the machine slows one
round of all of them, not all rounds of one); the best and the median seconds are recorded, about
`--kernel-budget-s` seconds of rounds per (shape, M).

**gguf**: each built-in model of `--gguf-models` (default: the embedded pair), its quantized
linears against its GGUF file's own dequantized values. For every linear that
``viasd.quant_gguf.gguf_weights`` maps (`--gguf-scheme int4`: Q4_K / Q4_1 / Q4_0 blocks to int4
exactly, the other types requantized to int8 per channel; ``int8``: all to int8), per GGUF type:
how many, and over all of them

* ``max_abs_error``: max |W_mapped - W_gguf|, W_mapped the mapped weight dequantized in float32,
  W_gguf gguf's ``quants.dequantize`` of the tensor (transformers' row order);
* ``max_error_over_step``: that error over the channel's int8 step ``s[n]`` (int8 rounds to the
  nearest: at most 0.5);
* ``kernel_max_abs_error`` / ``kernel_max_rel_error``: the weight the integer kernel computes with
  in the dtype (`--dtype`; auto: bfloat16) (int4: ``(q - 8) * s + z`` with ``s``, ``z`` rounded
  to it; int8: ``q * s``, ``s`` rounded) against W_gguf, absolute and over max |W_gguf| of the row;
* ``loaded_equal``: whether W_gguf rounded to the loaded dtype equals the loaded weight (the
  cached conversion of the same file) for every tensor: the condition under which the engine uses
  a mapped weight.

**e2e**: greedy `ar` on the embedded verifier (and `sd` on the pair) per weight quantization, end
to end. For each of `--e2e-quantization` (one fresh process each, ``python -m viasd.bench.quant
--child Q``, so that no configuration runs beside another's memory), loads the engine
(``viasd.llm.LLM``, the embedded pair, ``max_batch`` 16) and measures

* ``ar_1``: seconds a generated token at batch 1, ``(t(1 + n) - t(1)) / n`` from two greedy `ar`
  requests of 1 and 1 + n tokens on one prompt (the prompt and its first token cancel);
* ``ar_16``: generated tokens a second with 16 greedy `ar` requests decoding together (16
  prompts, ``n`` tokens each; from the first step to the last, prefill included);
* ``sd_1``: seconds a generated token of one greedy `sd` request (gamma 5) of 1 + n tokens, minus
  its 1-token run, and its agreement with `ar`'s tokens;

best of `--e2e-repeats` runs each (n = `--e2e-tokens`), and the engine's runtime info (the
quantization chosen, kernels, bytes). The tokens of each mode are recorded so that runs can be
compared.

**llamacpp**: batch-1 decoding beside llama.cpp's on the embedded verifier's own GGUF file (its
Q4_K_M quantization), greedy, on the same prompt token ids (the first `--llamacpp-prompts` of the
e2e prompts, encoded by the verifier's tokenizer) and the same count of generated tokens
(`--llamacpp-tokens`). Where the optional ``llama_cpp`` package (llama-cpp-python) imports, one
fresh process per system and round, in ABAB order over `--llamacpp-rounds` rounds (so that the
spread between the two runs of a system, the A/A spread, is recorded):

* ``llama.cpp``: plain decoding with `--llamacpp-threads` threads (``Llama.eval`` of the prompt,
  then one token at a time, the argmax of its logits; no prompt cache);
* ``ar`` and ``auto`` of via-sd on the embedded pair at `--quantization` (default ``auto``).

Per request of k generated tokens on a prompt, ``t(k)``: the wall seconds from the prompt to the
k-th token. Decode tokens/s ``n / (t(1 + n) - t(1))`` (the prompt and its first token cancel);
tokens/s over the wall time ``(1 + n) / t(1 + n)`` (prefill included); each summed over the
prompts. llama.cpp's own counters (``llama_perf_context``: prompt and decode milliseconds) are
recorded beside them, and every system's tokens.

Writes `--out`/results.json: the command, the environment (commit, CPU capability), and one key
per part run: ``kernels``, ``gguf`` (a list, one entry per model), ``e2e``, ``llamacpp``, each in the layout of
the committed files under docs/benchmarks/cpu/quant/ (the tables of docs/QUANTIZATION.md,
`viasd.bench.tables`, read either), and results.md.

    flock /tmp/viasd-heavy.lock .venv/bin/viasd bench --suite quant --parts kernels --out bench-out/quant-kernels
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

PARTS = ("kernels", "gguf", "e2e", "llamacpp")

# ------------------------------------------------------------------ kernels

SHAPES = {
    "q_o_proj": (1536, 1536),
    "k_v_proj": (1536, 256),
    "gate_up_proj": (1536, 8960),
    "down_proj": (8960, 1536),
    "lm_head": (1536, 151936),
}
ROWS = (1, 2, 4, 8, 16)
CHUNK_N = 512  # output channels a slice of int8_chunked widens at a time


def int4_pack(w, group: int):
    """Asymmetric 4-bit group quantization of w [N, K]: (q int32 [N, K] in 0..15, scale [K/g, N],
    zero [K/g, N]) with w ~ (q - 8) * scale + zero (the CPU int4 kernel's formula)."""
    import torch

    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)  # [N, K/g]
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    return q, scale.t().contiguous(), zero.t().contiguous()


def runners(k: int, n: int, m: int, torchao_ok: bool) -> dict:
    import torch
    import torch.nn.functional as F

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
            aa = (packed4, sz)
            nib = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)  # [N, K/2], plain layout
            sc, ze = scale.t().to(torch.bfloat16), zero.t().to(torch.bfloat16)  # [N, K/g]

            def dequant(nib=nib, sc=sc, ze=ze):
                qq = torch.stack([nib & 15, nib >> 4], -1).reshape(n, k // 32, 32).to(torch.bfloat16)
                wd = ((qq - 8) * sc[..., None] + ze[..., None]).reshape(n, k)
                return F.linear(x, wd)

            out["int4_dequant_g32"] = dequant
    from viasd.quant import a8w8_available, a8w8_matmul, a8w8_pack, a8w8r_matmul, a8w8r_missing, a8w8r_pack

    if a8w8_available():
        fb = a8w8_pack(q8, s8.float())
        out["int8_a8w8"] = lambda: a8w8_matmul(x, fb)
    if a8w8r_missing() is None:  # (8-bit activations, a scale per row: via-sd's a8w8r)
        dn, s8f, z8 = a8w8r_pack(q8), s8.float(), torch.zeros(n, dtype=torch.long)
        out["int8_onednn_a8w8"] = lambda: a8w8r_matmul(x, dn, s8f, z8)
    q4, scale4, _ = int4_pack(w, 32)
    nib4 = (q4[:, 0::2] | (q4[:, 1::2] << 4)).to(torch.uint8)  # [N, K/2]
    dyn = torch.ops.aten._dyn_quant_pack_4bit_weight(nib4, scale4.t().contiguous(), None, 32, k, n)
    out["dyn_quant_4bit_g32"] = lambda: torch.ops.aten._dyn_quant_matmul_4bit(x.float(), dyn, 32, k, n).to(x.dtype)
    if torchao_ok:
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

        for name, config in (
            ("torchao_int8", Int8WeightOnlyConfig()),
            ("torchao_a8w8", Int8DynamicActivationInt8WeightConfig()),
        ):
            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
            with torch.no_grad():
                lin.weight.copy_(w)
            quantize_(lin, config)
            out[name] = (lambda mod: lambda: mod(x))(lin)
        for group in (32, 128):
            wt = Int4OpaqueTensor.from_hp(w, [1, group])
            out[f"torchao_int4_g{group}"] = (lambda t: lambda: F.linear(x, t))(wt)
        if torchao_da8w4():
            wt = Int4OpaqueTensor.from_hp_da8w4(w, 32)
            out["torchao_da8w4_g32"] = lambda: F.linear(x, wt)
    # an A/A pair: int4_g32 again, on its own copy of the weight, last in the round (not right after
    # its twin, whose weight would still be in the caches): the spread of the measurement
    p32, sz32 = aa[0].clone(), aa[1].clone()
    out["int4_g32_again"] = lambda: torch._weight_int4pack_mm_for_cpu(x, p32, 32, sz32)
    return out


def torchao_da8w4() -> bool:
    """Whether torchao's int8-activation int4-weight CPU kernel (``torchao::da8w4_linear_cpu``) is
    built: torchao's wheels on PyPI have none (it needs a build with ``USE_CPU_KERNELS=1``)."""
    import torch

    try:
        return "CPU" in torch._C._dispatch_dump("torchao::da8w4_linear_cpu")
    except RuntimeError:
        return False


def measure(k: int, n: int, m: int, torchao_ok: bool, budget_s: float) -> dict:
    """Best and median seconds of each kernel over interleaved rounds, about budget_s in all."""
    import torch

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


def run_kernels(rows: list[int], shapes: list[str], budget_s: float, extra_ops: str | None = None) -> dict:
    """The kernels part: every kernel at every (shape, M). ``extra_ops``: a library of torch ops
    loaded after torchao (its CPU kernels built from its source: ``torchao_da8w4_g32``)."""
    import torch

    from viasd.quant import a8w8_available, a8w8r_missing, cpu_model

    torchao: dict = {"available": False}
    try:
        import torchao as ao

        torchao = {"available": True, "version": ao.__version__}
        if extra_ops:
            torch.ops.load_library(extra_ops)
            torchao["extra_ops"] = Path(extra_ops).name
        torchao["da8w4_cpu_kernel"] = torchao_da8w4()
    except Exception as exc:  # noqa: BLE001 - recorded
        torchao["error"] = f"{type(exc).__name__}: {exc}"
    results = []
    for shape in shapes:
        k, n = SHAPES[shape]
        for m in rows:
            seconds = measure(k, n, m, torchao["available"], budget_s)
            results.append({"shape": shape, "K": k, "N": n, "M": m, "kernels": seconds})
            base = seconds["bf16"]["best_s"]
            line = "  ".join(
                f"{name} {v['best_s'] * 1e3:.3f}ms({base / v['best_s']:.2f}x)" for name, v in seconds.items()
            )
            print(f"{shape} M={m}: {line}", file=sys.stderr, flush=True)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "torchao": torchao,
        "fbgemm_int8": a8w8_available(),
        "onednn_int8": a8w8r_missing() is None,
        **({"onednn_int8_note": a8w8r_missing()} if a8w8r_missing() else {}),
        "cpu_vnni": bool(torch.cpu._is_vnni_supported()) if hasattr(torch.cpu, "_is_vnni_supported") else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "activations": "bfloat16",
        "budget_s": budget_s,
        "results": results,
    }


# ------------------------------------------------------------------ gguf


def check_gguf(model_name: str, scheme: str = "int4", dtype: str = "bfloat16") -> dict:
    """The gguf part for one built-in model: its mapped linears against gguf's dequantization."""
    import numpy as np
    import torch
    from gguf import GGUFReader, quants

    from viasd import quant as Q
    from viasd import quant_gguf as G
    from viasd.models.loader import load_causal_lm

    t0 = time.perf_counter()
    path = G.cached_gguf(model_name)
    model, _ = load_causal_lm(model_name, dtype=dtype)
    dt = getattr(torch, dtype)
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    mapped = G.gguf_weights(path, scheme, model.config)
    by_type: dict[str, dict] = {}
    for name, lin in model.named_modules():
        if type(lin) is not torch.nn.Linear or G.gguf_name(name) not in tensors:
            continue
        tensor = tensors[G.gguf_name(name)]
        ref = torch.from_numpy(np.array(quants.dequantize(np.asarray(tensor.data), tensor.tensor_type), np.float32))
        ref = ref.reshape(lin.weight.shape)  # [N, K]
        if model.config.model_type == "llama" and any(f".attn_{x}." in tensor.name for x in "qk"):
            heads = model.config.num_attention_heads if ".attn_q." in tensor.name else model.config.num_key_value_heads
            ref = ref[G._llama_rows(ref.shape[0], heads)]
        qw = mapped(name, lin)
        entry = by_type.setdefault(
            tensor.tensor_type.name,
            {
                "tensors": 0,
                "mapped_to": set(),
                "max_abs_error": 0.0,
                "max_error_over_step": 0.0,
                "kernel_max_abs_error": 0.0,
                "kernel_max_rel_error": 0.0,
                "loaded_equal": True,
            },
        )
        entry["tensors"] += 1
        entry["loaded_equal"] &= bool(torch.equal(ref.to(dt), lin.weight))
        if qw is None:
            entry["mapped_to"].add("none (does not match the loaded weight)")
            continue
        entry["mapped_to"].add(f"{qw.scheme}" + (f" g{qw.group}" if qw.group else "") + f" ({qw.source})")
        err = (qw.dequantize() - ref).abs()  # [N, K]
        entry["max_abs_error"] = max(entry["max_abs_error"], float(err.max()))
        if qw.scheme == "int8":
            entry["max_error_over_step"] = max(entry["max_error_over_step"], float((err / qw.scale[:, None]).max()))
        mod = Q.quantized_linear_class()(qw, None, dt)
        if qw.scheme == "int8":
            kernel_w = qw.q.float() * mod.scales.float()[:, None]
        else:
            s, z = mod.scales_zeros.float().transpose(0, 1).unbind(-1)  # [N, K/g]
            g = qw.group
            kernel_w = ((qw.q.float().reshape(*s.shape, g) - 8) * s[..., None] + z[..., None]).reshape(ref.shape)
        kerr = (kernel_w - ref).abs()
        row_max = ref.abs().amax(1, keepdim=True).clamp(min=1e-30)
        entry["kernel_max_abs_error"] = max(entry["kernel_max_abs_error"], float(kerr.max()))
        entry["kernel_max_rel_error"] = max(entry["kernel_max_rel_error"], float((kerr / row_max).max()))
    for entry in by_type.values():
        entry["mapped_to"] = sorted(entry["mapped_to"])
    return {
        "model": model_name,
        "gguf_sha256": Path(str(path) + ".sha256").read_text().strip(),
        "scheme": scheme,
        "dtype": dtype,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "by_gguf_type": by_type,
        "seconds": round(time.perf_counter() - t0, 1),
    }


# ------------------------------------------------------------------ e2e

PROMPTS = [
    "def fibonacci(n):",
    "def quicksort(xs):",
    "class LRUCache:",
    "def is_prime(n):",
    "def merge_sorted(a, b):",
    "def parse_csv(path):",
    "def binary_search(xs, x):",
    "def flatten(tree):",
]


def one(quantization: str, tokens: int, repeats: int) -> dict:
    """One quantization's e2e figures, in this process (the child of `run_e2e`)."""
    import torch

    from viasd.config import EngineConfig, parse_params
    from viasd.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(EngineConfig(quantization=quantization, max_batch=16))
    load_s = time.perf_counter() - t0
    engine = llm.engine
    ids = llm.encode(PROMPTS[0])

    def timed(mode: str, n: int) -> tuple[float, list[int]]:
        t = time.perf_counter()
        out = engine.complete(ids, parse_params(mode=mode, max_tokens=n, ignore_eos=True, gamma=5))
        return time.perf_counter() - t, out.token_ids

    out: dict = {"quantization": quantization, "load_s": round(load_s, 1), "threads": torch.get_num_threads()}
    timed("ar", 4)  # warm-up
    for mode in ("ar", "sd"):
        best = float("inf")
        for _ in range(repeats):
            t1, _ = timed(mode, 1)
            tn, toks = timed(mode, 1 + tokens)
            best = min(best, (tn - t1) / tokens)
        out[f"{mode}_1_s_per_token"] = best
        out[f"{mode}_tokens"] = toks
    out["sd_agrees_with_ar"] = sum(a == b for a, b in zip(out["sd_tokens"], out["ar_tokens"])) / len(out["ar_tokens"])
    prompts = [llm.encode(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))) for i in range(16)]
    best = float("inf")
    for _ in range(repeats):
        for p in prompts:
            engine.submit(p, parse_params(mode="ar", max_tokens=tokens, ignore_eos=True))
        t, generated = time.perf_counter(), 0
        while engine.scheduler.has_work():
            generated += sum(len(chunk.token_ids) for _, chunk in engine.step())
        best = min(best, time.perf_counter() - t)
        assert generated == 16 * tokens, generated
    out["ar_16_tokens_per_s"] = 16 * tokens / best
    out["runtime"] = llm.runtime_info()
    return out


def child_command(quantization: str, tokens: int, repeats: int) -> list[str]:
    """The fresh process of one quantization: this module's entry point, printing `one`'s JSON."""
    return [
        sys.executable,
        "-m",
        "viasd.bench.quant",
        "--child",
        quantization,
        "--tokens",
        str(tokens),
        "--repeats",
        str(repeats),
    ]


def run_child(cmd: list[str]) -> dict:
    """Run a child of this module (`cmd`) to the end; the JSON object of its last line."""
    root = Path(__file__).resolve().parents[2]  # (the child imports this checkout's viasd)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spawn(quantization: str, tokens: int, repeats: int) -> dict:
    return run_child(child_command(quantization, tokens, repeats))


def run_e2e(quantizations: list[str], tokens: int, repeats: int) -> dict:
    """The e2e part: one fresh process per quantization."""
    import torch

    runs = []
    for q in quantizations:
        runs.append(spawn(q, tokens, repeats))
        r = runs[-1]
        print(
            f"{q}: ar_1 {r['ar_1_s_per_token'] * 1e3:.1f} ms/token, sd_1 {r['sd_1_s_per_token'] * 1e3:.1f} ms/token "
            f"(agrees {r['sd_agrees_with_ar']:.2f}), ar_16 {r['ar_16_tokens_per_s']:.1f} tokens/s",
            file=sys.stderr,
            flush=True,
        )
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "tokens": tokens,
        "repeats": repeats,
        "runs": runs,
    }


# ------------------------------------------------------------------ llamacpp

#: the systems of the llamacpp part, in the order of its table
LLAMACPP_SYSTEMS = ("llama.cpp", "ar", "auto")


def llama_cpp_installed() -> bool:
    """Whether the optional llama_cpp package (llama-cpp-python, not a dependency) is installed."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llamacpp_prompt_ids(n: int) -> list[list[int]]:
    """The token ids of the first n e2e prompts, from the embedded verifier's tokenizer: both
    systems decode these very ids."""
    from viasd.llm import encode_prompt
    from viasd.models.embedded import DEFAULT_VERIFIER
    from viasd.models.loader import load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_VERIFIER)
    return [encode_prompt(tokenizer, p) for p in PROMPTS[:n]]


def llamacpp_one(prompt_ids: list[list[int]], tokens: int, threads: int) -> dict:
    """llama.cpp's plain greedy decoding of the embedded verifier's GGUF file, in this process (a
    child of `run_llamacpp`): per prompt, t(1) and t(1 + tokens), its tokens and its counters."""
    import llama_cpp
    import numpy as np

    from viasd.models.embedded import DEFAULT_VERIFIER
    from viasd.quant_gguf import cached_gguf

    path = cached_gguf(DEFAULT_VERIFIER)
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=max(map(len, prompt_ids)) + tokens + 16,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    load_s = time.perf_counter() - t0
    vocab = llm.n_vocab()

    def timed(ids: list[int], n: int) -> tuple[float, list[int], dict]:
        llm.reset()  # (eval drops the cache past n_tokens: the prompt is computed again)
        llama_cpp.llama_perf_context_reset(llm.ctx)
        t = time.perf_counter()
        llm.eval(ids)
        out: list[int] = []
        while True:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            out.append(int(np.argmax(logits)))  # greedy: the lowest id of a tie
            if len(out) == n:
                break
            llm.eval(out[-1:])
        seconds = time.perf_counter() - t
        perf = llama_cpp.llama_perf_context(llm.ctx)
        counters = {k: getattr(perf, k) for k in ("t_p_eval_ms", "n_p_eval", "t_eval_ms", "n_eval")}
        return seconds, out, counters

    timed(prompt_ids[0], 8)  # warm-up
    results = []
    for i, ids in enumerate(prompt_ids):
        t1, _, _ = timed(ids, 1)
        tn, toks, counters = timed(ids, 1 + tokens)
        results.append({"system": "llama.cpp", "prompt": i, "t_1": t1, "t_n": tn, "tokens": toks, **counters})
    return {
        "system": "llama.cpp",
        "load_s": round(load_s, 1),
        "llama_cpp": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "gguf": path.name,
        "gguf_sha256": Path(str(path) + ".sha256").read_text().strip(),
        "threads": threads,
        "results": results,
    }


def viasd_one(prompt_ids: list[list[int]], tokens: int, quantization: str) -> dict:
    """via-sd's greedy `ar` and `auto` at batch 1 on the embedded pair, in this process (a child of
    `run_llamacpp`): per prompt and mode, t(1) and t(1 + tokens), its tokens and its plans."""
    import torch

    from viasd.config import EngineConfig, parse_params
    from viasd.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(EngineConfig(quantization=quantization))
    load_s = time.perf_counter() - t0
    engine = llm.engine

    def timed(mode: str, ids: list[int], n: int):
        t = time.perf_counter()
        out = engine.complete(ids, parse_params(mode=mode, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t, out

    for mode in ("ar", "auto"):  # warm-up (and auto's costs, measured once per machine)
        timed(mode, prompt_ids[0], 8)
    results = []
    for i, ids in enumerate(prompt_ids):
        for mode in ("ar", "auto"):
            t1, _ = timed(mode, ids, 1)
            tn, out = timed(mode, ids, 1 + tokens)
            assert len(out.token_ids) == 1 + tokens, (mode, len(out.token_ids))
            stats = out.stats
            results.append(
                {
                    "system": mode,
                    "prompt": i,
                    "t_1": t1,
                    "t_n": tn,
                    "tokens": list(out.token_ids),
                    "plans": dict(getattr(stats, "plans", None) or {}),
                    "mean_acceptance_length": getattr(stats, "mean_acceptance_length", None),
                }
            )
    return {
        "system": "via-sd",
        "load_s": round(load_s, 1),
        "quantization": quantization,
        "threads": torch.get_num_threads(),
        "runtime": llm.runtime_info(),
        "results": results,
    }


def llamacpp_child_command(system: str, prompt_ids: list[list[int]], tokens: int, threads: int, quantization: str):
    """One system's fresh process: this module's entry point, printing `llamacpp_one`'s or
    `viasd_one`'s JSON."""
    return [
        sys.executable,
        "-m",
        "viasd.bench.quant",
        "--child",
        system,
        "--tokens",
        str(tokens),
        "--prompt-ids",
        json.dumps(prompt_ids),
        "--threads",
        str(threads),
        "--quantization",
        quantization,
    ]


def _agreement(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def llamacpp_summary(runs: list[dict], tokens: int) -> dict:
    """Per system: decode tokens/s and tokens/s over the wall time of each round (summed over the
    prompts), their mean and A/A spread ((max - min) / mean); each via-sd mode over llama.cpp's
    (the means); the tokens each system shares with llama.cpp's before the first difference."""
    rows: dict[str, list[list[dict]]] = {}
    for run in runs:
        per: dict[str, list[dict]] = {}
        for r in run["results"]:
            per.setdefault(r["system"], []).append(r)
        for system, rs in per.items():
            rows.setdefault(system, []).append(rs)
    out: dict[str, dict] = {}
    for system in [s for s in LLAMACPP_SYSTEMS if s in rows] + sorted(set(rows) - set(LLAMACPP_SYSTEMS)):
        rounds = rows[system]
        decode = [len(rs) * tokens / sum(r["t_n"] - r["t_1"] for r in rs) for rs in rounds]
        wall = [len(rs) * (1 + tokens) / sum(r["t_n"] for r in rs) for rs in rounds]
        entry: dict = {}
        for key, values in (("decode_tokens_per_s", decode), ("wall_tokens_per_s", wall)):
            mean = statistics.mean(values)
            entry[key] = {"rounds": values, "mean": mean, "aa_spread": (max(values) - min(values)) / mean}
        counters = [r for rs in rounds for r in rs if "t_eval_ms" in r]
        if counters:  # llama.cpp's own: decode and prompt tokens/s over every round and prompt
            entry["llama_eval_tokens_per_s"] = (
                1e3 * sum(r["n_eval"] for r in counters) / sum(r["t_eval_ms"] for r in counters)
            )
            entry["llama_prompt_tokens_per_s"] = (
                1e3 * sum(r["n_p_eval"] for r in counters) / sum(r["t_p_eval_ms"] for r in counters)
            )
        out[system] = entry
    base = out.get("llama.cpp")
    if base:
        ref = {r["prompt"]: r["tokens"] for r in rows["llama.cpp"][0]}
        for system, entry in out.items():
            entry["vs_llama_cpp"] = {
                k: entry[k]["mean"] / base[k]["mean"] for k in ("decode_tokens_per_s", "wall_tokens_per_s")
            }
            same = [_agreement(r["tokens"], ref[r["prompt"]]) for r in rows[system][0] if r["prompt"] in ref]
            entry["tokens_equal_to_llama_cpp"] = same
    return out


def run_llamacpp(n_prompts: int, tokens: int, threads: int, rounds: int, quantization: str) -> dict:
    """The llamacpp part: llama.cpp and via-sd alternating (ABAB...), one fresh process each."""
    import torch

    record: dict = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "tokens": tokens,
        "threads": threads,
        "quantization": quantization,
        "rounds": rounds,
    }
    if not llama_cpp_installed():
        record["llama_cpp"] = {"available": False, "error": "llama_cpp is not installed (pip install llama-cpp-python)"}
        print(f"llamacpp: skipped, {record['llama_cpp']['error']}", file=sys.stderr, flush=True)
        return record
    prompt_ids = llamacpp_prompt_ids(n_prompts)
    record["prompts"] = PROMPTS[:n_prompts]
    record["prompt_ids"] = prompt_ids
    record["order"], record["runs"] = [], []
    for i in range(rounds):
        for system in ("llamacpp", "viasd"):
            run = run_child(llamacpp_child_command(system, prompt_ids, tokens, threads, quantization))
            run["round"] = i
            record["order"].append(run["system"])
            record["runs"].append(run)
            line = "  ".join(
                f"{r['system']}[{r['prompt']}] {tokens / (r['t_n'] - r['t_1']):.2f} tok/s" for r in run["results"]
            )
            print(f"round {i} {run['system']}: {line}", file=sys.stderr, flush=True)
    first = next(r for r in record["runs"] if r["system"] == "llama.cpp")
    record["llama_cpp"] = {
        "available": True,
        **{k: first[k] for k in ("llama_cpp", "system_info", "gguf", "gguf_sha256")},
    }
    record["runtime"] = next(r for r in record["runs"] if r["system"] == "via-sd")["runtime"]
    record["summary"] = llamacpp_summary(record["runs"], tokens)
    return record


# ------------------------------------------------------------------ the suite


def _list(value: str | None, default) -> list[str]:
    return [x.strip() for x in (value or ",".join(map(str, default))).split(",") if x.strip()]


def run_quant_bench(args) -> int:
    """`viasd bench --suite quant`: the parts of `--parts`, one results.json in `--out`."""
    from viasd.bench import environment
    from viasd.bench.report import write_results
    from viasd.errors import InvalidParameterError

    parts = _list(args.parts, PARTS)
    if set(parts) - set(PARTS):
        raise InvalidParameterError("parts", f"{sorted(set(parts) - set(PARTS))}: the parts are {', '.join(PARTS)}")
    shapes = _list(args.kernel_shapes, SHAPES)
    if set(shapes) - set(SHAPES):
        raise InvalidParameterError("kernel_shapes", f"{sorted(set(shapes) - set(SHAPES))}: known {', '.join(SHAPES)}")
    record: dict = {
        "command": getattr(args, "command_line", None) or " ".join(sys.argv),
        "environment": environment(),
        "parts": parts,
    }
    if "kernels" in parts:
        rows = [int(r) for r in _list(args.kernel_rows, ROWS)]
        record["kernels"] = run_kernels(rows, shapes, args.kernel_budget_s, getattr(args, "kernel_extra_ops", None))
    if "gguf" in parts:
        from viasd.models.embedded import DEFAULT_DRAFTER, DEFAULT_VERIFIER

        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        models = _list(args.gguf_models, (DEFAULT_VERIFIER, DEFAULT_DRAFTER))
        record["gguf"] = [check_gguf(m, args.gguf_scheme, dtype) for m in models]
    if "e2e" in parts:
        quantizations = _list(args.e2e_quantization, ("none", "int8", "int4"))
        record["e2e"] = run_e2e(quantizations, args.e2e_tokens, args.e2e_repeats)
    if "llamacpp" in parts:
        record["llamacpp"] = run_llamacpp(
            args.llamacpp_prompts, args.llamacpp_tokens, args.llamacpp_threads, args.llamacpp_rounds, args.quantization
        )
    from viasd.bench.tables import quant_markdown

    text = quant_markdown(record)
    print(text)
    out = write_results(args.out, record, text)
    print(f"wrote {out}/results.json, results.md", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """A child process of the suite, printing one JSON line: `python -m viasd.bench.quant --child Q`
    (the e2e part: quantization Q), `--child llamacpp` / `--child viasd` (the llamacpp part)."""
    ap = argparse.ArgumentParser(
        description="one child of --suite quant: a quantization's e2e figures, or a system of the llamacpp part"
    )
    ap.add_argument("--child", required=True, help="none, int8, int4 or auto (e2e); llamacpp or viasd (llamacpp)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="e2e: runs of each measurement")
    ap.add_argument("--prompt-ids", default=None, help="llamacpp: the prompts' token ids, a JSON list of lists")
    ap.add_argument("--threads", type=int, default=2, help="llamacpp: llama.cpp's threads")
    ap.add_argument("--quantization", default="auto", help="llamacpp: via-sd's quantization")
    args = ap.parse_args(argv)
    if args.child == "llamacpp":
        result = llamacpp_one(json.loads(args.prompt_ids), args.tokens, args.threads)
    elif args.child == "viasd":
        result = viasd_one(json.loads(args.prompt_ids), args.tokens, args.quantization)
    else:
        result = one(args.child, args.tokens, args.repeats)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
