"""Aggregate tokens/s of the served API at several numbers of concurrent streams.

Starts the Ray Serve application (`viasd.cluster.launch.start`) from a serving config, or uses
a running one (--url), then for each concurrency c runs c streams at once through the official
`openai` client (/v1/completions, SSE streaming, greedy, ignore_eos so that every stream makes
exactly --max-tokens tokens) and reports

    aggregate tokens/s = all streams' completion tokens / wall time from first request to last token

plus mean time to first token and per-stream tokens/s. A warm-up request runs first.

    flock /tmp/viasd-heavy.lock python scripts/serve_throughput.py --config cluster/serve.yaml \
        --concurrency 1,4,8 --max-tokens 32 --modes sd,via --out throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True when s reads the same backwards.\"\"\"\n",
    "def merge_sorted(a: list, b: list) -> list:\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "def count_words(text: str) -> dict:\n    \"\"\"Count how often each word occurs in text.\"\"\"\n",
    "def flatten(xs):\n    \"\"\"Flatten a nested list of lists into one list.\"\"\"\n",
    "def gcd(a: int, b: int) -> int:\n    \"\"\"Greatest common divisor of a and b.\"\"\"\n",
    "def transpose(m: list[list[int]]) -> list[list[int]]:\n    \"\"\"Transpose a matrix.\"\"\"\n",
    "def parse_csv_line(line: str) -> list[str]:\n    \"\"\"Split one CSV line into fields.\"\"\"\n",
]


def mode_params(spec: str) -> dict:
    """'sd' -> {mode: sd}; 'sd:overlap=true:proposer=hybrid' -> request parameters (bench-style specs)."""
    head, *parts = spec.split(":")
    params: dict = {"mode": head}
    for part in parts:
        key, value = part.split("=", 1)
        params[key] = {"true": True, "false": False}.get(value, value)
    return params


def one_stream(client, model: str, prompt: str, mode: str, max_tokens: int, out: dict) -> None:
    t0 = time.perf_counter()
    ttft, tokens, text = None, 0, []
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={**mode_params(mode), "ignore_eos": True, "return_token_ids": True},
    )
    for chunk in stream:
        ids = chunk.choices[0].model_extra.get("token_ids") or []
        if ids and ttft is None:
            ttft = time.perf_counter() - t0
        tokens += len(ids)
        text.append(chunk.choices[0].text)
        stats = chunk.model_extra.get("viasd_stats")
        if stats:
            out["stats"] = stats
    out.update(ttft=ttft, tokens=tokens, seconds=time.perf_counter() - t0, text="".join(text))


def run_level(client, model: str, mode: str, concurrency: int, max_tokens: int) -> dict:
    results = [{} for _ in range(concurrency)]
    threads = [
        threading.Thread(target=one_stream, args=(client, model, PROMPTS[i % len(PROMPTS)], mode, max_tokens, results[i]))
        for i in range(concurrency)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if any("tokens" not in r for r in results):
        raise RuntimeError(f"a stream failed at concurrency {concurrency}")
    tokens = sum(r["tokens"] for r in results)
    mal = [r["stats"]["mean_acceptance_length"] for r in results if r.get("stats", {}).get("mean_acceptance_length")]
    return {
        "mode": mode,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "aggregate_tokens_per_s": round(tokens / wall, 2),
        "per_stream_tokens_per_s": round(statistics.mean(r["tokens"] / r["seconds"] for r in results), 2),
        "mean_ttft_s": round(statistics.mean(r["ttft"] for r in results), 2),
        "max_ttft_s": round(max(r["ttft"] for r in results), 2),
        "mean_acceptance_length": round(statistics.mean(mal), 2) if mal else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="serve.yaml (default: the embedded pair, actors backend)")
    ap.add_argument("--url", default=None, help="use a running endpoint (http://host:port) instead of starting one")
    ap.add_argument("--backend", default=None, choices=["actors", "local"])
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="sd", help="comma-separated: ar, sd, via")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    import openai

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    levels = [int(x) for x in args.concurrency.split(",")]
    started = None
    if args.url:
        base = args.url.rstrip("/")
    else:
        from viasd.cluster import launch
        from viasd.cluster.serve_config import load_serve_config, parse_serve_config

        config = load_serve_config(args.config)
        raw = config.model_dump(mode="json")
        raw["limits"] = {**raw["limits"], "max_concurrent_requests": max(levels),
                         "max_queued_requests": max(raw["limits"]["max_queued_requests"], max(levels))}
        if args.backend:
            raw["backend"] = args.backend
        config = parse_serve_config(raw)
        t0 = time.perf_counter()
        started = launch.start(config, blocking_timeout_s=1200)
        print(f"[serve_throughput] application up in {time.perf_counter() - t0:.0f}s: {started.http}", file=sys.stderr)
        base = started.http
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=3600)
        model = client.models.list().data[0]
        info = model.model_extra.get("viasd", {})
        from viasd.bench import provenance

        results = {"model": model.id, "pipeline": info, "cpus": os.cpu_count(), **provenance(), "runs": []}
        for mode in args.modes.split(","):
            run_level(client, model.id, mode, 1, 8)  # warm-up
            for c in levels:
                r = run_level(client, model.id, mode, c, args.max_tokens)
                results["runs"].append(r)
                print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
    finally:
        if started is not None:
            from viasd.cluster import launch

            launch.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
