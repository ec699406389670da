"""The distributed pipeline through real Ray actors and real gRPC equals the in-process engine.

Tiny random LLaMA models (float32; the drafter shares the verifier's vocabulary) are saved to
temporary directories without tokenizer files and loaded by every actor through the normal
loader; requests carry token ids. One Ray per test session (conftest.ray_session); one event
loop thread runs every coroutine, with a timeout, so nothing can hang CI.

* ar / sd / via, greedy and sampled with a seed: served tokens, finish reason and counters ==
  `viasd.llm.LLM` in-process (same config, same loader);
* 8 concurrent streams with different seeds each == their sequential in-process run;
* TP=2 (torch backend; DeepSpeed AutoTP too) == TP=1, one request at a time and in batches;
* served continuous batching: mixed-mode requests joining and leaving one batch == the
  in-process batched run == each alone; a bad row of a batched Verify fails alone;
* a cancelled stream closes the drafter's and the verifier's sessions;
* bad input -> INVALID_ARGUMENT naming the field; ListModels; the health service;
* a failing drafter: the request finishes as `ar` (drafter_fallback);
* `quantization: int4`: the actors quantize as the in-process engine does (TP=2: each rank its
  slices) and serve its tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import grpc
import pytest
from conftest import LOOP_TIMEOUT_S as TIMEOUT_S
from conftest import save_tiny_pair

from viasd.config import EngineConfig, parse_params
from viasd.costs import GRID
from viasd.v1 import generation_pb2 as pb
from viasd.v1 import generation_pb2_grpc
from viasd.v1.convert import finish_from_proto, params_to_proto, stats_from_proto

PROMPTS = [[5, 17, 3, 88, 41, 9], [60] * 12]
VIA = dict(mode="via", gamma=4, alpha1=0.9, alpha2=0.7)  # thresholds that exercise all three tiers
CASES = {
    "ar-greedy": dict(mode="ar"),
    "sd-greedy": dict(mode="sd", gamma=4),
    "via-greedy": dict(VIA),
    "ar-sampled": dict(mode="ar", temperature=1.0, seed=11),
    "sd-sampled": dict(mode="sd", gamma=4, temperature=0.8, top_k=40, seed=12),
    "via-sampled": dict(VIA, temperature=1.0, seed=13),
    # issue 9's options run on the drafter actor: n-gram blocks travel without p
    "sd-hybrid-adaptive-sampled": dict(
        mode="sd",
        gamma=6,
        proposer="hybrid",
        ngram_max=2,
        draft_confidence=0.3,
        adaptive_gamma=True,
        temperature=1.0,
        seed=14,
    ),
    "via-ngram-greedy": dict(VIA, proposer="ngram"),
    # overlap: the drafter actor drafts ahead while the verifier verifies; timing must not matter
    "sd-overlap-sampled": dict(mode="sd", gamma=4, overlap=True, temperature=1.0, seed=15),
    "via-overlap-greedy": dict(VIA, overlap=True),
    "via-staged-sampled": dict(VIA, rule="staged", temperature=1.0, seed=16),  # (the staged rule travels)
    # probability only: the drafter draws a rejected block's token from the lossy residual max(0, q - beta p)
    "sd-lossy-sampled": dict(
        mode="sd", gamma=4, rule="lossy", lossy_alpha=0.2, lossy_beta=0.5, temperature=1.0, seed=17
    ),
}
COUNTERS = (
    "generated_tokens",
    "num_drafts",
    "num_draft_tokens",
    "ngram_draft_tokens",
    "overlap_draft_tokens",
    "num_accepted_tokens",
    "num_accepted_tokens_per_pos",
    "num_rejected_tokens",
    "num_bonus_tokens",
    "num_cycle_tokens",
    "slim_accepted",
    "slim_rewritten",
    "escalations",
    "escalated_tokens",
    "full_accepted",
    "forwards",
    "finish_reason",
)


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory) -> EngineConfig:
    """A float32 tiny LLaMA pair saved without tokenizer files (eos_token_id 2 in its configs)."""
    return save_tiny_pair(tmp_path_factory.mktemp("pipeline-models"))


@pytest.fixture(scope="module")
def llm(engine_config):
    """The in-process reference: the same config through the same loader."""
    from viasd.llm import LLM

    llm = LLM(engine_config)
    assert llm.tokenizer is None and llm.engine.eos_token_ids == (2,)
    return llm


def _pipeline_config(engine_config, **kw):
    from viasd.cluster.pipeline import PipelineConfig

    return PipelineConfig(
        engine=engine_config, drafter_cpus=0.5, verifier_cpus_per_rank=0.5, rpc_timeout_s=60, check_ranks=True, **kw
    )


@pytest.fixture(scope="module")
def pipeline(ray_session, aio, engine_config):
    from viasd.cluster.pipeline import Pipeline

    t0 = time.perf_counter()
    p = aio.run(Pipeline.start(_pipeline_config(engine_config, name="tiny")))
    print(f"\nTP=1 pipeline up in {time.perf_counter() - t0:.1f}s")
    yield p
    aio.run(p.shutdown())


@pytest.fixture(scope="module")
def server(aio, pipeline):
    """The public GenerationService on a free loopback port, and a client stub."""
    from viasd.cluster.grpc_api import GenerationServicer
    from viasd.cluster.standalone import serve_grpc

    servicer = GenerationServicer({"tiny": pipeline}, default="tiny")
    srv = aio.run(serve_grpc(servicer, 0))

    async def connect():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.viasd_port}")
        return channel, generation_pb2_grpc.GenerationServiceStub(channel)

    channel, stub = aio.run(connect())
    yield servicer, srv, stub
    aio.run(channel.close())
    aio.run(srv.stop(grace=1))


def request(prompt, model: str = "", request_id: str = "", **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        model=model,
        prompt_token_ids=pb.TokenIds(ids=prompt),
        params=params_to_proto(parse_params(max_tokens=24, **params)),
    )


async def collect(stub, req: pb.GenerateRequest):
    """(all token ids, responses) of one Generate stream."""
    responses = [r async for r in stub.Generate(req, timeout=TIMEOUT_S)]
    return [t for r in responses for t in r.token_ids], responses


def reference(llm, prompt, **params):
    return llm.complete(prompt, parse_params(**{"max_tokens": 24, **params}))


# with overlap, how far the drafter got ahead before each outcome came in depends on timing: its
# forward count and the number of drafted-ahead tokens used may differ; the tokens may not
TIMING_DEPENDENT = ("forwards", "overlap_draft_tokens")


def assert_same_run(served_tokens, responses, ref, what="", overlap=False):
    assert served_tokens == ref.token_ids, what
    last = responses[-1]
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not r.HasField("stats") for r in responses[:-1])
    stats = stats_from_proto(last.stats, finish_from_proto(last.finish_reason))
    for name in COUNTERS:
        if not (overlap and name in TIMING_DEPENDENT):
            assert getattr(stats, name) == getattr(ref.stats, name), (what, name)


# ------------------------------------------------------------------ equality with the in-process engine


@pytest.mark.parametrize("case", list(CASES))
def test_served_equals_in_process(server, aio, llm, case):
    _, _, stub = server
    for prompt in PROMPTS:
        tokens, responses = aio.run(collect(stub, request(prompt, **CASES[case])))
        assert_same_run(
            tokens,
            responses,
            reference(llm, prompt, **CASES[case]),
            f"{case} {prompt}",
            overlap=CASES[case].get("overlap", False),
        )
        assert len(responses) > 1  # streamed cycle by cycle


OPTIONS = {  # the request options the verifier computes and the coordinator returns
    "sd-sampled-n3-logprobs": dict(mode="sd", gamma=4, temperature=1.0, seed=21, n=3, logprobs=2, prompt_logprobs=1),
    "via-greedy-logprobs": dict(VIA, logprobs=1, prompt_logprobs=0),
    "via-sampled-slim-logprobs": dict(VIA, temperature=1.0, seed=22, logprobs=1, logprobs_tier="slim", n=2),
    "ar-prompt-only": dict(mode="ar", max_tokens=0, prompt_logprobs=3),
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_served_logprobs_and_samples_equal_in_process(server, aio, llm, case):
    """logprobs (either tier), prompt logprobs (max_tokens 0 too) and n > 1 samples through the
    actors == `Engine.complete_n` in-process: tokens, logprobs, tops; samples 1..n-1 copy sample 0's
    prefill on both sides instead of recomputing it."""
    from viasd.v1.convert import logprobs_from_proto

    _, _, stub = server
    params = parse_params(**{"max_tokens": 24, **OPTIONS[case]})
    want = llm.engine.complete_n(PROMPTS[0], params)
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=PROMPTS[0]), params=params_to_proto(params))
    _, responses = aio.run(collect(stub, req))
    assert {r.index for r in responses} == set(range(params.n))
    for i, w in enumerate(want):
        mine = [r for r in responses if r.index == i]
        assert [t for r in mine for t in r.token_ids] == w.token_ids, (case, i)
        got = logprobs_from_proto([e for r in mine for e in r.logprobs])
        expected = w.logprobs or []
        assert [(e.token_id, e.tier, [t for t, _ in e.top]) for e in got] == [
            (e.token_id, e.tier, [t for t, _ in e.top]) for e in expected
        ], (case, i)
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in expected], abs=1e-4)
        scored = logprobs_from_proto(mine[0].prompt_logprobs)
        assert [e.token_id for e in scored] == ([] if w.prompt_logprobs is None else PROMPTS[0][1:])
        if w.prompt_logprobs is not None:
            assert [e.logprob for e in scored] == pytest.approx([e.logprob for e in w.prompt_logprobs[1:]], abs=1e-4)
        stats = stats_from_proto(mine[-1].stats)
        assert mine[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert (stats.prefill_forwards > 0) == (i == 0), (case, i)  # the others copied sample 0's prefill


def test_served_run_covers_the_tiers_and_the_stop_tokens(server, aio, llm):
    """The cases above exercise all three tiers; a stop token ends a served request like an in-process one."""
    _, _, stub = server
    seen = {"slim_accepted": 0, "slim_rewritten": 0, "escalations": 0}
    for case in ("via-greedy", "via-sampled"):
        for prompt in PROMPTS:
            ref = reference(llm, prompt, **CASES[case])
            for k in seen:
                seen[k] += getattr(ref.stats, k)
    assert all(seen.values()), seen
    full = reference(llm, PROMPTS[0], **CASES["via-sampled"]).token_ids
    stop = full[9]
    stopped = reference(llm, PROMPTS[0], stop_token_ids=(stop,), **CASES["via-sampled"])
    assert stopped.finish_reason == "stop" and stopped.token_ids == full[: full.index(stop) + 1]
    tokens, responses = aio.run(collect(stub, request(PROMPTS[0], stop_token_ids=(stop,), **CASES["via-sampled"])))
    assert_same_run(tokens, responses, stopped, "stop")
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP


def test_concurrent_streams_equal_their_sequential_runs(server, aio, llm):
    _, _, stub = server
    settings = [
        dict(VIA, temperature=1.0, seed=100 + i) if i % 2 else dict(mode="sd", gamma=3, temperature=0.9, seed=100 + i)
        for i in range(8)
    ]
    expected = [reference(llm, PROMPTS[i % 2], **s) for i, s in enumerate(settings)]

    async def all_at_once():
        return await asyncio.gather(
            *(collect(stub, request(PROMPTS[i % 2], request_id=f"c{i}", **s)) for i, s in enumerate(settings))
        )

    results = aio.run(all_at_once())
    for i, ((tokens, responses), ref) in enumerate(zip(results, expected)):
        assert_same_run(tokens, responses, ref, f"stream {i}")
        assert all(r.request_id == f"c{i}" for r in responses)
    assert len({tuple(r[0]) for r in results}) > 1  # different seeds, different outputs


# ------------------------------------------------------------------ served continuous batching

# a mixed batch: every mode, greedy and sampled, n-gram and overlap rows, different lengths
# (rows leave at different steps); the second wave joins while the first is decoding
BATCH_WAVES = [
    [
        (0, dict(mode="ar", max_tokens=10)),
        (1, dict(VIA, temperature=1.0, seed=21, max_tokens=24)),
        (0, dict(mode="sd", gamma=3, temperature=0.9, seed=22, max_tokens=18)),
        (1, dict(VIA, max_tokens=30)),
        (0, dict(mode="ar", temperature=1.0, seed=23, max_tokens=24)),
    ],
    [
        (1, dict(mode="sd", gamma=4, max_tokens=14)),
        (0, dict(VIA, proposer="ngram", max_tokens=20)),
        (1, dict(mode="sd", gamma=4, overlap=True, temperature=1.0, seed=24, max_tokens=22)),
        (0, dict(VIA, temperature=1.0, seed=25, max_tokens=8)),
        (1, dict(mode="ar", max_tokens=26)),
        # (the staged rule's blocks travel as p's rows: verified beside p(x~) alone, in one group)
        (0, dict(VIA, rule="staged", temperature=1.0, seed=26, max_tokens=16)),
    ],
]


def in_process_batched(llm, waves, steps_between: int = 2) -> list[list[int]]:
    """The waves through the in-process step scheduler (one engine, one batch): each wave joins
    after `steps_between` steps of the ones before it."""
    engine, handles = llm.engine, []
    for wave in waves:
        handles += [engine.submit(PROMPTS[i], parse_params(**params)) for i, params in wave]
        for _ in range(steps_between):
            engine.step()
    while not all(h.finished for h in handles):
        engine.step()
    assert all(h.error is None for h in handles)
    return [[t for c in h.chunks for t in c.token_ids] for h in handles]


async def served_waves(coordinator, waves, prefix: str) -> list[list[int]]:
    """The waves through a coordinator at once, each wave starting after every stream of the
    waves before it has its second chunk (so it joins a batch that is decoding)."""

    async def stream(name, i, params, started: asyncio.Event):
        chunks = []
        async for c in coordinator.generate(name, PROMPTS[i], parse_params(**params)):
            chunks.append(c)
            if len(chunks) == 2 or c.finished:
                started.set()
        return [t for c in chunks for t in c.token_ids]

    tasks = []
    for w, wave in enumerate(waves):
        events = [asyncio.Event() for _ in wave]
        tasks += [
            asyncio.ensure_future(stream(f"{prefix}-{w}-{j}", i, params, e))
            for j, ((i, params), e) in enumerate(zip(wave, events))
        ]
        await asyncio.gather(*(e.wait() for e in events))
    return list(await asyncio.gather(*tasks))


def test_served_batch_equals_in_process_batch(aio, pipeline, llm):
    """Mixed-mode requests joining and leaving one served batch: each request's tokens equal the
    in-process batched run's and its run alone, token for token (float32); the steps did run as
    batches (one Verify per step carried rows of several modes), sampled blocks travelled as p(x~)
    alone, their rejected blocks' tokens drawn by the drafter, and every session is closed afterwards."""
    coord, totals = pipeline.coordinator, pipeline.executor.totals
    before = totals.to_dict()
    served = aio.run(served_waves(coord, BATCH_WAVES, "wave"))
    after = totals.to_dict()
    batched = in_process_batched(llm, BATCH_WAVES)
    alone = [llm.complete(PROMPTS[i], parse_params(**params)).token_ids for wave in BATCH_WAVES for i, params in wave]
    for j, (s, b, a) in enumerate(zip(served, batched, alone)):
        assert s == b == a, j
    steps = after["steps"] - before["steps"]
    verifies = after["calls"]["Verify"] - before["calls"].get("Verify", 0)
    rows = after["rows"] - before["rows"]
    assert verifies == steps  # one Verify per step
    assert rows > 2 * verifies  # batches, not one request at a time
    assert totals.max_rows >= 6  # > the 4 rows of any one mode: a mixed-mode Verify
    assert after["calls"]["Propose"] - before["calls"].get("Propose", 0) <= steps  # at most one Propose per step
    corrections = after["corrections"] - before["corrections"]
    assert corrections > 0 and after["calls"]["Correct"] - before["calls"].get("Correct", 0) <= corrections
    assert _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]}
    assert coord.active_requests() == 0


def test_a_paged_pipeline_equals_in_process_slots(ray_session, aio, engine_config, llm):
    """Actors on paged caches (kv_block_size 4) with a budget of about 36 blocks on the verifier:
    the mixed waves run out of blocks, requests are preempted (each actor's caches roll back, the
    sessions stay) and resumed by a recomputing prefill, and every output equals the in-process
    run on slot caches token for token; the scheduler admits against the least of the actors'
    blocks; every block comes back. A second request behind the same prompt prefix attaches its
    blocks on the actors (prefix caching) and still equals the in-process run."""
    from viasd.cluster.pipeline import Pipeline

    gib = 30 * 4 * llm.engine.kv_bytes_per_token / 2**30  # (each actor's budget for its own tiers)
    paged = engine_config.model_copy(update={"kv_block_size": 4, "kv_cache_gib": gib})
    p = aio.run(Pipeline.start(_pipeline_config(paged, name="tiny-paged")), timeout=240)
    try:
        scheduler = p.coordinator.engine.scheduler
        capacity = scheduler.capacity
        blocks = [i["kv_blocks"] for i in (p.verifier_info, p.drafter_info)]
        assert capacity.block_size == 4 and capacity.kv_blocks == min(blocks) > 0
        served = aio.run(served_waves(p.coordinator, BATCH_WAVES, "paged-wave"))
        assert served == in_process_batched(llm, BATCH_WAVES)
        assert scheduler.preemptions > 0 and scheduler.kv_blocks_needed == 0
        assert aio.run(p.session_counts()) == {"drafter": 0, "verifier": [0]}
        prompt = [(3 * i) % 90 + 1 for i in range(13)] + [7]  # 3 full blocks, then a second request behind them
        for i, mode in enumerate(["sd", "via"]):
            chunks = aio.run(_run(p.coordinator, f"prefix-{i}", prompt, **(VIA if mode == "via" else {"mode": mode})))
            assert [t for c in chunks for t in c.token_ids] == reference(
                llm, prompt, **(VIA if mode == "via" else {"mode": mode})
            ).token_ids
            assert chunks[-1].stats.cached_tokens == 12 * i  # the actors' caches attached the first one's blocks
    finally:
        aio.run(p.shutdown())


def test_the_executor_reports_its_calls_and_where_its_time_went(aio, pipeline, llm):
    """The served executor counts each phase's calls and bytes, and splits its time into each
    service's own seconds and the transport around them (`RpcTotals.phases`,
    `viasd_coordinator_seconds{phase}`): a request alone makes one Prefill per side, one Propose
    and one Verify per step, one Release per side."""
    from viasd.cluster.serving_metrics import ServingMetrics, parse_exposition, total

    coord = _coordinator(pipeline)
    t = coord.engine.executor.totals

    async def run():
        try:
            t0 = time.perf_counter()
            chunks = await _run(coord, "phases", PROMPTS[0], mode="sd", gamma=3, max_tokens=12)
            return chunks, time.perf_counter() - t0
        finally:
            coord.close()

    chunks, wall = aio.run(run())
    assert [tok for c in chunks for tok in c.token_ids] == reference(
        llm, PROMPTS[0], mode="sd", gamma=3, max_tokens=12
    ).token_ids
    steps = len(chunks)
    assert t.steps == steps and t.rows == steps and t.max_rows == 1 and t.requests == 1
    assert t.calls == {"Prefill": 2, "Propose": steps, "Verify": steps, "Release": 2}
    assert t.bytes_sent > 0 and t.bytes_received > 0 and t.probs_bytes == 0  # (greedy: no p travels)
    phases = t.phases()
    assert all(v > 0 for v in phases.values()), phases
    assert sum(phases.values()) <= wall
    metrics = ServingMetrics("m")
    metrics.set_steps(3, {"verifier": 1e-3, "prefill": 2e-3})
    metrics.set_steps(t.steps, phases)  # the counters move by what changed
    samples = parse_exposition(metrics.exposition()[0].decode())
    assert total(samples, "viasd_coordinator_steps_total") == steps
    for phase, seconds in phases.items():
        assert total(samples, "viasd_coordinator_seconds_total", phase=phase) == pytest.approx(seconds)


def test_a_served_request_past_capacity_waits_then_completes(aio, pipeline, llm):
    """Served, the engine's capacity is the actors': past `max_batch` rows a request waits in the
    scheduler's queue (no private cache on an actor), then completes with its own tokens."""
    coord = _coordinator(pipeline, max_batch=1)
    seen = []  # sessions open on each side at every step
    executor = coord.engine.executor
    verify = executor.verify

    def counting(rows, times):
        seen.append(len(rows))
        return verify(rows, times)

    executor.verify = counting

    async def run():
        try:
            params = dict(mode="sd", gamma=3, max_tokens=10)
            first = asyncio.ensure_future(_run(coord, "cap-0", PROMPTS[0], **params))
            second = asyncio.ensure_future(_run(coord, "cap-1", PROMPTS[1], **params))
            return await first, await second
        finally:
            coord.close()

    first, second = aio.run(run())
    assert [t for c in first for t in c.token_ids] == reference(
        llm, PROMPTS[0], mode="sd", gamma=3, max_tokens=10
    ).token_ids
    assert [t for c in second for t in c.token_ids] == reference(
        llm, PROMPTS[1], mode="sd", gamma=3, max_tokens=10
    ).token_ids
    assert max(seen) == 1  # one row at a time: the second waited for the first to finish
    earlier, later = sorted((first[-1].stats, second[-1].stats), key=lambda stats: stats.queue_seconds)
    assert later.queue_seconds > 0.5 * earlier.total_seconds
    assert _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]}


def _open(request_id, prompt, **params):
    from viasd.v1 import internal_pb2 as ipb

    return ipb.Open(
        request_id=request_id, prompt_token_ids=prompt, params=params_to_proto(parse_params(**params)), seed=1
    )


def _prefill(opens, upto=None):
    """A Prefill batch: the opens, and each prompt but its last token (or up to `upto`)."""
    from viasd.v1 import internal_pb2 as ipb

    chunks = [
        ipb.PrefillChunk(request_id=o.request_id, upto=min(upto or 1 << 30, len(o.prompt_token_ids) - 1))
        for o in opens
        if len(o.prompt_token_ids) > 1
    ]
    return ipb.PrefillBatch(opens=opens, chunks=chunks)


async def _served(add, servicer):
    """A servicer on a free loopback port: (server, a channel to it, its address)."""
    from viasd.actors.rpc import start_server

    server, port = await start_server(lambda s: add(servicer, s))
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}"), f"127.0.0.1:{port}"


def _capacity():
    from viasd.executor import Capacity

    return Capacity(max_batch=8, max_seq_len=512)


def test_a_batched_propose_reports_its_forwards_and_each_rows_work(aio, llm):
    """A Propose reports every batched forward it ran (tier, rows, padded tokens, seconds: a lazy
    `auto` drafter's catch-up, then one per drafting round, rows leaving as their blocks end) and
    each row's work between them, so that the engine's cost model learns from the drafter's own
    figures (`viasd.costs.StepTimes`)."""
    from viasd.actors.drafter import DrafterServicer
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc

    async def run():
        servicer = DrafterServicer(llm.drafter, _capacity())
        server, ch, _ = await _served(internal_pb2_grpc.add_DrafterServiceServicer_to_server, servicer)
        try:
            stub = internal_pb2_grpc.DrafterServiceStub(ch)
            fed = _prefill([_open("fed", PROMPTS[0], mode="sd")])  # an `auto` drafter is fed when a plan drafts
            fed.opens.append(_open("lazy", PROMPTS[1], mode="auto"))
            prefilled = await stub.Prefill(fed, timeout=30)
            rows = [ipb.ProposeRow(request_id="fed", k=3), ipb.ProposeRow(request_id="lazy", k=2)]
            batch = await stub.Propose(ipb.ProposeBatch(rows=rows), timeout=30)
            released = await stub.Release(ipb.ReleaseBatch(request_ids=["fed", "lazy", "gone"]))
            return prefilled, batch, released, servicer.worker.store.rows_in_use
        finally:
            await ch.close()
            await server.stop(None)

    prefilled, batch, released, rows_left = aio.run(run())
    assert {r.request_id: r.fed for r in prefilled.rows} == {"fed": len(PROMPTS[0]) - 1, "lazy": 0}
    assert [len(r.draft) for r in batch.rows] == [3, 2]
    assert [r.fed for r in batch.rows] == [len(PROMPTS[0]) + 2, len(PROMPTS[1]) + 1]  # all but the last draft token
    # the lazy row's catch-up (its prompt but the last token), then rounds of 2, 2 and 1 rows
    assert [(f.tier, f.rows, f.tokens) for f in batch.times.forwards] == [
        ("drafter", 1, len(PROMPTS[1]) - 1),
        ("drafter", 2, 1),
        ("drafter", 2, 1),
        ("drafter", 1, 1),
    ]
    assert all(f.seconds > 0 for f in batch.times.forwards) and all(r.work_seconds > 0 for r in batch.rows)
    assert batch.times.seconds >= sum(f.seconds for f in batch.times.forwards) + sum(r.work_seconds for r in batch.rows)
    # each side's counters travel once, at the end; a request it does not hold did not exist
    assert [(r.request_id, r.existed) for r in released.rows] == [("fed", True), ("lazy", True), ("gone", False)]
    assert [r.stats.forwards["drafter"] for r in released.rows[:2]] == [3, 2]  # rounds (the catch-up is a prefill)
    assert [r.stats.prefill_forwards for r in released.rows[:2]] == [1, 1]
    assert rows_left == 0


def _verifier(llm, channel=None, loops=(), **kw):
    from viasd.actors.verifier import VerifierRank, VerifierServicer

    rank = VerifierRank(llm.verifier, llm.engine.mask, "separate", _capacity(), **kw)
    return rank, VerifierServicer(rank, channel, loops, check_ranks=True)


class _Channel:
    """`viasd.parallel.ControlChannel` between rank 0 and one follower rank in two threads of this
    process (queues), recording what crosses to the follower."""

    def __init__(self):
        import queue

        self.down, self.up, self.sent = queue.Queue(), queue.Queue(), []

    def send(self, obj):
        self.sent.append(obj)
        self.down.put(obj)

    def receive(self):
        return self.down.get(timeout=60)

    def gather(self, obj):
        if threading.current_thread() is self.follower_thread:
            self.up.put(obj)
            return None
        return [self.up.get(timeout=60)]

    def start(self, core):
        """The follower's loop (`viasd.actors.verifier.follow`) on its own thread: its future."""
        from concurrent.futures import ThreadPoolExecutor

        from viasd.actors.verifier import follow

        pool = ThreadPoolExecutor(1)
        self.follower_thread = pool.submit(threading.current_thread).result()
        return asyncio.wrap_future(pool.submit(follow, core, self))

    def stop(self):
        from viasd.actors.verifier import STOP

        self.down.put(STOP)


def test_a_bad_row_fails_alone_in_a_batched_verify(aio, llm):
    """A Verify batch with an unknown request, an out-of-vocabulary draft and a request named
    twice: those rows carry NOT_FOUND / INVALID_ARGUMENT, the good rows are verified in the same
    call (the batched forward runs), and a batch whose every row fails still answers."""
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc

    sizes = []  # rows of each forward the verifier ran
    forward_batch = llm.verifier.forward_batch

    def counting(rows, *args, **kwargs):
        sizes.append(len(rows))
        return forward_batch(rows, *args, **kwargs)

    async def run():
        rank, servicer = _verifier(llm)
        server, ch, _ = await _served(internal_pb2_grpc.add_VerifierServiceServicer_to_server, servicer)
        try:
            stub = internal_pb2_grpc.VerifierServiceStub(ch)
            opens = [
                _open("a", PROMPTS[0], mode="ar"),
                _open("b", PROMPTS[0], mode="sd"),
                _open("c", PROMPTS[0], mode="sd"),
            ]
            await stub.Prefill(_prefill(opens), timeout=30)
            llm.verifier.forward_batch = counting
            try:
                batch = await stub.Verify(
                    ipb.VerifyBatch(
                        rows=[
                            ipb.VerifyRow(request_id="a"),
                            ipb.VerifyRow(request_id="nope"),
                            ipb.VerifyRow(request_id="c", draft=[5, 999]),
                            ipb.VerifyRow(request_id="b", draft=[5, 6]),
                            ipb.VerifyRow(request_id="b", draft=[5, 6]),
                        ]
                    ),
                    timeout=30,
                )
            finally:
                del llm.verifier.forward_batch
            lone = await stub.Verify(ipb.VerifyBatch(rows=[ipb.VerifyRow(request_id="nope")]), timeout=30)
            await stub.Release(ipb.ReleaseBatch(request_ids=["a", "b", "c"]))
            return batch, lone, rank.worker.full_store.rows_in_use
        finally:
            await ch.close()
            await server.stop(None)

    batch, lone, rows_left = aio.run(run())
    assert [r.request_id for r in batch.rows] == ["a", "nope", "c", "b", "b"]
    assert [r.error.code for r in batch.rows] == ["", "NOT_FOUND", "INVALID_ARGUMENT", "", "INVALID_ARGUMENT"]
    assert batch.rows[2].error.message.startswith("draft:") and "twice" in batch.rows[4].error.message
    ar = reference(llm, PROMPTS[0], mode="ar").token_ids
    assert list(batch.rows[0].outcome.tokens) == ar[:1]
    assert 1 <= len(batch.rows[3].outcome.tokens) <= 3
    assert [r.error.code for r in lone.rows] == ["NOT_FOUND"]
    assert rows_left == 0  # released sessions gave their cache rows back
    assert sizes == [2]  # the `ar` row and the `sd` block: one batched full forward
    # ... which the answer reports, with each good row's work around it (the engine's cost model)
    forwards = batch.times.forwards
    assert [(f.tier, f.rows, f.tokens) for f in forwards] == [("full", 2, 3)] and forwards[0].seconds > 0
    assert [r.work_seconds > 0 for r in batch.rows] == [True, False, False, True, False]


def test_probability_only_rows_are_checked_and_settled(aio, llm):
    """Verify rows carrying p(x~) alone: a rejected block answers with q's row and its uniform in
    place of its last token, and its session refuses the next block until a call settles that
    token; a p(x~) of the wrong length or outside (0, 1], or for a request that asks for logprobs,
    fails its row alone naming `p_x`; a settle nothing waits for fails the call naming `settles`.
    The drafter draws the token (`Correct`) from its own p row; a position its last block does
    not have, or a session it does not hold, fails alone."""
    import torch

    from viasd.actors.drafter import DrafterServicer
    from viasd.actors.rpc import decode_probs
    from viasd.rules import Lossless, correct_rows
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc

    sampled = dict(mode="sd", temperature=1.0)

    async def run():
        rank, servicer = _verifier(llm)
        drafter = DrafterServicer(llm.drafter, _capacity())
        v_server, v_ch, _ = await _served(internal_pb2_grpc.add_VerifierServiceServicer_to_server, servicer)
        d_server, d_ch, _ = await _served(internal_pb2_grpc.add_DrafterServiceServicer_to_server, drafter)
        try:
            verifier, drafts = internal_pb2_grpc.VerifierServiceStub(v_ch), internal_pb2_grpc.DrafterServiceStub(d_ch)
            opens = [_open("s", PROMPTS[0], **sampled), _open("l", PROMPTS[0], **sampled, logprobs=1)]
            await verifier.Prefill(_prefill(opens), timeout=30)
            await drafts.Prefill(_prefill(opens[:1]), timeout=30)
            proposal = (
                await drafts.Propose(ipb.ProposeBatch(rows=[ipb.ProposeRow(request_id="s", k=4, p_x=True)]))
            ).rows[0]
            draft = list(proposal.draft)
            first = await verifier.Verify(
                ipb.VerifyBatch(
                    rows=[
                        ipb.VerifyRow(
                            request_id="s", draft=draft, p_x=[1.0] * 4
                        ),  # q(x~) accepts: almost surely rejected
                        ipb.VerifyRow(request_id="l", draft=draft, p_x=[1.0] * len(draft)),
                    ]
                ),
                timeout=30,
            )
            blocked = await verifier.Verify(ipb.VerifyBatch(rows=[ipb.VerifyRow(request_id="s")]), timeout=30)
            bad = await verifier.Verify(
                ipb.VerifyBatch(
                    rows=[
                        ipb.VerifyRow(request_id="l", draft=[5, 6], p_x=[0.5]),
                        ipb.VerifyRow(request_id="l", draft=[5], p_x=[1.5]),
                    ]
                ),
                timeout=30,
            )
            verdict = first.rows[0]
            position = verdict.outcome.num_draft_accepted
            corrected = await drafts.Correct(
                ipb.CorrectBatch(
                    rows=[
                        ipb.CorrectRow(
                            request_id="s", position=position, q=verdict.correction.q, u=verdict.correction.u
                        ),
                        ipb.CorrectRow(request_id="s", position=4, q=verdict.correction.q, u=0.5),
                        ipb.CorrectRow(request_id="nope", position=0, q=verdict.correction.q, u=0.5),
                    ]
                ),
                timeout=30,
            )
            token = corrected.rows[0].token
            settled = await verifier.Verify(
                ipb.VerifyBatch(rows=[ipb.VerifyRow(request_id="s")], settles={"s": token}), timeout=30
            )
            with pytest.raises(grpc.aio.AioRpcError) as twice:
                await verifier.Verify(ipb.VerifyBatch(settles={"s": token}), timeout=30)
            p_row = drafter.worker.session("s").last_p[position]  # [1, V]
            seq = list(rank.worker.session("s").seq)
            await verifier.Release(ipb.ReleaseBatch(request_ids=["s", "l"]))
            await drafts.Release(ipb.ReleaseBatch(request_ids=["s"]))
            return proposal, first, blocked, bad, corrected, settled, twice.value, p_row, seq
        finally:
            await v_ch.close()
            await d_ch.close()
            await v_server.stop(None)
            await d_server.stop(None)

    proposal, first, blocked, bad, corrected, settled, twice, p_row, seq = aio.run(run())
    assert len(proposal.p_x) == len(proposal.draft) > 1 and not proposal.HasField("probs")  # p(x~) alone
    verdict = first.rows[0]
    assert verdict.HasField("correction") and not verdict.error.code
    q = decode_probs(verdict.correction.q)  # [1, V]
    assert q.shape == (1, llm.verifier.vocab_size) and 0.0 <= verdict.correction.u < 1.0
    position = verdict.outcome.num_draft_accepted
    assert len(verdict.outcome.tokens) == position < len(proposal.draft)  # the accepted draft tokens, the last pending
    assert proposal.p_x[position] == float(p_row[0, proposal.draft[position]])  # p(x~), exact
    want = correct_rows([Lossless()], p_row, q, torch.tensor([verdict.correction.u], dtype=torch.float64))
    assert [r.token for r in corrected.rows[:1]] == want.tolist()
    assert [r.error.code for r in corrected.rows] == ["", "INVALID_ARGUMENT", "NOT_FOUND"]
    assert corrected.rows[1].error.message.startswith("position:")
    assert [first.rows[1].error.code, *(r.error.code for r in bad.rows)] == ["INVALID_ARGUMENT"] * 3
    assert all(r.error.message.startswith("p_x:") for r in [first.rows[1], *bad.rows])
    assert blocked.rows[0].error.code == "INVALID_ARGUMENT" and blocked.rows[0].error.message.startswith("settles:")
    assert not settled.rows[0].error.code and len(settled.rows[0].outcome.tokens) == 1
    assert seq[len(PROMPTS[0]) + position] == corrected.rows[0].token  # settled, then decoded after it
    assert twice.code() == grpc.StatusCode.INVALID_ARGUMENT and "settles" in twice.details()


def _beside_a_drafter(aio, pipeline, drafter):
    """`drafter` (a DrafterServicer) served on a port of its own, and an engine on the pipeline's
    verifier with it for a drafter (`drafter_fallback`): (drafter, its server, the engine)."""
    from viasd.v1 import internal_pb2_grpc

    server, ch, address = aio.run(_served(internal_pb2_grpc.add_DrafterServiceServicer_to_server, drafter))
    aio.run(ch.close())
    return drafter, server, _coordinator(pipeline, drafter_address=address, drafter_fallback=True)


def test_a_correction_the_drafter_cannot_draw_fails_its_request_alone(aio, pipeline, llm):
    """A drafter that fails its Correct calls: the sampled requests whose blocks it had to finish
    fail (their verifier waits for a token only the drafter's p rows can give exactly: no fallback
    to `ar`), a greedy request beside them completes as in process, and no session is left."""
    from viasd.actors.drafter import DrafterServicer

    class Failing(DrafterServicer):
        async def Correct(self, request, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "drafter is gone")

    drafter, server, coord = _beside_a_drafter(aio, pipeline, Failing(llm.drafter, _capacity()))

    async def run():
        try:
            sampled = _run(coord, "sampled", PROMPTS[0], mode="sd", gamma=4, temperature=1.0, seed=3)
            greedy = _run(coord, "greedy", PROMPTS[1], mode="sd", gamma=3)
            return await asyncio.gather(sampled, greedy, return_exceptions=True)
        finally:
            coord.close()
            await server.stop(None)

    sampled, greedy = aio.run(run())
    assert isinstance(sampled, Exception) and "correction UNAVAILABLE" in str(sampled)
    assert [t for c in greedy for t in c.token_ids] == reference(llm, PROMPTS[1], mode="sd", gamma=3).token_ids
    assert len(drafter.sessions) == 0
    assert _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]}


@pytest.mark.parametrize("chunk", [0, 4], ids=["whole", "chunked"])
def test_a_prefill_batch_prefills_together_and_scores_each_prompt(aio, llm, chunk):
    """One Prefill opens several requests and feeds their prompts (of different lengths:
    right-padded) in one batched forward per tier, whole or in chunks over several calls; every
    request then decodes its own greedy tokens, each prompt's logprobs are its alone, and a
    second open of the same id, an unknown chunk or a full cache fail their rows alone."""
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc

    prompts = [PROMPTS[0], PROMPTS[1], [7, 8, 9], list(range(20, 41))]
    prefills = []  # rows of each prefill forward of q (the full tier)
    forward_batch = llm.verifier.forward_batch

    def counting(rows, store, mask=None, *args, **kwargs):
        if mask is None and any(len(r.tokens) > 1 for r in rows):
            prefills.append(len(rows))
        return forward_batch(rows, store, mask, *args, **kwargs)

    async def run():
        _, servicer = _verifier(llm)
        server, ch, _ = await _served(internal_pb2_grpc.add_VerifierServiceServicer_to_server, servicer)
        try:
            stub = internal_pb2_grpc.VerifierServiceStub(ch)
            opens = [_open(f"r{i}", p, mode="via", prompt_logprobs=1) for i, p in enumerate(prompts)]
            scored = {o.request_id: [] for o in opens}
            llm.verifier.forward_batch = counting
            try:
                batch = _prefill(opens, upto=chunk or None)
                while batch.opens or batch.chunks:
                    reply = await stub.Prefill(batch, timeout=30)
                    for row in reply.rows:
                        scored[row.request_id] += list(row.prompt_logprobs)
                    fed = {c.request_id: c.upto for c in batch.chunks}
                    ends = {o.request_id: len(o.prompt_token_ids) - 1 for o in opens}
                    batch = ipb.PrefillBatch(
                        chunks=[
                            ipb.PrefillChunk(request_id=r, upto=min(ends[r], done + chunk))
                            for r, done in fed.items()
                            if done < ends[r]
                        ]
                    )
            finally:
                del llm.verifier.forward_batch
            bad = await stub.Prefill(
                ipb.PrefillBatch(
                    opens=[opens[0]] + [_open(f"x{i}", [1, 2]) for i in range(8)],
                    chunks=[ipb.PrefillChunk(request_id="nope", upto=3)],
                ),
                timeout=30,
            )
            tokens = {o.request_id: [] for o in opens}
            for _ in range(4):  # `ar` steps of every row
                out = await stub.Verify(ipb.VerifyBatch(rows=[ipb.VerifyRow(request_id=r) for r in tokens]))
                for r in out.rows:
                    tokens[r.request_id] += list(r.outcome.tokens)
            await stub.Release(ipb.ReleaseBatch(request_ids=[*tokens, *(f"x{i}" for i in range(8))]))
            return scored, list(tokens.values()), bad
        finally:
            await ch.close()
            await server.stop(None)

    scored, tokens, bad = aio.run(run())
    for (key, got_scored), prompt, got in zip(scored.items(), prompts, tokens):
        alone = llm.complete(prompt, parse_params(mode="ar", max_tokens=4, prompt_logprobs=1))
        assert got == alone.token_ids, key
        ref = [e for e in alone.prompt_logprobs if e is not None]  # (the first prompt token has none)
        assert [e.token_id for e in got_scored] == [e.token_id for e in ref] == prompt[1:]
        assert [e.logprob for e in got_scored] == pytest.approx([e.logprob for e in ref], abs=1e-4)
    if chunk:  # every call's chunks went in one forward
        assert prefills == [4, 3, 2, 1, 1]  # (chunks of 4 tokens: the prompts are 6, 12, 3 and 21 long)
    else:
        assert prefills == [4]
    errors = {r.request_id: r.error.code for r in bad.rows if r.HasField("error")}
    full = dict.fromkeys(("x4", "x5", "x6", "x7"), "RESOURCE_EXHAUSTED")  # (8 rows: 4 held, x0..x3 took the rest)
    assert errors == {"r0": "INVALID_ARGUMENT", **full, "nope": "NOT_FOUND"}


# ------------------------------------------------------------------ lifecycle


def _counts(aio, pipeline):
    return aio.run(pipeline.session_counts())


def test_cancelled_stream_closes_both_sessions(server, aio, pipeline):
    _, _, stub = server

    async def start_then_cancel():
        params = parse_params(mode="via", max_tokens=400, ignore_eos=True, temperature=1.0, seed=5)
        call = stub.Generate(
            pb.GenerateRequest(
                request_id="to-cancel", prompt_token_ids=pb.TokenIds(ids=PROMPTS[0]), params=params_to_proto(params)
            )
        )
        got = [await call.read() for _ in range(2)]
        mid = await pipeline.session_counts()
        call.cancel()
        return got, mid

    got, mid = aio.run(start_then_cancel())
    assert all(r.token_ids for r in got)
    assert mid == {"drafter": 1, "verifier": [1]}  # the request was open on both sides
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]} and pipeline.coordinator.active_requests() == 0:
            break
        time.sleep(0.2)
    assert _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]}
    assert pipeline.coordinator.active_requests() == 0


@pytest.mark.parametrize("delay", [0.0, 0.002, 0.02])
def test_cancelled_while_opening_leaves_no_session(aio, pipeline, delay):
    """Cancelled before, during or just after the Open calls: whatever was opened is closed."""

    async def run():
        gen = pipeline.coordinator.generate(f"early-{delay}", PROMPTS[0], parse_params(mode="sd", max_tokens=50))
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(delay)
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, StopAsyncIteration):
            pass
        await gen.aclose()
        return await pipeline.session_counts()

    assert aio.run(run()) == {"drafter": 0, "verifier": [0]}
    assert pipeline.coordinator.active_requests() == 0


def test_finished_requests_leave_no_session(server, aio, pipeline):
    _, _, stub = server
    aio.run(collect(stub, request(PROMPTS[1], mode="sd", gamma=3)))
    assert _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]}
    assert pipeline.coordinator.active_requests() == 0


@pytest.mark.parametrize(
    "make, field",
    [
        (
            lambda: pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=[1, 2]), params=pb.GenerationParams(temperature=-1)
            ),
            "temperature",
        ),
        (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 500])), "prompt"),
        (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])), "prompt"),
        (
            lambda: pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=[1]), params=pb.GenerationParams(alpha1=0.3, alpha2=0.4)
            ),
            "alpha2",
        ),
        (
            lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1]), params=pb.GenerationParams(gamma=99)),
            "gamma",
        ),
        (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1]), params=pb.GenerationParams(mode=9)), "mode"),
        (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1]), model="nope"), "model"),
        (lambda: pb.GenerateRequest(), "prompt"),
        (lambda: pb.GenerateRequest(prompt="def f():"), "prompt"),  # these test models have no tokenizer
        (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1] * 600)), "prompt"),  # past the context (512)
    ],
    ids=["temperature", "vocab", "empty", "alpha2", "gamma", "mode", "model", "no-input", "text", "context"],
)
def test_bad_input_is_invalid_argument_naming_the_field(server, aio, pipeline, make, field):
    _, _, stub = server

    async def call():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, make())
        return err.value

    err = aio.run(call())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith(f"{field}:"), err.details()
    assert ("viasd-invalid-field", field) in tuple(err.trailing_metadata()), err.trailing_metadata()
    assert _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]}


def test_dtype_auto_is_chosen_once_for_every_actor_of_a_pipeline(ray_session, aio, engine_config):
    """`dtype: auto` is resolved once, on the node of the verifier's first rank, and every actor
    gets the concrete dtype (a choice each made alone rests on a timed probe: ranks could
    disagree); a concrete dtype is kept as it is."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from viasd.cluster.pipeline import _resolve_dtype

    auto = _pipeline_config(engine_config.model_copy(update={"dtype": "auto"}))
    pg = placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
    try:
        aio.run(pg.ready())
        resolved, choice = aio.run(_resolve_dtype(auto, pg))
        kept, none = aio.run(_resolve_dtype(_pipeline_config(engine_config), pg))
    finally:
        remove_placement_group(pg)
    assert choice["dtype_requested"] == "auto" and choice["dtype"] in ("bfloat16", "float32") and choice["dtype_reason"]
    assert resolved.engine.dtype == choice["dtype"] and resolved.engine.verifier == auto.engine.verifier
    assert kept.engine.dtype == "float32" and none is None


def test_the_actors_pack_the_linears_the_in_process_engine_packs(pipeline, llm):
    """Each actor loads and packs on its model thread; /v1/models reports what both packed (packing
    stops where memory runs short), as the in-process engine reports its own; likewise the kernel
    that reads paged caches, and why."""
    runtime, local = pipeline.info()["runtime"], llm.runtime_info()
    fields = ("linear_method", "linears_swapped", "linear_extra_bytes", "linear_mixed_from_rows")
    fields += ("paged_attention", "paged_attention_requested", "paged_attention_reason")
    assert {f: runtime[f] for f in fields} == {f: local[f] for f in fields}


def test_a_quantized_pipeline_serves_what_the_in_process_engine_does(ray_session, aio, tmp_path):
    """`quantization: int4` on a tiny random pair whose every linear the int4 kernel takes (integer
    kernels on every product: packed_linears off): the actors quantize as the in-process engine
    does, at TP=1 and at TP=2 (each rank its own slices), the served tokens over gRPC equal its
    tokens (which differ from the unquantized pair's), and the runtime info (/v1/models) reports
    the quantization of both models as it does."""
    from viasd.cluster.grpc_api import GenerationServicer
    from viasd.cluster.pipeline import Pipeline
    from viasd.cluster.standalone import serve_grpc
    from viasd.llm import LLM

    # K 64 / 128: whole groups of 32 on each of two ranks
    config = save_tiny_pair(tmp_path, hidden=64, intermediate=128, quantization="int4", packed_linears=False)
    llm, plain = LLM(config), LLM(config.model_copy(update={"quantization": "none"}))
    pipelines = {
        "int4": aio.run(Pipeline.start(_pipeline_config(config, name="int4")), timeout=120),
        "int4-tp2": aio.run(Pipeline.start(_pipeline_config(config, name="int4-tp2", tp_size=2)), timeout=120),
    }
    srv = aio.run(serve_grpc(GenerationServicer(pipelines, default="int4"), 0))

    async def connect():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.viasd_port}")
        return channel, generation_pb2_grpc.GenerationServiceStub(channel)

    channel, stub = aio.run(connect())
    try:
        local = llm.runtime_info()["quantization"]
        assert all(q.pop("seconds") >= 0 for q in local)
        for name, pipeline in pipelines.items():
            served = pipeline.info()["runtime"]["quantization"]
            assert all(q.pop("seconds") >= 0 for q in served)
            assert [(q["quantization"], q["quantization_reason"], q["kernels"]) for q in served] == [
                ("int4", "requested", {"int4g32": 6 * 7 + 1}),
                ("int4", "requested", {"int4g32": 2 * 7 + 1}),
            ], name
            if name == "int4":
                assert served == local
            else:  # (each rank holds half of every quantized weight)
                assert served[1] == local[1] and 2 * served[0]["bytes"] == local[0]["bytes"]
        differs = False
        for case in ("ar-greedy", "sd-greedy", "sd-sampled", "via-greedy"):
            params = CASES[case]
            for prompt in PROMPTS:
                ref = reference(llm, prompt, **params)
                for name in pipelines:
                    tokens, responses = aio.run(collect(stub, request(prompt, model=name, **params)))
                    assert_same_run(tokens, responses, ref, (name, case, prompt))
                differs |= ref.token_ids != reference(plain, prompt, **params).token_ids
        assert differs  # (the quantized pair decodes otherwise: the test sees whether it is quantized)
    finally:
        aio.run(channel.close())
        aio.run(srv.stop(grace=1))
        for pipeline in pipelines.values():
            aio.run(pipeline.shutdown())


def test_list_models_and_health(server, aio):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, srv, stub = server

    async def calls():
        models = await stub.ListModels(pb.ListModelsRequest(), timeout=10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.viasd_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            statuses = [
                (await health.Check(health_pb2.HealthCheckRequest(service=s), timeout=10)).status
                for s in ("", "viasd.v1.GenerationService")
            ]
        return models, statuses

    models, statuses = aio.run(calls())
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2
    (m,) = models.models
    assert (m.name, m.num_layers, list(m.skipped_layers), m.tensor_parallel_size, m.max_context, m.default_mode) == (
        "tiny",
        6,
        [1, 3],
        1,
        512,
        pb.MODE_AUTO,
    )
    assert m.verifier.endswith("verifier") and m.drafter.endswith("drafter")


# ------------------------------------------------------------------ drafter failure


def test_failing_drafter_falls_back_to_ar(aio, pipeline, llm):
    """Greedy sd whose drafter fails after one block finishes as ar: the same tokens as greedy ar;
    the drafter's counters still come back with its Release."""
    from viasd.actors.drafter import DrafterServicer

    class Failing(DrafterServicer):
        """Every Propose after the first fails with UNAVAILABLE."""

        proposes = 0

        async def Propose(self, request, context):
            self.proposes += 1
            if self.proposes > 1:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "drafter is gone")
            return await super().Propose(request, context)

    drafter, server, coord = _beside_a_drafter(aio, pipeline, Failing(llm.drafter, _capacity()))

    async def run():
        try:
            return await _run(coord, "fallback", PROMPTS[0], mode="sd", gamma=3)
        finally:
            coord.close()
            await server.stop(None)

    chunks = aio.run(run())
    ar = reference(llm, PROMPTS[0], mode="ar")
    assert [t for c in chunks for t in c.token_ids] == ar.token_ids
    stats = chunks[-1].stats
    assert stats.drafter_fallback and stats.num_drafts == 1 and stats.forwards["drafter"] > 0
    assert len(drafter.sessions) == 0  # the engine still released the drafter's session
    assert _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]}


# ------------------------------------------------------------------ tensor parallel


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_tp2_pipeline_equals_tp1(ray_session, aio, engine_config, server, pipeline, llm, backend, tmp_path):
    """TP=2 (torch: each rank reads its slices, the mask a DIMR artifact checked against the
    checkpoint files; deepspeed: whole copies sharded) serves what TP=1 does, alone and batched."""
    import json

    from viasd.cluster.pipeline import Pipeline
    from viasd.models.loader import checkpoint_fingerprint

    config = engine_config
    if backend == "deepspeed":
        import deepspeed  # noqa: F401  (a declared dependency: missing is a broken install, not a skip)
    else:  # the TP=1 pipeline's mask, as an artifact searched on these files (no weights fingerprint fits)
        artifact = {
            "schema_version": 1,
            "model_fingerprint": "0" * 64,
            "checkpoint_fingerprint": checkpoint_fingerprint(engine_config.verifier),
            "num_layers": pipeline.verifier_info["num_layers"],
            "skipped_layers": pipeline.verifier_info["skipped_layers"],
            "ratio": engine_config.skip_ratio,
            "objective": {"name": "rkl"},
            "trials": 1,
            "seconds": 0.0,
        }
        (tmp_path / "mask.json").write_text(json.dumps(artifact))
        config = engine_config.model_copy(update={"mask": str(tmp_path / "mask.json")})
    _, _, stub = server
    t0 = time.perf_counter()
    tp2 = aio.run(
        Pipeline.start(_pipeline_config(config, name=f"tiny-tp2-{backend}", tp_size=2, tp_backend=backend)),
        timeout=240,
    )
    print(f"\nTP=2 ({backend}) pipeline up in {time.perf_counter() - t0:.1f}s")
    try:
        assert tp2.info()["tensor_parallel_size"] == 2
        assert tp2.info()["runtime"]["linear_method"].startswith("off: sharded")  # (sharded linears: their own)
        assert tp2.verifier_info["local_q_proj_rows"] * 2 == pipeline.verifier_info["local_q_proj_rows"]  # sharded
        # torch: each rank read only its slices of the checkpoint (load_shard); DeepSpeed shards a whole
        # copy (and keeps the embeddings and head whole)
        assert tp2.verifier_info["checkpoint_read"] == ("its slices" if backend == "torch" else "every weight")
        mask_source = tp2.verifier_info["mask_source"]
        assert mask_source.startswith("file") if backend == "torch" else mask_source.startswith("given")
        share = tp2.verifier_info["weight_bytes"] / pipeline.verifier_info["weight_bytes"]
        assert share < (0.6 if backend == "torch" else 0.7), share
        for case, params in CASES.items():
            tp1_tokens, tp1 = aio.run(collect(stub, request(PROMPTS[0], **params)))

            async def on_tp2():
                return [
                    c
                    async for c in tp2.coordinator.generate(
                        f"tp2-{case}", PROMPTS[0], parse_params(max_tokens=24, **params)
                    )
                ]

            chunks = aio.run(on_tp2())
            assert [t for c in chunks for t in c.token_ids] == tp1_tokens, (backend, case)
            tp1_forwards = stats_from_proto(tp1[-1].stats).forwards
            for model in ("full", "slim") if params.get("overlap") else ("drafter", "full", "slim"):
                assert chunks[-1].stats.forwards[model] == tp1_forwards[model], (backend, case, model)
        # under batching: the mixed waves on the TP=2 group == the in-process (TP=1) batched run
        served = aio.run(served_waves(tp2.coordinator, BATCH_WAVES, f"tp2-wave-{backend}"))
        assert served == in_process_batched(llm, BATCH_WAVES), backend
        assert tp2.executor.totals.max_rows >= 6  # the ranks ran mixed-mode batches in lockstep
        # `auto`: both ranks profile q and q' together (collectives), then plan; greedy == ar
        costs = tp2.coordinator.engine.cost_model()
        assert costs.key["verifier"]["ranks"] == 2 and set(costs.grid) == {"full", "slim", "drafter"}
        auto = aio.run(_run(tp2.coordinator, f"tp2-auto-{backend}", PROMPTS[1], mode="auto"))
        assert [t for c in auto for t in c.token_ids] == reference(llm, PROMPTS[1], mode="ar").token_ids
        assert aio.run(tp2.session_counts()) == {"drafter": 0, "verifier": [0, 0]}
    finally:
        aio.run(tp2.shutdown())


# ------------------------------------------------------------------ lockstep checks (no Ray)


def test_rank_disagreement_is_detected(aio, llm, engine_config):
    """Rank 0 compares every rank's outcome with its own: a rank on another random stream (a bug
    that lockstep must never hide) fails the call with INTERNAL instead of streaming rank 0's tokens."""
    from viasd.actors.verifier import VerifierRank
    from viasd.llm import LLM
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc

    follower, _ = _verifier(LLM(engine_config))

    def shifted(batch):  # seeds shifted by one
        return VerifierRank.prefill(
            follower, dataclasses.replace(batch, opens=[o._replace(seed=o.seed + 1) for o in batch.opens])
        )

    follower.prefill = shifted
    channel = _Channel()

    async def run():
        _, servicer = _verifier(llm, channel, [channel.start(follower)])
        server, ch, _ = await _served(internal_pb2_grpc.add_VerifierServiceServicer_to_server, servicer)
        try:
            stub = internal_pb2_grpc.VerifierServiceStub(ch)
            await stub.Prefill(_prefill([_open("r", PROMPTS[0], mode="ar", temperature=1.0, seed=0)]), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                for _ in range(20):  # some step samples differently on the two streams
                    await stub.Verify(ipb.VerifyBatch(rows=[ipb.VerifyRow(request_id="r")]), timeout=30)
            await stub.Release(ipb.ReleaseBatch(request_ids=["r"]))
            return err.value
        finally:
            channel.stop()
            await ch.close()
            await server.stop(None)

    err = aio.run(run())
    assert err.code() == grpc.StatusCode.INTERNAL and "verifier ranks disagree on verify" in err.details()


def test_followers_receive_no_probability_rows_and_commit_rank_0s_verdicts(aio, llm, engine_config):
    """Tensor parallelism without the drafter's p on the followers: rank 0 decodes p, decides every
    sampled check and shares the verdicts ([B, 4] integers); a follower gets token ids, plans,
    p's shape and the tokens to settle only, consumes the same random draws, and commits the same
    tokens (check_ranks compares every outcome) over several steps of sampled sd (p(x~) alone, its
    rejected blocks settled by the next call), via and staged rows beside greedy and `ar` ones, so
    its random streams never part from rank 0's."""
    import pickle
    import queue

    import torch

    from viasd.actors.rpc import decode_probs, encode_probs
    from viasd.llm import LLM
    from viasd.rules import Lossless, correct_rows
    from viasd.sessions import Absent, VerdictShare
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc

    class Share(VerdictShare):
        """`VerdictBroadcast` within one process: a queue from the leader's thread to the follower's."""

        def __init__(self, verdicts: queue.Queue, leader: bool):
            self.verdicts, self.leader, self.followed = verdicts, leader, 0

        def lead(self, verdicts):
            self.verdicts.put(verdicts.clone())

        def follow(self, rows, device):
            self.followed += rows
            verdicts = self.verdicts.get(timeout=30)
            assert verdicts.shape == (rows, 4)
            return verdicts.to(device)

    shared = queue.Queue()
    follower, _ = _verifier(LLM(engine_config))  # (its own model: the two ranks run at once)
    follower.worker.verdicts = Share(shared, leader=False)
    channel = _Channel()
    vocab = llm.verifier.vocab_size
    keys = {
        "sd": dict(mode="sd", gamma=3, temperature=1.0, seed=3),
        "via": dict(VIA, temperature=0.9, seed=4),
        "staged": dict(VIA, rule="staged", temperature=1.0, seed=5),
        "greedy": dict(mode="sd", gamma=3),
        "ar": dict(mode="ar", temperature=1.0, seed=6),
    }
    g = torch.Generator().manual_seed(0)
    sent_p = {}  # key -> its last block's p [3, V]

    def row(key, step):
        if key == "ar" or (key in ("sd", "via") and step % 2):  # (an empty block decodes one token: a Draw)
            return ipb.VerifyRow(request_id=key)
        p = sent_p[key] = torch.softmax(torch.randn(3, vocab, generator=g) * 2, dim=-1)  # [3, V]
        draft = torch.multinomial(p, 1, generator=g)[:, 0]  # [3]
        if key == "sd":  # probability only
            return ipb.VerifyRow(request_id=key, draft=draft.tolist(), p_x=p.gather(1, draft[:, None])[:, 0].tolist())
        probs = None if key == "greedy" else encode_probs(p)
        return ipb.VerifyRow(request_id=key, draft=draft.tolist(), probs=probs, plan="")

    def settle(verdict) -> int:
        """The drafter's draw of a pending block's token."""
        q, u = decode_probs(verdict.correction.q), torch.tensor([verdict.correction.u], dtype=torch.float64)
        p_row = sent_p[verdict.request_id][verdict.outcome.num_draft_accepted][None]  # [1, V]
        return int(correct_rows([Lossless()], p_row.double(), q, u)[0])

    async def run():
        rank, servicer = _verifier(llm, channel, [channel.start(follower)])
        rank.worker.verdicts = Share(shared, leader=True)
        server, ch, _ = await _served(internal_pb2_grpc.add_VerifierServiceServicer_to_server, servicer)
        try:
            stub = internal_pb2_grpc.VerifierServiceStub(ch)
            await stub.Prefill(_prefill([_open(k, PROMPTS[0], **params) for k, params in keys.items()]), timeout=30)
            batches, settles, corrections = [], {}, 0
            for step in range(6):
                batch = ipb.VerifyBatch(rows=[row(k, step) for k in keys], settles=settles)
                reply = await stub.Verify(batch, timeout=30)
                assert [r.error.code for r in reply.rows] == [""] * len(keys)
                settles = {r.request_id: settle(r) for r in reply.rows if r.HasField("correction")}
                corrections += len(settles)
                batches.append(batch)
            assert corrections > 0
            await stub.Release(ipb.ReleaseBatch(request_ids=list(keys)))
            return batches
        finally:
            channel.stop()
            await ch.close()
            await server.stop(None)

    batches = aio.run(run())
    # every verdict rank 0 shared was used (a staged row checks twice a step); draws on the same
    # streams after them (the empty blocks) agreed, so the follower consumed what rank 0 did
    assert shared.empty() and follower.worker.verdicts.followed >= 6 * 2 + 3
    assert [op for op, _ in channel.sent] == ["prefill", *["verify"] * 6, "release"]  # what crossed, in order
    verifies = [args for op, args in channel.sent if op == "verify"]
    for (rows, settles), batch in zip(verifies, batches):
        assert [r.key for r in rows] == list(keys) and settles == dict(batch.settles)
        assert all(not isinstance(r.probs, (torch.Tensor, bytes)) for r in rows)  # no probability rows crossed
        sampled = {r.request_id: Absent((3, vocab)) for r in batch.rows if r.HasField("probs")}
        sampled |= {r.request_id: Absent((3,)) for r in batch.rows if r.p_x}
        assert {r.key: r.probs for r in rows if r.probs is not None} == sampled
        sent = len(pickle.dumps(("verify", (rows, settles))))  # (the channel's message: op and arguments)
        dense = sum(len(r.probs.data) for r in batch.rows if r.HasField("probs"))  # what crossed before
        rows_sent = sum(1 for r in batch.rows if r.HasField("probs"))
        assert sent < 2048 and dense == rows_sent * 3 * vocab * 4, (sent, dense)


def test_the_follower_bytes_table_is_what_the_arguments_pickle_to():
    """docs/TENSOR_PARALLEL.md's table of what crosses to a follower per step (16 sampled rows of
    5 drafts over Qwen's vocabulary, half of them settling a token): the Verify call's arguments
    with p as Ray pickled them before, the call with p(x~)'s shape (`Absent`) and the settles as
    the control channel pickles it now, and the [16, 4] int64 verdicts broadcast."""
    import pickle
    import re
    from pathlib import Path

    import torch

    from viasd.actors.rpc import encode_probs
    from viasd.executor import VerifyRow
    from viasd.sessions import Absent

    vocab, k, rows = 151_936, 5, 16
    g = torch.Generator().manual_seed(0)
    keys, draft = [f"req-{i:04d}-abcdef" for i in range(rows)], list(range(100, 100 + k))
    probs = [encode_probs(torch.softmax(torch.randn(k, vocab, generator=g), -1)).SerializeToString() for _ in keys]
    before = len(pickle.dumps([(key, draft, p, "") for key, p in zip(keys, probs)], protocol=5))  # (Ray's)
    shapes = [VerifyRow(key, list(draft), Absent((k,)), "") for key in keys]
    settles = {key: 100_000 + i for i, key in enumerate(keys[::2])}
    after = len(pickle.dumps(("verify", (shapes, settles))))  # what ControlChannel.send pickles (broadcast_object_list)
    broadcast = torch.empty(rows, 4, dtype=torch.long).nbytes
    doc = (Path(__file__).parents[2] / "docs" / "TENSOR_PARALLEL.md").read_text()
    table = [int(n.replace(",", "")) for n in re.findall(r"^\| [^|]+ \| ([\d,]+) \|$", doc, re.M)]
    assert table == [before, after, broadcast]


def test_actor_threads_default_to_the_nodes_cores_over_the_ranks(monkeypatch):
    """The drafter and the verifier take turns within a step: by default each uses the node's cores
    (over the TP ranks, which run at once), not its Ray CPU reservation; engine.threads wins."""
    import os

    import torch

    from viasd.actors.drafter import set_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    try:
        assert set_threads(None, 1) == 8 and torch.get_num_threads() == 8
        assert set_threads(None, 2) == 4 and set_threads(None, 16) == 1
        assert set_threads(3, 2) == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_the_masks_calibrated_gates_apply_to_served_via_requests_as_in_process(server, aio, llm, pipeline):
    """A `via` request that chooses no gate gets the pipeline's gates (the mask artifact's, read by
    the verifier at start), as `Engine.submit` gives them in-process; a request's own values win."""
    from viasd.gates import Gates

    _, _, stub = server
    gates = Gates(0.9, 0.7, "escalate")
    served = pipeline.coordinator.engine
    before = served.gates, llm.engine.gates
    served.gates = llm.engine.gates = gates
    try:
        for prompt in PROMPTS:
            params = parse_params(mode="via", gamma=4, max_tokens=24)
            bare = pb.GenerationParams(mode=pb.MODE_VIA, gamma=4, max_tokens=24)  # no gate field set
            req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), params=bare)
            tokens, responses = aio.run(collect(stub, req))
            ref = llm.engine.complete(prompt, params)
            assert tokens == ref.token_ids
            stats = stats_from_proto(responses[-1].stats)
            assert stats.slim_rewritten == 0 and stats.escalations > 0  # region B escalated, never rewrote
            own, _ = aio.run(collect(stub, request(prompt, **VIA)))  # alpha1 / alpha2 set: no gates applied
            assert own == reference(llm, prompt, **VIA).token_ids
    finally:
        served.gates, llm.engine.gates = before


# ------------------------------------------------------------------ served `auto`

# cost curves that make the planner's choice known (seconds against tokens per forward):
# drafting nearly free and q flat -> sd; every forward linear and the drafter as dear as q -> ar;
# the drafter dear and q flat -> only the free n-gram drafts pay
SPECULATE = {"full": [(1, 1.0), (64, 1.3)], "slim": [(1, 0.5), (64, 0.7)], "drafter": [(1, 0.05), (64, 0.6)]}
NEVER = {"full": [(1, 1.0), (64, 64.0)], "slim": [(1, 0.6), (64, 38.0)], "drafter": [(1, 1.0), (64, 64.0)]}
NGRAM = {"full": [(1, 1.0), (64, 1.3)], "slim": [(1, 0.6), (64, 0.8)], "drafter": [(1, 5.0), (64, 300.0)]}
CHEAP_SLIM = {"full": [(1, 1.0), (64, 64.0)], "slim": [(1, 0.01), (64, 0.02)], "drafter": [(1, 0.05), (64, 0.6)]}


def _coordinator(pipeline, grid=None, *, drafter_address=None, max_batch=None, drafter_fallback=False):
    """An engine of its own on the pipeline's actors (its own estimates and planner), planning with
    `grid` as given (None: it fetches both services' profiles and corrects them online, as a
    pipeline's does); `max_batch` rows at most (the actors hold more)."""
    from viasd.actors.coordinator import ServedExecutor
    from viasd.costs import CostModel
    from viasd.engine import AsyncEngine, Engine

    base = pipeline.coordinator.engine
    executor = ServedExecutor(
        pipeline.executor.verifier_address,
        drafter_address or pipeline.executor.drafter_address,
        vocab_size=base.executor.vocab_size,
        rpc_timeout_s=30,
    )
    capacity = base.capacity if max_batch is None else dataclasses.replace(base.capacity, max_batch=max_batch)
    engine = Engine.over(
        executor,
        capacity,
        eos_token_ids=base.eos_token_ids,
        costs=CostModel(dict(grid)) if grid is not None else None,  # (as given: not corrected online)
        drafter_fallback=drafter_fallback,
    )
    return AsyncEngine(engine)


async def _run(coordinator, name, prompt, **params):
    return [c async for c in coordinator.generate(name, prompt, parse_params(**{"max_tokens": 24, **params}))]


@pytest.mark.parametrize(
    "grid, expect", [(SPECULATE, "sd"), (NEVER, "ar"), (NGRAM, "ngram")], ids=["speculate", "never", "ngram"]
)
def test_served_greedy_auto_equals_ar_whatever_it_plans(aio, pipeline, llm, grid, expect):
    """Greedy `auto` through the actors, restricted to lossless plans: ar's tokens, token for token,
    alone and in a batch beside fixed-mode rows, with the plans the costs call for (the stats say
    which ran); a row planned `ar` sends no Propose, and a drafter no plan uses is never fed."""
    coord = _coordinator(pipeline, grid)

    async def run():
        try:
            alone = [await _run(coord, f"auto-{expect}-{i}", p, mode="auto") for i, p in enumerate(PROMPTS)]
            wave = [
                (0, dict(mode="auto", max_tokens=20)),
                (1, dict(VIA, max_tokens=16)),
                (1, dict(mode="auto", max_tokens=24)),
            ]
            wave += [(0, dict(mode="sd", gamma=3, temperature=0.9, seed=5, max_tokens=12))]
            return alone, await served_waves(coord, [wave], f"auto-wave-{expect}"), wave
        finally:
            coord.close()

    alone, batched, wave = aio.run(run())
    kinds = set()
    for prompt, chunks in zip(PROMPTS, alone):
        ar = reference(llm, prompt, mode="ar")
        assert [t for c in chunks for t in c.token_ids] == ar.token_ids
        stats = chunks[-1].stats
        assert stats.mode == "auto" and sum(stats.plans.values()) == stats.num_drafts + stats.plans.get("ar", 0)
        kinds |= {label.split(":")[0] for label in stats.plans}
        if expect == "ar":  # the drafter never ran, not even its prefill
            assert stats.forwards["drafter"] == 0 and stats.prefill_forwards == ar.stats.prefill_forwards
    assert expect in kinds and (kinds == {"ar"} or expect != "ar")
    for tokens, (i, params) in zip(batched, wave):
        solo = dict(params, mode="ar") if params["mode"] == "auto" else params
        assert tokens == llm.complete(PROMPTS[i], parse_params(**solo)).token_ids, params
    assert _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]}


@pytest.mark.parametrize("grid", [SPECULATE, NGRAM], ids=["speculate", "ngram"])
def test_served_auto_plans_as_in_process(aio, pipeline, llm, grid):
    """With the same cost curves, a served `auto` request makes the in-process engine's choices,
    step for step: the same plans, drafts, acceptances and tokens, greedy and sampled (the
    coordinator tracks what each drafter has fed as the drafter's cache does)."""
    from viasd.costs import CostModel
    from viasd.engine import Engine

    cases = [dict(mode="auto", max_tokens=40), dict(mode="auto", max_tokens=40, temperature=1.0, seed=31)]
    for params in cases:
        for i, prompt in enumerate(PROMPTS):
            coord = _coordinator(pipeline, grid)
            engine = Engine(
                llm.verifier, llm.drafter, mask=llm.engine.mask, costs=CostModel(dict(grid)), eos_token_ids=(2,)
            )

            async def run():
                try:
                    return await _run(coord, f"as-in-process-{i}", prompt, **params)
                finally:
                    coord.close()

            chunks = aio.run(run())
            ref = engine.complete(prompt, parse_params(**params))
            assert [t for c in chunks for t in c.token_ids] == ref.token_ids, params
            stats = chunks[-1].stats
            assert stats.plans == ref.stats.plans, params
            names = ("num_drafts", "num_draft_tokens", "ngram_draft_tokens", "num_accepted_tokens", "forwards")
            for name in (*names, "prefill_forwards"):  # (the drafter fed at Open, or caught up, as in-process)
                assert getattr(stats, name) == getattr(ref.stats, name), (params, name)


@pytest.mark.parametrize("grid, fed", [(SPECULATE, True), (NEVER, False)], ids=["speculate", "never"])
def test_served_auto_feeds_its_drafter_at_open_only_when_it_plans_to_draft(aio, pipeline, llm, grid, fed):
    """The drafter of an `auto` request planned to draft from the start prefills at Open, beside
    the verifier's prefill (as in-process: test_auto); one planned `ar` stays unfed."""
    coord, opens = _coordinator(pipeline, grid), []
    executor = coord.engine.executor
    call = executor._call

    def recording(stub, component, method, request, timeout=None):
        reply = call(stub, component, method, request, timeout)
        if method == "Prefill" and component == "drafter" and request.opens:
            opens.append((bool(request.chunks), [r.fed for r in reply[0].rows]))
        return reply

    executor._call = recording
    prompt = list(range(3, 33))  # (no repeats: no n-gram drafts)

    async def run():
        try:
            return await _run(coord, f"feed-{fed}", prompt, mode="auto", max_tokens=12)
        finally:
            coord.close()

    chunks = aio.run(run())
    assert opens == [(fed, [len(prompt) - 1 if fed else 0])]
    assert [t for c in chunks for t in c.token_ids] == llm.complete(
        prompt, parse_params(mode="ar", max_tokens=12)
    ).token_ids
    assert (chunks[-1].stats.forwards["drafter"] > 0) == fed


def test_served_auto_profiles_both_services_and_learns_online(aio, pipeline, llm):
    """The first `auto` request fetches each service's profile of its own tiers (`Costs`); the
    steps' Propose and Verify calls then correct it, and the planner's state says so. A lossy
    plan runs only for a request that allows it."""
    from viasd.cluster.serving_metrics import ServingMetrics, parse_exposition, total

    coord = _coordinator(pipeline)

    async def run():
        try:
            ar = await _run(coord, "fetch", PROMPTS[0], mode="auto")
            state = coord.planner_state()
            cheap = _coordinator(pipeline, CHEAP_SLIM)  # the slim tier nearly free: via pays
            estimates = cheap.engine.scheduler.estimates
            estimates.via_tokens, estimates.via_escalation = 3.0, 0.1
            try:
                lossless = await _run(cheap, "lossless", PROMPTS[1], mode="auto")
                lossy = await _run(cheap, "lossy", PROMPTS[1], mode="auto", auto_lossy=True)
            finally:
                cheap.close()
            return ar, state, lossless, lossy
        finally:
            coord.close()

    ar, state, lossless, lossy = aio.run(run())
    assert [t for c in ar for t in c.token_ids] == reference(llm, PROMPTS[0], mode="ar").token_ids
    costs = state["costs"]
    assert set(costs["seconds"]) == {"full", "slim", "drafter"}
    assert all(p["seconds"] > 0 for curve in costs["seconds"].values() for p in curve)
    # the profiles' rows x tokens grids travel whole (CostCurve.rows)
    assert all({p["rows"] for p in curve} == {b for b, _ in GRID} for curve in costs["seconds"].values())
    assert costs["key"]["verifier"]["ranks"] == 1 and set(costs["key"]["verifier"]["tiers"]) == {"full", "slim"}
    assert set(costs["key"]["drafter"]["tiers"]) == {"drafter"}
    assert costs["online"] and costs["observed"] > 0 and costs["scale"]["full"] != 1.0  # the steps taught it
    assert costs["transport_seconds"]["verify"] > 0  # each Verify's round trip beyond the verifier's own seconds
    metrics = ServingMetrics("m")
    metrics.set_planner(state)
    exposed = total(
        parse_exposition(metrics.exposition()[0].decode()), "viasd_planner_transport_seconds", call="verify"
    )
    assert exposed == pytest.approx(costs["transport_seconds"]["verify"])
    tokens = len([t for c in ar for t in c.token_ids])  # every step of the request, planned and settled once
    assert sum(f["tokens"] for f in state["forecasts"].values()) == tokens
    steps = sum(f["steps"] for f in state["forecasts"].values())
    assert (
        total(parse_exposition(metrics.exposition()[0].decode()), "viasd_planner_forecast", quantity="steps") == steps
    )
    assert state["acceptance"]["model"] and 0 <= state["via"]["escalation_rate"] <= 1
    # the services report each forward and each row's work: the coordinator learns as in-process,
    # per tier and per plan kind (`CostModel.observe_step`)
    kinds = {label.split(":")[0] for label in ar[-1].stats.plans}
    assert set(costs["overhead_seconds"]) == kinds and all(o > 0 for o in costs["overhead_seconds"].values())
    assert ("drafter" in costs["scale"]) == bool(kinds & {"sd", "via"}) and costs["observed"] >= steps
    plans = lossless[-1].stats.plans, lossy[-1].stats.plans
    assert not any(k.startswith("via") for k in plans[0]) and lossless[-1].stats.forwards["slim"] == 0
    assert any(k.startswith("via") for k in plans[1]) and lossy[-1].stats.forwards["slim"] > 0
    assert [t for c in lossless for t in c.token_ids] == reference(llm, PROMPTS[1], mode="ar").token_ids


def test_a_plan_the_request_does_not_allow_is_invalid_argument():
    from viasd.config import Mode
    from viasd.errors import InvalidParameterError
    from viasd.executor import plan_mode as _plan_mode

    auto, lossy = parse_params(mode="auto"), parse_params(mode="auto", auto_lossy=True)
    assert _plan_mode(auto, "sd", True) == Mode.SD and _plan_mode(auto, "ngram", True) == Mode.SD
    assert _plan_mode(lossy, "via", True) == Mode.VIA and _plan_mode(parse_params(mode="sd"), "", True) is None
    for params, plan, words in (
        (auto, "via", "lossy"),  # not allowed: auto_lossy is off
        (auto, "", "needs its plan"),  # an auto block with no plan would run the via path
        (parse_params(mode="sd"), "sd", "only `auto`"),
        (auto, "bogus", "unknown plan"),
    ):
        with pytest.raises(InvalidParameterError) as err:
            _plan_mode(params, plan, True)
        assert err.value.field == "plan" and words in str(err.value), (plan, str(err.value))
