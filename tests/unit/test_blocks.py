"""The paged KV cache (viasd/blocks.py) against the slot cache: the same logits and the same keys
for any schedule of joins, ragged batched forwards, rollbacks, shared prefixes and leaves, at any
block size; blocks come back to the pool; a forward the pool cannot hold changes nothing.

The engine on blocks (viasd/scheduler.py): admission against the blocks requests hold and their
next step's growth; out of blocks, the request admitted last is preempted and resumed by
recomputing its caches, and every request produces token for token (float64) what it produces
with ample blocks and alone; the pools never hold more than the scheduler counts."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from viasd.blocks import PagedKVCache
from viasd.costs import CostModel
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
    output equals the request alone on slot caches. After every step each tier's pool holds at most
    the blocks the scheduler counts for the running requests, within the budget."""
    from viasd.config import parse_params

    per_token = _engine(tiny_pair, max_batch=1, max_seq_len=8).kv_bytes_per_token
    gib = 40 * 4 * per_token / 2**30
    engine = _engine(tiny_pair, max_batch=16, kv_cache_gib=gib, kv_block_size=4)
    cap = engine.scheduler.capacity
    assert (cap.kv_blocks, cap.max_seq_len) == (40, 160)
    slots = _engine(tiny_pair, max_batch=2, kv_cache_gib=gib, kv_block_size=0)
    assert slots.scheduler.capacity.max_seq_len == 80
    jobs = [([(7 * i) % 90 + 1 for i in range(100)], parse_params(mode="sd", max_tokens=10, gamma=3))]
    jobs += [([3 + i, 5, 8 + i], parse_params(mode="via" if i % 2 else "ar", max_tokens=12)) for i in range(8)]
    handles = [engine.submit(*job) for job in jobs]
    tokens = {h: [] for h in handles}
    running, needed = [], []
    while engine.scheduler.has_work():
        for handle, chunk in engine.step():
            tokens[handle] += chunk.token_ids
        running.append(engine.scheduler.num_running)
        needed.append(engine.scheduler.kv_blocks_needed)
        stores = [
            engine.executor.verifier.full_store,
            engine.executor.verifier.slim_store,
            engine.executor.drafter.store,
        ]
        assert all(s.num_blocks - s.free_blocks <= needed[-1] for s in stores)  # blocks held within the count
    assert max(running) >= 3 and engine.scheduler.num_waiting == 0
    assert min(running[:3]) < len(jobs)  # some waited for blocks
    for handle, job in zip(handles, jobs):
        alone = _engine(tiny_pair, max_batch=1, max_seq_len=160, kv_block_size=0).complete(*job).token_ids
        assert tokens[handle] == alone
    assert engine.scheduler.kv_blocks_needed == 0
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
    slots = _engine(tiny_pair, max_batch=32, kv_cache_gib=gib, kv_block_size=0)
    with pytest.raises(InvalidParameterError, match="prompt"):
        slots.submit(long, params)
    engine = _engine(tiny_pair, max_batch=32, kv_cache_gib=gib, kv_block_size=4, prefill_chunk=1024)
    handles = [engine.submit(p, params) for p in [long, *short]]
    most = 0
    while engine.scheduler.has_work():
        engine.step()
        most = max(most, engine.scheduler.num_running)
    assert most == 32 and all(h.finished and h.error is None for h in handles)


# ------------------------------------------------------------------ out of blocks: preemption and resumption

# every mode, greedy and seeded sampling, n > 1, logprobs, prompt logprobs and drafting options
MIXED = [
    ([5, 17, 3, 88, 41, 9], dict(mode="ar")),
    ([1, 2, 3], dict(mode="ar", temperature=1.0, seed=11, logprobs=2)),
    ([60] * 12, dict(mode="sd", gamma=4)),
    ([7], dict(mode="sd", temperature=1.0, seed=12, gamma=3, n=2)),
    ([33, 34, 35, 33, 34, 35, 33, 34], dict(mode="via")),
    (list(range(10, 40)), dict(mode="via", temperature=1.0, seed=14, slim_bonus=True, prompt_logprobs=1)),
    ([4, 8, 15, 16, 23, 42], dict(mode="via", rule="staged", temperature=1.0, seed=15)),
    ([9, 9, 2], dict(mode="sd", overlap=True, temperature=1.0, seed=16)),
    ([5, 6, 7, 8], dict(mode="sd", proposer="hybrid", adaptive_gamma=True, gamma=6, temperature=1.0, seed=17)),
    ([12, 13], dict(mode="via", n=3, temperature=0.9, seed=18, logprobs=1)),
    ([70, 71, 72, 73, 74], dict(mode="auto")),  # greedy `auto` equals greedy `ar` whatever it plans
]
# counters that follow from a request's random streams alone (not from timing or its neighbours)
DECODE_COUNTERS = (
    "generated_tokens",
    "finish_reason",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_accepted_tokens_per_pos",
    "num_rejected_tokens",
    "num_bonus_tokens",
    "num_cycle_tokens",
    "slim_accepted",
    "slim_rewritten",
    "escalations",
    "full_accepted",
)
# full forward dear and flat in tokens, drafter cheap: `auto` speculates
SPECULATE = CostModel({"full": [(1, 1.0), (64, 1.3)], "slim": [(1, 0.5), (64, 0.7)], "drafter": [(1, 0.05), (64, 0.6)]})


def _params(spec: dict, max_tokens: int = 24):
    from viasd.config import parse_params

    return parse_params(max_tokens=max_tokens, alpha1=0.9, alpha2=0.7, **spec)


def _watch_blocks(engine) -> list[tuple[int, int]]:
    """At every verify phase (before and after the step's forwards), the blocks the scheduler
    counts for the running requests are within the budget, and no tier's pool holds more; per
    step, the count and the rows that decoded."""
    scheduler, executor = engine.scheduler, engine.executor
    stores = [executor.verifier.full_store, executor.verifier.slim_store, executor.drafter.store]
    verify, seen = executor.verify, []

    def watched(rows, times):
        needed = scheduler.kv_blocks_needed
        assert needed <= scheduler.capacity.kv_blocks
        assert all(s.num_blocks - s.free_blocks <= needed for s in stores)
        out = verify(rows, times)
        assert all(s.num_blocks - s.free_blocks <= needed for s in stores)
        seen.append((needed, len(rows)))
        return out

    executor.verify = watched
    return seen


def _run_joining(engine, jobs, joins: list[int]):
    """jobs[i] is submitted before step joins[i]; steps until every request has ended. Per job, its
    samples' results (tokens, logprobs, prompt logprobs, finish reason, stats) from their chunks,
    and the most rows that decoded in one step."""
    handles, step, seen = {}, 0, _watch_blocks(engine)
    while len(handles) < len(jobs) or engine.scheduler.has_work():
        for i, at in enumerate(joins):
            if at == step:
                handles[i] = engine.submit(*jobs[i])
        engine.step()
        step += 1
    out = []
    for i in range(len(jobs)):
        samples = []
        for h in handles[i].samples:
            assert h.finished and h.error is None
            chunks = list(h.chunks)
            assert chunks[-1].finished and all(not c.finished for c in chunks[:-1])
            samples.append(
                dict(
                    tokens=[t for c in chunks for t in c.token_ids],
                    logprobs=[lp for c in chunks for lp in c.logprobs or ()],
                    prompt_logprobs=chunks[0].prompt_logprobs,
                    stats=chunks[-1].stats,
                )
            )
        out.append(samples)
    assert max(needed for needed, _ in seen) <= engine.scheduler.capacity.kv_blocks
    return out, max(rows for _, rows in seen)


def _alone(pair, policy, prompt, params):
    engine = _engine(pair, cache_policy=policy, max_batch=params.n, max_seq_len=160, costs=SPECULATE, kv_block_size=0)
    results = engine.complete_n(prompt, params)
    return [
        dict(tokens=r.token_ids, logprobs=r.logprobs or [], prompt_logprobs=r.prompt_logprobs, stats=r.stats)
        for r in results
    ]


def _assert_same_sample(got: dict, want: dict, what) -> None:
    assert got["tokens"] == want["tokens"], what
    assert [lp.token_id for lp in got["logprobs"]] == [lp.token_id for lp in want["logprobs"]], what
    for a, b in zip(got["logprobs"], want["logprobs"]):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-9) and [t for t, _ in a.top] == [t for t, _ in b.top]
    if want["prompt_logprobs"] is None:
        assert got["prompt_logprobs"] is None, what
        return
    assert len(got["prompt_logprobs"]) == len(want["prompt_logprobs"]) and got["prompt_logprobs"][0] is None, what
    for a, b in zip(got["prompt_logprobs"][1:], want["prompt_logprobs"][1:]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-9), what


@pytest.mark.parametrize("policy", ["separate", "shared"])
def test_preempted_requests_produce_what_they_would_have_with_ample_blocks_and_alone(tiny_pair, policy):
    """A budget of 28 blocks of 4 positions: the mixed requests (15 rows with their samples)
    join in three waves while the others decode, prefill 8 tokens a step, run out of blocks
    mid-decode, and are preempted (the latest admitted first, some mid-prefill), resumed by
    recomputing their caches, some more than once. Every
    request completes, and each sample's tokens, logprobs and prompt logprobs equal the same batch
    on ample blocks (no preemption) and the request alone on slot caches, token for token
    (float64); its counters equal its run alone, and its stats count its preemptions. At every
    step the blocks the pools hold stay within what the scheduler counts, within the budget."""
    jobs = [(prompt, _params(spec)) for prompt, spec in MIXED]
    joins = [0, 0, 0, 0, 2, 2, 2, 5, 5, 5, 5]
    alone = [_alone(tiny_pair, policy, *job) for job in jobs]
    ar = _alone(tiny_pair, policy, MIXED[-1][0], _params(dict(mode="ar")))
    assert alone[-1][0]["tokens"] == ar[0]["tokens"]

    per_token = _engine(tiny_pair, cache_policy=policy, max_batch=1, max_seq_len=8).kv_bytes_per_token
    blocks = dict(cache_policy=policy, max_batch=16, kv_block_size=4, prefill_chunk=8, costs=SPECULATE)
    ample = _engine(tiny_pair, kv_cache_gib=400 * 4 * per_token / 2**30, **blocks)
    roomy, _ = _run_joining(ample, jobs, joins)
    assert ample.scheduler.preemptions == 0

    tight = _engine(tiny_pair, kv_cache_gib=28 * 4 * per_token / 2**30, **blocks)
    assert tight.scheduler.capacity.kv_blocks == 28
    preempted, _ = _run_joining(tight, jobs, joins)

    for i, (spec, got, want, base) in enumerate(zip(MIXED, preempted, roomy, alone)):
        assert len(got) == len(want) == len(base) == jobs[i][1].n
        for j, (g, w, b) in enumerate(zip(got, want, base)):
            _assert_same_sample(g, w, (i, j, spec))
            _assert_same_sample(g, b, (i, j, spec))
            if spec[1]["mode"] != "auto":  # (`auto`'s plans follow its batch, its tokens do not)
                for name in DECODE_COUNTERS:
                    assert getattr(g["stats"], name) == getattr(b["stats"], name), (i, j, name)
                assert g["stats"].forwards["full"] == b["stats"].forwards["full"], (i, j)
                assert g["stats"].forwards["slim"] == b["stats"].forwards["slim"], (i, j)
    stats = [s["stats"] for samples in preempted for s in samples]
    assert sum(s.preemptions for s in stats) == tight.scheduler.preemptions >= 3
    assert any(s.preemptions >= 2 for s in stats)  # resumed, then preempted again
    for s, r in zip(stats, [s["stats"] for samples in roomy for s in samples]):
        assert s.prefill_forwards >= r.prefill_forwards + (1 if s.preemptions else 0)  # recomputed
    executor = tight.executor
    stores = [executor.verifier.full_store, executor.verifier.slim_store, executor.drafter.store]
    assert tight.scheduler.kv_blocks_needed == 0 and tight.scheduler.num_preempted == 0
    assert all(s.free_blocks == s.num_blocks and s.rows_in_use == 0 for s in stores)
    assert not executor.verifier.sessions and not executor.drafter.sessions


def test_admission_against_held_blocks_runs_more_requests_at_once_than_reserving_their_budget(tiny_pair):
    """Twelve requests allowed 100 tokens each that stop within 6 (a stop token): reserving every
    block a request could take (prompt + max_tokens + a draft block: 27 or 28 of the 40) ran them
    one at a time; admitted against the blocks they hold and their next step's growth, all twelve
    decode together, nobody is preempted, and each output equals the request alone."""
    from viasd.config import parse_params

    per_token = _engine(tiny_pair, max_batch=1, max_seq_len=8).kv_bytes_per_token
    engine = _engine(tiny_pair, max_batch=16, kv_cache_gib=40 * 4 * per_token / 2**30, kv_block_size=4)
    alone_engine = _engine(tiny_pair, max_batch=1, max_seq_len=160, kv_block_size=0)
    jobs = []
    for i in range(12):
        prompt = [3 + i, 5 + 2 * i, 8, 13 + i]
        mode = ("ar", "sd", "via")[i % 3]
        free = alone_engine.complete(prompt, parse_params(mode=mode, max_tokens=6, ignore_eos=True)).token_ids
        jobs.append((prompt, parse_params(mode=mode, max_tokens=100, stop_token_ids=[free[-1]])))
    draft = {"ar": 1, "sd": 7, "via": 7}  # (one token, or a block of gamma 5 and two more)
    reserved = [-(-(len(p) + params.max_tokens + draft[params.mode.value]) // 4) for p, params in jobs]
    assert min(reserved) > 40 // 2  # reserving the budget, no two of them ran at once
    out, most = _run_joining(engine, jobs, [0] * len(jobs))
    assert most == 12 and engine.scheduler.preemptions == 0
    for (prompt, params), samples in zip(jobs, out):
        alone = alone_engine.complete(prompt, params)
        assert samples[0]["tokens"] == alone.token_ids and len(alone.token_ids) <= 6
        assert samples[0]["stats"].finish_reason == "stop"


def test_a_request_that_cannot_fit_alone_is_refused_at_submission(tiny_pair):
    """Blocks fewer than a request's last step may hold: CapacityError naming kv_blocks before it
    queues (a capacity whose rows are longer than the blocks; an engine's never are)."""
    from viasd.config import parse_params
    from viasd.executor import Capacity, LocalExecutor
    from viasd.scheduler import Scheduler

    verifier, drafter = tiny_pair
    capacity = Capacity(max_batch=4, max_seq_len=None, block_size=4, kv_blocks=10)
    executor = LocalExecutor(
        verifier, drafter, LayerMask.from_skipped((1, 3), verifier.num_layers), "separate", capacity
    )
    scheduler = Scheduler(executor, capacity, eos_token_ids=())
    with pytest.raises(CapacityError, match="kv_blocks") as err:
        # its last step: 3 + 32 positions and a block of 4 with two more, 41 positions: 11 blocks
        scheduler.submit([1, 2, 3], parse_params(mode="sd", gamma=4, max_tokens=33))
    assert err.value.field == "kv_blocks" and scheduler.num_waiting == 0
    scheduler.submit([1, 2, 3], parse_params(mode="sd", gamma=4, max_tokens=32))  # 40 positions fit
    assert scheduler.num_waiting == 1


def test_a_preempted_request_cancelled_while_it_waits_gives_its_rows_back(tiny_pair):
    """Preempted, then cancelled before it resumes: its sessions and rows go at the next step
    boundary, the others complete with their own tokens, and every block comes back."""
    per_token = _engine(tiny_pair, max_batch=1, max_seq_len=8).kv_bytes_per_token
    engine = _engine(tiny_pair, max_batch=8, kv_cache_gib=20 * 4 * per_token / 2**30, kv_block_size=4)
    jobs = [
        ([4 + i, 9, 11 + i], _params(dict(mode=("sd", "via", "ar")[i % 3], temperature=1.0, seed=i), 40))
        for i in range(6)
    ]
    handles = [engine.submit(*job) for job in jobs]
    while not engine.scheduler.num_preempted:
        engine.step()
    (victim,) = [h for h in handles if h in engine.scheduler._suspended][:1]
    got = [t for c in victim.chunks for t in c.token_ids]
    engine.cancel(victim)
    while engine.scheduler.has_work():
        engine.step()
    alone_engine = _engine(tiny_pair, max_batch=1, max_seq_len=80, kv_block_size=0)
    for h, job in zip(handles, jobs):
        alone = alone_engine.complete(*job).token_ids
        tokens = [t for c in h.chunks for t in c.token_ids]
        assert tokens == (alone[: len(got)] if h is victim else alone)
    assert victim.cancelled and victim.stats.preemptions >= 1 and victim.error is None
    executor = engine.executor
    stores = [executor.verifier.full_store, executor.verifier.slim_store, executor.drafter.store]
    assert all(s.free_blocks == s.num_blocks and s.rows_in_use == 0 for s in stores)
    assert not executor.verifier.sessions and not executor.drafter.sessions


def test_the_request_admitted_last_is_preempted_first_and_resumes_first(tiny_pair):
    """Four short requests admitted over two steps outgrow 12 blocks: the one admitted last is
    preempted (not the ones before it) and waits at the head of the queue, ahead of a long request
    that was already waiting for blocks; it resumes before that one is admitted."""
    per_token = _engine(tiny_pair, max_batch=1, max_seq_len=8).kv_bytes_per_token
    engine = _engine(tiny_pair, max_batch=8, kv_cache_gib=12 * 4 * per_token / 2**30, kv_block_size=4)
    params = _params(dict(mode="ar", ignore_eos=True), 24)
    first = [engine.submit([10 + i, 20 + i], params) for i in range(3)]
    engine.step()
    late = engine.submit([40, 41], params)
    engine.step()
    assert engine.scheduler.num_running == 4
    long = engine.submit(list(range(1, 31)), params)
    while not engine.scheduler.num_preempted:
        engine.step()
        assert long not in engine.scheduler._suspended and long.stats.queue_seconds == 0.0  # (it waits)
    assert list(engine.scheduler._suspended) == [late] and engine.scheduler.num_running == 3
    assert list(engine.scheduler._waiting) == [late, long]
    while late in engine.scheduler._suspended:
        assert long.stats.queue_seconds == 0.0  # (not admitted)
        engine.step()
    while engine.scheduler.has_work():
        engine.step()
    assert all(h.stats.finish_reason == "length" for h in [*first, late, long])
    assert late.stats.preemptions >= 1 and first[0].stats.preemptions == 0  # (the first admitted always runs)


def test_preemptions_are_counted_on_metrics_as_requests_end():
    """`viasd_num_preemptions_total` (vLLM's num_preemptions) adds every sample's count."""
    from viasd.cluster.serving_metrics import ServingMetrics, parse_exposition, total
    from viasd.metrics import RequestStats

    metrics = ServingMetrics("m")
    metrics.record_stats([RequestStats(preemptions=2), RequestStats(preemptions=1), None], "length")
    metrics.record_stats([RequestStats()], "stop")
    samples = parse_exposition(metrics.exposition()[0].decode())
    assert total(samples, "viasd_num_preemptions_total", model_name="m") == 3


def test_one_row_in_adjacent_blocks_is_written_and_read_in_place_and_equals_slot_rows():
    """A row forwarded alone whose blocks lie one after the other in the pool (a request decoding
    alone) writes and reads its keys as a slice of the pool, no scatter or gather; one whose blocks
    interleave with another row's takes the gathered path. Both give slot rows' logits and keys
    (float64), prefill and decode, across block boundaries."""
    gen = torch.Generator().manual_seed(5)
    slots = LM.new_store(MASK, max_rows=3, max_len=64)
    paged = LM.new_store(MASK, max_rows=3, max_len=64, block_size=4)
    rows = {slots.alloc(): paged.alloc() for _ in range(3)}
    (a, pa), (b, pb), (c, pc) = rows.items()
    held = dict.fromkeys(rows, 0)

    def forward(row: int, n: int, adjacent: bool | None = None) -> None:
        tokens = torch.randint(0, LM.vocab_size, (n,), generator=gen).tolist()
        want = LM.forward_batch([Row(tokens, held[row], n, row)], slots, MASK)
        write = paged.batch([rows[row]], [held[row]], [n], "cpu")
        if adjacent is not None:
            assert (write.base is not None) == adjacent
        got = LM.forward_batch([Row(tokens, held[row], n, rows[row])], paged, MASK)
        for x, y in zip(want, got):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-10)
        held[row] += n

    forward(a, 10, adjacent=True)  # blocks 1, 2, 3
    for _ in range(5):
        forward(a, 1, adjacent=True)  # into block 4 at position 12
    for n in (3, 5, 2, 6):  # b and c take blocks in turn: neither's are adjacent
        forward(b, n)
        forward(c, n)
    forward(b, 1, adjacent=False)
    forward(c, 4, adjacent=False)
    forward(a, 3, adjacent=False)  # (its fifth block came after b's and c's)
    _assert_rows_equal(slots, paged, rows)


def test_rows_of_very_different_spans_are_read_in_buckets_and_equal_slot_rows():
    """A paged forward over rows holding 5, 70, 150 and 300 positions attends bucket by bucket
    (viasd.attention.span_buckets: each bucket gathered to its own longest span), decode and
    ragged prefill rows alike: the logits equal slot rows' (float64)."""
    from viasd.attention import span_buckets

    assert [s for _, s in span_buckets([5, 70, 150, 300, 60], "cpu")] == [60, 70, 150, 300]
    assert span_buckets([40, 33, 64], "cpu") == ((None, 64),)
    lengths = [5, 70, 150, 300]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, LM.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    slots = LM.new_store(max_rows=4, max_len=320)
    paged = LM.new_store(max_rows=4, max_len=320, block_size=8)
    for store in (slots, paged):
        rows = [store.alloc() for _ in lengths]
        LM.forward_batch([Row(p, 0, 1, r) for p, r in zip(prompts, rows)], store)
    for step in ([1, 1, 1, 1], [3, 1, 6, 2]):  # decode rows, then ragged rows
        batch = [torch.randint(0, LM.vocab_size, (n,), generator=gen).tolist() for n in step]
        want = LM.forward_batch([Row(t, lengths[r], len(t), r) for r, t in enumerate(batch)], slots)
        got = LM.forward_batch([Row(t, lengths[r], len(t), r) for r, t in enumerate(batch)], paged)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-10)
        lengths = [n + len(t) for n, t in zip(lengths, batch)]
