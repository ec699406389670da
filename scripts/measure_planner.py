#!/usr/bin/env python
"""What `auto`'s planner costs a step: `Planner.plans` timed on a committed cost profile, at
1 / 4 / 8 / 16 rows, with the engine's online learning between calls (each simulated step
observes its forwards, so nothing the planner memoises outlives a step).

    flock /tmp/viasd-heavy.lock python scripts/measure_planner.py
    PYTHONPATH=<an older tree> flock /tmp/viasd-heavy.lock python scripts/measure_planner.py --name before

Each step: plan every row (the timed call), then feed the cost model what the plans would run,
at the profile's price times a seeded jitter of +-20% (the machine's noise), and each drafting
row a block accepted to a seeded depth from its own acceptance rate (0.2-0.9). Rows leave when
their 64 tokens are done and new ones join with a drafter that lags their prompt (110 tokens), as
under load. The same seed gives every tree the same steps while their plans agree. Writes
``docs/benchmarks/cpu/planner/<name>-<label>.json`` (viasd.bench.machine_label): the command,
the commit and the machine, and per row count the median and p90 milliseconds of one
`Planner.plans` call and the plans it chose.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "cpu" / "planner"


def run(profile: dict, rows: int, steps: int, seed: int) -> dict:
    from viasd.costs import Acceptance, CostModel
    from viasd.planner import Planner, RowState, step_seconds

    rng = random.Random(seed)
    costs, planner = CostModel(profile["grid"], online=True), Planner()

    def new_row() -> tuple[RowState, float]:
        row = RowState(fixed=None, gamma=5, acceptance=Acceptance(), draft_lag=110, remaining=64)
        return row, rng.uniform(0.2, 0.9)

    batch = [new_row() for _ in range(rows)]
    ms, chosen = [], Counter()
    for _ in range(steps):
        states = [r for r, _ in batch]
        t0 = time.perf_counter()
        plans = planner.plans(costs, states)
        ms.append(1e3 * (time.perf_counter() - t0))
        chosen.update(p.label for p in plans)
        seconds = step_seconds(costs, states, plans)
        for tier, n, tokens in (("full", rows, 1 + max((p.k for p in plans), default=0)), ("drafter", rows, 1)):
            costs.observe(tier, n, tokens, costs.seconds(tier, n, tokens) * rng.uniform(0.8, 1.2))
        planner.settle(seconds, rows)
        for i, ((row, rate), plan) in enumerate(zip(batch, plans)):
            committed = 1
            if plan.kind == "sd":
                accepted = 0
                while accepted < plan.k and rng.random() < rate:
                    accepted += 1
                row.acceptance.update("model", plan.k, accepted)
                row.draft_lag, committed = 0, accepted + 1
            else:
                row.draft_lag += 1
            row.remaining -= committed
            if row.remaining <= 0:
                batch[i] = new_row()
    return {
        "rows": rows,
        "steps": steps,
        "median_ms": statistics.median(ms),
        "p90_ms": statistics.quantiles(ms, n=10)[-1],
        "plans": dict(chosen),
    }


def main() -> None:
    from viasd.bench import provenance, write_raw

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="docs/benchmarks/cpu/costs/costs-bfloat16-native.json")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="after", help="the raw file's stem: which tree it measured")
    args = ap.parse_args()
    profile = json.loads((ROOT / args.profile).read_text())
    results = [run(profile, int(b), args.steps, args.seed) for b in args.rows.split(",")]
    for r in results:
        print(f"{r['rows']:>3} rows: {r['median_ms']:.2f} ms median, {r['p90_ms']:.2f} ms p90 a step")
    path = write_raw(OUT, args.name, {**provenance(), "profile": args.profile, "results": results})
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
