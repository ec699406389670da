#!/usr/bin/env python
"""`auto` at one request, replayed offline on the prices a real run ended with: what the
engine-wide acceptance estimate reads, and what `auto` makes beside fixed `sd` and `ar`.

    python scripts/simulate_planner.py --record docs/benchmarks/cpu/load-c1-avx2/mixed-planner/results.json

The drafter's blocks are drawn with a seeded per-position acceptance (default HumanEval/0's on a
real AVX2 CPU: accepted at positions 1-5 in 12, 11, 10, 9, 9 of 14 `sd` blocks). Each tree:

* `estimate`: E[tokens] at k = 5 of the engine-wide estimate after n `sd` requests of 14 blocks,
  mean, standard deviation and 10th percentile over the seeds, beside the truth.
* `requests`: per seed, requests of 64 tokens (118-token prompts), each run as fixed `sd`
  (k = 5, its drafter prefilled) and as `auto` on one engine, in turn; a step costs the
  record's price (`CostModel` at its `prices`, not learning) times a seeded jitter of +-3%, and
  `auto`'s steps settle the planner's forecasts. Tokens per second of `auto` / `ar`, `auto` /
  `sd` and `sd` / `ar`, mean over the seeds, and the steps `auto` speculated.

`--before` runs the tree as it was: the engine-wide estimate with a request's memory
(POPULATION_DECAY = DECAY) and the margin fixed at SPECULATE_MARGIN. Writes
``docs/benchmarks/cpu/planner/simulate-<name>-<label>.json`` (viasd.bench.machine_label): the
command, the commit and the machine beside the figures. The prices are the record's; the
machine only runs the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "cpu" / "planner"
HUMANEVAL_0 = [12 / 14, 11 / 12, 10 / 11, 9 / 10, 9 / 9]
K, TOKENS, PROMPT, BLOCKS = 5, 64, 118, 14


def block(rng: random.Random, rates: list[float], k: int) -> int:
    """Draft tokens accepted in a block of k: position j is accepted with probability rates[j]."""
    accepted = 0
    while accepted < k and rng.random() < rates[min(accepted, len(rates) - 1)]:
        accepted += 1
    return accepted


def estimate(rates: list[float], requests: int, seeds: int) -> dict:
    """The engine-wide estimate's E[tokens] at k after `requests` `sd` requests, over the seeds."""
    from viasd.planner import Estimates, Plan

    values = []
    for seed in range(seeds):
        rng, engine = random.Random(seed), Estimates(population=True)
        for _ in range(requests * BLOCKS):
            a = block(rng, rates, K)
            engine.learn(Plan("sd", K), drafted=K, accepted=a, committed=a + 1, escalated=False)
        values.append(engine.acceptance.expected_tokens("model", K))
    return {
        "requests": requests,
        "mean": round(statistics.mean(values), 3),
        "sd": round(statistics.stdev(values), 3),
        "p10": round(sorted(values)[len(values) // 10], 3),
    }


def requests(costs, rates: list[float], count: int, seed: int) -> dict:
    """`count` requests as fixed `sd` then `auto`, in turn, on one engine's estimates and planner."""
    from viasd.planner import Estimates, Plan, Planner, learn_cycle, step_seconds

    rng = random.Random(seed)
    engine, planner = Estimates(population=True), Planner()
    seconds = {"sd": 0.0, "auto": 0.0}
    speculated = 0
    for _ in range(count):
        t, n = costs.seconds("drafter", 1, PROMPT), 0  # fixed `sd`: its drafter prefilled, then blocks of K
        while n < TOKENS:
            a = block(rng, rates, K)
            t += step_seconds(costs, [engine.row(gamma=K)], [Plan("sd", K)]) * rng.uniform(0.97, 1.03)
            learn_cycle([engine], Plan("sd", K), drafted=K, accepted=a, committed=a + 1, escalated=False)
            n += a + 1
        seconds["sd"] += t
        own, lag, t, n = Estimates(engine), PROMPT, 0.0, 0
        if planner.drafts_from_the_start(costs, [], own.row(gamma=K, draft_lag=lag, remaining=TOKENS)):
            t, lag = costs.seconds("drafter", 1, lag), 0
        while n < TOKENS:
            row = own.row(gamma=K, draft_lag=lag, remaining=TOKENS - n)
            (plan,) = planner.plans(costs, [row])
            if plan.kind == "ar":
                dt, committed, lag = step_seconds(costs, [row], [plan]) * rng.uniform(0.97, 1.03), 1, lag + 1
            else:
                speculated += 1
                t, lag = t + costs.seconds("drafter", 1, lag), 0  # (what the step's forecast spreads)
                row = own.row(gamma=K, remaining=TOKENS - n)
                a = block(rng, rates, plan.k)
                dt, committed = step_seconds(costs, [row], [plan]) * rng.uniform(0.97, 1.03), a + 1
                learn_cycle([engine, own], plan, drafted=plan.k, accepted=a, committed=committed, escalated=False)
            planner.settle(dt, committed)
            t, n = t + dt, n + committed
        seconds["auto"] += t
    ar = count * TOKENS * costs.seconds("full", 1, 1)
    return {
        "auto_ar": ar / seconds["auto"],
        "auto_sd": seconds["sd"] / seconds["auto"],
        "sd_ar": ar / seconds["sd"],
        "speculated": speculated,
    }


def main() -> None:
    import viasd.planner as planner
    from viasd.bench import provenance, write_raw
    from viasd.costs import Acceptance, CostModel

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", required=True, help="a load-bench results.json with an `auto` run's prices")
    ap.add_argument("--rates", default=",".join(f"{a:.4f}" for a in HUMANEVAL_0), help="acceptance per position")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=60)
    ap.add_argument("--before", action="store_true", help="the tree before: one memory, the margin fixed")
    ap.add_argument("--name", default=None, help="the raw file's stem (default after / before)")
    args = ap.parse_args()
    if args.before:
        Acceptance.POPULATION_DECAY = Acceptance.DECAY
        planner.Planner.margin = lambda self, costs=None: planner.SPECULATE_MARGIN
    rates = [float(a) for a in args.rates.split(",")]
    record = json.loads((ROOT / args.record).read_text())
    prices = next(r for r in record["runs"] if r["method"] == "auto")["planner"]["prices"]
    costs = CostModel(
        {tier: [(p["rows"], p["tokens"], p["seconds"]) for p in points] for tier, points in prices.items()}, online=True
    )
    truth = 1 + sum(math.prod(rates[: i + 1]) for i in range(K))
    estimates = [estimate(rates, n, args.seeds) for n in (1, 3, 8)]
    runs = [requests(costs, rates, args.requests, seed) for seed in range(args.seeds)]
    result = {key: round(statistics.mean(r[key] for r in runs), 3) for key in ("auto_ar", "auto_sd", "sd_ar")}
    result["speculated_steps_per_request"] = round(statistics.mean(r["speculated"] for r in runs) / args.requests, 2)
    for e in estimates:
        print(
            f"after {e['requests']} sd requests: E[tokens] {e['mean']} +- {e['sd']} (p10 {e['p10']}; truth {truth:.3f})"
        )
    print(f"{args.requests} requests, {args.seeds} seeds: {result}")
    name = args.name or ("before" if args.before else "after")
    record = {**provenance(), "record": args.record, "rates": rates, "truth": round(truth, 3)}
    path = write_raw(OUT, f"simulate-{name}", {**record, "estimate": estimates, "requests": result})
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
