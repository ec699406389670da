"""The client SDK (`viasd.client`) and its CLI against a real server: the tiny LLaMA pair through
real Ray actors (the session's Ray, conftest.ray_session), the coordinator and the public
GenerationService on loopback (`serve_grpc`, the same function the standalone server runs),
started in this process so that the suite pays for one pipeline only.

* importing viasd.client (and its CLI) imports neither torch nor Ray (a fresh interpreter);
* bad parameters raise InvalidParameterError naming the field before any network I/O;
* streamed tokens, finish reason and statistics == the in-process `LLM` (sync and asyncio);
* the asyncio client with 16 concurrent streams (one seed each) == their sequential runs;
* closing a stream, breaking out of it or leaving its `with` / `async with` block cancels the
  request on the server: the drafter's and the verifier's sessions drop to 0;
* a deadline expires with DeadlineExceeded; server-side INVALID_ARGUMENT is InvalidArgument
  naming the field;
* retries: UNAVAILABLE before the first token is retried (a server that comes up late, a
  server that refuses the first attempt), never after a token arrived (a server killed or
  failing mid-stream: an error, no duplicate tokens, one call on the server);
* TLS and mutual TLS with certificates made here; a missing or wrong bearer token is
  Unauthenticated while the health service stays open; the security settings of the server;
* the `viasd-client` CLI: generate / chat / models / health, --json, exit codes;
* the standalone server as a real process (`python -m viasd.cluster.standalone`, its own Ray on
  loopback) with TLS and a token file: a client started before it retries until it is up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from contextlib import aclosing
from pathlib import Path

import grpc
import pytest
from certs import make_certificates
from conftest import listen_port, save_tiny_pair

from viasd.client import (
    NO_RETRY,
    AsyncClient,
    Cancelled,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    InvalidParameterError,
    RetryPolicy,
    RPCError,
    TLSConfig,
    Unauthenticated,
    Unavailable,
)
from viasd.config import EngineConfig, parse_params

TIMEOUT_S = 120
PROMPT = [5, 17, 3, 88, 41, 9]
VIA = dict(mode="via", gamma=4, alpha1=0.9, alpha2=0.7)  # thresholds that exercise all three tiers
CASES = {
    "ar-greedy": dict(mode="ar"),
    "sd-sampled": dict(mode="sd", gamma=4, temperature=0.8, top_k=40, seed=12),
    "via-greedy": dict(VIA),
    "via-sampled": dict(VIA, temperature=1.0, seed=13),
}
LONG = dict(mode="ar", max_tokens=500, ignore_eos=True)  # still running when the test acts on it
COUNTERS = (
    "generated_tokens",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_accepted_tokens_per_pos",
    "num_rejected_tokens",
    "num_bonus_tokens",
    "slim_accepted",
    "slim_rewritten",
    "escalations",
    "escalated_tokens",
    "full_accepted",
    "forwards",
    "finish_reason",
)
FAST_RETRY = RetryPolicy(max_attempts=30, initial_backoff_s=0.05, max_backoff_s=0.3)
TOKEN = "s3cret-token"


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory) -> EngineConfig:
    return save_tiny_pair(tmp_path_factory.mktemp("client-models"))


@pytest.fixture(scope="module")
def llm(engine_config):
    from viasd.llm import LLM

    return LLM(engine_config)


@pytest.fixture(scope="module")
def pipeline(ray_session, aio, engine_config):
    from viasd.cluster.pipeline import Pipeline, PipelineConfig

    config = PipelineConfig(
        name="tiny", engine=engine_config, drafter_cpus=0.5, verifier_cpus_per_rank=0.5, rpc_timeout_s=60
    )
    p = aio.run(Pipeline.start(config))
    yield p
    aio.run(p.shutdown())


@pytest.fixture(scope="module")
def servicer(pipeline):
    from viasd.cluster.grpc_api import GenerationServicer

    return GenerationServicer({"tiny": pipeline}, default="tiny")


class Servers:
    """Starts servers on the test loop and stops every one still running at teardown."""

    def __init__(self, aio):
        self.aio = aio
        self.running = []

    def start(self, servicer, port: int = 0, security=None):
        from viasd.cluster.standalone import serve_grpc

        server = self.aio.run(serve_grpc(servicer, port, security=security))
        self.running.append(server)
        return server, f"127.0.0.1:{server.viasd_port}"

    def stop(self, server, grace: float | None = None):
        self.aio.run(server.stop(grace))
        self.running.remove(server)

    def stop_all(self):
        for server in list(self.running):
            self.stop(server)


@pytest.fixture(scope="module")
def servers(aio):
    s = Servers(aio)
    yield s
    s.stop_all()


@pytest.fixture(scope="module")
def target(servers, servicer) -> str:
    """The plaintext GenerationService the tests share."""
    return servers.start(servicer)[1]


@pytest.fixture
def client(target):
    with Client(target, timeout=TIMEOUT_S) as c:
        yield c


def reference(llm, prompt, **params):
    return llm.complete(prompt, parse_params(**{"max_tokens": 24, **params}))


def idle(aio, pipeline, timeout_s: float = 30) -> bool:
    """Wait until no request is open anywhere in the pipeline (sessions and coordinator)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            aio.run(pipeline.session_counts()) == {"drafter": 0, "verifier": [0]}
            and pipeline.coordinator.active_requests() == 0
        ):
            return True
        time.sleep(0.1)
    return False


def open_sessions(aio, pipeline) -> dict:
    return aio.run(pipeline.session_counts())


def retries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "viasd.client" and "retry" in r.getMessage()]


# ------------------------------------------------------------------ light import, validation before I/O


def test_client_imports_neither_torch_nor_ray():
    code = (
        "import sys, viasd.client, viasd.client.console\n"
        "print([m for m in ('torch', 'ray', 'transformers', 'numpy') if m in sys.modules])"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt="x", temperature=-1), "temperature"),
        (dict(prompt="x", gamma=99), "gamma"),
        (dict(prompt="x", alpha1=0.3, alpha2=0.4), "alpha2"),
        (dict(prompt="x", mode="fast"), "mode"),
        (dict(prompt="x", no_such_param=1), "no_such_param"),
        (dict(prompt="x", messages=[{"role": "user", "content": "y"}]), "prompt"),
        (dict(), "prompt"),
        (dict(messages=[{"role": "robot", "content": "y"}]), "messages.0"),
        (dict(prompt_token_ids=[]), "prompt_token_ids"),
        (dict(prompt_token_ids=[1, -2]), "prompt_token_ids"),
        (dict(prompt="x", timeout=-1), "timeout"),
    ],
    ids=[
        "temperature",
        "gamma",
        "alpha2",
        "mode",
        "unknown",
        "two-inputs",
        "no-input",
        "role",
        "empty-ids",
        "negative-id",
        "timeout",
    ],
)
def test_bad_parameters_fail_before_any_network_io(kwargs, field):
    """Nothing listens on the target: a bad value must be reported by the client itself."""
    client = Client(f"127.0.0.1:{listen_port()}", retry=NO_RETRY)
    try:
        kwargs = dict(kwargs)
        prompt = kwargs.pop("prompt", None)
        with pytest.raises(InvalidParameterError) as err:
            client.generate(prompt, **kwargs)
        assert err.value.field == field and not isinstance(err.value, RPCError), err.value
        assert str(err.value).startswith(f"{field}:")
        with pytest.raises(Unavailable):  # the same client does reach the network with good values
            client.complete("x", max_tokens=2)
    finally:
        client.close()


def test_retry_policy_backoff_is_exponential_capped_and_jittered():
    policy = RetryPolicy(max_attempts=6, initial_backoff_s=0.1, max_backoff_s=0.5, multiplier=2.0, jitter=0.5)
    for retry, full in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (5, 0.5)]:
        delays = {policy.backoff(retry) for _ in range(50)}
        assert all(full * 0.5 <= d <= full for d in delays) and len(delays) > 1
    assert RetryPolicy(jitter=0.0).backoff(2) == 0.5
    with pytest.raises(InvalidParameterError):
        RetryPolicy(max_attempts=0)


def test_cancel_stops_the_retries(caplog):
    """cancel() during the backoff between attempts ends the stream with Cancelled and makes no
    further attempt: the backoff is an hour, so a client that slept it out would still be
    waiting when the join below gives up (a hang guard, not a measurement)."""
    caplog.set_level(logging.INFO, logger="viasd.client")
    hour = RetryPolicy(max_attempts=100, initial_backoff_s=3600.0, max_backoff_s=3600.0, jitter=0.0)
    with Client(f"127.0.0.1:{listen_port()}", retry=hour) as client:
        stream = client.generate("x", max_tokens=2)
        out: dict = {}

        def read():
            try:
                list(stream)
            except BaseException as exc:  # noqa: BLE001 - checked below
                out["error"] = exc

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while not retries(caplog) and reader.is_alive():  # the first attempt failed: now in the backoff
            time.sleep(0.05)
        stream.cancel()
        reader.join(TIMEOUT_S)
        assert not reader.is_alive(), "cancel() did not cut the backoff short"
    assert isinstance(out.get("error"), Cancelled), out
    assert len(retries(caplog)) == 1  # one attempt, one backoff begun, no second attempt


# ------------------------------------------------------------------ results equal the in-process engine


def assert_same(result, ref, what=""):
    assert result.token_ids == ref.token_ids, what
    assert result.finish_reason == ref.finish_reason, what
    for name in COUNTERS:
        assert getattr(result.stats, name) == getattr(ref.stats, name), (what, name)


@pytest.mark.parametrize("case", list(CASES))
def test_stream_equals_in_process(client, llm, case):
    ref = reference(llm, PROMPT, **CASES[case])
    chunks = list(client.generate(prompt_token_ids=PROMPT, max_tokens=24, **CASES[case]))
    assert len(chunks) > 1 and all(c.finish_reason is None and c.stats is None for c in chunks[:-1])
    assert len({c.request_id for c in chunks}) == 1
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert_same(client.complete(prompt_token_ids=PROMPT, max_tokens=24, **CASES[case]), ref, case)


def test_unset_parameters_take_the_servers_defaults(client, llm):
    """Only the fields the caller set travel: mode unset -> the pipeline's default mode (auto:
    greedy, lossless plans only, so ar's tokens), gamma unset -> the engine's."""
    got = client.complete(prompt_token_ids=PROMPT, max_tokens=24)
    assert got.stats.mode == "auto" and sum(got.stats.plans.values()) > 0
    assert got.token_ids == reference(llm, PROMPT, mode="ar").token_ids
    via = client.complete(prompt_token_ids=PROMPT, max_tokens=24, mode="via")
    assert_same(via, reference(llm, PROMPT, mode="via"))


def test_async_client_16_concurrent_streams_equal_their_sequential_runs(aio, target, llm):
    settings = [
        dict(VIA, temperature=1.0, seed=200 + i) if i % 2 else dict(mode="sd", gamma=3, temperature=0.9, seed=200 + i)
        for i in range(16)
    ]
    prompts = [PROMPT, [60] * 12]
    expected = [reference(llm, prompts[i % 2], **s) for i, s in enumerate(settings)]

    async def all_at_once():
        async with AsyncClient(target, timeout=TIMEOUT_S) as client:
            return await asyncio.gather(
                *(
                    client.complete(prompt_token_ids=prompts[i % 2], request_id=f"s{i}", max_tokens=24, **s)
                    for i, s in enumerate(settings)
                )
            )

    results = aio.run(all_at_once())
    for i, (got, ref) in enumerate(zip(results, expected)):
        assert got.request_id == f"s{i}"
        assert_same(got, ref, f"stream {i}")
    assert len({tuple(r.token_ids) for r in results}) > 1  # different seeds, different outputs


def test_models_and_health(client):
    (m,) = client.models()
    assert (m.name, m.num_layers, m.skipped_layers, m.tensor_parallel_size, m.max_context, m.default_mode) == (
        "tiny",
        6,
        (1, 3),
        1,
        512,
        "auto",
    )
    assert client.health() == "SERVING" and client.health("viasd.v1.GenerationService") == "SERVING"
    with pytest.raises(RPCError) as err:
        client.health("no.such.Service")
    assert err.value.code == "NOT_FOUND"


def test_server_side_invalid_argument_names_the_field(client, aio):
    async def on_async():
        async with AsyncClient(client.target, timeout=TIMEOUT_S) as c:
            with pytest.raises(InvalidArgument) as err:
                await c.complete(prompt_token_ids=[1, 500])
            return err.value

    assert aio.run(on_async()).field == "prompt"
    for kwargs, field in [
        (dict(prompt_token_ids=[1, 500]), "prompt"),  # outside the 96-token vocabulary
        (dict(prompt="def f():"), "prompt"),  # these test models have no tokenizer
        (dict(prompt_token_ids=[1], model="nope"), "model"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            client.complete(**kwargs)
        e = err.value
        assert isinstance(e, InvalidParameterError) and isinstance(e, RPCError), e
        assert (e.field, e.code) == (field, "INVALID_ARGUMENT") and str(e).startswith(f"{field}: ") and e.message


# ------------------------------------------------------------------ cancellation, deadlines


def test_closing_a_stream_cancels_the_request_on_the_server(client, aio, pipeline):
    # close()
    stream = client.generate(prompt_token_ids=PROMPT, **dict(LONG, mode="sd"))
    next(stream), next(stream)
    assert open_sessions(aio, pipeline) == {"drafter": 1, "verifier": [1]}
    stream.close()
    assert idle(aio, pipeline)
    # leaving the `with` block (an exception inside it)
    with pytest.raises(KeyError):
        with client.generate(prompt_token_ids=PROMPT, **dict(LONG, mode="sd")) as stream:
            next(stream)
            assert open_sessions(aio, pipeline) == {"drafter": 1, "verifier": [1]}
            raise KeyError("caller's error")
    assert idle(aio, pipeline)
    # breaking out of a for loop over the stream (dropped: CPython closes it at once)
    for i, _chunk in enumerate(client.generate(prompt_token_ids=PROMPT, **LONG)):
        if i == 2:
            break
    assert idle(aio, pipeline)


def test_cancel_from_another_thread_ends_the_iteration(client, aio, pipeline):
    stream = client.generate(prompt_token_ids=PROMPT, **LONG)
    next(stream)
    threading.Timer(0.2, stream.cancel).start()
    with pytest.raises(Cancelled):
        for _ in stream:
            pass
    assert idle(aio, pipeline)


def test_async_stream_closed_by_async_with_cancels_on_the_server(aio, target, pipeline):
    async def run():
        async with AsyncClient(target) as client:
            async with client.generate(prompt_token_ids=PROMPT, **dict(LONG, mode="via")) as stream:
                async for _ in stream:
                    mid = await pipeline.session_counts()
                    break
            return mid

    assert aio.run(run()) == {"drafter": 1, "verifier": [1]}
    assert idle(aio, pipeline)


def test_deadline_expires_with_deadline_exceeded(client, aio, pipeline):
    got = []
    with pytest.raises(DeadlineExceeded) as err:
        for chunk in client.generate(prompt_token_ids=PROMPT, timeout=0.3, **LONG):
            got.extend(chunk.token_ids)
    assert err.value.code == "DEADLINE_EXCEEDED"
    assert len(got) < LONG["max_tokens"]  # ended by the deadline, not by running to completion
    assert idle(aio, pipeline)  # the server ended the request too

    async def on_async():
        async with AsyncClient(client.target, timeout=0.3) as c:  # the client-wide default deadline
            return await c.complete(prompt_token_ids=PROMPT, **LONG)

    with pytest.raises(DeadlineExceeded):
        aio.run(on_async())
    assert idle(aio, pipeline)


# ------------------------------------------------------------------ retries


def test_unavailable_before_the_first_token_is_retried_until_the_server_is_up(aio, servers, servicer, llm, caplog):
    caplog.set_level(logging.INFO, logger="viasd.client")
    port = listen_port()
    late = []
    timer = threading.Timer(1.0, lambda: late.append(servers.start(servicer, port)[0]))
    timer.start()
    try:
        with Client(f"127.0.0.1:{port}", retry=FAST_RETRY, timeout=TIMEOUT_S) as client:
            got = client.complete(prompt_token_ids=PROMPT, max_tokens=24, **CASES["via-sampled"])
    finally:
        timer.join()
        for server in late:
            servers.stop(server)
    assert_same(got, reference(llm, PROMPT, **CASES["via-sampled"]))
    assert retries(caplog), "the first attempts met a closed port"
    with Client(f"127.0.0.1:{port}", retry=NO_RETRY) as client, pytest.raises(Unavailable):
        client.models()  # and without retries the closed port is an error at once


class Flaky:
    """A GenerationServicer wrapper that fails chosen calls with `code` (UNAVAILABLE unless told)
    and trailing `metadata`: before the first response (`fail_first` calls) or after the first
    response (`fail_after_first`)."""

    def __init__(
        self,
        servicer,
        fail_first: int = 0,
        fail_after_first: bool = False,
        code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        metadata: tuple = (),
    ):
        self.servicer = servicer
        self.fail_first = fail_first
        self.fail_after_first = fail_after_first
        self.code = code
        self.metadata = metadata
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.servicer, name)

    async def Generate(self, request, context, **kw):
        self.calls += 1
        if self.calls <= self.fail_first:
            await context.abort(self.code, "warming up", trailing_metadata=self.metadata)
        async with aclosing(self.servicer.Generate(request, context, **kw)) as responses:
            async for response in responses:
                yield response
                if self.fail_after_first:
                    await asyncio.sleep(0.05)
                    await context.abort(self.code, "lost the verifier", trailing_metadata=self.metadata)


def _complete_through(servers, flaky):
    """A sampled `sd` request through a server that fails its first calls (retried): its result."""
    server, address = servers.start(flaky)
    try:
        with Client(address, retry=FAST_RETRY, timeout=TIMEOUT_S) as client:
            return client.complete(prompt_token_ids=PROMPT, max_tokens=24, **CASES["sd-sampled"])
    finally:
        servers.stop(server)


def test_server_unavailable_status_before_the_first_token_is_retried(aio, servers, servicer, llm, caplog):
    caplog.set_level(logging.INFO, logger="viasd.client")
    flaky = Flaky(servicer, fail_first=2)
    got = _complete_through(servers, flaky)
    assert_same(got, reference(llm, PROMPT, **CASES["sd-sampled"]))
    assert flaky.calls == 3 and len(retries(caplog)) == 2


def test_unavailable_after_the_first_token_is_never_retried(aio, servers, servicer, pipeline, llm, caplog):
    caplog.set_level(logging.INFO, logger="viasd.client")
    ref = reference(llm, PROMPT, **LONG)
    flaky = Flaky(servicer, fail_after_first=True)
    server, address = servers.start(flaky)
    got = []
    try:
        with Client(address, retry=FAST_RETRY, timeout=TIMEOUT_S) as client, pytest.raises(Unavailable) as err:
            for chunk in client.generate(prompt_token_ids=PROMPT, **LONG):
                got.extend(chunk.token_ids)
    finally:
        servers.stop(server)
    assert "lost the verifier" in str(err.value)
    assert flaky.calls == 1 and not retries(caplog)
    assert got and got == ref.token_ids[: len(got)]  # what arrived, once, in order
    assert idle(aio, pipeline)


def retry_delays(caplog) -> list[float]:
    """The delays the client chose, from its retry log lines ("... retry n/m in 0.25s")."""
    return [float(m.rsplit(" in ", 1)[1].rstrip("s")) for m in retries(caplog)]


def test_queue_full_before_the_first_token_is_retried_after_the_servers_hint(aio, servers, servicer, llm, caplog):
    """RESOURCE_EXHAUSTED with the server's retry hint (viasd-retry-after-ms) is retried; each
    wait is at least the hint, although the policy's own backoff (<= 0.05 s here) is shorter."""
    from viasd.client.errors import RETRY_AFTER_KEY

    caplog.set_level(logging.INFO, logger="viasd.client")
    flaky = Flaky(servicer, fail_first=2, code=grpc.StatusCode.RESOURCE_EXHAUSTED, metadata=((RETRY_AFTER_KEY, "200"),))
    got = _complete_through(servers, flaky)
    assert_same(got, reference(llm, PROMPT, **CASES["sd-sampled"]))
    assert flaky.calls == 3 and all("RESOURCE_EXHAUSTED" in m for m in retries(caplog))
    assert len(retry_delays(caplog)) == 2 and min(retry_delays(caplog)) >= 0.2


@pytest.mark.parametrize("after_first", [False, True], ids=["no-hint", "after-the-first-token"])
def test_resource_exhausted_without_the_hint_or_after_a_token_is_not_retried(
    aio, servers, servicer, pipeline, llm, caplog, after_first
):
    """Without the hint RESOURCE_EXHAUSTED is gRPC's own (a message past the size limit): another
    attempt would fail the same way. After the first token nothing is retried, hint or not."""
    from viasd.client import ResourceExhausted
    from viasd.client.errors import RETRY_AFTER_KEY

    caplog.set_level(logging.INFO, logger="viasd.client")
    hint = ((RETRY_AFTER_KEY, "10"),) if after_first else ()
    flaky = Flaky(
        servicer,
        fail_first=0 if after_first else 1,
        fail_after_first=after_first,
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        metadata=hint,
    )
    server, address = servers.start(flaky)
    got = []
    try:
        with Client(address, retry=FAST_RETRY, timeout=TIMEOUT_S) as client, pytest.raises(ResourceExhausted):
            for chunk in client.generate(prompt_token_ids=PROMPT, **LONG):
                got.extend(chunk.token_ids)
    finally:
        servers.stop(server)
    assert flaky.calls == 1 and not retries(caplog)
    assert bool(got) == after_first
    assert idle(aio, pipeline)


def test_a_full_queue_of_a_real_server_is_retried_until_a_slot_frees(aio, servers, pipeline, llm, caplog):
    """The real admission limits (one slot, no queue): while the slot is taken the server answers
    RESOURCE_EXHAUSTED with its hint, the client waits and tries again, and once the slot is free
    the call is served, equal to the engine."""
    from viasd.cluster.grpc_api import GenerationServicer
    from viasd.cluster.handler import RETRY_AFTER_S, Admission

    caplog.set_level(logging.INFO, logger="viasd.client")
    admission = Admission(1, 0)
    counting = Flaky(GenerationServicer({"tiny": pipeline}, "tiny", admission=admission))
    server, address = servers.start(counting)
    aio.run(admission.enter())  # the one slot is taken, as by a running request
    out: dict = {}

    def call():
        try:
            with Client(
                address,
                retry=RetryPolicy(max_attempts=50, initial_backoff_s=0.05, max_backoff_s=0.1),
                timeout=TIMEOUT_S,
            ) as client:
                out["got"] = client.complete(prompt_token_ids=PROMPT, max_tokens=24, **CASES["via-greedy"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    worker = threading.Thread(target=call)
    worker.start()
    try:
        while counting.calls < 2 and worker.is_alive():  # refused at least once, then tried again
            time.sleep(0.05)
    finally:

        async def free():
            admission.leave()

        aio.run(free())
        worker.join(TIMEOUT_S)
        servers.stop(server)
    assert "error" not in out, out.get("error")
    assert_same(out["got"], reference(llm, PROMPT, **CASES["via-greedy"]))
    assert counting.calls >= 2 and retry_delays(caplog) and min(retry_delays(caplog)) >= RETRY_AFTER_S
    assert all("RESOURCE_EXHAUSTED" in m and "max_queued_requests=0" in m for m in retries(caplog))


def test_server_killed_mid_stream_is_an_error_without_duplicates(aio, servers, servicer, pipeline, llm, caplog):
    caplog.set_level(logging.INFO, logger="viasd.client")
    ref = reference(llm, PROMPT, **LONG)
    server, address = servers.start(servicer)
    got = []
    with Client(address, retry=FAST_RETRY, timeout=TIMEOUT_S) as client:
        stream = client.generate(prompt_token_ids=PROMPT, **LONG)
        got.extend(next(stream).token_ids)
        servers.stop(server)  # no grace: every open call is ended
        with pytest.raises(RPCError) as err:
            for chunk in stream:
                got.extend(chunk.token_ids)
    assert isinstance(err.value, (Unavailable, Cancelled)), err.value
    assert not retries(caplog)
    assert 0 < len(got) < len(ref.token_ids) and got == ref.token_ids[: len(got)]
    assert idle(aio, pipeline)


# ------------------------------------------------------------------ TLS, mutual TLS, bearer token


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    return make_certificates(tmp_path_factory.mktemp("certs"))


def test_tls_with_a_bearer_token(servers, servicer, certs, llm, tmp_path):
    from viasd.cluster.security import GRPCSecurity

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    security = GRPCSecurity(tls_cert_file=certs["server.pem"], tls_key_file=certs["server.key"], token_file=token_file)
    server, address = servers.start(servicer, security=security)
    tls = TLSConfig(ca_file=certs["ca.pem"])
    ref = reference(llm, PROMPT, **CASES["via-greedy"])
    try:
        with Client(address, tls=tls, token=TOKEN, timeout=TIMEOUT_S) as client:
            assert_same(client.complete(prompt_token_ids=PROMPT, max_tokens=24, **CASES["via-greedy"]), ref)
            assert [m.name for m in client.models()] == ["tiny"]
        with Client(address.replace("127.0.0.1", "localhost"), tls=tls, token=TOKEN, timeout=TIMEOUT_S) as client:
            assert [m.name for m in client.models()] == ["tiny"]  # the DNS name of the certificate
        for token, message in [
            (None, "missing bearer token"),
            ("wrong", "invalid bearer token"),
            (TOKEN + "x", "invalid bearer token"),
        ]:
            with Client(address, tls=tls, token=token, retry=NO_RETRY, timeout=TIMEOUT_S) as client:
                with pytest.raises(Unauthenticated, match=message):
                    client.complete(prompt_token_ids=PROMPT, max_tokens=4)
                with pytest.raises(Unauthenticated):
                    client.models()
                assert client.health() == "SERVING"  # the health service needs no token
        with Client(address, token=TOKEN, retry=NO_RETRY, timeout=10) as plaintext, pytest.raises(Unavailable):
            plaintext.models()  # a plaintext client cannot talk to a TLS port
        untrusted = TLSConfig(ca_file=certs["other-ca.pem"])
        with (
            Client(address, tls=untrusted, token=TOKEN, retry=NO_RETRY, timeout=10) as client,
            pytest.raises(Unavailable),
        ):
            client.models()  # the server's certificate is not signed by the CA this client trusts
    finally:
        servers.stop(server)


def test_mutual_tls(aio, servers, servicer, certs, llm):
    from viasd.cluster.security import GRPCSecurity

    security = GRPCSecurity(
        tls_cert_file=certs["server.pem"],
        tls_key_file=certs["server.key"],
        client_ca_file=certs["ca.pem"],
        require_client_cert=True,
        token_env=None,
    )
    server, address = servers.start(servicer, security=security)
    ref = reference(llm, PROMPT, **CASES["sd-sampled"])
    try:
        tls = TLSConfig(ca_file=certs["ca.pem"], cert_file=certs["client.pem"], key_file=certs["client.key"])
        with Client(address, tls=tls, timeout=TIMEOUT_S) as client:
            assert_same(client.complete(prompt_token_ids=PROMPT, max_tokens=24, **CASES["sd-sampled"]), ref)

        async def on_async():
            async with AsyncClient(address, tls=tls, timeout=TIMEOUT_S) as client:
                return await client.complete(prompt_token_ids=PROMPT, max_tokens=24, **CASES["sd-sampled"])

        assert_same(aio.run(on_async()), ref)
        for bad in [
            TLSConfig(ca_file=certs["ca.pem"]),  # no client certificate
            TLSConfig(ca_file=certs["ca.pem"], cert_file=certs["other-client.pem"], key_file=certs["other-client.key"]),
        ]:  # signed by a CA the server does not trust
            with Client(address, tls=bad, retry=NO_RETRY, timeout=10) as client, pytest.raises(Unavailable):
                client.models()
    finally:
        servers.stop(server)


def test_server_security_settings(tmp_path, monkeypatch, certs):
    from viasd.cluster.security import GRPCSecurity
    from viasd.cluster.standalone import main

    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    assert GRPCSecurity(token_file=token_file).token() == TOKEN
    monkeypatch.setenv("VIASD_API_TOKEN", "from-env")
    assert GRPCSecurity().token() == "from-env" and GRPCSecurity(token_env=None).token() is None
    assert GRPCSecurity(token_file=token_file).token() == TOKEN  # the file wins
    sec = GRPCSecurity(tls_cert_file=certs["server.pem"], tls_key_file=certs["server.key"], token_file=token_file)
    assert TOKEN not in sec.describe() and TOKEN not in repr(sec) and sec.describe().startswith("TLS")
    token_file.write_text("\n")
    for values, field in [
        (dict(token_file=token_file), "token_file"),
        (dict(token_file=tmp_path / "missing"), "token_file"),
    ]:
        with pytest.raises(InvalidParameterError) as err:
            GRPCSecurity.parse(values).token()
        assert err.value.field == field
    for values, field in [
        (dict(tls_cert_file="a.pem"), "tls_key_file"),
        (dict(client_ca_file="ca.pem"), "client_ca_file"),
        (dict(require_client_cert=True), "require_client_cert"),
        (dict(tls_cert_file="a", tls_key_file="b", nope=1), "nope"),
    ]:
        with pytest.raises(InvalidParameterError) as err:
            GRPCSecurity.parse(values)
        assert err.value.field == field
    with pytest.raises(SystemExit):  # no flag takes the token itself: it would show in `ps`
        main(["--token", TOKEN])
    for name, info in GRPCSecurity.model_fields.items():
        assert info.description, name


# ------------------------------------------------------------------ CLI


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("viasd-client")  # the console script pyproject installs
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "viasd.client.console"]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, **(env or {})}
    )


def test_cli_generate_models_health_json(target, llm):
    ref = reference(llm, PROMPT, **CASES["sd-sampled"])
    res = _cli(
        "--target",
        target,
        "--json",
        "generate",
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-tokens",
        "24",
        "--mode",
        "sd",
        "--gamma",
        "4",
        "--temperature",
        "0.8",
        "--top-k",
        "40",
        "--seed",
        "12",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["token_ids"] == ref.token_ids and out["finish_reason"] == ref.finish_reason
    assert out["stats"]["num_accepted_tokens"] == ref.stats.num_accepted_tokens


def test_cli_in_process(target, certs, servers, servicer, capsys, tmp_path, monkeypatch):
    from viasd.client.console import main

    assert main(["--target", target, "--json", "models"]) == 0
    assert json.loads(capsys.readouterr().out)["models"][0]["name"] == "tiny"
    assert main(["--target", target, "health"]) == 0 and capsys.readouterr().out.strip() == "SERVING"
    assert main(["--target", target, "generate", "--prompt-ids", "5,17,3", "--max-tokens", "4", "--stats"]) == 0
    assert "tokens in" in capsys.readouterr().err
    # errors: client-side (exit 2, nothing sent), server-side INVALID_ARGUMENT (exit 2), unreachable (exit 1)
    assert main(["--target", target, "--json", "generate", "x", "--temperature", "-1"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["field"] == "temperature"
    assert main(["--target", target, "--json", "chat", "hello", "--system", "be brief"]) == 2  # no chat template
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "INVALID_ARGUMENT" and error["field"] in ("prompt", "messages")
    assert main(["--target", f"127.0.0.1:{listen_port()}", "--retries", "0", "models"]) == 1
    assert "Unavailable" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no flag takes the token itself (nor abbreviates --token-file)
        main(["--target", target, "--token", TOKEN, "models"])
    # TLS and the token from the environment or a file
    from viasd.cluster.security import GRPCSecurity

    security = GRPCSecurity(
        tls_cert_file=certs["server.pem"], tls_key_file=certs["server.key"], token_env="VIASD_TEST_SERVER_TOKEN"
    )
    monkeypatch.setenv("VIASD_TEST_SERVER_TOKEN", TOKEN)
    server, address = servers.start(servicer, security=security)
    try:
        tls = ["--target", address, "--ca-file", str(certs["ca.pem"]), "--retries", "0"]
        monkeypatch.delenv("VIASD_API_TOKEN", raising=False)
        assert main([*tls, "models"]) == 1 and "Unauthenticated" in capsys.readouterr().err
        monkeypatch.setenv("VIASD_API_TOKEN", TOKEN)
        assert main([*tls, "--json", "models"]) == 0
        assert json.loads(capsys.readouterr().out)["models"][0]["name"] == "tiny"
        monkeypatch.delenv("VIASD_API_TOKEN")
        (tmp_path / "token").write_text(TOKEN)
        assert main([*tls, "--token-file", str(tmp_path / "token"), "health"]) == 0
    finally:
        servers.stop(server)


# ------------------------------------------------------------------ the standalone server process


def test_standalone_server_process_with_tls_and_token(engine_config, llm, certs, tmp_path, caplog):
    """`python -m viasd.cluster.standalone` as a real process (its own Ray on loopback) with TLS
    and a token file: a client started before it retries until it is up, then streams the
    in-process result; a wrong token is refused; SIGTERM ends it cleanly."""
    import signal

    caplog.set_level(logging.INFO, logger="viasd.client")
    config = tmp_path / "pipeline.json"
    config.write_text(
        json.dumps(
            {
                "name": "tiny",
                "engine": engine_config.model_dump(mode="json"),
                "drafter_cpus": 0.5,
                "verifier_cpus_per_rank": 0.5,
            }
        )
    )
    (tmp_path / "token").write_text(TOKEN)
    port = listen_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIASD_API_TOKEN")}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_enable_worker_prestart="0", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "viasd.cluster.standalone",
        "--config",
        str(config),
        "--port",
        str(port),
        "--tls-cert",
        str(certs["server.pem"]),
        "--tls-key",
        str(certs["server.key"]),
        "--token-file",
        str(tmp_path / "token"),
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    tls = TLSConfig(ca_file=certs["ca.pem"])
    retry = RetryPolicy(max_attempts=10_000, initial_backoff_s=0.2, max_backoff_s=1.0)
    ref = reference(llm, PROMPT, **CASES["via-sampled"])
    try:
        with Client(f"127.0.0.1:{port}", tls=tls, token=TOKEN, retry=retry, timeout=240) as client:
            stream = client.generate(prompt_token_ids=PROMPT, max_tokens=24, **CASES["via-sampled"])

            def watch():  # a server that dies while starting ends the retries
                proc.wait()
                stream.cancel()

            threading.Thread(target=watch, daemon=True).start()
            chunks = list(stream)
            assert [t for c in chunks for t in c.token_ids] == ref.token_ids, "".join(output)
            assert chunks[-1].stats.num_accepted_tokens == ref.stats.num_accepted_tokens
        assert retries(caplog), "the client was started before the server"
        with Client(f"127.0.0.1:{port}", tls=tls, token="wrong", retry=NO_RETRY, timeout=30) as client:
            with pytest.raises(Unauthenticated):
                client.models()
            assert client.health() == "SERVING"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, "".join(output)
        reader.join(10)
        log = "".join(output)
        assert "TLS, bearer token from file" in log and TOKEN not in log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
