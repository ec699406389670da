"""Aggregate tokens/s of the served API at several numbers of concurrent streams.

Starts the Ray Serve application (`viasd.cluster.launch.start`) from a serving config, or uses
a running one (--url), then for each concurrency c runs c streams at once through the official
`openai` client (/v1/completions, SSE streaming, greedy, ignore_eos so that every stream makes
exactly --max-tokens tokens) and reports

    aggregate tokens/s = all streams' completion tokens / wall time from first request to last token

plus time to first token (mean, p50, p99), inter-token latency (p50, p99; a chunk of n tokens
after a gap g counts n gaps of g / n), per-stream tokens/s and the mean queue time from the
stats. A warm-up request runs first. With `--in-process` the same levels first run on the
in-process batched engine (`viasd.llm.LLM` of the same pipeline config; c threads share its
steps), which is then freed before the application starts (one copy of the models in memory at
a time), and `ratios` gives served / in-process per mode and level. Every stream is greedy, so
each must equal its prompt's greedy output whatever the mode, level or system: a lost,
duplicated or reordered token is a mismatch (exit status 1). Each level also records the cores
each kind of process kept busy (`cores_busy`: CPU seconds over wall seconds, by
`PROCESS_CLASSES`: the actors, Serve's replica, proxy and controller, Ray's own daemons, this
client, and every other process of the machine), and an `auto` level what its steps cost and
committed beside what the planner expected of them (`forecasts`: viasd.planner.Forecast), its
probe and exploration steps, and the running acceptance of model drafts it started from.

    flock /tmp/viasd-heavy.lock python scripts/serve_throughput.py --config cluster/serve.yaml \
        --concurrency 1,4,8,16 --max-tokens 32 --modes ar,sd,via --in-process --dtype float32 \
        --out docs/benchmarks/serve-throughput-cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'def is_palindrome(s: str) -> bool:\n    """Return True when s reads the same backwards."""\n',
    'def merge_sorted(a: list, b: list) -> list:\n    """Merge two sorted lists into one sorted list."""\n',
    'def count_words(text: str) -> dict:\n    """Count how often each word occurs in text."""\n',
    'def flatten(xs):\n    """Flatten a nested list of lists into one list."""\n',
    'def gcd(a: int, b: int) -> int:\n    """Greatest common divisor of a and b."""\n',
    'def transpose(m: list[list[int]]) -> list[list[int]]:\n    """Transpose a matrix."""\n',
    'def parse_csv_line(line: str) -> list[str]:\n    """Split one CSV line into fields."""\n',
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
    ttft, ids, itl, last, text = None, [], [], None, []
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={**mode_params(mode), "ignore_eos": True, "return_token_ids": True},
    )
    for chunk in stream:
        got = chunk.choices[0].model_extra.get("token_ids") or []
        now = time.perf_counter()
        if got:
            if ttft is None:
                ttft = now - t0
            else:  # a chunk of n tokens after a gap g counts n gaps of g / n (as the serving metrics do)
                itl += [(now - last) / len(got)] * len(got)
            last = now
        ids += got
        text.append(chunk.choices[0].text)
        stats = chunk.model_extra.get("viasd_stats")
        if stats:
            out["stats"] = stats
    out.update(ttft=ttft, tokens=len(ids), ids=ids, itl=itl, seconds=time.perf_counter() - t0, text="".join(text))


def in_process_stream(llm, prompt: str, mode: str, max_tokens: int, defaults: dict, out: dict) -> None:
    """The same request through the in-process engine (threads share its steps: one batch)."""
    from viasd.config import parse_params

    params = parse_params(
        **{**defaults, **mode_params(mode), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    )
    t0 = time.perf_counter()
    ttft, ids, itl, last = None, [], [], None
    for chunk in llm.engine.generate(llm.encode(prompt), params):
        now = time.perf_counter()
        if chunk.token_ids:
            if ttft is None:
                ttft = now - t0
            else:
                itl += [(now - last) / len(chunk.token_ids)] * len(chunk.token_ids)
            last = now
        ids += chunk.token_ids
        if chunk.stats is not None:
            out["stats"] = chunk.stats.to_dict()
    out.update(ttft=ttft, tokens=len(ids), ids=ids, itl=itl, seconds=time.perf_counter() - t0)


def release_memory() -> None:
    """Free what the system just measured before the next one loads its models: collect, then hand
    the freed heap back to the OS (glibc keeps freed small blocks, a model's weights among them:
    2 GB of a float32 pair stayed resident in this process, and the served drafter found too
    little memory free to pack its linears as the in-process one had)."""
    import ctypes
    import ctypes.util

    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:  # (glibc)
            trim(0)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def run_level(target, mode: str, concurrency: int, max_tokens: int, system: str = "served") -> dict:
    """`concurrency` streams at once (prompt i % 8 each); `target(prompt, mode, max_tokens, out)`."""
    results = [{} for _ in range(concurrency)]
    threads = [
        threading.Thread(target=target, args=(PROMPTS[i % len(PROMPTS)], mode, max_tokens, results[i]))
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
    plans: dict[str, int] = {}  # `auto`: the steps of every stream by the plan chosen
    for r in results:
        for label, n in (r.get("stats", {}).get("plans") or {}).items():
            plans[label] = plans.get(label, 0) + n
    itl = [g for r in results for g in r["itl"]]
    ttft = [r["ttft"] for r in results]
    return {
        "system": system,
        "mode": mode,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tokens_per_s": round(tokens / wall, 3),
        "per_stream_tokens_per_s": round(statistics.mean(r["tokens"] / r["seconds"] for r in results), 3),
        "mean_ttft_s": round(statistics.mean(ttft), 3),
        "p50_ttft_s": round(percentile(ttft, 50), 3),
        "p99_ttft_s": round(percentile(ttft, 99), 3),
        "p50_itl_s": round(percentile(itl, 50), 4) if itl else None,
        "p99_itl_s": round(percentile(itl, 99), 4) if itl else None,
        "mean_queue_s": round(statistics.mean(r.get("stats", {}).get("queue_seconds", 0.0) for r in results), 3),
        "mean_acceptance_length": round(statistics.mean(mal), 2) if mal else None,
        "plans": dict(sorted(plans.items())),
        "stream_token_ids": [[i % len(PROMPTS), r["ids"]] for i, r in enumerate(results)],  # [prompt, ids]
    }


#: Whose CPU time a level records (`cpu_by_process`): a process whose command line names one of
#: these is counted under it; this process is `client` (in process: the engine too), the rest `other`.
PROCESS_CLASSES = {
    "DrafterActor": "drafter",
    "VerifierWorker": "verifier",
    "ServeReplica": "replica",
    "ProxyActor": "proxy",
    "ServeController": "controller",
    "raylet": "ray",
    "gcs_server": "ray",
    "ray/": "ray",
}


def process_class(cmdline: list[str] | None) -> str | None:
    """The class of PROCESS_CLASSES a process's command line names, else None."""
    line = " ".join(cmdline or [])
    return next((c for k, c in PROCESS_CLASSES.items() if k in line), None)


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """Every readable process of the machine: pid -> (its class, CPU seconds so far, user + system)."""
    import psutil

    out = {}
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is None:
            continue
        name = "client" if proc.pid == os.getpid() else process_class(proc.info["cmdline"]) or "other"
        out[proc.pid] = (name, times.user + times.system)
    return out


def niceness_by_class() -> dict[str, list[int]]:
    """The niceness of each class's processes (their main threads), as the scheduler weighs them
    against each other: Ray starts its workers at 15, the model actors run at 0
    (viasd.cluster.pipeline.MODEL_ACTOR_ENV)."""
    import psutil

    out: dict[str, set[int]] = {}
    for proc in psutil.process_iter(["pid", "cmdline", "nice"]):
        name = process_class(proc.info["cmdline"])
        if name is not None and proc.info["nice"] is not None:
            out.setdefault(name, set()).add(proc.info["nice"])
    return {name: sorted(values) for name, values in sorted(out.items())}


def cpu_used(before: dict, after: dict, wall: float) -> dict[str, float]:
    """Cores busy per class over a level: CPU seconds between two `cpu_by_process` snapshots over
    the wall seconds (2.0 = both cores of this machine all the time)."""
    used: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        used[name] = used.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
    return {name: round(s / wall, 3) for name, s in sorted(used.items())}


def metrics_samples(base: str) -> dict:
    """The served application's /metrics, parsed (`serving_metrics.parse_exposition`)."""
    import urllib.request

    from viasd.cluster.serving_metrics import parse_exposition

    with urllib.request.urlopen(base + "/metrics", timeout=30) as f:
        return parse_exposition(f.read().decode())


def coordinator_totals(base: str) -> dict:
    """The served executor's totals from /metrics: steps, and seconds by phase
    (`viasd_coordinator_seconds{phase}`; published as each request ends)."""
    from viasd.cluster.serving_metrics import total

    samples = metrics_samples(base)
    phases = {dict(lab)["phase"] for (n, lab) in samples if n == "viasd_coordinator_seconds_total"}
    return {
        "steps": total(samples, "viasd_coordinator_steps_total"),
        "seconds": {ph: total(samples, "viasd_coordinator_seconds_total", phase=ph) for ph in sorted(phases)},
    }


def served_planner(base: str) -> dict:
    """Mode auto's planner so far, from /metrics (published as each request ends): its forecasts
    (`viasd.planner.Forecast`, by steps that speculated and `ar` steps:
    `viasd_planner_forecast{steps,quantity}`), probe and exploration steps, and the running
    acceptance of model drafts per position (`viasd_planner_acceptance`)."""
    out: dict = {"forecasts": {}, "probes": 0, "explorations": 0, "acceptance": {}}
    for (name, labels), value in metrics_samples(base).items():
        lab = dict(labels)
        if name == "viasd_planner_forecast":
            out["forecasts"].setdefault(lab["steps"], {})[lab["quantity"]] = value
        elif name in ("viasd_planner_probe_steps", "viasd_planner_exploration_steps"):
            out["probes" if "probe" in name else "explorations"] = int(value)
        elif name == "viasd_planner_acceptance":
            out["acceptance"].setdefault(lab["kind"], {})[int(lab["position"])] = value
    out["acceptance"] = {kind: [rates[j] for j in sorted(rates)] for kind, rates in out["acceptance"].items()}
    return out


def planner_delta(before: dict, after: dict) -> dict:
    """What one `auto` level did to the planner (`served_planner`'s or `Engine.planner_state`'s
    keys): the forecasts it added (`forecast_delta`), its probe and exploration steps, and the
    running acceptance of model drafts it started from (positions 0-4)."""
    return {
        "forecasts": forecast_delta(before["forecasts"], after["forecasts"]),
        "probes": after["probes"] - before["probes"],
        "explorations": after["explorations"] - before["explorations"],
        "acceptance_at_start": [round(a, 3) for a in before["acceptance"].get("model", [])[:5]],
    }


def forecast_delta(before: dict, after: dict) -> dict:
    """What one level added to the planner's forecasts: per kind of step, its steps, predicted and
    measured seconds, expected and committed tokens, and the two ratios."""
    out = {}
    for kind, f in after.items():
        d = {q: v - before.get(kind, {}).get(q, 0) for q, v in f.items()}
        if d.get("steps"):
            d["measured_over_predicted"] = round(d["seconds"] / d["predicted_seconds"], 3)
            d["committed_over_expected"] = round(d["tokens"] / d["expected_tokens"], 3)
            out[kind] = {q: round(v, 4) if isinstance(v, float) else v for q, v in d.items()}
    return out


def step_phases(before: dict, after: dict, tokens: int) -> dict:
    """What one level cost the coordinator: its steps, and milliseconds per step by phase (the
    services' own time, each call's transport, its own work, its waits between steps)."""
    steps = after["steps"] - before["steps"]
    seconds = {ph: s - before["seconds"].get(ph, 0.0) for ph, s in after["seconds"].items()}
    return {
        "steps": int(steps),
        "tokens_per_step": round(tokens / steps, 2) if steps else None,
        "ms_per_step": {ph: round(1e3 * s / steps, 1) for ph, s in seconds.items()} if steps else {},
    }


def tokenizer_dir(spec: str) -> str:
    """A local directory with the served model's tokenizer (guidellm sizes synthetic prompts with it)."""
    from pathlib import Path

    from viasd.models.embedded import cache_dir_for

    if Path(spec).is_dir():
        return spec
    for dtype in ("float32", "bfloat16"):
        path = cache_dir_for(spec, dtype)
        if (path / "tokenizer.json").exists():
            return str(path)
    raise SystemExit(f"no local tokenizer for {spec!r}: load the model once first")


def run_guidellm(
    exe: str,
    base: str,
    model: str,
    tokenizer: str,
    mode: str,
    levels: list[int],
    max_tokens: int,
    requests_per_stream: int,
    workdir: str,
) -> dict:
    """guidellm (a third-party load generator) against the served /v1/completions at each level:
    synthetic 64-token prompts, `max_tokens` output tokens (ignore_eos), greedy, this mode; its
    per-level figures (tokens/s, TTFT and ITL p50 / p99) from its JSON report."""
    import subprocess

    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": base,
                "model": model,
                "request_format": "/v1/completions",
                "max_tokens": max_tokens,
                "extras": {"body": {**mode_params(mode), "ignore_eos": True, "temperature": 0}},
            },
            "profile": {"kind": "concurrent"},
            "data": [{"kind": "synthetic_text", "prompt_tokens": 64, "output_tokens": max_tokens}],
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
            "constraints": [{"kind": "max_requests", "count": [requests_per_stream * c for c in levels]}],
        },
        "benchmarks": [{"profile.streams": c} for c in levels],
    }
    path = os.path.join(workdir, f"guidellm-{mode}.json")
    report = os.path.join(workdir, f"guidellm-{mode}-report.json")
    with open(path, "w") as f:
        json.dump(scenario, f, indent=1)
    cmd = [exe, "run", "-c", path, "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"guidellm failed ({proc.returncode}): {proc.stderr[-3000:]}")
    with open(report) as f:
        benchmarks = json.load(f)["benchmarks"]
    scenario["spec"]["tokenizer"]["model"] = f"<the local tokenizer of {model}>"  # (no machine path in the figures)
    return {
        "command": " ".join(["guidellm", *cmd[1:3], "<scenario>", *cmd[4:5], "kind=json,path=<report>", *cmd[6:]]),
        "scenario": scenario,
        "levels": [guidellm_level(b) for b in benchmarks],
    }


def guidellm_level(benchmark: dict) -> dict:
    """One level of a guidellm report: aggregate output tokens/s, TTFT and ITL p50 / p99 (seconds)."""
    m = benchmark["metrics"]

    def ok(name: str) -> dict:
        return m[name]["successful"]

    tokens = ok("output_token_count")["total_sum"]
    return {
        "streams": benchmark["config"]["strategy"]["streams"],
        "requests": m["request_totals"],
        "output_tokens": tokens,
        "duration_s": round(benchmark["duration"], 3),
        "aggregate_tokens_per_s": round(tokens / benchmark["duration"], 3),
        "p50_ttft_s": round(ok("time_to_first_token_ms")["percentiles"]["p50"] / 1e3, 4),
        "p99_ttft_s": round(ok("time_to_first_token_ms")["percentiles"]["p99"] / 1e3, 4),
        "p50_itl_s": round(ok("inter_token_latency_ms")["percentiles"]["p50"] / 1e3, 4),
        "p99_itl_s": round(ok("inter_token_latency_ms")["percentiles"]["p99"] / 1e3, 4),
    }


def check_tokens(runs: list[dict], expected: dict) -> dict:
    """Greedy: every stream of every level and system must be its prompt's greedy output for its
    mode family, so a lost, duplicated, reordered or foreign token shows as a mismatch. Greedy
    `sd` equals greedy `ar` (lossless); `via` has its own reference (its slim verifier commits
    region-A tokens on q''s word: lossy). `expected` is filled from the first stream of each
    (family, prompt)."""
    checked = mismatched = 0
    for r in runs:
        bad = 0
        family = "via" if mode_params(r["mode"])["mode"] == "via" else "lossless"
        for prompt, ids in r["stream_token_ids"]:
            ref = expected.setdefault((family, prompt), ids)
            checked += 1
            bad += ids != ref
        r["mismatched_streams"] = bad
        mismatched += bad
    return {"streams_checked": checked, "streams_mismatched": mismatched}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="serve.yaml (default: the embedded pair, actors backend)")
    ap.add_argument("--url", default=None, help="use a running endpoint (http://host:port) instead of starting one")
    ap.add_argument("--backend", default=None, choices=["actors", "local"])
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="sd", help="comma-separated: ar, sd, via, auto (bench-style specs: sd:gamma=3)")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="first measure the in-process batched engine (the config's pipeline engine) at the same "
        "levels, then free it and start the served application",
    )
    ap.add_argument("--dtype", default=None, help="override the pipeline's engine dtype (float32, bfloat16)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="override the pipeline's engine threads (both systems; fewer than the cores leaves the rest to "
        "the control plane)",
    )
    ap.add_argument(
        "--passes",
        type=int,
        default=1,
        help="measure every system this many times, in-process and served alternating (ABBA: a machine "
        "whose pace drifts moves both alike); the tables and ratios take each figure's median",
    )
    ap.add_argument(
        "--guidellm",
        default=None,
        help="the guidellm executable, e.g. `guidellm` on PATH (pip install -e .[load], or its own "
        "venv): also drive the served endpoint with it at the same levels",
    )
    ap.add_argument("--guidellm-requests", type=int, default=1, help="guidellm requests per stream and level")
    ap.add_argument(
        "--merge-guidellm",
        default=None,
        help="a results file of this script whose guidellm figures join these ones (its command, "
        "commit and machine are kept under `merged`)",
    )
    ap.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="before the load of each served pass, record the cores each kind of process keeps busy "
        "over this many seconds with no request in flight (the control plane's own cost: `idle`)",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    import openai

    from viasd.bench import provenance
    from viasd.cluster.serve_config import load_serve_config, parse_serve_config

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    levels = [int(x) for x in args.concurrency.split(",")]
    modes = args.modes.split(",")
    config = load_serve_config(args.config)
    raw = config.model_dump(mode="json")
    # the batch capacity: every stream of the largest level decodes at once
    raw["limits"] = {
        **raw["limits"],
        "max_concurrent_requests": max(levels),
        "max_queued_requests": max(raw["limits"]["max_queued_requests"], max(levels)),
    }
    for p in raw["pipelines"]:
        p["engine"]["max_batch"] = max(p["engine"].get("max_batch") or 1, max(levels))
        # positions per cache row: fixed, not a share of the memory that happens to be free at start
        p["engine"]["max_seq_len"] = p["engine"].get("max_seq_len") or 512
        if args.dtype:
            p["engine"]["dtype"] = args.dtype
        if args.threads:
            p["engine"]["threads"] = args.threads
    if args.backend:
        raw["backend"] = args.backend
    if not args.url:  # free loopback ports: other servers may run on this machine
        from viasd.parallel import free_port

        raw["http"]["port"] = free_port()
        raw["grpc"]["port"] = free_port()
    config = parse_serve_config(raw)
    results = {"cpus": os.cpu_count(), **provenance(), "levels": levels, "modes": modes, "runs": []}
    # Ray's and Serve's settings from the environment (the control plane's loops read them at start)
    results["ray_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("RAY_")}
    expected: dict[int, list[int]] = {}

    def measure(target, system: str, mode_list: list[str], p: int, steps=None, planner=None) -> None:
        for mode in mode_list:
            run_level(target, mode, 1, 8, system)  # warm-up
            for c in levels:
                before, cpu = (steps() if steps else None), cpu_by_process()
                planned = planner() if planner and mode.startswith("auto") else None
                r = {**run_level(target, mode, c, args.max_tokens, system), "pass": p}
                r["cores_busy"] = cpu_used(cpu, cpu_by_process(), r["wall_s"])
                r["niceness"] = niceness_by_class()
                if steps:
                    r["coordinator"] = step_phases(before, steps(), r["tokens"])
                if planned is not None:
                    r.update(planner_delta(planned, planner()))
                results["runs"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "stream_token_ids"}), flush=True)

    def in_process(p: int) -> None:
        from viasd.llm import LLM

        pc = config.pipeline()
        llm = LLM(pc.engine)
        results["in_process"] = {"engine": pc.engine.model_dump(mode="json"), "runtime": llm.runtime_info()}
        defaults = dict(config.default_params)
        try:
            measure(
                lambda prompt, mode, n, out: in_process_stream(llm, prompt, mode, n, defaults, out),
                "in_process",
                modes,
                p,
                planner=llm.engine.planner_state,
            )
        finally:
            llm.engine.close()  # (the models leave memory with this frame: gc.collect below)

    def served(p: int) -> None:
        from viasd.cluster import launch

        started = None
        if args.url:
            base = args.url.rstrip("/")
        else:
            t0 = time.perf_counter()
            started = launch.start(config, blocking_timeout_s=1200)
            print(
                f"[serve_throughput] application up in {time.perf_counter() - t0:.0f}s: {started.http}", file=sys.stderr
            )
            base = started.http
        try:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=3600)
            model = client.models.list().data[0]
            results.update(model=model.id, pipeline=model.model_extra.get("viasd", {}), backend=raw["backend"])
            if args.idle:
                cpu, t0 = cpu_by_process(), time.perf_counter()
                time.sleep(args.idle)
                idle = cpu_used(cpu, cpu_by_process(), time.perf_counter() - t0)
                results.setdefault("idle", []).append({"pass": p, "seconds": args.idle, "cores_busy": idle})
                print(json.dumps({"idle": idle}), flush=True)
            measure(
                lambda prompt, mode, n, out: one_stream(client, model.id, prompt, mode, n, out),
                "served",
                modes,
                p,
                steps=(lambda: coordinator_totals(base)) if raw["backend"] == "actors" else None,
                planner=lambda: served_planner(base),
            )
            if args.guidellm and p == 0:
                import tempfile

                tok = tokenizer_dir(config.pipeline().engine.verifier)
                with tempfile.TemporaryDirectory() as work:
                    results["guidellm"] = {
                        mode: run_guidellm(
                            args.guidellm,
                            base,
                            model.id,
                            tok,
                            mode,
                            levels,
                            args.max_tokens,
                            args.guidellm_requests,
                            work,
                        )
                        for mode in modes
                    }
        finally:
            if started is not None:
                launch.stop()

    results["passes"] = args.passes
    for p in range(args.passes):  # (one copy of the models in memory at a time)
        systems = [in_process, served] if args.in_process else [served]
        for system in systems if p % 2 == 0 else systems[::-1]:
            system(p)
            release_memory()
    if args.merge_guidellm:
        with open(args.merge_guidellm) as f:
            other = json.load(f)
        results["merged"] = {"what": "guidellm", "command": other["command"], "environment": other["environment"]}
        results["guidellm"] = other["guidellm"]
    results["tokens"] = check_tokens(results["runs"], expected)
    results["summary"] = summarize(results["runs"])
    results["ratios"] = ratios(results["summary"])
    print(json.dumps({"tokens": results["tokens"], "ratios": results["ratios"]}, indent=1), flush=True)
    print(markdown_table(results), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if results["tokens"]["streams_mismatched"] else 0


TABLE_HEADER = (
    "| mode | streams | in-process tok/s | served tok/s | served / in-process | served TTFT p50 / p99 (s) "
    "| served ITL p50 / p99 (s) | guidellm tok/s | guidellm TTFT p50 / p99 (s) | guidellm ITL p50 / p99 (s) |"
)


def markdown_table(results: dict, in_process: bool = True) -> str:
    """The figures of a results file as the table docs/SERVING.md shows (tests/unit/test_docs_figures.py
    checks that the page's table is this one); `in_process=False` leaves the in-process runs out."""
    runs = {
        (r["system"], r["mode"], r["concurrency"]): r
        for r in results.get("summary") or results["runs"]
        if in_process or r["system"] != "in_process"
    }
    guide = {(mode, lv["streams"]): lv for mode, g in results.get("guidellm", {}).items() for lv in g["levels"]}
    lines = [TABLE_HEADER, "|" + " --- |" * TABLE_HEADER.count(" | ") + " --- |"]
    for mode in results["modes"]:
        for c in results["levels"]:
            ip, sv, g = runs.get(("in_process", mode, c)), runs.get(("served", mode, c)), guide.get((mode, c))
            cells = [
                mode,
                str(c),
                f"{ip['aggregate_tokens_per_s']:.2f}" if ip else "-",
                f"{sv['aggregate_tokens_per_s']:.2f}" if sv else "-",
                f"{sv['aggregate_tokens_per_s'] / ip['aggregate_tokens_per_s']:.2f}" if ip and sv else "-",
                f"{sv['p50_ttft_s']:.2f} / {sv['p99_ttft_s']:.2f}" if sv else "-",
                f"{sv['p50_itl_s']:.3f} / {sv['p99_itl_s']:.3f}" if sv and sv["p50_itl_s"] is not None else "-",
                f"{g['aggregate_tokens_per_s']:.2f}" if g else "-",
                f"{g['p50_ttft_s']:.2f} / {g['p99_ttft_s']:.2f}" if g else "-",
                f"{g['p50_itl_s']:.3f} / {g['p99_itl_s']:.3f}" if g else "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cores_table(results: dict) -> str:
    """The cores each kind of process kept busy per run (`cores_busy`), as docs/SERVING.md shows
    them: in process the client is the engine; served, Serve's three kinds of process are summed."""
    lines = [
        "| system | mode | streams | pass | ITL p50 (s) | drafter | verifier | in-process engine | "
        "Serve (replica, proxy, controller) | Ray daemons | client threads | other |",
        "|" + " --- |" * 12,
    ]
    for r in results["runs"]:
        b, served = r["cores_busy"], r["system"] == "served"
        serve = sum(b.get(k, 0.0) for k in ("replica", "proxy", "controller"))
        cells = [
            r["system"],
            r["mode"],
            str(r["concurrency"]),
            str(r["pass"]),
            f"{r['p50_itl_s']:.3f}",
            f"{b.get('drafter', 0.0):.2f}",
            f"{b.get('verifier', 0.0):.2f}",
            "-" if served else f"{b.get('client', 0.0):.2f}",
            f"{serve:.2f}",
            f"{b.get('ray', 0.0):.2f}",
            f"{b.get('client', 0.0):.2f}" if served else "-",
            f"{b.get('other', 0.0):.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def variants_table(variants: dict[str, list[dict]]) -> str:
    """Runs of one command under several variants of the code (label -> that variant's results
    files, in the order they ran), level by level: served and in-process tokens/s and their
    ratio in each run, the median ratio, and the served ITL p50 of each run."""
    lines = [
        "| variant | mode | streams | served tok/s per run | in-process tok/s per run | "
        "served / in-process per run | median | served ITL p50 per run (s) |",
        "|" + " --- |" * 8,
    ]
    for label, mode, c, pairs in _by_variant_and_level(variants):
        sv, ip = zip(*pairs)
        ratio = [s["aggregate_tokens_per_s"] / i["aggregate_tokens_per_s"] for s, i in pairs]
        cells = [
            label,
            mode,
            str(c),
            ", ".join(f"{s['aggregate_tokens_per_s']:.2f}" for s in sv),
            ", ".join(f"{i['aggregate_tokens_per_s']:.2f}" for i in ip),
            ", ".join(f"{x:.2f}" for x in ratio),
            f"{statistics.median(ratio):.2f}",
            ", ".join(f"{s['p50_itl_s']:.3f}" for s in sv),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def forecasts_table(results: dict) -> str:
    """Mode auto's forecasts per run (`forecasts`): for each system, level and pass, the steps that
    speculated and the `ar` steps, with the seconds the planner predicted against those measured
    and the tokens it expected against those committed, and the run's tokens/s and TTFT p50."""
    lines = [
        "| system | streams | pass | tok/s | TTFT p50 (s) | steps | speculating steps | predicted / measured s "
        "| expected / committed tokens | `ar` steps | predicted / measured s |",
        "|" + " --- |" * 11,
    ]
    runs = [r for r in results["runs"] if "forecasts" in r]
    for r in sorted(runs, key=lambda r: (r["system"], r["concurrency"], r.get("pass", 0))):
        spec, ar = r["forecasts"].get("speculating"), r["forecasts"].get("ar")
        cells = [
            r["system"].replace("_", "-"),
            str(r["concurrency"]),
            str(r.get("pass", 0)),
            f"{r['aggregate_tokens_per_s']:.2f}",
            f"{r['p50_ttft_s']:.2f}",
            str(int(sum(f["steps"] for f in r["forecasts"].values()))),
            str(int(spec["steps"])) if spec else "0",
            f"{spec['predicted_seconds']:.1f} / {spec['seconds']:.1f}" if spec else "-",
            f"{spec['expected_tokens']:.0f} / {spec['tokens']:.0f}" if spec else "-",
            str(int(ar["steps"])) if ar else "0",
            f"{ar['predicted_seconds']:.1f} / {ar['seconds']:.1f}" if ar else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _by_variant_and_level(variants: dict[str, list[dict]]):
    """(label, mode, streams, [(served, in-process) run of each file and pass, in the order they
    ran]) for every level of the first file, variant after variant."""
    first = next(iter(variants.values()))[0]
    for mode in first["modes"]:
        for c in first["levels"]:
            for label, files in variants.items():
                pairs = []
                for f in files:
                    for p in sorted({r.get("pass", 0) for r in f["runs"]}):
                        by = {(r["system"], r["mode"], r["concurrency"]): r for r in f["runs"] if r.get("pass", 0) == p}
                        pairs.append((by[("served", mode, c)], by[("in_process", mode, c)]))
                yield label, mode, c, pairs


IDLE_CLASSES = ("controller", "proxy", "replica", "ray", "drafter", "verifier", "other")


def idle_table(variants: dict[str, list[dict]]) -> str:
    """The `--idle` records of several variants' runs (label -> results files, in the order they
    ran): the cores each kind of process kept busy with no request in flight, and their total
    (this client's own polling left out)."""
    lines = ["| variant | run | " + " | ".join(IDLE_CLASSES) + " | total |", "|" + " --- |" * (len(IDLE_CLASSES) + 3)]
    for label, files in variants.items():
        for i, results in enumerate(files):
            for idle in results["idle"]:
                busy = idle["cores_busy"]
                cells = [f"{busy.get(c, 0.0):.3f}" for c in IDLE_CLASSES]
                total = sum(v for c, v in busy.items() if c != "client")
                lines.append(f"| {label} | {i} | " + " | ".join(cells) + f" | {total:.3f} |")
    return "\n".join(lines)


FIGURES = (  # a run's figures that a summary row takes the median of over the passes
    "wall_s",
    "aggregate_tokens_per_s",
    "per_stream_tokens_per_s",
    "mean_ttft_s",
    "p50_ttft_s",
    "p99_ttft_s",
    "p50_itl_s",
    "p99_itl_s",
    "mean_queue_s",
    "mean_acceptance_length",
)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (system, mode, concurrency): the median of each figure over its passes."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["system"], r["mode"], r["concurrency"]), []).append(r)
    rows = []
    for (system, mode, c), rs in groups.items():
        row = {"system": system, "mode": mode, "concurrency": c, "passes": len(rs)}
        for name in FIGURES:
            values = [r[name] for r in rs if r.get(name) is not None]
            row[name] = round(statistics.median(values), 4) if values else None
        row["mismatched_streams"] = sum(r.get("mismatched_streams", 0) for r in rs)
        rows.append(row)
    return rows


def ratios(runs: list[dict]) -> dict:
    """served / in-process aggregate tokens/s per (mode, concurrency), and each system's
    aggregate at c streams / at 1 stream."""
    agg = {(r["system"], r["mode"], r["concurrency"]): r["aggregate_tokens_per_s"] for r in runs}
    out: dict = {"served_over_in_process": {}, "scaling_over_1_stream": {}}
    for (system, mode, c), v in agg.items():
        if system == "served" and ("in_process", mode, c) in agg:
            out["served_over_in_process"][f"{mode}@{c}"] = round(v / agg[("in_process", mode, c)], 3)
        if (system, mode, 1) in agg:
            out["scaling_over_1_stream"][f"{system}:{mode}@{c}"] = round(v / agg[(system, mode, 1)], 3)
    return out


if __name__ == "__main__":
    sys.exit(main())
