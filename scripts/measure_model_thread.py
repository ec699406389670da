#!/usr/bin/env python
"""What a second OpenMP team costs the engine's forwards (viasd.model_thread).

Loads the embedded verifier (`ar`, no drafter) with `viasd.llm.LLM`, then decodes the same
greedy request again and again, alternating two conditions in one process:

* `one team`: every forward on the model thread, the only thread with an OpenMP team (today);
* `two teams`: the same, while another thread that once ran a parallel region (a matrix
  product) stays alive, as the loading thread of an actor or a request thread that stepped the
  engine did before the model thread: its team's worker lives as long as it does, the process
  holds more OpenMP threads than CPUs, and libgomp parks threads at every barrier.

Reports per condition the seconds per token (median over the passes) and the context switches
the process's threads made per token (voluntary: a thread parked itself; involuntary: preempted).

    flock /tmp/viasd-heavy.lock python scripts/measure_model_thread.py --dtype bfloat16

Writes ``docs/benchmarks/cpu/model-thread/model-thread-<dtype>-<label>.json`` (viasd.bench.machine_label).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "cpu" / "model-thread"
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


class SecondTeam:
    """A live thread that has run one parallel region (its OpenMP team lives until it exits)."""

    def __init__(self):
        import torch

        self._ran, self._release = threading.Event(), threading.Event()

        def hold():
            x = torch.randn(1024, 1024)
            (x @ x).sum()
            self._ran.set()
            self._release.wait()

        self._thread = threading.Thread(target=hold, daemon=True)

    def __enter__(self):
        self._thread.start()
        self._ran.wait()
        return self

    def __exit__(self, *exc):
        self._release.set()
        self._thread.join()


def switches() -> tuple[int, int]:
    """(voluntary, involuntary) context switches of this process's threads so far."""
    total = [0, 0]
    for t in psutil.Process().threads():
        try:
            s = psutil.Process(t.id).num_ctx_switches()  # (Linux: a thread id is a pid for /proc)
        except psutil.Error:
            continue
        total[0] += s.voluntary
        total[1] += s.involuntary
    return total[0], total[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--passes", type=int, default=4, help="runs per condition, alternating")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    args = ap.parse_args()

    from viasd.bench import provenance, write_raw
    from viasd.config import EngineConfig, parse_params
    from viasd.llm import LLM

    llm = LLM(
        EngineConfig(
            verifier="qwen2.5-coder-1.5b-instruct", drafter=None, dtype=args.dtype, threads=args.threads, max_batch=1
        )
    )
    ids = llm.encode(PROMPT)
    params = parse_params(mode="ar", max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.complete(ids, params)  # warm-up

    def run(condition: str) -> dict:
        s0, t0 = switches(), time.perf_counter()
        res = llm.complete(ids, params)
        seconds, s1 = time.perf_counter() - t0, switches()
        n = len(res.token_ids)
        return {
            "condition": condition,
            "tokens": n,
            "seconds": round(seconds, 4),
            "voluntary_switches_per_token": round((s1[0] - s0[0]) / n, 1),
            "involuntary_switches_per_token": round((s1[1] - s0[1]) / n, 1),
        }

    runs = []
    for p in range(args.passes):
        for condition in ("one team", "two teams") if p % 2 == 0 else ("two teams", "one team"):
            if condition == "two teams":
                with SecondTeam():
                    runs.append(run(condition))
            else:
                runs.append(run(condition))
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for condition in ("one team", "two teams"):
        rs = [r for r in runs if r["condition"] == condition]
        summary[condition] = {
            "seconds_per_token_median": round(statistics.median(r["seconds"] / r["tokens"] for r in rs), 4),
            "voluntary_switches_per_token_median": round(
                statistics.median(r["voluntary_switches_per_token"] for r in rs), 1
            ),
            "involuntary_switches_per_token_median": round(
                statistics.median(r["involuntary_switches_per_token"] for r in rs), 1
            ),
        }
    one, two = summary["one team"], summary["two teams"]
    summary["two_over_one_seconds"] = round(two["seconds_per_token_median"] / one["seconds_per_token_median"], 3)
    record = {**provenance(), "runtime": llm.runtime_info(), "dtype": args.dtype, "runs": runs, "summary": summary}
    print(json.dumps(summary, indent=1))
    path = write_raw(OUT, f"model-thread-{args.dtype}", record)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
