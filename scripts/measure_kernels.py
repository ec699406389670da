#!/usr/bin/env python
"""Small-M CPU matmul kernels, per-phase forwards and the sampling / gate cost, in bf16 and float32.

    flock /tmp/viasd-heavy.lock python scripts/measure_kernels.py kernels
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        flock /tmp/viasd-heavy.lock python scripts/measure_kernels.py kernels     # emulated AVX2 CPU
    flock /tmp/viasd-heavy.lock python scripts/measure_kernels.py phases          # real 1.5B verifier
    flock /tmp/viasd-heavy.lock python scripts/measure_kernels.py sampling
    python scripts/measure_kernels.py table                                       # results.md

Each command writes ``docs/benchmarks/cpu/kernels/<what>-<label>.json`` (label ``native``, or
``avx2`` when torch runs AVX2 kernels) with every raw time, the command line, the commit and
the machine; ``table`` renders ``results.md`` from all of them.

Kernels: ``linear`` (plain ``F.linear``), ``mkldnn_packed`` (weight reordered once by
``torch.ops.mkldnn._reorder_linear_weight``, run by ``torch.ops.mkldnn._linear_pointwise``: what
inductor's freezing pass emits for bf16 linears), ``mkl_packed`` (float32 only: MKL packed GEMM,
``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, what freezing emits for float32),
``compiled`` (``torch.compile`` of one ``nn.Linear`` with ``torch._inductor.config.freezing``;
only with ``--compile``, a few shapes and M values: each M compiles anew).
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

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "cpu" / "kernels"
MS = (1, 2, 4, 6, 8, 16, 32, 64)
#: (name, in_features K, out_features N): the linears of the 1.5B verifier (v.) and 0.5B drafter (d.).
SHAPES = (
    ("v.q_o", 1536, 1536),
    ("v.k_v", 1536, 256),
    ("v.gate_up", 1536, 8960),
    ("v.down", 8960, 1536),
    ("v.lm_head", 1536, 151936),
    ("d.q_o", 896, 896),
    ("d.k_v", 896, 128),
    ("d.gate_up", 896, 4864),
    ("d.down", 4864, 896),
    ("d.lm_head", 896, 151936),
)
#: One decoder layer in linears of each shape (q, o; k, v; gate, up; down).
PER_LAYER = {"q_o": 2, "k_v": 2, "gate_up": 2, "down": 1}
HEAD_MS = (1, 6, 64)  # lm_head is 0.2-0.9 GB of weights: fewer M values
DTYPES = ("float32", "bfloat16")


# ------------------------------------------------------------------------------------------------
# bookkeeping


def machine() -> dict:
    flags: set[str] = set()
    model = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model in ("", platform.processor()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    relevant = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
    return {
        "cpu_model": model,
        "flags": {f: f in flags for f in relevant},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16_supported": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "env": {
            k: os.environ.get(k)
            for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS")
        },
        "loadavg": os.getloadavg(),
    }


def header() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=False
            ).stdout.strip()
        )
    except OSError:
        commit, dirty = None, None
    return {
        "command": [Path(sys.executable).name, *sys.argv],
        "commit": commit,
        "worktree_dirty": dirty,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
    }


def label() -> str:
    return "avx2" if torch.backends.cpu.get_cpu_capability().upper() == "AVX2" else "native"


def timeit(fn, *, budget_s: float = 0.25, min_reps: int = 3, max_reps: int = 30, warmup: int = 2) -> list[float]:
    """Raw wall times (s) of ``fn()``: ``warmup`` untimed runs, then at least ``min_reps`` and
    until ``budget_s`` is spent (at most ``max_reps``)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < min_reps or (spent < budget_s and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return times


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


def write(name: str, data: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}-{label()}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path


# ------------------------------------------------------------------------------------------------
# kernels


#: Weight copies per cell span at least this many bytes, cycled call after call, so that the
#: weights stream from memory as in a real forward instead of staying in the 32 MiB L3.
COLD_BYTES = 256 << 20


class Cycle:
    """Calls ``fn(x, w_i)`` on the next of several weight copies each time."""

    def __init__(self, fn, weights):
        self.fn, self.weights, self.i = fn, weights, 0

    def __call__(self, x):
        self.i = (self.i + 1) % len(self.weights)
        return self.fn(x, self.weights[self.i])


def kernel_fns(ws: list[torch.Tensor], m: int, dtype: str):
    """{method: callable(x)} for weight copies ``ws`` [N, K] in ``dtype`` and batch ``m``."""
    fns = {"linear": Cycle(F.linear, ws)}
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
        fns["mkldnn_packed"] = Cycle(
            lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), packed
        )
    except RuntimeError as exc:
        fns["mkldnn_packed"] = exc
    if dtype == "float32" and torch.backends.mkl.is_available():
        mkl = [(torch.ops.mkl._mkl_reorder_linear_weight(w, m), w) for w in ws]
        fns["mkl_packed"] = Cycle(lambda x, p: torch.ops.mkl._mkl_linear(x, p[0], p[1], None, m), mkl)
    return fns


def compiled_fn(w: torch.Tensor):
    import torch._inductor.config as ic

    ic.freezing = True
    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 4096)
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    lin.eval()
    return torch.compile(lin, dynamic=False)


def run_kernels(args) -> None:
    data = header()
    data["what"] = "F.linear-style products x [M, K] @ w [N, K]^T per method and dtype"
    data["results"] = []
    g = torch.Generator().manual_seed(0)
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes]
    with torch.inference_mode():
        for name, k, n in shapes:
            base = torch.randn(n, k, generator=g) / k**0.5
            ms = HEAD_MS if name.endswith("lm_head") else MS
            for dtype in DTYPES:
                w = base.to(getattr(torch, dtype))
                copies = max(1, min(16, -(-COLD_BYTES // (w.numel() * w.element_size()))))
                ws = [w] + [w.clone() for _ in range(copies - 1)]
                for m in ms:
                    x = torch.randn(m, k, generator=g).to(w.dtype)
                    ref = F.linear(x, w).float()
                    for method, fn in kernel_fns(ws, m, dtype).items():
                        row = {
                            "shape": name,
                            "K": k,
                            "N": n,
                            "M": m,
                            "dtype": dtype,
                            "method": method,
                            "weight_copies": copies,
                        }
                        if isinstance(fn, Exception):
                            row["error"] = str(fn).splitlines()[0]
                        else:
                            err = (fn(x).float() - ref).abs().max().item()
                            row.update(summary(timeit(lambda: fn(x), budget_s=args.budget)), max_abs_diff=err)
                        data["results"].append(row)
                        print(json.dumps({k_: v for k_, v in row.items() if k_ != "times_s"}), flush=True)
                    del x
                if args.compile and name in ("v.gate_up", "v.down", "d.gate_up") and not name.endswith("lm_head"):
                    for m in (1, 6, 64):
                        torch._dynamo.reset()
                        x = torch.randn(m, k, generator=g).to(w.dtype)
                        row = {
                            "shape": name,
                            "K": k,
                            "N": n,
                            "M": m,
                            "dtype": dtype,
                            "method": "compiled",
                            "weight_copies": copies,
                        }
                        try:
                            t0 = time.perf_counter()
                            fns = [compiled_fn(wi) for wi in ws]
                            fn = Cycle(lambda x_, f: f(x_), fns)
                            y = fns[0](x)
                            row["compile_s"] = time.perf_counter() - t0
                            row["max_abs_diff"] = (y.float() - F.linear(x, w).float()).abs().max().item()
                            row.update(summary(timeit(lambda: fn(x), budget_s=args.budget)))
                        except Exception as exc:  # noqa: BLE001 - record why it does not compile
                            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                        data["results"].append(row)
                        print(json.dumps({k_: v for k_, v in row.items() if k_ != "times_s"}), flush=True)
                del w, ws
            del base
    write("kernels", data)


# ------------------------------------------------------------------------------------------------
# per-phase forwards of the real models


def param_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def run_phases(args) -> None:
    from viasd.models.loader import load_causal_lm
    from viasd.runtime import MaskedLM

    data = header()
    data["what"] = (
        "MaskedLM forwards: decode = 1 token after a 64-token prefix (cache), block = 6 tokens after "
        "it (cache), prefill = 64 tokens from position 0 (no cache); lm_head alone at M = 1 and 6"
    )
    data["results"] = []
    g = torch.Generator().manual_seed(0)
    for spec in args.models:
        for dtype in DTYPES:
            t0 = time.perf_counter()
            model, _ = load_causal_lm(spec, dtype=dtype)
            lm = MaskedLM(model)
            load_s = time.perf_counter() - t0
            ids = torch.randint(0, 150000, (64 + 6,), generator=g)
            prefix, block = ids[:64], ids[64:70]

            def step(tokens):
                def fn():
                    cache = lm.new_cache()  # noqa: F821
                    lm.forward(prefix, 0, cache)  # noqa: F821
                    t = time.perf_counter()
                    lm.forward(tokens, len(prefix), cache)  # noqa: F821
                    return time.perf_counter() - t

                return fn

            def cached(tokens, reps):
                step(tokens)()  # warm-up
                return [step(tokens)() for _ in range(reps)]

            for variant in ("linear", "mkldnn_packed"):
                report = None
                if variant == "mkldnn_packed":
                    from viasd.precision import optimize_linears

                    report = optimize_linears(model, dtype).as_dict()
                    if not report["linears_swapped"]:
                        break
                    lm = MaskedLM(model)  # it holds lm_head itself: rebuild after the swap
                row = {
                    "model": spec,
                    "dtype": dtype,
                    "linear": variant,
                    "optimize": report,
                    "load_s": load_s,
                    "weight_bytes": param_bytes(model),
                    "num_layers": lm.num_layers,
                }
                row["decode"] = summary(cached(block[:1], args.reps))
                row["block6"] = summary(cached(block, args.reps))
                row["prefill64"] = summary(
                    timeit(
                        lambda: lm.forward(prefix, 0),  # noqa: F821
                        budget_s=0.0,
                        min_reps=args.reps,
                        warmup=1,
                    )
                )
                with torch.inference_mode():
                    for m in (1, 6):
                        h = torch.randn(m, lm.lm_head.in_features, generator=g).to(lm.dtype)
                        row[f"lm_head_m{m}"] = summary(
                            timeit(
                                lambda: lm.lm_head(h),  # noqa: F821
                                budget_s=0.0,
                                min_reps=args.reps,
                                warmup=1,
                            )
                        )
                data["results"].append(row)
                print(
                    json.dumps({k: (v.get("median_s", v) if isinstance(v, dict) else v) for k, v in row.items()}),
                    flush=True,
                )
            del lm, model
    write("phases", data)


# ------------------------------------------------------------------------------------------------
# sampling and the gate on verifier-sized logits


def run_sampling(args) -> None:
    from viasd.rules import gate
    from viasd.sampling import Sampler

    data = header()
    data["what"] = "Sampler.probs / Sampler.gate_probs / rules.gate on [6, 151936] float32 logits"
    data["results"] = []
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 151936, generator=g) * 4
    draft = torch.randint(0, 151936, (6,), generator=g)
    with torch.inference_mode():
        for temperature in (0.0, 0.7, 1.0):
            s = Sampler(temperature=temperature)
            probs = s.probs(logits)
            q_slim = s.gate_probs(logits)
            for name, fn in (
                ("probs", lambda: s.probs(logits)),
                ("gate_probs", lambda: s.gate_probs(logits)),
                ("gate", lambda: gate(q_slim, draft, 0.9, 0.3)),
                (
                    "probs+gate_probs+gate",
                    lambda: gate(s.gate_probs(logits), draft, 0.9, 0.3) if s.probs(logits) is not None else None,
                ),
            ):
                row = {"temperature": temperature, "op": name, "probs_dtype": str(probs.dtype)}
                row.update(summary(timeit(fn, budget_s=0.3)))
                data["results"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "times_s"}), flush=True)
    write("sampling", data)


# ------------------------------------------------------------------------------------------------
# results.md


def _load(name: str) -> dict[str, dict]:
    return {lab: json.loads(p.read_text()) for lab in ("native", "avx2") if (p := OUT / f"{name}-{lab}.json").is_file()}


def _ms(row: dict | None) -> str:
    return "—" if not row or "median_s" not in row else f"{1e3 * row['median_s']:.2f}"


def run_table(args) -> None:
    lines = [
        "# Small-M CPU kernels, per-phase forwards, sampling",
        "",
        "Raw figures: `kernels-*.json`, `phases-*.json`, `sampling-*.json` beside this file "
        "(every run's times, command line, commit, machine). Made by `scripts/measure_kernels.py`; "
        "`avx2` = the same machine with `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "
        "MKL_ENABLE_INSTRUCTIONS=AVX2`. Times: median, ms. Ratio columns: time at M over time at M = 1 "
        "of the same method.",
        "",
    ]
    for lab, data in _load("kernels").items():
        mach = data["machine"]
        lines += [
            f"## Kernels, {lab}: {mach['cpu_model']}, capability {mach['cpu_capability']}, "
            f"{mach['torch_threads']} torch threads, oneDNN bf16 {mach['mkldnn_bf16_supported']}",
            "",
            f"commit `{data['commit']}` (dirty: {data['worktree_dirty']}), {data['date']}",
            "",
        ]
        rows = data["results"]
        idx = {(r["shape"], r["dtype"], r["method"], r["M"]): r for r in rows}
        methods = [
            m for m in ("linear", "mkldnn_packed", "mkl_packed", "compiled") if any(r["method"] == m for r in rows)
        ]
        for shape in dict.fromkeys(r["shape"] for r in rows):
            ms = sorted({r["M"] for r in rows if r["shape"] == shape})
            k, n = next((r["K"], r["N"]) for r in rows if r["shape"] == shape)
            lines += [
                f"### {shape} [M, {k}] x [{k}, {n}]",
                "",
                "| dtype | method | " + " | ".join(f"M={m}" for m in ms) + " | M=6 / M=1 | M=64 / M=1 |",
                "|---|---|" + "---|" * (len(ms) + 2),
            ]
            for dtype in DTYPES:
                for method in methods:
                    cells = [idx.get((shape, dtype, method, m)) for m in ms]
                    if not any(cells):
                        continue
                    if all(c is None or "error" in c for c in cells):
                        err = next(c["error"] for c in cells if c)
                        lines.append(f"| {dtype} | {method} | error: {err[:80]} |")
                        continue
                    one = idx.get((shape, dtype, method, 1))

                    def ratio(m):
                        r = idx.get((shape, dtype, method, m))
                        return (
                            "—"
                            if not (r and one and "median_s" in r and "median_s" in one)
                            else f"{r['median_s'] / one['median_s']:.2f}"
                        )

                    lines.append(
                        f"| {dtype} | {method} | "
                        + " | ".join(_ms(c) for c in cells)
                        + f" | {ratio(6)} | {ratio(64)} |"
                    )
            lines.append("")
        # one decoder layer's linears, per dtype / method
        for prefix, tier in (("v.", "verifier 1.5B"), ("d.", "drafter 0.5B")):
            lines += [
                f"### One {tier} decoder layer's linears (sum of q, k, v, o, gate, up, down), ms",
                "",
                "| dtype | method | " + " | ".join(f"M={m}" for m in MS) + " |",
                "|---|---|" + "---|" * len(MS),
            ]
            for dtype in DTYPES:
                for method in methods:
                    if method == "compiled":
                        continue
                    cells = []
                    for m in MS:
                        parts = [idx.get((prefix + s, dtype, method, m)) for s in PER_LAYER]
                        cells.append(
                            "—"
                            if any(p is None or "median_s" not in p for p in parts)
                            else f"{1e3 * sum(c * p['median_s'] for c, p in zip(PER_LAYER.values(), parts)):.1f}"
                        )
                    if any(c != "—" for c in cells):
                        lines.append(f"| {dtype} | {method} | " + " | ".join(cells) + " |")
            lines.append("")
    for lab, data in _load("phases").items():
        mach = data["machine"]
        lines += [
            f"## Per-phase forwards, {lab} (capability {mach['cpu_capability']}), ms",
            "",
            data["what"],
            "",
            "| model | dtype | linears | weights GiB | decode (1) | block (6) | prefill (64) | block / decode | "
            "lm_head M=1 | lm_head M=6 |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in data["results"]:
            lines.append(
                f"| {r['model']} | {r['dtype']} | {r.get('linear', 'linear')} | {r['weight_bytes'] / 2**30:.2f} | {_ms(r['decode'])} | "
                f"{_ms(r['block6'])} | {_ms(r['prefill64'])} | "
                f"{r['block6']['median_s'] / r['decode']['median_s']:.2f} | {_ms(r['lm_head_m1'])} | "
                f"{_ms(r['lm_head_m6'])} |"
            )
        lines.append("")
    for lab, data in _load("sampling").items():
        lines += [
            f"## Sampling and gate on [6, 151936] logits, {lab}, ms",
            "",
            "| temperature | op | ms |",
            "|---|---|---|",
        ]
        for r in data["results"]:
            lines.append(f"| {r['temperature']} | {r['op']} | {_ms(r)} |")
        lines.append("")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT / 'results.md'}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--shapes", nargs="*", help="subset of shape names (default: all)")
    k.add_argument("--budget", type=float, default=0.25, help="seconds of timed runs per cell")
    k.add_argument("--compile", action="store_true", help="also torch.compile with inductor freezing (slow)")
    p = sub.add_parser("phases")
    p.add_argument("--models", nargs="*", default=["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
    p.add_argument("--reps", type=int, default=4)
    sub.add_parser("sampling")
    sub.add_parser("table")
    args = ap.parse_args()
    {"kernels": run_kernels, "phases": run_phases, "sampling": run_sampling, "table": run_table}[args.cmd](args)


if __name__ == "__main__":
    main()
