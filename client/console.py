"""``viasd-client``: the gRPC API from a terminal.

    viasd-client generate "def fib(n):" --mode via --max-tokens 64    # streams the text
    viasd-client chat "Write a haiku about caches." --system "Be brief." --temperature 0.7 --seed 1
    viasd-client models --json
    viasd-client --target host:443 --tls --ca-file ca.pem --token-file token health

Every GenerationParams field is an option (``--max-tokens``, ``--alpha1``, ...), with the model's
own description as help and its own validation. ``--json`` prints one JSON object instead (the
text, token ids, finish reason and statistics; or ``{"error": ...}``). Exit status: 0, 1 (the
call failed; for ``health``: not serving), 2 (a bad argument, client- or server-side).
The token comes from ``--token-file`` or the environment variable VIASD_API_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from viasd.config import GenerationParams
from viasd.errors import InvalidParameterError, ViaSDError

from .common import DEFAULT_TARGET, NO_RETRY, TOKEN_ENV, Completion, RetryPolicy, TLSConfig
from .errors import RPCError
from .sync import Client


def _params_options(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("generation parameters (viasd.config.GenerationParams; default: the server's)")
    for name, info in GenerationParams.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if info.annotation is bool:  # a flag
            group.add_argument(flag, dest=f"param_{name}", action="store_true", default=None, help=info.description)
        elif name == "stop":  # strings: one per flag
            group.add_argument(
                flag,
                dest=f"param_{name}",
                action="append",
                metavar="STRING",
                help=info.description + " Repeat the flag for several.",
            )
        else:
            group.add_argument(
                flag,
                dest=f"param_{name}",
                metavar=name.upper(),
                help=info.description + (" Comma-separated." if name == "stop_token_ids" else ""),
            )


def _params(args: argparse.Namespace) -> dict[str, Any]:
    values = {k.removeprefix("param_"): v for k, v in vars(args).items() if k.startswith("param_") and v is not None}
    if "stop_token_ids" in values:
        values["stop_token_ids"] = _ids(values["stop_token_ids"], "stop_token_ids")
    return values  # strings: GenerationParams validates and converts them


def _ids(text: str, field: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise InvalidParameterError(field, f"comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="viasd-client", description="via-sd gRPC client (viasd.v1.GenerationService).", allow_abbrev=False
    )  # "--token" must not pass for "--token-file"
    ap.add_argument(
        "--target",
        default=os.environ.get("VIASD_TARGET", DEFAULT_TARGET),
        help=f"server host:port (default: env VIASD_TARGET or {DEFAULT_TARGET})",
    )
    ap.add_argument("--tls", action="store_true", help="use TLS (system roots unless --ca-file)")
    ap.add_argument("--ca-file", help="PEM CA bundle that verifies the server (implies --tls)")
    ap.add_argument("--cert-file", help="PEM client certificate for mutual TLS (implies --tls)")
    ap.add_argument("--key-file", help="PEM private key of --cert-file")
    ap.add_argument("--server-name", help="name to check the server certificate against (default: the target host)")
    ap.add_argument("--token-file", help=f"file holding the bearer token (default: env {TOKEN_ENV})")
    ap.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds (default: none)")
    ap.add_argument("--retries", type=int, default=3, help="retries on UNAVAILABLE before the first token (default 3)")
    ap.add_argument(
        "--metadata",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra call metadata, e.g. application=viasd for Ray Serve (repeatable)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    sub = ap.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt (streamed)")
    gen.add_argument("prompt", nargs="?", help="prompt text")
    gen.add_argument("--prompt-ids", help="comma-separated prompt token ids instead of text")
    chat = sub.add_parser("chat", help="one chat turn (the model's chat template)")
    chat.add_argument("message", help="the user message")
    chat.add_argument("--system", help="a system message first")
    for p in (gen, chat):
        p.add_argument("--model", default="", help="pipeline name (default: the server's default)")
        p.add_argument("--request-id", default=None, help="request id (default: a random one)")
        p.add_argument("--stats", action="store_true", help="print the request's statistics to stderr at the end")
        _params_options(p)
    sub.add_parser("models", help="list the served pipelines")
    health = sub.add_parser("health", help="standard gRPC health check (exit 0 when SERVING)")
    health.add_argument("--service", default="", help='service name ("" = the whole server)')
    return ap


def _client(args: argparse.Namespace) -> Client:
    tls = None
    if args.tls or args.ca_file or args.cert_file:
        tls = TLSConfig(
            ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file, server_name=args.server_name
        )
    token = None
    if args.token_file:
        try:
            token = open(args.token_file).read().strip()
        except OSError as exc:
            raise InvalidParameterError("token_file", f"cannot read {args.token_file}: {exc.strerror}") from None
    token = token or os.environ.get(TOKEN_ENV, "").strip() or None
    metadata = []
    for pair in args.metadata:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidParameterError("metadata", f"KEY=VALUE expected, got {pair!r}")
        metadata.append((key.lower(), value))
    retry = RetryPolicy(max_attempts=args.retries + 1) if args.retries > 0 else NO_RETRY
    return Client(args.target, tls=tls, token=token, timeout=args.timeout, retry=retry, metadata=metadata)


def _generate(client: Client, args: argparse.Namespace) -> int:
    kwargs: dict[str, Any] = dict(model=args.model, request_id=args.request_id, **_params(args))
    if args.command == "chat":
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.message}
        ]
        kwargs["messages"] = messages
    elif args.prompt_ids:
        kwargs["prompt_token_ids"] = _ids(args.prompt_ids, "prompt_token_ids")
        if args.prompt is not None:
            raise InvalidParameterError("prompt", "give a prompt or --prompt-ids, not both")
    else:
        kwargs["prompt"] = args.prompt
    t0 = time.perf_counter()
    with client.generate(**kwargs) as stream:
        result = Completion(stream.request_id)
        for chunk in stream:
            result.add(chunk)
            if not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        sys.stdout.write("\n")
        if args.stats and result.stats is not None:
            s = result.stats
            seconds = time.perf_counter() - t0
            print(
                f"[{s.mode}] {s.generated_tokens} tokens in {seconds:.2f}s ({s.generated_tokens / seconds:.1f} tok/s), "
                f"finish: {result.finish_reason}, mean acceptance length: {s.mean_acceptance_length}",
                file=sys.stderr,
            )
    return 0


def _run(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.command in ("generate", "chat"):
            return _generate(client, args)
        if args.command == "models":
            models = client.models()
            if args.json:
                print(json.dumps({"models": [asdict(m) for m in models]}))
            for m in models if not args.json else ():
                print(
                    f"{m.name}: verifier {m.verifier}, drafter {m.drafter or '-'}, {m.num_layers} layers "
                    f"({len(m.skipped_layers)} skipped by q'), TP {m.tensor_parallel_size}, context {m.max_context}, "
                    f"default mode {m.default_mode}"
                )
            return 0
        status = client.health(args.service)
        print(json.dumps({"status": status}) if args.json else status)
        return 0 if status == "SERVING" else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = _run(args)
    except ViaSDError as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, RPCError):
            error["code"] = exc.code
        if isinstance(exc, InvalidParameterError):
            error["field"] = exc.field
        if args.json:
            print(json.dumps({"error": error}))
        print(f"viasd-client: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 2 if isinstance(exc, InvalidParameterError) else 1
    except KeyboardInterrupt:  # the stream's `with` block has cancelled the call
        code = 130
    return code


if __name__ == "__main__":
    sys.exit(main())
