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
"viasd.v1.GenerationService" report SERVING once the server has started.

Standalone: ``python -m viasd.cluster.grpc_server --config pipeline.json --port 50051``.
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
from viasd.actors.rpc import GRPC_OPTIONS
from viasd.cluster.pipeline import Pipeline, PipelineConfig
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

    def __init__(self, pipelines: dict[str, Pipeline], default: str):
        if default not in pipelines:
            raise ValueError(f"default pipeline {default!r} is not among {sorted(pipelines)}")
        self.pipelines = pipelines
        self.default = default

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

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            async with aclosing(self.generate(request)) as responses:
                async for response in responses:
                    yield response
        except Exception as exc:
            await abort_with(context, exc)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        return await self.list_models(request)


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


async def serve_grpc(servicer: GenerationServicer, port: int, host: str = "127.0.0.1") -> grpc.aio.Server:
    """Start a grpc.aio server with GenerationService and the health service on host:port (0: a
    free port). The bound port is `server.viasd_port`, the health servicer `server.viasd_health`."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise RuntimeError(f"cannot bind the gRPC server to {host}:{port}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    server.viasd_port = bound
    server.viasd_health = health
    return server


# ---------------------------------------------------------------- standalone


async def _main(args: argparse.Namespace) -> None:
    import signal

    import ray

    raw = json.loads(open(args.config).read()) if args.config else {}
    configs = [PipelineConfig.parse(c) for c in (raw if isinstance(raw, list) else [raw])]
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
    try:
        for config in configs:
            pipelines[config.name] = await Pipeline.start(config)
        server = await serve_grpc(GenerationServicer(pipelines, configs[0].name), args.port, args.host)
        log.info("GenerationService on %s:%d (models: %s)", args.host, server.viasd_port, ", ".join(pipelines))
        print(f"serving on {args.host}:{server.viasd_port}", flush=True)
        await stop.wait()
        log.info("stopping: draining requests")
        await server.viasd_health.enter_graceful_shutdown()
        await server.stop(grace=5.0)
    finally:
        for pipeline in pipelines.values():
            await pipeline.shutdown()
        if started_ray:
            ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m viasd.cluster.grpc_server", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="JSON file: one PipelineConfig object, or a list (the first is the default)")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start a local one)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
