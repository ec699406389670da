"""A quality evaluation that can tell decoding settings apart.

For each setting (a method spec of `viasd.bench.methods`) every prompt is decoded through one
batched `Engine` (`submit` / `step`, continuous batching: docs/BATCHING.md), and a request is
cancelled as soon as its text reaches a stop sequence (`execution.STOP_SEQUENCES`: the function
is complete), so no compute goes to text the scorer throws away. Two corpora:

* HumanEval problems: pass@1 (sandboxed execution, `viasd.bench.execution`) with its 95% Wilson
  interval, against the matched baseline of every lossy setting (the verifier alone with
  min-p = alpha1, seed 003; `methods.matched_baseline`);
* standard-library functions (`stdlib_functions`): the signature and docstring of public
  pure-Python functions of the installed interpreter's standard library, the model writes the
  body. Not HumanEval, and not executed: scored by greedy agreement with `ar`.

Greedy agreement with `ar` on both corpora: the share of tokens before the first difference
(`report.agreement`'s prefix share) and the share of completions identical to `ar`'s after
truncation at the stop sequences. The sampled setting (temperature 1) runs with several seeds.
Wall times are recorded per setting and for the whole evaluation.

    viasd bench --suite quality --humaneval 40 --stdlib 40 --out bench-out/quality

(`run_quality_bench`): greedy settings on both corpora, with the loaded mask's calibrated gates
added when it has them; sampled settings on HumanEval with every seed of --seeds; every lossy
sampled setting gets its matched baseline. Writes results.json (the raw runs, the summary, the
command, the commit and the machine) and results.md (the table).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import statistics
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from viasd.bench.execution import STOP_SEQUENCES, check_many, truncate
from viasd.bench.methods import Method, matched_baseline, parse_method, split_specs
from viasd.bench.report import pass_at_1, wilson, write_results
from viasd.bench.workloads import Prompt, humaneval
from viasd.config import GenerationParams
from viasd.engine import Engine

# pure-Python standard-library modules whose public functions carry docstrings; the order is fixed
STDLIB_MODULES = (
    "textwrap",
    "shlex",
    "fnmatch",
    "posixpath",
    "heapq",
    "bisect",
    "calendar",
    "colorsys",
    "statistics",
    "difflib",
    "string",
    "html",
    "base64",
    "quopri",
    "glob",
    "urllib.parse",
    "email.utils",
    "json",
    "ipaddress",
    "fractions",
    "random",
    "functools",
    "inspect",
    "tokenize",
    "operator",
    "copy",
    "pprint",
    "gettext",
    "locale",
    "mimetypes",
    "ntpath",
    "genericpath",
    "shutil",
    "tempfile",
    "zipfile",
    "tarfile",
)


def stdlib_functions(n: int, *, max_body_lines: int = 30, min_body_lines: int = 3) -> list[Prompt]:
    """n prompts "def f(signature):\\n    \\"\\"\\"docstring\\"\\"\\"\\n" from the installed standard library.

    Deterministic for one Python version: public module-level functions defined in the modules
    of STDLIB_MODULES (in that order), with a docstring and a body of min..max lines after it,
    sorted by name within a module, then taken round-robin across modules so the corpus mixes
    modules. Decorators are dropped; the prompt is the `def` line(s) and the docstring.
    """
    per_module: list[list[Prompt]] = []
    for name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        found = []
        for fname, fn in sorted(vars(mod).items()):
            if fname.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
                continue
            prompt = _signature_and_docstring(fn, min_body_lines, max_body_lines)
            if prompt is not None:
                found.append(Prompt(f"stdlib/{name}.{fname}", text=prompt))
        if found:
            per_module.append(found)
    out: list[Prompt] = []
    for i in range(max((len(f) for f in per_module), default=0)):
        out += [f[i] for f in per_module if i < len(f)]
    return out[:n]


def _signature_and_docstring(fn, min_body: int, max_body: int) -> str | None:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    try:
        node = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.FunctionDef) or len(node.body) < 2:
        return None
    doc = node.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        return None
    body_lines = node.body[-1].end_lineno - doc.end_lineno
    if not min_body <= body_lines <= max_body:
        return None
    lines = source.splitlines()
    return "\n".join(lines[node.lineno - 1 : doc.end_lineno]) + "\n"


@dataclass(frozen=True)
class Setting:
    """One decoding setting of the evaluation: a method, the seeds it runs with and the label of its
    matched baseline among the settings (lossy sampled settings; `methods.matched_baseline`)."""

    method: Method
    seeds: tuple[int, ...] = (0,)
    baseline: str | None = None

    @property
    def label(self) -> str:
        return self.method.label


def decode_batched(
    engine: Engine,
    tokenizer,
    prompts: Sequence[list[int]],
    params: Sequence[GenerationParams],
    stops: tuple[str, ...] = STOP_SEQUENCES,
) -> tuple[list[dict], float]:
    """Decode every prompt with its params through `engine`'s steps (all submitted at once; the
    engine's max_batch rows decode together, the rest queue); a request is cancelled once its
    text holds a stop sequence. Returns one record per prompt (tokens, text, finish) and the wall
    seconds of the whole batch."""
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    t0 = time.perf_counter()
    handles = {engine.submit(ids, p): i for i, (ids, p) in enumerate(zip(prompts, params))}
    for i in handles.values():
        tokens[i] = []
    while engine.scheduler.has_work():
        for handle, chunk in engine.step():
            i = handles[handle]
            tokens[i] += chunk.token_ids
            if chunk.finished:
                finish[i] = chunk.finish_reason
            elif i not in finish and truncate(tokenizer.decode(tokens[i]), stops) != tokenizer.decode(tokens[i]):
                finish[i] = "stop_sequence"
                engine.cancel(handle)
    seconds = time.perf_counter() - t0
    out = []
    for i in range(len(prompts)):
        text = tokenizer.decode(tokens[i], skip_special_tokens=True)
        out.append(
            {
                "tokens": tokens[i],
                "text": text,
                "completion": truncate(text, stops),
                "finish_reason": finish.get(i),
                "generated_tokens": len(tokens[i]),
            }
        )
    return out, seconds


def _agreement(runs: list[dict], reference: list[dict]) -> dict | None:
    """Greedy agreement with the reference runs (same prompt and seed): prefix share of the
    tokens before the first difference (over the shorter output) and identical completions."""
    ref = {(r["prompt"], r["seed"]): r for r in reference}
    shares, exact = [], []
    for r in runs:
        other = ref.get((r["prompt"], r["seed"]))
        if other is None or r["temperature"] != 0:
            continue
        a, b = r["tokens"], other["tokens"]
        n = min(len(a), len(b))
        same = next((i for i in range(n) if a[i] != b[i]), n)
        shares.append(same / n if n else 1.0)
        exact.append(r["completion"] == other["completion"])
    if not shares:
        return None
    k = sum(exact)
    return {
        "prefix_share": statistics.mean(shares),
        "identical": k / len(exact),
        "n": len(exact),
        "identical_wilson95": list(wilson(k / len(exact), len(exact))),
    }


def evaluate(
    engine: Engine,
    tokenizer,
    settings: Sequence[Setting],
    corpora: dict[str, list[Prompt]],
    *,
    exec_timeout: float = 10.0,
    log=None,
) -> dict[str, Any]:
    """Run every setting on every corpus; score pass@1 (executable prompts) and agreement with
    the `ar` setting of the same temperature and seed. Returns runs, per-setting summaries
    and timings (JSON-ready)."""
    t_all = time.perf_counter()
    runs: list[dict] = []
    timings: dict[str, dict[str, float]] = {}
    for setting in settings:
        for cname, prompts in corpora.items():
            ids = [tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]
            for seed in setting.seeds:
                params = [
                    setting.method.params.model_copy(update={"seed": seed * 100_003 + i}) for i in range(len(prompts))
                ]
                records, seconds = decode_batched(engine, tokenizer, ids, params)
                n_tok = sum(r["generated_tokens"] for r in records)
                timings.setdefault(setting.label, {}).setdefault(cname, 0.0)
                timings[setting.label][cname] += seconds
                for i, (p, rec) in enumerate(zip(prompts, records)):
                    runs.append(
                        {
                            "method": setting.label,
                            "corpus": cname,
                            "prompt": p.id,
                            "prompt_index": i,
                            "seed": seed,
                            "repeat": 0,
                            "temperature": setting.method.params.temperature,
                            "ok": True,
                            **rec,
                        }
                    )
                if log:
                    log(
                        f"{setting.label:<40} {cname:<10} seed {seed}: {n_tok} tokens in {seconds:.1f}s "
                        f"({n_tok / seconds:.1f} tok/s)"
                    )
    _score(runs, corpora, exec_timeout)
    summary = summarize(runs, settings)
    for label, per in timings.items():
        summary[label]["seconds"] = per
    return {"runs": runs, "summary": summary, "wall_seconds": time.perf_counter() - t_all}


def _score(runs: list[dict], corpora: dict[str, list[Prompt]], timeout: float) -> None:
    jobs, targets = [], []
    for r in runs:
        prompt = corpora[r["corpus"]][r["prompt_index"]]
        if prompt.executable:
            jobs.append((prompt.problem, r["text"]))
            targets.append(r)
    for r, res in zip(targets, check_many(jobs, timeout=timeout)):
        r["passed"], r["exec_result"] = res.passed, res.result


def _reference_label(method: Method, labels: set[str]) -> str | None:
    """The `ar` setting a method's agreement is measured against: `ar` at its temperature."""
    t = method.params.temperature
    for label in ("ar",) if t == 0 else (f"ar:temperature={t:g}",):
        if label in labels:
            return label
    return None


def summarize(runs: list[dict], settings: Sequence[Setting]) -> dict[str, dict]:
    """Per setting: tokens/s per corpus, pass@1 with its Wilson interval, the matched
    baseline's pass@1 and the difference, greedy agreement with `ar` per corpus."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        by.setdefault((r["method"], r["corpus"]), []).append(r)
    labels = {s.label for s in settings}
    out: dict[str, dict] = {}
    for s in settings:
        m = s.method
        entry: dict[str, Any] = {
            "spec": m.label,
            "params": m.params.model_dump(mode="json"),
            "seeds": list(s.seeds),
            "lossy": m.lossy,
        }
        entry["matched_baseline"] = s.baseline if s.baseline in labels else None
        ref = _reference_label(m, labels)
        for (label, corpus), rs in by.items():
            if label != m.label:
                continue
            c: dict[str, Any] = {"generated_tokens": sum(r["generated_tokens"] for r in rs), "n_runs": len(rs)}
            pa = pass_at_1(rs)
            if pa is not None:
                pa.pop("per_prompt", None)
                c["pass_at_1"] = pa
                if entry["matched_baseline"]:
                    bp = pass_at_1(by.get((entry["matched_baseline"], corpus), []))
                    if bp is not None:
                        c["baseline_pass_at_1"] = bp["pass_at_1"]
                        c["delta_pass_at_1"] = pa["pass_at_1"] - bp["pass_at_1"]
            if ref is not None and ref != m.label and m.params.temperature == 0:
                c["agreement_with_ar"] = _agreement(rs, by.get((ref, corpus), []))
            entry[corpus] = c
        out[m.label] = entry
    return out


def markdown(summary: dict[str, dict], corpora: Sequence[str]) -> str:
    """One table: setting, tokens/s per corpus, pass@1 [Wilson] vs matched baseline, agreement."""
    head = ["setting", "T", "seeds"]
    for c in corpora:
        head += [f"{c} tok/s", f"{c} pass@1 [95%]", f"{c} vs baseline", f"{c} agree (prefix / identical)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, e in summary.items():
        row = [f"`{label}`", f"{e['params']['temperature']:g}", ",".join(map(str, e["seeds"]))]
        for c in corpora:
            d = e.get(c, {})
            sec = e.get("seconds", {}).get(c)
            row.append(f"{d['generated_tokens'] / sec:.1f}" if d and sec else "-")
            pa = d.get("pass_at_1")
            row.append(
                f"{pa['pass_at_1']:.3f} [{pa['wilson95'][0]:.2f}-{pa['wilson95'][1]:.2f}] (n={pa['n_samples']})"
                if pa
                else "-"
            )
            row.append(f"{d['delta_pass_at_1']:+.3f} vs `{e['matched_baseline']}`" if "delta_pass_at_1" in d else "-")
            ag = d.get("agreement_with_ar")
            row.append(f"{ag['prefix_share']:.2f} / {ag['identical']:.2f} (n={ag['n']})" if ag else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


#: the suite's default settings: greedy on both corpora, sampled (temperature 1) on HumanEval
GREEDY = "ar;sd;via:alpha1=0.5:alpha2=0.3;via:alpha1=0.7:region_b=escalate;via:rule=staged"
SAMPLED = "ar:temperature=1;via:alpha1=0.5:alpha2=0.3:temperature=1;via:rule=staged:temperature=1"


def settings_from(spec: str, seeds: tuple[int, ...], base: GenerationParams) -> list[Setting]:
    """The settings of ';'-separated method specs, each lossy sampled one followed by its matched
    baseline (same seeds); a greedy setting runs once (seed 0)."""
    out: dict[str, Setting] = {}
    for s in split_specs(spec):
        m = parse_method(s, base)
        mb = matched_baseline(m, base) if m.lossy and not m.params.greedy else None
        out.setdefault(m.label, Setting(m, seeds if not m.params.greedy else (0,), mb.label if mb else None))
        if mb is not None:
            out.setdefault(mb.label, Setting(mb, seeds))
    return list(out.values())


def run_quality_bench(args, config) -> int:
    """`viasd bench --suite quality`: load the pair once (`config`), evaluate every setting through
    one batched engine of `config.max_batch` rows, write `--out`/results.json and results.md."""
    import sys

    from viasd.bench import environment
    from viasd.config import parse_params
    from viasd.engine import cost_cache_dir
    from viasd.llm import LLM

    seeds = tuple(int(s) for s in str(args.seeds or "0,1").split(",") if s.strip())
    max_tokens = int(args.max_tokens) if args.max_tokens is not None else 160
    base = parse_params(max_tokens=max_tokens)
    greedy = settings_from(args.greedy, (0,), base) if args.greedy else []
    sampled = settings_from(args.sampled, seeds, base) if args.sampled else []
    llm = LLM(config, mask=args.mask)
    if greedy and llm.engine.gates is not None:  # the mask's calibrated gates, spelled out (viasd.gates)
        greedy = settings_from(";".join([*(s.label for s in greedy), llm.engine.gates.spec()]), (0,), base)
    engine = Engine(
        llm.verifier,
        llm.drafter,
        mask=llm.engine.mask,
        eos_token_ids=llm.engine.eos_token_ids,
        max_batch=config.max_batch,
        cost_cache_dir=cost_cache_dir(),
    )
    he = humaneval(args.humaneval) if args.humaneval else []
    lib = stdlib_functions(args.stdlib) if args.stdlib else []
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    corpora = {k: v for k, v in (("humaneval", he), ("stdlib", lib)) if v}
    res_g = evaluate(engine, llm.tokenizer, greedy, corpora, log=log) if greedy else None
    res_s = evaluate(engine, llm.tokenizer, sampled, {"humaneval": he}, log=log) if sampled and he else None
    done = [r for r in (res_g, res_s) if r is not None]
    summary = {k: v for r in done for k, v in r["summary"].items()}
    results = {
        "meta": {
            "command": getattr(args, "command_line", None) or " ".join(sys.argv),
            "environment": environment(str(llm.verifier.device)),
            "runtime": llm.runtime_info(),
            "mask": {"skipped_layers": list(llm.engine.mask.skipped), "source": llm.mask_source},
            "max_tokens": max_tokens,
            "max_batch": config.max_batch,
            "seeds": list(seeds),
            "corpora": {"humaneval": [p.id for p in he], "stdlib": [p.id for p in lib]},
            "wall_seconds": sum(r["wall_seconds"] for r in done),
        },
        "summary": summary,
        "runs": [run for r in done for run in r["runs"]],
    }
    table = markdown(summary, list(corpora))
    out = write_results(
        args.out, results, f"wall time of the whole evaluation: {results['meta']['wall_seconds']:.0f} s\n\n" + table
    )
    print(table)
    print(f"wall time {results['meta']['wall_seconds']:.0f} s; wrote {out}/results.json, results.md", file=sys.stderr)
    return 0
