"""What the request options of issue 17 cost: the default path (no penalty, no logprobs) against the
code before them, and penalties / logprobs against the default path, interleaved in one run.

    python scripts/bench_request_options.py --base DIR --out docs/benchmarks/cpu/request-options/run.json

DIR holds the earlier code (`git archive <commit> | tar -x -C DIR`). Each round runs one child
process per code base, alternating, on the same models and prompts; a child loads the pair once,
warms up, and decodes every case, recording seconds per generated token (greedy, ignore_eos).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def quicksort(items):", "class LRUCache:\n    def __init__(self, capacity):", "import json\n\ndef load("]
CASES = {  # name -> extra parameters (the base code knows only the first two)
    "ar": dict(mode="ar"),
    "via": dict(mode="via"),
    "via+penalties": dict(
        mode="via", presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, logit_bias={0: -1.0}
    ),
    "via+logprobs(slim)": dict(mode="via", logprobs=5, logprobs_tier="slim"),
    "via+logprobs(full)": dict(mode="via", logprobs=5, logprobs_tier="full"),
}


def child(args) -> None:
    from viasd.config import EngineConfig, parse_params
    from viasd.llm import LLM

    llm = LLM(EngineConfig(threads=args.threads))
    prompts = [llm.encode(p) for p in PROMPTS]
    names = ["ar", "via"] if args.label == "base" else list(CASES)
    llm.complete(prompts[0], parse_params(mode="via", max_tokens=8))  # warm-up
    out = {}
    for name in names:
        secs = tokens = 0.0
        for ids in prompts:
            res = llm.complete(ids, parse_params(max_tokens=args.max_tokens, ignore_eos=True, **CASES[name]))
            secs += res.stats.total_seconds
            tokens += len(res.token_ids)
        out[name] = secs / tokens
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", help="directory of the earlier code (parent run)")
    ap.add_argument("--out", help="raw JSON file to write (parent run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--label", help=argparse.SUPPRESS)  # child run: 'base' or 'branch'
    args = ap.parse_args()
    if args.label:
        return child(args)
    from viasd.bench import provenance

    runs: dict[str, list[dict]] = {"base": [], "branch": []}
    for _ in range(args.rounds):
        for label, path in (("base", args.base), ("branch", str(ROOT))):
            cmd = [
                sys.executable,
                __file__,
                "--label",
                label,
                "--max-tokens",
                str(args.max_tokens),
                "--threads",
                str(args.threads),
            ]
            res = subprocess.run(
                cmd, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, check=True
            )
            runs[label].append(json.loads(res.stdout.strip().splitlines()[-1]))
    median = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in runs.items()}
    ratio = {k: median["branch"][k] / median["base"][k] for k in median["base"]}
    ratio.update({k: median["branch"][k] / median["branch"]["via"] for k in median["branch"] if k.startswith("via+")})
    report = {
        **provenance(),
        "base_commit": Path(args.base, ".base-commit").read_text().strip()
        if Path(args.base, ".base-commit").exists()
        else None,
        "prompts": PROMPTS,
        "cases": {k: {**v} for k, v in CASES.items()},
        "max_tokens": args.max_tokens,
        "seconds_per_token": runs,
        "median_seconds_per_token": median,
        "ratios": ratio,  # ar, via: branch / base (default path); via+X: branch via+X / branch via
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"median": median, "ratios": ratio}, indent=2))


if __name__ == "__main__":
    main()
