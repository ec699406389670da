"""The published benchmark tables, rendered from the committed result files under docs/.

Each table has a name, the result files it reads (paths relative to the repository root) and a
renderer. A document shows a table between two marker lines::

    <!-- table:NAME -->
    ... what render(NAME) returns ...
    <!-- /table:NAME -->

`viasd bench report` prints every table; `--docs` rewrites the marked blocks of the documents in
place; `--check` exits non-zero, naming the tables, when a document differs from what its result
files give (tests/unit/test_docs_tables.py runs the check). A table's first line names its source
files and what each recorded: the command, the commit, the CPU capability and the dtype.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from viasd.bench.report import ratio

#: the documents whose marked tables `viasd bench report --docs` maintains
DOCS = ("docs/BATCHING.md", "docs/BENCHMARKS.md", "docs/DIMR.md", "docs/QUANTIZATION.md", "docs/SERVING.md")

_MARK = re.compile(r"^<!-- table:([a-z0-9_-]+) -->\n(.*?)^<!-- /table:\1 -->$", re.M | re.S)


@dataclass(frozen=True)
class Table:
    name: str
    sources: tuple[str, ...]
    render: Callable[[list[dict]], list[str]]  # the loaded sources -> the table's lines


# ------------------------------------------------------------------ what a result file recorded


def _meta(data: dict) -> dict:
    return data.get("meta") or data


def _environment(data: dict) -> dict:
    env = _meta(data).get("environment")
    if env is None and data.get("runs"):
        env = data["runs"][0].get("environment")
    meta = _meta(data)
    if env is None and meta.get("commit"):  # (a file that records its commit and machine at the top)
        env = {
            "git_commit": meta["commit"],
            "git_dirty": meta.get("dirty"),
            "cpu_capability": meta.get("cpu_capability"),
            "cpu": meta.get("cpu_model"),
            "cpu_count": meta.get("cores"),
            "torch": meta.get("torch"),
        }
    return env or {}


def _runtime(data: dict) -> dict:
    meta = _meta(data)
    return meta.get("runtime") or (meta.get("in_process") or {}).get("runtime") or {}


def capability(data: dict) -> str:
    """The CPU capability (torch.backends.cpu.get_cpu_capability()) the file recorded."""
    return _environment(data).get("cpu_capability") or _runtime(data).get("cpu_capability") or "not recorded"


def dtype(data: dict) -> str:
    rt = _runtime(data)
    if rt.get("dtype"):
        return rt["dtype"]
    engine = _meta(data).get("engine") or {}
    if engine.get("dtype") and engine["dtype"] != "auto":
        return engine["dtype"]
    runs = data.get("runs") or []
    if runs and isinstance(runs[0], dict) and runs[0].get("dtype"):
        return str(runs[0]["dtype"]).removeprefix("torch.")
    if runs and isinstance(runs[0], dict) and (runs[0].get("runtime") or {}).get("dtype"):
        return runs[0]["runtime"]["dtype"]  # (quant e2e: the engine's runtime info)
    if _meta(data).get("activations"):  # (quant kernels: the activations' dtype)
        return _meta(data)["activations"]
    for part in ("e2e", "kernels", "gguf", "llamacpp"):  # (a `--suite quant` record: its first part's)
        sub = _meta(data).get(part)
        sub = sub[0] if isinstance(sub, list) and sub else sub
        if isinstance(sub, dict):
            return dtype(sub)
    if isinstance(_meta(data).get("dtype"), str):  # (a mask artifact: the dtype it was searched in)
        return _meta(data)["dtype"]
    return "not recorded"


def commit(data: dict) -> str:
    env = _environment(data)
    c = env.get("git_commit")
    if not c:
        return "not recorded"
    return f"{c[:7]}" + (" (uncommitted changes)" if env.get("git_dirty") else "")


def source_line(path: str, data: dict) -> str:
    """One line: the file, and the command, commit, CPU capability and dtype it recorded."""
    env = _environment(data)
    machine = ", ".join(
        x
        for x in (
            env.get("cpu"),
            f"{env['cpu_count']} cores" if env.get("cpu_count") else None,
            f"torch {env['torch']}" if env.get("torch") else None,
        )
        if x
    )
    link = path.removeprefix("docs/") if path.startswith("docs/") else f"../{path}"  # (from a page in docs/)
    return (
        f"Source: [`{path}`]({link}): `{_meta(data).get('command')}`; "
        f"commit `{commit(data)}`; CPU capability `{capability(data)}`; dtype `{dtype(data)}`"
        + (f"; {machine}." if machine else ".")
    )


# ------------------------------------------------------------------ formatting


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _spread(s: dict | None, spec: str = ".2f", suffix: str = "") -> str:
    if not s:
        return "-"
    if s.get("n", 1) > 1 and s["min"] != s["max"]:
        return f"{s['median']:{spec}}{suffix} [{s['min']:{spec}}-{s['max']:{spec}}]"
    return f"{s['median']:{spec}}{suffix}"


def _pass_count(p: dict | None) -> str:
    if not p:
        return "-"
    passed = round(p["pass_at_1"] * p["n_samples"])
    return f"{passed}/{p['n_samples']} [{p['wilson95'][0]:.2f}-{p['wilson95'][1]:.2f}]"


def _pass_rate(p: dict | None) -> str:
    if not p:
        return "-"
    return f"{p['pass_at_1']:.3f} [{p['wilson95'][0]:.2f}-{p['wilson95'][1]:.2f}]"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(cells: list[str], right: int = 0) -> list[str]:
    """The header and rule of a table whose last `right` columns are right-aligned."""
    rule = ["---"] * (len(cells) - right) + ["---:"] * right
    return [_row(cells), "|" + "|".join(rule) + "|"]


# ------------------------------------------------------------------ the tables

#: how a bench method is named in the tables
METHOD_NAMES = {
    "hf": "transformers `generate`",
    "hf-assisted": "transformers assisted generation (its defaults)",
    "hf-assisted:draft=fixed": "transformers assisted generation, 5 draft tokens",
    "via:region_b=escalate": "`via`, pre-check (accept or escalate)",
    "sd:proposer=hybrid": "`sd`, prompt lookup then the drafter",
    "sd:draft_confidence=0.4:adaptive_gamma=true": "`sd`, confidence stop + adaptive gamma",
    "sd:proposer=hybrid:draft_confidence=0.4:adaptive_gamma=true": "`sd`, all three",
}


def _method(label: str) -> str:
    return METHOD_NAMES.get(label, f"`{label}`")


def _runs(results: dict, label: str) -> list[dict]:
    return [r for r in results["runs"] if r["method"] == label]


def batch1(sources: list[dict]) -> list[str]:
    """Batch 1: our modes beside transformers generate and assisted generation, one process."""
    (res,) = sources
    summary = res["summary"]
    lines = _header(
        [
            "method",
            "tok/s [min-max]",
            "vs `ar`",
            "vs `generate`",
            "vs assisted generation",
            "mean accept length",
            "pass@1 [95%]",
            "agreement with `ar` (prefix / identical)",
        ]
    )
    assisted = _runs(res, "hf-assisted")
    for m in res["methods"]:
        label = m["label"]
        s = summary[label]
        if s.get("alias_of") or "tokens" not in s:
            continue
        ag = s.get("agreement_with_ar")
        lines.append(
            _row(
                [
                    _method(label),
                    _spread(s["tokens_per_second_per_pass"]),
                    _spread(s.get("speedup_vs_ar"), suffix="x"),
                    _spread(s.get("speedup_vs_hf"), suffix="x"),
                    _spread(ratio(_runs(res, label), assisted), suffix="x") if assisted else "-",
                    _f(s.get("mean_acceptance_length")),
                    _pass_count(s.get("pass_at_1")),
                    "-" if not ag else f"{ag['prefix_share']:.2f} / {ag['exact']:.2f}",
                ]
            )
        )
    meta = res["meta"]
    lines += [
        "",
        f"{len(meta['prompts']) if isinstance(meta['prompts'], list) else meta['prompts']} HumanEval prompts x "
        f"{meta['max_tokens']} tokens, T = {meta['temperature']:g}, {meta['repeats']} interleaved passes; "
        "tok/s is the median over passes, each ratio the median of its per-pass ratios.",
    ]
    return lines


def drafting(sources: list[dict]) -> list[str]:
    """Batch 1: the drafting options of `sd` beside `sd`, `via` and transformers assisted generation."""
    (res,) = sources
    summary = res["summary"]
    lines = _header(
        [
            "method",
            "tok/s",
            "vs `ar`",
            "vs `sd`",
            "vs assisted generation",
            "forwards p / q' / q",
            "pass@1 [95%]",
        ]
    )
    sd, assisted = _runs(res, "sd"), _runs(res, "hf-assisted")
    for m in res["methods"]:
        label = m["label"]
        s = summary[label]
        if s.get("alias_of") or "tokens" not in s:
            continue
        fw = s["forwards"]
        lines.append(
            _row(
                [
                    _method(label),
                    _spread(s["tokens_per_second_per_pass"]),
                    _spread(s.get("speedup_vs_ar"), suffix="x"),
                    _spread(ratio(_runs(res, label), sd), suffix="x"),
                    _spread(ratio(_runs(res, label), assisted), suffix="x") if assisted else "-",
                    f"{fw['drafter']} / {fw['slim']} / {fw['full']}",
                    _pass_count(s.get("pass_at_1")),
                ]
            )
        )
    first = res["prompts"][0]["id"] if res.get("prompts") else "?"
    last = res["prompts"][-1]["id"] if res.get("prompts") else "?"
    meta = res["meta"]
    lines += [
        "",
        f"Prompts {first} to {last}, {meta['max_tokens']} tokens, T = {meta['temperature']:g}, "
        f"{meta['repeats']} pass{'es' if meta['repeats'] > 1 else ''}.",
    ]
    return lines


LOAD_METHODS = ("ar", "sd", "via", "auto", "ar@batch1", "generate_batch", "roofline")
LOAD_NAMES = {
    "ar@batch1": "`ar`, one at a time",
    "generate_batch": "transformers `generate_batch`",
    "roofline": "bare batched forward",
}


def load(sources: list[dict]) -> list[str]:
    """Under load: aggregate (and decode-phase) tokens/s against generate_batch and the bare forward."""
    (res,) = sources
    rows = [r for r in res["summary"] if r["arrival"] == "all"]
    methods = [m for m in LOAD_METHODS if any(r["method"] == m for r in rows)]
    cell = {(r["method"], r["concurrency"]): r for r in rows}
    levels = sorted({r["concurrency"] for r in rows})
    engine = [m for m in methods if m in ("ar", "sd", "via", "auto")]
    lines = _header(
        ["requests"] + [LOAD_NAMES.get(m, f"`{m}`") for m in methods] + ["best mode / `generate_batch`"],
        right=len(methods) + 2,
    )
    for c in levels:
        cells = [str(c)]
        for m in methods:
            r = cell.get((m, c))
            if r is None or r["aggregate_tokens_per_second"] is None:
                cells.append("-")
                continue
            agg, dec = r["aggregate_tokens_per_second"], r.get("decode_tokens_per_second")
            cells.append(f"{agg:.1f}" if dec is None or m == "roofline" else f"{agg:.1f} ({dec:.1f})")
        best = max(
            (cell[(m, c)]["aggregate_tokens_per_second"] for m in engine if (m, c) in cell),
            default=None,
        )
        gb = cell.get(("generate_batch", c))
        cells.append(f"{best / gb['aggregate_tokens_per_second']:.2f}x" if best and gb else "-")
        lines.append(_row(cells))
    meta = res["meta"]
    lines += [
        "",
        f"Every request arrives at once; {meta['max_tokens']} tokens each, T = {meta['temperature']:g}, "
        f"{meta['passes']} pass{'es' if meta['passes'] > 1 else ''}. Aggregate tokens/s with the prefill, "
        "and in brackets the decode-phase rate (requests / inter-token latency p50); the bare forward "
        "has no prefill.",
    ]
    return lines


def served(sources: list[dict]) -> list[str]:
    """The same engine served (HTTP through Ray Serve, actors) and in process; where the file has
    it, the in-process engine beside a synthetic load as large as the serving stack's share."""
    (res,) = sources
    by = {(r["system"], r["mode"], r["concurrency"]): r for r in res["summary"]}
    beside = any(system == "in_process_beside_serving" for system, _, _ in by)
    load = {}  # (mode, c) -> the synthetic load's cores, the median over the passes
    for r in res["runs"] if beside else ():
        if r["system"] == "in_process_beside_serving":
            load.setdefault((r["mode"], r["concurrency"]), []).append(r["synthetic_load_cores"])
    extra = ["serving stack's cores", "in process beside them tok/s", "served / beside"] if beside else []
    lines = _header(
        [
            "mode",
            "streams",
            "in process tok/s",
            "served tok/s",
            "served / in process",
            *extra,
            "served TTFT p50 / p99 (s)",
            "served ITL p50 / p99 (s)",
        ],
        right=5 + len(extra),
    )
    for mode in res["modes"]:
        for c in res["levels"]:
            i, s, b = (
                by.get(("in_process", mode, c)),
                by.get(("served", mode, c)),
                by.get(("in_process_beside_serving", mode, c)),
            )
            if not i or not s:
                continue
            cells = [
                f"`{mode}`",
                str(c),
                f"{i['aggregate_tokens_per_s']:.2f}",
                f"{s['aggregate_tokens_per_s']:.2f}",
                f"{s['aggregate_tokens_per_s'] / i['aggregate_tokens_per_s']:.2f}",
            ]
            if beside:
                cells += [
                    f"{statistics.median(load[(mode, c)]):.2f}",
                    f"{b['aggregate_tokens_per_s']:.2f}",
                    f"{s['aggregate_tokens_per_s'] / b['aggregate_tokens_per_s']:.2f}",
                ]
            cells += [f"{s['p50_ttft_s']:.2f} / {s['p99_ttft_s']:.2f}", f"{s['p50_itl_s']:.3f} / {s['p99_itl_s']:.3f}"]
            lines.append(_row(cells))
    tok = res.get("tokens") or {}
    systems = "in process, served and in process beside the serving stack's load" if beside else "in process and served"
    lines += [
        "",
        f"{res['passes']} passes, {systems} alternating, each figure the median of its passes; "
        f"{tok.get('streams_mismatched')} of {tok.get('streams_checked')} greedy streams "
        "differ from their prompt's first stream.",
    ]
    return lines


#: the gate settings of the quality evaluation, by spec
SETTINGS = {
    "ar": "`ar`",
    "sd": "`sd`",
    "via:alpha1=0.5:alpha2=0.3": "`via`, the paper's gates",
    "via:alpha1=0.7:region_b=escalate": "`via`, literal reading",
    "via:alpha1=0.4:alpha2=0.3:region_b=escalate": "`via`, calibrated gates (the default)",
    "via:rule=staged": "`via`, staged rule (lossless)",
}


def quality(sources: list[dict]) -> list[str]:
    """Greedy quality of every mode and gate setting, with the batch-1 speed of each."""
    res, speed = sources
    n = {s["humaneval"]["pass_at_1"]["n_samples"] for s in res["summary"].values() if s["humaneval"].get("pass_at_1")}
    lines = _header(
        [
            "setting",
            "spec",
            f"HumanEval pass@1 [95%] (n={'/'.join(map(str, sorted(n)))})",
            "agreement with `ar`, HumanEval (prefix / identical)",
            "agreement with `ar`, standard library",
            "batch-1 tok/s (vs `ar`)",
        ]
    )
    order = [x for x in SETTINGS if x in res["summary"]] + [x for x in res["summary"] if x not in SETTINGS]
    for spec in order:
        s = res["summary"][spec]
        he, lib = s["humaneval"], s.get("stdlib") or {}
        sp = speed["summary"].get(spec)

        def agree(part: dict) -> str:
            a = part.get("agreement_with_ar")
            return "-" if not a else f"{a['prefix_share']:.2f} / {a['identical']:.2f}"

        tps = (
            "-"
            if not sp or "tokens" not in sp
            else f"{sp['tokens_per_second_per_pass']['median']:.2f} ({sp['speedup_vs_ar']['median']:.2f}x)"
        )
        lines.append(
            _row(
                [
                    SETTINGS.get(spec, f"`{spec}`"),
                    f"`{spec}`",
                    _pass_rate(he.get("pass_at_1")),
                    agree(he),
                    agree(lib),
                    tps,
                ]
            )
        )
    meta = res["meta"]
    corpora = meta.get("corpora", {})
    lines += [
        "",
        f"HumanEval/0-{len(corpora.get('humaneval', [])) - 1} and {len(corpora.get('stdlib', []))} standard-library "
        f"functions, at most {meta['max_tokens']} tokens, {meta['max_batch']} rows decoding together, T = 0. "
        f"Speed: [`{SPEED}`]({SPEED.removeprefix('docs/')}) (`{_meta(speed).get('command')}`; commit "
        f"`{commit(speed)}`; CPU capability `{capability(speed)}`).",
    ]
    return lines


def quality_sampled(sources: list[dict]) -> list[str]:
    """Sampled quality (T = 1) against the matched baseline of each lossy setting."""
    (res,) = sources
    lines = _header(["setting", "seeds", "HumanEval pass@1 [95%]", "samples", "vs its matched baseline"])
    for spec, s in res["summary"].items():
        if s["params"]["temperature"] == 0:
            continue  # a greedy setting rescored here: the greedy table has it
        he = s["humaneval"]
        base = s.get("matched_baseline")
        vs = "-" if not base else f"{he['delta_pass_at_1']:+.3f} against `{base}` ({he['baseline_pass_at_1']:.3f})"
        lines.append(
            _row(
                [
                    f"`{spec}`",
                    ", ".join(map(str, s["seeds"])),
                    _pass_rate(he.get("pass_at_1")),
                    str(he["pass_at_1"]["n_samples"]),
                    vs,
                ]
            )
        )
    return lines


#: the two sides of the host-work measurement
SIDES = {"before": "per row, on the host", "after": "batched, on the device"}


def _median(runs: list[dict], key: str, scale: float = 1.0) -> float:
    return statistics.median(x[key] * scale for x in runs)


def host_work(sources: list[dict]) -> list[str]:
    """What a decode step of many rows spends outside its forwards."""
    (res,) = sources
    lines = _header(
        [
            f"method ({res['rows']} rows)",
            "sampling and rules",
            "step ms",
            "forwards ms",
            "outside ms",
            "host reads",
            "tokens/s [min-max]",
        ],
        right=5,
    )
    sides = [s for s in SIDES if any(r["side"] == s for r in res["runs"])]
    methods = list(dict.fromkeys(m for r in res["runs"] for m in r["methods"]))
    for m in methods:
        for side in sides:
            runs = [r["methods"][m] for r in res["runs"] if r["side"] == side and m in r["methods"]]
            if not runs:
                continue

            tps = [x["tokens_per_second"] for x in runs]
            lines.append(
                _row(
                    [
                        f"`{m}`",
                        SIDES[side],
                        f"{_median(runs, 'step_seconds', 1000):.0f}",
                        f"{_median(runs, 'forward_seconds', 1000):.0f}",
                        f"{_median(runs, 'outside_seconds', 1000):.1f}",
                        f"{_median(runs, 'host_reads'):.0f}",
                        _spread(
                            {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "n": len(tps)}, ".1f"
                        ),
                    ]
                )
            )
    lines += [
        "",
        f"{res['steps']} steps per run, each side run {len(res['runs']) // max(1, len(sides))} times, alternating; "
        "medians over the runs. `outside` is a step's wall time less its forwards.",
    ]
    return lines


def _layers(skipped: list[int]) -> str:
    """Layer indices, compact: an arithmetic run of step > 1 as `a, b, c, ..., z`, else runs of
    three or more consecutive layers as `a-z`."""
    steps = {b - a for a, b in zip(skipped, skipped[1:])}
    if len(skipped) >= 5 and len(steps) == 1 and steps != {1}:
        return ", ".join(map(str, skipped[:3])) + f", ..., {skipped[-1]}"
    parts, i = [], 0
    while i < len(skipped):
        j = i
        while j + 1 < len(skipped) and skipped[j + 1] == skipped[j] + 1:
            j += 1
        parts += [f"{skipped[i]}-{skipped[j]}"] if j - i >= 2 else [str(x) for x in skipped[i : j + 1]]
        i = j + 1
    return ", ".join(parts)


def _bold_better(a: str, b: str, a_better: bool) -> tuple[str, str]:
    return (f"**{a}**", b) if a_better else (a, f"**{b}**")


def dimr_heldout(sources: list[dict]) -> list[str]:
    """A shipped mask artifact's held-out scores: the searched mask against evenly spaced skips."""
    artifact = sources[0]
    h = artifact["heldout"]
    s, e = h["searched"], h["evenly_spaced"]
    tokens = h["calibration"]["tokens"]
    rows = [
        ("skipped layers", _layers(artifact["skipped_layers"]), _layers(e["skipped_layers"])),
        (
            "paper's cost `C(z)` (sum) / per token",
            *_bold_better(
                f"{s['rkl_total']:.0f} / {s['rkl']:.2f}", f"{e['rkl_total']:.0f} / {e['rkl']:.2f}", s["rkl"] < e["rkl"]
            ),
        ),
        ("KL(q ‖ q'_z) per token", *_bold_better(f"{s['kl']:.2f}", f"{e['kl']:.2f}", s["kl"] < e["kl"])),
        ("total variation per token", *_bold_better(f"{s['tv']:.3f}", f"{e['tv']:.3f}", s["tv"] < e["tv"])),
        ("top-1 agreement with q", *_bold_better(f"{s['top1']:.1%}", f"{e['top1']:.1%}", s["top1"] > e["top1"])),
        (
            "gate regions A / B / C (greedy drafter, the paper's gates)",
            " / ".join(f"{x:.2f}" for x in s["e2e_detail"]["regions_abc"]),
            " / ".join(f"{x:.2f}" for x in e["e2e_detail"]["regions_abc"]),
        ),
        ("modelled `e2e` (good tokens/s)", f"{s['e2e']:.2f}", f"{e['e2e']:.2f}"),
    ]
    return [*_header([f"held-out, {tokens} tokens", "searched mask", "evenly spread mask"]), *map(_row, rows)]


def _mask_cell(m: dict) -> str:
    """top-1 agreement / the paper's cost per token / escalation rate."""
    return f"{m['top1']:.1%} / {m['rkl']:.2f} / {m['escalation_rate']:.2f}"


def dimr_ratios(sources: list[dict]) -> list[str]:
    """Every shipped ratio's searched mask against evenly spaced skips and the best of the random
    masks (by top-1, then cost), on the same held-out tokens; an artifact given as a further
    source replaces the searched cell of its ratio with its own held-out scores."""
    compare, *artifacts = sources
    own = {a["ratio"]: a["heldout"]["searched"] for a in artifacts}
    rows = []
    for entry in sorted(compare["ratios"], key=lambda r: (r["ratio"], "e2e" in r["masks"][0]["name"])):
        searched, even, *randoms = entry["masks"]
        e2e = "e2e" in searched["name"]
        if not e2e and entry["ratio"] in own:
            s = own[entry["ratio"]]
            searched = {"top1": s["top1"], "rkl": s["rkl"], "escalation_rate": s["e2e_detail"]["escalation_rate"]}
        best = max(randoms, key=lambda m: (m["top1"], -m["rkl"])) if randoms and not e2e else None
        cell = _mask_cell(searched)
        if searched["top1"] > max(m["top1"] for m in [even, *([best] if best else [])]):
            cell = f"**{cell.split(' / ', 1)[0]}** / {cell.split(' / ', 1)[1]}"
        label = f"{entry['ratio']:.2f}" + (", `e2e` objective" if e2e else "")
        rows.append([label, cell, _mask_cell(even), _mask_cell(best) if best else "—"])
    return [*_header(["ratio", "searched", "evenly spaced", f"best of {len(randoms)} random"]), *map(_row, rows)]


# ------------------------------------------------------------------ weight quantization (`--suite quant`)


def _part(data: dict, key: str) -> list[dict]:
    """A quant part's records: a `viasd bench --suite quant` results.json holds them under `key`
    (``gguf``: a list, one per model); a committed per-part file is its own record."""
    if key in data or "parts" in data:
        value = data.get(key) or []
        return value if isinstance(value, list) else [value]
    return [data]


def _gb(n: int | None) -> str:
    return "-" if not n else f"{n / 1e9:.2f}"


def quant_gguf(sources: list[dict]) -> list[str]:
    """Built-in models' quantized linears against their GGUF files' own dequantized values."""
    checks = [c for data in sources for c in _part(data, "gguf")]
    dtypes = sorted({c["dtype"] for c in checks})
    lines = _header(
        [
            "model",
            "GGUF type",
            "tensors",
            "served as",
            "max abs error of the weights",
            "over the int8 step",
            f"in the kernel, {' / '.join(dtypes)}: max abs (of the row's max)",
            "loaded weight equal",
        ],
        right=4,
    )
    for c in checks:
        for gtype, e in c["by_gguf_type"].items():
            int8 = any(m.startswith("int8") for m in e["mapped_to"])
            lines.append(
                _row(
                    [
                        f"`{c['model']}`",
                        gtype,
                        str(e["tensors"]),
                        "; ".join(e["mapped_to"]),
                        "0" if e["max_abs_error"] == 0 else f"{e['max_abs_error']:.4f}",
                        f"{e['max_error_over_step']:.2f}" if int8 else "-",
                        f"{e['kernel_max_abs_error']:.4f} ({e['kernel_max_rel_error']:.2%})",
                        "yes" if e["loaded_equal"] else "NO",
                    ]
                )
            )
    lines += [
        "",
        f"Mapping `{'` / `'.join(sorted({c['scheme'] for c in checks}))}`. "
        + " ".join(
            f"[`{p}`]({p.removeprefix('docs/')}): `{_meta(d).get('command')}`; commit `{commit(d)}`; "
            f"CPU capability `{capability(d)}`."
            for p, d in zip(QUANT_GGUF[1:], sources[1:])
        ),
    ]
    return lines


#: the kernels of the short table, and the row counts shown
QUANT_KERNELS = {
    "bf16": "bf16",
    "bf16_packed": "bf16 packed",
    "int8": "int8",
    "int8_a8w8": "int8 a8w8",
    "int8_onednn_a8w8": "int8 oneDNN a8w8",
    "int4_g32": "int4 g32",
    "int4_g32_again": "int4 g32 (A/A)",
    "torchao_a8w8": "torchao a8w8",
    "torchao_int4_g32": "torchao int4 g32",
    "torchao_da8w4_g32": "torchao da8w4 g32",
}
QUANT_ROWS = (1, 4, 16)
QUANT_SHAPES = {
    "q_o_proj": "q / o",
    "k_v_proj": "k / v",
    "gate_up_proj": "gate / up",
    "down_proj": "down",
    "lm_head": "lm_head",
}


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _times(results: list[dict], kernel: str) -> str:
    """min-max over every (shape, M) of a kernel's best time over bf16's."""
    r = [x["kernels"][kernel]["best_s"] / x["kernels"]["bf16"]["best_s"] for x in results if kernel in x["kernels"]]
    return f"{min(r):.1f}-{max(r):.1f}" if r else "-"


def quant_kernels(sources: list[dict]) -> list[str]:
    """Quantized matmul kernels against bf16: best milliseconds at a few row counts."""
    rec = _part(sources[0], "kernels")[0]
    results = rec["results"]
    kernels = [k for k in QUANT_KERNELS if any(k in x["kernels"] for x in results)]
    lines = _header(["shape (K -> N)", "M", *(QUANT_KERNELS[k] for k in kernels)], right=len(kernels) + 1)
    shape = None
    for x in results:
        if x["M"] not in QUANT_ROWS:
            continue
        name = "" if x["shape"] == shape else f"{QUANT_SHAPES.get(x['shape'], x['shape'])} {x['K']} -> {x['N']}"
        shape = x["shape"]
        lines.append(
            _row([name, str(x["M"]), *(_ms(x["kernels"][k]["best_s"]) if k in x["kernels"] else "-" for k in kernels)])
        )
    ao = rec.get("torchao") or {}
    rows = sorted({x["M"] for x in results})
    lines += [
        "",
        f"Best of the interleaved rounds, milliseconds, {rec.get('activations')} activations, "
        f"{rec.get('cores')} cores ({rec.get('cpu_model')}), torch {rec.get('torch')}, "
        + (f"torchao {ao['version']}" if ao.get("available") else "torchao not installed")
        + f". Over every shape and M of the file ({', '.join(map(str, rows))}): the int4 weight dequantized at "
        f"every call (`int4_dequant_g32`) takes {_times(results, 'int4_dequant_g32')} times a bf16 product; "
        f"the int8 weight widened a slice at a time (`int8_chunked`), {_times(results, 'int8_chunked')} times"
        + (
            f"; torch's `_dyn_quant_matmul_4bit`, {_times(results, 'dyn_quant_4bit_g32')} times"
            if any("dyn_quant_4bit_g32" in x["kernels"] for x in results)
            else ""
        )
        + "."
        + (f" {_aa(results)}" if any("int4_g32_again" in x["kernels"] for x in results) else ""),
    ]
    return lines


def _aa(results: list[dict]) -> str:
    """The A/A pair of the kernels part: int4 g32 run twice a round, on two copies of its weight."""
    spread = [
        abs(x["kernels"]["int4_g32"]["best_s"] - x["kernels"]["int4_g32_again"]["best_s"])
        / statistics.mean([x["kernels"]["int4_g32"]["best_s"], x["kernels"]["int4_g32_again"]["best_s"]])
        for x in results
        if "int4_g32_again" in x["kernels"]
    ]
    return (
        f"The A/A pair (int4 g32 twice a round, two copies of the weight) differs by {statistics.median(spread):.1%} "
        f"at the median (shape, M), {max(spread):.1%} at most."
    )


def quant_e2e(sources: list[dict]) -> list[str]:
    """Greedy decoding on the embedded pair per weight quantization, one process each."""
    rec = _part(sources[0], "e2e")[0]
    runs = rec["runs"]
    base = next((r for r in runs if r["quantization"] == "none"), None)

    def vs(r: dict, key: str, per_token: bool) -> str:
        if base is None or r is base:
            return ""
        x = base[key] / r[key] if per_token else r[key] / base[key]
        return f" ({x:.2f}x)"

    lines = _header(
        [
            "quantization",
            "load (s)",
            "`ar`, batch 1 (ms a token)",
            "`sd`, batch 1 (ms a token)",
            "`sd` tokens equal to `ar`'s",
            "`ar`, 16 requests (tokens/s)",
            "verifier GB: integers / dense copies",
        ],
        right=6,
    )
    for r in runs:
        rt = r.get("runtime") or {}
        quant = rt.get("quantization") or []
        if quant:
            v = quant[0]
            how = f"{v['quantization']}: `{v['quantization_reason']}`"
            mem = f"{_gb(v.get('bytes'))} / {_gb(v.get('dense_bytes'))}"
        else:
            how = f"{rt.get('dtype')}, `{rt.get('linear_method')}`"
            mem = "-"
        lines.append(
            _row(
                [
                    f"{r['quantization']} ({how})",
                    f"{r['load_s']:.1f}",
                    f"{r['ar_1_s_per_token'] * 1e3:.1f}{vs(r, 'ar_1_s_per_token', True)}",
                    f"{r['sd_1_s_per_token'] * 1e3:.1f}{vs(r, 'sd_1_s_per_token', True)}",
                    f"{r['sd_agrees_with_ar']:.0%}",
                    f"{r['ar_16_tokens_per_s']:.1f}{vs(r, 'ar_16_tokens_per_s', False)}",
                    mem,
                ]
            )
        )
    extra = base and (base.get("runtime") or {}).get("linear_extra_bytes")
    lines += [
        "",
        f"n = {rec['tokens']} tokens, best of {rec['repeats']}; in brackets, against `none`. "
        + (f"`none` holds {_gb(extra)} GB of prepacked copies (both models). " if extra else "")
        + "The runtime info (`quantization`) of each run is in the file.",
    ]
    return lines


#: how the llamacpp part's systems are named in its table
LLAMACPP_NAMES = {"llama.cpp": "llama.cpp, plain decoding", "ar": "via-sd `ar`", "auto": "via-sd `auto`"}


def _rounds(s: dict, spec: str = ".2f") -> str:
    return " / ".join(format(v, spec) for v in s["rounds"])


def _lengths(rec: dict) -> str:
    n = sorted({len(ids) for ids in rec.get("prompt_ids") or []})
    return "-" if not n else str(n[0]) if n[0] == n[-1] else f"{n[0]}-{n[-1]}"


def quant_llamacpp(sources: list[dict]) -> list[str]:
    """Batch-1 greedy decoding beside llama.cpp's on the same GGUF file, prompts and token count."""
    recs = _part(sources[0], "llamacpp")
    if not recs:
        return []
    rec = recs[0]
    if not rec.get("summary"):
        return [f"Not measured: {(rec.get('llama_cpp') or {}).get('error', 'no runs')}."]
    summary = rec["summary"]
    lines = _header(
        [
            "system",
            "decode tokens/s, each round",
            "A/A spread",
            "decode tokens/s (mean)",
            "vs llama.cpp",
            "tokens/s, prefill included (mean)",
            "vs llama.cpp",
            "tokens before the first difference from llama.cpp's, per prompt",
        ],
        right=6,
    )
    n = 1 + rec["tokens"]
    for system, e in summary.items():
        d, w, vs = e["decode_tokens_per_s"], e["wall_tokens_per_s"], e.get("vs_llama_cpp")
        same = e.get("tokens_equal_to_llama_cpp")
        lines.append(
            _row(
                [
                    LLAMACPP_NAMES.get(system, f"`{system}`"),
                    _rounds(d),
                    f"{d['aa_spread']:.1%}",
                    f"{d['mean']:.2f}",
                    f"{vs['decode_tokens_per_s']:.2f}x" if vs else "-",
                    f"{w['mean']:.2f}",
                    f"{vs['wall_tokens_per_s']:.2f}x" if vs else "-",
                    "-" if system == "llama.cpp" or same is None else f"{', '.join(map(str, same))} of {n}",
                ]
            )
        )
    ll = summary.get("llama.cpp", {})
    via = next((r for r in rec["runs"] if r["system"] == "via-sd"), {})
    quant = (via.get("runtime") or {}).get("quantization") or []
    served = f"{quant[0]['quantization']} (`{quant[0]['quantization_reason']}`)" if quant else "none"
    info = rec["llama_cpp"]
    lines += [
        "",
        f"Greedy, batch 1, {len(rec['prompts'])} prompts ({', '.join(f'`{p}`' for p in rec['prompts'])}) x "
        f"{rec['tokens']} generated tokens after the first, the same token ids on both sides; "
        f"{rec['rounds']} rounds in the order {', '.join(rec['order'])}, one process each. "
        f"llama.cpp {info['llama_cpp']} (llama-cpp-python) on `{info['gguf']}` with {rec['threads']} threads; "
        f"its own counters: {_f(ll.get('llama_eval_tokens_per_s'))} tokens/s decoding, "
        f"{_f(ll.get('llama_prompt_tokens_per_s'), '.0f')} tokens/s on the prompts ({_lengths(rec)} tokens). "
        f"via-sd with `--quantization {rec['quantization']}`: verifier served {served}, "
        f"{via.get('threads')} threads. Decode tokens/s: n / (t(1 + n) - t(1)), summed over the prompts; "
        "the A/A spread is (max - min) / mean of a system's rounds.",
    ]
    return lines


def quant_quality(sources: list[dict]) -> list[str]:
    """pass@1 of greedy `ar` on the first HumanEval problems per quantization, one evaluation each."""

    def label(data: dict) -> str:
        found = re.search(r"--quantization (\S+)", _meta(data).get("command") or "")
        return found.group(1) if found else "auto"

    lines = _header(
        [
            "quantization",
            "verifier served",
            "HumanEval pass@1 [95% Wilson]",
            "passed",
            f"within `{label(sources[0])}`'s interval",
            f"completions identical to `{label(sources[0])}`'s",
        ],
        right=4,
    )
    first = None
    for data in sources:
        s = data["summary"]["ar"]["humaneval"]
        p = s["pass_at_1"]
        rt = data["meta"].get("runtime") or {}
        quant = rt.get("quantization") or []
        served = f"{quant[0]['quantization']} (`{quant[0]['quantization_reason']}`)" if quant else rt.get("dtype")
        runs = {r["prompt"]: r for r in data["runs"] if r["method"] == "ar" and r["corpus"] == "humaneval"}
        if first is None:
            first, within, same = (p, runs), "-", "-"
        else:
            lo, hi = first[0]["wilson95"]
            within = "yes" if lo <= p["pass_at_1"] <= hi else "NO"
            k = sum(r["completion"] == first[1][k]["completion"] for k, r in runs.items() if k in first[1])
            same = f"{k}/{len(runs)}"
        lines.append(
            _row(
                [
                    f"`{label(data)}`",
                    served,
                    _pass_rate(p),
                    f"{round(p['pass_at_1'] * p['n_samples'])}/{p['n_samples']}",
                    within,
                    same,
                ]
            )
        )
    meta = sources[0]["meta"]
    batches = {label(d): d["meta"]["max_batch"] for d in sources}
    together = (
        f"{meta['max_batch']} requests"
        if len(set(batches.values())) == 1
        else ", ".join(f"`{name}` {b} request{'s' if b > 1 else ''}" for name, b in batches.items())
    )
    lines += [
        "",
        f"Greedy `ar`, the first {len(meta['corpora']['humaneval'])} HumanEval problems, at most "
        f"{meta['max_tokens']} tokens, {together} decoding together; pass@1 by running each "
        "problem's tests. "
        + " ".join(
            f"[`{p}`]({p.removeprefix('docs/')}): `{_meta(d).get('command')}`; commit `{commit(d)}`; "
            f"CPU capability `{capability(d)}`."
            for p, d in zip(QUANT_QUALITY[1:], sources[1:])
        ),
    ]
    return lines


def quant_markdown(record: dict) -> str:
    """results.md of `viasd bench --suite quant`: the tables of the parts it ran."""
    out = [f"Command: `{record.get('command')}`; commit `{commit(record)}`; CPU capability `{capability(record)}`."]
    for key, title, render_ in (
        ("kernels", "Kernels", quant_kernels),
        ("gguf", "GGUF mapping", lambda s: quant_gguf(s)[:-2]),
        ("e2e", "End to end", quant_e2e),
        ("llamacpp", "Beside llama.cpp", quant_llamacpp),
    ):
        if record.get(key):
            out += ["", f"### {title}", "", *render_([record])]
    return "\n".join(out) + "\n"


def blocks_capacity(sources: list[dict]) -> list[str]:
    """One KV budget, slot rows against blocks: a long prompt beside many short ones."""
    (res,) = sources
    rows, length = res["budget"]["as_slot_rows"]
    lines = _header(["setting", "refused", "most decoding at once", "preemptions", "seconds", "tokens/s"], right=5)
    for name, r in res["capacity"].items():
        lines.append(
            _row(
                [
                    name,
                    f"{r['refused']} of {r['requests']}",
                    str(r["most_decoding"]),
                    str(r["preemptions"]),
                    f"{r['seconds']:.1f}",
                    f"{r['tokens_per_second']:.1f}",
                ]
            )
        )
    first = next(iter(res["capacity"].values()))
    return lines + [
        "",
        f"A budget of {res['budget']['gib']:.3f} GiB: {rows} slot rows of {length:,} positions. "
        f"{first['requests']} requests, `ar`, {first['generated_tokens'] // max(1, first['requests'] - first['refused'])} "
        "new tokens each.",
    ]


def blocks_prefix(sources: list[dict]) -> list[str]:
    """Requests behind one system prompt, with prefix caching off and on."""
    (res,) = sources
    lines = _header(
        ["prefix caching", "prompt positions computed", "prefill forwards", "every first token (s)", "tokens/s"],
        right=4,
    )
    for name, r in res["prefix"].items():
        lines.append(
            _row(
                [
                    name.removeprefix("prefix caching "),
                    f"{r['prompt_tokens'] - r['cached_tokens']:,} of {r['prompt_tokens']:,}",
                    str(r["prefill_forwards"]),
                    f"{r['all_first_tokens_seconds']:.1f}",
                    f"{r['tokens_per_second']:.1f}",
                ]
            )
        )
    return lines


def blocks_throughput(sources: list[dict]) -> list[str]:
    """Requests arriving at once on slot rows and on blocks, per level (requests at once) and mode:
    tokens/s of each round, the A/A spread, blocks / slots."""
    (res,) = sources
    t = res["throughput"]
    levels = t.get("levels") or [t]  # (a single level: the files written before levels)
    lines = _header(
        [
            "requests at once",
            "mode",
            "slots, tokens/s each round",
            "blocks, tokens/s each round",
            "A/A spread",
            "blocks / slots",
        ],
        right=4,
    )
    for level in levels:
        for mode, rounds in level["modes"].items():
            rate = {name: [r["tokens_per_second"] for r in rs] for name, rs in rounds.items()}
            spread = max((max(v) - min(v)) / statistics.mean(v) for v in rate.values())
            ratio = statistics.mean(rate["blocks"]) / statistics.mean(rate["slots"])
            lines.append(
                _row(
                    [
                        str(level["requests"]),
                        f"`{mode}`",
                        " / ".join(f"{v:.1f}" for v in rate["slots"]),
                        " / ".join(f"{v:.1f}" for v in rate["blocks"]),
                        f"{spread:.1%}",
                        f"{ratio:.2f}x",
                    ]
                )
            )
    first = levels[0]
    new = next(iter(next(iter(first["modes"].values())).values()))[0]["generated_tokens"] // first["requests"]
    return lines + [
        "",
        f"Prompts of {t['prompt_tokens']} tokens, all arriving at once, {new} new tokens each; "
        "rounds alternate slots, blocks, slots, blocks; the A/A spread is the larger (max - min) / mean of a setting's rounds.",
    ]


def blocks_markdown(record: dict) -> str:
    """results.md of `viasd bench --suite blocks` (the parts it ran)."""
    parts = [
        render([record])
        for key, render in (("capacity", blocks_capacity), ("prefix", blocks_prefix), ("throughput", blocks_throughput))
        if record.get(key)
    ]
    head = f"Command: `{record.get('command')}`; commit `{commit(record)}`; CPU capability `{capability(record)}`."
    return "\n\n".join(["\n".join(lines) for lines in [[head], *parts]]) + "\n"


def draft_routes(sources: list[dict]) -> list[str]:
    """Draft data on the wire: each route's bytes per step and tokens/s, pass by pass (viasd/bench/routes.py)."""
    from viasd.bench.routes import MEASURED, ROUTES, summaries

    (res,) = sources
    passes = summaries(res)
    lines = _header(
        [
            "route",
            f"MB per step at {res['rows']} rows",
            "tokens/s, " + " / ".join(f"pass {i + 1}" for i in range(len(passes))),
            "/ through the engine",
        ],
        right=3,
    )
    for route in ROUTES:
        speeds = [p["routes"][route]["tokens_per_s"] for p in passes]
        gain = statistics.mean(s / p["routes"][ROUTES[0]]["tokens_per_s"] for s, p in zip(speeds, passes))
        lines.append(
            _row(
                [
                    route + (" (measured)" if route in MEASURED else " (estimated)"),
                    f"{statistics.mean(p['routes'][route]['mb_per_full_step'] for p in passes):.2f}",
                    " / ".join(f"{s:.2f}" for s in speeds),
                    f"{gain:.2f}x",
                ]
            )
        )
    spreads = {
        route: (max(v) - min(v)) / statistics.mean(v)
        for route in MEASURED
        if (v := [p["routes"][route]["tokens_per_s"] for p in passes])
    }
    rejected = [n for p in passes for route in MEASURED for n in p["routes"][route]["rejected_rows"]]
    params = res["params"]
    return lines + [
        "",
        f"{res['rows']} sampled `{params.get('mode', 'sd')}` streams at once (temperature "
        f"{params.get('temperature', 1.0):g}, gamma {params.get('gamma', 5)}, {params.get('max_tokens')} tokens each; "
        f"V = {res['vocab_size']:,}, p's rows in {res['value_bytes']}-byte values), each measured route "
        f"{len(passes)} times, alternately. MB per step: the bytes of a step's Propose, Verify and Correct calls "
        f"(requests and replies), the mean over the steps where every stream was verified, {min(rejected)} to "
        f"{max(rejected)} of whose rows had a rejection. The estimate takes one hop of p's rows off the first "
        "route's bytes and their transport, at "
        + " / ".join(f"{p['seconds_per_mb'] * 1e3:.2f}" for p in passes)
        + " ms per MB, off its wall time. A/A (a route's passes): "
        + ", ".join(f"{route} {spread:.1%}" for route, spread in spreads.items())
        + ".",
    ]


def routes_markdown(record: dict) -> str:
    """results.md of `viasd bench --suite routes`."""
    head = f"Command: `{record.get('command')}`; commit `{commit(record)}`; CPU capability `{capability(record)}`."
    return "\n".join([head, "", *draft_routes([record])]) + "\n"


QUANT = "docs/benchmarks/cpu/quant/"
QUANT_GGUF = tuple(
    f"{QUANT}gguf-check-{m}.json" for m in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
)

QUANT_QUALITY = (f"{QUANT}quality-none/results.json", f"{QUANT}quality-int4/results.json")

SPEED = "docs/benchmarks/cpu/gates-speed/results.json"

TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        Table("batch1", ("docs/benchmarks/cpu/main-greedy/results.json",), batch1),
        Table("drafting", ("docs/benchmarks/cpu/proposers-heldout/results.json",), drafting),
        Table("load", ("docs/benchmarks/cpu/load/results.json",), load),
        Table("served", ("docs/benchmarks/cpu/one-engine/beside-serving-avx512/results.json",), served),
        Table("quality", ("docs/benchmarks/quality/greedy/results.json", SPEED), quality),
        Table("quality-sampled", ("docs/benchmarks/quality/sampled/results.json",), quality_sampled),
        Table("host-work", ("docs/benchmarks/cpu/device-step/step-breakdown-avx512.json",), host_work),
        Table("dimr-heldout", ("viasd/masks/qwen2.5-coder-1.5b-instruct-r0.45.json",), dimr_heldout),
        Table(
            "dimr-ratios",
            ("docs/dimr-compare.json", "viasd/masks/qwen2.5-coder-1.5b-instruct-r0.25.json"),
            dimr_ratios,
        ),
        Table("blocks-capacity", ("docs/benchmarks/cpu/blocks/results.json",), blocks_capacity),
        Table("blocks-prefix", ("docs/benchmarks/cpu/blocks/results.json",), blocks_prefix),
        Table("blocks-throughput", ("docs/benchmarks/cpu/blocks-throughput/results.json",), blocks_throughput),
        Table("quant-gguf", QUANT_GGUF, quant_gguf),
        Table("quant-kernels", (f"{QUANT}kernels.json",), quant_kernels),
        Table("quant-e2e", (f"{QUANT}e2e.json",), quant_e2e),
        Table("quant-e2e-a8w8r", (f"{QUANT}e2e-a8w8r/results.json",), quant_e2e),
        Table("quant-llamacpp", (f"{QUANT}llamacpp/results.json",), quant_llamacpp),
        Table("quant-quality", QUANT_QUALITY, quant_quality),
        Table("draft-routes", ("docs/benchmarks/cpu/one-engine/draft-routes-avx512/results.json",), draft_routes),
    )
}


# ------------------------------------------------------------------ rendering and the documents


def render(name: str, root: Path | str = ".") -> str:
    """Table `name` as the lines between its markers: the source line, a blank line, the table."""
    table = TABLES[name]
    data = [json.loads((Path(root) / p).read_text()) for p in table.sources]
    return "\n".join([source_line(table.sources[0], data[0]), "", *table.render(data)]) + "\n"


def update(text: str, root: Path | str = ".") -> tuple[str, list[str]]:
    """`text` with every marked table regenerated, and the names of those that changed."""
    changed: list[str] = []

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise KeyError(f"unknown table {name!r} (known: {', '.join(TABLES)})")
        body = render(name, root)
        if body != m.group(2):
            changed.append(name)
        return f"<!-- table:{name} -->\n{body}<!-- /table:{name} -->"

    return _MARK.sub(sub, text), changed


def marked(text: str) -> list[str]:
    """The names of the tables a document marks."""
    return [m.group(1) for m in _MARK.finditer(text)]


def report(root: Path | str = ".", docs: bool = False, check: bool = False, out: Any = None) -> int:
    """`viasd bench report`: print every table, or rewrite (--docs) / check (--check) the documents."""
    import sys

    out = out or sys.stdout
    root = Path(root)
    if not docs and not check:
        for name in TABLES:
            print(f"<!-- table:{name} -->\n{render(name, root)}<!-- /table:{name} -->\n", file=out)
        return 0
    stale = []
    for doc in DOCS:
        path = root / doc
        text = path.read_text()
        new, changed = update(text, root)
        stale += [f"{doc}: {name}" for name in changed]
        if docs and new != text:
            path.write_text(new)
    if check and stale:
        print("tables that differ from their result files:\n  " + "\n  ".join(stale), file=out)
        print("run `viasd bench report --docs` to regenerate them", file=out)
        return 1
    for line in stale if docs else []:
        print(f"rewrote {line}", file=out)
    return 0
