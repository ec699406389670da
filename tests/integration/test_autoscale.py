"""Autoscaling of whole pipelines through Serve's autoscaling config.

One Serve application whose deployment starts with one replica (one pipeline: drafter actor +
verifier group + coordinator) and may grow to two. Sustained concurrent load through Serve's gRPC
proxy must make Serve add a replica, the new replica must bring up its own pipeline (a second
drafter and verifier actor), and requests must keep returning exactly the in-process engine's
tokens while the application scales. Tiny float32 LLaMA pair (no tokenizer: token ids in and out).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from conftest import listen_port, save_tiny_pair

from viasd.cluster.serve_config import parse_serve_config
from viasd.config import parse_params
from viasd.v1 import generation_pb2 as pb
from viasd.v1 import generation_pb2_grpc
from viasd.v1.convert import params_to_proto

SCALE_TIMEOUT_S = 180
PROMPT = [5, 17, 3, 88, 41, 9]
PARAMS = dict(mode="sd", gamma=4, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    engine = save_tiny_pair(tmp_path_factory.mktemp("autoscale-models")).model_dump(mode="json")
    return parse_serve_config(
        {
            "pipelines": [{"name": "tiny", "engine": engine, "drafter_cpus": 0.25, "verifier_cpus_per_rank": 0.25}],
            "http": {"port": listen_port()},
            "grpc": {"port": listen_port()},
            "limits": {"max_concurrent_requests": 2, "max_queued_requests": 16},
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 2,
                "target_ongoing_requests": 1,
                "upscale_delay_s": 0,
                "downscale_delay_s": 600,
            },
            "ray": {"replica_num_cpus": 0.25},
            "metrics": {"ray_export": False},
        }
    )


@pytest.fixture(scope="module")
def service(config, ray_session):
    from ray import serve

    from viasd.cluster import launch

    endpoints = launch.start(config, blocking_timeout_s=240)
    yield endpoints
    serve.shutdown()


def _running_replicas(app: str) -> int:
    from ray import serve

    deployments = serve.status().applications[app].deployments
    return sum(d.replica_states.get("RUNNING", 0) for d in deployments.values())


def _pipelines() -> int:
    """Placement groups in place: each pipeline reserves one (drafter + verifier ranks)."""
    from ray.util import placement_group_table

    return sum(pg["state"] == "CREATED" and len(pg["bundles"]) == 2 for pg in placement_group_table().values())


def test_load_adds_a_whole_pipeline_and_outputs_stay_exact(service, config):
    from viasd.llm import LLM

    want = LLM(config.pipelines[0].engine).complete(PROMPT, parse_params(**PARAMS)).token_ids
    app = service.apps["tiny"]
    assert _running_replicas(app) == 1
    pipelines_before = _pipelines()
    assert pipelines_before >= 1

    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=PROMPT), params=params_to_proto(parse_params(**PARAMS))
    )
    results: list[list[int]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def stream_forever():
        with grpc.insecure_channel(service.grpc) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            while not stop.is_set():
                try:
                    results.append([t for r in stub.Generate(request, timeout=120) for t in r.token_ids])
                except grpc.RpcError as exc:  # collected and asserted on below
                    errors.append(exc)
                    return

    threads = [threading.Thread(target=stream_forever, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + SCALE_TIMEOUT_S
    try:
        while _running_replicas(app) < 2 and time.monotonic() < deadline and not errors:
            time.sleep(1.0)
        scaled = _running_replicas(app)
        served_before_scale = len(results)
        # keep the load on until the new replica has served too
        while len(results) < served_before_scale + 8 and time.monotonic() < deadline and not errors:
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(150)

    assert not errors, errors[:1]
    assert scaled == 2, f"no second replica after {SCALE_TIMEOUT_S}s of load"
    assert _pipelines() == pipelines_before + 1  # the new replica brought up its own pipeline
    assert results and all(r == want for r in results), "a stream differed from the in-process engine"
    # both replicas' pipelines served requests: the new one took part of the load
    served = _requests_per_replica(app)
    assert len(served) == 2 and all(n > 0 for n in served.values()), served


def _requests_per_replica(app: str, calls: int = 64) -> dict[int, int]:
    """{replica pid: requests its pipeline's coordinator took}, from pipeline_status calls that the
    router spreads over the replicas (stops once two replicas have answered)."""
    from ray import serve

    handle = serve.get_app_handle(app)
    seen: dict[int, int] = {}
    for _ in range(calls):
        status = handle.pipeline_status.remote().result(timeout_s=60)
        seen[status["replica_pid"]] = status["requests"]
        if len(seen) == 2:
            break
    return seen
