"""Reliability on tiny models through real Ray actors and real gRPC: faults, cancellation at scale,
bad input (property-based), graceful drain, load, admission, and the security limits.

One pipeline for the module (tiny float32 LLaMA pair with a character-level tokenizer and chat
template, so that text prompts and chat messages go through real tokenization), supervised the
way the standalone server supervises it (`Pipeline.supervise`, wired to the health service).
Every step runs under a timeout; nothing asserts on a duration. The long versions (100 cancel
cycles, 32 streams for minutes, thousands of fuzz cases) are `tests/reliability_load.py` and
`VIASD_FUZZ_EXAMPLES`; docs/RELIABILITY.md has the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
from conftest import drafter_from, process_alive, save_tiny_pair, served_http, tiny_model
from test_pipeline import collect

from viasd.config import EngineConfig, parse_params
from viasd.v1 import generation_pb2 as pb
from viasd.v1 import generation_pb2_grpc
from viasd.v1.convert import params_to_proto, stats_from_proto

TIMEOUT_S = 120
REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 3, 88, 41, 9], [60] * 12, [7, 8, 9, 10, 11], [30, 31, 40, 41, 50, 51, 60]]
LONG = 400  # tokens: long enough to still be running when a fault is injected between two cycles


def char_tokenizer():
    """A character-level tokenizer over the tiny models' 96 ids: <unk>, <s>, </s> (eos, id 2) and
    the printable ASCII characters 32..124; a chat template that writes `role: content` lines."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): 3 + i for i, c in enumerate(range(32, 125))}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    return tok


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory) -> EngineConfig:
    return save_tiny_pair(tmp_path_factory.mktemp("reliability-models"), tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def llm(engine_config):
    from viasd.llm import LLM

    return LLM(engine_config)


@pytest.fixture(scope="module")
def pipeline(ray_session, aio, engine_config):
    from viasd.cluster.pipeline import Pipeline, PipelineConfig

    config = PipelineConfig(
        name="tiny",
        engine=engine_config,
        drafter_cpus=0.5,
        verifier_cpus_per_rank=0.5,
        rpc_timeout_s=30,
        health_check_period_s=2.0,
    )
    p = aio.run(Pipeline.start(config))
    yield p
    aio.run(p.shutdown())


@pytest.fixture(scope="module")
def server(aio, pipeline):
    """The public GenerationService over the pipeline, supervised like the standalone server."""
    with _supervised_server(aio, pipeline, "tiny") as served:
        yield served


@contextlib.contextmanager
def _supervised_server(aio, pipeline, name: str):
    """GenerationService over `pipeline` on a free port, its health following the pipeline's
    supervisor (as the standalone server runs it): (servicer, server, stub, channel)."""
    from viasd.cluster.grpc_api import GenerationServicer
    from viasd.cluster.standalone import serve_grpc, set_health

    servicer = GenerationServicer({name: pipeline}, default=name)
    srv = aio.run(serve_grpc(servicer, 0))

    async def start():
        supervisor = asyncio.ensure_future(pipeline.supervise(lambda ok: set_health(srv.viasd_health, ok)))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.viasd_port}")
        return supervisor, channel, generation_pb2_grpc.GenerationServiceStub(channel)

    supervisor, channel, stub = aio.run(start())
    try:
        yield servicer, srv, stub, channel
    finally:
        aio.loop.call_soon_threadsafe(supervisor.cancel)
        aio.run(channel.close())
        aio.run(srv.stop(grace=1))


def request(prompt, request_id: str = "", max_tokens: int = 24, **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=pb.TokenIds(ids=prompt),
        params=params_to_proto(parse_params(max_tokens=max_tokens, **params)),
    )


def reference(llm, prompt, max_tokens: int = 24, **params):
    """The in-process run of the same request (the served one must equal it token for token)."""
    return llm.complete(prompt, parse_params(max_tokens=max_tokens, **params))


def counts(aio, pipeline) -> dict:
    return aio.run(pipeline.session_counts())


def wait_until(what, predicate, timeout: float = TIMEOUT_S, step: float = 0.1):
    """Poll `predicate` until it holds; fail naming `what` after `timeout` (a bound, not an assertion on speed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(step)
    raise AssertionError(f"not reached within {timeout}s: {what}")


def assert_idle(aio, pipeline, servicer=None):
    """No request left anywhere: coordinator, drafter, every verifier rank (and the servicer's slots)."""
    wait_until(
        "all sessions closed",
        lambda: (
            counts(aio, pipeline) == {"drafter": 0, "verifier": [0] * len(pipeline.ranks)}
            and pipeline.coordinator.active_requests() == 0
        ),
        timeout=30,
    )
    if servicer is not None:
        wait_until("no request in flight in the servicer", lambda: servicer.in_flight() == 0, timeout=30)


async def rest(gen) -> list:
    return [c async for c in gen]


async def read_all(call) -> list:
    """The remaining responses of a gRPC stream already read with `read()`."""
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r)
    return out


def rss(pids) -> int:
    return sum(psutil.Process(pid).memory_info().rss for pid in pids)


# ------------------------------------------------------------------ faults


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_killed_drafter_finishes_requests_as_ar_and_is_restarted(aio, server, pipeline, llm, how):
    """Three requests stand between two cycles when the drafter process dies: each finishes as
    `ar` (greedy sd == greedy ar, so each must equal its own prompt's ar output: no request gets
    another's tokens), its stats say drafter_fallback; the supervisor starts a new drafter and
    the next request drafts again. An `ar` request opened before the replacement and resumed
    after it still finishes on the verifier connection it was opened on."""
    import ray

    servicer = server[0]
    before, old_pid = pipeline.rebuilds["drafter"], pipeline.drafter_info["pid"]

    async def run():
        gens = [
            pipeline.coordinator.generate(
                f"dk-{how}-{i}", PROMPTS[i], parse_params(mode="sd", gamma=3, max_tokens=40, ignore_eos=True)
            )
            for i in range(3)
        ]
        firsts = [await g.__anext__() for g in gens]  # one drafted cycle each; now paused
        bystander = pipeline.coordinator.generate(f"dk-{how}-ar", PROMPTS[3], parse_params(mode="ar", max_tokens=40))
        firsts.append(await bystander.__anext__())
        assert await pipeline.session_counts() == {"drafter": 3, "verifier": [4]}
        if how == "ray.kill":
            ray.kill(pipeline.drafter)
        else:
            os.kill(old_pid, signal.SIGKILL)
        rests = await asyncio.gather(*(rest(g) for g in gens))
        while pipeline.rebuilds["drafter"] == before:  # the coordinator now points at a new drafter
            await asyncio.sleep(0.1)
        rests.append(await rest(bystander))
        return [[f, *r] for f, r in zip(firsts, rests)]

    runs = aio.run(run())
    tokens = [t for c in runs.pop() for t in c.token_ids]
    assert tokens == reference(llm, PROMPTS[3], mode="ar", max_tokens=40).token_ids
    outputs = []
    for i, chunks in enumerate(runs):
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == reference(llm, PROMPTS[i], mode="ar", max_tokens=40, ignore_eos=True).token_ids, i
        stats = chunks[-1].stats
        assert stats.drafter_fallback and stats.num_drafts >= 1 and chunks[-1].finish_reason == "length"
        outputs.append(tuple(tokens))
    assert len(set(outputs)) == 3  # three different outputs: a mix-up could not go unnoticed
    wait_until("a new drafter", lambda: pipeline.rebuilds["drafter"] == before + 1)
    assert pipeline.drafter_info["pid"] != old_pid
    assert os.getpriority(os.PRIO_PROCESS, pipeline.drafter_info["pid"]) == 0  # rebuilt as it was built
    tokens, responses = aio.run(collect(server[2], request(PROMPTS[1], mode="sd", gamma=3)))
    stats = stats_from_proto(responses[-1].stats)
    assert not stats.drafter_fallback and stats.num_drafts > 0  # drafting again, on the new actor
    assert tokens == reference(llm, PROMPTS[1], mode="sd", gamma=3).token_ids
    assert_idle(aio, pipeline, servicer)


def test_killed_verifier_fails_in_flight_requests_and_the_group_is_rebuilt(aio, server, pipeline, llm):
    """A request between two cycles when the verifier rank dies fails with UNAVAILABLE (not a
    hang); health goes NOT_SERVING while the group is rebuilt, then SERVING; the next request is
    served by the new group and equals the in-process run."""
    servicer, _, stub, channel = server
    _kill_a_verifier_rank_mid_requests(aio, pipeline, servicer, stub, channel, llm, rank=0)


@pytest.fixture
def tp2_server(ray_session, aio, engine_config):
    """A second pipeline whose verifier is a TP=2 group (torch backend, gloo), served and supervised
    like `server`; shut down after the test."""
    from viasd.cluster.pipeline import Pipeline, PipelineConfig

    config = PipelineConfig(
        name="tiny-tp2",
        engine=engine_config,
        tp_size=2,
        drafter_cpus=0.5,
        verifier_cpus_per_rank=0.5,
        rpc_timeout_s=30,
        health_check_period_s=2.0,
    )
    pipeline = aio.run(Pipeline.start(config), timeout=300)
    with _supervised_server(aio, pipeline, "tiny-tp2") as (servicer, _, stub, channel):
        yield pipeline, servicer, stub, channel
    aio.run(pipeline.shutdown())


def test_killed_follower_rank_of_a_tp2_group_fails_in_flight_requests_and_the_group_is_rebuilt(aio, tp2_server, llm):
    """SIGKILL of rank 1 (a follower: it serves nothing itself, rank 0 drives it in lockstep) of a
    TP=2 verifier in the middle of requests: they fail with UNAVAILABLE, rank 0 does not stay
    stuck in a collective with the dead peer (its old process is gone, the new group serves),
    health goes NOT_SERVING then SERVING, and a later request equals the in-process engine."""
    pipeline, servicer, stub, channel = tp2_server
    assert pipeline.info()["tensor_parallel_size"] == 2 and len(pipeline.verifier_info["rank_pids"]) == 2
    _kill_a_verifier_rank_mid_requests(aio, pipeline, servicer, stub, channel, llm, rank=1)


def _kill_a_verifier_rank_mid_requests(aio, pipeline, servicer, stub, channel, llm, rank: int) -> None:
    """SIGKILL verifier rank `rank` while two requests stream; check what the public API answers,
    the health stream, the rebuild, that no old rank survives and that later requests are right."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from viasd.cluster.grpc_api import status_of

    before, old_pids = pipeline.rebuilds["verifier"], list(pipeline.verifier_info["rank_pids"])
    old_pid, old_procs = old_pids[rank], [psutil.Process(p) for p in old_pids]
    statuses: list[int] = []

    async def run():
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service="viasd.v1.GenerationService"), timeout=TIMEOUT_S)

        async def watcher():
            async for r in watch:
                statuses.append(r.status)
                if (
                    health_pb2.HealthCheckResponse.NOT_SERVING in statuses
                    and r.status == health_pb2.HealthCheckResponse.SERVING
                ):
                    return

        watching = asyncio.ensure_future(watcher())
        gens = [
            pipeline.coordinator.generate(f"vk-{i}", PROMPTS[i], parse_params(mode=m, max_tokens=LONG, ignore_eos=True))
            for i, m in enumerate(("ar", "sd"))
        ]
        for g in gens:
            await g.__anext__()
        while not statuses:  # the Watch stream has reported the state before the fault
            await asyncio.sleep(0.01)
        os.kill(old_pid, signal.SIGKILL)
        errors = []
        for g in gens:
            try:
                async for _ in g:
                    pass
            except Exception as exc:  # noqa: BLE001 - what the public API would answer
                errors.append(exc)
        await asyncio.wait_for(watching, TIMEOUT_S)
        return errors

    errors = aio.run(run(), timeout=TIMEOUT_S + 30)
    assert len(errors) == 2 and all(status_of(e)[0] == grpc.StatusCode.UNAVAILABLE for e in errors), errors
    S = health_pb2.HealthCheckResponse
    assert statuses[0] == S.SERVING and S.NOT_SERVING in statuses and statuses[-1] == S.SERVING, statuses
    assert pipeline.rebuilds["verifier"] == before + 1
    new_pids = pipeline.verifier_info["rank_pids"]
    assert len(new_pids) == len(old_pids) and not set(new_pids) & set(old_pids), (old_pids, new_pids)
    wait_until("every rank of the old group gone", lambda: not any(process_alive(p) for p in old_procs), timeout=60)
    for case in (dict(mode="ar"), dict(mode="via", gamma=4, alpha1=0.9, alpha2=0.7, temperature=1.0, seed=3)):
        tokens, _ = aio.run(collect(stub, request(PROMPTS[0], **case)))
        assert tokens == reference(llm, PROMPTS[0], **case).token_ids, case
    assert_idle(aio, pipeline, servicer)


# ------------------------------------------------------------------ cancellation at scale

CANCEL_CYCLES = int(os.environ.get("VIASD_CANCEL_CYCLES", "20"))
RSS_TOLERANCE_MB = 48  # per run, over all processes of the pipeline (allocator noise on 2 cores ~ 10-20 MB)


async def cancel_cycle(stub, i: int) -> list:
    """Start a long sampled request, read 0-2 responses, cancel it; returns what the server sent
    before the cancel (GenerateResponse messages, or grpc.aio.EOF if its stream had ended)."""
    mode = ("sd", "via", "ar")[i % 3]
    req = request(
        PROMPTS[i % len(PROMPTS)],
        request_id=f"cancel-{i}",
        mode=mode,
        max_tokens=LONG,
        ignore_eos=True,
        temperature=1.0,
        seed=i,
    )
    call = stub.Generate(req, timeout=TIMEOUT_S)
    got = []
    for _ in range(i % 3):  # 0: cancelled before any token (while opening), 1-2: mid-stream
        got.append(await call.read())
    call.cancel()
    return got


def test_reusing_the_id_of_a_cancelled_request(aio, server, pipeline):
    """A request id reused at once after its request was cancelled: the new request is served, or
    refused as INVALID_ARGUMENT on `request_id` while the old one still closes; never INTERNAL
    (it used to meet the old session still open on the verifier)."""
    servicer, _, stub, _ = server

    async def run():
        answers = []
        for i in range(8):
            while pipeline.coordinator.active_requests() or servicer.in_flight():  # the previous round is over
                await asyncio.sleep(0.01)
            first = stub.Generate(
                request(PROMPTS[0], request_id="reused", mode="sd", max_tokens=LONG, ignore_eos=True), timeout=60
            )
            for _ in range(i % 2):
                await first.read()
            first.cancel()
            answers.append(
                await _answer(
                    lambda: stub.Generate(
                        request(PROMPTS[1], request_id="reused", mode="ar", max_tokens=4), timeout=60
                    ),
                    max_reads=10,
                )
            )
        return answers

    for kind, got in aio.run(run()):
        field = _check_answer(kind, got, "reused")
        assert field in (None, "request_id"), got
    assert_idle(aio, pipeline, servicer)


def test_cancel_cycles_free_every_session_and_memory(aio, server, pipeline):
    """N cancel cycles (before, during and after the Open calls, mid-stream): afterwards no request
    is live in the coordinator, no session on the drafter or the verifier, no call in the servicer,
    and the resident memory of the actor processes and of this process (coordinator + server) is
    back within RSS_TOLERANCE_MB of its level after a warm-up."""
    servicer, _, stub, _ = server

    def pids():
        return [pipeline.drafter_info["pid"], pipeline.verifier_info["pid"], os.getpid()]

    async def cycles(n, offset):
        return [await cancel_cycle(stub, offset + i) for i in range(n)]

    aio.run(cycles(6, 10_000))  # warm-up: allocator pools, gRPC buffers
    assert_idle(aio, pipeline, servicer)
    gc.collect()
    baseline = rss(pids())
    opened = pipeline.executor.totals.requests
    sent = aio.run(cycles(CANCEL_CYCLES, 0), timeout=TIMEOUT_S + 5 * CANCEL_CYCLES)
    # what the server did: every cycle that read was streamed tokens of a request still running
    # (no EOF, no finish reason) when it was cancelled, and each of those reached the coordinator
    mid_stream = [got for got in sent if got]
    assert len(mid_stream) == sum(1 for i in range(CANCEL_CYCLES) if i % 3), sent
    for got in mid_stream:
        assert all(r is not grpc.aio.EOF and r.token_ids and not r.finish_reason for r in got), got
    assert pipeline.executor.totals.requests - opened >= len(mid_stream)
    assert_idle(aio, pipeline, servicer)
    gc.collect()
    after = rss(pids())
    print(f"\n{CANCEL_CYCLES} cancel cycles: RSS {baseline / 2**20:.1f} -> {after / 2**20:.1f} MB")
    assert after - baseline < RSS_TOLERANCE_MB * 2**20, (baseline, after)


def test_model_actors_run_at_normal_priority_where_ray_workers_run_at_15(pipeline):
    """The drafter and the verifier ranks run at niceness 0 (cluster.pipeline.MODEL_ACTOR_ENV),
    while an actor started with Ray's defaults runs at its worker_niceness, 15, below every Ray
    daemon of the node (docs/SERVING.md, "Model actors at normal priority")."""
    import ray

    @ray.remote(num_cpus=0)
    class Plain:
        def niceness(self) -> int:
            return os.getpriority(os.PRIO_PROCESS, 0)

    plain = Plain.remote()
    try:
        assert ray.get(plain.niceness.remote(), timeout=60) == 15
    finally:
        ray.kill(plain)
    ranks = pipeline.verifier_info.get("rank_pids") or [pipeline.verifier_info["pid"]]
    for pid in [pipeline.drafter_info["pid"], *ranks]:
        assert os.getpriority(os.PRIO_PROCESS, pid) == 0, pid


# ------------------------------------------------------------------ bad input, property-based

FUZZ_EXAMPLES = int(os.environ.get("VIASD_FUZZ_EXAMPLES", "150"))
_FIELDS = {
    "request_id",
    "model",
    "prompt",
    "messages",
    "messages.content",
    "messages.role",
    "request",
    "mode",
    "region_b",
    "rule",
    "proposer",
    *(f.name for f in pb.GenerationParams.DESCRIPTOR.fields),
}


def _strategies():
    from hypothesis import strategies as st

    i32 = st.one_of(st.integers(-3, 40), st.integers(-(2**31), 2**31 - 1))
    u32 = st.integers(0, 2**32 - 1)
    real = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]))
    optional = {
        "max_tokens": i32,
        "top_k": i32,
        "gamma": i32,
        "seed": st.integers(0, 2**64 - 1),
        "temperature": real,
        "top_p": real,
        "min_p": real,
        "alpha1": real,
        "alpha2": real,
        "lossy_alpha": real,
        "lossy_beta": real,
        "overshoot_ceiling": real,
        "slim_bonus": st.booleans(),
        "ignore_eos": st.booleans(),
        "mode": st.integers(0, 6),
        "region_b": st.integers(0, 4),
        "rule": st.integers(0, 5),
        "stop_token_ids": st.lists(st.one_of(st.integers(0, 120), u32), max_size=4),
        "proposer": st.integers(0, 5),
        "ngram_max": i32,
        "draft_confidence": real,
        "adaptive_gamma": st.booleans(),
        "overlap": st.booleans(),
    }
    params = st.fixed_dictionaries({}, optional=optional).map(lambda d: pb.GenerationParams(**d))
    text = st.text(max_size=40)
    tokens = st.one_of(
        st.lists(st.integers(0, 110), max_size=16),
        st.lists(u32, max_size=4),
        st.integers(500, 520).map(lambda n: [7] * n),
    )
    messages = st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", ""]) | text, text), max_size=3)
    inputs = st.one_of(
        st.none(),
        text.map(lambda t: {"prompt": t}),
        st.integers(500, 520).map(lambda n: {"prompt": "x" * n}),  # past the context of 512
        messages.map(
            lambda ms: {"messages": pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in ms])}
        ),
        tokens.map(lambda ids: {"prompt_token_ids": pb.TokenIds(ids=ids)}),
    )
    return st.builds(
        lambda rid, model, inp, p: pb.GenerateRequest(request_id=rid, model=model, params=p, **(inp or {})),
        st.one_of(st.just(""), text, st.just("r" * 300)),
        st.one_of(st.just(""), st.just("tiny"), text),
        inputs,
        st.one_of(st.none(), params),
    )


async def _answer(call_factory, max_reads: int = 3):
    """('ok', responses) after up to `max_reads` responses (then cancelled), or ('error', AioRpcError)."""
    call = call_factory()
    responses = []
    try:
        for _ in range(max_reads):
            r = await call.read()
            if r is grpc.aio.EOF:
                break
            responses.append(r)
    except grpc.aio.AioRpcError as exc:
        return "error", exc
    finally:
        call.cancel()
    return "ok", responses


def _check_answer(kind, got, request_id: str | None = None):
    """Either a valid stream or INVALID_ARGUMENT naming a request field (in details and metadata)."""
    if kind == "error":
        assert got.code() == grpc.StatusCode.INVALID_ARGUMENT, (got.code(), got.details())
        field = got.details().split(":", 1)[0]
        assert field in _FIELDS, got.details()
        assert ("viasd-invalid-field", field) in tuple(got.trailing_metadata() or ()), got.trailing_metadata()
        return field
    assert got, "a stream without any response"
    for r in got:
        assert all(0 <= t < 96 for t in r.token_ids)
        assert r.request_id and (not request_id or r.request_id == request_id)
        assert r.finish_reason in (pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    return None


def test_fuzz_generate_requests(aio, server, pipeline, llm):
    """Property: every GenerateRequest, valid or not, gets a valid stream or INVALID_ARGUMENT naming a
    field; nothing crashes, nothing leaks, and the server serves a normal request correctly afterwards."""
    from hypothesis import HealthCheck, given, settings

    servicer, _, stub, _ = server
    seen = {"ok": 0, "error": 0}

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_strategies())
    def check(req):
        kind, got = aio.run(_answer(lambda: stub.Generate(req, timeout=60)))
        seen[kind] += 1
        _check_answer(kind, got, req.request_id or None)

    check()
    print(f"\nfuzz: {sum(seen.values())} requests, {seen['ok']} streams, {seen['error']} INVALID_ARGUMENT")
    assert seen["ok"] and seen["error"]  # the strategy reaches both sides
    assert_idle(aio, pipeline, servicer)
    tokens, _ = aio.run(collect(stub, request(PROMPTS[0], mode="sd", gamma=3)))
    assert tokens == reference(llm, PROMPTS[0], mode="sd", gamma=3).token_ids


def test_fuzz_raw_bytes(aio, server, pipeline):
    """Property: arbitrary bytes, and valid messages with bytes flipped, as a Generate request: a
    valid stream or INVALID_ARGUMENT naming a field (never UNKNOWN / INTERNAL)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    servicer, _, _, channel = server
    raw = channel.unary_stream(
        "/viasd.v1.GenerationService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    valid = request(PROMPTS[0], request_id="b", mode="sd").SerializeToString()
    mutated = st.lists(st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)), min_size=1, max_size=4).map(
        lambda flips: bytes(_flip(valid, flips))
    )

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.one_of(st.binary(max_size=64), mutated))
    def check(data):
        kind, got = aio.run(_answer(lambda: raw(data, timeout=60)))
        _check_answer(kind, got)

    check()
    assert_idle(aio, pipeline, servicer)


def _flip(data: bytes, flips) -> bytearray:
    out = bytearray(data)
    for i, b in flips:
        out[i] = b
    return out


@pytest.mark.parametrize(
    "data, field",
    [
        (b"", "prompt"),  # the empty message: no input at all
        (b"\x1a\x03\xff\xfe\xfd", "prompt"),  # field 3 (prompt), malformed UTF-8
        (b"\x12\x02\xc3\x28\x1a\x01a", "model"),
        (b"\x0a\x01\xff\x1a\x01a", "request_id"),
        (b"\x22\x07\x0a\x05\x12\x03\xe2\x28\xa1", "messages.content"),  # messages[0].content, malformed UTF-8
        (b"\x22\x00", "messages"),  # messages set, but empty
        (pb.GenerateRequest(prompt="x" * 600).SerializeToString(), "prompt"),  # longer than the context (512)
        (pb.GenerateRequest(prompt="hi", model="gpt-5").SerializeToString(), "model"),
        (pb.GenerateRequest(prompt="hi", params=pb.GenerationParams(mode=7)).SerializeToString(), "mode"),
        (
            pb.GenerateRequest(prompt="hi", params=pb.GenerationParams(max_tokens=2**31 - 1)).SerializeToString(),
            "max_tokens",
        ),
        (pb.GenerateRequest(prompt="hi", params=pb.GenerationParams(seed=2**64 - 1)).SerializeToString(), "seed"),
        (
            pb.GenerateRequest(prompt="hi", params=pb.GenerationParams(temperature=float("nan"))).SerializeToString(),
            "temperature",
        ),
        (
            pb.GenerateRequest(prompt="hi", params=pb.GenerationParams(temperature=1e-300)).SerializeToString(),
            "temperature",
        ),  # (overflowed float32 into NaN probabilities: INTERNAL before it was refused)
        (
            pb.GenerateRequest(prompt="hi", params=pb.GenerationParams(stop_token_ids=[2] * 2000)).SerializeToString(),
            "stop_token_ids",
        ),
        (pb.GenerateRequest(prompt="hi", request_id="r" * 1000).SerializeToString(), "request_id"),
        (b"\xff\xff\xff\xff", "request"),  # not a message at all
    ],
    ids=[
        "empty",
        "utf8-prompt",
        "utf8-model",
        "utf8-request-id",
        "utf8-messages",
        "no-messages",
        "context",
        "model",
        "mode",
        "max-tokens",
        "seed",
        "nan",
        "tiny-temperature",
        "stop-ids",
        "long-id",
        "garbage",
    ],
)
def test_bad_messages_are_invalid_argument_naming_the_field(aio, server, data, field):
    _, _, _, channel = server
    raw = channel.unary_stream(
        "/viasd.v1.GenerationService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    kind, got = aio.run(_answer(lambda: raw(data, timeout=60)))
    assert kind == "error", got
    assert _check_answer(kind, got) == field, got.details()


def test_oversized_message_is_refused_and_the_server_stays_up(aio, server, llm):
    """Past the public 4 MiB limit: RESOURCE_EXHAUSTED from gRPC itself; the next request is served."""
    _, _, stub, _ = server
    big = pb.GenerateRequest(prompt="x" * (5 * 2**20))
    kind, got = aio.run(_answer(lambda: stub.Generate(big, timeout=60)))
    assert kind == "error" and got.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, got
    tokens, _ = aio.run(collect(stub, request(PROMPTS[2], mode="ar")))
    assert tokens == reference(llm, PROMPTS[2], mode="ar").token_ids


def test_text_and_chat_prompts_are_served_and_never_logged(aio, server, llm, caplog):
    """Text and chat prompts go through the tokenizer and equal the in-process run; neither the prompt
    text nor its token ids appear in any log record of this process, even when the request fails."""
    import logging

    _, _, stub, _ = server
    secret = "zq#secret-prompt#qz"
    ids = llm.tokenizer.encode(secret, add_special_tokens=False)
    with caplog.at_level(logging.DEBUG):
        req = pb.GenerateRequest(prompt=secret, params=params_to_proto(parse_params(mode="sd", gamma=3, max_tokens=12)))
        tokens, responses = aio.run(collect(stub, req))
        assert tokens == reference(llm, ids, mode="sd", gamma=3, max_tokens=12).token_ids
        assert "".join(r.text for r in responses) == llm.tokenizer.decode(tokens)
        chat = pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=secret)]),
            params=params_to_proto(parse_params(mode="via", max_tokens=8)),
        )
        assert aio.run(collect(stub, chat))[0]
        bad = pb.GenerateRequest(prompt=secret * 40)  # too long: refused
        kind, got = aio.run(_answer(lambda: stub.Generate(bad, timeout=60)))
        assert kind == "error"
    text = "\n".join(r.getMessage() + str(r.exc_info or "") for r in caplog.records)
    assert secret not in text and str(ids)[1:-1] not in text


# ------------------------------------------------------------------ admission and drain (in-process)


@pytest.fixture
def own_server(aio, pipeline):
    """A second GenerationService over the same pipeline, with its own admission and drain state."""
    from viasd.cluster.grpc_api import GenerationServicer
    from viasd.cluster.handler import Admission
    from viasd.cluster.standalone import serve_grpc

    made = []

    def make(max_running: int = 4, max_waiting: int = 4):
        servicer = GenerationServicer({"tiny": pipeline}, "tiny", admission=Admission(max_running, max_waiting))
        srv = aio.run(serve_grpc(servicer, 0))

        async def connect():
            return grpc.aio.insecure_channel(f"127.0.0.1:{srv.viasd_port}")

        channel = aio.run(connect())
        made.append((srv, channel))
        return servicer, generation_pb2_grpc.GenerationServiceStub(channel)

    yield make
    for srv, channel in made:
        aio.run(channel.close())
        aio.run(srv.stop(grace=1))


def test_past_the_queue_limit_grpc_is_resource_exhausted(aio, own_server, pipeline, llm):
    """One decoding slot, no queue: while it is taken, a Generate call is refused with
    RESOURCE_EXHAUSTED (naming the limits) instead of waiting; once free, the call is served."""
    servicer, stub = own_server(max_running=1, max_waiting=0)
    aio.run(servicer.admission.enter())  # the slot is taken (as by a running request)
    kind, got = aio.run(_answer(lambda: stub.Generate(request(PROMPTS[0], mode="ar"), timeout=60)))
    assert kind == "error" and got.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, got
    assert "max_queued_requests=0" in got.details()
    servicer.admission.leave()
    tokens, _ = aio.run(collect(stub, request(PROMPTS[0], mode="ar")))
    assert tokens == reference(llm, PROMPTS[0], mode="ar").token_ids
    assert (servicer.admission.running, servicer.admission.waiting, servicer.in_flight()) == (0, 0, 0)


def test_queue_time_is_in_the_stats_and_the_metric(aio, own_server, pipeline, llm):
    """limits.max_concurrent_requests is the batch capacity: with its one slot taken, a request
    waits in the queue; its final stats report the wait (queue_seconds), and a replica's
    admission observes it in viasd_request_queue_time_seconds."""
    from viasd.cluster.serving_metrics import ServingMetrics, parse_exposition, total

    servicer, stub = own_server(max_running=1, max_waiting=2)
    wait_s = 0.5

    async def queued_request():
        await servicer.admission.enter()  # the slot is taken (as by a running request)
        call = asyncio.ensure_future(collect(stub, request(PROMPTS[0], mode="ar")))
        await asyncio.sleep(wait_s)
        assert servicer.admission.waiting == 1 and not call.done()
        servicer.admission.leave()
        return await call

    tokens, responses = aio.run(queued_request())
    assert tokens == reference(llm, PROMPTS[0], mode="ar").token_ids
    assert wait_s * 0.8 <= responses[-1].stats.queue_seconds < wait_s + 30

    metrics = ServingMetrics("m")
    timer = metrics.timer()  # a request arrives, waits, is admitted
    time.sleep(0.2)
    timer.admitted()
    samples = parse_exposition(metrics.exposition()[0].decode())
    assert total(samples, "viasd_request_queue_time_seconds_count") == 1
    assert total(samples, "viasd_request_queue_time_seconds_sum") >= 0.15


def test_drain_lets_requests_finish_then_aborts_the_rest(aio, own_server, pipeline, llm):
    """Draining: a request in flight that ends within the drain timeout ends normally; new calls are
    UNAVAILABLE; with the timeout spent, a request still running (and one waiting for admission)
    ends with a last message of finish reason `abort`, and its sessions are closed."""
    servicer, stub = own_server()

    async def finish_within():
        call = stub.Generate(request(PROMPTS[1], mode="sd", gamma=3, max_tokens=12), timeout=60)
        first = await call.read()
        drained = asyncio.ensure_future(servicer.calls.drain(60.0))
        await asyncio.sleep(0)
        refused = await _answer(lambda: stub.Generate(request(PROMPTS[0]), timeout=60))
        rest = await read_all(call)
        return [first, *rest], refused, await drained

    responses, (kind, got), aborted = aio.run(finish_within())
    assert kind == "error" and got.code() == grpc.StatusCode.UNAVAILABLE, got
    assert aborted == 0 and responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [t for r in responses for t in r.token_ids] == reference(
        llm, PROMPTS[1], mode="sd", gamma=3, max_tokens=12
    ).token_ids

    servicer, stub = own_server(max_running=1, max_waiting=1)

    async def abort_the_rest():
        running = stub.Generate(
            request(PROMPTS[0], request_id="long", mode="via", max_tokens=LONG, ignore_eos=True), timeout=60
        )
        first = await running.read()
        waiting = stub.Generate(request(PROMPTS[2], request_id="queued", mode="ar"), timeout=60)
        while servicer.admission.waiting == 0:  # the second call waits for the one slot
            await asyncio.sleep(0.01)
        aborted = await servicer.calls.drain(0.0)
        return [first, *await read_all(running)], await read_all(waiting), aborted

    long, queued, aborted = aio.run(abort_the_rest())
    assert aborted == 2
    assert long[-1].finish_reason == pb.FINISH_REASON_ABORT and long[-1].request_id == "long"
    assert 0 < sum(len(r.token_ids) for r in long) < LONG
    assert [(r.request_id, r.finish_reason) for r in queued] == [("queued", pb.FINISH_REASON_ABORT)]
    assert_idle(aio, pipeline, servicer)
    assert (servicer.admission.running, servicer.admission.waiting) == (0, 0)


# ------------------------------------------------------------------ graceful drain of the standalone server


def test_sigterm_drains_the_standalone_server(tmp_path, llm):
    """`python -m viasd.cluster.standalone --http-port 0` under SIGTERM: health turns NOT_SERVING
    and new calls are refused, a short request in flight finishes, a long one on gRPC and one on
    HTTP are ended with finish reason `abort` once --drain-timeout-s is spent, the process exits 0
    and leaves no child process."""
    import threading

    import torch
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # a model with a long context, so that the long request surely outlives the drain timeout
    verifier = tiny_model("llama", dtype=torch.float32)
    verifier.config.max_position_embeddings = 8192
    drafter = drafter_from(verifier)
    for name, model in (("verifier", verifier), ("drafter", drafter)):
        model.save_pretrained(tmp_path / name)
    config = {
        "name": "tiny",
        "engine": {
            "verifier": str(tmp_path / "verifier"),
            "drafter": str(tmp_path / "drafter"),
            "dtype": "float32",
            "threads": 1,
        },
        "drafter_cpus": 0.5,
        "verifier_cpus_per_rank": 0.5,
        "rpc_timeout_s": 30,
    }
    (tmp_path / "pipeline.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    stderr = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "viasd.cluster.standalone",
            "--config",
            str(tmp_path / "pipeline.json"),
            "--port",
            "0",
            "--http-port",
            "0",
            "--drain-timeout-s",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_until(
            "the server is up",
            lambda: any(x.startswith("serving on ") for x in lines) or proc.poll() is not None,
            timeout=240,
        )
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        address = next(x for x in lines if x.startswith("serving on ")).split()[-1]
        wait_until("the HTTP API is up", lambda: any(x.startswith("http on ") for x in lines), timeout=30)
        http_base = "http://" + next(x for x in lines if x.startswith("http on ")).split()[-1]
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # Ray's processes and the actors
        http_events: list[str] = []
        http_started = threading.Event()

        def http_stream():  # a long stream on the HTTP API: drained like the gRPC one
            import requests

            body = {
                "prompt": [5, 6, 7],
                "max_tokens": 6000,
                "ignore_eos": True,
                "mode": "ar",
                "stream": True,
                "return_token_ids": True,
            }
            with requests.post(http_base + "/v1/completions", json=body, stream=True, timeout=TIMEOUT_S) as r:
                for line in r.iter_lines():
                    if line:
                        http_events.append(line.decode())
                        http_started.set()
            http_started.set()

        http_thread = threading.Thread(target=http_stream)
        http_thread.start()
        assert http_started.wait(TIMEOUT_S)

        async def scenario():
            async with grpc.aio.insecure_channel(address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                long = stub.Generate(
                    request([5, 6, 7], request_id="long", mode="ar", max_tokens=6000, ignore_eos=True),
                    timeout=TIMEOUT_S,
                )
                short = stub.Generate(
                    request([8, 9], request_id="short", mode="sd", gamma=3, max_tokens=8, ignore_eos=True),
                    timeout=TIMEOUT_S,
                )
                first_long, first_short = await long.read(), await short.read()
                proc.send_signal(signal.SIGTERM)
                while (
                    await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                ).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                    await asyncio.sleep(0.05)
                refused = await _answer(lambda: stub.Generate(request([5]), timeout=30))
                return [first_long, *await read_all(long)], [first_short, *await read_all(short)], refused

        long, short, (kind, got) = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT_S))
        http_thread.join(TIMEOUT_S)
        assert kind == "error" and got.code() == grpc.StatusCode.UNAVAILABLE, got
        assert http_events[-1] == "data: [DONE]"
        last = json.loads(http_events[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "abort" and last["viasd_stats"]["stopped_by"] == "drain"
        assert short[-1].finish_reason == pb.FINISH_REASON_LENGTH and sum(len(r.token_ids) for r in short) == 8
        assert long[-1].finish_reason == pb.FINISH_REASON_ABORT and long[-1].request_id == "long"
        n = sum(len(r.token_ids) for r in long)
        assert 0 < n < 6000
        assert [t for r in long for t in r.token_ids] == llm_prefix(tmp_path, [5, 6, 7], n)
        assert proc.wait(timeout=120) == 0, (tmp_path / "server.log").read_text()[-3000:]
        wait_until("no child process left", lambda: not [c for c in children if process_alive(c)], timeout=60)
        log = (tmp_path / "server.log").read_text()
        assert "drained; 2 request(s) aborted" in log, log[-3000:]  # the gRPC stream and the HTTP one
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        stderr.close()


def llm_prefix(models: Path, prompt: list[int], n: int) -> list[int]:
    """The first n greedy `ar` tokens of the in-process engine on the drain test's models."""
    from viasd.llm import LLM

    engine = LLM(EngineConfig(verifier=str(models / "verifier"), drafter=None, dtype="float32", threads=1))
    return engine.complete(prompt, parse_params(mode="ar", max_tokens=n, ignore_eos=True)).token_ids


# ------------------------------------------------------------------ bad input over HTTP (OpenAI API), property-based


@pytest.fixture(scope="module")
def http_base(aio, pipeline):
    """The OpenAI-compatible app over the pipeline, on uvicorn on a free loopback port."""
    from viasd.cluster.handler import RequestHandler
    from viasd.cluster.serving_metrics import ServingMetrics

    handler = RequestHandler(
        pipeline,
        "tiny",
        metrics=ServingMetrics("tiny", enabled=False),
        max_concurrent_requests=4,
        max_queued_requests=16,
    )
    with served_http(aio, handler) as base:
        yield base, handler


async def _post(base: str, path: str, data: bytes) -> tuple[int, object]:
    """(status, parsed body or first SSE event); a stream is closed after its first event."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(
            base + path,
            data=data,
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=60),
        ) as resp:
            if resp.content_type == "text/event-stream":
                line = b""
                while not line.strip():
                    line = await resp.content.readline()
                return resp.status, json.loads(line.decode().removeprefix("data: "))
            return resp.status, await resp.json(content_type=None)


def _json_bodies():
    from hypothesis import strategies as st

    scalar = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-10, 40),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False),
        st.text(max_size=12),
    )
    anything = st.recursive(
        scalar,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=6,
    )
    keys = {
        "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-2, 110), max_size=10), anything),
        "max_tokens": st.one_of(st.integers(1, 8), st.integers(-3, 0), st.integers(2**20 + 1, 2**40), anything),
        "stream": st.one_of(st.just(True), anything),
        "model": st.one_of(st.just("tiny"), anything),
        **{
            k: anything
            for k in (
                "temperature",
                "top_p",
                "seed",
                "stop",
                "n",
                "mode",
                "gamma",
                "alpha1",
                "alpha2",
                "top_k",
                "min_p",
                "stop_token_ids",
                "ignore_eos",
                "return_token_ids",
                "logprobs",
                "echo",
                "stream_options",
                "unknown_field",
            )
        },
    }
    return st.fixed_dictionaries({"prompt": keys.pop("prompt")}, optional=keys)


def test_oversized_http_body_is_413(aio, http_base):
    """A body past 4 MiB is refused (413, OpenAI's error shape, param "body") before it is parsed."""
    base, replica = http_base
    status, body = aio.run(_post(base, "/v1/completions", json.dumps({"prompt": "x" * (5 * 2**20)}).encode()))
    assert status == 413 and body["error"]["param"] == "body", body
    assert (replica.admission.running, replica.admission.waiting) == (0, 0)


def test_fuzz_http_completions(aio, http_base, pipeline, llm):
    """Property: every JSON body (and broken bytes) to /v1/completions gets 200 with a valid stream,
    or 400 / 404 with OpenAI's error object (naming the field when it is one); never a 500 or a
    dropped connection; /health stays ok and a normal request is served afterwards."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    base, replica = http_base
    seen: dict[int, int] = {}

    def check_one(data: bytes):
        status, body = aio.run(_post(base, "/v1/completions", data))
        seen[status] = seen.get(status, 0) + 1
        assert status in (200, 400, 404), (status, body, data[:200])
        if status == 200:
            assert "choices" in body or "error" in body, body
            if "error" in body:  # an error after the stream started: still a named, typed error
                assert body["error"]["code"] in (400, 503), body
        else:
            assert body["error"]["code"] == status and body["error"]["message"], body

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.one_of(
            _json_bodies().map(lambda b: json.dumps(b).encode()),
            st.binary(max_size=40),
            st.just(b'{"prompt": "\xff\xfe"}'),
            st.just(b""),
        )
    )
    def check(data):
        check_one(data)

    check()
    print(f"\nHTTP fuzz: {sum(seen.values())} bodies, by status {dict(sorted(seen.items()))}")
    assert seen.get(200) and seen.get(400)
    assert_idle(aio, pipeline)
    assert (replica.admission.running, replica.admission.waiting) == (0, 0)
    ok, detail = aio.run(replica.health())
    assert ok, detail
    status, body = aio.run(
        _post(
            base,
            "/v1/completions",
            json.dumps({"prompt": PROMPTS[0], "max_tokens": 12, "mode": "sd", "return_token_ids": True}).encode(),
        )
    )
    assert (
        status == 200
        and body["choices"][0]["token_ids"] == reference(llm, PROMPTS[0], mode="sd", max_tokens=12).token_ids
    )


# ------------------------------------------------------------------ load (short version of tests/reliability_load.py)


def _load_script():
    import reliability_load

    return reliability_load


def test_concurrent_streams_lose_nothing(aio, server, pipeline, llm):
    """8 concurrent streams, 6 requests each over 24 different cases (modes, seeds, prompts): every
    stream equals the in-process run of its request (no token lost, duplicated, reordered or taken
    from another request), no error, nothing left open; latency and RSS are recorded."""
    load = _load_script()
    servicer, _, stub, _ = server
    case_list = load.cases(16)
    refs = load.references(llm, case_list)
    pids = {"server": os.getpid(), "drafter": pipeline.drafter_info["pid"], "verifier": pipeline.verifier_info["pid"]}
    result = aio.run(
        load.run_load(stub, case_list, refs, streams=8, requests_per_stream=6, pids=pids), timeout=TIMEOUT_S * 2
    )
    summary = result.summary()
    print(f"\nload: {summary}")
    assert result.errors == {} and result.mismatched == 0, (result.errors, result.examples)
    assert result.requests == 48 and result.tokens == 48 * 16
    assert summary["e2e_p99_s"] is not None and result.rss_mb  # measured
    assert_idle(aio, pipeline, servicer)


# ------------------------------------------------------------------ weights and remote code (no Ray)


def test_only_safetensors_weights_load(tmp_path):
    """A directory with pickled weights only (pytorch_model.bin, which runs code when unpickled) is refused."""
    import torch

    from viasd.errors import ModelLoadError
    from viasd.models.loader import load_causal_lm

    model = tiny_model("llama", layers=2, dtype=torch.float32)
    model.save_pretrained(tmp_path / "pickled")
    for f in (tmp_path / "pickled").glob("*.safetensors"):  # the same weights, pickled instead
        f.unlink()
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_causal_lm(str(tmp_path / "pickled"), dtype="float32")
    model.save_pretrained(tmp_path / "safe")
    assert load_causal_lm(str(tmp_path / "safe"), dtype="float32")[0] is not None


def test_remote_code_runs_only_when_the_operator_allows_it(tmp_path):
    """A model directory whose config points at its own Python code (auto_map): by default the code
    is never imported; with trust_remote_code=True (EngineConfig.trust_remote_code) it is."""
    import torch

    from viasd.config import parse_engine_config
    from viasd.errors import ModelLoadError
    from viasd.models.loader import load_causal_lm

    d = tmp_path / "remote"
    tiny_model("llama", layers=2, dtype=torch.float32).save_pretrained(d)
    marker = tmp_path / "code-ran"
    (d / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    pass\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (d / "config.json").write_text(json.dumps(config))
    assert parse_engine_config().trust_remote_code is False
    try:
        load_causal_lm(str(d), dtype="float32")
    except ModelLoadError:
        pass  # refusing is fine too; running the code is not
    assert not marker.exists()
    try:
        load_causal_lm(str(d), dtype="float32", trust_remote_code=True)
    except ModelLoadError:
        pass
    assert marker.exists()
