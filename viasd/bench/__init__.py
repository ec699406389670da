"""`viasd bench`: our `ar` / `sd` / `via`, transformers' `generate` and assisted generation, and the
matched baselines of seed 003, side by side on the same prompts, pair and seeds, in one process.

    viasd bench                                   # the main suite on 5 HumanEval prompts, greedy
    viasd bench --suite ablations --prompts 3 --max-tokens 64
    viasd bench --methods "ar;sd;via:region_b=escalate:gamma=3" --workload prompts.jsonl
    viasd bench --suite load --concurrency 1,2,4,8,16 --max-tokens 128   # throughput under concurrency

Python API (already loaded models; no tokenizer needed when prompts carry token ids)::

    from viasd.bench import Bench, Prompt, parse_methods, run_suite
    bench = Bench(verifier, drafter)              # MaskedLM objects, or Bench.from_llm(llm)
    results = run_suite(bench, parse_methods("ar,sd,via", base), [Prompt("p0", ids=[1, 2, 3])], base)
    load = run_load(bench, concurrency=[1, 4, 16], methods=["ar", "via", "ar@batch1", "generate_batch", "roofline"])

The outputs (``--out``): results.json (every raw run, the summary, the environment, the exact
command), results.md (the tables), one PNG per plot group. Modules: `methods` (the registry and
suites), `workloads` (HumanEval, JSONL), `runner` (the interleaved loop), `execution` (pass@1 in a
sandboxed subprocess), `report` (summaries, targets, Markdown), `plots` (matplotlib), `load` (the
load suite: continuous batching under concurrency against transformers' generate_batch and the
bare batched forward); the other suites: `serve` with its records `serve_report` (the served API
against in process), `quality`, `dimr_compare`, `lmeval`, `step` (host work per step, with
`host_reads`); `tables` renders the published tables (`viasd bench report`).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from viasd.bench.load import run_load
from viasd.bench.methods import Group, Method, matched_baseline, parse_method, parse_methods, suite_methods
from viasd.bench.report import markdown, summarize, targets, write_results
from viasd.bench.runner import Bench
from viasd.bench.workloads import Prompt, humaneval, load_jsonl, load_workload
from viasd.config import EngineConfig, GenerationParams

__all__ = [
    "Bench",
    "Group",
    "Method",
    "Prompt",
    "environment",
    "humaneval",
    "load_jsonl",
    "load_workload",
    "matched_baseline",
    "parse_method",
    "parse_methods",
    "rerender",
    "run_bench",
    "run_load",
    "run_suite",
    "suite_methods",
    "write_outputs",
]


def run_suite(
    bench: Bench,
    methods: list[Method],
    prompts: list[Prompt],
    base: GenerationParams,
    *,
    groups: list[Group] | None = None,
    meta: dict | None = None,
    out: str | Path | None = None,
    plots: bool = True,
    **run_kwargs: Any,
) -> dict:
    """Run, summarise, evaluate the targets; write the outputs to `out` when given."""
    results = bench.run(methods, prompts, base, **run_kwargs)
    labels = [m["label"] for m in results["methods"]]
    if groups is None:
        groups = [Group("main", "Methods side by side", "bar", tuple(labels))]
    results["groups"] = [{**asdict(g), "methods": [x for x in g.methods if x in labels]} for g in groups]
    results["meta"] = meta or {}
    results["summary"] = summarize(results)
    results["targets"] = targets(results, results["summary"])
    if out is not None:
        write_outputs(results, out, plots=plots)
    return results


def write_outputs(results: dict, out: str | Path, *, plots: bool = True) -> list[str]:
    """results.json, results.md and the PNG plots into `out`; returns the file names."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = ["results.json", "results.md"]
    md = markdown(results, results["summary"], results.get("targets"))
    if plots and results.get("groups"):
        from viasd.bench.plots import make_plots

        try:
            pngs = make_plots(results, results["summary"], out)
        except Exception as exc:  # a plot is not worth the numbers: say so and keep them
            pngs = []
            results.setdefault("meta", {})["plot_error"] = f"{type(exc).__name__}: {exc}"
        files += pngs
        md += "\n" + "\n".join(f"![{p}]({p})" for p in pngs) + "\n"
    write_results(out, results, md)
    return files


def rerender(out: str | Path, *, plots: bool = True) -> dict:
    """Recompute the summary, targets, Markdown and plots of an existing results.json in `out`
    (after a change to the report code, or to re-draw the plots); the raw runs are untouched."""
    out = Path(out)
    results = json.loads((out / "results.json").read_text())
    results["summary"] = summarize(results)
    results["targets"] = targets(results, results["summary"])
    write_outputs(results, out, plots=plots)
    return results


def _git(*args: str) -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=root).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment(device: str = "cpu") -> dict[str, Any]:
    """Versions, hardware and the git commit, for the results file."""
    import torch
    import transformers

    from viasd import __version__

    cpu, flags = platform.processor(), None
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "viasd": __version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the kernels torch dispatches to
        "cpu_flags": sorted(f for f in flags or () if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def machine_label() -> str:
    """How per-machine raw files are named: `avx2` on a CPU without AVX-512, `avx2-emulated` where
    torch is held to AVX2 kernels on one that has it (ATEN_CPU_CAPABILITY=avx2), `native` on an
    AVX-512 CPU with native bf16 (AVX-512 BF16 or AMX), else `<capability>-no-bf16`."""
    from viasd.precision import BF16_FLAGS

    env = environment()
    capability, flags = env["cpu_capability"].lower(), env["cpu_flags"]
    if capability == "avx2":
        return "avx2-emulated" if any(f.startswith("avx512") for f in flags) else "avx2"
    return "native" if set(BF16_FLAGS) & set(flags) else f"{capability}-no-bf16"


def write_raw(folder: Path, stem: str, record: dict) -> Path:
    """Write a per-machine raw file, `folder/{stem}-{machine_label()}.json`; return its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}-{machine_label()}.json"
    path.write_text(json.dumps(record, indent=1))
    return path


def provenance(device: str = "cpu") -> dict[str, Any]:
    """What a committed raw file must record beside its figures: the command that made it (this
    process's argv, an installed command by its name: no path of this machine), the commit and the
    machine (`environment`)."""
    import shlex
    import sys

    prog = Path(sys.argv[0])
    prog = prog.name if prog.is_absolute() else prog.as_posix()
    return {"command": shlex.join([prog, *sys.argv[1:]]), "environment": environment(device)}


def _searched_masks(llm, extra_files: list[str]) -> dict:
    """Searched masks for the loaded verifier, by number of skipped layers: the shipped DIMR
    artifacts that fit it (fingerprint checked) and the artifact files given on the command line."""
    from viasd.dimr import check_artifact, read_artifact, shipped_artifacts
    from viasd.errors import MaskError

    found: dict[int, tuple] = {}
    for name, art in shipped_artifacts():
        if art.verifier != llm.config.verifier or art.num_layers != llm.verifier.num_layers:
            continue
        try:
            mask = check_artifact(art, llm.verifier, source=f"viasd/masks/{name}")
        except MaskError:
            continue
        found.setdefault(len(mask.skipped), (mask, f"DIMR mask viasd/masks/{name}"))
    for path in extra_files:
        mask = check_artifact(read_artifact(path), llm.verifier, source=path)
        found[len(mask.skipped)] = (mask, f"DIMR mask {path}")
    return found


def run_bench(args, config: EngineConfig, params: GenerationParams) -> int:
    """The `viasd bench` command: load the pair once, run the suite, write the outputs.

    Exit status 0, or 1 when any run of any method failed (the outputs are written either way).
    """
    from viasd.llm import LLM

    suite = getattr(args, "suite", None)
    spec = getattr(args, "methods", None) or getattr(args, "modes", None)
    if spec:
        specs, groups = spec, None
    else:
        specs, groups = suite_methods(suite or "main")
    methods = parse_methods(specs, params)  # validate before loading models
    seeds = [
        int(s) for s in str(getattr(args, "seeds", None) or (params.seed if params.seed is not None else 0)).split(",")
    ]
    prompts = load_workload(getattr(args, "workload", "humaneval"), args.prompts, getattr(args, "prompt_offset", 0))

    t0 = time.perf_counter()
    llm = LLM(config, mask=args.mask)
    load_seconds = time.perf_counter() - t0
    bench = Bench.from_llm(llm, searched_masks=_searched_masks(llm, getattr(args, "searched_mask", None) or []))
    print(
        f"loaded in {load_seconds:.1f}s; mask {llm.engine.mask} ({bench.default_mask_source}); "
        f"{len(prompts)} prompts x {len(methods)} methods",
        file=sys.stderr,
    )
    from viasd.bench.execution import isolation

    meta = {
        "command": getattr(args, "command_line", None) or shlex.join([Path(sys.executable).name, *sys.argv]),
        "argv": sys.argv,
        "suite": None if spec else (suite or "main"),
        "engine": config.model_dump(mode="json"),
        "device": str(llm.verifier.device),
        "runtime": llm.runtime_info(),  # the dtype `auto` chose and why, CPU capability, kernels
        "default_mask": {"skipped_layers": list(llm.engine.mask.skipped), "source": bench.default_mask_source},
        "searched_masks": {
            str(k): {"skipped_layers": list(m.skipped), "source": s}
            for k, (m, s) in sorted(bench.searched_masks.items())
        },
        "params": params.model_dump(mode="json"),
        "workload": getattr(args, "workload", "humaneval"),
        "prompts": len(prompts),
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "seeds": seeds,
        "repeats": args.repeats,
        "warmup_tokens": args.warmup_tokens,
        "load_seconds": load_seconds,
        "pass_at_1": {"enabled": not args.no_pass_at_1, "timeout_s": args.exec_timeout, "isolation": isolation()},
        "environment": environment(str(llm.verifier.device)),
    }
    t1 = time.perf_counter()
    results = run_suite(
        bench,
        methods,
        prompts,
        params,
        groups=groups,
        meta=meta,
        repeats=args.repeats,
        seeds=seeds,
        warmup_tokens=args.warmup_tokens,
        progress=not args.no_progress,
        pass_at_1=not args.no_pass_at_1,
        exec_timeout=args.exec_timeout,
        time_budget=args.time_budget,
    )
    meta["bench_seconds"] = time.perf_counter() - t1
    write_outputs(results, args.out, plots=not args.no_plots)
    print(markdown(results, results["summary"], results["targets"]))
    print(f"wrote {args.out}/results.json, results.md" + ("" if args.no_plots else " and plots"), file=sys.stderr)
    return 1 if any(not r["ok"] for r in results["runs"]) else 0
