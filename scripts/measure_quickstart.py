#!/usr/bin/env python
"""The quick start's decode speed before and after "Never slower": `viasd generate` on the
embedded pair, 128 tokens of "def fibonacci(n):", one fresh process per configuration, passes
interleaved.

    flock /tmp/viasd-heavy.lock python scripts/measure_quickstart.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        flock /tmp/viasd-heavy.lock python scripts/measure_quickstart.py          # emulated AVX2 CPU

Configurations: `before` = the old quick start (`--mode via`, bf16, plain `F.linear`, the paper's gates); `after` =
today's (`--mode auto`, `dtype auto`, prepacked linears); `after-float32` = the same in float32 (what
`dtype auto` chose without native bf16 before its decode probe); `ar` = plain decoding with today's
precision choice; `ar-float32` = plain decoding in float32. tokens/s = generated tokens / request seconds (model loading excluded; one
untimed 8-token request first). Writes ``docs/benchmarks/cpu/quickstart/<stem>-<label>.json`` (``--stem``,
default ``quickstart``; viasd.bench.machine_label).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "cpu" / "quickstart"
PROMPT = "def fibonacci(n):"
CONFIGS = {
    "before": ({"dtype": "bfloat16", "packed_linears": False, "gates": "paper"}, {"mode": "via"}),
    "after": ({"dtype": "auto", "packed_linears": True}, {"mode": "auto"}),
    "after-float32": ({"dtype": "float32", "packed_linears": True}, {"mode": "auto"}),
    "ar": ({"dtype": "auto", "packed_linears": True}, {"mode": "ar"}),
    "ar-float32": ({"dtype": "float32", "packed_linears": True}, {"mode": "ar"}),
}


def one(name: str, max_tokens: int, threads: int) -> dict:
    """Run one configuration in this process (the child side)."""
    from viasd.config import parse_engine_config, parse_params
    from viasd.llm import LLM

    engine_kw, params_kw = CONFIGS[name]
    llm = LLM(parse_engine_config(threads=threads, **engine_kw))
    ids = llm.encode(PROMPT)
    llm.complete(ids, parse_params(max_tokens=8, **params_kw))  # warm-up
    result = llm.complete(ids, parse_params(max_tokens=max_tokens, **params_kw))
    s = result.stats
    return {
        "config": name,
        "engine": engine_kw,
        "params": params_kw,
        "runtime": llm.runtime_info(),
        "tokens": s.generated_tokens,
        "seconds": s.total_seconds,
        "tokens_per_second": s.generated_tokens / s.total_seconds,
        "plans": s.plans,
        "finish_reason": s.finish_reason,
        "mask": llm.mask_source,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stem", default="quickstart", help="raw file name: <stem>-<machine label>.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.child, args.max_tokens, args.threads)))
        return
    from viasd.bench import environment, write_raw

    runs = []
    for p in range(args.passes):
        for name in CONFIGS:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    name,
                    "--max-tokens",
                    str(args.max_tokens),
                    "--threads",
                    str(args.threads),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            runs.append({"pass": p, **json.loads(out.stdout.strip().splitlines()[-1])})
            print(f"pass {p} {name}: {runs[-1]['tokens_per_second']:.2f} tok/s", file=sys.stderr)
    median = {n: statistics.median(r["tokens_per_second"] for r in runs if r["config"] == n) for n in CONFIGS}
    record = {
        "command": "python scripts/measure_quickstart.py " + " ".join(sys.argv[1:]),
        "environment": environment(),
        "prompt": PROMPT,
        "max_tokens": args.max_tokens,
        "runs": runs,
        "median_tokens_per_second": median,
        "after_over_before": median["after"] / median["before"],
        "after_over_ar": median["after"] / median["ar"],
    }
    path = write_raw(OUT, args.stem, record)
    print(json.dumps({k: record[k] for k in ("median_tokens_per_second", "after_over_before", "after_over_ar")}))
    print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
