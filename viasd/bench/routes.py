"""`viasd bench --suite routes`: what a step moves between the engine and its services on each
route of draft data, at `--rows` sampled rows through a served pipeline, and its tokens/s
(docs/SERVING.md, "Draft data on the wire").

A sampled block's rules need the drafter's p at the draft positions. `--rows` sampled `sd`
requests (temperature 1, no top-k / top-p / min-p unless given: p is dense) run at once through a
TP=1 pipeline (`Pipeline.start`: a drafter actor, a verifier actor, the engine over
`ServedExecutor`), after a short warm-up, on two routes in turn, twice (ABAB: each route's two
passes are its A/A pair):

* (a) `through the engine` (`draft_route` "rows"): p's rows [k, V], drafter -> engine -> verifier;
* (b) `drafter to verifier`: the same rows, one hop (estimated from (a)'s steps, below);
* (c) `probability only` (`draft_route` "probability", the default): p(x~) of each draft token,
  both hops; at a row's first rejected position the verifier returns q's row there, which the
  engine hands the drafter (`Correct`), which draws the token from norm(residual(p, q)) itself.

The suite wraps the executor's methods in this process (nothing in the actors changes): every
`verify` phase records each row's draft length, the encoded size of its p as the Verify request
carried it and whether a draft token was rejected, and the bytes (request + reply) of the step's
Propose, Verify and Correct calls; each call its round trip and the seconds its service reported.
A call's transport is its round trip less its service's seconds; a least-squares line of
transport against bytes over (a)'s calls prices a byte, and (b)'s tokens/s is (a)'s tokens over
its wall time less one hop of p's bytes at that price.

    viasd bench --suite routes --out docs/benchmarks/cpu/one-engine/draft-routes-avx512
    viasd bench --suite routes --rows 8 --gamma 3 --max-tokens 32 --out bench-out/routes

Writes `--out`/results.json (every step and call of every pass, the command, the commit, the
machine) and results.md (docs/SERVING.md's table reads the json).
"""

from __future__ import annotations

import asyncio
import statistics
import time

ROUTES = ("through the engine", "drafter to verifier", "probability only")
MEASURED = {"through the engine": "rows", "probability only": "probability"}  # route -> ServedExecutor.draft_route
VALUE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}  # one probability of p on the wire, by DraftProbs.dtype
WARMUP_TOKENS = 8  # the warm-up pass's tokens per stream (the first forwards' allocations)
PASSES = 2  # each route twice, alternately: the spread between a route's passes beside the routes' differences
CALLS = ("Propose", "Verify", "Correct")  # a decode step's calls


def per_byte(calls: list[dict]) -> tuple[float, float]:
    """Least squares over the calls of transport seconds = a + b x bytes: (a, b)."""
    xs, ys = [c["bytes"] for c in calls], [c["transport"] for c in calls]
    if len(xs) < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def summarize(runs: dict[str, dict], rows: int) -> dict:
    """One pass of every measured route (draft_route -> its run): each route's bytes per full step
    (every stream in the verify phase; the step's Propose, Verify and Correct calls) and tokens/s,
    (b) estimated from (a)'s steps at (a)'s price of a byte."""
    a = runs[MEASURED[ROUTES[0]]]
    _, b = per_byte(a["calls"])
    out = {"seconds_per_mb": b * 1e6, "routes": {}}
    for route, name in MEASURED.items():
        run = runs[name]
        full = [i for i, s in enumerate(run["steps"]) if len(s) == rows] or range(len(run["steps"]))
        out["routes"][route] = {
            "steps": len(run["steps"]),
            "full_steps": len(full),
            "rejected_rows": [sum(1 for r in run["steps"][i] if r["rejected"]) for i in full],
            "mb_per_full_step": statistics.fmean(run["step_bytes"][i] for i in full) / 1e6,
            "tokens_per_s": run["tokens"] / run["wall_s"],
        }
    full = [i for i, s in enumerate(a["steps"]) if len(s) == rows] or range(len(a["steps"]))
    hop = [sum(r["probs_bytes"] for r in s) for s in a["steps"]]  # p's bytes of each step, one hop
    out["routes"][ROUTES[1]] = {
        "mb_per_full_step": statistics.fmean(a["step_bytes"][i] - hop[i] for i in full) / 1e6,
        "seconds_saved": b * sum(hop),
        "tokens_per_s": a["tokens"] / (a["wall_s"] - b * sum(hop)),
    }
    return out


def summaries(record: dict) -> list[dict]:
    """`summarize` of every pass of a results record."""
    return [summarize(p, record["rows"]) for p in record["passes"]]


async def _pass(pipeline, prompts: list[list[int]], params, tag: str, route: str) -> dict:
    """The streams at once through the pipeline's engine on `route`; every verify phase and every
    call of a decode step recorded (the executor's methods wrapped for the pass, then restored)."""
    executor = pipeline.executor
    steps, step_bytes, calls, dtypes, since = [], [], [], set(), [0]
    verify, call = executor.verify, executor._call

    def recording_verify(rows, times):
        out = verify(rows, times)  # (its Correct calls included)
        dtypes.update(r.probs.dtype for r in rows if r.probs is not None and not isinstance(r.probs, list))
        steps.append(
            [
                {
                    "k": len(r.draft),
                    "probs_bytes": r.probs.ByteSize() if r.probs is not None and not isinstance(r.probs, list) else 0,
                    "rejected": bool(r.draft) and not isinstance(o, Exception) and o.num_draft_accepted < len(r.draft),
                }
                for r, o in zip(rows, out)
            ]
        )
        step_bytes.append(since[0])
        since[0] = 0
        return out

    def recording_call(stub, component, method, request, timeout=None):
        reply, seconds = call(stub, component, method, request, timeout)
        if method in CALLS:
            size = request.ByteSize() + reply.ByteSize()
            since[0] += size
            transport = seconds - reply.times.seconds  # (the rest is the service's own)
            calls.append({"method": method, "bytes": size, "seconds": seconds, "transport": transport})
        return reply, seconds

    executor.verify, executor._call, executor.draft_route = recording_verify, recording_call, route
    try:

        async def stream(i: int) -> int:
            request = params.model_copy(update={"seed": i})
            chunks = pipeline.coordinator.generate(f"{tag}-{i}", prompts[i], request)
            return sum([len(c.token_ids) async for c in chunks])

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(stream(i) for i in range(len(prompts)))))
        wall = time.perf_counter() - t0
    finally:
        del executor.verify, executor._call, executor.draft_route  # (the class's again)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "probs_dtypes": sorted(dtypes),
        "steps": steps,
        "step_bytes": step_bytes,
        "calls": calls,
    }


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
            for route in MEASURED.values():
                await _pass(pipeline, prompts, warmup, f"warm-up-{route}", route)
            passes = []
            for i in range(PASSES):
                passes.append({})
                for route in MEASURED.values():
                    p = passes[-1][route] = await _pass(pipeline, prompts, params, f"pass-{i}-{route}", route)
                    print(f"pass {i + 1}, {route}: {p['tokens']} tokens in {p['wall_s']:.1f} s", flush=True)
            return {**pipeline.verifier_info, "kernels": kernels(pipeline._linears())}, passes
        finally:
            await pipeline.shutdown()

    with local_ray(num_cpus=4, log_to_driver=False):
        info, passes = asyncio.run(run())
    (wire,) = {d for p in passes for run in p.values() for d in run["probs_dtypes"]} or {"float32"}
    record = {
        **provenance(),
        "verifier": config.verifier,
        "drafter": config.drafter,
        "runtime": info["runtime"],
        "kernels": info["kernels"],  # both actors' linears: packed kernels, weight quantization
        "vocab_size": info["vocab_size"],
        "draft_probs_dtype": pipeline_config.draft_probs_dtype,
        "value_bytes": VALUE_BYTES[wire],  # one probability of p's rows on the wire
        "rows": rows,
        "params": params.model_dump(mode="json", exclude_defaults=True),
        "passes": passes,
    }
    out = write_results(args.out, record, routes_markdown(record))
    print(routes_markdown(record))
    print(f"wrote {out}/results.json")
    return 0
