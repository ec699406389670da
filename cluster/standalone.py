"""The standalone server: the public gRPC API and, optionally, the OpenAI HTTP API, outside Ray Serve.

    python -m viasd.cluster.standalone --config pipeline.json --port 9000 [--http-port 8000]

It starts (or joins) Ray and each pipeline of the config, makes one `handler.RequestHandler` per
pipeline (one admission limit and one drain shared by all of them and by both transports) and
serves them with `grpc_api.GenerationServicer` and the standard health service on a grpc.aio
server (`serve_grpc`) and, with ``--http-port``, the app of `openai_api` on uvicorn in the same
event loop (`serve_http`). TLS, mutual TLS and the bearer token (cluster/security.py) apply to
both ports: Serve's proxies can do neither mutual TLS nor (for gRPC) interceptors.

Every pipeline runs under `Pipeline.supervise` (health NOT_SERVING while it is rebuilt). On
SIGTERM / SIGINT it drains (`Limits.drain_timeout_s`: new calls refused, the rest ended with
finish reason `abort`), then stops the actors and the Ray it started (docs/SERVING.md, "The
pipeline and the standalone gRPC server").
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import signal
import socket
import ssl

import grpc
import ray
import uvicorn
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2_grpc
from starlette.applications import Starlette
from starlette.routing import Mount

from viasd.actors.rpc import start_server
from viasd.cluster.grpc_api import HEALTH_SERVICES, SERVICE_NAME, GenerationServicer, health_status
from viasd.cluster.guard import PUBLIC_MAX_MESSAGE_BYTES
from viasd.cluster.handler import Admission
from viasd.cluster.openai_api import build_http_app
from viasd.cluster.pipeline import Pipeline, PipelineConfig
from viasd.cluster.security import TOKEN_ENV, GRPCSecurity
from viasd.cluster.serve_config import QUIET_CONTROL_PLANE, Limits, apply_control_plane_env, capacity_summary
from viasd.config import parse_params
from viasd.errors import InvalidParameterError
from viasd.v1 import generation_pb2 as pb

log = logging.getLogger("viasd.cluster.standalone")

#: Client keepalive pings are accepted every 30 s even while no data flows (gRPC's default, 5
#: minutes, would end the connection of a client pinging more often: viasd.client pings every 60 s).
#: Public messages are bounded (PUBLIC_MAX_MESSAGE_BYTES, 4 MiB): only the internal services need 256 MB.
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", PUBLIC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", PUBLIC_MAX_MESSAGE_BYTES),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 30_000),
]


def add_generation_service(servicer: GenerationServicer, server: grpc.aio.Server, token: str | None = None) -> None:
    """GenerationService with Generate receiving raw bytes (parsed by `guard.parse_request`, so that
    a malformed message is INVALID_ARGUMENT naming the field, not UNKNOWN); every call must carry
    the bearer token `token` (None: no authentication)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            functools.partial(servicer.Generate, token=token),
            request_deserializer=None,
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            functools.partial(servicer.ListModels, token=token),
            request_deserializer=pb.ListModelsRequest.FromString,
            response_serializer=pb.ListModelsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def set_health(health, serving: bool) -> None:
    """Report both health services SERVING or NOT_SERVING (from synchronous callbacks; ignored by the
    health servicer once it entered graceful shutdown)."""
    for service in HEALTH_SERVICES:
        asyncio.ensure_future(health.set(service, health_status(serving)))


async def serve_grpc(
    servicer: GenerationServicer, port: int, host: str = "127.0.0.1", security: GRPCSecurity | None = None
) -> grpc.aio.Server:
    """Start a grpc.aio server with GenerationService and the health service on host:port (0: a free
    port), with `security`'s TLS / mutual TLS and bearer token (None: plaintext, no authentication).
    The bound port is `server.viasd_port`, the health servicer `server.viasd_health`."""
    security = security or GRPCSecurity(token_env=None)
    health = grpc_health.aio.HealthServicer()

    def add(server: grpc.aio.Server) -> None:
        add_generation_service(servicer, server, security.token())
        health_pb2_grpc.add_HealthServicer_to_server(health, server)

    server, bound = await start_server(
        add, host, port, credentials=security.server_credentials(), options=SERVER_OPTIONS
    )
    for service in HEALTH_SERVICES:
        await health.set(service, health_status(True))
    server.viasd_port = bound
    server.viasd_health = health
    return server


async def serve_http(
    servers: dict, default: str, port: int, host: str = "127.0.0.1", security: GRPCSecurity | None = None
):
    """Start the OpenAI-compatible HTTP API over `servers` (pipeline name -> RequestHandler) on
    host:port (0: a free port) with uvicorn in this event loop: the default pipeline at /, every other
    one under /<name> (as under Serve), with `security`'s TLS, client certificates and bearer token.
    Returns the uvicorn server; its bound port is `server.viasd_port`, its task `server.viasd_task`."""
    security = security or GRPCSecurity(token_env=None)
    token = security.token()
    routes = [Mount(f"/{name}", app=build_http_app(srv, token)) for name, srv in servers.items() if name != default]
    routes.append(Mount("/", app=build_http_app(servers[default], token)))
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
    config = uvicorn.Config(
        Starlette(routes=routes),
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=5,
        **tls,
    )
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
    raw = json.loads(open(args.config).read()) if args.config else {}
    configs = [PipelineConfig.parse(c) for c in (raw if isinstance(raw, list) else [raw])]
    limits = limits_from_args(args)
    default_params = default_params_from_args(args)
    security = GRPCSecurity.parse(
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        client_ca_file=args.tls_client_ca,
        require_client_cert=args.require_client_cert,
        token_file=args.token_file,
    )
    description = security.describe()  # reads the token and the files now: fail before Ray starts
    started_ray = not ray.is_initialized()
    if started_ray:
        if args.ray_address:
            ray.init(address=args.ray_address)
        else:  # a local Ray on loopback, like the servers, with their quieter control plane
            apply_control_plane_env(QUIET_CONTROL_PLANE)
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
        # one handler per pipeline; all of them and both transports share one admission and one drain,
        # by default of every pipeline's max_batch together (as ServeConfig.max_running)
        running = limits.max_concurrent_requests or sum(c.engine.max_batch for c in configs)
        for c, p in zip(configs, pipelines.values()):
            log.info(
                capacity_summary(c.name, p.info().get("capacity") or {}, running, bool(limits.max_concurrent_requests))
            )
        servicer = GenerationServicer(
            pipelines,
            configs[0].name,
            admission=Admission(running, limits.max_queued_requests),
            default_params=default_params,
            max_tokens_default=limits.max_tokens_default,
        )
        server = await serve_grpc(servicer, args.port, args.host, security)
        if args.http_port is not None:
            http = await serve_http(servicer.handlers, configs[0].name, args.http_port, args.host, security)
        on_health = functools.partial(set_health, server.viasd_health)
        supervisors.extend(asyncio.ensure_future(p.supervise(on_health)) for p in pipelines.values())
        log.info(
            "GenerationService on %s:%d (models: %s; %s)",
            args.host,
            server.viasd_port,
            ", ".join(pipelines),
            description,
        )
        print(f"serving on {args.host}:{server.viasd_port}", flush=True)
        if http is not None:
            scheme = "https" if security.tls else "http"
            log.info("OpenAI-compatible HTTP API on %s://%s:%d", scheme, args.host, http.viasd_port)
            print(f"http on {args.host}:{http.viasd_port}", flush=True)
        await stop.wait()
        log.info(
            "stopping: %d request(s) in flight, draining for up to %.0fs", len(servicer.calls), limits.drain_timeout_s
        )
        await server.viasd_health.enter_graceful_shutdown()
        aborted = await servicer.calls.drain(limits.drain_timeout_s)
        log.info("drained; %d request(s) aborted", aborted)
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
    """serve_config.Limits of the standalone server's flags (InvalidParameterError names a bad one)."""
    flags = ("max_concurrent_requests", "max_queued_requests", "drain_timeout_s")
    return Limits.parse({k: getattr(args, k) for k in flags if getattr(args, k) is not None})


def default_params_from_args(args: argparse.Namespace) -> dict:
    """The --default-params object, validated (InvalidParameterError names the flag or the field)."""
    if not args.default_params:
        return {}
    try:
        values = json.loads(args.default_params)
    except json.JSONDecodeError as exc:
        raise InvalidParameterError("default_params", f"not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise InvalidParameterError("default_params", "must be a JSON object of GenerationParams fields")
    parse_params(values)
    return values


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m viasd.cluster.standalone", description=__doc__.splitlines()[0], allow_abbrev=False
    )  # "--token" must not pass for "--token-file"
    ap.add_argument("--config", help="JSON file: one PipelineConfig object, or a list (the first is the default)")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument(
        "--http-port",
        type=int,
        help="also serve the OpenAI-compatible HTTP API on this port (0: a free one), with the same TLS, "
        "token, limits and drain (default: gRPC only)",
    )
    ap.add_argument(
        "--default-params",
        help="JSON object of GenerationParams fields requests leave unset take "
        "(as ServeConfig.default_params), on both transports",
    )
    ap.add_argument("--ray-address", help="Ray cluster to join (default: start a local one)")
    lim = ap.add_argument_group("limits (cluster.serve_config.Limits; defaults there)")
    lim.add_argument("--max-concurrent-requests", type=int, help="requests decoding at once")
    lim.add_argument("--max-queued-requests", type=int, help="requests waiting; past it RESOURCE_EXHAUSTED")
    lim.add_argument(
        "--drain-timeout-s",
        type=float,
        help="on SIGTERM: seconds in-flight requests may still run before they are aborted",
    )
    sec = ap.add_argument_group("security (cluster/security.py; default: plaintext, no authentication)")
    sec.add_argument("--tls-cert", help="PEM certificate chain of the server: turns TLS on (with --tls-key)")
    sec.add_argument("--tls-key", help="PEM private key of --tls-cert")
    sec.add_argument("--tls-client-ca", help="PEM CA bundle verifying client certificates (mutual TLS)")
    sec.add_argument("--require-client-cert", action="store_true", help="refuse clients without a certificate")
    sec.add_argument(
        "--token-file",
        help=f"file holding the bearer token every call must present (default: env "
        f"{TOKEN_ENV}; unset: no authentication)",
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
