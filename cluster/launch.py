"""Launch: a local Ray (or a given cluster), Serve's HTTP and gRPC proxies, one application per pipeline.

`viasd serve [--config serve.yaml]` calls `serve_forever`; tests call `start` and `stop`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import HTTPOptions
from ray.serve.schema import ApplicationStatus

from viasd.cluster import drain as draining
from viasd.cluster.app import build_app, grpc_options, http_options
from viasd.cluster.serve_config import QUIET_CONTROL_PLANE, ServeConfig, apply_control_plane_env

#: After a drain, the seconds the proxies get to forward the last bytes of the streams that ended
#: (an `abort` chunk and [DONE]) before the applications are deleted; on a busy machine too short
#: a grace ends a client's stream without its last events.
FLUSH_GRACE_S = 2.0


@dataclass
class Endpoints:
    """Where the running application answers."""

    http: str  # base URL of the OpenAI-compatible API (…/v1)
    grpc: str | None  # host:port of viasd.v1.GenerationService (None: disabled)
    apps: dict[str, str]  # pipeline name -> Serve application name
    routes: dict[str, str]  # pipeline name -> HTTP route prefix

    def describe(self) -> str:
        lines = [f"OpenAI-compatible HTTP API: {self.http}/v1  (completions, chat/completions, models)"]
        lines.append(f"health: {self.http}/health   metrics: {self.http}/metrics")
        if self.grpc:
            lines.append(f"gRPC viasd.v1.GenerationService: {self.grpc}")
        for name, app in self.apps.items():
            lines.append(f"pipeline {name!r}: Serve application {app!r}, HTTP prefix {self.routes[name]!r}")
        return "\n".join(lines)


def app_name(config: ServeConfig, pipeline: str) -> str:
    """The default pipeline's application is `app_name`; others are `app_name-<pipeline>`."""
    return config.app_name if pipeline == config.default_pipeline else f"{config.app_name}-{pipeline}"


def _ray_init(config: ServeConfig) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if config.ray.address:
        ray.init(address=config.ray.address, namespace="viasd")
        return
    apply_control_plane_env(config.ray.control_plane_env)
    per_pipeline = 4 * max(p.tp_size for p in config.pipelines) + 2  # drafter, verifier ranks, coordinator, ingress
    num_cpus = config.ray.num_cpus or per_pipeline * config.autoscaling.max_replicas * len(config.pipelines)
    ray.init(
        address="local",  # a new local Ray, never a cluster some other process started on this machine
        num_cpus=num_cpus,
        include_dashboard=config.ray.include_dashboard,
        _node_ip_address="127.0.0.1",
        namespace="viasd",
        log_to_driver=True,
    )


@contextmanager
def local_ray(**options):
    """A local Ray on loopback with the servers' quieter control plane while the block runs (for
    tools that start a `Pipeline` themselves); `options` go to `ray.init`."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    apply_control_plane_env(QUIET_CONTROL_PLANE)
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", **options)
    try:
        yield
    finally:
        ray.shutdown()


def start(config: ServeConfig, *, blocking_timeout_s: float | None = None) -> Endpoints:
    """Start Ray (unless running), Serve's proxies and every pipeline's application; wait until ready."""
    _ray_init(config)
    serve.start(http_options=HTTPOptions(**http_options(config)), grpc_options=grpc_options(config))
    apps, routes = {}, {}
    names = [config.default_pipeline] + [p.name for p in config.pipelines if p.name != config.default_pipeline]
    for name in names:
        apps[name], routes[name] = app_name(config, name), config.route_prefix(name)
        serve.run(build_app(config, name), name=apps[name], route_prefix=routes[name], blocking=False)
    _wait_running(list(apps.values()), blocking_timeout_s)
    host = config.http.host if config.http.host not in ("0.0.0.0", "::") else "127.0.0.1"
    scheme = "https" if config.http.tls_cert_file else "http"
    base = f"{scheme}://{host}:{config.http.port}{config.http.route_prefix.rstrip('/')}"
    grpc_addr = f"{host}:{config.grpc.port}" if config.grpc.enabled else None
    return Endpoints(base, grpc_addr, apps, routes)


def _wait_running(apps: list[str], timeout_s: float | None) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        statuses = serve.status().applications
        states = {a: statuses[a].status if a in statuses else None for a in apps}
        bad = {a: statuses[a].message for a, s in states.items() if s == ApplicationStatus.DEPLOY_FAILED}
        if bad:
            raise RuntimeError(f"deployment failed: {bad}")
        if all(s == ApplicationStatus.RUNNING for s in states.values()):
            return
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"applications not running after {timeout_s}s: {states}")
        time.sleep(0.5)


def stop() -> None:
    """Shut Serve and the Ray this process started down."""
    try:
        serve.shutdown()
        draining.reset()
    finally:
        ray.shutdown()


def _say(message: str) -> None:
    print(f"[viasd] {message}", file=sys.stderr, flush=True)


def serve_forever(config: ServeConfig) -> int:
    """Start everything, print the endpoints, serve until Ctrl-C / SIGTERM, shut down cleanly."""
    stop_event = threading.Event()

    def trap_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop_event.set())

    trap_signals()
    pairs = ", ".join(f"{p.name}: {p.engine.verifier} <- {p.engine.drafter}" for p in config.pipelines)
    _say(f"starting {len(config.pipelines)} pipeline(s) ({config.backend} backend): {pairs}")
    try:
        endpoints = start(config)
        trap_signals()  # again: ray.init installs its own SIGTERM handler, which would skip this clean shutdown
        print(endpoints.describe(), flush=True)
        _say("serving; Ctrl-C or SIGTERM stops")
        while not stop_event.wait(0.5):
            pass
        _say(f"draining for up to {config.limits.drain_timeout_s:g}s")
        result = draining.drain(config.limits.drain_timeout_s)  # new requests refused, the rest `abort` after it
        time.sleep(FLUSH_GRACE_S)
        missing = f", no report from {result['missing']}" if result["missing"] else ""
        aborted = sum(result["reports"].values())
        _say(f"drained {len(result['reports'])} replica(s), {aborted} request(s) aborted{missing}; shutting down")
    finally:
        stop()
    return 0
