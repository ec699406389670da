"""The records of `viasd bench --suite serve` (viasd.bench.serve_report), without a server: request
specs, the greedy token check, the median over passes, the ratios and the table."""

from __future__ import annotations

from viasd.bench.serve_report import check_tokens, cpu_used, markdown_table, mode_params, ratios, summarize


def _run(system: str, mode: str, c: int, tps: float, ids, p: int = 0) -> dict:
    return {
        "system": system,
        "mode": mode,
        "concurrency": c,
        "pass": p,
        "aggregate_tokens_per_s": tps,
        "p50_ttft_s": 0.1,
        "p99_ttft_s": 0.2,
        "p50_itl_s": 0.01,
        "p99_itl_s": 0.02,
        "stream_token_ids": [[i, list(x)] for i, x in enumerate(ids)],
    }


def test_mode_params_reads_bench_style_specs():
    assert mode_params("sd") == {"mode": "sd"}
    assert mode_params("sd:overlap=true:gamma=3") == {"mode": "sd", "overlap": True, "gamma": "3"}


def test_a_stream_that_differs_from_its_prompts_first_stream_is_a_mismatch():
    runs = [
        _run("in_process", "ar", 2, 10.0, [[1, 2], [3, 4]]),
        _run("served", "sd", 2, 9.0, [[1, 2], [3, 5]]),  # lossless: sd must equal ar; prompt 1 differs
        _run("served", "via", 1, 8.0, [[7, 7]]),  # via has its own reference
    ]
    assert check_tokens(runs, {}) == {"streams_checked": 5, "streams_mismatched": 1}
    assert [r["mismatched_streams"] for r in runs] == [0, 1, 0]


def test_summary_takes_the_median_of_the_passes_and_the_ratios_pair_the_systems():
    runs = [_run(s, "ar", c, tps * (1 + p), [[1]], p) for s, tps in (("in_process", 10.0), ("served", 9.0))
            for c in (1, 2) for p in (0, 1, 2)]  # fmt: skip
    summary = summarize(runs)
    assert len(summary) == 4 and all(r["passes"] == 3 for r in summary)
    assert {(r["system"], r["concurrency"]): r["aggregate_tokens_per_s"] for r in summary}[("served", 2)] == 18.0
    out = ratios(summary)
    assert out["served_over_in_process"] == {"ar@1": 0.9, "ar@2": 0.9}
    table = markdown_table({"summary": summary, "modes": ["ar"], "levels": [1, 2]})
    assert "| ar | 2 | 20.00 | 18.00 | 0.90 |" in table


def test_cores_busy_is_cpu_seconds_over_wall_seconds_per_class():
    before = {1: ("client", 1.0), 2: ("drafter", 5.0)}
    after = {1: ("client", 2.0), 2: ("drafter", 7.0), 3: ("verifier", 4.0)}
    assert cpu_used(before, after, 2.0) == {"client": 0.5, "drafter": 1.0, "verifier": 2.0}


def test_the_serving_share_is_every_class_but_the_model_actors_less_the_background():
    from viasd.bench.serve import serving_share

    runs = [
        {**_run("in_process", "ar", 4, 10.0, [[1]], 1), "cores_busy": {"client": 1.9, "other": 0.02}},
        {**_run("served", "ar", 4, 9.0, [[1]], 1),
         "cores_busy": {"verifier": 1.8, "drafter": 0.1, "proxy": 0.03, "replica": 0.05, "other": 0.06}},
        {**_run("served", "ar", 4, 9.0, [[1]], 0), "cores_busy": {"verifier": 1.0, "proxy": 0.5}},
    ]  # fmt: skip
    assert abs(serving_share(runs, "ar", 4, 1) - 0.12) < 1e-9  # 0.03 + 0.05 + 0.06 - 0.02
    assert serving_share(runs, "ar", 4, 0) == 0.5  # no in-process run of that pass: nothing to take off
    runs.append({**_run("in_process_beside_serving", "ar", 4, 9.5, [[1]], 1), "cores_busy": {}})
    out = ratios(summarize(runs))
    assert out["served_over_beside_serving"] == {"ar@4": 0.947} and out["beside_serving_over_in_process"] == {
        "ar@4": 0.95
    }


def test_a_synthetic_load_keeps_its_share_of_the_cores_busy_until_stopped():
    import time

    import psutil

    from viasd.bench.serve import SyntheticLoad

    load = SyntheticLoad()
    load.start(0.4)
    try:
        procs = [psutil.Process(p.pid) for p in load.procs]
        time.sleep(0.3)
        before, t0 = sum(sum(p.cpu_times()[:2]) for p in procs), time.perf_counter()
        time.sleep(1.5)
        busy = (sum(sum(p.cpu_times()[:2]) for p in procs) - before) / (time.perf_counter() - t0)
    finally:
        load.stop()
    assert len(procs) == 1 and 0.25 < busy < 0.6, busy
    assert not load.procs and not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
