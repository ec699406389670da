"""HTTPS and the bearer token on the OpenAI-compatible API, through Ray Serve's HTTP proxy; mutual
TLS on HTTP through the standalone server's HTTP front (Serve's proxy cannot require client
certificates).

Certificates are made by the test (tests/certs.py: a CA with server and client certificates, a
second CA nobody trusts); the application serves a tiny float32 LLaMA pair (token ids in and out).
"""

from __future__ import annotations

import pytest
from certs import make_certificates
from conftest import listen_port, save_tiny_pair

TOKEN = "https-test-token"
CALL_TIMEOUT = 120


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("https-certs"))


@pytest.fixture(scope="module")
def service(tmp_path_factory, certs, ray_session):
    from ray import serve

    from viasd.cluster import launch
    from viasd.cluster.serve_config import parse_serve_config

    root = tmp_path_factory.mktemp("https-models")
    (root / "token").write_text(TOKEN)
    config = parse_serve_config(
        {
            "pipelines": [
                {
                    "name": "tiny",
                    "engine": save_tiny_pair(root).model_dump(mode="json"),
                    "drafter_cpus": 0.25,
                    "verifier_cpus_per_rank": 0.25,
                }
            ],
            "http": {
                "port": listen_port(),
                "token_file": str(root / "token"),
                "tls_cert_file": str(certs["server.pem"]),
                "tls_key_file": str(certs["server.key"]),
            },
            "grpc": {"port": listen_port()},
            "metrics": {"ray_export": False},
        }
    )
    endpoints = launch.start(config, blocking_timeout_s=240)
    yield endpoints
    serve.shutdown()


def test_the_api_is_served_over_https_with_the_token(service, certs):
    import requests

    assert service.http.startswith("https://")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = requests.get(service.http + "/health", verify=str(certs["ca.pem"]), timeout=30)
    assert r.status_code == 200
    r = requests.get(service.http + "/v1/models", headers=auth, verify=str(certs["ca.pem"]), timeout=CALL_TIMEOUT)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"]
    body = {"model": "tiny", "prompt": [5, 17, 3, 88], "max_tokens": 4, "return_token_ids": True}
    r = requests.post(
        service.http + "/v1/completions", json=body, headers=auth, verify=str(certs["ca.pem"]), timeout=CALL_TIMEOUT
    )
    assert r.status_code == 200, r.text
    r = requests.get(service.http + "/v1/models", verify=str(certs["ca.pem"]), timeout=CALL_TIMEOUT)
    assert r.status_code == 401


def test_plain_http_and_untrusted_certificates_are_refused(service, certs):
    import requests

    with pytest.raises(requests.exceptions.ConnectionError):  # (SSLError is a ConnectionError too)
        requests.get(service.http.replace("https://", "http://") + "/health", timeout=30)
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(service.http + "/health", verify=str(certs["other-ca.pem"]), timeout=30)


# ------------------------------------------------------------------ mutual TLS: the standalone server's HTTP API


@pytest.fixture(scope="module")
def mtls_http(tmp_path_factory, certs, aio):
    """The standalone server's HTTP front (standalone.serve_http) requiring client certificates,
    over the in-process pipeline (no Ray needed), with the bearer token."""
    from viasd.cluster.handler import RequestHandler
    from viasd.cluster.local import LocalPipeline
    from viasd.cluster.pipeline import PipelineConfig
    from viasd.cluster.security import GRPCSecurity
    from viasd.cluster.standalone import serve_http

    root = tmp_path_factory.mktemp("mtls-models")
    (root / "token").write_text(TOKEN)
    config = PipelineConfig(name="tiny", engine=save_tiny_pair(root))
    security = GRPCSecurity(
        tls_cert_file=certs["server.pem"],
        tls_key_file=certs["server.key"],
        client_ca_file=certs["ca.pem"],
        require_client_cert=True,
        token_file=root / "token",
    )

    async def start():
        pipeline = await LocalPipeline.start(config)
        server = await serve_http({"tiny": RequestHandler(pipeline, "tiny")}, "tiny", 0, "127.0.0.1", security)
        return pipeline, server

    pipeline, server = aio.run(start())
    yield f"https://127.0.0.1:{server.viasd_port}"

    async def stop():
        server.should_exit = True
        await server.viasd_task
        await pipeline.shutdown()

    aio.run(stop())


def test_http_mutual_tls_serves_clients_with_a_certificate_signed_by_the_ca(mtls_http, certs):
    import requests

    mine = (str(certs["client.pem"]), str(certs["client.key"]))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"prompt": [5, 17, 3, 88], "max_tokens": 4, "return_token_ids": True}
    r = requests.post(
        mtls_http + "/v1/completions",
        json=body,
        headers=auth,
        cert=mine,
        verify=str(certs["ca.pem"]),
        timeout=CALL_TIMEOUT,
    )
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4, r.text
    r = requests.get(mtls_http + "/v1/models", cert=mine, verify=str(certs["ca.pem"]), timeout=CALL_TIMEOUT)
    assert r.status_code == 401  # the certificate gets a client through TLS, not past the token


def test_http_mutual_tls_refuses_clients_without_a_trusted_certificate(mtls_http, certs):
    import requests

    ca = str(certs["ca.pem"])
    with pytest.raises(requests.exceptions.ConnectionError):  # no certificate (SSLError or a reset)
        requests.get(mtls_http + "/health", verify=ca, timeout=30)
    with pytest.raises(requests.exceptions.ConnectionError):  # signed by a CA the server does not trust
        requests.get(
            mtls_http + "/health",
            cert=(str(certs["other-client.pem"]), str(certs["other-client.key"])),
            verify=ca,
            timeout=30,
        )
    with pytest.raises(requests.exceptions.ConnectionError):  # plaintext
        requests.get(mtls_http.replace("https://", "http://") + "/health", timeout=30)
    r = requests.get(
        mtls_http + "/health", cert=(str(certs["client.pem"]), str(certs["client.key"])), verify=ca, timeout=30
    )
    assert r.status_code == 200  # and the server is still up
