"""The public gRPC API (viasd.v1.GenerationService) over one or more pipelines.

`GenerationServicer` has two layers, so that the same code serves a standalone grpc.aio server
(`serve_grpc`) and Ray Serve's gRPC proxy:

* transport-free cores, `generate(request)` (an async iterator of GenerateResponse) and
  `list_models(request)`, which raise `InvalidParameterError` (a bad field, named) or
  `BackendError` (an internal RPC failed);
* the grpc.aio methods `Generate` / `ListModels`, which map those to status codes:
  INVALID_ARGUMENT with the message "field: what is wrong" and the field in the trailing
  metadata key ``viasd-invalid-field``; UNAVAILABLE when a backend is down or too slow;
  INTERNAL otherwise. Cancelling a Generate call cancels the request: the coordinator closes
  the drafter's and the verifier's sessions.

`serve_grpc` adds the standard gRPC health service (grpcio-health-checking): "" and
"viasd.v1.GenerationService" report SERVING once the server has started. Requests larger than
4 MiB are refused (RESOURCE_EXHAUSTED; the internal services allow 256 MB); a message that does
not parse (malformed UTF-8) is INVALID_ARGUMENT naming the field (cluster/guard.py). With an
`admission` (cluster/server.py), at most `max_concurrent_requests` decode and
`max_queued_requests` wait; past that RESOURCE_EXHAUSTED at once.

Standalone server lifecycle: every pipeline runs under `Pipeline.supervise` (a dead drafter is
restarted, a dead verifier rank rebuilds the group; health NOT_SERVING meanwhile). On SIGTERM /
SIGINT it stops accepting (health NOT_SERVING, new calls UNAVAILABLE), lets the requests in
flight finish for up to `--drain-timeout-s` (`Limits.drain_timeout_s`), ends the rest with a
last message of finish reason `abort`, then stops the actors and the Ray it started.

Standalone: ``python -m viasd.cluster.grpc_server --config pipeline.json --port 50051``, with
optional TLS / mutual TLS (``--tls-cert``, ``--tls-key``, ``--tls-client-ca``,
``--require-client-cert``) and a bearer token (``--token-file`` or env ``VIASD_API_TOKEN``), see
cluster/security.py. Ray Serve's gRPC proxy can do neither, so this server is the TLS and
authentication endpoint of the gRPC API. ``--http-port`` adds the OpenAI-compatible HTTP API
(`serve_http`: uvicorn in this process) under the same TLS settings, the same token, the same
admission limits and the same drain; it is the endpoint for mutual TLS on HTTP, which Serve's
HTTP proxy cannot require (it passes no client-certificate requirement to uvicorn).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from viasd.actors.coordinator import BackendError
from viasd.cluster.guard import MAX_REQUEST_ID_CHARS, PUBLIC_MAX_MESSAGE_BYTES, SHUTTING_DOWN, Aborted, Calls, \
    abortable, parse_request, until_aborted
from viasd.cluster.pipeline import Pipeline, PipelineConfig
from viasd.cluster.security import TOKEN_ENV, GRPCSecurity
from viasd.config import Mode
from viasd.errors import InvalidParameterError
from viasd.llm import IncrementalDetokenizer, encode_prompt
from viasd.v1 import generation_pb2 as pb
from viasd.v1 import generation_pb2_grpc
from viasd.v1.convert import FINISH_TO_PB, MODE_TO_PB, params_from_proto, stats_to_proto

log = logging.getLogger("viasd.cluster.grpc_server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name  # "viasd.v1.GenerationService"
INVALID_FIELD_KEY = "viasd-invalid-field"


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """GenerationService over named pipelines; requests naming no model go to `default`."""

    def __init__(self, pipelines: dict[str, Pipeline], default: str, *, admission=None):
        if default not in pipelines:
            raise ValueError(f"default pipeline {default!r} is not among {sorted(pipelines)}")
        self.pipelines = pipelines
        self.default = default
        self.admission = admission  # cluster.server.Admission, or None: no limit (Serve applies its own)
        self.calls = Calls()

    def in_flight(self) -> int:
        """Generate calls running (or waiting for admission) on the grpc.aio methods."""
        return len(self.calls)

    def pipeline(self, name: str) -> Pipeline:
        try:
            return self.pipelines[name or self.default]
        except KeyError:
            raise InvalidParameterError("model", f"unknown model {name!r}; served: {sorted(self.pipelines)}") from None

    # ---------------------------------------------------------------- transport-free cores

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """Validate, run the request through its pipeline's coordinator, stream the responses."""
        pipeline = self.pipeline(request.model)
        params = params_from_proto(request.params, pipeline.config.mode)
        prompt_ids = await _prompt_ids(request, pipeline.tokenizer)
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidParameterError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
        request_id = request.request_id or uuid.uuid4().hex
        detok = IncrementalDetokenizer(pipeline.tokenizer) if pipeline.tokenizer is not None else None
        async with aclosing(pipeline.coordinator.generate(request_id, prompt_ids, params)) as chunks:
            async for chunk in chunks:
                text = detok.push(chunk.token_ids, final=chunk.finished) if detok is not None else ""
                yield pb.GenerateResponse(
                    request_id=request_id,
                    text=text,
                    token_ids=chunk.token_ids,
                    finish_reason=FINISH_TO_PB[chunk.finish_reason],
                    stats=stats_to_proto(chunk.stats) if chunk.stats is not None else None,
                )

    async def list_models(self, request: pb.ListModelsRequest | None = None) -> pb.ListModelsResponse:
        models = []
        for pipeline in self.pipelines.values():
            info = dict(pipeline.info())
            info["default_mode"] = MODE_TO_PB[Mode(info["default_mode"])]
            models.append(pb.ModelInfo(**info))
        return pb.ListModelsResponse(models=models)

    # ---------------------------------------------------------------- grpc.aio methods

    async def Generate(self, request: pb.GenerateRequest | bytes, context: grpc.aio.ServicerContext):
        if self.calls.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        abort = self.calls.enter()
        admitted, queued = False, 0.0
        try:
            if isinstance(request, bytes):  # registered by serve_grpc: parsed here, bad fields named
                request = parse_request(request, pb.GenerateRequest)
            if not request.request_id:  # named now, so that an aborted stream can say which request ended
                request = named_request(request)
            if self.admission is not None:
                queued = await until_aborted(self.admission.enter(), abort)
                admitted = True
            async with aclosing(self.generate(request)) as responses:
                async for response in abortable(responses, abort):
                    if response.HasField("stats"):
                        response.stats.queue_seconds += queued
                    yield response
        except Aborted:
            yield abort_response(request.request_id)
        except Exception as exc:
            await abort_with(context, exc)
        finally:
            if admitted:
                self.admission.leave()
            self.calls.leave(abort)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        return await self.list_models(request)


def abort_response(request_id: str) -> pb.GenerateResponse:
    """The last message of a stream ended by a drain that ran out of time."""
    return pb.GenerateResponse(request_id=request_id, finish_reason=pb.FINISH_REASON_ABORT)


def named_request(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """The request with a fresh id, so that an aborted stream can say which request ended."""
    named = pb.GenerateRequest()
    named.CopyFrom(request)
    named.request_id = uuid.uuid4().hex
    return named


async def _prompt_ids(request: pb.GenerateRequest, tokenizer) -> list[int]:
    which = request.WhichOneof("input")
    if which == "prompt_token_ids":
        return list(request.prompt_token_ids.ids)
    if which == "prompt":
        return await asyncio.to_thread(encode_prompt, tokenizer, request.prompt)
    if which == "messages":
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        return await asyncio.to_thread(encode_prompt, tokenizer, None, messages)
    raise InvalidParameterError("prompt", "set one of prompt, messages or prompt_token_ids")


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple]:
    """(status code, details, trailing metadata) of an error raised by a servicer core."""
    from viasd.cluster.server import RequestError, retry_after_metadata

    if isinstance(exc, RequestError) and exc.status == 429:  # admission: the queue is full; retry later
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), retry_after_metadata()
    if isinstance(exc, InvalidParameterError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ((INVALID_FIELD_KEY, exc.field),)
    if isinstance(exc, BackendError):
        code = grpc.StatusCode.UNAVAILABLE if exc.unavailable else grpc.StatusCode.INTERNAL
        return code, str(exc), ()
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}", ()


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    code, details, metadata = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("request failed", exc_info=exc)
    await context.abort(code, details, trailing_metadata=metadata)


#: Client keepalive pings are accepted every 30 s even while no data flows (gRPC's default, 5
#: minutes, would end the connection of a client pinging more often: viasd.client pings every 60 s).
#: Public messages are bounded (PUBLIC_MAX_MESSAGE_BYTES, 4 MiB): only the internal services need 256 MB.
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", PUBLIC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", PUBLIC_MAX_MESSAGE_BYTES),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 30_000),
]


def add_generation_service(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """GenerationService with Generate receiving raw bytes (parsed by `guard.parse_request`, so that
    a malformed message is INVALID_ARGUMENT naming the field, not UNKNOWN)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=None, response_serializer=pb.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=pb.ListModelsRequest.FromString,
            response_serializer=pb.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def set_health(health, serving: bool) -> None:
    """Report both health services SERVING or NOT_SERVING (from synchronous callbacks; ignored by the
    health servicer once it entered graceful shutdown)."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", SERVICE_NAME):
        asyncio.ensure_future(health.set(service, status))


async def serve_grpc(servicer: GenerationServicer, port: int, host: str = "127.0.0.1",
                     security: GRPCSecurity | None = None) -> grpc.aio.Server:
    """Start a grpc.aio server with GenerationService and the health service on host:port (0: a
    free port). The bound port is `server.viasd_port`, the health servicer `server.viasd_health`.
    `security` (cluster/security.py) adds TLS / mutual TLS and bearer-token authentication;
    None: plaintext, no authentication."""
    security = security or GRPCSecurity(token_env=None)
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=security.interceptors())
    add_generation_service(servicer, server)
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    credentials = security.server_credentials()
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if not bound:
        raise RuntimeError(f"cannot bind the gRPC server to {host}:{port}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    server.viasd_port = bound
    server.viasd_health = health
    return server


async def serve_http(servers: dict, default: str, port: int, host: str = "127.0.0.1",
                     security: GRPCSecurity | None = None):
    """Start the OpenAI-compatible HTTP API (cluster/openai_api.py) over `servers` (pipeline name ->
    cluster.server.ReplicaServer) on host:port (0: a free port) with uvicorn in this event loop:
    the default pipeline at /, every other one under /<name> (as under Serve). `security` gives
    HTTPS (tls_cert_file / tls_key_file), client certificates (client_ca_file: verified when
    presented, required with require_client_cert — mutual TLS) and the bearer token.
    Returns the uvicorn server; its bound port is `server.viasd_port`, its task `server.viasd_task`."""
    import socket
    import ssl

    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from viasd.cluster.openai_api import build_http_app

    security = security or GRPCSecurity(token_env=None)
    token = security.token()

    def app_of(server):
        app = build_http_app()
        app.state.server = server
        app.state.token = token
        return app

    routes = [Mount(f"/{name}", app=app_of(srv)) for name, srv in servers.items() if name != default]
    routes.append(Mount("/", app=app_of(servers[default])))
    tls: dict = {}
    if security.tls:
        tls = {"ssl_certfile": str(security.tls_cert_file), "ssl_keyfile": str(security.tls_key_file)}
        if security.client_ca_file is not None:
            tls["ssl_ca_certs"] = str(security.client_ca_file)
            tls["ssl_cert_reqs"] = ssl.CERT_REQUIRED if security.require_client_cert else ssl.CERT_OPTIONAL
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot bind the HTTP server to {host}:{port}: {exc.strerror}") from None
    config = uvicorn.Config(Starlette(routes=routes), lifespan="off", access_log=False, log_level="warning",
                            timeout_graceful_shutdown=5, **tls)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # the standalone server handles SIGTERM / SIGINT itself
    server.viasd_task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if server.viasd_task.done():  # failed to start (a bad certificate file): raise its error
            server.viasd_task.result()
            raise RuntimeError("the HTTP server stopped while starting")
        await asyncio.sleep(0.01)
    server.viasd_port = sock.getsockname()[1]
    return server


# ---------------------------------------------------------------- standalone


async def _main(args: argparse.Namespace) -> None:
    import signal

    import ray

    raw = json.loads(open(args.config).read()) if args.config else {}
    configs = [PipelineConfig.parse(c) for c in (raw if isinstance(raw, list) else [raw])]
    limits = limits_from_args(args)
    security = security_from_args(args)
    description = security.describe()  # reads the token and the files now: fail before Ray starts
    started_ray = not ray.is_initialized()
    if started_ray:
        if args.ray_address:
            ray.init(address=args.ray_address)
        else:  # a local Ray on loopback, like the servers
            ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pipelines = {}
    supervisors = []
    http = None
    try:
        for config in configs:
            pipelines[config.name] = await Pipeline.start(config)
        from viasd.cluster.server import Admission, ReplicaServer

        admission = Admission(limits.max_concurrent_requests, limits.max_queued_requests)
        servicer = GenerationServicer(pipelines, configs[0].name, admission=admission)
        server = await serve_grpc(servicer, args.port, args.host, security)
        http_servers = {}
        if args.http_port is not None:  # the HTTP API shares the admission limits with gRPC
            http_servers = {name: ReplicaServer(p, name, admission=admission) for name, p in pipelines.items()}
            http = await serve_http(http_servers, configs[0].name, args.http_port, args.host, security)
        for pipeline in pipelines.values():
            supervisors.append(asyncio.ensure_future(pipeline.supervise(
                lambda ok: set_health(server.viasd_health, ok))))
        log.info("GenerationService on %s:%d (models: %s; %s)", args.host, server.viasd_port, ", ".join(pipelines),
                 description)
        print(f"serving on {args.host}:{server.viasd_port}", flush=True)
        if http is not None:
            scheme = "https" if security.tls else "http"
            log.info("OpenAI-compatible HTTP API on %s://%s:%d", scheme, args.host, http.viasd_port)
            print(f"http on {args.host}:{http.viasd_port}", flush=True)
        await stop.wait()
        in_flight = servicer.in_flight() + sum(len(s.calls) for s in http_servers.values())
        log.info("stopping: %d request(s) in flight, draining for up to %.0fs", in_flight, limits.drain_timeout_s)
        await server.viasd_health.enter_graceful_shutdown()
        aborted = await asyncio.gather(servicer.calls.drain(limits.drain_timeout_s),
                                       *(s.drain(limits.drain_timeout_s) for s in http_servers.values()))
        log.info("drained; %d request(s) aborted", sum(aborted))
        await server.stop(grace=5.0)
    finally:
        if http is not None:  # stops accepting, closes idle connections, then its task ends
            http.should_exit = True
            await http.viasd_task
        for task in supervisors:
            task.cancel()
        for pipeline in pipelines.values():
            await pipeline.shutdown()
        if started_ray:
            ray.shutdown()


def limits_from_args(args: argparse.Namespace):
    """cluster.config.Limits of the standalone server's flags (InvalidParameterError names a bad one)."""
    from viasd.cluster.config import Limits
    from viasd.config import invalid_from_validation

    values = {"max_concurrent_requests": args.max_concurrent_requests, "max_queued_requests": args.max_queued_requests,
              "drain_timeout_s": args.drain_timeout_s}
    try:
        return Limits.model_validate({k: v for k, v in values.items() if v is not None})
    except Exception as exc:
        raise invalid_from_validation(exc) from None


def security_from_args(args: argparse.Namespace) -> GRPCSecurity:
    """GRPCSecurity of the standalone server's flags (InvalidParameterError names a bad one)."""
    return GRPCSecurity.parse(tls_cert_file=args.tls_cert, tls_key_file=args.tls_key, client_ca_file=args.tls_client_ca,
                              require_client_cert=args.require_client_cert, token_file=args.token_file)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m viasd.cluster.grpc_server", description=__doc__.splitlines()[0],
                                 allow_abbrev=False)  # "--token" must not pass for "--token-file"
    ap.add_argument("--config", help="JSON file: one PipelineConfig object, or a list (the first is the default)")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=None,
                    help="also serve the OpenAI-compatible HTTP API on this port (0: a free one), with the same TLS, "
                         "token, limits and drain (default: gRPC only)")
    ap.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start a local one)")
    lim = ap.add_argument_group("limits (cluster.config.Limits; defaults there)")
    lim.add_argument("--max-concurrent-requests", type=int, help="requests decoding at once")
    lim.add_argument("--max-queued-requests", type=int, help="requests waiting; past it RESOURCE_EXHAUSTED")
    lim.add_argument("--drain-timeout-s", type=float,
                     help="on SIGTERM: seconds in-flight requests may still run before they are aborted")
    sec = ap.add_argument_group("security (cluster/security.py; default: plaintext, no authentication)")
    sec.add_argument("--tls-cert", help="PEM certificate chain of the server: turns TLS on (with --tls-key)")
    sec.add_argument("--tls-key", help="PEM private key of --tls-cert")
    sec.add_argument("--tls-client-ca", help="PEM CA bundle verifying client certificates (mutual TLS)")
    sec.add_argument("--require-client-cert", action="store_true", help="refuse clients without a certificate")
    sec.add_argument("--token-file", help=f"file holding the bearer token every call must present (default: env "
                                          f"{TOKEN_ENV}; unset: no authentication)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
