"""Prefix caching on the paged KV cache (viasd/blocks.py): a row that attaches the published
blocks of its prompt's prefix holds the keys and values it would have computed, for any
schedule of requests with common prefixes, rollbacks and leaves, at any block size; blocks no row
holds stay cached until the pool needs them (least recently used first); a block written in
place stops being shared. The engine: requests with a common prompt prefix produce token for
token (float64) what they produce alone, in every mode and under both cache policies, while
computing fewer prompt positions."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_blocks import MIXED, SPECULATE, _alone, _assert_same_sample, _engine, _params, _run_joining

from viasd.runtime import LayerMask, MaskedLM, Row

LM = MaskedLM(tiny_model("llama", layers=3))
MASK = LayerMask.from_skipped((1,), LM.num_layers)


def _prefill(store, row: int, tokens: list[int]) -> int:
    """What a session's prefill does on a paged store: attach, feed the rest, publish; the
    positions it attached."""
    n = store.attach(row, tokens)
    if n < len(tokens):
        LM.forward_batch([Row(tokens[n:], n, 1, row)], store, store_mask(store))
    store.publish(row, tokens)
    return n


def store_mask(store):
    return None if len(store.layers) == LM.num_layers else MASK


def _same_kv(a_store, a_row, b_store, b_row) -> None:
    for layer in a_store.layers:
        assert a_store.length(a_row, layer) == b_store.length(b_row, layer)
        if not a_store.length(a_row, layer):
            continue
        for x, y in zip(a_store.kv(a_row, layer), b_store.kv(b_row, layer)):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-12)


# ("join", which prefix, its tokens taken, own tokens after them) | ("leave", row) | ("crop", row, positions back)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 2), st.integers(0, 30), st.integers(1, 9)),
        st.tuples(st.just("leave"), st.integers(0, 7)),
        st.tuples(st.just("crop"), st.integers(0, 7), st.integers(1, 12)),
    ),
    min_size=3,
    max_size=16,
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, block_size=st.sampled_from([1, 3, 4, 8]), masked=st.booleans(), blocks=st.integers(12, 40))
def test_attached_prefixes_hold_what_the_row_would_have_computed(ops, block_size, masked, blocks):
    """Requests whose prompts begin with one of three prefixes join (attach what is published,
    feed the rest, publish), roll back and feed their tokens again (writing into blocks they share
    or published), and leave, on a pool small enough that cached blocks are reused and admitted
    against the scheduler's count (which never makes a forward find the pool full); after every
    op each live row's keys and values equal its tokens fed alone into a slot row, the pool's
    free blocks are exactly those no row holds, and in the end each row's next logits equal the
    slot row's."""
    mask = MASK if masked else None
    paged = LM.new_store(mask, max_rows=8, max_len=64, block_size=block_size, num_blocks=blocks, prefix_caching=True)
    gen = torch.Generator().manual_seed(block_size * 1000 + blocks)
    prefixes = [torch.randint(0, LM.vocab_size, (30,), generator=gen).tolist() for _ in range(3)]
    live: dict[int, list[int]] = {}  # paged row -> its tokens (all fed but the last)
    attached = 0

    def held(row: int) -> int:
        return paged.length(row, paged.layers[0])

    for op in ops:
        rows = sorted(live)
        if op[0] == "join" and len(live) < 8:
            tokens = prefixes[op[1]][: op[2]] + torch.randint(0, LM.vocab_size, (op[3],), generator=gen).tolist()
            if sum(paged.blocks_for(len(t)) for t in [*live.values(), tokens]) > paged.num_blocks:
                continue  # (the scheduler's count, blocks through the next token, shared ones each time: it waits)
            row = paged.alloc()
            n = _prefill(paged, row, tokens[:-1])
            assert n % block_size == 0 and n <= len(tokens) - 1 and held(row) == len(tokens) - 1
            attached += n
            live[row] = tokens
        elif op[0] == "leave" and rows:
            row = rows[op[1] % len(rows)]
            paged.free(row)
            del live[row]
        elif op[0] == "crop" and rows:
            row = rows[op[1] % len(rows)]
            end = held(row)
            paged.crop(row, max(0, end - op[2]))
            if held(row) < end:  # feed them again: a shared block is copied first, a published one unpublished
                LM.forward_batch([Row(live[row][held(row) : end], held(row), 1, row)], paged, mask)
        for row, tokens in live.items():
            slot = LM.new_store(mask, max_rows=1, max_len=64)
            s = slot.alloc()
            if held(row):
                LM.forward_batch([Row(tokens[: held(row)], 0, 1, s)], slot, mask)
            _same_kv(slot, s, paged, row)
        assert paged.free_blocks == paged.num_blocks - len({b for r in live for b in paged.blocks(r)})
    for row, tokens in live.items():
        slot = LM.new_store(mask, max_rows=1, max_len=64)
        s = slot.alloc()
        want = LM.forward_batch([Row(tokens, 0, 1, s)], slot, mask)[0]
        got = LM.forward_batch([Row(tokens[held(row) :], held(row), 1, row)], paged, mask)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    for row in list(live):
        paged.free(row)
    assert paged.free_blocks == paged.num_blocks and paged.attached_positions == attached


def test_a_second_request_attaches_the_full_blocks_of_the_first_ones_prompt():
    store = LM.new_store(max_rows=3, max_len=64, block_size=4, num_blocks=20, prefix_caching=True)
    system = list(range(3, 13))  # 10 tokens: 2 full blocks
    a, b, c = store.alloc(), store.alloc(), store.alloc()
    assert _prefill(store, a, system + [40, 41]) == 0  # nothing published yet
    assert _prefill(store, b, system + [50, 51, 52]) == 8
    assert store.blocks(b)[:2] == store.blocks(a)[:2] and store.blocks(b)[2] != store.blocks(a)[2]
    assert _prefill(store, c, [3, 4, 5]) == 0  # no full block in common
    assert store.num_blocks - store.free_blocks == 3 + 2 + 1  # a: 3; b: 2 of its own (13 positions); c: 1
    assert store.attached_positions == 8
    store.free(c)
    c = store.alloc()
    _prefill(store, c, [2, 4, 5, 6, 7, 7, 7, 7, 1])  # publishes a block 0 of its own
    store.free(c)
    c = store.alloc()
    assert store.attach(c, [2, 4, 5, 6] + system[4:8]) == 4  # its block 0; a's block 1 followed another block 0


def test_blocks_no_row_holds_stay_cached_until_the_pool_needs_them_least_recent_first():
    store = LM.new_store(max_rows=2, max_len=64, block_size=4, num_blocks=6, prefix_caching=True)
    first, second = list(range(1, 9)), list(range(20, 28))  # two blocks each
    row = store.alloc()
    _prefill(store, row, first + [9])  # 3 blocks, 2 published
    store.free(row)
    row = store.alloc()
    _prefill(store, row, second + [29])
    store.free(row)
    assert store.free_blocks == store.num_blocks  # cached blocks count as free
    row = store.alloc()
    assert _prefill(store, row, first + [9]) == 8  # still cached, though freed (and now the most recent)
    store.free(row)
    row = store.alloc()
    _prefill(store, row, list(range(40, 53)))  # 4 blocks: 2 unused, then the 2 least recently used (second's)
    other = store.alloc()
    assert store.attach(other, second) == 0  # forgotten
    assert store.attach(other, first) == 8  # survived


def test_a_published_block_written_in_place_is_no_longer_attached():
    store = LM.new_store(max_rows=2, max_len=64, block_size=4, num_blocks=8, prefix_caching=True)
    row = store.alloc()
    _prefill(store, row, list(range(1, 10)))  # blocks 0, 1 published
    store.crop(row, 6)
    LM.forward_batch([Row([90, 91], 6, 1, row)], store)  # block 1 now holds other tokens
    other = store.alloc()
    assert _prefill(store, other, list(range(1, 10))) == 4  # only block 0 still holds that prefix


def test_off_nothing_is_attached():
    store = LM.new_store(max_rows=2, max_len=64, block_size=4, num_blocks=8)
    a, b = store.alloc(), store.alloc()
    _prefill(store, a, list(range(1, 10)))
    assert _prefill(store, b, list(range(1, 10))) == 0 and store.attached_positions == 0


# ------------------------------------------------------------------ the engine


SYSTEM = [(7 * i + 3) % 90 + 1 for i in range(22)]  # a shared "system prompt": 5 full blocks of 4


@pytest.mark.parametrize("policy", ["separate", "shared"])
def test_requests_with_a_common_prefix_produce_what_they_produce_alone(tiny_pair, policy):
    """The mixed requests (every mode, sampled and greedy, n > 1, logprobs, prompt logprobs), each
    prompt behind one common prefix, join in waves on a budget that preempts: each sample equals
    the request alone on slot caches token for token (float64); the later ones attach the prefix
    (stats.cached_tokens), except where prompt logprobs must score it, and the pools give every
    block back."""
    jobs = [(SYSTEM + prompt, _params(spec)) for prompt, spec in MIXED]
    alone = [_alone(tiny_pair, policy, *job) for job in jobs]
    per_token = _engine(tiny_pair, cache_policy=policy, max_batch=1, max_seq_len=8).kv_bytes_per_token
    engine = _engine(
        tiny_pair,
        cache_policy=policy,
        max_batch=16,
        kv_block_size=4,
        prefill_chunk=40,
        costs=SPECULATE,
        kv_cache_gib=60 * 4 * per_token / 2**30,
    )
    got, _ = _run_joining(engine, jobs, [0, 1, 1, 1, 2, 2, 2, 5, 5, 5, 5])
    for i, (spec, samples, want) in enumerate(zip(MIXED, got, alone)):
        for j, (g, w) in enumerate(zip(samples, want)):
            _assert_same_sample(g, w, (i, j, spec))
    stats = [samples[0]["stats"] for samples in got]
    assert stats[0].cached_tokens == 0  # the first computes the prefix
    for (_, spec), s in zip(MIXED[1:], stats[1:]):
        if not s.preemptions:  # (a resumed request attaches its own blocks again, where still cached)
            assert s.cached_tokens == (0 if "prompt_logprobs" in spec else 20), (spec, s.cached_tokens)
        else:
            assert s.cached_tokens >= (0 if "prompt_logprobs" in spec else 20), (spec, s.cached_tokens)
    assert engine.scheduler.preemptions > 0 and any(s.preemptions and s.cached_tokens > 20 for s in stats)
    executor = engine.executor
    stores = [executor.verifier.full_store, executor.verifier.slim_store, executor.drafter.store]
    assert stores[0].attached_positions >= 20 * 9
    assert all(s.free_blocks == s.num_blocks and s.rows_in_use == 0 for s in stores)


def test_prefix_cache_hits_reach_the_metrics_and_openai_usage():
    """`viasd_prefix_cache_queries_total` / `_hits_total` (vLLM's prefix_cache_queries / hits) count
    the prompt once and every sample's attached positions; OpenAI's usage reports them as
    `prompt_tokens_details.cached_tokens`."""
    from viasd.cluster.openai_api import usage
    from viasd.cluster.serving_metrics import ServingMetrics, parse_exposition, total
    from viasd.metrics import RequestStats

    metrics = ServingMetrics("m")
    metrics.record_stats([RequestStats(prompt_tokens=30, cached_tokens=16), RequestStats(prompt_tokens=30)], "stop")
    metrics.record_stats([RequestStats(prompt_tokens=9)], "length")
    samples = parse_exposition(metrics.exposition()[0].decode())
    assert total(samples, "viasd_prefix_cache_queries_total", model_name="m") == 39
    assert total(samples, "viasd_prefix_cache_hits_total", model_name="m") == 16
    got = usage(RequestStats(prompt_tokens=30, generated_tokens=4, cached_tokens=16).to_dict(), None)
    assert got == {
        "prompt_tokens": 30,
        "completion_tokens": 4,
        "total_tokens": 34,
        "prompt_tokens_details": {"cached_tokens": 16},
    }


def test_prefill_goes_on_from_what_was_attached(tiny_pair):
    """Chunks of 8 prompt tokens: a request behind a 20-position cached prefix attaches it in its
    first prefill step and its next chunk starts past it (not rolled back to the chunk's end): it
    has its first token in its second step, after one prefill forward of its own 4 positions."""
    params = _params(dict(mode="ar"), max_tokens=2)
    engine = _engine(tiny_pair, max_batch=2, kv_block_size=4, prefill_chunk=8, max_seq_len=64)
    first = engine.submit(SYSTEM + [40, 41, 42], params)
    while engine.scheduler.has_work():
        engine.step()
    second = engine.submit(SYSTEM + [50, 51, 52], params)
    steps = 0
    while not second.chunks:
        engine.step()
        steps += 1
    while engine.scheduler.has_work():
        engine.step()
    assert first.stats.cached_tokens == 0 and second.stats.cached_tokens == 20
    assert steps == 2 and second.stats.prefill_forwards == 1, (steps, second.stats.prefill_forwards)
