"""The Ray Serve application: one deployment per pipeline, one replica = one whole pipeline.

A replica starts its pipeline (Ray actors, or the in-process engine) in its constructor and serves
it through one request handler (`cluster/handler.py`: defaults, admission, drain and metrics shared
by both transports): gRPC through Serve's gRPC proxy (`grpc_api.GenerationServicer`, which checks
the HTTP API's bearer token, and the standard health service, no token), HTTP through Serve's HTTP
proxy (the OpenAI-compatible app of `openai_api`).

Autoscaling adds or removes whole pipelines. Faults are repaired inside the replica first
(`Pipeline.supervise`); `check_health` reports the replica unhealthy, and Serve replaces it, only
when the pipeline stays down longer than a rebuild may take (`PipelineConfig.start_timeout_s`) or
rebuilding is off.

    serve.start(http_options=..., grpc_options=grpc_options(config))
    serve.run(build_app(config), name=config.app_name, route_prefix="/")

KubeRay (serveConfigV2): import path `viasd.cluster.app:app_builder`, `grpc_servicer_functions:
GRPC_SERVICERS` (docs/SERVING.md, "Architecture").
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.config import gRPCOptions

from viasd.cluster import drain
from viasd.cluster.grpc_api import HEALTH_SERVICES, GenerationServicer, GRPCStatus, health_status, set_status
from viasd.cluster.handler import Backend, RequestHandler, model_names
from viasd.cluster.local import LocalPipeline
from viasd.cluster.openai_api import build_http_app
from viasd.cluster.pipeline import Pipeline
from viasd.cluster.security import read_token
from viasd.cluster.serve_config import ServeConfig, capacity_summary, load_serve_config, parse_serve_config
from viasd.cluster.serving_metrics import ServingMetrics

logger = logging.getLogger("viasd.serve")

#: The servicer function Serve's gRPC proxy registers (importable wherever Serve runs).
GRPC_SERVICER = "viasd.v1.generation_pb2_grpc.add_GenerationServiceServicer_to_server"
#: The standard gRPC health service, routed by the proxy to the replica's `Check`.
HEALTH_SERVICER = "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"
GRPC_SERVICERS = [GRPC_SERVICER, HEALTH_SERVICER]

#: Deployment options every pipeline starts from; build_app overrides them from the ServeConfig.
DEPLOYMENT_DEFAULTS: dict[str, Any] = {
    "health_check_period_s": 10.0,
    "health_check_timeout_s": 60.0,
    "graceful_shutdown_wait_loop_s": 2.0,
    "graceful_shutdown_timeout_s": 30.0,
}


@serve.deployment(**DEPLOYMENT_DEFAULTS)
@serve.ingress()
class PipelineDeployment:
    """One replica = one pipeline; gRPC methods for Serve's gRPC proxy and the OpenAI HTTP API."""

    async def __init__(self, config: dict, pipeline: str | None = None):
        self.config = parse_serve_config(config)
        pc = self.config.pipeline(pipeline)
        self.name = pc.name
        backend = LocalPipeline if self.config.backend == "local" else Pipeline
        self.pipeline: Backend = await backend.start(pc)
        limits, options = self.config.limits, self.config.metrics
        self.server = RequestHandler(
            self.pipeline,
            default_params=self.config.default_params,
            metrics=ServingMetrics(model_names(pc)[0], enabled=options.enabled, ray_export=options.ray_export),
            max_concurrent_requests=running_limit(self.config, pc.name, self.pipeline),
            max_queued_requests=limits.max_queued_requests,
            max_tokens_default=limits.max_tokens_default,
        )
        self.servicer = GenerationServicer.over({pc.name: self.server}, pc.name)  # gRPC over the same handler
        http = self.config.http  # one token for both ports; None: authentication off
        self.token = read_token(http.token_file, http.token_env, field="http.token_file")
        # repairs the pipeline in place (actors backend, rebuild_actors on)
        self._supervisor = asyncio.ensure_future(self.pipeline.supervise()) if pc.rebuild_actors else None
        self._rebuild_grace_s = pc.start_timeout_s
        self._down_since: float | None = None
        # `viasd drain` / SIGTERM of `viasd serve` (cluster/drain.py): drain, then end the rest with `abort`
        self._replica_id = f"{pc.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        registered = asyncio.Event()
        self._drain_watch = asyncio.ensure_future(drain.watch(self._replica_id, self.server.calls.drain, registered))
        try:  # serve only once a drain would wait for this replica
            await asyncio.wait_for(registered.wait(), pc.start_timeout_s)
        except TimeoutError:
            raise RuntimeError(
                f"pipeline {pc.name}: the drain control actor did not register this replica within "
                f"start_timeout_s={pc.start_timeout_s:g}s"
            ) from None
        logger.info("pipeline %s ready: %s", pc.name, self.pipeline.info())

    def __serve_build_asgi_app__(self):
        """Serve's hook, called after the constructor: this replica's own FastAPI app."""
        return build_http_app(self.server, self.token)

    # ------------------------------------------------------------------ gRPC (Serve's gRPC proxy)

    async def Generate(self, request, grpc_context=None):
        """viasd.v1.GenerationService/Generate: the shared servicer over this replica's handler."""
        async for response in self.servicer.Generate(request, grpc_context, token=self.token):
            yield response

    async def ListModels(self, request, grpc_context=None):
        """viasd.v1.GenerationService/ListModels."""
        return await self.servicer.ListModels(request, grpc_context, token=self.token)

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1.Health/Check: this replica's pipeline health, as the standalone server
        reports it (needs no token; Serve's proxy ends a call naming an unknown application)."""
        if request.service not in HEALTH_SERVICES:
            set_status(grpc_context, grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
            raise GRPCStatus(request.service)
        ok, _ = await self.server.health()
        return health_pb2.HealthCheckResponse(status=health_status(ok and not self.server.calls.draining))

    # ------------------------------------------------------------------ Serve hooks

    async def pipeline_status(self) -> dict:
        """For operators (through a Serve handle): this replica's process and health, and its
        pipeline's `status()` (actors' processes, rebuilds, requests taken)."""
        ok, detail = await self.server.health()
        return {"replica_pid": os.getpid(), "healthy": ok, "health": detail, **self.pipeline.status()}

    async def check_health(self) -> None:
        """Serve's replica health check: raises when the pipeline is down and its supervisor has not
        brought it back within a rebuild's time (start_timeout_s); Serve then replaces the replica."""
        ok, detail = await self.server.health()
        if ok:
            self._down_since = None
            return
        now = time.monotonic()
        self._down_since = self._down_since or now
        if self._supervisor is not None and not self._supervisor.done():
            self.pipeline.wake()  # probe and rebuild now rather than at the next period
            if now - self._down_since < self._rebuild_grace_s:
                logger.warning(
                    "pipeline %s down for %.0fs, being rebuilt in place: %s",
                    self.name,
                    now - self._down_since,
                    detail.get("error"),
                )
                return
        raise RuntimeError(f"pipeline {self.name} unhealthy: {detail.get('error')}")

    async def __del__(self):
        if getattr(self, "_supervisor", None) is not None:
            self._supervisor.cancel()
        if getattr(self, "_drain_watch", None) is not None:
            self._drain_watch.cancel()
            await drain.unregister(self._replica_id)
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None:
            await pipeline.shutdown()


def deployment_options(config: ServeConfig, pipeline: str | None = None) -> dict[str, Any]:
    """Serve options of a pipeline deployment from the config (on top of DEPLOYMENT_DEFAULTS).

    max_ongoing_requests leaves room above the replica's own limits, so that requests past
    them reach the replica and are refused with 429 / RESOURCE_EXHAUSTED instead of waiting
    without bound in the router; the autoscaler counts decoding + queued requests.
    """
    limits = config.limits
    return {
        "autoscaling_config": config.autoscaling.serve_config(),
        "max_ongoing_requests": config.max_running(pipeline) + limits.max_queued_requests + 8,
        "graceful_shutdown_timeout_s": limits.drain_timeout_s,
        "ray_actor_options": {"num_cpus": config.ray.replica_num_cpus},
    }


def running_limit(config: ServeConfig, name: str, pipeline: Backend) -> int:
    """The started pipeline's admission limit (`ServeConfig.max_running`), logged with what its
    KV caches hold, as vLLM logs its maximum concurrency (`capacity_summary`)."""
    running = config.max_running(name)
    capacity = pipeline.info().get("capacity") or {}
    logger.info(capacity_summary(name, capacity, running, bool(config.limits.max_concurrent_requests)))
    return running


def build_app(config: ServeConfig, pipeline: str | None = None):
    """The Serve application of one pipeline (default: the config's default pipeline)."""
    name = config.pipeline(pipeline).name
    deployment = PipelineDeployment.options(name=f"pipeline-{name}", **deployment_options(config, name))
    return deployment.bind(config.model_dump(mode="json"), name)


def app_builder(args: dict[str, Any]):
    """Serve's application builder (KubeRay serveConfigV2 `import_path: viasd.cluster.app:app_builder`).

    args: `{config: path}` to a serve.yaml, or ServeConfig fields inline; `pipeline: NAME` picks
    the pipeline this application serves (default: the config's default pipeline).
    """
    args = dict(args or {})
    pipeline = args.pop("pipeline", None)
    path = args.pop("config", None)
    config = load_serve_config(path) if path else parse_serve_config(args)
    if path and args:
        config = parse_serve_config({**config.model_dump(mode="json"), **args})
    return build_app(config, pipeline)


def http_options(config: ServeConfig) -> dict[str, Any]:
    opts: dict[str, Any] = {"host": config.http.host, "port": config.http.port}
    if config.http.tls_cert_file:  # Serve's proxy (uvicorn) then serves HTTPS only
        opts.update(ssl_certfile=config.http.tls_cert_file, ssl_keyfile=config.http.tls_key_file)
    if config.limits.request_timeout_s:
        opts["request_timeout_s"] = config.limits.request_timeout_s
    return opts


def grpc_options(config: ServeConfig):
    """Serve's gRPC proxy options (None when gRPC is disabled)."""
    if not config.grpc.enabled:
        return None
    return gRPCOptions(
        port=config.grpc.port, grpc_servicer_functions=GRPC_SERVICERS, request_timeout_s=config.grpc.request_timeout_s
    )
