#!/usr/bin/env python
"""The engine's profiled cost curves and the break-even acceptance length of every plan.

    flock /tmp/viasd-heavy.lock python scripts/measure_costs.py run --dtype bfloat16
    flock /tmp/viasd-heavy.lock python scripts/measure_costs.py run --dtype float32
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        flock /tmp/viasd-heavy.lock python scripts/measure_costs.py run --dtype bfloat16   # emulated AVX2 CPU
    python scripts/measure_costs.py table                                                 # results.md

`run` loads the embedded pair as `viasd generate` does (prepacked linears), profiles the three
tiers (`viasd.costs.profile`, no cache: measured afresh), runs `sd` and `via` greedily on a few
HumanEval prompts for the acceptance actually reached, and writes
``docs/benchmarks/cpu/costs/costs-<dtype>-<label>.json`` (viasd.bench.machine_label: ``native``,
``avx2`` on a CPU without AVX-512, ``avx2-emulated`` with torch held to AVX2 kernels) with the raw
grid, the command, the commit and the machine.

Break-even, per row at batch B (a cycle must commit E* tokens to match `ar`, which commits one
token per C_full(B, 1) seconds; C(B, T): a forward of B rows of T tokens, viasd.costs):

    sd,  k drafts:  E* = (k C_drafter(B, 1) + C_full(B, k + 1)) / C_full(B, 1)
    via, k drafts:  E* = (k C_drafter(B, 1) + C_slim(B, k + 1) + C_full(P B, k + 1)) / C_full(B, 1)

with P the probability that a via cycle escalates. A plan pays when its measured tokens per cycle
exceed E*.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from viasd.costs import GRID as ENGINE_GRID

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "cpu" / "costs"
BATCHES = (1, 4, 16)
KS = (1, 2, 3, 4, 5)
# (rows, tokens per row): the engine's grid, a longer 1-row curve, and the blocks of BATCHES rows
GRID = tuple(sorted({*ENGINE_GRID, (1, 96), *((b, k + 1) for b in BATCHES for k in (0, *KS))}))


def break_even(grid: dict, plan: str, k: int, batch: int, escalation: float = 0.0) -> float:
    """E* of the module docstring, from a cost grid."""
    from viasd.costs import CostModel

    c = CostModel({t: [tuple(p) for p in pts] for t, pts in grid.items()})
    verify = (
        c.seconds("full", batch, k + 1)
        if plan == "sd"
        else c.seconds("slim", batch, k + 1) + c.seconds("full", escalation * batch, k + 1)
    )
    return (k * c.seconds("drafter", batch, 1) + verify) / c.seconds("full", batch, 1)


def cmd_run(args: argparse.Namespace) -> None:

    from viasd.bench import environment, humaneval, write_raw
    from viasd.config import EngineConfig, parse_params
    from viasd.costs import profile
    from viasd.llm import LLM

    llm = LLM(EngineConfig(dtype=args.dtype, threads=args.threads))
    engine = llm.engine
    model = profile(engine.verifier, engine.drafter, engine.mask, grid=GRID, repeats=args.repeats, cache_dir=None)
    measured = {}
    prompts = [llm.encode(p.text) for p in humaneval(args.prompts)]
    for mode in ("sd", "via"):
        tokens = cycles = escalations = 0
        t0 = time.perf_counter()
        for ids in prompts:
            stats = engine.complete(ids, parse_params(mode=mode, max_tokens=args.max_tokens, ignore_eos=True)).stats
            tokens, cycles, escalations = (
                tokens + stats.num_cycle_tokens,
                cycles + stats.num_drafts,
                escalations + stats.escalations,
            )
        measured[mode] = {
            "tokens_per_cycle": tokens / max(cycles, 1),
            "cycles": cycles,
            "escalation_rate": escalations / max(cycles, 1),
            "seconds": time.perf_counter() - t0,
        }
    p_esc = measured["via"]["escalation_rate"]
    table = {
        f"{plan}:k={k}@B={b}": round(break_even(model.grid, plan, k, b, p_esc), 3)
        for plan in ("sd", "via")
        for k in KS
        for b in BATCHES
    }
    record = {
        "command": "python scripts/measure_costs.py " + " ".join(sys.argv[1:]),
        "environment": environment(),
        "runtime": llm.runtime_info(),
        "mask": list(engine.mask.skipped),
        "grid": model.grid,
        "profile_seconds": model.profile_seconds,
        "measured": measured,
        "break_even": table,
        "batches": list(BATCHES),
        "ks": list(KS),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
    }
    out = write_raw(OUT, f"costs-{args.dtype}", record)
    print(f"wrote {out.relative_to(ROOT)}")


def cmd_table(args: argparse.Namespace) -> None:
    lines = [
        "# Cost curves and break-even acceptance lengths",
        "",
        "Written by `python scripts/measure_costs.py table` from the `costs-*.json` files beside it "
        "(each records its command, commit and machine). Seconds of one forward of B rows x T tokens "
        "(files from before the rows x tokens grid: one row of M tokens); "
        "E* = tokens a cycle must commit per row to match `ar` at batch B (scripts/measure_costs.py).",
        "",
    ]
    for path in sorted(OUT.glob("costs-*.json")):
        r = json.loads(path.read_text())
        env, rt = r["environment"], r["runtime"]
        lines += [
            f"## {path.stem}",
            "",
            f"- `{r['command']}`; commit {env['git_commit'][:12]}{' (dirty)' if env['git_dirty'] else ''}; "
            f"{env['cpu']}, capability {env['cpu_capability']}, {env['threads']} threads; "
            f"dtype {rt.get('dtype')} ({rt.get('dtype_reason', '')}); linears {rt.get('linear_method')}",
            "",
        ]
        heads = [f"M={p[0]}" if len(p) == 2 else f"{p[0]}x{p[1]}" for p in r["grid"]["full"]]
        lines += ["| tier | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
        for tier, pts in r["grid"].items():
            lines.append(f"| {tier} | " + " | ".join(f"{p[-1] * 1e3:.1f} ms" for p in pts) + " |")
        meas = r["measured"]
        lines += [
            "",
            f"Measured (greedy, {r['prompts']} HumanEval prompts x {r['max_tokens']} tokens): "
            f"`sd` {meas['sd']['tokens_per_cycle']:.2f} tokens per cycle, `via` "
            f"{meas['via']['tokens_per_cycle']:.2f} (escalation rate {meas['via']['escalation_rate']:.2f}).",
            "",
            "| plan | " + " | ".join(f"E* at B={b}" for b in r["batches"]) + " |",
            "|---|" + "---:|" * len(r["batches"]),
        ]
        for plan in ("sd", "via"):
            for k in r["ks"]:
                lines.append(
                    f"| {plan} k={k} | "
                    + " | ".join(f"{r['break_even'][f'{plan}:k={k}@B={b}']:.2f}" for b in r["batches"])
                    + " |"
                )
        lines.append("")
    (OUT / "results.md").write_text("\n".join(lines))
    print(f"wrote {(OUT / 'results.md').relative_to(ROOT)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    run.add_argument("--threads", type=int, default=2)
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--prompts", type=int, default=3)
    run.add_argument("--max-tokens", type=int, default=48)
    sub.add_parser("table")
    args = ap.parse_args()
    {"run": cmd_run, "table": cmd_table}[args.cmd](args)


if __name__ == "__main__":
    main()
