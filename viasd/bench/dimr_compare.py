"""`viasd bench --suite dimr-compare`: DIMR mask artifacts scored against the evenly spaced mask and
uniformly random masks on held-out HumanEval text.

    viasd bench --suite dimr-compare --artifact viasd/masks/qwen2.5-coder-1.5b-instruct-r0.45.json \
        --heldout-tokens 512 --random 5 --out bench-out/dimr-compare

For each artifact (same verifier; its fingerprint is checked; default: every shipped artifact of
--verifier): every objective of `viasd.dimr` on the held-out text for the searched mask, the evenly
spaced mask and `--random` uniformly random masks at the same ratio (first and last layer kept).
With a drafter, forward costs for the e2e figures are measured once per ratio, after the reference
pass (`--drafter none`: no e2e figures). Writes results.json (every mask's figures) and results.md.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from viasd.bench.report import write_results

COLUMNS = ("top1", "rkl", "rkl_total", "kl", "tv", "e2e", "paper_cost")


def row(values: dict) -> dict:
    """One mask's figures from `viasd.dimr.evaluate_mask`'s values."""
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


def artifact_paths(args) -> list[str]:
    """The --artifact files, or every shipped artifact of --verifier."""
    if args.artifact:
        return list(args.artifact)
    from importlib import resources

    from viasd import dimr

    root = resources.files("viasd.masks")
    return [str(root / name) for name, art in dimr.shipped_artifacts() if art.verifier == args.verifier]


def run_dimr_compare(args) -> int:
    """Score the masks, print the table, write `--out`/results.json and results.md."""
    import torch

    from viasd import dimr
    from viasd.bench import environment
    from viasd.errors import InvalidParameterError
    from viasd.models.loader import load_causal_lm
    from viasd.runtime import LayerMask, MaskedLM

    if args.threads:
        torch.set_num_threads(args.threads)
    paths = artifact_paths(args)
    if not paths:
        raise InvalidParameterError("artifact", f"no --artifact given and no shipped artifact for {args.verifier!r}")
    arts = [(p, dimr.read_artifact(p)) for p in paths]
    drafter = None if str(args.drafter).lower() in ("none", "") else args.drafter
    t0 = time.perf_counter()
    model, tok = load_causal_lm(arts[0][1].verifier, dtype=args.dtype, device=args.device)
    vq = MaskedLM(model)
    vp = MaskedLM(load_causal_lm(drafter, dtype=args.dtype, device=args.device)[0]) if drafter else None
    cal = dimr.humaneval_calibration(
        tok, start=args.heldout_start, max_tokens=args.heldout_tokens, max_seq_tokens=args.max_seq_tokens
    )
    ref = dimr.build_reference(vq, cal, cache_policy=args.cache_policy, drafter=vp)
    print(
        f"held-out: {cal.description}; cache policy {args.cache_policy}; reference in {time.perf_counter() - t0:.0f}s",
        file=sys.stderr,
    )
    rng = random.Random(int(args.seed) if args.seed is not None else 0)
    costs_by_ratio: dict[float, dimr.Costs] = {}
    results = {
        "command": getattr(args, "command_line", None) or " ".join(sys.argv),
        "environment": environment(str(model.device)),
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
    for ratio, cost in costs_by_ratio.items():
        c = cost.to_dict()
        lines.append(
            f"\nr={ratio:g} costs (s): drafter token {c['drafter']:.4f}, slim block {c['slim']:.4f}, "
            f"full block {c['full']:.4f}, full token {c['full_token']:.4f}"
        )
    lines.append(f"\nthreads {torch.get_num_threads()}; {results['heldout']['description']}")
    table = "\n".join(lines)
    print(table)
    out = write_results(args.out, results, table + "\n")
    print(f"wrote {out}/results.json, results.md", file=sys.stderr)
    return 0
