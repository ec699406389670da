"""`viasd bench --suite routes` (viasd/bench/routes.py): each measured route's bytes per step and
tokens/s, the estimate of the one-hop route from the first's steps at the least-squares price of a
byte of transport, and what the table makes of them."""

from __future__ import annotations

import pytest

from viasd.bench import routes, tables

V = 1000  # vocabulary of the made-up steps
P_ROW = 4 * V + 6  # a float32 row of p as encoded, with a little framing


def _row(k: int, rejected: bool, sampled: bool = True, rows: bool = True) -> dict:
    return {"k": k, "probs_bytes": k * P_ROW if sampled and rows else 0, "rejected": rejected}


def test_per_byte_recovers_a_line():
    calls = [{"bytes": x, "transport": 0.002 + 3e-9 * x} for x in (1_000, 2_000_000, 10_000_000, 48_000_000)]
    a, b = routes.per_byte(calls)
    assert a == pytest.approx(0.002)
    assert b == pytest.approx(3e-9)


def test_per_byte_is_least_squares_on_noisy_calls():
    calls = [{"bytes": x, "transport": t} for x, t in ((0, 0.0), (1, 1.0), (2, 1.0), (3, 2.0))]
    a, b = routes.per_byte(calls)
    assert (a, b) == pytest.approx((0.1, 0.6))  # slope cov/var = 1.5 / 2.5; intercept 1.0 - 0.6 x 1.5
    assert routes.per_byte([{"bytes": 5, "transport": 0.1}] * 3) == (pytest.approx(0.1), 0.0)  # no spread: no slope


def _run(tokens: int, wall: float, rows: bool) -> dict:
    """A pass of 2 rows on one route: one full step and a last step with one row left."""
    steps = [[_row(5, True, rows=rows), _row(5, False, rows=rows)], [_row(2, False, rows=rows)]]
    step_bytes = [2 * 10 * P_ROW + 300, 2 * 2 * P_ROW + 100] if rows else [2 * 8 * 10 + 2 * 4 * V + 300, 132]
    calls = [{"bytes": x, "transport": 1e-8 * x} for x in (10 * P_ROW, 100, 2 * P_ROW, 50)]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "probs_dtypes": ["float32"],
        "steps": steps,
        "step_bytes": step_bytes,
        "calls": calls,
    }


def _record() -> dict:
    return {
        "command": "viasd bench --suite routes",
        "environment": {"git_commit": "0123456789abcdef", "git_dirty": False, "cpu_capability": "AVX512"},
        "runtime": {"dtype": "bfloat16"},
        "vocab_size": V,
        "value_bytes": 4,
        "rows": 2,
        "params": {"mode": "sd", "temperature": 1.0, "max_tokens": 48},
        "passes": [
            {"rows": _run(96, 10.0, True), "probability": _run(96, 8.0, False)},
            {"rows": _run(96, 12.0, True), "probability": _run(96, 8.5, False)},
        ],
    }


def test_summarize_measures_two_routes_and_prices_the_third():
    record = _record()
    s = routes.summarize(record["passes"][0], rows=2)
    assert s["seconds_per_mb"] == pytest.approx(1e-8 * 1e6)
    engine = s["routes"]["through the engine"]
    assert (engine["steps"], engine["full_steps"], engine["rejected_rows"]) == (2, 1, [1])
    assert engine["tokens_per_s"] == pytest.approx(96 / 10.0)
    assert engine["mb_per_full_step"] == pytest.approx((2 * 10 * P_ROW + 300) / 1e6)  # the full step only
    one_hop = s["routes"]["drafter to verifier"]
    assert one_hop["mb_per_full_step"] == pytest.approx((10 * P_ROW + 300) / 1e6)  # one hop of p less
    assert one_hop["seconds_saved"] == pytest.approx(1e-8 * 12 * P_ROW)  # both steps' p, once
    assert one_hop["tokens_per_s"] == pytest.approx(96 / (10.0 - 1e-8 * 12 * P_ROW))
    only = s["routes"]["probability only"]
    assert only["tokens_per_s"] == pytest.approx(96 / 8.0)  # measured on its own pass
    assert only["mb_per_full_step"] == pytest.approx((2 * 8 * 10 + 2 * 4 * V + 300) / 1e6)


def test_the_table_reads_every_pass():
    record = _record()
    lines = tables.draft_routes([record])
    assert lines[0].startswith("| route | MB per step at 2 rows | tokens/s, pass 1 / pass 2 |")
    assert lines[2] == f"| through the engine (measured) | {(2 * 10 * P_ROW + 300) / 1e6:.2f} | 9.60 / 8.00 | 1.00x |"
    assert lines[3].startswith("| drafter to verifier (estimated) |")
    gain = (12.0 / 9.6 + (96 / 8.5) / 8.0) / 2
    assert (
        lines[4]
        == f"| probability only (measured) | {(2 * 8 * 10 + 2 * 4 * V + 300) / 1e6:.2f} | 12.00 / 11.29 | {gain:.2f}x |"
    )
    assert "through the engine 18.2%" in lines[-1]  # (9.6 - 8.0) / 8.8
    md = tables.routes_markdown(record)
    assert md.startswith("Command: `viasd bench --suite routes`; commit `0123456`; CPU capability `AVX512`.")
