"""Where a batched decode step's time goes: the forwards, and everything outside them.

For each method (ar, sd greedy, sd sampled at temperature 1) the embedded pair decodes `--rows`
concurrent requests in one engine; after every row is prefilled, `--steps` decode steps are
timed: the step's wall time, the time inside `MaskedLM.forward_batch` (every tier), the rest
(sampling, the rules, the gate, building the batch, bookkeeping: "outside"), the tokens it
committed and the host reads it made (viasd.bench.host_reads).

`--before REV` measures another commit of this repository in the same run: each side runs in
its own process (a git worktree of REV for the other side), alternating after, before, after,
before, so each side has an A/A pair on the same machine. Writes one JSON file (`--out`).

    flock /tmp/viasd-heavy.lock python scripts/measure_step.py --before HEAD~1 --out step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "def quicksort(xs):\n",
    "class Stack:\n    def __init__(self):\n",
    "def is_prime(n: int) -> bool:\n",
]
METHODS = {"ar": dict(mode="ar"), "sd": dict(mode="sd"), "sd-sampled": dict(mode="sd", temperature=1.0)}


def measure(rows: int, steps: int, methods: list[str], dtype: str) -> dict:
    """One side's figures, in this process (viasd imported from sys.path)."""
    import torch

    from viasd.bench import environment

    count_host_reads = _host_reads().count_host_reads  # (this checkout's: the other side may predate it)
    from viasd.config import EngineConfig, parse_params
    from viasd.llm import LLM

    llm = LLM(EngineConfig(dtype=dtype, max_batch=rows))
    engine = llm.engine
    inside = [0.0]
    for lm in (engine.verifier, engine.drafter):
        forward = lm.forward_batch

        def timed(*args, _forward=forward, **kwargs):
            t0 = time.perf_counter()
            try:
                return _forward(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - t0

        lm.forward_batch = timed
    out = {"environment": environment(), "dtype": str(engine.verifier.dtype), "methods": {}}
    for name in methods:
        params = parse_params(max_tokens=steps * 8 + 64, ignore_eos=True, seed=1, **METHODS[name])
        for i in range(rows):
            engine.submit(llm.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + f"# {i}\n"), params)
        while engine.scheduler.num_waiting or not all(r.prefilled for r in engine.scheduler._running):
            engine.step()
        engine.step()  # (a first decode step: the drafter's catch-up, lazy allocations)
        records = []
        for _ in range(steps):
            inside[0] = 0.0
            with count_host_reads() as reads:
                t0 = time.perf_counter()
                chunks = engine.step()
                wall = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for _, c in chunks)
            records.append(
                dict(wall=wall, forwards=inside[0], outside=wall - inside[0], tokens=tokens, reads=reads.total)
            )
        for r in list(engine.scheduler._running):
            engine.cancel(r.handle)
        engine.scheduler.reap()
        med = {k: statistics.median(r[k] for r in records) for k in ("wall", "forwards", "outside", "reads")}
        out["methods"][name] = {
            "step_seconds": med["wall"],
            "forward_seconds": med["forwards"],
            "outside_seconds": med["outside"],
            "host_reads": med["reads"],
            "tokens_per_second": sum(r["tokens"] for r in records) / sum(r["wall"] for r in records),
            "steps": records,
        }
        print(
            f"[{out['environment']['git_commit'][:8]}] {name}: {json.dumps({k: round(v, 4) for k, v in med.items()})}",
            file=sys.stderr,
        )
    out["torch_threads"] = torch.get_num_threads()
    return out


def summarize(record: dict) -> dict:
    """Per side and method: the median over that side's runs of each figure (runs: A/A pairs),
    and each figure's A/A spread (max / min - 1 over the runs)."""
    out: dict = {}
    for run in record["runs"]:
        for method, m in run["methods"].items():
            out.setdefault(run["side"], {}).setdefault(method, []).append(m)
    figures = ("step_seconds", "forward_seconds", "outside_seconds", "tokens_per_second", "host_reads")
    return {
        side: {
            method: {
                **{f: statistics.median(r[f] for r in runs) for f in figures},
                "spread": {f: max(r[f] for r in runs) / min(r[f] for r in runs) - 1 for f in figures[:4]},
            }
            for method, runs in methods.items()
        }
        for side, methods in out.items()
    }


def markdown_table(record: dict) -> str:
    """The step breakdown, before and after, with each side's A/A spread of tokens/s."""
    summary = summarize(record)
    lines = [
        f"| method ({record['rows']} rows) | side | step ms | forwards ms | outside ms | host reads | tokens/s (A/A) |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in summary["after"]:
        for side in ("before", "after"):
            m = summary.get(side, {}).get(method)
            if m is None:
                continue
            lines.append(
                f"| {method} | {side} | {1e3 * m['step_seconds']:.0f} | {1e3 * m['forward_seconds']:.0f} | "
                f"{1e3 * m['outside_seconds']:.1f} | {m['host_reads']:.0f} | {m['tokens_per_second']:.1f} "
                f"(±{100 * m['spread']['tokens_per_second']:.0f}%) |"
            )
    return "\n".join(lines)


def _host_reads():
    import importlib.util

    spec = importlib.util.spec_from_file_location("host_reads", ROOT / "viasd" / "bench" / "host_reads.py")
    module = sys.modules["host_reads"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def side(repo: Path, args) -> dict:
    """Run `measure` in a fresh process that imports viasd from `repo`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [
            sys.executable,
            __file__,
            "--side",
            str(repo),
            "--rows",
            str(args.rows),
            "--steps",
            str(args.steps),
            "--methods",
            args.methods,
            "--dtype",
            args.dtype,
            "--out",
            f.name,
        ]
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(repo)})
        return json.loads(Path(f.name).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--before", help="another commit to measure in the same run (alternating, A/A pairs)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--side", help=argparse.SUPPRESS)  # (internal: one side, viasd from this repository)
    ap.add_argument("--table", action="store_true", help="print the markdown table of the --out file and exit")
    args = ap.parse_args()
    if args.table:
        print(markdown_table(json.loads(Path(args.out).read_text())))
        return 0
    if args.side:
        sys.path.insert(0, args.side)
        record = measure(args.rows, args.steps, args.methods.split(","), args.dtype)
        Path(args.out).write_text(json.dumps(record, indent=1))
        return 0
    from viasd.bench import provenance

    record = {**provenance(), "rows": args.rows, "steps": args.steps, "runs": []}
    worktree = None
    try:
        sides = [("after", ROOT)]
        if args.before:
            worktree = Path(tempfile.mkdtemp(prefix="viasd-before-"))
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.before], check=True
            )
            sides.append(("before", worktree))
        for _ in range(2):  # A/A: each side twice, alternating
            for label, repo in sides:
                record["runs"].append({"side": label, **side(repo, args)})
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
