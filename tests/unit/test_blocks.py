"""The paged KV cache (viasd/blocks.py) against the slot cache: the same logits and the same keys
for any schedule of joins, ragged batched forwards, rollbacks, shared prefixes and leaves, at any
block size; blocks come back to the pool; a forward the pool cannot hold changes nothing."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from viasd.blocks import PagedKVCache
from viasd.errors import CapacityError
from viasd.runtime import LayerMask, MaskedLM, Row

LM = MaskedLM(tiny_model("qwen2", layers=4))
MASK = LayerMask.from_skipped((1,), LM.num_layers)


def _assert_rows_equal(slots, paged, rows: dict[int, int]) -> None:
    """Every live row holds the same keys and values, layer by layer, in both caches."""
    for row, prow in rows.items():
        for layer in slots.layers:
            assert slots.length(row, layer) == paged.length(prow, layer)
            if slots.length(row, layer):
                for a, b in zip(slots.kv(row, layer), paged.kv(prow, layer)):
                    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


# one op: ("join", prompt length) | ("step", tokens per row, logits) | ("crop", row, back) | ("fork", row) | ("leave", row)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(1, 21)),
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("crop"), st.integers(0, 7), st.integers(1, 9)),
        st.tuples(st.just("fork"), st.integers(0, 7)),
        st.tuples(st.just("leave"), st.integers(0, 7)),
    ),
    min_size=4,
    max_size=14,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, block_size=st.sampled_from([1, 3, 4, 16]), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_paged_equals_slots_for_any_schedule(ops, block_size, masked, seed):
    mask = MASK if masked else None
    slots = LM.new_store(mask, max_rows=6, max_len=64)
    paged = LM.new_store(mask, max_rows=6, max_len=64, block_size=block_size)
    gen = torch.Generator().manual_seed(seed)
    live: dict[int, int] = {}  # slot row -> paged row
    pos: dict[int, int] = {}  # slot row -> positions held

    def tokens(n):
        return torch.randint(0, LM.vocab_size, (n,), generator=gen).tolist()

    def forward(batch: dict[int, list[int]]):
        rows = list(batch)
        a = LM.forward_batch([Row(batch[r], pos[r], len(batch[r]), r) for r in rows], slots, mask)
        b = LM.forward_batch([Row(batch[r], pos[r], len(batch[r]), live[r]) for r in rows], paged, mask)
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-10)
        for r in rows:
            pos[r] += len(batch[r])

    for op in ops:
        rows = sorted(live)
        if op[0] == "join" and len(live) < 6:
            row = slots.alloc()
            live[row], pos[row] = paged.alloc(), 0
            forward({row: tokens(op[1])})
        elif op[0] == "step" and rows:
            forward({r: tokens(1 + (op[1] + r) % 4) for r in rows if pos[r] + 4 <= 64})
        elif op[0] == "crop" and rows:
            row = rows[op[1] % len(rows)]
            pos[row] = max(0, pos[row] - op[2])
            slots.crop(row, pos[row])
            paged.crop(live[row], pos[row])
        elif op[0] == "fork" and rows and len(live) < 6:
            src = rows[op[1] % len(rows)]
            row = slots.alloc()
            live[row], pos[row] = paged.alloc(), pos[src]
            slots.copy_row(src, row, pos[src])
            paged.copy_row(live[src], live[row], pos[src])
        elif op[0] == "leave" and rows:
            row = rows[op[1] % len(rows)]
            slots.free(row)
            paged.free(live.pop(row))
            del pos[row]
        _assert_rows_equal(slots, paged, live)
        held = {b for r in live.values() for b in paged.blocks(r)}
        assert paged.free_blocks == paged.num_blocks - len(held)  # shared blocks counted once
        for r, prow in live.items():
            assert len(paged.blocks(prow)) == paged.blocks_for(pos[r])
    for row in list(live):
        paged.free(live.pop(row))
    assert paged.free_blocks == paged.num_blocks and paged.rows_in_use == 0


def test_a_forked_row_writes_its_own_copy_of_the_shared_block():
    paged = LM.new_store(max_rows=2, max_len=32, block_size=4)
    a = paged.alloc()
    LM.forward_batch([Row(list(range(1, 7)), 0, 1, a)], paged)  # 6 positions: blocks [1, 2]
    before = [t.clone() for t in paged.kv(a, 0)]
    b = paged.alloc()
    paged.copy_row(a, b, 6)
    assert paged.blocks(b) == paged.blocks(a) and paged.free_blocks == paged.num_blocks - 2
    LM.forward_batch([Row([9, 9], 6, 1, b)], paged)  # writes positions 6, 7 of the shared block 2
    assert paged.blocks(b)[0] == paged.blocks(a)[0] and paged.blocks(b)[1] != paged.blocks(a)[1]
    for x, y in zip(before, paged.kv(a, 0)):
        assert torch.equal(x, y)  # the source never sees the fork's tokens
    assert torch.equal(paged.kv(b, 0)[0][:, :, :6], before[0])


def test_a_forward_past_the_pool_is_refused_whole():
    paged = PagedKVCache(LM.all_layers, LM.num_layers, num_blocks=3, block_size=4, max_rows=2)
    a, b = paged.alloc(), paged.alloc()
    LM.forward_batch([Row(list(range(8)), 0, 1, a)], paged)  # 2 blocks
    with pytest.raises(CapacityError, match="kv_blocks"):
        LM.forward_batch([Row([1, 2], 8, 1, a), Row(list(range(5)), 0, 1, b)], paged)  # needs 1 + 2
    assert paged.free_blocks == 1 and paged.blocks(b) == () and paged.length(b, 0) == 0
    LM.forward_batch([Row([1, 2], 8, 1, a)], paged)  # fits alone
    paged.crop(a, 3)
    assert paged.free_blocks == 2 and len(paged.blocks(a)) == 1


def test_memory_follows_the_tokens_held():
    """One long row and many short ones: the pool holds their blocks, not rows x the longest."""
    paged = LM.new_store(max_rows=8, max_len=256, block_size=16)
    long, *short = [paged.alloc() for _ in range(8)]
    LM.forward_batch([Row([i % 90 for i in range(200)], 0, 1, long)], paged)
    LM.forward_batch([Row([1, 2, 3], 0, 1, r) for r in short], paged)
    held = 13 + 7  # ceil(200 / 16) + one block each
    assert paged.num_blocks - paged.free_blocks == held
    per_block = paged.reserved_bytes() // (paged._capacity)  # (the pool has grown to a power of two)
    assert paged.reserved_bytes() <= 2 * (held + 1) * per_block
    slots = LM.new_store(max_rows=8, max_len=256)
    rows = [slots.alloc() for _ in range(8)]
    LM.forward_batch([Row([i % 90 for i in range(200)], 0, 1, rows[0])], slots)
    LM.forward_batch([Row([1, 2, 3], 0, 1, r) for r in rows[1:]], slots)
    assert slots.reserved_bytes() > 2 * paged.reserved_bytes()


# ------------------------------------------------------------------ the engine on blocks


def _engine(pair, **kw):
    from viasd.engine import Engine

    verifier, drafter = pair
    return Engine(verifier, drafter, mask=LayerMask.from_skipped((1, 3), verifier.num_layers), **kw)


def test_requests_are_admitted_against_blocks_and_wait_for_them(tiny_pair):
    """A budget of 40 blocks of 4 positions: one long request (a 100-token prompt) and eight short
    ones. Slot rows of the same budget would hold 2 rows of 80 positions (the long prompt refused);
    blocks run the long one beside several short ones, queue the rest until blocks free, and every
    output equals the request alone on slot caches."""
    from viasd.config import parse_params

    per_token = _engine(tiny_pair, max_batch=1, max_seq_len=8).kv_bytes_per_token
    gib = 40 * 4 * per_token / 2**30
    engine = _engine(tiny_pair, max_batch=16, kv_cache_gib=gib, kv_block_size=4)
    cap = engine.scheduler.capacity
    assert (cap.kv_blocks, cap.max_seq_len) == (40, 160)
    slots = _engine(tiny_pair, max_batch=2, kv_cache_gib=gib)
    assert slots.scheduler.capacity.max_seq_len == 80
    jobs = [([(7 * i) % 90 + 1 for i in range(100)], parse_params(mode="sd", max_tokens=10, gamma=3))]
    jobs += [([3 + i, 5, 8 + i], parse_params(mode="via" if i % 2 else "ar", max_tokens=12)) for i in range(8)]
    handles = [engine.submit(*job) for job in jobs]
    tokens = {h: [] for h in handles}
    running, reserved = [], []
    while engine.scheduler.has_work():
        for handle, chunk in engine.step():
            tokens[handle] += chunk.token_ids
        running.append(engine.scheduler.num_running)
        reserved.append(engine.scheduler.kv_blocks_reserved)
        stores = [
            engine.executor.verifier.full_store,
            engine.executor.verifier.slim_store,
            engine.executor.drafter.store,
        ]
        assert all(s.num_blocks - s.free_blocks <= reserved[-1] for s in stores)  # blocks held within the reservation
    assert max(running) >= 3 and max(reserved) <= 40 and engine.scheduler.num_waiting == 0
    assert min(running[:3]) < len(jobs)  # some waited for blocks
    for handle, job in zip(handles, jobs):
        alone = _engine(tiny_pair, max_batch=1, max_seq_len=160).complete(*job).token_ids
        assert tokens[handle] == alone
    assert engine.scheduler.kv_blocks_reserved == 0
    assert all(s.free_blocks == s.num_blocks for s in stores)


def test_one_long_and_31_short_requests_decode_at_once_where_slot_rows_hold_4(tiny_pair):
    """The budget of 4 slot rows of 256 positions, paged in blocks of 4: one request with a
    250-token prompt and 31 with 19-token prompts, 4 new tokens each, all decode in the same step
    (slot rows: 4 at a time, or at max_batch 32 rows of 32 positions the long prompt is refused)."""
    from viasd.config import parse_params
    from viasd.errors import InvalidParameterError

    per_token = _engine(tiny_pair, max_batch=1, max_seq_len=8).kv_bytes_per_token
    gib = 4 * 256 * per_token / 2**30
    long = [(5 * i) % 90 + 1 for i in range(250)]
    short = [[3 + i, 7, 11 + i % 5] * 6 + [2] for i in range(31)]
    params = parse_params(mode="ar", max_tokens=4, ignore_eos=True)
    slots = _engine(tiny_pair, max_batch=32, kv_cache_gib=gib)
    with pytest.raises(InvalidParameterError, match="prompt"):
        slots.submit(long, params)
    engine = _engine(tiny_pair, max_batch=32, kv_cache_gib=gib, kv_block_size=4, prefill_chunk=1024)
    handles = [engine.submit(p, params) for p in [long, *short]]
    most = 0
    while engine.scheduler.has_work():
        engine.step()
        most = max(most, engine.scheduler.num_running)
    assert most == 32 and all(h.finished and h.error is None for h in handles)
