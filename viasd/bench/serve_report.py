"""The records of `viasd bench --suite serve` (viasd.bench.serve): what a level of streams measured,
the cores each kind of process kept busy, the served coordinator's and planner's counters from
/metrics, the greedy token check, the summary over passes and the Markdown table.

    aggregate tokens/s = all streams' completion tokens / wall time from first request to last token

Inter-token latency: a chunk of n tokens after a gap g counts n gaps of g / n (as the serving
metrics do). A summary row is the median of each figure over the passes of one (system, mode,
streams).
"""

from __future__ import annotations

import os
import statistics

from viasd.errors import require


def mode_params(spec: str) -> dict:
    """'sd' -> {mode: sd}; 'sd:overlap=true:proposer=hybrid' -> request parameters (bench-style specs)."""
    head, *parts = spec.split(":")
    params: dict = {"mode": head}
    for part in parts:
        key, value = part.split("=", 1)
        params[key] = {"true": True, "false": False}.get(value, value)
    return params


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


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
    psutil = require("psutil", "bench")

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
    psutil = require("psutil", "bench")

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


TABLE_HEADER = (
    "| mode | streams | in-process tok/s | served tok/s | served / in-process | served TTFT p50 / p99 (s) "
    "| served ITL p50 / p99 (s) | guidellm tok/s | guidellm TTFT p50 / p99 (s) | guidellm ITL p50 / p99 (s) |"
)


def markdown_table(results: dict, in_process: bool = True) -> str:
    """Each mode and level of a results file: in-process and served tokens/s, their ratio, served
    TTFT and ITL, and guidellm's figures where it ran; `in_process=False` leaves the in-process runs out."""
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
    """served / in-process aggregate tokens/s per (mode, concurrency); where the in-process engine
    also ran beside the serving stack's share of the cores, served / that and that / in-process;
    and each system's aggregate at c streams / at 1 stream."""
    agg = {(r["system"], r["mode"], r["concurrency"]): r["aggregate_tokens_per_s"] for r in runs}
    pairs = {
        "served_over_in_process": ("served", "in_process"),
        "served_over_beside_serving": ("served", "in_process_beside_serving"),
        "beside_serving_over_in_process": ("in_process_beside_serving", "in_process"),
    }
    out: dict = {"served_over_in_process": {}, "scaling_over_1_stream": {}}
    for (system, mode, c), v in agg.items():
        for name, (top, base) in pairs.items():
            if system == top and (base, mode, c) in agg:
                out.setdefault(name, {})[f"{mode}@{c}"] = round(v / agg[(base, mode, c)], 3)
        if (system, mode, 1) in agg:
            out["scaling_over_1_stream"][f"{system}:{mode}@{c}"] = round(v / agg[(system, mode, 1)], 3)
    return out
