#!/usr/bin/env python
"""Greedy `ar` on the embedded verifier (and `sd` on the pair) per weight quantization, end to end.

For each ``--quantization`` (one fresh process each, so that no configuration runs beside
another's memory), loads the engine (``viasd.llm.LLM``, the embedded pair, ``max_batch`` 16) and
measures

* ``ar_1``: seconds a generated token at batch 1, ``(t(1 + n) - t(1)) / n`` from two greedy `ar`
  requests of 1 and 1 + n tokens on one prompt (the prompt and its first token cancel);
* ``ar_16``: generated tokens a second with 16 greedy `ar` requests decoding together (16
  prompts, ``n`` tokens each; from the first step to the last, prefill included);
* ``sd_1``: seconds a generated token of one greedy `sd` request (gamma 5) of 1 + n tokens, minus
  its 1-token run, and its agreement with `ar`'s tokens;

best of ``--repeats`` runs each, and the engine's runtime info (the quantization chosen, kernels,
bytes). The tokens of each mode are recorded so that runs can be compared.

    flock /tmp/viasd-heavy.lock .venv/bin/python scripts/quant_e2e.py --out docs/benchmarks/cpu/quant/e2e.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantization", default="none,int8,int4")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.tokens, args.repeats)))
        return 0
    runs = []
    for q in args.quantization.split(","):
        cmd = [sys.executable, __file__, "--one", q, "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = runs[-1]
        print(
            f"{q}: ar_1 {r['ar_1_s_per_token'] * 1e3:.1f} ms/token, sd_1 {r['sd_1_s_per_token'] * 1e3:.1f} ms/token "
            f"(agrees {r['sd_agrees_with_ar']:.2f}), ar_16 {r['ar_16_tokens_per_s']:.1f} tokens/s",
            file=sys.stderr,
            flush=True,
        )
    import torch

    root = Path(__file__).resolve().parent.parent
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
    doc = {
        "command": " ".join(["python", *sys.argv]),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain")),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "runs": runs,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
