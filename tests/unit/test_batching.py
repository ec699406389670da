"""Continuous batching against its definitions (float64 tiny models):

* a request's tokens in a batch equal its tokens alone: `ar` / `sd` / `via`, greedy and seeded
  sampling, every rule and drafting option, both cache policies, with requests joining at random
  steps, leaving when done or cancelled, and more requests than cache rows (they queue);
* after every step each row's caches equal a fresh prefill of its committed prefix;
* the lossless rule reproduces the verifier's distribution with rows batched (chi-square), and
  the same statistic rejects the drafter's law;
* padding never reaches a real row (property test over random ragged batches);
* capacity: a full engine queues, an over-long prompt gets an error naming the limit, cancelled
  and finished requests free their rows, threads calling `generate` at once share steps.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from viasd.config import parse_params
from viasd.engine import Engine
from viasd.errors import InvalidParameterError
from viasd.runtime import LayerMask, Row

PROMPTS = [[5, 17, 3, 88, 41, 9], [1, 2, 3], [60] * 12, [7], [33, 34, 35, 33, 34, 35, 33, 34], list(range(10, 40))]

# every mode, rule and drafting option; sampled ones carry a seed
REQUESTS = [
    dict(mode="ar"),
    dict(mode="ar", temperature=1.0, seed=11),
    dict(mode="sd", gamma=4),
    dict(mode="sd", temperature=1.0, seed=12, gamma=3),
    dict(mode="sd", temperature=0.8, top_k=20, top_p=0.9, seed=13),
    dict(mode="via"),
    dict(mode="via", region_b="escalate"),
    dict(mode="via", temperature=1.0, seed=14, slim_bonus=True),
    dict(mode="via", temperature=1.0, seed=15, rule="lossy", lossy_alpha=0.3, lossy_beta=0.8),
    dict(mode="via", temperature=1.0, seed=16, rule="overshoot", overshoot_ceiling=0.5),
    dict(mode="sd", proposer="ngram"),
    dict(mode="sd", proposer="hybrid", temperature=1.0, seed=17),
    dict(mode="sd", draft_confidence=0.4, temperature=1.0, seed=18),
    dict(mode="via", adaptive_gamma=True, gamma=6),
    dict(mode="sd", overlap=True, temperature=1.0, seed=19),
    dict(mode="via", overlap=True, draft_confidence=0.3),
    dict(mode="via", rule="staged"),
    dict(mode="via", rule="staged", temperature=1.0, seed=20, proposer="hybrid"),
]


def _params(spec: dict, max_tokens: int = 24):
    return parse_params(max_tokens=max_tokens, alpha1=0.9, alpha2=0.7, **spec)


def _engine(pair, policy="separate", **kw):
    verifier, drafter = pair
    return Engine(
        verifier, drafter, mask=LayerMask.from_skipped((1, 3), verifier.num_layers), cache_policy=policy, **kw
    )


def _run_batched(engine, jobs, rng, cancel=None):
    """Submit jobs (prompt, params) at random steps, step until all are done; tokens per job.
    `cancel`: the index of a job cancelled after its second chunk."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    order = list(range(len(jobs)))
    handles, chunks_seen = {}, dict.fromkeys(order, 0)
    while order or engine.scheduler.has_work():
        for _ in range(rng.randint(0, 3)):  # 0-3 requests join at this step boundary
            if order:
                i = order.pop(0)
                handles[engine.submit(*jobs[i])] = i
        for handle, chunk in engine.step():
            i = handles[handle]
            tokens[i] += chunk.token_ids
            chunks_seen[i] += 1
            if i == cancel and chunks_seen[i] == 2:
                engine.cancel(handle)
    return tokens


@pytest.mark.parametrize("policy", ["separate", "shared"])
@pytest.mark.parametrize("block_size", [0, 3])
def test_every_request_in_a_batch_equals_its_run_alone(tiny_pair, policy, block_size):
    """Alone on slot caches; batched on slot caches (0), or on paged ones (blocks of 3 positions).
    The other tests here run on the default, paged caches of 16 positions a block."""
    jobs = [(PROMPTS[i % len(PROMPTS)], _params(spec)) for i, spec in enumerate(REQUESTS)]
    alone = [_engine(tiny_pair, policy, max_batch=1, kv_block_size=0).complete(*job).token_ids for job in jobs]
    assert all(len(t) == 24 for t in alone)
    # fewer rows than requests: they queue
    engine = _engine(tiny_pair, policy, max_batch=5, prefill_chunk=8, kv_block_size=block_size)
    batched = _run_batched(engine, jobs, random.Random(policy), cancel=3)
    for i, _job in enumerate(jobs):
        if i == 3:  # cancelled after two chunks: what it got is a prefix of its output alone
            assert 0 < len(batched[i]) < 24 and batched[i] == alone[i][: len(batched[i])]
        else:
            assert batched[i] == alone[i], (i, REQUESTS[i])
    assert engine.scheduler.num_running == 0 and engine.executor.verifier.full_store.rows_in_use == 0
    assert engine.executor.drafter.store.rows_in_use == 0 and engine.executor.verifier.slim_store.rows_in_use == 0


def test_batch_composition_never_changes_a_seeded_output(tiny_pair):
    """The same sampled request beside different neighbours, joining at different steps."""
    target = (PROMPTS[0], _params(dict(mode="via", temperature=1.0, seed=99), max_tokens=30))
    alone = _engine(tiny_pair).complete(*target).token_ids
    for trial in range(3):
        rng = random.Random(trial)
        others = [
            (PROMPTS[rng.randrange(len(PROMPTS))], _params(REQUESTS[rng.randrange(len(REQUESTS))]))
            for _ in range(rng.randint(2, 6))
        ]
        at = min(trial + 1, len(others))
        jobs = others[:at] + [target] + others[at:]
        out = _run_batched(_engine(tiny_pair, max_batch=4), jobs, rng)
        assert out[at] == alone


def _fresh_kv(lm, seq, mask=None):
    cache = lm.new_cache(mask)
    if seq:
        lm.forward(torch.tensor(seq), 0, cache, mask)
    return cache


def _assert_tier_matches_fresh_prefill(tier, seq, verifier, mask, full_pos, shared):
    if tier.pos == 0:
        return
    if shared and tier.name == "slim":  # kept layers: q's keys/values up to q's position, then q''s own
        fresh = _fresh_kv(verifier, seq[:full_pos])
        if tier.pos > full_pos:
            verifier.forward(torch.tensor(seq[full_pos : tier.pos]), full_pos, fresh, mask)
    else:
        fresh = _fresh_kv(tier.lm, seq[: tier.pos], tier.mask)
    for layer in tier.layers:
        k, v = tier.cache.kv(layer)
        fk, fv = fresh.kv(layer)
        torch.testing.assert_close(k[:, :, : tier.pos], fk[:, :, : tier.pos], rtol=0, atol=1e-10)
        torch.testing.assert_close(v[:, :, : tier.pos], fv[:, :, : tier.pos], rtol=0, atol=1e-10)


@pytest.mark.parametrize("policy", ["separate", "shared"])
@pytest.mark.parametrize("block_size", [0, 4])
def test_caches_equal_fresh_prefill_after_every_step(tiny_pair, policy, block_size):
    verifier, _ = tiny_pair
    engine = _engine(tiny_pair, policy, max_batch=4, prefill_chunk=5, kv_block_size=block_size)
    specs = [
        dict(mode="via", temperature=1.0, seed=4),
        dict(mode="sd", temperature=1.0, seed=5),
        dict(mode="via", gamma=3),
        dict(mode="ar"),
        dict(mode="sd", overlap=True, temperature=1.0, seed=6),
        dict(mode="via", rule="staged", temperature=1.0, seed=7),
    ]
    handles = [engine.submit(PROMPTS[i], _params(s, max_tokens=40)) for i, s in enumerate(specs)]
    rejected_cycles, checked = 0, 0
    while engine.scheduler.has_work():
        rejected_before = sum(h.stats.num_rejected_tokens for h in handles)
        engine.step()
        rejected_cycles += sum(h.stats.num_rejected_tokens for h in handles) > rejected_before
        for h in handles:
            sessions = engine.executor.sessions(h.key)
            if sessions is None:
                continue
            draft, verify = sessions
            seq = verify.seq
            assert draft is None or draft.seq == seq  # both sides hold the same committed sequence
            tiers = ([draft.tier] if draft is not None else []) + verify.tiers
            for tier in tiers:
                # the drafter may hold drafted-ahead tokens the committed ones agreed with (overlap)
                fed = seq + draft.pending if tier.name == "drafter" else seq
                assert 0 <= tier.pos <= len(fed) - 1  # the last token is always fed next
                _assert_tier_matches_fresh_prefill(
                    tier, fed, verifier, engine.mask, verify.full.pos, policy == "shared"
                )
                checked += 1
    assert rejected_cycles > 0 and checked > 50


def test_lossless_rule_reproduces_q_with_rows_batched(tiny_pair):
    """4,000 sampled `sd` requests, 16 rows a step: the first committed token follows q exactly;
    the same statistic rejects p (the drafter's law)."""
    verifier, drafter = tiny_pair
    prompt = PROMPTS[0]
    engine = _engine(tiny_pair, max_batch=16)
    n = 4000
    handles = [
        engine.submit(prompt, parse_params(mode="sd", gamma=2, max_tokens=1, temperature=1.0, seed=s)) for s in range(n)
    ]
    while engine.scheduler.has_work():
        engine.step()
    firsts = [h.chunks[0].token_ids[0] for h in handles]
    counts = torch.bincount(torch.tensor(firsts), minlength=verifier.vocab_size).double()
    q = torch.softmax(verifier.forward(torch.tensor(prompt), 0)[-1], -1)  # [V]
    p = torch.softmax(drafter.forward(torch.tensor(prompt), 0)[-1], -1)  # [V]

    def pvalue(law):
        expected = law * n
        big = expected >= 5  # merge the small bins into one
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)

    assert pvalue(q) > 1e-3
    assert pvalue(p) < 1e-6
    assert (
        sum(h.stats.num_accepted_tokens for h in handles) > 0 and sum(h.stats.num_rejected_tokens for h in handles) > 0
    )


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_padding_never_leaks_into_real_rows(tiny_pair, data):
    """Random ragged batches (prefix length, new tokens, logits per row, reused dirty rows): each
    row's logits and cache equal the same row run alone."""
    verifier, _ = tiny_pair
    mask = data.draw(st.sampled_from([None, LayerMask.from_skipped((0, 2), verifier.num_layers)]))
    n_rows = data.draw(st.integers(1, 5))
    store = verifier.new_store(mask, max_rows=6)
    dirty = store.alloc()  # a row left full of another request's keys, then freed and reused
    verifier.forward_batch([Row(list(range(30)), 0, 0, dirty)], store, mask)
    store.free(dirty)
    rows, alone = [], []
    for _ in range(n_rows):
        prefix = data.draw(st.lists(st.integers(0, verifier.vocab_size - 1), min_size=0, max_size=20))
        new = data.draw(st.lists(st.integers(0, verifier.vocab_size - 1), min_size=1, max_size=7))
        k = data.draw(st.integers(0, len(new)))
        r = store.alloc()
        single = verifier.new_cache(mask)
        if prefix:
            verifier.forward_batch([Row(prefix, 0, 0, r)], store, mask)
            verifier.forward(torch.tensor(prefix), 0, single, mask, num_logits=0)
        rows.append(Row(new, len(prefix), k, r))
        alone.append((single, new, len(prefix), k))
    out = verifier.forward_batch(rows, store, mask)
    for row, got, (single, new, start, k) in zip(rows, out, alone):
        ref = verifier.forward(torch.tensor(new), start, single, mask, num_logits=k)
        assert got.shape == ref.shape == (k, verifier.vocab_size)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
        for layer in store.layers:
            assert store.length(row.cache_row, layer) == start + len(new)
            torch.testing.assert_close(store.kv(row.cache_row, layer)[0], single.kv(layer)[0], rtol=0, atol=1e-10)


def test_a_full_engine_queues_and_finished_requests_free_their_rows(tiny_pair):
    engine = _engine(tiny_pair, max_batch=2)
    handles = [engine.submit(PROMPTS[i], _params(dict(mode="sd"), max_tokens=10)) for i in range(5)]
    engine.step()
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 3
    while engine.scheduler.has_work():
        engine.step()
        assert engine.scheduler.num_running <= 2
    assert all(sum(len(c.token_ids) for c in h.chunks) == 10 and h.chunks[-1].finished for h in handles)
    assert handles[-1].stats.queue_seconds > 0 and handles[0].stats.kv_bytes > 0
    assert engine.executor.verifier.full_store.rows_in_use == 0


def test_an_over_long_prompt_names_the_limit(tiny_pair):
    """max_seq_len, or the budget: slot rows split it over max_batch rows; blocks (the default)
    let one request hold all of it."""
    verifier, drafter = tiny_pair
    for kv_block_size in (0, 16):
        engine = Engine(verifier, drafter, max_seq_len=16, kv_block_size=kv_block_size)
        with pytest.raises(InvalidParameterError, match="max_seq_len") as info:
            engine.submit(list(range(16)), parse_params(mode="ar"))
        assert info.value.field == "prompt"
    per_token = engine.kv_bytes_per_token
    gib = 40 * 4 * per_token / 2**30
    budget = Engine(verifier, drafter, max_batch=4, kv_cache_gib=gib, kv_block_size=0)
    assert budget.max_context == 40
    with pytest.raises(InvalidParameterError, match="kv_cache_gib"):
        budget.submit(list(range(45)), parse_params(mode="ar"))
    res = budget.complete(list(range(30)), parse_params(mode="via", max_tokens=100))
    assert len(res.token_ids) == 10 and res.finish_reason == "length"  # cut at the row's capacity
    paged = Engine(verifier, drafter, max_batch=4, kv_cache_gib=gib)
    assert paged.max_context == 160 and paged.scheduler.capacity.kv_blocks == 10  # blocks of 16
    with pytest.raises(InvalidParameterError, match="kv_cache_gib"):
        paged.submit([i % 90 for i in range(165)], parse_params(mode="ar"))
    res = paged.complete([i % 90 for i in range(150)], parse_params(mode="via", max_tokens=100))
    assert len(res.token_ids) == 10 and res.finish_reason == "length"  # cut at the blocks' capacity


def test_a_default_kv_budget_too_small_to_serve_is_an_error_naming_the_fix(tiny_pair, monkeypatch):
    """Little memory left after loading (e.g. float32 weights and their packed copies): the default
    budget would hold a few positions per request; the engine refuses to start and says what to set,
    while an explicit kv_cache_gib is taken as given."""
    import viasd.engine as E
    from viasd.errors import ModelLoadError

    verifier, drafter = tiny_pair
    per_token = Engine(verifier, drafter, max_seq_len=16).kv_bytes_per_token
    monkeypatch.setattr(E, "available_memory", lambda device: int(8 * 100 * per_token / E.DEFAULT_KV_MEMORY_FRACTION))
    with pytest.raises(ModelLoadError, match="kv_cache_gib") as info:  # slot rows: 100 positions each
        Engine(verifier, drafter, max_batch=8, kv_block_size=0)
    assert "100 positions" in str(info.value)
    gib = 8 * 100 * per_token / 2**30
    assert Engine(verifier, drafter, max_batch=8, kv_cache_gib=gib, kv_block_size=0).max_context == 100
    assert Engine(verifier, drafter, max_batch=8).max_context == 512  # blocks: 800 positions, any one may take
    monkeypatch.setattr(E, "available_memory", lambda device: int(100 * per_token / E.DEFAULT_KV_MEMORY_FRACTION))
    with pytest.raises(ModelLoadError, match="kv_cache_gib") as info:  # blocks: 96 positions in all
        Engine(verifier, drafter, max_batch=8)
    assert "96 positions" in str(info.value)


def test_threads_calling_generate_share_steps(tiny_pair):
    engine = _engine(tiny_pair, max_batch=8)
    jobs = [(PROMPTS[i], _params(REQUESTS[i * 2])) for i in range(6)]
    alone = [_engine(tiny_pair).complete(*job).token_ids for job in jobs]
    out: dict[int, list[int]] = {}
    steps_with_many = []

    def worker(i):
        tokens = []
        for chunk in engine.generate(*jobs[i]):
            tokens += chunk.token_ids
            steps_with_many.append(engine.scheduler.num_running)
        out[i] = tokens

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [out[i] for i in range(len(jobs))] == alone
    assert max(steps_with_many) > 1  # requests were in flight together


def test_threads_calling_generate_get_each_chunk_within_a_step(tiny_pair):
    """While one thread steps for every request, the others wait for the step to end and take
    their chunks then: no stream's chunks pile up behind a thread that keeps the steps to itself.
    (Each step sleeps, as a real forward releases the GIL.)"""
    engine = _engine(tiny_pair, max_batch=4)
    step = engine.scheduler.step
    steps, committed_at = [0], {}  # the step that committed each chunk

    def slow_step():
        time.sleep(0.01)
        out = step()
        steps[0] += 1
        committed_at.update((id(chunk), steps[0]) for _, chunk in out)
        return out

    engine.scheduler.step = slow_step
    lags: list[int] = []  # per chunk: steps run after the one that committed it, before its delivery

    def worker(i):
        for chunk in engine.generate(PROMPTS[i], _params(dict(mode="ar"), max_tokens=30)):
            lags.append(steps[0] - committed_at[id(chunk)])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(lags) >= 4 * 30 and max(lags) <= 2, lags


def test_closing_a_stream_cancels_the_request(tiny_pair):
    engine = _engine(tiny_pair, max_batch=2)
    it = engine.generate(PROMPTS[0], _params(dict(mode="via"), max_tokens=40))
    next(it)
    assert engine.scheduler.num_running == 1
    it.close()
    engine.step()
    assert engine.scheduler.num_running == 0 and engine.executor.verifier.full_store.rows_in_use == 0


def test_a_check_group_mixing_probability_only_blocks_with_whole_rows_decides_as_whole_rows():
    """A served verifier's step can check blocks whose p came as p(x~) alone ([k]) beside blocks
    with p's rows ([k, V]) in one group: every block gets the acceptance, bonus and uniform that
    p's rows give it, a block with rows its token, a rejected p(x~) block -1 (pending)."""
    from viasd.rules import Lossless, Lossy
    from viasd.sampling import Sampler
    from viasd.sessions import Check, _check

    vocab, lengths = 64, [3, 2, 4, 3]
    sampler = Sampler(temperature=1.0)
    rules = [Lossless(), Lossy(alpha=0.2, beta=0.5), Lossless(), Lossless()]
    pending = 0
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        blocks = []
        for n in lengths:
            p = torch.softmax(2 * torch.randn(n, vocab, generator=g), -1)  # [n, V]
            draft = torch.multinomial(p, 1, generator=g)[:, 0]  # [n]
            blocks.append((p, torch.randn(n + 1, vocab, generator=g) * 2, draft))

        def asks(point: set[int]):
            return [
                Check(
                    rules[b],
                    p.gather(1, draft[:, None])[:, 0] if b in point else p,
                    logits,
                    draft,
                    sampler,
                    torch.Generator().manual_seed(100 * seed + b),
                )
                for b, (p, logits, draft) in enumerate(blocks)
            ]

        whole = torch.stack([v for v, _ in _check(asks(set()))])  # [B, 4]
        mixed = torch.stack([v for v, _ in _check(asks({0, 1}))])
        assert torch.equal(mixed[:, [0, 2, 3]], whole[:, [0, 2, 3]]) and torch.equal(mixed[2:], whole[2:])
        for b in (0, 1):
            want = whole[b, 1] if whole[b, 2] else -1  # (bonus: committed; rejected: pending)
            assert int(mixed[b, 1]) == int(want), (seed, b)
            pending += int(want) == -1
    assert pending > 0
