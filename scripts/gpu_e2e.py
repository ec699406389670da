"""End-to-end check of the served pipeline on one CUDA machine (run by scripts/gpu_e2e.sh).

1. Starts a local Ray and the Serve application (actors backend) on the embedded pair in bf16:
   drafter on a GPU share, verifier ranks with TP = --tp (default: every visible GPU) over
   NCCL with --tp-backend (default deepspeed, i.e. DeepSpeed AutoTP; TP=1 runs unsharded).
2. Sends greedy requests (sd and via) through the OpenAI-compatible HTTP endpoint with the
   official `openai` client, streaming, and compares the served tokens with the in-process
   engine (`viasd.llm.LLM` on cuda:0, unsharded, same dtype).
   With TP=1 they must be equal. With TP>1 in bf16 the sharded sums round differently from the
   unsharded ones, so near-ties may flip (docs/ARCHITECTURE.md, "Exactness and precision"): the check then
   requires the first --tp-prefix tokens to agree and reports full agreement; --dtype float32
   makes it exact again. `sd:overlap=true` is checked the same way: the drafter actor drafts the
   next block on its own GPU share while the verifier verifies (issue 9; tokens must not change).
3. Measures the served-batching curve of docs/SERVING.md ("Served continuous batching") at 1, 4,
   8 and 16 concurrent streams (viasd.bench.serve, `viasd bench --suite serve`): aggregate tokens/s, TTFT and ITL
   p50 / p99 for ar, sd, via and auto (the service default) through HTTP, and the same levels
   on the in-process batched engine (the reference LLM on cuda:0) for the served / in-process
   ratio; then sd with
   overlap and sd with the hybrid proposer and adaptive drafting, served only. Every stream is
   greedy, so it must equal its prompt's greedy output (reported: `tokens`; required at TP=1 or
   in float32).

Exit status 0 when every check passes. Meant to finish in well under 10 minutes on one node.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'def is_palindrome(s: str) -> bool:\n    """Return True when s reads the same backwards."""\n',
    'def merge_sorted(a: list, b: list) -> list:\n    """Merge two sorted lists into one sorted list."""\n',
]


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=max(1, torch.cuda.device_count()))
    ap.add_argument("--tp-backend", default="deepspeed", choices=["deepspeed", "torch"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tp-prefix", type=int, default=16)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--out", default="gpu-e2e.json")
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="rehearse the script on CPU with SmolLM2-135M (checks the script, not the GPU path)",
    )
    args = ap.parse_args()
    cpu = args.cpu_dry_run
    if cpu:
        args.tp, args.dtype = 1, "float32"
    elif not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU machine", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    import openai

    from viasd.bench.serve import check_tokens, in_process_stream, mode_params, one_stream, ratios, run_level
    from viasd.cluster import launch
    from viasd.cluster.serve_config import parse_serve_config
    from viasd.config import parse_params
    from viasd.llm import LLM

    engine = {
        "verifier": "qwen2.5-coder-1.5b-instruct",
        "drafter": "qwen2.5-coder-0.5b-instruct",
        "dtype": args.dtype,
        "device": "cuda",
    }
    pipeline = {
        "name": "qwen2.5-coder-1.5b",
        "engine": engine,
        "tp_size": args.tp,
        "tp_backend": args.tp_backend,
        # the drafter shares GPU 0 with rank 0; every rank has a GPU of its own (NCCL needs that)
        "drafter_gpus": 0.2,
        "drafter_cpus": 1,
        "verifier_gpus_per_rank": 0.8,
        "verifier_cpus_per_rank": 1,
    }
    if cpu:
        engine = {
            "verifier": "smollm2-135m-instruct",
            "drafter": "smollm2-135m-instruct",
            "dtype": "float32",
            "device": "cpu",
            "threads": 1,
        }
        pipeline.update(name="smol", engine=engine, drafter_gpus=0, verifier_gpus_per_rank=0)
        args.max_tokens, args.concurrency = min(args.max_tokens, 16), "1,2"
    levels = [int(c) for c in args.concurrency.split(",")]
    engine["max_batch"] = max(levels)  # the in-process reference batches every stream of a level, as the served one
    config = parse_serve_config(
        {
            "pipelines": [pipeline],
            "limits": {"max_concurrent_requests": max(levels), "max_queued_requests": max(levels)},
            "ray": {"num_cpus": max(8, 2 * args.tp + 4)},
        }
    )
    report: dict = {
        "tp_size": args.tp,
        "tp_backend": args.tp_backend,
        "dtype": args.dtype,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if not cpu else [],
    }
    t0 = time.perf_counter()
    endpoints = launch.start(config, blocking_timeout_s=480)
    report["startup_s"] = round(time.perf_counter() - t0, 1)
    print(
        f"[gpu_e2e] served in {report['startup_s']}s at {endpoints.http} (TP={args.tp}, {args.tp_backend})", flush=True
    )
    ok = True
    try:
        client = openai.OpenAI(base_url=endpoints.http + "/v1", api_key="unused", max_retries=0, timeout=600)
        info = client.models.list().data[0].model_extra["viasd"]
        assert info["tensor_parallel_size"] == args.tp, info
        ref = LLM(config.pipelines[0].engine.model_copy(update={"device": "cpu" if cpu else "cuda:0"}))
        checks = []
        for mode in ("sd", "via", "sd:overlap=true"):  # overlap: the drafter actor drafts ahead on its own GPU share
            for prompt in PROMPTS:
                ids = ref.encode(prompt)
                want = ref.complete(ids, parse_params(**mode_params(mode), max_tokens=args.max_tokens)).token_ids
                got, text = [], []
                for chunk in client.completions.create(
                    model=info["name"],
                    prompt=prompt,
                    max_tokens=args.max_tokens,
                    temperature=0,
                    stream=True,
                    extra_body={**mode_params(mode), "return_token_ids": True},
                ):
                    got.extend(chunk.choices[0].model_extra.get("token_ids") or [])
                    text.append(chunk.choices[0].text)
                prefix = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                equal = got == want
                passed = equal if args.tp == 1 or args.dtype == "float32" else prefix >= min(args.tp_prefix, len(want))
                ok &= passed
                checks.append(
                    {"mode": mode, "equal": equal, "common_prefix": prefix, "tokens": len(want), "pass": passed}
                )
                print(
                    f"[gpu_e2e] {mode} {'PASS' if passed else 'FAIL'} equal={equal} common_prefix={prefix}/{len(want)}"
                    f" {''.join(text)[:60]!r}",
                    flush=True,
                )
        report["checks"] = checks
        report["throughput"] = []
        served = lambda prompt, mode, n, out: one_stream(client, info["name"], prompt, mode, n, out)  # noqa: E731
        in_process = lambda prompt, mode, n, out: in_process_stream(ref, prompt, mode, n, {}, out)  # noqa: E731, F821
        curve = [
            (mode, system, target)
            for mode in ("ar", "sd", "via", "auto")
            for system, target in (("in_process", in_process), ("served", served))
        ]
        curve += [
            (mode, "served", served)
            for mode in ("sd:overlap=true", "sd:proposer=hybrid:draft_confidence=0.4:adaptive_gamma=true")
        ]
        for mode, system, target in curve:  # in-process and served side by side, level by level
            run_level(target, mode, 1, 8, system)  # warm-up
            for c in levels:
                r = run_level(target, mode, c, args.max_tokens, system)
                report["throughput"].append(r)
                print(
                    f"[gpu_e2e] {system} {mode} streams={c}: {r['aggregate_tokens_per_s']} tokens/s aggregate, "
                    f"TTFT p50 {r['p50_ttft_s']}s, ITL p50/p99 {r['p50_itl_s']}/{r['p99_itl_s']}s",
                    flush=True,
                )
        report["tokens"] = check_tokens(report["throughput"], {})
        report["ratios"] = ratios(report["throughput"])
        if args.tp == 1 or args.dtype == "float32":
            ok &= report["tokens"]["streams_mismatched"] == 0
        print(f"[gpu_e2e] tokens {report['tokens']}; ratios {json.dumps(report['ratios'])}", flush=True)
        del ref
        if not cpu:
            torch.cuda.empty_cache()
    finally:
        launch.stop()
    report["pass"] = bool(ok)
    report["total_s"] = round(time.perf_counter() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"[gpu_e2e] {'PASS' if ok else 'FAIL'} in {report['total_s']}s; report: {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
