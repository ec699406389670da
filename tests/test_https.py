"""HTTPS and the bearer token on the OpenAI-compatible API, through Ray Serve's HTTP proxy.

Certificates are made by the test (a CA and a server certificate for 127.0.0.1; a second CA
nobody trusts); the application serves a tiny float32 LLaMA pair (token ids in and out).
"""

from __future__ import annotations

import pytest

from conftest import save_tiny_pair
from test_serve import _free_port

TOKEN = "https-test-token"
CALL_TIMEOUT = 120


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    pytest.importorskip("cryptography")
    from test_client import _certificates

    return _certificates(tmp_path_factory.mktemp("https-certs"))


@pytest.fixture(scope="module")
def service(tmp_path_factory, certs, ray_session):
    from ray import serve

    from viasd.cluster import launch
    from viasd.cluster.config import parse_serve_config

    root = tmp_path_factory.mktemp("https-models")
    (root / "token").write_text(TOKEN)
    config = parse_serve_config({
        "pipelines": [{"name": "tiny", "engine": save_tiny_pair(root).model_dump(mode="json"),
                       "drafter_cpus": 0.25, "verifier_cpus_per_rank": 0.25}],
        "http": {"port": _free_port(), "token_file": str(root / "token"),
                 "tls_cert_file": str(certs["server.pem"]), "tls_key_file": str(certs["server.key"])},
        "grpc": {"port": _free_port()},
        "metrics": {"ray_export": False},
    })
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
    r = requests.post(service.http + "/v1/completions", json=body, headers=auth, verify=str(certs["ca.pem"]),
                      timeout=CALL_TIMEOUT)
    assert r.status_code == 200, r.text
    r = requests.get(service.http + "/v1/models", verify=str(certs["ca.pem"]), timeout=CALL_TIMEOUT)
    assert r.status_code == 401


def test_plain_http_and_untrusted_certificates_are_refused(service, certs):
    import requests

    with pytest.raises(requests.exceptions.ConnectionError):  # (SSLError is a ConnectionError too)
        requests.get(service.http.replace("https://", "http://") + "/health", timeout=30)
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(service.http + "/health", verify=str(certs["other-ca.pem"]), timeout=30)
