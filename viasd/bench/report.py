"""Summaries of a benchmark's raw runs, the suite's targets, and the Markdown report.

Definitions (every figure is recomputed from the raw runs stored beside it in results.json):

* tokens/s of a method in one pass = its generated tokens over its wall seconds, pooled over the
  prompts of that pass (a pass = one (seed, repeat)); reported as the median over passes with
  the min and max. A ratio "A vs B" is computed per pass over the prompts both ran, then the
  median (min, max) over passes: paired, so machine drift between passes cancels.
* rejection rate, mean acceptance length, tier fractions: from the summed counters of the runs
  (`viasd.metrics` defines them); for HF assisted generation the mean acceptance length is
  generated tokens per verifier forward (each assisted cycle is one verifier forward).
* pass@1: per prompt, the share of its (seed, repeat) runs that pass; averaged over prompts.
  Its noise band is the 95% Wilson interval for n = prompts x seeds samples. A lossy method's
  pass@1 is "within noise" when it lies inside its matched baseline's band.
* agreement (T = 0 only): the share of generated tokens before the first difference from `ar`'s
  output on the same prompt (the verifier's greedy output), and the share of identical outputs.
* memory: the peak RSS of the process during the run, its growth during the run, and the bytes of
  every KV cache row the request held at its end (RequestStats.kv_bytes: valid entries, all tiers).
* CPU ms per token: this process's CPU time (all threads) per generated token: less sensitive than
  wall time to other processes taking the cores, more to threads spinning while they wait.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

COUNTERS = (
    "num_drafts",
    "num_draft_tokens",
    "num_cycle_tokens",
    "num_accepted_tokens",
    "num_rejected_tokens",
    "num_bonus_tokens",
    "slim_accepted",
    "slim_rewritten",
    "escalations",
    "escalated_tokens",
    "full_accepted",
)
MODELS = ("drafter", "slim", "full")


def _spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion p over n samples."""
    if n == 0:
        return (0.0, 1.0)
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def _passes(runs: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        out[(r["seed"], r["repeat"])].append(r)
    return out


def ratio(runs_a: list[dict], runs_b: list[dict]) -> dict | None:
    """tokens/s of A over tokens/s of B, per pass over the prompts both ran ok: median/min/max."""
    a_by, b_by = _passes(runs_a), _passes(runs_b)
    values = []
    for key, ra in a_by.items():
        ok_a = {r["prompt_index"]: r for r in ra if r["ok"]}
        ok_b = {r["prompt_index"]: r for r in b_by.get(key, []) if r["ok"]}
        common = ok_a.keys() & ok_b.keys()
        if not common:
            continue
        tps = []
        for ok in (ok_a, ok_b):
            sec = sum(ok[i]["seconds"] for i in common)
            tps.append(sum(ok[i]["generated_tokens"] for i in common) / sec if sec > 0 else None)
        if tps[0] and tps[1]:
            values.append(tps[0] / tps[1])
    return _spread(values)


def pass_at_1(runs: list[dict]) -> dict | None:
    per_prompt: dict[int, list[bool]] = defaultdict(list)
    for r in runs:
        if r["ok"] and r.get("passed") is not None:
            per_prompt[r["prompt_index"]].append(bool(r["passed"]))
    if not per_prompt:
        return None
    by_prompt = {i: sum(v) / len(v) for i, v in per_prompt.items()}
    p = statistics.mean(by_prompt.values())
    # distinct samples: at T = 0 repeats decode the same text, so count (prompt, seed) pairs
    n = len({(r["prompt_index"], r["seed"]) for r in runs if r["ok"] and r.get("passed") is not None})
    lo, hi = wilson(p, n)
    return {
        "pass_at_1": p,
        "n_prompts": len(by_prompt),
        "n_samples": n,
        "wilson95": [lo, hi],
        "per_prompt": {str(i): v for i, v in sorted(by_prompt.items())},
    }


def agreement(runs: list[dict], reference: list[dict]) -> dict | None:
    ref = {(r["prompt_index"], r["seed"], r["repeat"]): r["tokens"] for r in reference if r["ok"]}
    shares, exact = [], []
    for r in runs:
        key = (r["prompt_index"], r["seed"], r["repeat"])
        if not r["ok"] or r["temperature"] != 0 or key not in ref:
            continue
        a, b = r["tokens"], ref[key]
        n = min(len(a), len(b))
        same = next((i for i in range(n) if a[i] != b[i]), n)
        shares.append(same / n if n else 1.0)
        exact.append(a == b)
    if not shares:
        return None
    return {"prefix_share": statistics.mean(shares), "exact": statistics.mean(exact), "n": len(shares)}


def summarize_method(runs: list[dict]) -> dict[str, Any]:
    ok = [r for r in runs if r["ok"]]
    failed = [r for r in runs if not r["ok"]]
    out: dict[str, Any] = {"runs": len(runs), "failed": len(failed), "errors": sorted({r["error"] for r in failed})[:5]}
    if not ok:
        return out
    tokens = sum(r["generated_tokens"] for r in ok)
    seconds = sum(r["seconds"] for r in ok)
    per_pass = []
    for rs in _passes(ok).values():
        sec = sum(r["seconds"] for r in rs)
        per_pass.append(sum(r["generated_tokens"] for r in rs) / sec if sec > 0 else None)
    stats = [r.get("stats") or {} for r in ok]
    agg = {k: sum(s.get(k, 0) or 0 for s in stats) for k in COUNTERS}
    fw = {m: sum((s.get("forwards") or {}).get(m, 0) for s in stats) for m in MODELS}
    msec = {m: sum((s.get("seconds") or {}).get(m, 0.0) for s in stats) for m in MODELS}
    decided = agg["num_accepted_tokens"] + agg["num_rejected_tokens"]
    gate = agg["slim_accepted"] + agg["slim_rewritten"] + agg["escalations"]
    mal = agg["num_cycle_tokens"] / agg["num_drafts"] if agg["num_drafts"] else None
    ttft = [r["time_to_first_token"] for r in ok if r.get("time_to_first_token") is not None]
    kv = [r["kv_bytes"] for r in ok if r.get("kv_bytes") is not None]
    out.update(
        {
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else None,
            "tokens_per_second_per_pass": _spread(per_pass),
            "time_to_first_token": _spread(ttft),
            "mean_acceptance_length": mal,
            "rejection_rate": agg["num_rejected_tokens"] / decided if decided else None,
            "tier_fractions": {
                "accepted_by_slim": agg["slim_accepted"] / gate,
                "rewritten_by_slim": agg["slim_rewritten"] / gate,
                "escalated_to_full": agg["escalations"] / gate,
            }
            if gate
            else None,
            "full_accepted_of_escalated": agg["full_accepted"] / agg["escalated_tokens"]
            if agg["escalated_tokens"]
            else None,
            "counters": agg,
            "forwards": fw,
            "seconds_per_model": msec,
            "seconds_other": seconds - sum(msec.values()),  # sampling, gating, Python, framework overhead
            "peak_rss_bytes": max((r.get("peak_rss_bytes") or 0) for r in ok) or None,
            "peak_rss_delta_bytes": max((r.get("peak_rss_delta_bytes") or 0) for r in ok),
            "kv_bytes_max": max(kv) if kv else None,
            "peak_device_bytes": max((r.get("peak_device_bytes") or 0) for r in ok) or None,
            "pass_at_1": pass_at_1(ok),
            "cpu_seconds": sum(r.get("cpu_seconds") or 0.0 for r in ok),
            "loadavg_max": max((max(r.get("loadavg") or [0.0]) for r in ok), default=None),
        }
    )
    return out


def summarize(results: dict) -> dict[str, dict]:
    """Per method label: the figures above, ratios to `ar` and `hf`, and matched-baseline checks."""
    by_label: dict[str, list[dict]] = defaultdict(list)
    for r in results["runs"]:
        by_label[r["method"]].append(r)
    table = {m["label"]: m for m in results["methods"]}
    out: dict[str, dict] = {}
    for label, m in table.items():
        if m["alias_of"]:
            continue
        s = summarize_method(by_label.get(label, []))
        for ref in ("ar", "hf"):
            s[f"speedup_vs_{ref}"] = ratio(by_label[label], by_label[ref]) if ref in by_label else None
        s["agreement_with_ar"] = agreement(by_label[label], by_label.get("ar", []))
        out[label] = s
    for label, m in table.items():  # aliases share their target's figures
        if m["alias_of"]:
            out[label] = {**out[m["alias_of"]], "alias_of": m["alias_of"]}
    for label, m in table.items():
        mb = m.get("matched_baseline")
        s = out[label]
        if mb and mb in out and s.get("pass_at_1") and out[mb].get("pass_at_1"):
            p, b = s["pass_at_1"], out[mb]["pass_at_1"]
            lo, hi = b["wilson95"]
            s["vs_matched_baseline"] = {
                "baseline": mb,
                "delta_pass_at_1": p["pass_at_1"] - b["pass_at_1"],
                "baseline_wilson95": [lo, hi],
                "within_noise": lo <= p["pass_at_1"] <= hi,
                "prompts_better": sum(v > b["per_prompt"].get(i, v) for i, v in p["per_prompt"].items()),
                "prompts_worse": sum(v < b["per_prompt"].get(i, v) for i, v in p["per_prompt"].items()),
            }
    return out


def targets(results: dict, summary: dict) -> list[dict]:
    """The main suite's targets, evaluated on this run where the methods involved were run (T = 0):
    via >= 1.2x sd and 1.3x assisted generation, sd >= 1.0x assisted generation (tokens/s), and
    via's pass@1 within its matched baseline's noise."""
    by_label: dict[str, list[dict]] = defaultdict(list)
    for r in results["runs"]:
        by_label[r["method"]].append(r)
    alias = {m["label"]: m["alias_of"] or m["label"] for m in results["methods"]}

    def runs(label):
        return by_label.get(alias.get(label, label), [])

    out = []
    for a, b, goal in (
        ("via", "sd", 1.2),
        ("via", "hf-assisted", 1.3),
        ("via", "hf-assisted:draft=fixed", 1.3),
        ("sd", "hf-assisted", 1.0),
        ("sd", "hf-assisted:draft=fixed", 1.0),
    ):
        if runs(a) and runs(b):
            r = ratio(runs(a), runs(b))
            if r:
                out.append(
                    {
                        "target": f"{a} / {b} tokens/s >= {goal}",
                        "measured": r,
                        "met": r["median"] >= goal,
                        "by": r["median"] / goal - 1,
                    }
                )
    s = summary.get("via", {})
    if s.get("vs_matched_baseline"):
        v = s["vs_matched_baseline"]
        out.append(
            {
                "target": f"via pass@1 within the matched baseline's noise ({v['baseline']})",
                "measured": v,
                "met": v["within_noise"],
            }
        )
    return out


# ------------------------------------------------------------------------------ Markdown


def _f(x, spec=".2f", none="-") -> str:
    return none if x is None else format(x, spec)


def _spread_s(s: dict | None, spec=".2f", suffix="") -> str:
    if not s:
        return "-"
    if s["n"] == 1 or s["min"] == s["max"]:
        return f"{s['median']:{spec}}{suffix}"
    return f"{s['median']:{spec}}{suffix} [{s['min']:{spec}}-{s['max']:{spec}}]"


def markdown(results: dict, summary: dict, tgt: list[dict] | None = None) -> str:
    """The Markdown report: speed and acceptance, quality and memory, targets, failures, legend."""
    meta = results.get("meta", {})
    lines = []
    if meta:
        lines += [
            f"Command: `{meta.get('command')}`",
            "",
            f"Pair: `{meta.get('engine', {}).get('drafter')}` -> `{meta.get('engine', {}).get('verifier')}`, "
            f"dtype {meta.get('engine', {}).get('dtype')}, device {meta.get('device', 'cpu')}; "
            f"{meta.get('prompts')} prompts ({meta.get('workload')}), {meta.get('max_tokens')} tokens, "
            f"T={meta.get('temperature')}, seeds {meta.get('seeds')}, repeats {meta.get('repeats')}; "
            f"torch {meta.get('environment', {}).get('torch')}, {meta.get('environment', {}).get('threads')} threads, "
            f"commit {str(meta.get('environment', {}).get('git_commit'))[:10]}"
            f"{' (dirty)' if meta.get('environment', {}).get('git_dirty') else ''}.",
            "",
        ]
    loads = [x for r in results["runs"] for x in (r.get("loadavg") or [])]
    cores = meta.get("environment", {}).get("cpu_count")
    if loads:
        lines += [
            f"Machine load (1-min load average around the runs): {min(loads):.1f}-{max(loads):.1f}"
            + (f" on {cores} cores" if cores else "")
            + "."
            + (
                " **Other processes competed for the CPU during this run: timings are noisier than the spread shows.**"
                if cores and max(loads) > cores + 0.5
                else ""
            ),
            "",
        ]
    if results.get("stopped_early"):
        lines += [
            f"**Time budget spent: {results['stopped_early']} prompt rounds were not run** "
            "(every method ran the same prompts).",
            "",
        ]
    labels = [m["label"] for m in results["methods"]]
    lines += [
        "### Speed and acceptance",
        "",
        "| method | tok/s | vs ar | vs hf | TTFT s | mean accept len | rejection | q' accept / rewrite / escalate | "
        "forwards p / q' / q | seconds p / q' / q / other | ms per forward p / q' / q |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        s = summary[label]
        name = label + (f" (= {s['alias_of']})" if s.get("alias_of") else "")
        if "tokens" not in s:
            lines.append(f"| {name} | FAILED ({s['failed']}/{s['runs']} runs) | | | | | | | | | |")
            continue
        tf = s["tier_fractions"]
        tiers = (
            "-"
            if tf is None
            else " / ".join(_f(tf[k]) for k in ("accepted_by_slim", "rewritten_by_slim", "escalated_to_full"))
        )
        fw, sec = s["forwards"], s["seconds_per_model"]
        fail = f" ({s['failed']} failed)" if s["failed"] else ""
        lines.append(
            f"| {name}{fail} | {_spread_s(s['tokens_per_second_per_pass'])} | {_spread_s(s['speedup_vs_ar'], suffix='x')} | "
            f"{_spread_s(s['speedup_vs_hf'], suffix='x')} | {_spread_s(s['time_to_first_token'])} | "
            f"{_f(s['mean_acceptance_length'])} | {_f(s['rejection_rate'], '.3f')} | {tiers} | "
            f"{fw['drafter']} / {fw['slim']} / {fw['full']} | "
            f"{sec['drafter']:.1f} / {sec['slim']:.1f} / {sec['full']:.1f} / {s['seconds_other']:.1f} | "
            + " / ".join(_f(1000 * sec[m] / fw[m] if fw[m] else None, ".0f") for m in MODELS)
            + " |"
        )
    lines += [
        "",
        "### Quality and memory",
        "",
        "| method | pass@1 [95% CI] | vs matched baseline | agreement with ar (prefix / exact) | peak RSS MiB (growth) | KV MiB "
        "| CPU ms per token |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        s = summary[label]
        if "tokens" not in s:
            continue
        p = s.get("pass_at_1")
        pa = (
            "-"
            if not p
            else f"{p['pass_at_1']:.3f} [{p['wilson95'][0]:.2f}-{p['wilson95'][1]:.2f}] (n={p['n_samples']})"
        )
        v = s.get("vs_matched_baseline")
        vm = (
            "-"
            if not v
            else (
                f"{v['delta_pass_at_1']:+.3f} vs {v['baseline']} "
                f"({'within' if v['within_noise'] else 'OUTSIDE'} noise; "
                f"{v['prompts_better']} better / {v['prompts_worse']} worse)"
            )
        )
        ag = s.get("agreement_with_ar")
        ags = "-" if not ag else f"{ag['prefix_share']:.3f} / {ag['exact']:.2f}"
        mem = (
            "-"
            if not s["peak_rss_bytes"]
            else f"{s['peak_rss_bytes'] / 2**20:.0f} (+{s['peak_rss_delta_bytes'] / 2**20:.0f})"
        )
        kv = _f(None if s["kv_bytes_max"] is None else s["kv_bytes_max"] / 2**20, ".1f")
        cpu = _f(1000 * s["cpu_seconds"] / s["tokens"] if s.get("cpu_seconds") and s["tokens"] else None, ".0f")
        lines.append(f"| {label} | {pa} | {vm} | {ags} | {mem} | {kv} | {cpu} |")
    if tgt:
        lines += ["", "### Targets", "", "| target | measured | met |", "|---|---|---|"]
        for t in tgt:
            m = t["measured"]
            ms = (
                (_spread_s(m, suffix="x") + f" ({t['by']:+.0%} vs goal)")
                if "median" in m
                else (
                    f"{m['delta_pass_at_1']:+.3f}, band {m['baseline_wilson95'][0]:.2f}-{m['baseline_wilson95'][1]:.2f}"
                )
            )
            lines.append(f"| {t['target']} | {ms} | {'yes' if t['met'] else 'NO'} |")
    fails = [
        (label, summary[label])
        for label in labels
        if summary[label].get("failed") and not summary[label].get("alias_of")
    ]
    if fails:
        lines += ["", "### Failures", ""]
        for label, s in fails:
            lines.append(
                f"* `{label}`: {s['failed']}/{s['runs']} runs failed: " + "; ".join(f"`{e}`" for e in s["errors"])
            )
    lines += ["", "### Methods", ""]
    for m in results["methods"]:
        bits = [f"{m['kind']}"]
        if m["kind"] != "engine":
            bits.append(
                "transformers "
                + {"hf_assisted": "assisted generation", "hf_lookup": "prompt lookup"}.get(m["kind"], "generate")
            )
            if m.get("hf_draft"):
                bits.append(f"draft={m['hf_draft']}")
        if m.get("mask_info"):
            mi = m["mask_info"]
            bits.append(
                f"mask: {mi['error']}"
                if "error" in mi
                else f"mask {mi['source']}, skipped {mi['skipped_layers']} (ratio {mi['ratio']:.2f})"
            )
        if m.get("role"):
            bits.append(m["role"])
        if m.get("matched_baseline"):
            bits.append(f"matched baseline {m['matched_baseline']}")
        if m.get("alias_of"):
            bits.append(f"decodes exactly like {m['alias_of']} at these settings: not run twice")
        lines.append(f"* `{m['label']}`: " + "; ".join(bits))
    return "\n".join(lines) + "\n"


def write_results(out: str | Path, results: dict, markdown: str | None = None) -> Path:
    """A suite's results.json (and, given, results.md) in directory `out`, made if needed; `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    if markdown is not None:
        (out / "results.md").write_text(markdown)
    return out
