"""`viasd bench --suite step`: where a batched decode step's time goes, the forwards and everything
outside them.

For each method (`ar`, `sd` greedy, `sd-sampled` at temperature 1) the pair decodes `--rows`
concurrent requests in one engine; after every row is prefilled, `--steps` decode steps are timed:
the step's wall time, the time inside `MaskedLM.forward_batch` (every tier), the rest (sampling,
the rules, the gate, building the batch, bookkeeping: "outside"), the tokens it committed and the
host reads it made (`viasd.bench.host_reads`).

`--before REV` measures another commit of this repository in the same run: each side runs in its
own process (a git worktree of REV for the other side), alternating after, before, after, before,
so each side has an A/A pair on the same machine. Writes `--out`/results.json (the "host work per
step" table of docs/BENCHMARKS.md reads such a file) and results.md.

    viasd bench --suite step --before HEAD~1 --rows 16 --steps 8 --out bench-out/step

This module is also run by path in the measuring process (`side`): it imports `viasd` only inside
functions, so that process measures the checkout on its path, not this one.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "def quicksort(xs):\n",
    "class Stack:\n    def __init__(self):\n",
    "def is_prime(n: int) -> bool:\n",
]
METHODS = {"ar": dict(mode="ar"), "sd": dict(mode="sd"), "sd-sampled": dict(mode="sd", temperature=1.0)}
HOST_READS = Path(__file__).resolve().parent / "host_reads.py"


def measure(rows: int, steps: int, methods: list[str], engine: dict) -> dict:
    """One side's figures, in this process (`viasd` from sys.path); `engine`: EngineConfig fields."""
    import torch

    from viasd.bench import environment
    from viasd.config import EngineConfig, parse_params
    from viasd.llm import LLM

    count_host_reads = _host_reads().count_host_reads  # (this checkout's: the other side may predate it)
    llm = LLM(EngineConfig(**{**engine, "max_batch": rows}))
    engine_ = llm.engine
    inside = [0.0]
    for lm in (engine_.verifier, engine_.drafter):
        if lm is None:
            continue
        forward = lm.forward_batch

        def timed(*args, _forward=forward, **kwargs):
            t0 = time.perf_counter()
            try:
                return _forward(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - t0

        lm.forward_batch = timed
    out = {"environment": environment(), "dtype": str(engine_.verifier.dtype), "methods": {}}
    for name in methods:
        params = parse_params(max_tokens=steps * 8 + 64, ignore_eos=True, seed=1, **METHODS[name])
        for i in range(rows):
            engine_.submit(llm.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + f"# {i}\n"), params)
        while engine_.scheduler.num_waiting or not all(r.prefilled for r in engine_.scheduler._running):
            engine_.step()
        engine_.step()  # (a first decode step: the drafter's catch-up, lazy allocations)
        records = []
        for _ in range(steps):
            inside[0] = 0.0
            with count_host_reads() as reads:
                t0 = time.perf_counter()
                chunks = engine_.step()
                wall = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for _, c in chunks)
            records.append(
                dict(wall=wall, forwards=inside[0], outside=wall - inside[0], tokens=tokens, reads=reads.total)
            )
        for r in list(engine_.scheduler._running):
            engine_.cancel(r.handle)
        engine_.scheduler.reap()
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
            f"[{(out['environment']['git_commit'] or '?')[:8]}] {name}: "
            f"{json.dumps({k: round(v, 4) for k, v in med.items()})}",
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

    spec = importlib.util.spec_from_file_location("viasd_step_host_reads", HOST_READS)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: what the measuring process runs: this file loaded by path, `viasd` from the side's checkout
_SIDE = """
import importlib.util, json, sys
repo, here, settings, out = sys.argv[1:5]
sys.path.insert(0, repo)
spec = importlib.util.spec_from_file_location("viasd_step_side", here)
step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step)
s = json.loads(settings)
record = step.measure(s["rows"], s["steps"], s["methods"], s["engine"])
open(out, "w").write(json.dumps(record, indent=1))
"""


def side(repo: Path, settings: dict) -> dict:
    """`measure` in a fresh process that imports viasd from `repo`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-c", _SIDE, str(repo), str(Path(__file__).resolve()), json.dumps(settings), f.name]
        subprocess.run(cmd, check=True, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
        return json.loads(Path(f.name).read_text())


def run_step_bench(args) -> int:
    """Both sides (or this checkout alone), twice each, alternating; writes `--out`."""
    from viasd.bench import environment
    from viasd.errors import InvalidParameterError

    root = Path(__file__).resolve().parents[2]
    methods = [m.strip() for m in (args.methods or ",".join(METHODS)).split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise InvalidParameterError("methods", f"{unknown}: the step suite measures {', '.join(METHODS)}")
    drafter = None if str(args.drafter).lower() == "none" else args.drafter
    engine = {"verifier": args.verifier, "drafter": drafter, "dtype": args.dtype, "device": args.device}
    if args.threads:
        engine["threads"] = args.threads
    settings = {"rows": args.rows, "steps": args.steps, "methods": methods, "engine": engine}
    record = {
        "command": getattr(args, "command_line", None) or " ".join(sys.argv),
        "environment": environment(),
        "rows": args.rows,
        "steps": args.steps,
        "runs": [],
    }
    worktree = None
    try:
        sides = [("after", root)]
        if args.before:
            worktree = Path(tempfile.mkdtemp(prefix="viasd-before-"))
            subprocess.run(
                ["git", "-C", str(root), "worktree", "add", "--detach", str(worktree), args.before], check=True
            )
            sides.append(("before", worktree))
        for _ in range(2):  # A/A: each side twice, alternating
            for label, repo in sides:
                record["runs"].append({"side": label, **side(repo, settings)})
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(worktree)], check=False)
    from viasd.bench.report import write_results  # (not at the top: the measuring side loads this file by path)

    table = markdown_table(record)
    print(table)
    out = write_results(args.out, record, table + "\n")
    print(f"wrote {out}/results.json, results.md", file=sys.stderr)
    return 0
