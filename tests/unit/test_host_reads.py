"""A decode step reads the host at most twice, whatever the batch size (viasd.sessions): once for
the committed tokens and counts, and a `via` step once more for the gate's decisions; rows that
ask for logprobs add one read for all of them. Counted around `Engine.step` on every thread (the
engine steps on its model thread)."""

from __future__ import annotations

import threading

import pytest
import torch

from viasd.bench.host_reads import count_host_reads
from viasd.config import parse_params
from viasd.engine import Engine
from viasd.runtime import LayerMask

MODES = [
    dict(mode="ar"),
    dict(mode="sd"),
    dict(mode="via"),
    dict(mode="auto"),
    dict(mode="ar", temperature=1.0),
    dict(mode="sd", temperature=1.0),
    dict(mode="via", temperature=1.0),
    dict(mode="via", temperature=1.0, rule="staged"),
]


@pytest.fixture(scope="module")
def pair():
    from conftest import drafter_from, tiny_model

    from viasd.runtime import MaskedLM

    verifier = tiny_model("qwen2", dtype=torch.float32)
    return MaskedLM(verifier), MaskedLM(drafter_from(verifier))


@pytest.mark.parametrize("rows", [8, 32])
@pytest.mark.parametrize("spec", MODES, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_a_decode_step_reads_the_host_at_most_twice(pair, rows, spec):
    assert 1 <= max(_reads_per_step(pair, rows, spec)) <= 2


@pytest.mark.parametrize("spec", [dict(mode="sd", temperature=1.0), dict(mode="via")], ids=["sd", "via"])
def test_logprobs_add_one_read_for_every_row(pair, spec):
    reads = _reads_per_step(pair, 8, dict(spec, logprobs=3))
    assert max(reads) == max(_reads_per_step(pair, 8, spec)) + 1 <= 3


def _reads_per_step(pair, rows: int, spec: dict) -> list[int]:
    """Host reads of each of 4 decode steps of `rows` requests (every row decoding in each)."""
    verifier, drafter = pair
    engine = Engine(verifier, drafter, mask=LayerMask.from_skipped((1, 3), verifier.num_layers), max_batch=rows)
    try:
        params = [
            parse_params(max_tokens=64, ignore_eos=True, alpha1=0.9, alpha2=0.7, seed=i, **spec) for i in range(rows)
        ]
        handles = [engine.submit([5 + i % 50, 17, 3, 88, 41], p) for i, p in enumerate(params)]
        while not all(r.prefilled for r in engine.scheduler._running) or len(engine.scheduler._running) < rows:
            engine.step()
        reads = []
        for _ in range(4):
            with count_host_reads() as counted:
                engine.step()
            reads.append(counted.total)
        assert all(not h.finished for h in handles)  # every row decoded in every counted step
        return reads
    finally:
        engine.close()


def test_the_counter_counts_reads_on_every_thread():
    t = torch.arange(4)
    with count_host_reads() as counted:
        t.tolist()
        worker = threading.Thread(target=lambda: (int(t[0]), bool(t[1]), t.sum().item()))
        worker.start()
        worker.join()
    assert counted.total == 4 and counted.by_method == {"tolist": 1, "__int__": 1, "__bool__": 1, "item": 1}
    with count_host_reads() as nothing:
        (t + 1) * 2
    assert nothing.total == 0


def test_a_forwards_rows_are_viewed_not_copied():
    """Logits rows that lie one after the other (a forward's, asked for in order) are batched as a
    view of the forward's tensor; others are copied, in the order asked."""
    from viasd.sessions import _rows

    big = torch.randn(10, 7)
    view = _rows(list(big.split([3, 1, 6])))
    assert view.data_ptr() == big.data_ptr() and torch.equal(view, big)
    for parts in ([big[3:4], big[0:3]], [big[0:2], big[3:5]]):
        copied = _rows(parts)
        assert copied.data_ptr() != big.data_ptr() and torch.equal(copied, torch.cat(parts))
    assert _rows([big[:2], big[2:4].double()]).dtype == torch.float64
