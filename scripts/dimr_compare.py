"""Score DIMR artifacts against the evenly spaced and random masks on held-out HumanEval text.

    python scripts/dimr_compare.py viasd/masks/qwen2.5-coder-1.5b-instruct-r0.45.json \
        --drafter qwen2.5-coder-0.5b-instruct --heldout-tokens 512 --random 5 --out docs/dimr-compare.json

For each artifact (same verifier; its fingerprint is checked): every objective of viasd.dimr on
the held-out text for the searched mask, the evenly spaced mask and `--random` uniformly random
masks at the same ratio (first and last layer kept). Forward costs for the e2e figures are
measured once per ratio, after the reference pass. Prints markdown; writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from viasd import dimr
from viasd.models.loader import load_causal_lm
from viasd.runtime import LayerMask, MaskedLM

COLUMNS = ("top1", "rkl", "rkl_total", "kl", "tv", "e2e", "paper_cost")


def row(values: dict) -> dict:
    out = {k: values[k] for k in ("top1", "rkl", "rkl_total", "kl", "tv") if k in values}
    if "e2e" in values:
        d = values["e2e_detail"]
        out.update(
            e2e=values["e2e"],
            paper_cost=d["paper_expected_cost_s"],
            escalation_rate=d["escalation_rate"],
            regions_abc=d["regions_abc"],
            sd_tokens_per_s=d["sd_tokens_per_s"],
            ar_tokens_per_s=d["ar_tokens_per_s"],
        )
    return out


def fmt(r: dict) -> str:
    return " | ".join("-" if k not in r else f"{r[k]:.4f}" if k != "rkl_total" else f"{r[k]:.1f}" for k in COLUMNS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--heldout-tokens", type=int, default=512)
    ap.add_argument("--heldout-start", type=int, default=100)
    ap.add_argument("--max-seq-tokens", type=int, default=256)
    ap.add_argument("--cache-policy", default="separate", choices=["separate", "shared"])
    ap.add_argument("--random", type=int, default=5, help="random masks per ratio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    arts = [(p, dimr.read_artifact(p)) for p in args.artifacts]
    verifier = arts[0][1].verifier
    t0 = time.perf_counter()
    model, tok = load_causal_lm(verifier, dtype=args.dtype)
    vq = MaskedLM(model)
    vp = MaskedLM(load_causal_lm(args.drafter, dtype=args.dtype)[0]) if args.drafter else None
    cal = dimr.humaneval_calibration(
        tok, start=args.heldout_start, max_tokens=args.heldout_tokens, max_seq_tokens=args.max_seq_tokens
    )
    ref = dimr.build_reference(vq, cal, cache_policy=args.cache_policy, drafter=vp)
    print(
        f"held-out: {cal.description}; cache policy {args.cache_policy}; reference in {time.perf_counter() - t0:.0f}s",
        file=sys.stderr,
    )
    rng = random.Random(args.seed)
    costs_by_ratio: dict[float, dimr.Costs] = {}
    results = {
        "command": "python " + " ".join(sys.argv),
        "heldout": cal.to_dict(),
        "cache_policy": args.cache_policy,
        "threads": torch.get_num_threads(),
        "ratios": [],
    }
    lines = ["| ratio | mask | skipped layers | " + " | ".join(COLUMNS) + " |", "|---|---|---|" + "---|" * len(COLUMNS)]
    for path, art in arts:
        searched = dimr.check_artifact(art, vq, source=path)
        L, k = vq.num_layers, len(searched.skipped)
        even = LayerMask.evenly_spaced(art.ratio, L)
        if vp is not None and art.ratio not in costs_by_ratio:  # one measurement per ratio: rows comparable
            costs_by_ratio[art.ratio] = dimr.measure_costs(vq, vp, even, repeats=7)
        costs = costs_by_ratio.get(art.ratio)
        objs = [dimr.make_objective(n, costs=costs) for n in dimr.OBJECTIVES if n != "e2e" or costs is not None]
        entry = {"artifact": str(path), "ratio": art.ratio, "costs": costs.to_dict() if costs else None, "masks": []}
        masks = [(f"searched ({art.objective['name']}, {art.trials} trials)", searched), ("evenly spaced", even)]
        for j in range(args.random):
            masks.append((f"random {j}", LayerMask.from_skipped(sorted(rng.sample(range(1, L - 1), k)), L)))
        for name, mask in masks:
            t = time.perf_counter()
            r = row(dimr.evaluate_mask(vq, ref, mask, objs))
            entry["masks"].append({"name": name, "skipped_layers": list(mask.skipped), **r})
            print(f"  r={art.ratio:g} {name}: {r} ({time.perf_counter() - t:.0f}s)", file=sys.stderr)
            if not name.startswith("random"):
                lines.append(f"| {art.ratio:g} | {name} | {list(mask.skipped)} | {fmt(r)} |")
        rand = [m for m in entry["masks"] if m["name"].startswith("random")]
        if rand:
            med = {c: statistics.median(m[c] for m in rand) for c in COLUMNS if c in rand[0]}
            entry["random_median"] = med
            lines.append(f"| {art.ratio:g} | median of {len(rand)} random | - | {fmt(med)} |")
        results["ratios"].append(entry)
    print("\n".join(lines))
    for ratio, cost in costs_by_ratio.items():
        c = cost.to_dict()
        print(
            f"\nr={ratio:g} costs (s): drafter token {c['drafter']:.4f}, slim block {c['slim']:.4f}, "
            f"full block {c['full']:.4f}, full token {c['full_token']:.4f}"
        )
    print(f"\nthreads {torch.get_num_threads()}; {results['heldout']['description']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
