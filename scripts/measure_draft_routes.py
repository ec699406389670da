"""Bytes a step's draft data moves, per route, at 16 sampled rows on a served pipeline
(docs/SERVING.md, "Draft data on the wire").

Sampled `sd` requests (temperature 1, no top-k / top-p: p is dense) run at once through a TP=1
pipeline (`Engine.over(ServedExecutor)`), twice (an A/A pair). Every verify phase is recorded:
each row's draft length, the encoded size of its p, whether a draft token was rejected. For the
same steps, the bytes each route would move:

* (a) `through the engine`: drafter -> engine -> verifier rank 0, p of every draft token (what
  runs: its bytes are the ones the calls carried);
* (b) `drafter to verifier`: the same p, one hop;
* (c) `probability only`: each draft token's p(x~) alone (4 bytes, both hops); at a row's first
  rejected position the verifier returns q's row to the drafter (4 V bytes, both hops), which
  samples the correction from norm(max(0, q - p)) itself.

Every Propose and Verify call is timed: its transport (round trip less the seconds its service
spent) against its bytes gives this machine's seconds per byte (least squares over the calls);
the time (b) and (c) would save is their byte saving at that price, and their tokens/s the run's
tokens over its wall time less that saving (an estimate: only (a) runs end to end).

    flock /tmp/viasd-heavy.lock .venv/bin/python scripts/measure_draft_routes.py \
        --out docs/benchmarks/cpu/one-engine/draft-routes-avx512.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from serve_throughput import PROMPTS  # (the same HumanEval-style prompts as the load measurement)

FLOAT = 4  # bytes of one float32 probability
ROUTES = ("through the engine", "drafter to verifier", "probability only")


def route_bytes(step: list[dict], vocab: int) -> dict[str, int]:
    """The draft data one step's rows move on each route (module docstring)."""
    probs = sum(r["probs_bytes"] for r in step)
    k = sum(r["k"] for r in step)
    rejected = sum(1 for r in step if r["rejected"])
    return {
        "through the engine": 2 * probs,
        "drafter to verifier": probs,
        "probability only": 2 * FLOAT * k + 2 * FLOAT * vocab * rejected,
    }


def per_byte(calls: list[dict]) -> tuple[float, float]:
    """Least squares transport seconds = a + b * bytes over the calls: (a, b)."""
    xs, ys = [c["bytes"] for c in calls], [c["transport"] for c in calls]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def summarize(run: dict, vocab: int, rows: int) -> dict:
    """A pass's figures: bytes per full step (every stream decoding) per route, and what each
    route's saving is worth at the pass's price per byte."""
    full = [s for s in run["steps"] if len(s) == rows]
    _, b = per_byte(run["calls"])
    tokens, wall = run["tokens"], run["wall_s"]
    all_steps = [route_bytes(s, vocab) for s in run["steps"]]
    out = {"full_steps": len(full), "steps": len(run["steps"]), "seconds_per_mb": round(b * 2**20, 5), "routes": {}}
    for route in ROUTES:
        saved = b * sum(s["through the engine"] - s[route] for s in all_steps)
        out["routes"][route] = {
            "mb_per_full_step": round(statistics.fmean(route_bytes(s, vocab)[route] for s in full) / 2**20, 3),
            "tokens_per_s": round(tokens / (wall - saved), 3),
        }
    return out


TABLE_HEADER = "| route | MB per step at {rows} rows | tokens/s (pass 1 / pass 2) |"


def markdown_table(results: dict) -> str:
    """The figures as docs/SERVING.md shows them (tests/unit/test_docs_figures.py checks the page)."""
    header = TABLE_HEADER.format(rows=results["rows"])
    lines = [header, "| --- | --- | --- |"]
    passes = results["summary"]
    for route in ROUTES:
        mb = passes[0]["routes"][route]["mb_per_full_step"]
        speeds = " / ".join(f"{p['routes'][route]['tokens_per_s']:.2f}" for p in passes)
        measured = " (measured)" if route == ROUTES[0] else " (estimated)"
        lines.append(f"| {route} | {mb:,.2f} | {speeds}{measured} |")
    return "\n".join(lines)


async def one_pass(pipeline, tokenizer, args, tag: str, max_tokens: int) -> dict:
    """The streams at once through the pipeline's engine; every verify phase and call recorded."""
    from viasd.config import parse_params

    executor = pipeline.executor
    steps, calls = [], []
    verify, call = executor.verify, executor._call

    def recording_verify(rows, times):
        out = verify(rows, times)
        steps.append(
            [
                {
                    "k": len(r.draft),
                    "probs_bytes": r.probs.ByteSize() if r.probs is not None else 0,
                    "rejected": bool(r.draft) and not isinstance(o, Exception) and o.num_draft_accepted < len(r.draft),
                }
                for r, o in zip(rows, out)
            ]
        )
        return out

    def recording_call(stub, component, method, request, timeout=None):
        reply, seconds = call(stub, component, method, request, timeout)
        if method in ("Propose", "Verify"):
            calls.append({"bytes": request.ByteSize() + reply.ByteSize(), "transport": seconds - reply.times.seconds})
        return reply, seconds

    executor.verify, executor._call = recording_verify, recording_call
    try:

        async def stream(i: int) -> int:
            ids = tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids
            params = parse_params(
                mode="sd", gamma=args.gamma, temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True
            )
            return sum([len(c.token_ids) async for c in pipeline.coordinator.generate(f"{tag}-{i}", ids, params)])

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(stream(i) for i in range(args.rows))))
        wall = time.perf_counter() - t0
    finally:
        executor.verify, executor._call = verify, call
    return {"tokens": tokens, "wall_s": round(wall, 3), "steps": steps, "calls": calls}


def main() -> None:
    import ray

    from viasd.bench import provenance
    from viasd.cluster.pipeline import Pipeline, PipelineConfig
    from viasd.config import EngineConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rows", type=int, default=16, help="streams at once")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    config = PipelineConfig(
        engine=EngineConfig(verifier=args.verifier, drafter=args.drafter, max_batch=args.rows),
        drafter_cpus=0.5,
        verifier_cpus_per_rank=0.5,
        rpc_timeout_s=600,
    )

    async def run() -> tuple[dict, list[dict]]:
        pipeline = await Pipeline.start(config)
        try:
            from transformers import AutoTokenizer

            tokenizer = pipeline.tokenizer or AutoTokenizer.from_pretrained(args.verifier)
            await one_pass(pipeline, tokenizer, args, "warm-up", 8)  # (first forwards' allocations)
            passes = [await one_pass(pipeline, tokenizer, args, f"pass-{i}", args.max_tokens) for i in range(2)]
            return pipeline.verifier_info, passes
        finally:
            await pipeline.shutdown()

    info, passes = asyncio.run(run())
    ray.shutdown()
    results = {
        **provenance(),
        "verifier": args.verifier,
        "drafter": args.drafter,
        "vocab_size": info["vocab_size"],
        "runtime": info["runtime"],
        "rows": args.rows,
        "gamma": args.gamma,
        "max_tokens": args.max_tokens,
        "passes": passes,
    }
    results["summary"] = [summarize(p, info["vocab_size"], args.rows) for p in passes]
    print(json.dumps(results["summary"], indent=2))
    print(markdown_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
