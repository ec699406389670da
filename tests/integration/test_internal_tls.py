"""Mutual TLS on the internal drafter / verifier services (`PipelineConfig.internal_tls`).

A pipeline of tiny models with test-made certificates (tests/certs.py): served tokens equal the
in-process engine's; the drafter's and the verifier's ports refuse plaintext, a TLS client without
a certificate and a client whose certificate another CA signed, and answer the pipeline's own
identity; a missing certificate file is an error naming the field; a drafter rebuilt by the
supervisor serves mutual TLS again.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import ray
from certs import make_certificates
from conftest import save_tiny_pair
from test_pipeline import _pipeline_config, collect, reference, request

from viasd.actors.rpc import GRPC_OPTIONS, InternalTLS
from viasd.errors import InvalidParameterError
from viasd.v1 import internal_pb2 as ipb
from viasd.v1 import internal_pb2_grpc

CALL_S = 30.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("internal-certs"))


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("internal-tls-models"))


@pytest.fixture(scope="module")
def tls(certs) -> InternalTLS:
    return InternalTLS(cert_file=certs["internal.pem"], key_file=certs["internal.key"], ca_file=certs["ca.pem"])


@pytest.fixture(scope="module")
def llm(engine_config):
    from viasd.llm import LLM

    return LLM(engine_config)


@pytest.fixture(scope="module")
def pipeline(ray_session, aio, engine_config, tls):
    from viasd.cluster.pipeline import Pipeline

    p = aio.run(Pipeline.start(_pipeline_config(engine_config, name="mtls", internal_tls=tls)))
    yield p
    aio.run(p.shutdown())


@pytest.fixture(scope="module")
def stub(aio, pipeline):
    """The public GenerationService over the pipeline on a loopback port (plaintext: the public side)."""
    from viasd.cluster.grpc_api import GenerationServicer
    from viasd.cluster.standalone import serve_grpc
    from viasd.v1 import generation_pb2_grpc

    srv = aio.run(serve_grpc(GenerationServicer({"mtls": pipeline}, default="mtls"), 0))

    async def connect():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.viasd_port}")
        return channel, generation_pb2_grpc.GenerationServiceStub(channel)

    channel, stub = aio.run(connect())
    yield stub
    aio.run(channel.close())
    aio.run(srv.stop(grace=1))


async def _close_unknown_session(channel, service: str) -> grpc.StatusCode:
    """Release a session nobody opened (Release is idempotent): OK proves the call got through the
    handshake. `channel` is a callable making the channel in the running loop."""
    channel = channel()
    stub = (internal_pb2_grpc.DrafterServiceStub if service == "drafter" else internal_pb2_grpc.VerifierServiceStub)(
        channel
    )
    try:
        await stub.Release(ipb.ReleaseBatch(request_ids=["nobody"]), timeout=CALL_S)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await channel.close()


def _addresses(pipeline) -> dict[str, str]:
    return {"drafter": pipeline.executor.drafter_address, "verifier": pipeline.executor.verifier_address}


def test_served_tokens_equal_the_engine_over_mutual_tls(pipeline, aio, stub, llm):
    prompt = [5, 17, 3, 88, 41, 9]
    for params in (
        dict(mode="sd", gamma=4, temperature=1.0, seed=3),
        dict(mode="via", gamma=4, alpha1=0.9, alpha2=0.7),
    ):
        tokens, responses = aio.run(collect(stub, request(prompt, **params)))
        assert tokens == reference(llm, prompt, **params).token_ids, params
        assert not responses[-1].stats.drafter_fallback
    assert aio.run(pipeline.session_counts()) == {"drafter": 0, "verifier": [0]}


@pytest.mark.parametrize("service", ["drafter", "verifier"])
def test_internal_ports_refuse_anyone_without_the_pipeline_certificate(pipeline, aio, certs, tls, service):
    address = _addresses(pipeline)[service]
    ca = certs["ca.pem"].read_bytes()
    name = [("grpc.ssl_target_name_override", tls.server_name), *GRPC_OPTIONS]

    def channel(kind: str) -> grpc.aio.Channel:
        if kind == "plaintext":
            return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        if kind == "no client certificate":
            return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca), options=name)
        if kind == "another CA's certificate":
            creds = grpc.ssl_channel_credentials(
                root_certificates=ca,
                private_key=certs["other-internal.key"].read_bytes(),
                certificate_chain=certs["other-internal.pem"].read_bytes(),
            )
            return grpc.aio.secure_channel(address, creds, options=name)
        return tls.channel(address)

    def attempt(kind: str):
        return _close_unknown_session(lambda: channel(kind), service)

    for kind in ("plaintext", "no client certificate", "another CA's certificate"):
        assert aio.run(attempt(kind)) == grpc.StatusCode.UNAVAILABLE, kind
    assert aio.run(attempt("the pipeline's identity")) == grpc.StatusCode.OK


def test_a_server_certificate_for_another_name_is_refused_by_the_client(pipeline, aio, certs):
    """The client checks the server's name: the internal certificate names viasd-internal only."""
    wrong = InternalTLS(
        cert_file=certs["internal.pem"],
        key_file=certs["internal.key"],
        ca_file=certs["ca.pem"],
        server_name="someone-else",
    )
    address = _addresses(pipeline)["drafter"]
    code = aio.run(_close_unknown_session(lambda: wrong.channel(address), "drafter"))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_a_rebuilt_drafter_serves_mutual_tls_again(pipeline, aio, stub, llm):
    old = _addresses(pipeline)["drafter"]
    ray.kill(pipeline.drafter)

    async def heal():
        for _ in range(3):
            await pipeline.heal()
            if pipeline.executor.drafter_address != old:
                return
            await asyncio.sleep(0.5)

    aio.run(heal())
    new = _addresses(pipeline)["drafter"]
    assert new != old and pipeline.rebuilds["drafter"] >= 1
    plain = aio.run(_close_unknown_session(lambda: grpc.aio.insecure_channel(new, options=GRPC_OPTIONS), "drafter"))
    assert plain == grpc.StatusCode.UNAVAILABLE
    prompt, params = [60] * 12, dict(mode="sd", gamma=4)
    tokens, responses = aio.run(collect(stub, request(prompt, **params)))
    assert tokens == reference(llm, prompt, **params).token_ids
    assert not responses[-1].stats.drafter_fallback  # drafted by the new drafter, over mutual TLS


def test_a_missing_certificate_file_names_the_field(ray_session, aio, engine_config, certs, tmp_path):
    from viasd.cluster.pipeline import Pipeline

    broken = InternalTLS(cert_file=tmp_path / "absent.pem", key_file=certs["internal.key"], ca_file=certs["ca.pem"])
    with pytest.raises(InvalidParameterError) as err:
        aio.run(Pipeline.start(_pipeline_config(engine_config, name="broken-tls", internal_tls=broken)))
    assert err.value.field == "internal_tls.cert_file"
