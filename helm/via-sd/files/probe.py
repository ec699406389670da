"""Liveness / readiness probe of a via-sd Ray pod (mounted from the chart's ConfigMap; stdlib + grpcio).

    python probe.py live  --node head        Ray is up on this pod: the raylet's health (dashboard agent),
                                             and on the head the GCS (dashboard). Never the model: loading
                                             a 70B verifier takes minutes, and Serve restarts an unhealthy
                                             replica itself (the deployment's check_health).
    python probe.py ready --node worker --http-port 8000 --grpc-port 9000 --route / --app viasd
                                             `live`, then, when a Serve proxy listens on this pod, the model
                                             through it: GET <route>health (every actor of a pipeline
                                             answers, else 503) and viasd.v1.GenerationService/ListModels
                                             through the gRPC proxy. No proxy on the pod (a node that only
                                             holds pipeline actors): Ray's checks alone.

Exit status 0: healthy; 1: not (the reason on stderr).
"""

import argparse
import socket
import sys
import urllib.error
import urllib.request

RAYLET = "http://127.0.0.1:{agent}/api/local_raylet_healthz"
GCS = "http://127.0.0.1:{dashboard}/api/gcs_healthz"


def get(url: str, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read(4096).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(4096).decode(errors="replace")


def listening(port: int, timeout: float) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def check_ray(args) -> None:
    urls = [RAYLET.format(agent=args.agent_port)]
    if args.node == "head":
        urls.append(GCS.format(dashboard=args.dashboard_port))
    for url in urls:
        status, body = get(url, args.timeout)
        if status != 200 or "success" not in body:
            raise RuntimeError(f"{url}: HTTP {status} {body[:200]!r}")


def check_model(args) -> None:
    url = f"http://127.0.0.1:{args.http_port}{args.route.rstrip('/')}/health"
    status, body = get(url, args.timeout)
    if status != 200:
        raise RuntimeError(f"{url}: HTTP {status} {body[:200]!r}")
    if args.grpc_port:
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{args.grpc_port}") as channel:
            list_models = channel.unary_unary(
                "/viasd.v1.GenerationService/ListModels",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            # an empty ListModelsRequest; Serve's gRPC proxy picks the application from the metadata
            list_models(b"", timeout=args.timeout, metadata=[("application", args.app)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["live", "ready"])
    ap.add_argument("--node", choices=["head", "worker"], required=True)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=9000, help="0: gRPC disabled")
    ap.add_argument("--route", default="/", help="route prefix of the application")
    ap.add_argument("--app", default="viasd", help="Serve application name (gRPC `application` metadata)")
    ap.add_argument("--agent-port", type=int, default=52365)
    ap.add_argument("--dashboard-port", type=int, default=8265)
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args(argv)
    try:
        check_ray(args)
        if args.what == "ready" and listening(args.http_port, args.timeout):
            check_model(args)
    except Exception as exc:  # noqa: BLE001 - a probe reports, it does not raise
        print(f"probe {args.what} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
