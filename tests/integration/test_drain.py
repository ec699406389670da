"""Graceful drain under Ray Serve (cluster/drain.py): `viasd drain` and SIGTERM of `viasd serve`.

One Serve application on tiny models (actors backend): streams running on HTTP and on gRPC
through Serve's proxies when a drain with no time left starts end with a last message of finish
reason `abort` (not a cut connection); new requests are refused with HTTP 503 / gRPC UNAVAILABLE;
every replica reports; an order for another node changes nothing here. `viasd drain` (a
Kubernetes preStop hook) joins the running cluster and drains it the same way, and `viasd serve`
drains itself on SIGTERM, exits 0 and leaves no process behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import grpc
import pytest
import torch
from conftest import drafter_from, listen_port, process_alive, tiny_model

from viasd.config import parse_params
from viasd.v1 import generation_pb2 as pb
from viasd.v1 import generation_pb2_grpc
from viasd.v1.convert import params_to_proto

CALL_S = 120
LONG = 6000  # tokens: still running when the drain starts


@pytest.fixture(scope="module")
def service(tmp_path_factory, ray_session):
    from ray import serve

    from viasd.cluster import drain, launch
    from viasd.cluster.serve_config import parse_serve_config

    root = tmp_path_factory.mktemp("drain-models")
    verifier = tiny_model("llama", dtype=torch.float32)
    verifier.config.max_position_embeddings = LONG + 512  # long enough to outlive the start of the drain
    for name, model in (("verifier", verifier), ("drafter", drafter_from(verifier))):
        model.save_pretrained(root / name)
    engine = {"verifier": str(root / "verifier"), "drafter": str(root / "drafter"), "dtype": "float32", "threads": 1}
    config = parse_serve_config(
        {
            "pipelines": [{"name": "tiny", "engine": engine, "drafter_cpus": 0.25, "verifier_cpus_per_rank": 0.25}],
            "http": {"port": listen_port()},
            "grpc": {"port": listen_port()},
            "metrics": {"ray_export": False},
            "limits": {"max_concurrent_requests": 4, "max_queued_requests": 4},
        }
    )
    drain.reset()
    endpoints = launch.start(config, blocking_timeout_s=240)
    yield endpoints
    serve.shutdown()
    drain.reset()


def _http_stream(base: str, out: dict, started: threading.Event) -> None:
    import requests

    body = {
        "prompt": [5, 17, 3, 88],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
        "mode": "ar",
        "return_token_ids": True,
    }
    with requests.post(base + "/v1/completions", json=body, stream=True, timeout=CALL_S) as r:
        out["status"] = r.status_code
        out["events"] = []
        for line in r.iter_lines():
            if line:
                out["events"].append(line.decode())
                started.set()
    started.set()


def _grpc_stream(stub, out: dict, started: threading.Event) -> None:
    req = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[7, 8, 9]),
        params=params_to_proto(parse_params(mode="ar", max_tokens=LONG, ignore_eos=True)),
    )
    out["responses"] = []
    try:
        for response in stub.Generate(req, timeout=CALL_S):
            out["responses"].append(response)
            started.set()
    except grpc.RpcError as exc:
        out["error"] = exc.code()
    started.set()


def test_drain_ends_running_streams_with_abort_and_refuses_new_requests(service):
    import ray
    import requests

    from viasd.cluster import drain

    channel = grpc.insecure_channel(service.grpc)
    grpc.channel_ready_future(channel).result(timeout=30)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)

    # the replica registered before its application ran: a drain issued at once waits for it
    assert len(ray.get(drain.control().status.remote())["replicas"]) == 1
    other = drain.drain(0.0, node="192.0.2.1")  # an order for another node concerns no replica here
    assert other == {"replicas": [], "reports": {}, "missing": []}
    r = requests.post(service.http + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=CALL_S)
    assert r.status_code == 200, r.text

    http, rpc = {}, {}
    events = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=_http_stream, args=(service.http, http, events[0])),
        threading.Thread(target=_grpc_stream, args=(stub, rpc, events[1])),
    ]
    for t in threads:
        t.start()
    assert all(e.wait(CALL_S) for e in events)  # both streams are running

    result = drain.drain(0.0)  # no time left: what runs is aborted at once
    for t in threads:
        t.join(CALL_S)

    assert result["missing"] == [] and len(result["replicas"]) == 1
    assert sum(result["reports"].values()) == 2, result
    assert http["status"] == 200 and http["events"][-1] == "data: [DONE]"
    last = json.loads(http["events"][-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort", last
    assert last["viasd_stats"]["stopped_by"] == "drain"
    http_tokens = [
        t for e in http["events"][:-1] for t in json.loads(e.removeprefix("data: "))["choices"][0]["token_ids"]
    ]
    assert 0 < len(http_tokens) < LONG
    assert "error" not in rpc, rpc.get("error")
    assert rpc["responses"][-1].finish_reason == pb.FINISH_REASON_ABORT and rpc["responses"][-1].request_id
    assert 0 < sum(len(r.token_ids) for r in rpc["responses"]) < LONG

    r = requests.post(service.http + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=CALL_S)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2])), timeout=CALL_S))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


def test_viasd_drain_joins_the_running_cluster_and_every_replica_reports(service, ray_session):
    """The preStop hook's command, in its own process, against the cluster the tests run on: a
    second order reaches the (already drained) replica, which reports nothing left to abort."""
    address = ray_session.get_runtime_context().gcs_address
    proc = subprocess.run(
        [sys.executable, "-m", "viasd.cli", "drain", "--address", address, "--timeout-s", "5", "--this-node"],
        capture_output=True,
        text=True,
        timeout=CALL_S,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["replicas"]) == 1 and result["missing"] == []
    assert list(result["reports"].values()) == [0]  # nothing was running


def test_sigterm_drains_viasd_serve_and_leaves_no_process(tmp_path):
    """`viasd serve` (its own local Ray) under SIGTERM: a stream still running past
    limits.drain_timeout_s ends with an `abort` chunk and [DONE], the process reports the drain,
    exits 0 and leaves none of its child processes (Ray, Serve, the actors)."""
    import os
    import signal
    import time

    import psutil
    import yaml

    verifier = tiny_model("llama", dtype=torch.float32)
    verifier.config.max_position_embeddings = LONG + 512
    for name, model in (("verifier", verifier), ("drafter", drafter_from(verifier))):
        model.save_pretrained(tmp_path / name)
    port = listen_port()
    config = {
        "pipelines": [
            {
                "name": "tiny",
                "engine": {
                    "verifier": str(tmp_path / "verifier"),
                    "drafter": str(tmp_path / "drafter"),
                    "dtype": "float32",
                    "threads": 1,
                },
                "drafter_cpus": 0.5,
                "verifier_cpus_per_rank": 0.5,
            }
        ],
        "http": {"port": port},
        "grpc": {"enabled": False},
        "metrics": {"ray_export": False},
        "limits": {"drain_timeout_s": 1},
        "ray": {"num_cpus": 4},
    }
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "viasd.cli", "serve", "--config", str(tmp_path / "serve.yaml")],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not any("OpenAI-compatible HTTP API" in x for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        out: dict = {}
        started = threading.Event()
        stream = threading.Thread(target=_http_stream, args=(f"http://127.0.0.1:{port}", out, started))
        stream.start()
        assert started.wait(CALL_S) and out.get("status") == 200
        proc.send_signal(signal.SIGTERM)
        stream.join(CALL_S)
        assert proc.wait(timeout=CALL_S) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        assert out["events"][-1] == "data: [DONE]"
        last = json.loads(out["events"][-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "abort" and last["viasd_stats"]["stopped_by"] == "drain"
        served_log = (tmp_path / "serve.log").read_text()
        assert "drained 1 replica(s), 1 request(s) aborted" in served_log, served_log[-3000:]
        deadline = time.monotonic() + 60
        while [c for c in children if process_alive(c)]:
            assert time.monotonic() < deadline, "child processes left after exit"
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def test_viasd_serve_model_with_vllm_flags_and_an_api_key(tmp_path):
    """`viasd serve MODEL --max-num-seqs 8 --api-key KEY` (a small file for Ray's own settings):
    the model is served under its flags; a request without the key is refused, one with it served."""
    import os
    import signal
    import time

    import requests
    import yaml

    tiny_model("llama", dtype=torch.float32).save_pretrained(tmp_path / "model")
    port = listen_port()
    base = {"grpc": {"enabled": False}, "metrics": {"ray_export": False}, "ray": {"num_cpus": 2}}
    (tmp_path / "ray.yaml").write_text(yaml.safe_dump(base))
    argv = [str(tmp_path / "model"), "--drafter", "none", "--max-num-seqs", "8", "--dtype", "float32"]
    argv += ["--api-key", "sesame", "--port", str(port), "--backend", "local", "--config", str(tmp_path / "ray.yaml")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "VIASD_API_TOKEN"))}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "viasd.cli", "serve", *argv], stdout=log, stderr=log, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": "default", "prompt": [5, 6, 7], "max_tokens": 4, "mode": "ar"}
    try:
        deadline = time.monotonic() + 300
        while "OpenAI-compatible HTTP API" not in (tmp_path / "serve.log").read_text():  # (printed once serving)
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        refused = requests.post(url, json=body, timeout=CALL_S)
        assert refused.status_code == 401
        served = requests.post(url, json=body, headers={"Authorization": "Bearer sesame"}, timeout=CALL_S)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=CALL_S) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
