"""`viasd bench --suite routes`: the bytes a step's draft data moves on each route, at `--rows`
sampled rows through a served pipeline, and what the routes that move less would be worth in
tokens/s (docs/SERVING.md, "Draft data on the wire").

A sampled block ships p, the drafter's rows [k, V] at the draft positions. `--rows` sampled `sd`
requests (temperature 1, no top-k / top-p / min-p unless given: p is dense) run at once through a
TP=1 pipeline (`Pipeline.start`: a drafter actor, a verifier actor, the engine over
`ServedExecutor`), after a short warm-up, twice (an A/A pair). The suite wraps the executor's
methods in this process (nothing in the actors changes): every `verify` phase records each row's
draft length, the encoded size of its p as the Verify request carried it, and whether a draft
token was rejected; every Propose and Verify call records its bytes (request + reply), its round
trip and the seconds its service reported. For the same steps, the bytes each route would move:

* (a) `through the engine` (what runs): drafter -> engine -> verifier rank 0, every row of p;
* (b) `drafter to verifier`: the same p, one hop;
* (c) `probability only`: each draft token's p(x~) alone, both hops; at a row's first rejected
  position the verifier returns q's row there to the drafter (V values, both hops), which samples
  the correction from norm(max(0, q - p)) itself.

A call's transport is its round trip less its service's seconds (serialisation, gRPC, the
socket); a least-squares line of transport against bytes over the pass's calls prices a byte on
this machine. (b) and (c) are estimates: their tokens/s is the pass's tokens over its wall time
less their byte saving at that price (the services' own encoding and decoding of p is inside
their seconds and not counted, so the saving is if anything understated); only (a) runs.

    viasd bench --suite routes --out docs/benchmarks/cpu/one-engine/draft-routes-avx512
    viasd bench --suite routes --rows 8 --gamma 3 --max-tokens 32 --out bench-out/routes

Writes `--out`/results.json (every step and call of both passes, the command, the commit, the
machine) and results.md (docs/SERVING.md's table reads the json).
"""

from __future__ import annotations

import asyncio
import statistics
import time

ROUTES = ("through the engine", "drafter to verifier", "probability only")
MEASURED = ROUTES[0]  # the route that runs; the others are priced from its steps
VALUE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}  # one probability on the wire, by DraftProbs.dtype
WARMUP_TOKENS = 8  # the warm-up pass's tokens per stream (the first forwards' allocations)
PASSES = 2  # an A/A pair: the spread between them beside the routes' differences


def route_bytes(step: list[dict], vocab: int, value_bytes: int = 4) -> dict[str, int]:
    """The draft data one verify phase's rows move on each route (module docstring). A row:
    {"k": draft tokens, "probs_bytes": its p as encoded, "rejected": a draft token was replaced}."""
    probs = sum(r["probs_bytes"] for r in step)
    tokens = sum(r["k"] for r in step if r["probs_bytes"])  # (greedy rows ship no p on any route)
    rejected = sum(1 for r in step if r["rejected"] and r["probs_bytes"])
    return {
        "through the engine": 2 * probs,
        "drafter to verifier": probs,
        "probability only": 2 * value_bytes * tokens + 2 * value_bytes * vocab * rejected,
    }


def per_byte(calls: list[dict]) -> tuple[float, float]:
    """Least squares over the calls of transport seconds = a + b x bytes: (a, b)."""
    xs, ys = [c["bytes"] for c in calls], [c["transport"] for c in calls]
    if len(xs) < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def summarize(run: dict, vocab: int, rows: int, value_bytes: int = 4) -> dict:
    """A pass's figures: each route's bytes per full step (every stream in the verify phase)
    and its tokens/s (measured for MEASURED; the others: its byte saving at the pass's price
    per byte taken off the wall time)."""
    full = [s for s in run["steps"] if len(s) == rows] or run["steps"]
    _, b = per_byte(run["calls"])
    per_step = [route_bytes(s, vocab, value_bytes) for s in run["steps"]]
    out = {
        "steps": len(run["steps"]),
        "full_steps": sum(1 for s in run["steps"] if len(s) == rows),
        "rejected_rows": [sum(1 for r in s if r["rejected"]) for s in full],  # per full step
        "seconds_per_mb": b * 1e6,
        "routes": {},
    }
    for route in ROUTES:
        saved = b * sum(s[MEASURED] - s[route] for s in per_step)
        out["routes"][route] = {
            "mb_per_full_step": statistics.fmean(route_bytes(s, vocab, value_bytes)[route] for s in full) / 1e6,
            "seconds_saved": saved,
            "tokens_per_s": run["tokens"] / (run["wall_s"] - saved),
        }
    return out


def summaries(record: dict) -> list[dict]:
    """`summarize` of every pass of a results record."""
    return [summarize(p, record["vocab_size"], record["rows"], record["value_bytes"]) for p in record["passes"]]


async def _pass(pipeline, prompts: list[list[int]], params, tag: str) -> dict:
    """The streams at once through the pipeline's engine; every verify phase and every Propose
    and Verify call recorded (the executor's methods wrapped for the pass, then restored)."""
    executor = pipeline.executor
    steps, calls, dtypes = [], [], set()
    verify, call = executor.verify, executor._call

    def recording_verify(rows, times):
        out = verify(rows, times)
        dtypes.update(r.probs.dtype for r in rows if r.probs is not None)
        steps.append(
            [
                {
                    "k": len(r.draft),
                    "probs_bytes": r.probs.ByteSize() if r.probs is not None else 0,  # (a DraftProbs message)
                    "rejected": bool(r.draft) and not isinstance(o, Exception) and o.num_draft_accepted < len(r.draft),
                }
                for r, o in zip(rows, out)
            ]
        )
        return out

    def recording_call(stub, component, method, request, timeout=None):
        reply, seconds = call(stub, component, method, request, timeout)
        if method in ("Propose", "Verify"):
            calls.append(
                {
                    "method": method,
                    "bytes": request.ByteSize() + reply.ByteSize(),
                    "seconds": seconds,
                    "transport": seconds - reply.times.seconds,  # (the rest is the service's own)
                }
            )
        return reply, seconds

    executor.verify, executor._call = recording_verify, recording_call
    try:

        async def stream(i: int) -> int:
            request = params.model_copy(update={"seed": i})
            chunks = pipeline.coordinator.generate(f"{tag}-{i}", prompts[i], request)
            return sum([len(c.token_ids) async for c in chunks])

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(stream(i) for i in range(len(prompts)))))
        wall = time.perf_counter() - t0
    finally:
        del executor.verify, executor._call  # (the instance attributes: the class's methods again)
    return {"tokens": tokens, "wall_s": wall, "probs_dtypes": sorted(dtypes), "steps": steps, "calls": calls}


def run_routes_bench(args, config, params) -> int:
    """`viasd bench --suite routes` (module docstring): `config` the engine's, `params` each
    stream's (its seed is the stream's index)."""
    from viasd.bench import provenance
    from viasd.bench.report import write_results
    from viasd.bench.serve import PROMPTS
    from viasd.bench.tables import routes_markdown
    from viasd.cluster.launch import local_ray
    from viasd.cluster.pipeline import Pipeline, PipelineConfig
    from viasd.precision import kernels

    rows = args.rows
    pipeline_config = PipelineConfig(engine=config, rpc_timeout_s=600)

    async def run() -> tuple[dict, list[dict]]:
        pipeline = await Pipeline.start(pipeline_config)
        try:
            if pipeline.tokenizer is None:
                raise RuntimeError("--suite routes needs a verifier with a tokenizer")
            prompts = [pipeline.tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(rows)]
            warmup = params.model_copy(update={"max_tokens": WARMUP_TOKENS})
            await _pass(pipeline, prompts, warmup, "warm-up")
            passes = []
            for i in range(PASSES):
                passes.append(await _pass(pipeline, prompts, params, f"pass-{i}"))
                p = passes[-1]
                print(f"pass {i + 1}: {p['tokens']} tokens in {p['wall_s']:.1f} s, {len(p['steps'])} steps", flush=True)
            return {**pipeline.verifier_info, "kernels": kernels(pipeline._linears())}, passes
        finally:
            await pipeline.shutdown()

    with local_ray(num_cpus=4, log_to_driver=False):
        info, passes = asyncio.run(run())
    (wire,) = {d for p in passes for d in p["probs_dtypes"]} or {"float32"}  # (sampled rows: one dtype)
    record = {
        **provenance(),
        "verifier": config.verifier,
        "drafter": config.drafter,
        "runtime": info["runtime"],
        "kernels": info["kernels"],  # both actors' linears: packed kernels, weight quantization
        "vocab_size": info["vocab_size"],
        "draft_probs_dtype": pipeline_config.draft_probs_dtype,
        "value_bytes": VALUE_BYTES[wire],  # one probability of p (and of q's row, on route (c)) on the wire
        "rows": rows,
        "params": params.model_dump(mode="json", exclude_defaults=True),
        "passes": passes,
    }
    out = write_results(args.out, record, routes_markdown(record))
    print(routes_markdown(record))
    print(f"wrote {out}/results.json")
    return 0
