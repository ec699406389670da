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
* a failing drafter: the request finishes as `ar` (drafter_fallback).
"""

from __future__ import annotations

import asyncio
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
    return llm.complete(prompt, parse_params(max_tokens=24, **params))


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
    batches (one Verify carried rows of several modes) and every session is closed afterwards."""
    coord = pipeline.coordinator
    before = dict(coord.totals.to_dict())
    served = aio.run(served_waves(coord, BATCH_WAVES, "wave"))
    after = coord.totals.to_dict()
    batched = in_process_batched(llm, BATCH_WAVES)
    alone = [llm.complete(PROMPTS[i], parse_params(**params)).token_ids for wave in BATCH_WAVES for i, params in wave]
    for j, (s, b, a) in enumerate(zip(served, batched, alone)):
        assert s == b == a, j
    steps, verifies = after["steps"] - before["steps"], after["verify_calls"] - before["verify_calls"]
    rows = after["rows"] - before["rows"]
    assert verifies == steps and rows == after["cycles"] - before["cycles"]  # one Verify per step, a row per cycle
    assert rows > 2 * verifies  # batches, not one request at a time
    assert coord.totals.max_rows >= 6  # > the 4 rows of any one mode: a mixed-mode Verify
    assert after["propose_calls"] - before["propose_calls"] <= steps  # at most one Propose per step
    assert _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]}
    assert coord.active_requests() == 0


def test_a_slow_consumer_holds_back_only_its_own_request_one_chunk_ahead(aio, pipeline, llm):
    """The step driver makes a request's next chunk while its consumer is busy with the last one
    (the transport's work overlaps the models'), and no more than that one: a slow consumer holds
    back only its own request. The driver's time is in its phases (`RpcTotals.phases`,
    `viasd_coordinator_seconds{phase}`), the consumer's turns in `wait_consumers`."""
    from viasd.cluster.serving_metrics import ServingMetrics, parse_exposition, total

    coord = _coordinator(pipeline)
    busy_s = 0.4

    async def run():
        chunks, made = [], []  # made: the request's steps that ended while its consumer was busy
        t0 = time.perf_counter()
        try:
            async for chunk in coord.generate("slow", PROMPTS[0], parse_params(mode="ar", max_tokens=6)):
                chunks.append(chunk)
                before = coord.totals.cycles
                await asyncio.sleep(busy_s)  # a slow consumer
                made.append(coord.totals.cycles - before)
        finally:
            await coord.close()
        return chunks, made, time.perf_counter() - t0

    chunks, made, wall = aio.run(run())
    assert [t for c in chunks for t in c.token_ids] == llm.complete(
        PROMPTS[0], parse_params(mode="ar", max_tokens=6)
    ).token_ids
    assert len(chunks) == 6 and made == [1] * 5 + [0]  # (nothing after the last chunk)
    t = coord.totals
    phases = t.phases()
    assert t.steps == 6 and phases["verifier"] > 0 and phases["verify_transport"] > 0 and phases["drafter"] == 0
    assert sum(phases.values()) <= wall
    # the driver waited out the consumer's turns, less the steps made meanwhile (but the fifth:
    # the step it made ahead then was the last, and nobody waited for an ended request)
    stepping = sum(v for k, v in phases.items() if not k.startswith("wait"))
    assert 4 * busy_s - stepping - 0.05 <= phases["wait_consumers"] <= 4 * busy_s
    metrics = ServingMetrics("m")
    metrics.set_steps(3, {"verifier": 1e-3, "wait_consumers": 2e-3})
    metrics.set_steps(t.steps, phases)  # the counters move by what changed
    samples = parse_exposition(metrics.exposition()[0].decode())
    assert total(samples, "viasd_coordinator_steps_total") == 6
    for phase, seconds in phases.items():
        assert total(samples, "viasd_coordinator_seconds_total", phase=phase) == pytest.approx(seconds)


def test_a_request_opened_into_an_empty_batch_steps_with_the_opens_in_flight(aio, pipeline, llm):
    """A burst into an idle pipeline: the first request's Open ends while the others' still run,
    and it waits for them, so the first step carries all three rows (not a step of its own that
    the others then wait for). A request that opens while the batch has a row steps at once,
    whatever Opens are still in flight. Each request's tokens are its own."""
    coord, verifies = _coordinator(pipeline), []
    call = coord._call
    slow = {"burst-1", "burst-2", "late-slow"}  # their Opens take 0.5 s more (a longer prefill)

    async def recording(stub, component, method, request, timeout=None):
        if method == "Open" and request.request_id in slow:
            await asyncio.sleep(0.5)
        if method == "Verify":
            verifies.append({r.request_id for r in request.rows})
        return await call(stub, component, method, request, timeout)

    coord._call = recording
    sd = dict(mode="sd", gamma=3, max_tokens=8)

    async def tokens(name, prompt, params):
        return [t for c in await _run(coord, name, prompt, **params) for t in c.token_ids]

    async def run():
        try:
            burst = await asyncio.gather(
                tokens("burst-0", PROMPTS[0], sd), *(tokens(f"burst-{i}", PROMPTS[1], sd) for i in (1, 2))
            )
            n = len(verifies)
            held = coord.generate("holder", PROMPTS[0], parse_params(mode="ar", max_tokens=8))
            await held.__anext__()  # a row in the batch (its consumer holds its next chunk back)
            late_slow = asyncio.ensure_future(tokens("late-slow", PROMPTS[1], sd))
            late = await tokens("late", PROMPTS[0], sd)
            await late_slow
            await held.aclose()
            return burst, late, verifies[n:]
        finally:
            await coord.close()

    burst, late, later = aio.run(run())
    assert verifies[0] == {"burst-0", "burst-1", "burst-2"}
    assert burst == [llm.complete(p, parse_params(**sd)).token_ids for p in (PROMPTS[0], PROMPTS[1], PROMPTS[1])]
    assert late == llm.complete(PROMPTS[0], parse_params(**sd)).token_ids
    joined = next(rows for rows in later if "late" in rows)
    assert "late-slow" not in joined  # it stepped before the slow Open ended


def test_a_batched_propose_reports_its_forwards_and_each_rows_work(aio, llm):
    """A Propose reports every batched forward it ran (tier, rows, padded tokens, seconds: a lazy
    `auto` drafter's catch-up, then one per drafting round, rows leaving as their blocks end) and
    each row's work between them, so that the coordinator's cost model learns from the drafter's
    own figures as the in-process scheduler does (`viasd.costs.StepTimes`)."""
    from viasd.actors.drafter import DrafterServicer
    from viasd.actors.rpc import start_server
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc

    async def run():
        servicer = DrafterServicer(llm.drafter)
        server, port = await start_server(lambda s: internal_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, s))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = internal_pb2_grpc.DrafterServiceStub(ch)
                for rid, mode, prompt in (("fed", "sd", PROMPTS[0]), ("lazy", "auto", PROMPTS[1])):
                    params = params_to_proto(parse_params(mode=mode))
                    await stub.Open(ipb.OpenRequest(request_id=rid, prompt_token_ids=prompt, params=params, seed=1))
                rows = [ipb.ProposeRequest(request_id="fed", k=3), ipb.ProposeRequest(request_id="lazy", k=2)]
                batch = await stub.Propose(ipb.ProposeRequest(rows=rows), timeout=30)
                for rid in ("fed", "lazy"):
                    await stub.Close(ipb.CloseRequest(request_id=rid))
                return batch
        finally:
            await server.stop(None)

    batch = aio.run(run())
    assert [len(r.draft) for r in batch.rows] == [3, 2]
    # the lazy row's catch-up (its prompt but the last token), then rounds of 2, 2 and 1 rows
    assert [(f.tier, f.rows, f.tokens) for f in batch.forwards] == [
        ("drafter", 1, len(PROMPTS[1]) - 1),
        ("drafter", 2, 1),
        ("drafter", 2, 1),
        ("drafter", 1, 1),
    ]
    assert all(f.seconds > 0 for f in batch.forwards) and all(r.work_seconds > 0 for r in batch.rows)
    assert batch.seconds >= sum(f.seconds for f in batch.forwards) + sum(r.work_seconds for r in batch.rows)


def test_a_bad_row_fails_alone_in_a_batched_verify(aio, llm):
    """A Verify batch with one unknown request and one out-of-vocabulary draft: those rows carry
    NOT_FOUND / INVALID_ARGUMENT, the good rows are verified in the same call (the batched
    forward runs), and a single-row Verify still answers with the call's status."""
    from viasd.actors.rpc import start_server
    from viasd.actors.verifier import VerifierCore, VerifierServicer
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc

    sizes = []  # rows of each forward the verifier ran
    forward_batch = llm.verifier.forward_batch

    def counting(rows, *args, **kwargs):
        sizes.append(len(rows))
        return forward_batch(rows, *args, **kwargs)

    async def run():
        core = VerifierCore(llm.verifier, llm.engine.mask, "separate")
        servicer = VerifierServicer(core)
        server, port = await start_server(
            lambda s: internal_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, s)
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = internal_pb2_grpc.VerifierServiceStub(ch)
                for rid, mode in (("a", "ar"), ("b", "sd")):
                    params = params_to_proto(parse_params(mode=mode))
                    await stub.Open(ipb.OpenRequest(request_id=rid, prompt_token_ids=PROMPTS[0], params=params, seed=1))
                llm.verifier.forward_batch = counting
                try:
                    batch = await stub.Verify(
                        ipb.VerifyRequest(
                            rows=[
                                ipb.VerifyRequest(request_id="a"),
                                ipb.VerifyRequest(request_id="nope"),
                                ipb.VerifyRequest(request_id="b", draft=[5, 999]),
                                ipb.VerifyRequest(request_id="b", draft=[5, 6]),
                            ]
                        ),
                        timeout=30,
                    )
                finally:
                    del llm.verifier.forward_batch
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Verify(ipb.VerifyRequest(request_id="nope"), timeout=30)
                for rid in ("a", "b"):
                    await stub.Close(ipb.CloseRequest(request_id=rid))
                return batch, err.value, core.full_store.rows_in_use
        finally:
            await server.stop(None)

    batch, err, rows_left = aio.run(run())
    assert [r.request_id for r in batch.rows] == ["a", "nope", "b", "b"]
    assert [r.error.code for r in batch.rows] == ["", "NOT_FOUND", "INVALID_ARGUMENT", ""]
    assert batch.rows[2].error.message.startswith("draft:")
    ar = reference(llm, PROMPTS[0], mode="ar").token_ids
    assert list(batch.rows[0].outcome.tokens) == ar[:1]
    assert 1 <= len(batch.rows[3].outcome.tokens) <= 3
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert rows_left == 0  # closed sessions gave their cache rows back
    assert sizes == [2]  # the `ar` row and the `sd` block: one batched full forward
    # ... which the answer reports, with each good row's work around it (the coordinator's cost model)
    assert [(f.tier, f.rows, f.tokens) for f in batch.forwards] == [("full", 2, 3)] and batch.forwards[0].seconds > 0
    assert [r.work_seconds > 0 for r in batch.rows] == [True, False, False, True]


@pytest.mark.parametrize("prefill_tokens", [512, 1], ids=["together", "alone"])
def test_opens_that_arrive_together_prefill_together(aio, llm, prefill_tokens):
    """The verifier's Opens that arrive while one runs go in the next lockstep call together, and
    their prompts (of different lengths: right-padded) prefill in one batched forward per tier
    within `prefill_tokens` padded tokens (1: each alone); every request then decodes its own
    greedy tokens, and each prompt's logprobs are its alone."""
    import threading

    from viasd.actors.rpc import start_server
    from viasd.actors.verifier import VerifierCore, VerifierServicer
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc

    prompts = [PROMPTS[0], PROMPTS[1], [7, 8, 9], list(range(20, 41))]
    prefills = []  # rows of each prefill forward of q (the full tier: one per Open batch)
    forward_batch = llm.verifier.forward_batch

    def counting(rows, store, mask=None, *args, **kwargs):
        if mask is None and any(len(r.tokens) > 1 for r in rows):
            prefills.append(len(rows))
        return forward_batch(rows, store, mask, *args, **kwargs)

    async def run():
        core = VerifierCore(llm.verifier, llm.engine.mask, "separate", prefill_tokens=prefill_tokens)
        servicer = VerifierServicer(core)
        server, port = await start_server(
            lambda s: internal_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, s)
        )
        busy = threading.Event()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = internal_pb2_grpc.VerifierServiceStub(ch)
                blocker = core.work.submit(busy.wait, 30)  # the worker is busy (a step) while the Opens arrive
                llm.verifier.forward_batch = counting
                params = params_to_proto(parse_params(mode="via", prompt_logprobs=1))
                opens = [
                    asyncio.ensure_future(
                        stub.Open(ipb.OpenRequest(request_id=f"r{i}", prompt_token_ids=p, params=params, seed=1))
                    )
                    for i, p in enumerate(prompts)
                ]
                await asyncio.sleep(0.5)
                busy.set()
                await blocker
                opened = await asyncio.gather(*opens)
                del llm.verifier.forward_batch
                tokens = {f"r{i}": [] for i in range(len(prompts))}
                for _ in range(4):  # `ar` steps of every row
                    out = await stub.Verify(ipb.VerifyRequest(rows=[ipb.VerifyRequest(request_id=r) for r in tokens]))
                    for r in out.rows:
                        tokens[r.request_id] += list(r.outcome.tokens)
                for rid in tokens:
                    await stub.Close(ipb.CloseRequest(request_id=rid))
                return opened, list(tokens.values())
        finally:
            busy.set()
            await server.stop(None)

    opened, tokens = aio.run(run())
    for prompt, got, response in zip(prompts, tokens, opened):
        alone = llm.complete(prompt, parse_params(mode="ar", max_tokens=4, prompt_logprobs=1))
        assert got == alone.token_ids
        ref = [e for e in alone.prompt_logprobs if e is not None]  # (the first prompt token has none)
        assert [e.token_id for e in response.prompt_logprobs] == [e.token_id for e in ref] == prompt[1:]
        assert [e.logprob for e in response.prompt_logprobs] == pytest.approx([e.logprob for e in ref], abs=1e-4)
    if prefill_tokens == 1:
        assert prefills == [1] * len(prompts)
    else:  # the first Open started a batch at once (with whichever Opens gRPC delivered in the same
        # tick of the event loop: one or more); the others, arriving while it waited, the next one
        assert sum(prefills) == len(prompts) and len(prefills) <= 2 and max(prefills) >= 2


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


def test_the_actors_pack_the_linears_the_in_process_engine_packs(pipeline, llm):
    """Each actor loads and packs on its model thread; /v1/models reports what both packed (packing
    stops where memory runs short), as the in-process engine reports its own."""
    runtime, local = pipeline.info()["runtime"], llm.runtime_info()
    fields = ("linear_method", "linears_swapped", "linear_extra_bytes", "linear_mixed_from_rows")
    assert {f: runtime[f] for f in fields} == {f: local[f] for f in fields}


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
    """Greedy sd whose drafter dies after one block finishes as ar: the same tokens as greedy ar."""
    from viasd.actors.coordinator import Coordinator
    from viasd.actors.drafter import DrafterServicer
    from viasd.actors.rpc import start_server
    from viasd.v1 import internal_pb2_grpc

    class Failing(DrafterServicer):
        """Every Propose after the first fails with UNAVAILABLE."""

        proposes = 0

        async def Propose(self, request, context):
            self.proposes += 1
            if self.proposes > 1:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "drafter is gone")
            return await super().Propose(request, context)

    async def run():
        drafter = Failing(llm.drafter)
        server, port = await start_server(lambda s: internal_pb2_grpc.add_DrafterServiceServicer_to_server(drafter, s))
        base = pipeline.coordinator
        coord = Coordinator(
            base.verifier_address,
            f"127.0.0.1:{port}",
            vocab_size=base.vocab_size,
            max_context=base.max_context,
            eos_token_ids=base.eos_token_ids,
            rpc_timeout_s=30,
        )
        try:
            chunks = [
                c async for c in coord.generate("fallback", PROMPTS[0], parse_params(mode="sd", gamma=3, max_tokens=24))
            ]
            return chunks, len(drafter.sessions)
        finally:
            await coord.close()
            await server.stop(None)

    chunks, open_sessions = aio.run(run())
    ar = reference(llm, PROMPTS[0], mode="ar")
    assert [t for c in chunks for t in c.token_ids] == ar.token_ids
    stats = chunks[-1].stats
    assert stats.drafter_fallback and stats.num_drafts == 1 and stats.forwards["drafter"] > 0
    assert open_sessions == 0  # the coordinator still closed the drafter's session
    assert _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]}


# ------------------------------------------------------------------ tensor parallel


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_tp2_pipeline_equals_tp1(ray_session, aio, engine_config, server, pipeline, llm, backend):
    from viasd.cluster.pipeline import Pipeline

    if backend == "deepspeed":
        import deepspeed  # noqa: F401  (a declared dependency: missing is a broken install, not a skip)
    _, _, stub = server
    t0 = time.perf_counter()
    tp2 = aio.run(
        Pipeline.start(_pipeline_config(engine_config, name=f"tiny-tp2-{backend}", tp_size=2, tp_backend=backend)),
        timeout=240,
    )
    print(f"\nTP=2 ({backend}) pipeline up in {time.perf_counter() - t0:.1f}s")
    try:
        assert tp2.info()["tensor_parallel_size"] == 2
        assert tp2.info()["runtime"]["linear_method"].startswith("off: sharded")  # (sharded linears: their own)
        assert tp2.verifier_info["local_q_proj_rows"] * 2 == pipeline.verifier_info["local_q_proj_rows"]  # sharded
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
        assert tp2.coordinator.totals.max_rows >= 6  # the ranks ran mixed-mode batches in lockstep
        # `auto`: both ranks profile q and q' together (collectives), then plan; greedy == ar
        costs = aio.run(tp2.coordinator.cost_model())
        assert costs.key["verifier"]["ranks"] == 2 and set(costs.grid) == {"full", "slim", "drafter"}
        auto = aio.run(_run(tp2.coordinator, f"tp2-auto-{backend}", PROMPTS[1], mode="auto"))
        assert [t for c in auto for t in c.token_ids] == reference(llm, PROMPTS[1], mode="ar").token_ids
        assert aio.run(tp2.session_counts()) == {"drafter": 0, "verifier": [0, 0]}
    finally:
        aio.run(tp2.shutdown())


# ------------------------------------------------------------------ lockstep checks (no Ray)


def test_rank_disagreement_is_detected(aio, llm):
    """Rank 0 compares every rank's outcome with its own: a rank on another random stream (a bug
    that lockstep must never hide) fails the call with INTERNAL instead of streaming rank 0's tokens."""
    from viasd.actors.rpc import start_server
    from viasd.actors.verifier import VerifierCore, VerifierServicer, _comparable
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc

    class Follower:
        """Stands in for a VerifierWorker handle: `call.remote(seq, op, *args)`, seeds shifted by one."""

        def __init__(self):
            self.core = VerifierCore(llm.verifier, llm.engine.mask, "separate")
            self.call = self

        def remote(self, seq, op, *args):
            if op == "open":  # (one Open per call here: a batch of one)
                args = ([(*r[:3], r[3] + 1, *r[4:]) for r in args[0]],)

            async def run():
                return _comparable(op, await self.core.work.enqueue(seq, getattr(self.core, op), *args))

            return asyncio.ensure_future(run())

    async def run():
        core = VerifierCore(llm.verifier, llm.engine.mask, "separate")
        servicer = VerifierServicer(core, [Follower()], check_ranks=True)
        server, port = await start_server(
            lambda s: internal_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, s)
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = internal_pb2_grpc.VerifierServiceStub(ch)
                params = params_to_proto(parse_params(mode="ar", temperature=1.0, seed=0))
                await stub.Open(ipb.OpenRequest(request_id="r", prompt_token_ids=PROMPTS[0], params=params, seed=3))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    for _ in range(20):  # some step samples differently on the two streams
                        await stub.Verify(ipb.VerifyRequest(request_id="r"), timeout=30)
                await stub.Close(ipb.CloseRequest(request_id="r"))
                return err.value
        finally:
            await server.stop(None)

    err = aio.run(run())
    assert err.code() == grpc.StatusCode.INTERNAL and "verifier ranks disagree on verify" in err.details()


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
    before = pipeline.coordinator.gates, llm.engine.gates
    pipeline.coordinator.gates = llm.engine.gates = gates
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
        pipeline.coordinator.gates, llm.engine.gates = before


# ------------------------------------------------------------------ served `auto`

# cost curves that make the planner's choice known (seconds against tokens per forward):
# drafting nearly free and q flat -> sd; every forward linear and the drafter as dear as q -> ar;
# the drafter dear and q flat -> only the free n-gram drafts pay
SPECULATE = {"full": [(1, 1.0), (64, 1.3)], "slim": [(1, 0.5), (64, 0.7)], "drafter": [(1, 0.05), (64, 0.6)]}
NEVER = {"full": [(1, 1.0), (64, 64.0)], "slim": [(1, 0.6), (64, 38.0)], "drafter": [(1, 1.0), (64, 64.0)]}
NGRAM = {"full": [(1, 1.0), (64, 1.3)], "slim": [(1, 0.6), (64, 0.8)], "drafter": [(1, 5.0), (64, 300.0)]}
CHEAP_SLIM = {"full": [(1, 1.0), (64, 64.0)], "slim": [(1, 0.01), (64, 0.02)], "drafter": [(1, 0.05), (64, 0.6)]}


def _coordinator(pipeline, grid=None):
    """A coordinator of its own on the pipeline's actors (its own estimates), planning with `grid`
    as given (None: it fetches both services' profiles and corrects them online, as a pipeline's does)."""
    from viasd.actors.coordinator import Coordinator
    from viasd.costs import CostModel

    base = pipeline.coordinator
    return Coordinator(
        base.verifier_address,
        base.drafter_address,
        vocab_size=base.vocab_size,
        max_context=base.max_context,
        eos_token_ids=base.eos_token_ids,
        rpc_timeout_s=30,
        costs=CostModel(dict(grid)) if grid is not None else None,  # (as given: not corrected online)
    )


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
            await coord.close()

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
                    await coord.close()

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
    call = coord._call

    async def recording(stub, component, method, request, timeout=None):
        response = await call(stub, component, method, request, timeout)
        if method == "Open" and component == "drafter":
            opens.append((request.feed_drafter, response.stats.prefill_forwards))
        return response

    coord._call = recording
    prompt = list(range(3, 33))  # (no repeats: no n-gram drafts)

    async def run():
        try:
            return await _run(coord, f"feed-{fed}", prompt, mode="auto", max_tokens=12)
        finally:
            await coord.close()

    chunks = aio.run(run())
    assert opens == [(fed, int(fed))]
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
            coord.costs = _coordinator(pipeline, CHEAP_SLIM).costs  # the slim tier nearly free: via pays
            coord.estimates.via_tokens, coord.estimates.via_escalation = 3.0, 0.1
            lossless = await _run(coord, "lossless", PROMPTS[1], mode="auto")
            lossy = await _run(coord, "lossy", PROMPTS[1], mode="auto", auto_lossy=True)
            return ar, state, lossless, lossy
        finally:
            await coord.close()

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
    from viasd.actors.verifier import _plan_mode
    from viasd.config import Mode
    from viasd.errors import InvalidParameterError

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
