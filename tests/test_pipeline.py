"""The distributed pipeline through real Ray actors and real gRPC equals the in-process engine.

Tiny random LLaMA models (float32; the drafter shares the verifier's vocabulary) are saved to
temporary directories without tokenizer files and loaded by every actor through the normal
loader; requests carry token ids. One Ray per test session (conftest.ray_session); one event
loop thread runs every coroutine, with a timeout, so nothing can hang CI.

* ar / sd / via, greedy and sampled with a seed: served tokens, finish reason and counters ==
  `viasd.llm.LLM` in-process (same config, same loader);
* 8 concurrent streams with different seeds each == their sequential in-process run;
* TP=2 (torch backend; DeepSpeed AutoTP too) == TP=1;
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
    "sd-hybrid-adaptive-sampled": dict(mode="sd", gamma=6, proposer="hybrid", ngram_max=2, draft_confidence=0.3,
                                       adaptive_gamma=True, temperature=1.0, seed=14),
    "via-ngram-greedy": dict(VIA, proposer="ngram"),
    # overlap: the drafter actor drafts ahead while the verifier verifies; timing must not matter
    "sd-overlap-sampled": dict(mode="sd", gamma=4, overlap=True, temperature=1.0, seed=15),
    "via-overlap-greedy": dict(VIA, overlap=True),
}
COUNTERS = ("generated_tokens", "num_drafts", "num_draft_tokens", "ngram_draft_tokens", "overlap_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
            "num_rejected_tokens", "num_bonus_tokens", "num_cycle_tokens", "slim_accepted", "slim_rewritten",
            "escalations", "escalated_tokens", "full_accepted", "forwards", "finish_reason")


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

    return PipelineConfig(engine=engine_config, drafter_cpus=0.5, verifier_cpus_per_rank=0.5, rpc_timeout_s=60,
                          check_ranks=True, **kw)


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
    return pb.GenerateRequest(request_id=request_id, model=model, prompt_token_ids=pb.TokenIds(ids=prompt),
                              params=params_to_proto(parse_params(max_tokens=24, **params)))


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
        assert_same_run(tokens, responses, reference(llm, prompt, **CASES[case]), f"{case} {prompt}",
                        overlap=CASES[case].get("overlap", False))
        assert len(responses) > 1  # streamed cycle by cycle


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
    settings = [dict(VIA, temperature=1.0, seed=100 + i) if i % 2 else dict(mode="sd", gamma=3, temperature=0.9,
                                                                            seed=100 + i) for i in range(8)]
    expected = [reference(llm, PROMPTS[i % 2], **s) for i, s in enumerate(settings)]

    async def all_at_once():
        return await asyncio.gather(*(collect(stub, request(PROMPTS[i % 2], request_id=f"c{i}", **s))
                                      for i, s in enumerate(settings)))

    results = aio.run(all_at_once())
    for i, ((tokens, responses), ref) in enumerate(zip(results, expected)):
        assert_same_run(tokens, responses, ref, f"stream {i}")
        assert all(r.request_id == f"c{i}" for r in responses)
    assert len({tuple(r[0]) for r in results}) > 1  # different seeds, different outputs


# ------------------------------------------------------------------ lifecycle


def _counts(aio, pipeline):
    return aio.run(pipeline.session_counts())


def test_cancelled_stream_closes_both_sessions(server, aio, pipeline):
    _, _, stub = server

    async def start_then_cancel():
        params = parse_params(mode="via", max_tokens=400, ignore_eos=True, temperature=1.0, seed=5)
        call = stub.Generate(pb.GenerateRequest(request_id="to-cancel", prompt_token_ids=pb.TokenIds(ids=PROMPTS[0]),
                                                params=params_to_proto(params)))
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


@pytest.mark.parametrize("make, field", [
    (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2]), params=pb.GenerationParams(temperature=-1)),
     "temperature"),
    (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 500])), "prompt"),
    (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])), "prompt"),
    (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1]),
                                params=pb.GenerationParams(alpha1=0.3, alpha2=0.4)), "alpha2"),
    (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1]), params=pb.GenerationParams(gamma=99)), "gamma"),
    (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1]), params=pb.GenerationParams(mode=9)), "mode"),
    (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1]), model="nope"), "model"),
    (lambda: pb.GenerateRequest(), "prompt"),
    (lambda: pb.GenerateRequest(prompt="def f():"), "prompt"),  # these test models have no tokenizer
    (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1] * 600)), "prompt"),  # past the context (512)
], ids=["temperature", "vocab", "empty", "alpha2", "gamma", "mode", "model", "no-input", "text", "context"])
def test_bad_input_is_invalid_argument_naming_the_field(server, aio, pipeline, make, field):
    _, _, stub = server

    async def call():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, make())
        return err.value

    err = aio.run(call())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith(f"{field}:"), err.details()
    assert (("viasd-invalid-field", field) in tuple(err.trailing_metadata())), err.trailing_metadata()
    assert _counts(aio, pipeline) == {"drafter": 0, "verifier": [0]}


def test_list_models_and_health(server, aio):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, srv, stub = server

    async def calls():
        models = await stub.ListModels(pb.ListModelsRequest(), timeout=10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.viasd_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            statuses = [(await health.Check(health_pb2.HealthCheckRequest(service=s), timeout=10)).status
                        for s in ("", "viasd.v1.GenerationService")]
        return models, statuses

    models, statuses = aio.run(calls())
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2
    (m,) = models.models
    assert (m.name, m.num_layers, list(m.skipped_layers), m.tensor_parallel_size, m.max_context, m.default_mode) == (
        "tiny", 6, [1, 3], 1, 512, pb.MODE_VIA)
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
        coord = Coordinator(base.verifier_address, f"127.0.0.1:{port}", vocab_size=base.vocab_size,
                            max_context=base.max_context, eos_token_ids=base.eos_token_ids, rpc_timeout_s=30)
        try:
            chunks = [c async for c in coord.generate("fallback", PROMPTS[0], parse_params(mode="sd", gamma=3,
                                                                                            max_tokens=24))]
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
def test_tp2_pipeline_equals_tp1(ray_session, aio, engine_config, server, pipeline, backend):
    from viasd.cluster.pipeline import Pipeline

    if backend == "deepspeed":
        import deepspeed  # noqa: F401  (a declared dependency: missing is a broken install, not a skip)
    _, _, stub = server
    t0 = time.perf_counter()
    tp2 = aio.run(Pipeline.start(_pipeline_config(engine_config, name=f"tiny-tp2-{backend}", tp_size=2,
                                                  tp_backend=backend)), timeout=240)
    print(f"\nTP=2 ({backend}) pipeline up in {time.perf_counter() - t0:.1f}s")
    try:
        assert tp2.info()["tensor_parallel_size"] == 2
        assert tp2.verifier_info["local_q_proj_rows"] * 2 == pipeline.verifier_info["local_q_proj_rows"]  # sharded
        for case, params in CASES.items():
            tp1_tokens, tp1 = aio.run(collect(stub, request(PROMPTS[0], **params)))

            async def on_tp2():
                return [c async for c in tp2.coordinator.generate(f"tp2-{case}", PROMPTS[0],
                                                                  parse_params(max_tokens=24, **params))]

            chunks = aio.run(on_tp2())
            assert [t for c in chunks for t in c.token_ids] == tp1_tokens, (backend, case)
            tp1_forwards = stats_from_proto(tp1[-1].stats).forwards
            for model in ("full", "slim") if params.get("overlap") else ("drafter", "full", "slim"):
                assert chunks[-1].stats.forwards[model] == tp1_forwards[model], (backend, case, model)
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
            if op == "open":
                args = (*args[:3], args[3] + 1)

            async def run():
                return _comparable(op, await self.core.work.enqueue(seq, getattr(self.core, op), *args))
            return asyncio.ensure_future(run())

    async def run():
        core = VerifierCore(llm.verifier, llm.engine.mask, "separate")
        servicer = VerifierServicer(core, [Follower()], check_ranks=True)
        server, port = await start_server(lambda s: internal_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, s))
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
