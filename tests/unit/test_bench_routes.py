"""`viasd bench --suite routes` (viasd/bench/routes.py): the bytes each route moves for the same
recorded steps, the least-squares price of a byte of transport, and what the table makes of them."""

from __future__ import annotations

import pytest

from viasd.bench import routes, tables

V = 1000  # vocabulary of the made-up steps
P_ROW = 4 * V + 6  # a float32 row of p as encoded, with a little framing


def _row(k: int, rejected: bool, sampled: bool = True) -> dict:
    return {"k": k, "probs_bytes": k * P_ROW if sampled else 0, "rejected": rejected}


def test_route_bytes_of_one_step():
    step = [_row(5, False), _row(5, True), _row(3, True), _row(2, True, sampled=False)]  # (the last: greedy)
    got = routes.route_bytes(step, V)
    probs = 13 * P_ROW
    assert got["through the engine"] == 2 * probs  # drafter -> engine -> verifier
    assert got["drafter to verifier"] == probs  # one hop
    # p(x~) of the 13 sampled draft tokens, both hops; q's row for the 2 sampled rows that rejected, both hops
    assert got["probability only"] == 2 * 4 * 13 + 2 * 4 * V * 2
    # float64 probabilities: twice the values' bytes on route (c); (a) and (b) are what was encoded
    assert routes.route_bytes(step, V, value_bytes=8)["probability only"] == 2 * 8 * 13 + 2 * 8 * V * 2


def test_a_step_without_rejections_or_probabilities():
    assert routes.route_bytes([_row(4, False)], V)["probability only"] == 2 * 4 * 4
    greedy = routes.route_bytes([_row(4, True, sampled=False)], V)
    assert greedy == {"through the engine": 0, "drafter to verifier": 0, "probability only": 0}


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


def _record() -> dict:
    """Two passes of 2 rows: one full step each and a last step with one row left."""

    def run(tokens: int, wall: float) -> dict:
        steps = [[_row(5, True), _row(5, False)], [_row(2, False)]]
        calls = [{"bytes": x, "transport": 1e-8 * x} for x in (10 * P_ROW, 100, 2 * P_ROW, 50)]
        return {"tokens": tokens, "wall_s": wall, "probs_dtypes": ["float32"], "steps": steps, "calls": calls}

    return {
        "command": "viasd bench --suite routes",
        "environment": {"git_commit": "0123456789abcdef", "git_dirty": False, "cpu_capability": "AVX512"},
        "runtime": {"dtype": "bfloat16"},
        "vocab_size": V,
        "value_bytes": 4,
        "rows": 2,
        "params": {"mode": "sd", "temperature": 1.0, "max_tokens": 48},
        "passes": [run(96, 10.0), run(96, 12.0)],
    }


def test_summarize_prices_each_routes_saving_at_the_fitted_price():
    record = _record()
    s = routes.summarize(record["passes"][0], V, rows=2)
    assert (s["steps"], s["full_steps"], s["rejected_rows"]) == (2, 1, [1])
    assert s["seconds_per_mb"] == pytest.approx(1e-8 * 1e6)
    engine = s["routes"]["through the engine"]
    assert engine["tokens_per_s"] == pytest.approx(96 / 10.0)  # measured: nothing saved
    assert engine["mb_per_full_step"] == pytest.approx(2 * 10 * P_ROW / 1e6)  # the full step only
    one_hop = s["routes"]["drafter to verifier"]
    assert one_hop["seconds_saved"] == pytest.approx(1e-8 * 12 * P_ROW)  # both steps' p, once
    assert one_hop["tokens_per_s"] == pytest.approx(96 / (10.0 - 1e-8 * 12 * P_ROW))
    only = s["routes"]["probability only"]
    c_bytes = (2 * 4 * 10 + 2 * 4 * V) + 2 * 4 * 2
    assert only["seconds_saved"] == pytest.approx(1e-8 * (2 * 12 * P_ROW - c_bytes))
    assert only["tokens_per_s"] > one_hop["tokens_per_s"] > engine["tokens_per_s"]


def test_the_table_reads_every_pass():
    record = _record()
    lines = tables.draft_routes([record])
    assert lines[0].startswith("| route | MB per step at 2 rows | tokens/s, pass 1 / pass 2 |")
    assert lines[2] == f"| through the engine (measured) | {2 * 10 * P_ROW / 1e6:.2f} | 9.60 / 8.00 | 1.00x |"
    assert lines[3].startswith("| drafter to verifier (estimated) |")
    assert "differ by 18.2%" in lines[-1]  # (9.6 - 8.0) / 8.8
    md = tables.routes_markdown(record)
    assert md.startswith("Command: `viasd bench --suite routes`; commit `0123456`; CPU capability `AVX512`.")
