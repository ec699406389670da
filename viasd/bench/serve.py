"""`viasd bench --suite serve`: aggregate tokens/s of the served API at several numbers of
concurrent streams, beside the in-process engine.

Starts the Ray Serve application (`viasd.cluster.launch.start`) from a serving config, or uses a
running one (--url), then for each level c runs c streams at once through the official `openai`
client (/v1/completions, SSE streaming, greedy, ignore_eos so that every stream makes exactly
--max-tokens tokens). A warm-up request runs first. With `--in-process` the same levels first run
on the in-process batched engine (`viasd.llm.LLM` of the same pipeline config; c threads share its
steps), which is then freed before the application starts (one copy of the models in memory at a
time); `ratios` gives served / in-process per mode and level. With `--in-process-beside-serving`
the in-process engine runs once more after each served pass, beside a synthetic load that keeps
as many cores busy as the serving stack's own processes did at that mode and level (Serve's
proxy, replica and controller, Ray's daemons, the HTTP client: every process but the model
actors), system `in_process_beside_serving`: what the engine loses to that share of the cores
alone. Every stream is greedy, so each must
equal its prompt's greedy output whatever the mode, level or system: a lost, duplicated or
reordered token is a mismatch (exit status 1). The figures of each level (`viasd.bench.serve_report`):
TTFT, ITL, per-stream tokens/s, queue time, the cores each kind of process kept busy, and for
`auto` what its steps cost beside what the planner expected.

    viasd bench --suite serve --config cluster/serve.yaml --concurrency 1,4,8,16 --max-tokens 32 \
        --modes ar,sd,via --in-process --dtype float32 --out bench-out/serve
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from viasd.bench.serve_report import (
    check_tokens,
    coordinator_totals,
    cpu_by_process,
    cpu_used,
    guidellm_level,
    markdown_table,
    mode_params,
    niceness_by_class,
    percentile,
    planner_delta,
    ratios,
    served_planner,
    step_phases,
    summarize,
)
from viasd.errors import require

__all__ = [
    "PROMPTS",
    "check_tokens",
    "in_process_stream",
    "mode_params",
    "one_stream",
    "ratios",
    "run_level",
    "run_serve_bench",
]

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


#: Processes of a served run that compute the model: the rest is the serving stack's share.
MODEL_CLASSES = ("verifier", "drafter")
#: The synthetic load's cycle: each burner spins its share of every period and sleeps the rest.
LOAD_PERIOD_S = 0.01
_BURNER = """
import sys, time
busy, period = float(sys.argv[1]) * float(sys.argv[2]), float(sys.argv[2])
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(period - busy)
"""


def serving_share(runs: list[dict], mode: str, concurrency: int, p: int) -> float:
    """Cores the serving stack's own processes kept busy in pass `p`'s served run at `mode` and
    `concurrency` (every class but MODEL_CLASSES), less what the in-process run of the same pass
    saw from other processes (the machine's own background, present in both)."""
    at = {(r["system"], r["mode"], r["concurrency"], r["pass"]): r for r in runs}
    served, alone = at[("served", mode, concurrency, p)], at.get(("in_process", mode, concurrency, p))
    share = sum(v for k, v in served["cores_busy"].items() if k not in MODEL_CLASSES)
    return max(0.0, share - (alone["cores_busy"].get("other", 0.0) if alone else 0.0))


class SyntheticLoad:
    """Processes that keep `cores` of the machine busy between `start` and `stop`: ceil(cores)
    burners, each spinning its share of every LOAD_PERIOD_S and sleeping the rest (as the serving
    stack's processes wake, work a little and sleep)."""

    def __init__(self) -> None:
        self.procs: list = []

    def start(self, cores: float) -> None:
        import math
        import subprocess

        self.stop()
        n = math.ceil(cores)
        self.procs = [
            subprocess.Popen([sys.executable, "-c", _BURNER, str(cores / n), str(LOAD_PERIOD_S)]) for _ in range(n)
        ]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs = []


def release_memory() -> None:
    """Free what the system just measured before the next one loads its models: collect, then hand
    the freed heap back to the OS (glibc keeps freed small blocks, a model's weights among them, and
    the next system would find less memory free than the first did)."""
    import ctypes
    import ctypes.util

    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:  # (glibc)
            trim(0)


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


def serve_config(args, levels: list[int]):
    """The serving config the suite runs: `--config` (default: the embedded pair), sized so every
    stream of the largest level decodes at once, with the suite's overrides, on free loopback ports."""
    from viasd.cluster.serve_config import load_serve_config, parse_serve_config
    from viasd.config import EngineConfig

    raw = load_serve_config(args.config).model_dump(mode="json")
    raw["limits"] = {
        **raw["limits"],
        "max_concurrent_requests": max(levels),
        "max_queued_requests": max(raw["limits"]["max_queued_requests"], max(levels)),
    }
    dtype = args.dtype if args.dtype != EngineConfig.model_fields["dtype"].default else None  # (the flag's default)
    for p in raw["pipelines"]:
        p["engine"]["max_batch"] = max(p["engine"].get("max_batch") or 1, max(levels))
        # positions per cache row: fixed, not a share of the memory that happens to be free at start
        p["engine"]["max_seq_len"] = p["engine"].get("max_seq_len") or 512
        if dtype:
            p["engine"]["dtype"] = dtype
        if args.threads:
            p["engine"]["threads"] = args.threads
    if args.backend:
        raw["backend"] = args.backend
    if not args.url:  # free loopback ports: other servers may run on this machine
        from viasd.parallel import free_port

        raw["http"]["port"] = free_port()
        raw["grpc"]["port"] = free_port()
    return raw, parse_serve_config(raw)


def run_serve_bench(args) -> int:
    """`viasd bench --suite serve`: measure, write `--out`/results.json and results.md; exit status 1
    when a stream differs from its prompt's greedy output."""
    from viasd.bench import environment

    openai = require("openai", "bench")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    modes = [m for m in (args.methods or "sd").split(",") if m.strip()]
    max_tokens = int(args.max_tokens) if args.max_tokens is not None else 32
    raw, config = serve_config(args, levels)
    results = {
        "command": getattr(args, "command_line", None) or " ".join(sys.argv),
        "environment": environment(),
        "cpus": os.cpu_count(),
        "levels": levels,
        "modes": modes,
        "max_tokens": max_tokens,
        "runs": [],
    }
    # Ray's and Serve's settings from the environment (the control plane's loops read them at start)
    results["ray_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("RAY_")}
    expected: dict = {}

    def measure(target, system: str, p: int, steps=None, planner=None, load=None) -> None:
        for mode in modes:
            run_level(target, mode, 1, 8, system)  # warm-up
            for c in levels:
                extra = {}
                if load is not None:
                    extra["synthetic_load_cores"] = round(serving_share(results["runs"], mode, c, p), 3)
                    load.start(extra["synthetic_load_cores"])
                before, cpu = (steps() if steps else None), cpu_by_process()
                planned = planner() if planner and mode.startswith("auto") else None
                try:
                    r = {**run_level(target, mode, c, max_tokens, system), "pass": p, **extra}
                finally:
                    if load is not None:
                        load.stop()
                r["cores_busy"] = cpu_used(cpu, cpu_by_process(), r["wall_s"])
                r["niceness"] = niceness_by_class()
                if steps:
                    r["coordinator"] = step_phases(before, steps(), r["tokens"])
                if planned is not None:
                    r.update(planner_delta(planned, planner()))
                results["runs"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "stream_token_ids"}), file=sys.stderr, flush=True)

    def run_in_process(p: int, beside_serving: bool = False) -> None:
        from viasd.llm import LLM

        pc = config.pipeline()
        llm = LLM(pc.engine)
        results["in_process"] = {"engine": pc.engine.model_dump(mode="json"), "runtime": llm.runtime_info()}
        defaults = dict(config.default_params)
        try:
            measure(
                lambda prompt, mode, n, out: in_process_stream(llm, prompt, mode, n, defaults, out),
                "in_process_beside_serving" if beside_serving else "in_process",
                p,
                planner=llm.engine.planner_state,
                load=SyntheticLoad() if beside_serving else None,
            )
        finally:
            llm.engine.close()  # (the models leave memory with this frame: gc.collect below)

    def run_served(p: int) -> None:
        from viasd.cluster import launch

        started = None
        if args.url:
            base = args.url.rstrip("/")
        else:
            t0 = time.perf_counter()
            started = launch.start(config, blocking_timeout_s=1200)
            print(f"[bench serve] application up in {time.perf_counter() - t0:.0f}s: {started.http}", file=sys.stderr)
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
                print(json.dumps({"idle": idle}), file=sys.stderr, flush=True)
            measure(
                lambda prompt, mode, n, out: one_stream(client, model.id, prompt, mode, n, out),
                "served",
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
                            args.guidellm, base, model.id, tok, mode, levels, max_tokens, args.guidellm_requests, work
                        )
                        for mode in modes
                    }
        finally:
            if started is not None:
                launch.stop()

    results["passes"] = args.passes
    for p in range(args.passes):  # (one copy of the models in memory at a time)
        systems = [run_in_process, run_served] if args.in_process else [run_served]
        for system in systems if p % 2 == 0 else systems[::-1]:  # ABBA: a drifting machine moves both alike
            system(p)
            release_memory()
        if args.in_process_beside_serving:  # (after the served run whose processes it imitates)
            run_in_process(p, beside_serving=True)
            release_memory()
    if args.merge_guidellm:
        other = json.loads(Path(args.merge_guidellm).read_text())
        results["merged"] = {"what": "guidellm", "command": other["command"], "environment": other["environment"]}
        results["guidellm"] = other["guidellm"]
    results["tokens"] = check_tokens(results["runs"], expected)
    results["summary"] = summarize(results["runs"])
    results["ratios"] = ratios(results["summary"])
    table = markdown_table(results)
    print(json.dumps({"tokens": results["tokens"], "ratios": results["ratios"]}, indent=1), file=sys.stderr)
    print(table, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(table + "\n")
    print(f"wrote {out}/results.json, results.md", file=sys.stderr)
    return 1 if results["tokens"]["streams_mismatched"] else 0
