"""The serving configuration: one pydantic model, loadable from YAML, a description on every field.

    config = load_serve_config("cluster/serve.yaml")   # InvalidParameterError names a bad field
    config.pipeline("default")                          # a PipelineConfig

What it decides: the pipelines (each a drafter + verifier group + coordinator: models, mask
artifact, TP size and backend), which one answers requests that name no model, default request
parameters, the HTTP and gRPC ports, per-replica limits, autoscaling of whole pipelines, metrics,
and the local Ray cluster that `viasd serve` starts. KubeRay's serveConfigV2 passes the same
fields (or `config: path/to/serve.yaml`) as the application's `args`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from viasd.cluster.pipeline import PipelineConfig, StrictModel
from viasd.config import invalid_from_validation, parse_params
from viasd.errors import InvalidParameterError


def capacity_summary(name: str, capacity: dict, running: int, explicit: bool) -> str:
    """The start-up line of a pipeline: what its KV caches hold (`Capacity.describe`), as vLLM
    logs its maximum concurrency, and the requests it decodes at once (`ServeConfig.max_running`)."""
    paged = capacity.get("kv_blocks") is not None
    return (
        f"pipeline {name!r}: KV caches hold {capacity.get('kv_tokens')} positions "
        f"({capacity.get('concurrency')} requests of {capacity.get('max_seq_len')} positions at once"
        f"{'; shorter ones admitted against the blocks they hold' if paged else ''}); "
        f"max_concurrent_requests {running}{' (limits.max_concurrent_requests)' if explicit else ''}"
    )


class HTTPOptions(StrictModel):
    """Serve's HTTP proxy (the OpenAI-compatible API, health, metrics)."""

    host: str = Field("127.0.0.1", description="Address the HTTP proxy binds; 0.0.0.0 inside a container.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of Serve's proxy.")
    route_prefix: str = Field("/", pattern=r"^/", description="Route prefix of the application (the default pipeline).")
    token_file: str | None = Field(
        None,
        description="File holding the bearer token every API request must present (Authorization: Bearer); "
        "/health and /metrics stay open. Read by each replica.",
    )
    token_env: str | None = Field(
        "VIASD_API_TOKEN",
        description="Environment variable holding the token when token_file is unset (the Helm "
        "chart sets it from a Secret); unset or empty: no authentication. null: never read the environment.",
    )
    tls_cert_file: str | None = Field(
        None, description="PEM certificate chain of the HTTP proxy; with tls_key_file it serves HTTPS only."
    )
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file.")

    @model_validator(mode="after")
    def _check_tls(self) -> HTTPOptions:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("http.tls_key_file: HTTPS needs both tls_cert_file and tls_key_file")
        return self


class GRPCOptions(StrictModel):
    """Serve's gRPC proxy (the public viasd.v1.GenerationService)."""

    enabled: bool = Field(True, description="Start Serve's gRPC proxy with viasd.v1.GenerationService.")
    port: int = Field(9000, ge=1, le=65535, description="gRPC port of Serve's proxy.")
    request_timeout_s: float | None = Field(
        None, gt=0, description="End-to-end timeout of a gRPC call; none: no limit."
    )


class Limits(StrictModel):
    """Admission control of one replica (one pipeline)."""

    max_concurrent_requests: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Requests one replica decodes at once; more wait in its queue. Default: its engine's "
        "max_batch. With paged caches (the default) the engine admits them against the KV blocks they hold, "
        "queues the rest and preempts on growth; the requests of a full context the blocks hold is logged at "
        "start and shown on /v1/models (capacity.concurrency).",
    )
    max_queued_requests: int = Field(
        16,
        ge=0,
        le=65536,
        description="Requests one replica holds waiting for a decoding slot; past it: HTTP 429 / gRPC RESOURCE_EXHAUSTED.",
    )
    request_timeout_s: float | None = Field(
        None, gt=0, description="End-to-end timeout of an HTTP request at Serve's proxy; none: no limit."
    )
    max_tokens_default: int = Field(
        2048,
        ge=1,
        le=1 << 20,
        description="A chat completion that sets no max_tokens (and no default_params.max_tokens) may generate the "
        "rest of the context, as with vLLM, but at most this many tokens: a cap on what one forgotten field costs.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="On SIGTERM (standalone server, `viasd serve`) or `viasd drain` (a pod's preStop hook): how "
        "long requests in flight may still run after new ones are refused; the rest then end with finish reason "
        "'abort'. Also the replicas' graceful_shutdown_timeout_s when Serve itself stops one.",
    )


class Autoscaling(StrictModel):
    """Autoscaling of whole pipelines (Serve replicas of the deployment): Serve's autoscaling_config."""

    min_replicas: int = Field(1, ge=0, description="Fewest pipelines kept running (0 allows scale to zero).")
    max_replicas: int = Field(1, ge=1, description="Most pipelines (each needs its own drafter and verifier group).")
    initial_replicas: int | None = Field(None, ge=0, description="Pipelines at start; default: min_replicas.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Requests per replica (decoding + queued) the autoscaler aims at."
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="How long the load must stay high before adding a pipeline.")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long the load must stay low before removing one.")

    @model_validator(mode="after")
    def _check(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        return self

    def serve_config(self) -> dict:
        """Serve's `autoscaling_config` (the same field names; initial_replicas only when set)."""
        return self.model_dump(exclude_none=True)


class MetricsOptions(StrictModel):
    """Prometheus metrics (cluster/serving_metrics.py)."""

    enabled: bool = Field(True, description="Record metrics and serve them at GET /metrics of each replica.")
    ray_export: bool = Field(
        True, description="Also record them through Ray's metrics agent (cluster-wide export on Ray's metrics port)."
    )


#: Ray's and Serve's periodic loops, slowed for the local Ray that `viasd serve` (and the standalone
#: server) start: each wake-up stalls the model's OpenMP team (docs/ARCHITECTURE.md, "Threads"), and
#: costs at most its period in reaction time.
QUIET_CONTROL_PLANE = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # Serve controller's loop (Ray's default 0.1 s)
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",  # replicas' and proxies' metrics into Ray's (100 ms)
    "RAY_raylet_report_resources_period_milliseconds": "1000",  # raylet -> GCS resource reports (100 ms)
    "RAY_raylet_check_gc_period_milliseconds": "1000",  # raylet's memory-pressure check (100 ms)
}


def apply_control_plane_env(env: dict[str, str]) -> None:
    """Set `env` in this process's environment, which a local Ray started next passes to its
    daemons and workers; a variable the environment already sets wins."""
    for key, value in env.items():
        os.environ.setdefault(key, value)


class RayOptions(StrictModel):
    """The Ray cluster `viasd serve` joins or starts (KubeRay brings its own)."""

    address: str | None = Field(None, description="Address of a running Ray cluster; none: start a local one.")
    num_cpus: int | None = Field(
        None,
        ge=1,
        description="Logical CPUs of the local Ray (actor slots, not cores); default: enough for every pipeline's actors.",
    )
    replica_num_cpus: float = Field(
        0.0,
        ge=0,
        description="CPUs the Serve replica (the ingress of one pipeline) reserves; its actors reserve their own.",
    )
    include_dashboard: bool = Field(False, description="Start Ray's dashboard with the local Ray.")
    control_plane_env: dict[str, str] = Field(
        default_factory=lambda: dict(QUIET_CONTROL_PLANE),
        description="Environment of the local Ray's daemons and workers (RAY_* variables only), set before it "
        "starts; a variable already in the environment wins. Default: Ray's and Serve's periodic loops slowed "
        "(QUIET_CONTROL_PLANE) so that fewer wake-ups share the model's cores; {}: Ray's own defaults. Not "
        "used with `address` (a running cluster has its environment; on KubeRay, the chart's extraEnv).",
    )

    @field_validator("control_plane_env")
    @classmethod
    def _ray_variables(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [k for k in env if not k.startswith("RAY_")]
        if bad:
            raise ValueError(f"only Ray's variables (RAY_*) belong here, not {', '.join(sorted(bad))}")
        return env


class ServeConfig(StrictModel):
    """Everything `viasd serve` and the KubeRay application need to serve via-sd."""

    app_name: str = Field("viasd", min_length=1, description="Serve application name (gRPC `application` metadata).")
    pipelines: list[PipelineConfig] = Field(
        default_factory=lambda: [PipelineConfig()],
        min_length=1,
        description="The pipelines served (one Serve deployment each; a replica is one whole pipeline).",
    )
    default_model: str | None = Field(
        None, description="Pipeline name that serves requests naming no model; default: the first pipeline."
    )
    backend: Literal["actors", "local"] = Field(
        "actors",
        description="'actors': drafter, verifier group and coordinator as Ray actors (the design); "
        "'local': the engine inside the replica process (single process, CPU development).",
    )
    default_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Server-side defaults of viasd.config.GenerationParams fields (mode, max_tokens, gamma, ...); "
        "a request's own values win.",
    )
    http: HTTPOptions = Field(default_factory=HTTPOptions, description="HTTP proxy: OpenAI-compatible API.")
    grpc: GRPCOptions = Field(default_factory=GRPCOptions, description="gRPC proxy: viasd.v1.GenerationService.")
    limits: Limits = Field(default_factory=Limits, description="Per-replica admission limits.")
    autoscaling: Autoscaling = Field(default_factory=Autoscaling, description="Autoscaling of whole pipelines.")
    metrics: MetricsOptions = Field(default_factory=MetricsOptions, description="Prometheus metrics.")
    ray: RayOptions = Field(default_factory=RayOptions, description="Ray cluster used by `viasd serve`.")

    @field_validator("default_params")
    @classmethod
    def _check_params(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            parse_params(v)
        except InvalidParameterError as exc:
            raise ValueError(f"default_params.{exc.field}: {exc.message}") from None
        return v

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        names = [p.name for p in self.pipelines]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"pipelines: names must be unique, repeated: {dup}")
        if self.default_model is not None and self.default_model not in names:
            raise ValueError(f"default_model: {self.default_model!r} is not a pipeline name (have {names})")
        if self.grpc.enabled and self.grpc.port == self.http.port:
            raise ValueError(f"grpc.port: {self.grpc.port} is also the HTTP port")
        return self

    @property
    def default_pipeline(self) -> str:
        return self.default_model or self.pipelines[0].name

    def max_running(self, name: str | None = None) -> int:
        """Requests a replica of pipeline `name` decodes at once: limits.max_concurrent_requests, else
        the engine's max_batch (its cache rows, vLLM's max_num_seqs). The full-context requests the
        KV blocks hold (`Capacity.concurrency`, `capacity_summary`) is a figure, not a limit."""
        return self.limits.max_concurrent_requests or self.pipeline(name).engine.max_batch

    def pipeline(self, name: str | None = None) -> PipelineConfig:
        name = name or self.default_pipeline
        for p in self.pipelines:
            if p.name == name:
                return p
        raise InvalidParameterError("model", f"no pipeline named {name!r} (have {[p.name for p in self.pipelines]})")

    def route_prefix(self, name: str) -> str:
        """The default pipeline is served at http.route_prefix, every other one under /<name>."""
        if name == self.default_pipeline:
            return self.http.route_prefix
        return self.http.route_prefix.rstrip("/") + "/" + name


def parse_serve_config(values: dict[str, Any] | None = None, *, source: str | None = None) -> ServeConfig:
    """Validate a serving configuration; InvalidParameterError names the bad field (dotted path)."""
    try:
        return ServeConfig.model_validate(values or {})
    except ValidationError as exc:
        err = invalid_from_validation(exc)
        field, message = err.field, err.message
        named = re.match(r"^([A-Za-z_][\w.]*): (.*)$", message, re.S)
        if named:  # our validators' messages start with the field they are about
            field, message = named.groups()
        raise InvalidParameterError(field, message + (f" (in {source})" if source else "")) from None


def load_serve_config(path: str | Path | None = None) -> ServeConfig:
    """The configuration in a YAML file (None: the defaults, the embedded pair on this machine)."""
    if path is None:
        return parse_serve_config({})
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InvalidParameterError("config", f"cannot read {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise InvalidParameterError("config", f"{path} is not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise InvalidParameterError("config", f"{path} must hold a mapping of ServeConfig fields")
    return parse_serve_config(data, source=str(path))
