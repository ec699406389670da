"""The figures in docs/ equal the committed raw files they cite, so that a drifted figure fails CI.

* docs/DIMR.md: the held-out table of the 0.45 mask against its artifact's `heldout` field; the
  ratio table against docs/dimr-compare.json (the 0.25 searched cell against the shipped 0.25
  artifact, which replaced the mask dimr-compare.json scored); the trials of every shipped mask.
* docs/BENCHMARKS.md: the ablation table (tok/s, vs ar, forwards, KV MiB) against
  docs/benchmarks/cpu/ablations/results.json; every `viasd bench` command that writes a results
  folder equals the command that folder's results.json records.
* docs/SERVING.md: the draft-probability dtype figures against docs/probs-dtype-cpu.json, which
  records the command, the commit and the machine; the served-load table and the
  draft-probabilities-on-the-wire table against docs/benchmarks/serve-throughput-cpu*.json and
  probs-travel-cpu.json (rendered by their scripts), with the commands they record; the lm-eval
  tables (generate-until and loglikelihood) against docs/lm_eval.json.
* docs/BENCHMARKS.md, "Three tiers without losing quality": the greedy and sampled quality
  tables against docs/benchmarks/quality/{greedy,sampled}/results.json.
* docs/BENCHMARKS.md, "On a real AVX2 CPU": the forwards per dtype and the quick start against
  docs/benchmarks/cpu/{dtypes/dtypes,quickstart/quickstart}-avx2.json.
* docs/SERVING.md, "One engine, served and in process": the served / in-process table and the
  draft-routes table against docs/benchmarks/cpu/one-engine/*.json (rendered by their scripts).
"""

from __future__ import annotations

import json
import re
import shlex
import statistics
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MASKS = ROOT / "viasd" / "masks"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def table(doc: str, header_start: str) -> list[list[str]]:
    """The body rows (cells stripped) of the markdown table whose header line starts so."""
    lines = (DOCS / doc).read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header_start)]
    assert len(starts) == 1, f"{doc}: {len(starts)} tables start with {header_start!r}"
    rows = []
    for line in lines[starts[0] + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    assert rows, f"{doc}: the table {header_start!r} is empty"
    return rows


def script_module(name: str):
    """scripts/<name>.py as a module (the scripts render the tables the docs show)."""
    import importlib
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def numbers(cell: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(r"-?\d[\d,]*\.?\d*", cell)]


def close(shown: float, exact: float, places: int) -> bool:
    """Whether `shown` is `exact` rounded to `places` decimals (half a unit of slack either way)."""
    return abs(shown - exact) <= 0.5 * 10**-places + 1e-12


def decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def check_cell(cell: str, exact: list[float], what: str) -> None:
    """Every number printed in `cell` equals the matching exact value at the printed precision."""
    shown = re.findall(r"-?\d[\d,]*\.?\d*", cell)
    assert len(shown) == len(exact), (what, cell, exact)
    for s, e in zip(shown, exact):
        assert close(float(s.replace(",", "")), e, decimals(s)), (what, cell, s, e)


# ------------------------------------------------------------------ DIMR


def test_dimr_heldout_table_equals_the_shipped_045_artifact():
    h = load(MASKS / "qwen2.5-coder-1.5b-instruct-r0.45.json")["heldout"]
    rows = {r[0]: r[1:] for r in table("DIMR.md", "| held-out, 512 tokens |")}
    for col, side in enumerate(("searched", "evenly_spaced")):
        s = h[side]
        check_cell(
            rows["paper's cost `C(z)` (sum) / per token"][col].replace("*", ""), [s["rkl_total"], s["rkl"]], side
        )
        check_cell(rows["KL(q ‖ q'_z) per token"][col].replace("*", ""), [s["kl"]], side)
        check_cell(rows["total variation per token"][col].replace("*", ""), [s["tv"]], side)
        check_cell(rows["top-1 agreement with q"][col].replace("*", "").rstrip("%"), [100 * s["top1"]], side)
        regions = rows["gate regions A / B / C (greedy drafter, alpha 0.5 / 0.3)"][col]
        check_cell(regions, s["e2e_detail"]["regions_abc"], side)
        check_cell(rows["modelled `e2e` (good tokens/s)"][col], [s["e2e"]], side)


def _compare_cell(m: dict) -> list[float]:
    return [100 * m["top1"], m["rkl"], m["escalation_rate"]]


def test_dimr_ratio_table_equals_dimr_compare_json_and_the_artifacts():
    compare = load(DOCS / "dimr-compare.json")
    by_artifact = {r["artifact"]: r for r in compare["ratios"]}
    rows = table("DIMR.md", "| ratio | searched | evenly spaced | best of 3 random |")
    assert [r[0] for r in rows] == ["0.25", "0.35", "0.45", "0.45, `e2e` objective", "0.55"]
    for label, searched, evenly, best_random in rows:
        ratio = label.split(",")[0]
        artifact = (
            f"viasd/masks/qwen2.5-coder-1.5b-instruct-r{ratio}.json"
            if "e2e" not in label
            else "docs/dimr-extra/qwen2.5-coder-1.5b-instruct-r0.45-e2e.json"
        )
        entry = by_artifact[artifact]
        masks = {m["name"]: m for m in entry["masks"]}
        shipped = load(ROOT / artifact)
        (found,) = [m for name, m in masks.items() if name.startswith("searched")]
        if found["skipped_layers"] == shipped["skipped_layers"]:
            exact = _compare_cell(found)
        else:  # dimr-compare.json scored an older mask: the doc cites the shipped artifact's own held-out figures
            assert ratio == "0.25", f"{artifact}: dimr-compare.json scored another mask than the shipped one"
            s = shipped["heldout"]["searched"]
            assert shipped["heldout"]["calibration"]["description"] == compare["heldout"]["description"]
            exact = [100 * s["top1"], s["rkl"], s["e2e_detail"]["escalation_rate"]]
        check_cell(searched.replace("*", "").replace("%", ""), exact, f"{label} searched")
        check_cell(evenly.replace("%", ""), _compare_cell(masks["evenly spaced"]), f"{label} evenly")
        randoms = [m for name, m in masks.items() if name.startswith("random")]
        if best_random == "—":
            assert "e2e" in label
        else:
            best = max(randoms, key=lambda m: (m["top1"], -m["rkl"]))  # ties on top-1: the lower cost
            check_cell(best_random.replace("%", ""), _compare_cell(best), f"{label} best random")


def test_dimr_doc_states_the_recorded_trials_of_every_shipped_mask():
    text = (DOCS / "DIMR.md").read_text()
    trials = {p.stem.rsplit("-r", 1)[1]: load(p)["trials"] for p in sorted(MASKS.glob("*-r*.json"))}
    assert trials == {"0.25": 60, "0.35": 20, "0.45": 80, "0.55": 20}
    stated = "60 (0.25), 20 (0.35), 80 (0.45, above), 20 (0.55)"
    assert stated in text
    for p in MASKS.glob("*-r*.json"):  # every artifact's recorded command is on the page
        assert _one_line(load(p)["command"]) in _commands(text), p.name


# ------------------------------------------------------------------ BENCHMARKS


def test_ablation_table_equals_its_results_json():
    s = load(DOCS / "benchmarks" / "cpu" / "ablations" / "results.json")["summary"]
    rows = table("BENCHMARKS.md", "| method | tok/s | vs ar [spread] | vs `sd` | mean accept len")
    ar, sd = s["ar"], s["sd"]
    for row in rows:
        m = re.match(r"`([^`]+)`", row[0]).group(1)
        r = s[m]
        check_cell(row[1], [r["tokens_per_second"]], f"{m} tok/s")
        check_cell(row[7], [r["forwards"]["drafter"], r["forwards"]["slim"], r["forwards"]["full"]], f"{m} forwards")
        kv = r["kv_bytes_max"]
        assert row[10] == ("-" if kv is None else f"{kv / 2**20:.1f}"), (m, row[10], kv)  # MiB
        ratio = r["tokens_per_second"] / ar["tokens_per_second"]
        assert abs(numbers(row[2])[0] - ratio) <= 0.011, (m, row[2], ratio)  # (paired per pass: within rounding)
        assert abs(numbers(row[3])[0] - r["tokens_per_second"] / sd["tokens_per_second"]) <= 0.011, (m, row[3])
    header = (DOCS / "BENCHMARKS.md").read_text()
    assert "| KV MiB |" in header and "| KV MB |" not in header


def _one_line(command: str) -> str:
    """A command with `flock ...` and `.venv/bin/` dropped, quotes resolved, spaces collapsed."""
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    if words[:2] == ["flock", "/tmp/viasd-heavy.lock"]:
        words = words[2:]
    words[0] = words[0].removeprefix(".venv/bin/")
    return " ".join(words)


def _commands(markdown: str) -> list[str]:
    """Every command line (continuations joined) inside ```bash blocks."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        joined = re.sub(r",\\\n", ",", block)  # a quoted list continued on the next line
        joined = re.sub(r"\\\n\s*", " ", joined)
        for line in joined.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(_one_line(line))
    return out


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in (DOCS / "benchmarks" / "cpu").glob("*/results.json")))
def test_benchmark_commands_are_the_recorded_ones(folder):
    recorded = _one_line(load(DOCS / "benchmarks" / "cpu" / folder / "results.json")["meta"]["command"])
    out = shlex.split(recorded)[shlex.split(recorded).index("--out") + 1]
    commands = _commands((DOCS / "BENCHMARKS.md").read_text())
    writing = [c for c in commands if c.startswith("viasd bench") and c.split(" --out ")[-1].split()[0] == out]
    assert writing, f"no command on BENCHMARKS.md writes {out} (recorded: {recorded})"
    assert all(c == recorded for c in writing), (recorded, writing)


def test_one_model_thread_table_equals_its_raw_files():
    """BENCHMARKS.md, "One model thread": each row is the summary of its dtype's raw file, which
    records the command (shown on the page), the commit and the machine."""
    rows = table("BENCHMARKS.md", "| dtype | one team: s / token |")
    page = (DOCS / "BENCHMARKS.md").read_text()
    assert [r[0] for r in rows] == ["`bfloat16`", "`float32`"]
    for row in rows:
        dtype = row[0].strip("`")
        raw = load(DOCS / "benchmarks" / "cpu" / "model-thread" / f"model-thread-{dtype}-native.json")
        one, two = raw["summary"]["one team"], raw["summary"]["two teams"]
        assert raw["dtype"] == dtype and raw["command"] in page
        assert raw["environment"]["git_commit"] and raw["environment"]["cpu_capability"]
        check_cell(row[1], [one["seconds_per_token_median"]], dtype)
        check_cell(row[2], [two["seconds_per_token_median"]], dtype)
        check_cell(row[3], [raw["summary"]["two_over_one_seconds"]], dtype)
        switches = [one["voluntary_switches_per_token_median"], two["voluntary_switches_per_token_median"]]
        check_cell(row[4], switches, dtype)


# ------------------------------------------------------------------ SERVING


def test_draft_probability_dtype_figures_equal_their_raw_file():
    raw = load(DOCS / "probs-dtype-cpu.json")
    env = raw["environment"]
    assert raw["command"].startswith("scripts/measure_probs_dtype.py") and env["git_commit"]
    assert env["cpu"] and env["cpu_capability"] and env["cpu_count"]
    text = " ".join((DOCS / "SERVING.md").read_text().split())
    m = re.search(
        r"total variation of ([\d.e-]+) on average \(median ([\d.e-]+), max ([\d.e-]+)\) per verified "
        r"position, against ([\d.e-]+) with float32",
        text,
    )
    assert m, "the dtype figures are not where the test expects them"
    for shown, exact in zip(
        m.groups(), (raw["bfloat16"]["mean"], raw["bfloat16"]["median"], raw["bfloat16"]["max"], raw["float32"]["max"])
    ):
        mantissa = shown.split("e")[0]
        assert abs(float(shown) - exact) <= 0.5 * 10 ** (-decimals(mantissa)) * 10 ** int(shown.split("e")[1]), (
            shown,
            exact,
        )
    assert f"{raw['positions']} positions" in text


def test_continuous_batching_table_equals_its_results_json():
    """BENCHMARKS.md, "Continuous batching": every cell (aggregate and decode-phase tok/s per method
    and concurrency, all arrivals) against docs/benchmarks/cpu/load/results.json."""
    summary = load(DOCS / "benchmarks" / "cpu" / "load" / "results.json")["summary"]
    row = {(r["method"], r["concurrency"]): r for r in summary if r["arrival"] == "all"}
    columns = ["ar", "sd", "via", "auto", "ar@batch1", "generate_batch", "roofline"]
    body = table("BENCHMARKS.md", "| C | `ar` | `sd` |")
    assert [int(r[0]) for r in body] == [1, 2, 4, 8, 16]
    for cells in body:
        c = int(cells[0])
        for method, cell in zip(columns, cells[1:]):
            r = row[(method, c)]
            exact = [r["aggregate_tokens_per_second"]]
            if "(" in cell:
                exact.append(r["decode_tokens_per_second"])
            check_cell(cell, exact, f"{method} at C={c}")


@pytest.mark.parametrize(
    "header, folder",
    [
        ("| dtype | C | `ar` |", "load-auto"),
        ("| dtype (rows x tokens) | C | `ar` |", "load-auto-grid"),
        ("| dtype (exploring) | C | `ar` |", "load-auto-explore"),
    ],
)
def test_auto_load_table_equals_its_results_json(header, folder):
    """BENCHMARKS.md, "Never slower": `auto` beside every fixed mode, aggregate tok/s per dtype and
    concurrency, and its ratios to the best fixed mode and to `ar`, against
    docs/benchmarks/cpu/<folder>/<dtype>/results.json (one interleaved run per dtype; load-auto
    with the 1-row cost curve, load-auto-grid with the rows x tokens grid)."""
    seen = set()
    for cells in table("BENCHMARKS.md", header):
        dtype, c = cells[0].strip("`"), int(cells[1])
        results = load(DOCS / "benchmarks" / "cpu" / folder / dtype / "results.json")
        assert results["meta"]["dtype"] == dtype and results["meta"]["cpu_capability"]
        tps = {
            (r["method"], r["concurrency"]): r["aggregate_tokens_per_second"]
            for r in results["summary"]
            if r["arrival"] == "all"
        }
        for method, cell in zip(("ar", "sd", "via", "auto"), cells[2:6]):
            check_cell(cell.replace("*", ""), [tps[(method, c)]], f"{dtype} {method} C={c}")
        best = max(tps[(m, c)] for m in ("ar", "sd", "via"))
        check_cell(cells[6].replace("*", ""), [tps[("auto", c)] / best], f"{dtype} auto / best C={c}")
        check_cell(cells[7].replace("*", ""), [tps[("auto", c)] / tps[("ar", c)]], f"{dtype} auto / ar C={c}")
        seen.add((dtype, c))
    assert seen == {(d, c) for d in ("bfloat16", "float32") for c in (1, 4, 8, 16)}


def test_auto_explore_load_bullets_equal_their_results_json():
    """BENCHMARKS.md, "After exploration and the services' timings": the per-pass figures the
    bullets quote (`auto` / `ar`, the share of `auto`'s steps on `ar`), from the runs."""
    per_pass = {}  # (dtype, C) -> [(auto / ar, share of steps `ar`) per pass]
    for dtype in ("bfloat16", "float32"):
        results = load(DOCS / "benchmarks" / "cpu" / "load-auto-explore" / dtype / "results.json")
        assert results["meta"]["environment"]["git_commit"].startswith("bbd6afd")
        assert not results["meta"]["environment"]["git_dirty"]
        by = {(r["method"], r["concurrency"], r["pass"]): r for r in results["runs"] if r["arrival"] == "all"}
        for c in (1, 4, 8, 16):
            for p in range(3):
                plans = Counter()
                for q in by["auto", c, p]["requests"]:
                    plans.update(q["stats"]["plans"])
                ratio = by["auto", c, p]["aggregate_tokens_per_second"] / by["ar", c, p]["aggregate_tokens_per_second"]
                per_pass.setdefault((dtype, c), []).append(
                    (round(ratio, 2), round(100 * plans["ar"] / sum(plans.values())))
                )
    assert [r for r, _ in per_pass["bfloat16", 1]] == [1.75, 1.69, 1.76] and [
        a for _, a in per_pass["bfloat16", 1]
    ] == [7, 11, 7]
    assert sorted(r for r, _ in per_pass["float32", 1]) == [1.29, 1.76, 1.90]
    assert per_pass["float32", 4] == [(0.81, 8), (0.89, 62), (0.95, 84)]
    loaded = [x for (d, c), xs in per_pass.items() if c > 1 and (d, c) != ("float32", 4) for x in xs]
    assert min(a for _, a in loaded) == 82
    all_ar = [r for r, a in loaded if a == 100]
    assert (min(all_ar), max(all_ar)) == (0.93, 1.08)
    assert [a for _, a in per_pass["bfloat16", 8]] == [96, 94, 87] and sorted(
        r for r, _ in per_pass["bfloat16", 8]
    ) == [0.83, 0.89, 0.93]


def test_calibrated_gates_table_equals_the_shipped_045_artifact():
    """BENCHMARKS.md, "Calibrated gates": every row against the artifact's `gates` entry."""
    g = load(MASKS / "qwen2.5-coder-1.5b-instruct-r0.45.json")["gates"]
    text = (DOCS / "BENCHMARKS.md").read_text()
    rows = {
        "paper": g["paper"],
        "calibrated": g["chosen"],
        "literal": next(x for x in g["grid"] if (x["alpha1"], x["region_b"]) == (0.7, "escalate")),
    }
    for name, r in rows.items():
        line = next(
            li
            for li in text.splitlines()
            if li.startswith(f"| {name}") and "| rewrite |" in li or li.startswith(f"| {name}") and "| escalate |" in li
        )
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[1]) == r["alpha1"] and float(cells[2]) == r["alpha2"] and cells[3] == r["region_b"], line
        for cell, key, spec in (
            (4, "agreement", ".3f"),
            (5, "tokens_per_cycle", ".2f"),
            (6, "escalation", ".2f"),
            (7, "tokens_per_second", ".1f"),
        ):
            assert cells[cell] == format(r[key], spec), (name, key, cells[cell])
    staged = next(li for li in text.splitlines() if li.startswith("| staged (lossless) | - |"))
    assert f"| {g['staged_tokens_per_cycle']:.2f} |" in staged and f"| {g['staged_tokens_per_second']:.1f} |" in staged
    assert f"ar {g['ar_tokens_per_second']:.1f} tok/s, sd {g['sd_tokens_per_second']:.1f} tok/s" in text


# ------------------------------------------------------------------ docs/SERVING.md: served batching


@pytest.mark.parametrize(
    "script, raw, kwargs",
    [
        ("serve_throughput", "serve-throughput-cpu-guidellm.json", {"in_process": False}),
        ("serve_throughput", "serve-throughput-cpu.json", {}),
        ("serve_throughput", "serve-throughput-cpu-threads.json", {}),
        ("serve_throughput", "serve-throughput-cpu-threads-via.json", {}),
        ("serve_throughput", "serve-throughput-cpu-auto.json", {}),
        ("serve_throughput", "serve-throughput-cpu-passes.json", {}),
        ("serve_throughput", "serve-throughput-cpu-auto-prior.json", {}),
        ("serve_throughput", "serve-throughput-cpu-model-thread.json", {}),
        ("serve_throughput", "serve-throughput-cpu-cores-lock.json", {}),
        ("serve_throughput", "serve-throughput-cpu-cores-busy.json", {}),
        ("serve_throughput", "serve-throughput-cpu-one-thread.json", {}),
        ("measure_probs_travel", "probs-travel-cpu.json", {}),
    ],
)
def test_serving_batching_tables_equal_their_raw_files(script, raw, kwargs):
    """The load table and the draft-probability table of docs/SERVING.md are the ones their
    scripts render from the committed raw files, which record command, commit and machine; the
    page shows the recorded command."""
    module = script_module(script)
    results = load(DOCS / "benchmarks" / raw)
    page = (DOCS / "SERVING.md").read_text()
    assert module.markdown_table(results, **kwargs) in page, f"regenerate the table from docs/benchmarks/{raw}"
    assert results["environment"]["git_commit"] and results["environment"]["cpu_capability"]
    if script == "serve_throughput" and "stream_token_ids" in results["runs"][0]:  # zero lost / wrong tokens
        streams = (
            sum(results["levels"]) * len(results["modes"]) * 2 * results.get("passes", 1)
        )  # (every pass of both systems)
        tokens = module.check_tokens(results["runs"], {})
        lossless = module.check_tokens([r for r in results["runs"] if r["mode"] != "via"], {})
        assert tokens["streams_checked"] == streams and lossless["streams_mismatched"] == 0
        if raw != "serve-throughput-cpu-threads.json":  # (its served `via` ran the paper's gates: SERVING.md)
            assert tokens["streams_mismatched"] == 0
    if "summary" in results:  # several passes: each figure is the median of its passes
        assert results["summary"] == module.summarize(results["runs"])
        assert results["ratios"] == module.ratios(results["summary"])
    args = shlex.split(results["command"])
    assert args[0] == f"scripts/{script}.py", args
    flat = commands_joined(page)
    assert " ".join(args[1:]) in flat, results["command"]


@pytest.mark.parametrize("raw", ["serve-throughput-cpu-cores-busy.json", "serve-throughput-cpu-one-thread.json"])
def test_served_cores_busy_table_equals_its_raw_file(raw):
    """SERVING.md, "One forward per node at a time" and "Model actors at normal priority": where
    the cores went, per kind of process, is the table serve_throughput renders from the committed
    run's `cores_busy`."""
    serve_throughput = script_module("serve_throughput")
    results = load(DOCS / "benchmarks" / raw)
    assert serve_throughput.cores_table(results) in (DOCS / "SERVING.md").read_text()
    served = [r["cores_busy"] for r in results["runs"] if r["system"] == "served"]
    assert served and all(b["verifier"] > 0.5 for b in served)  # (the classes found the actors)


def commands_joined(page: str) -> str:
    """The page on one line, with its commands' continuation lines joined (commands found as typed)."""
    return " ".join(page.replace("\\\n", " ").split())


def assert_one_of_the_runs_shown(serve_throughput, flat: str, results: dict) -> None:
    """A run of an A/B: made by the command the page shows with `--out <run>.json`, on a recorded
    commit and CPU, every stream its prompt's greedy output."""
    args = shlex.split(results["command"])
    assert args[-2] == "--out" and " ".join(args[1:-2]) + " --out <run>.json" in flat, results["command"]
    assert results["environment"]["git_commit"] and results["environment"]["cpu_capability"]
    assert serve_throughput.check_tokens(results["runs"], {})["streams_mismatched"] == 0


def test_model_actor_niceness_table_equals_its_raw_files():
    """SERVING.md, "Model actors at normal priority": the A/B table is the one serve_throughput
    renders from the six committed runs, each made by the command the page shows (its own
    --out), and the runs that recorded niceness ran their model actors as labelled."""
    serve_throughput = script_module("serve_throughput")
    folder = DOCS / "benchmarks" / "serve-niceness"
    runs = {v: [load(folder / f"{v}-{i}.json") for i in range(3)] for v in ("base", "nice0")}
    page = (DOCS / "SERVING.md").read_text()
    table = serve_throughput.variants_table({"Ray's default (15)": runs["base"], "model actors at 0": runs["nice0"]})
    assert table in page
    flat = commands_joined(page)
    for variant, niceness in (("base", 15), ("nice0", 0)):
        for results in runs[variant]:
            assert_one_of_the_runs_shown(serve_throughput, flat, results)
            for r in results["runs"]:
                if r["system"] == "served" and "niceness" in r:
                    assert r["niceness"]["verifier"] == r["niceness"]["drafter"] == [niceness]
                    assert r["niceness"]["replica"] == [15]
    assert sum("niceness" in r for v in runs.values() for f in v for r in f["runs"]) >= 8  # (4 recorded runs)


def test_quiet_control_plane_tables_equal_their_raw_files():
    """SERVING.md, "A quieter control plane": the A/B table and the idle table are the ones
    serve_throughput renders from the six committed runs, each made by the command the page shows,
    and each run's control plane ran as labelled (Ray's defaults set in its environment, or none
    set: `ray.control_plane_env` applies)."""
    serve_throughput = script_module("serve_throughput")
    folder = DOCS / "benchmarks" / "serve-quiet"
    runs = {v: [load(folder / f"{v}-{i}.json") for i in range(3)] for v in ("defaults", "quiet")}
    variants = {"Ray's defaults": runs["defaults"], "quiet (the default now)": runs["quiet"]}
    page = (DOCS / "SERVING.md").read_text()
    assert serve_throughput.variants_table(variants) in page
    assert serve_throughput.idle_table(variants) in page
    flat = commands_joined(page)
    for variant, interval in (("defaults", "0.1"), ("quiet", None)):
        for results in runs[variant]:
            assert_one_of_the_runs_shown(serve_throughput, flat, results)
            assert results["ray_env"].get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S") == interval
            assert [i["seconds"] for i in results["idle"]] == [30.0]


def test_native_bf16_serving_tables_equal_their_raw_files():
    """SERVING.md, "On a CPU with native bf16": both tables are the ones serve_throughput renders
    from the committed runs; float32 every stream exact; bf16 the same command without --dtype,
    its only differing streams one prompt's at eight streams, full length (a batched-rounding tie)."""
    serve_throughput = script_module("serve_throughput")
    folder = DOCS / "benchmarks" / "serve-native"
    f32, bf16 = load(folder / "float32.json"), load(folder / "auto.json")
    page = (DOCS / "SERVING.md").read_text()
    assert serve_throughput.markdown_table(f32) in page and serve_throughput.markdown_table(bf16) in page
    assert_one_of_the_runs_shown(serve_throughput, commands_joined(page), f32)
    assert_the_bf16_twin(serve_throughput, bf16, f32, mismatched=7)
    assert {r["concurrency"] for r in bf16["runs"] if r["mismatched_streams"]} == {8}


def assert_the_bf16_twin(serve_throughput, bf16: dict, f32: dict, mismatched: int) -> None:
    """A run of the float32 run's command without `--dtype float32` (`dtype: auto`: bf16 on a CPU
    with native bf16): every stream full length, `mismatched` of them another output of their
    prompt than its first (batched-rounding ties)."""
    assert shlex.split(bf16["command"])[:-2] == [
        a for a in shlex.split(f32["command"])[:-2] if a not in ("--dtype", "float32")
    ]
    assert bf16["pipeline"]["runtime"]["dtype"] == "bfloat16" and bf16["environment"]["cpu_capability"] == "AVX512"
    assert serve_throughput.check_tokens(bf16["runs"], {})["streams_mismatched"] == mismatched
    assert all(len(ids) == f32["runs"][0]["max_tokens"] for r in bf16["runs"] for _, ids in r["stream_token_ids"])


def test_every_mode_one_to_sixteen_streams_equals_its_raw_file():
    """SERVING.md, "Every mode, one to sixteen streams": the table is the one serve_throughput renders from the
    committed run, made by the command the page shows; served `sd` at eight streams ran ten
    steps of all eight rows in both passes."""
    serve_throughput = script_module("serve_throughput")
    raw = load(DOCS / "benchmarks" / "serve-native" / "matrix-float32.json")
    page = (DOCS / "SERVING.md").read_text()
    assert serve_throughput.markdown_table(raw) in page
    assert_one_of_the_runs_shown(serve_throughput, commands_joined(page), raw)
    assert serve_throughput.check_tokens(raw["runs"], {})["streams_checked"] == 464
    sd8 = [r for r in raw["runs"] if r["system"] == "served" and r["mode"] == "sd" and r["concurrency"] == 8]
    assert [r["coordinator"]["steps"] for r in sd8] == [10, 10]
    bf16 = load(DOCS / "benchmarks" / "serve-native" / "matrix-auto.json")  # the same without --dtype
    assert serve_throughput.markdown_table(bf16) in page
    assert_the_bf16_twin(serve_throughput, bf16, raw, mismatched=36)


def test_auto_forecasts_table_equals_its_raw_file():
    """SERVING.md, "What `auto` expected of its steps": both tables are the ones serve_throughput
    renders from the committed run, made on a clean tree by the command the page shows; every
    token of every `auto` level came from a step the planner forecast, and the ranges the page
    states are the run's."""
    serve_throughput = script_module("serve_throughput")
    raw = load(DOCS / "benchmarks" / "serve-forecast" / "auto-float32.json")
    page = (DOCS / "SERVING.md").read_text()
    assert serve_throughput.forecasts_table(raw) in page and serve_throughput.markdown_table(raw) in page
    assert_one_of_the_runs_shown(serve_throughput, commands_joined(page), raw)
    assert not raw["environment"]["git_dirty"] and f"commit `{raw['environment']['git_commit'][:7]}`" in page
    assert serve_throughput.check_tokens(raw["runs"], {})["streams_checked"] == 52
    ratio = {"served": {}, "in_process": {}}  # (kind of step, ratio) -> every run's value
    for r in raw["runs"]:
        assert sum(f["tokens"] for f in r["forecasts"].values()) == 32 * r["concurrency"]
        for kind, f in r["forecasts"].items():
            for q in ("measured_over_predicted", "committed_over_expected"):
                if kind == "ar" or q == "measured_over_predicted" or f["steps"] > 1:
                    ratio[r["system"]].setdefault((kind, q), []).append(f[q])
    outlier = ratio["served"][("speculating", "measured_over_predicted")]
    assert sorted(outlier)[-1] > 2 and (min(outlier), sorted(outlier)[-2]) == pytest.approx((0.94, 1.12), abs=0.005)
    stated = {
        ("in_process", "speculating", "measured_over_predicted"): (0.95, 1.08),
        ("served", "ar", "measured_over_predicted"): (0.96, 1.04),
        ("in_process", "ar", "measured_over_predicted"): (0.95, 1.12),
        ("served", "speculating", "committed_over_expected"): (0.98, 1.13),
        ("in_process", "speculating", "committed_over_expected"): (0.87, 1.14),
    }
    for (system, kind, q), (low, high) in stated.items():
        values = ratio[system][(kind, q)]
        assert (min(values), max(values)) == pytest.approx((low, high), abs=0.006), (system, kind, q)


def test_steptimes_table_equals_its_raw_files():
    """SERVING.md, "What the services measured": every row of the A/B table against the four
    committed runs (each made by the command the page shows, the old variant's files dirty, the
    new ones' clean), and the ranges and token counts the page states."""
    folder = DOCS / "benchmarks" / "serve-steptimes"
    page = (DOCS / "SERVING.md").read_text()
    flat = commands_joined(page)
    rows = iter(table("SERVING.md", "| served cost model learns from |"))
    ratios, priced, mismatched = {"old": [], "new": []}, {"old": [], "new": []}, 0
    for variant in ("old", "new"):
        for i in (0, 1):
            raw = load(folder / f"{variant}-{i}.json")
            args = shlex.split(raw["command"])
            assert " ".join(args[1:-2]) + " --out <run>.json" in flat and args[-1].endswith(f"{variant}-{i}.json")
            env = raw["environment"]
            assert env["git_commit"].startswith("a741060") and env["git_dirty"] == (variant == "old")
            assert env["cpu_capability"] and raw["in_process"]["runtime"]["dtype"] == "bfloat16"
            mismatched += raw["tokens"]["streams_mismatched"]
            by = {(r["system"], r["concurrency"]): r for r in raw["runs"]}
            for c in (1, 4, 8):
                row, a, s = next(rows), by[("in_process", c)], by[("served", c)]
                assert row[0] == (
                    "the services' own timings" if variant == "new" else "a call's seconds split by predicted share"
                )
                assert (row[1], row[2]) == (str(i), str(c))
                ratio = s["aggregate_tokens_per_s"] / a["aggregate_tokens_per_s"]
                check_cell(row[3], [a["aggregate_tokens_per_s"]], "in-process")
                check_cell(row[4], [s["aggregate_tokens_per_s"]], "served")
                check_cell(row[5], [ratio], "ratio")
                spec, ar = s["forecasts"].get("speculating", {}), s["forecasts"].get("ar", {})
                assert row[6] == f"{int(spec.get('steps', 0))} / {int(ar.get('steps', 0))}"
                check_cell(row[7], [spec["measured_over_predicted"]], "priced")
                ratios[variant].append(round(ratio, 2))
                priced[variant].append(spec["measured_over_predicted"])
    assert next(rows, None) is None
    assert (min(ratios["old"]), max(ratios["old"])) == (0.68, 1.43) and (min(ratios["new"]), max(ratios["new"])) == (
        0.77,
        1.19,
    )
    assert (min(priced["new"]), max(priced["new"])) == pytest.approx((0.94, 1.10), abs=0.005)
    assert (min(priced["old"]), max(priced["old"])) == pytest.approx((0.97, 1.17), abs=0.005)
    assert mismatched == 7 and "7 of the 104 streams" in page
    share_ar = {}  # (variant, run, system, streams) -> share of the cycles planned `ar`
    for variant in ("old", "new"):
        for i in (0, 1):
            for r in load(folder / f"{variant}-{i}.json")["runs"]:
                share_ar[variant, i, r["system"], r["concurrency"]] = r["plans"].get("ar", 0) / sum(r["plans"].values())
    loaded = sorted(v for (_, _, system, c), v in share_ar.items() if system == "in_process" and c > 1)
    assert loaded[0] < 0.05 and min(loaded[1:]) >= 0.925  # "93-100% ... in seven of the eight levels"
    assert sum(v < 0.5 for (_, _, system, c), v in share_ar.items() if system == "served" and c == 8) == 3
    assert sum(v > 0.7 for (_, _, system, c), v in share_ar.items() if system == "in_process" and c == 1) == 3


def test_explore_table_equals_its_raw_files():
    """SERVING.md, "Exploring speculation": each row against its committed run (in-process `auto`
    at one stream), the runs with exploration on a clean tree, those without it dirty."""
    folder = DOCS / "benchmarks" / "serve-explore"
    rows = iter(table("SERVING.md", "| in-process `auto`, one stream |"))
    for variant, label in (("before", "without exploration"), ("after", "with exploration")):
        for i in (0, 1):
            raw = load(folder / f"{variant}-{i}.json")
            env = raw["environment"]
            assert env["git_commit"].startswith("4f2fc1b") and env["git_dirty"] == (variant == "before")
            assert env["cpu_capability"] and raw["command"].endswith(f"--out /tmp/exp/explore-{variant}-{i}.json")
            run = next(r for r in raw["runs"] if r["system"] == "in_process" and r["concurrency"] == 1)
            row = next(rows)
            assert row[:2] == [label, str(i)]
            check_cell(row[2], [run["aggregate_tokens_per_s"]], f"{variant}-{i}")
            assert row[3] == f"{run['plans'].get('ar', 0)} of {sum(run['plans'].values())}"
    assert next(rows, None) is None


def test_explore_fence_table_equals_its_raw_files():
    """SERVING.md, "Exploring near the fence": every cell (tokens/s, cycles `ar`, explorations,
    position 0's estimate at the start) against its committed run, and the bullets' counts."""
    folder = DOCS / "benchmarks" / "serve-explore-fence"
    runs = {v: load(folder / f"{v}.json") for v in ("old-0", "old-1", "new-0", "new-1")}
    for v, raw in runs.items():
        env = raw["environment"]
        assert env["git_commit"].startswith("a1974bd") and env["git_dirty"] == v.startswith("old")
        assert env["cpu_capability"] and raw["command"].endswith(
            f"--max-tokens 64 --modes auto --in-process --out /tmp/exp/explore2-{v}.json"
        )
    rows = iter(table("SERVING.md", "| system | streams | without exploring near the fence, run 0 |"))
    ratios, explored = [], []
    for system in ("in_process", "served"):
        for c in (1, 4, 8):
            row = next(rows)
            assert row[:2] == [system.replace("_", "-"), str(c)]
            level = {
                v: next(r for r in raw["runs"] if (r["system"], r["concurrency"]) == (system, c))
                for v, raw in runs.items()
            }
            for cell, r in zip(row[2:], level.values()):
                tps, ar, explorations, start = cell.split(", ")
                check_cell(tps, [r["aggregate_tokens_per_s"]], f"{system} {c}")
                assert (
                    ar == f"{r['plans'].get('ar', 0)} of {sum(r['plans'].values())}"
                    and int(explorations) == r["explorations"]
                )
                check_cell(start, [r["acceptance_at_start"][0]], f"{system} {c} start")
            ratios += [
                level[f"new-{i}"]["aggregate_tokens_per_s"] / level[f"old-{i}"]["aggregate_tokens_per_s"]
                for i in (0, 1)
            ]
            explored += [(v, system, c) for v, r in level.items() if r["explorations"]]
    assert next(rows, None) is None
    assert (round(min(ratios), 2), round(max(ratios), 2)) == (0.81, 1.27)
    assert sorted(explored) == [("new-0", "served", 1), ("new-1", "in_process", 4), ("new-1", "served", 1)]
    mismatched = sum(raw["tokens"]["streams_mismatched"] for raw in runs.values())
    assert mismatched == 21 and sum(raw["tokens"]["streams_checked"] for raw in runs.values()) == 104


def test_verify_service_table_equals_its_raw_files():
    """SERVING.md's verify service without Ray, alone and beside a busy neighbour, per OpenMP
    wait policy, against the two committed runs (each made by the command the page shows)."""
    folder = DOCS / "benchmarks" / "cpu" / "verify-service"
    runs = [
        (load(folder / "verify-service-bfloat16-native.json"), "spinning (default)", None),
        (load(folder / "verify-service-bfloat16-omp-passive-native.json"), "`OMP_WAIT_POLICY=PASSIVE`", "PASSIVE"),
    ]
    rows = iter(table("SERVING.md", "| verify service (bf16, no Ray) |"))
    for raw, policy, recorded in runs:
        assert raw["command"] == "scripts/measure_verify_service.py --steps 12"
        assert raw.get("omp_wait_policy") == recorded  # (the first run predates the field)
        assert raw["runtime"]["dtype"] == "bfloat16" and raw["environment"]["cpu_capability"]
        for result in raw["results"]:
            for condition in ("alone", "neighbour"):
                row, f = next(rows), result[condition]
                assert (row[0] == "alone") == (condition == "alone") and row[1] == policy
                assert int(row[2]) == result["rows"] and f["steps"] == 12
                for cell, key in zip(row[3:], ("verify_s", "forward_s", "service_s")):
                    check_cell(cell, [f[key] * 1e3], f"{policy} {result['rows']} {condition} {key}")
    assert next(rows, None) is None


def test_serving_lm_eval_table_equals_its_raw_file():
    """docs/SERVING.md's lm-eval table against docs/lm_eval.json (command, commit, machine recorded)."""
    raw = load(DOCS / "lm_eval.json")
    assert raw["command"] and raw["commit"] and raw["machine"]["cpu_capability"] and raw["served_equals_in_process"]
    rows = table("SERVING.md", "| lm-eval client |")
    assert [r[0].strip("`") for r in rows] == list(raw["served"])
    for row in rows:
        client = row[0].strip("`")
        check_cell(row[1], [raw["served"][client]["exact_match"]], f"{client} served")
        check_cell(row[2], [raw["in_process"][client]["exact_match"]], f"{client} in-process")


def test_serving_lm_eval_loglikelihood_table_equals_its_raw_file():
    ll = load(DOCS / "lm_eval.json")["loglikelihood"]
    (row,) = table("SERVING.md", "| loglikelihood task |")
    assert row[0].strip("`").split("`")[0] == ll["task"]["name"]
    check_cell(row[1], [ll["served"]["acc"]], "served acc")
    check_cell(row[2], [ll["in_process"]["acc"]], "in-process acc")
    pairs = sum(len(c) for c in ll["served"]["loglikelihoods"])
    check_cell(row[3], [ll["max_abs_difference"], pairs], "difference")


# ------------------------------------------------------------------ BENCHMARKS.md: quality (issue 20)


def _quality_spec(cell: str) -> str:
    return cell.strip("`")


def check_unsigned(cell: str, exact: list[float], what) -> None:
    """`check_cell` for cells with intervals written lo-hi (no number in them is negative)."""
    shown = re.findall(r"\d[\d,]*(?:\.\d+)?", cell)
    assert len(shown) == len(exact), (what, cell, exact)
    for x, e in zip(shown, exact):
        assert close(float(x.replace(",", "")), e, decimals(x)), (what, cell, x, e)


def test_quality_tables_equal_their_raw_files():
    """Every pass@1 [Wilson interval] and agreement cell against the evaluation's results.json."""
    greedy = load(DOCS / "benchmarks" / "quality" / "greedy" / "results.json")["summary"]
    sampled = load(DOCS / "benchmarks" / "quality" / "sampled" / "results.json")["summary"]
    speed = load(DOCS / "benchmarks" / "cpu" / "gates-speed" / "results.json")["summary"]
    rows = table("BENCHMARKS.md", "| setting | spec | HumanEval pass@1")
    assert len(rows) == 6
    for row in rows:
        v = speed[_quality_spec(row[1])]
        check_unsigned(row[5], [v["tokens_per_second"], v["speedup_vs_ar"]["median"]], row[1])
        s = greedy.get(_quality_spec(row[1])) or sampled[_quality_spec(row[1])]  # (the calibrated one: either run)
        p = s["humaneval"]["pass_at_1"]
        assert p["n_prompts"] == 40, row[1]  # the header's n
        check_unsigned(row[2], [p["pass_at_1"], *p["wilson95"]], row[1])
        for cell, corpus in ((row[3], "humaneval"), (row[4], "stdlib")):
            a = s.get(corpus, {}).get("agreement_with_ar")
            if a is None:
                assert cell == "-", (row[1], corpus, cell)
            else:
                check_unsigned(cell, [a["prefix_share"], a["identical"]], (row[1], corpus))
    for row in table("BENCHMARKS.md", "| setting | HumanEval pass@1 [95% Wilson] (n=80) |"):
        p = sampled[row[0].split("`")[1]]["humaneval"]["pass_at_1"]
        assert p["n_samples"] == 80, row[0]
        check_unsigned(row[1], [p["pass_at_1"], *p["wilson95"]], row[0])


# ------------------------------------------------------------------ a real AVX2 CPU


def test_avx2_dtype_table_equals_its_raw_file():
    """docs/BENCHMARKS.md's one-row / block forwards per dtype on the AVX2 CPU against
    docs/benchmarks/cpu/dtypes/dtypes-avx2.json (command, commit and machine recorded)."""
    raw = load(DOCS / "benchmarks" / "cpu" / "dtypes" / "dtypes-avx2.json")
    assert raw["environment"]["cpu_capability"] == "AVX2" and raw["environment"]["git_commit"]
    assert raw["command"].startswith("scripts/measure_dtypes.py")
    rows = table("BENCHMARKS.md", "| model (AVX2) | dtype |")
    assert [(r[0].strip("`"), r[1].strip("`")) for r in rows] == [(f["model"], f["dtype"]) for f in raw["forwards"]]
    for row, f in zip(rows, raw["forwards"]):
        check_cell(row[2], [f["linears_swapped"]], "packed")
        for cell, t in zip(row[3:], ("1", "2", "6")):
            check_cell(cell, [f["seconds"][t] * 1e3], f"{f['model']} {f['dtype']} {t}")


@pytest.mark.parametrize(
    ("label", "machine", "capability", "auto"),
    [
        ("avx2-emulated", "AVX2, emulated", "AVX2", {"1": "bfloat16", "8": "float32"}),
        ("native", "AVX-512 BF16", "AVX512", {"1": "bfloat16", "8": "bfloat16"}),
    ],
)
def test_dtype_at_the_batch_capacity_forwards_equal_their_raw_files(label, machine, capability, auto):
    """docs/BENCHMARKS.md's forwards at one and eight requests a step per dtype, and what `auto`
    chose at each, against their raw files."""
    raw = load(DOCS / "benchmarks" / "cpu" / "dtypes" / f"dtypes-{label}.json")
    assert raw["environment"]["cpu_capability"] == capability and raw["environment"]["git_commit"]
    assert raw["command"] == "scripts/measure_dtypes.py --rows 1,8"
    assert {r: a["dtype"] for r, a in raw["auto"].items()} == auto
    rows = table("BENCHMARKS.md", f"| model ({machine}) |")
    assert [(r[0].strip("`"), r[1].strip("`"), int(r[2])) for r in rows] == [
        (f["model"], f["dtype"], f.get("rows", 1)) for f in raw["forwards"]
    ]
    for row, f in zip(rows, raw["forwards"]):
        t = f["seconds"]
        check_cell(row[3], [t["1"] * 1e3], "1 token")
        check_cell(row[4], [t["6"] * 1e3], "6 tokens")
        check_cell(row[5], [t["1"] * 1e3 / f.get("rows", 1)], "a token")


def test_dtype_at_the_batch_capacity_load_table_equals_its_raw_files():
    """docs/BENCHMARKS.md's load suite per requested dtype on the emulated AVX2 CPU."""
    rows = table("BENCHMARKS.md", "| load (AVX2, emulated) |")
    shown = []
    for requested in ("auto", "bfloat16"):
        res = load(DOCS / "benchmarks" / "cpu" / "dtype-rows" / requested / "results.json")
        runtime = res["meta"]["runtime"]
        assert runtime["dtype_requested"] == requested and runtime["dtype_rows"] == 8
        assert runtime["cpu_capability"] == "AVX2" and f"--dtype {requested}" in res["meta"]["command"]
        for srow in sorted(res["summary"], key=lambda x: (x["method"], x["concurrency"])):
            shown.append((requested, runtime["dtype"], srow))
    assert len(rows) == len(shown)
    for row, (requested, dtype, srow) in zip(rows, shown):
        assert (row[0], row[1], row[2], int(row[3])) == (
            f"`--dtype {requested}`",
            f"`{dtype}`",
            f"`{srow['method']}`",
            srow["concurrency"],
        )
        check_cell(row[4], [srow["aggregate_tokens_per_second"]], "agg")
        check_cell(row[5], [srow["decode_tokens_per_second"]], "decode")
        check_cell(row[6], [srow["ttft_p50"]], "ttft")
        check_cell(row[7], [srow["itl_p50"] * 1e3], "itl")


@pytest.mark.parametrize(
    ("machine", "label", "capability"),
    [
        ("AVX2", "avx2", "AVX2"),
        ("AVX2, at `e244efd`", "avx2-e244efd", "AVX2"),
        ("AVX2, mixed kernels", "mixed-avx2", "AVX2"),
        ("AVX2, after the margin", "margin-avx2", "AVX2"),
        ("AVX-512, no bf16, probes in sequence", "avx512-no-bf16-first", "AVX512"),
        ("AVX-512, no bf16", "avx512-no-bf16", "AVX512"),
    ],
)
def test_quick_start_tables_equal_their_raw_files(machine, label, capability):
    """The quick start on a CPU without native bf16, per configuration: each pass, the median
    tokens/s and the ratio to `before` in the same run, against
    docs/benchmarks/cpu/quickstart/quickstart-<label>.json."""
    raw = load(DOCS / "benchmarks" / "cpu" / "quickstart" / f"quickstart-{label}.json")
    assert raw["environment"]["cpu_capability"] == capability and raw["environment"]["git_commit"]
    assert not {"avx512_bf16", "amx_bf16"} & set(raw["environment"]["cpu_flags"])
    assert raw["command"].startswith("python scripts/measure_quickstart.py")
    median = raw["median_tokens_per_second"]
    rows = table("BENCHMARKS.md", f"| quick start ({machine}) | dtype |")
    assert [r[0].strip("`") for r in rows] == list(median)
    for row, name in zip(rows, median):
        runs = [r for r in raw["runs"] if r["config"] == name]
        assert row[1].replace("`", "").split(" / ") == list(dict.fromkeys(r["runtime"]["dtype"] for r in runs)), name
        check_cell(row[2], [r["tokens_per_second"] for r in runs], name)
        check_cell(row[3], [median[name]], name)
        check_cell(row[4], [median[name] / median["before"]], name)


def test_mixed_kernel_tables_equal_their_raw_file():
    """BENCHMARKS.md, "Mixed kernels": the probe's milliseconds per rows and kernel, and each
    model's forwards per dtype and kernels, against docs/benchmarks/cpu/dtypes/dtypes-mixed-avx2.json
    (scripts/measure_dtypes.py, a clean tree)."""
    raw = load(DOCS / "benchmarks" / "cpu" / "dtypes" / "dtypes-mixed-avx2.json")
    env = raw["environment"]
    assert env["cpu_capability"] == "AVX2" and env["git_commit"].startswith("c9b425d") and not env["git_dirty"]
    assert "--plain-bf16 --prompt 118" in raw["command"]
    assert {r["reason"] for r in raw["auto"].values()} == {"no-native-bf16-mixed"}
    probe = raw["mixed_probe_seconds"]
    rows = table("BENCHMARKS.md", "| `[M, 1536] x [1536, 8960]` (AVX2) |")
    assert len(rows) == 2
    for cells, kind in zip(rows, ("bf16", "mixed")):
        for cell, m in zip(cells[1:], (1, 2, 3, 4, 6, 8), strict=True):
            check_cell(cell, [probe[f"{kind}@{m}"] * 1e3], f"{kind}@{m}")
    forwards = {(f["model"], f["variant"], f.get("rows", 1)): f for f in raw["forwards"]}
    variants = {"`bfloat16`, plain": "bfloat16-plain", "`float32`, packed": "float32", "`bfloat16`, mixed": "bfloat16"}
    rows = table("BENCHMARKS.md", "| model (AVX2, mixed) |")
    assert len(rows) == 6
    for cells in rows:
        model, variant = cells[0].strip("`"), variants[cells[1]]
        one, eight = forwards[model, variant, 1]["seconds"], forwards[model, variant, 8]["seconds"]
        for cell, s in zip(cells[2:], (one["1"], one["2"], one["6"], one["118"], eight["1"], eight["6"]), strict=True):
            check_cell(cell, [s * 1e3], f"{model} {variant}")
        method = forwards[model, variant, 1]["linear_method"]
        assert method == {"bfloat16-plain": "plain", "float32": "mkldnn_packed", "bfloat16": "mixed"}[variant]


def _one_request_runs(header: str, runs: tuple[tuple[str, str], ...]) -> dict[str, dict]:
    """The one-request table under `header` against docs/benchmarks/cpu/load-c1-avx2/<run> for
    each (run, commit): mixed bf16 on AVX2, a clean tree at that commit, one row per method and
    run (tokens/s, decode tokens/s, TTFT p50, tokens/s per pass). Returns the raw files by run."""
    rows, shown, raws = table("BENCHMARKS.md", header), [], {}
    for run, commit in runs:
        raw = raws[run] = load(DOCS / "benchmarks" / "cpu" / "load-c1-avx2" / run / "results.json")
        meta = raw["meta"]
        assert meta["cpu_capability"] == "AVX2" and meta["runtime"]["dtype_reason"] == "no-native-bf16-mixed"
        assert meta["environment"]["git_commit"].startswith(commit) and not meta["environment"]["git_dirty"]
        for s in raw["summary"]:
            per_pass = [r["aggregate_tokens_per_second"] for r in raw["runs"] if r["method"] == s["method"]]
            shown.append((run, s, per_pass))
    assert len(rows) == len(shown)
    for cells, (run, s, per_pass) in zip(rows, shown):
        assert cells[:2] == [f"`{run}`", f"`{s['method']}`"]
        check_cell(cells[2], [s["aggregate_tokens_per_second"]], "tok/s")
        check_cell(cells[3], [s["decode_tokens_per_second"]], "decode")
        check_cell(cells[4], [s["ttft_p50"]], "ttft")
        check_cell(cells[5], per_pass, "per pass")
    return raws


def _block_of_five(rates: list[float]) -> float:
    """E[tokens] of a k = 5 cycle at per-position acceptance `rates`: 1 + sum_i prod_{j<=i} a_j, to 2 places."""
    total, reach = 1.0, 1.0
    for a in rates[:5]:
        reach *= a
        total += reach
    return round(total, 2)


def test_one_request_mixed_kernels_table_equals_its_results_json():
    """BENCHMARKS.md, "Mixed kernels": one request per method and run, against
    docs/benchmarks/cpu/load-c1-avx2/{mixed,mixed-order,mixed-planner}; the third run's planner
    record as the text gives it (no exploration, no probe, the acceptance it planned with)."""
    runs = (("mixed", "c9b425d"), ("mixed-order", "c9b425d"), ("mixed-planner", "711c6ba"))
    raw = _one_request_runs("| one request (AVX2, mixed kernels), run |", runs)["mixed-planner"]
    planner = [r for r in raw["runs"] if r["method"] == "auto"]
    assert len(planner) == 3 and all(r["planner"]["explorations"] == r["planner"]["probes"] == 0 for r in planner)
    assert [round(a, 2) for a in planner[0]["planner"]["acceptance"]["model"][:5]] == [0.78, 0.99, 0.86, 0.78, 0.99]
    assert [_block_of_five(r["planner"]["acceptance"]["model"]) for r in planner] == [4.25, 4.26, 4.26]
    prices = {
        (t, x["rows"], x["tokens"]): x["seconds"] for t, xs in planner[0]["planner"]["prices"].items() for x in xs
    }
    shown = [prices[k] for k in (("drafter", 1, 2), ("drafter", 1, 1), ("full", 1, 4), ("full", 1, 8), ("full", 1, 1))]
    assert [round(x, 3) for x in shown] == [0.114, 0.083, 0.366, 0.464, 0.222]  # the first pass's, as the text
    sd = next(r for r in raw["runs"] if r["method"] == "sd" and r["pass"] == 0)["requests"][0]["stats"]
    assert round((sd["seconds"]["drafter"] + sd["seconds"]["full"]) / sd["num_drafts"], 3) == 0.815


def test_one_request_after_the_margin_table_equals_its_results_json():
    """BENCHMARKS.md, "After the measured margin and the engine-wide memory": one request per
    method and run, against docs/benchmarks/cpu/load-c1-avx2/{margin,margin-order}; what the
    text says `auto` ran (its plans, explorations, margins, forecasts and acceptance) against
    each run's planner record."""
    header = "| one request after the margin (AVX2, mixed kernels), run |"
    raws = _one_request_runs(header, (("margin", "5d62f6f"), ("margin-order", "5d62f6f")))
    for run, vs_sd, vs_ar in (("margin", 1.03, 1.08), ("margin-order", 1.03, 1.16)):
        targets = {t["target"]: t for t in raws[run]["targets"]}
        assert round(targets["auto >= 0.97x best fixed mode at C=1 (all arrivals)"]["value"], 2) == vs_sd
        assert round(targets["auto >= 1.0x ar at C=1 (all arrivals)"]["value"], 2) == vs_ar
    autos = {run: [r for r in raw["runs"] if r["method"] == "auto"] for run, raw in raws.items()}
    sds = {run: [r for r in raw["runs"] if r["method"] == "sd"] for run, raw in raws.items()}
    ratios = [
        round(a["aggregate_tokens_per_second"] / s["aggregate_tokens_per_second"], 2)
        for run in raws
        for a, s in zip(autos[run], sds[run])
    ]
    assert ratios == [0.96, 1.01, 1.12, 1.0, 1.02, 1.07]
    plans = [r["requests"][0]["stats"]["plans"] for run in raws for r in autos[run]]
    assert plans[:3] == [{"ar": 17, "sd:k=5": 9}, {"sd:k=5": 12, "ar": 2}, {"sd:k=5": 12, "ar": 2}]
    assert [sum(v for k, v in p.items() if k != "ar") for p in plans[3:]] == [9, 11, 12]
    assert [r["planner"]["explorations"] for r in autos["margin-order"]] == [2, 0, 0]
    assert round(autos["margin"][0]["planner"]["margin"]["start"], 3) == 1.096
    assert [round(autos[run][-1]["planner"]["margin"]["end"], 3) for run in raws] == [1.051, 1.052]
    spec = [r["planner"]["forecasts"]["speculating"] for r in autos["margin"]]
    assert [round(f["predicted_seconds"], 2) for f in spec] == [8.71, 12.56, 11.87]
    assert [round(f["seconds"], 2) for f in spec] == [9.31, 12.35, 11.76]
    rates = autos["margin"][-1]["planner"]["acceptance"]["model"]
    assert [round(a, 2) for a in rates[:5]] == [0.9, 1.0, 0.9, 0.87, 0.99] and _block_of_five(rates) == 5.0


def _per_pass(run: dict, method: str, c: int, passes: int) -> tuple[list[float], list[float]]:
    """A load sweep's tokens/s of `method` at `c` requests, pass by pass, and each over `ar`'s in
    the same pass (`run`: the sweep's runs by (method, concurrency, pass))."""
    tps = [run[(method, c, p)]["aggregate_tokens_per_second"] for p in range(passes)]
    return tps, [t / run[("ar", c, p)]["aggregate_tokens_per_second"] for p, t in enumerate(tps)]


def _ran_ar_throughout(r: dict, margins: tuple[float, float], decimals: int = 3) -> None:
    """An `auto` load run ran `ar` on every step of every request, never explored nor probed,
    and kept its margins within `margins` (at the docs' precision)."""
    assert all(set(q["stats"]["plans"]) == {"ar"} for q in r["requests"])
    assert r["planner"]["explorations"] == r["planner"]["probes"] == 0
    assert all(margins[0] <= round(m, decimals) <= margins[1] for m in r["planner"]["margin"].values())


def test_under_load_after_the_margin_table_equals_its_results_json():
    """BENCHMARKS.md, "Under load" after the margin: every cell against
    docs/benchmarks/cpu/load-c48-avx2/margin, and what the text says `auto` ran: `ar` on every
    step, no exploration or probe, margins within 1.08-1.11."""
    raw = load(DOCS / "benchmarks" / "cpu" / "load-c48-avx2" / "margin" / "results.json")
    env = raw["meta"]["environment"]
    assert env["git_commit"].startswith("1cc218f") and env["cpu_capability"] == "AVX2"
    assert raw["meta"]["runtime"]["dtype_reason"] == "no-native-bf16-mixed"
    rows = table("BENCHMARKS.md", "| under load after the margin (AVX2, mixed kernels), C |")
    assert len(rows) == len(raw["summary"]) == 6
    for cells, s in zip(rows, raw["summary"]):
        assert cells[:2] == [str(s["concurrency"]), f"`{s['method']}`"]
        per_pass = [
            r["aggregate_tokens_per_second"]
            for r in raw["runs"]
            if r["method"] == s["method"] and r["concurrency"] == s["concurrency"]
        ]
        check_cell(cells[2], [s["aggregate_tokens_per_second"]], "tok/s")
        check_cell(cells[3], [s["decode_tokens_per_second"]], "decode")
        check_cell(cells[4], [s["ttft_p50"]], "ttft")
        check_cell(cells[5], per_pass, "per pass")
    autos = [r for r in raw["runs"] if r["method"] == "auto"]
    assert len(autos) == 4
    for r in autos:
        steps = sum(q["stats"]["plans"].get("ar", 0) for q in r["requests"])
        assert steps == 64 * r["concurrency"]
        _ran_ar_throughout(r, (1.08, 1.11), decimals=2)


def test_beside_an_identical_ar_tables_equal_their_results_json():
    """BENCHMARKS.md, "Beside an identical `ar`": every cell of both tables against
    docs/benchmarks/cpu/load-c48-avx2/aa (the A/A pair `ar` / `ar:gamma=4` beside `auto`), and
    what the text says: the pair's tokens equal, `auto` on `ar` every step, its planning's share."""
    raw = load(DOCS / "benchmarks" / "cpu" / "load-c48-avx2" / "aa" / "results.json")
    env, passes = raw["meta"]["environment"], raw["meta"]["passes"]
    assert env["git_commit"].startswith("94caed0") and not env["git_dirty"] and env["cpu_capability"] == "AVX2"
    assert raw["meta"]["runtime"]["dtype_reason"] == "no-native-bf16-mixed" and passes == 4
    run = {(r["method"], r["concurrency"], r["pass"]): r for r in raw["runs"]}
    rows = table("BENCHMARKS.md", "| beside an identical `ar` (AVX2, mixed kernels), C |")
    assert len(rows) == len(raw["summary"]) == 6
    for cells, s in zip(rows, raw["summary"]):
        method, c = s["method"], s["concurrency"]
        assert cells[:2] == [str(c), f"`{method}`"] and s["agree_with_ar"] == 1.0
        runs = [run[(method, c, p)] for p in range(passes)]
        tps, ratios = _per_pass(run, method, c, passes)
        check_cell(cells[2], [s["aggregate_tokens_per_second"]], "tok/s")
        check_cell(cells[3], tps, "per pass")
        check_cell(cells[4], ratios, "/ ar")
        forward = [sum(q["stats"]["seconds"]["full"] for q in r["requests"]) / len(r["requests"]) / 64 for r in runs]
        check_cell(cells[5], forward, "forward s a step")
    medians = {  # the text's medians of the per-pass ratios (A/A, auto / ar, auto / the A/A twin)
        (a, b, c): round(
            statistics.median(
                run[(a, c, p)]["aggregate_tokens_per_second"] / run[(b, c, p)]["aggregate_tokens_per_second"]
                for p in range(passes)
            ),
            2,
        )
        for a, b in (("ar:gamma=4", "ar"), ("auto", "ar"), ("auto", "ar:gamma=4"))
        for c in (4, 8)
    }
    assert list(medians.values()) == [1.0, 0.88, 0.92, 0.95, 0.91, 1.08]
    rows = table("BENCHMARKS.md", "| `auto`'s planning (AVX2), C |")
    assert len(rows) == 2 * passes
    for cells in rows:
        r = run[("auto", int(cells[0]), int(cells[1]))]
        planning, steps = r["planner"]["planning"], r["planner"]["forecasts"]
        measured = sum(f["seconds"] for f in steps.values())
        assert int(cells[2]) == planning["steps"] == sum(f["steps"] for f in steps.values())
        check_cell(cells[3], [planning["seconds"]], "planning")
        check_cell(cells[4], [measured], "steps measured")
        check_cell(cells[5], [100 * planning["seconds"] / measured], "share")
        _ran_ar_throughout(r, (1.085, 1.113))


def test_two_methods_balanced_table_equals_its_results_json():
    """BENCHMARKS.md, "Two methods, balanced": every cell against
    docs/benchmarks/cpu/load-c48-avx2/{aa-balanced,ar-auto} (each pair alone, each method first in
    half the passes), and what the text says of `auto`'s runs: `ar` on every step, its margins and
    its planning's share."""
    root = DOCS / "benchmarks" / "cpu" / "load-c48-avx2"
    raws = {m: load(root / d / "results.json") for m, d in (("ar:gamma=4", "aa-balanced"), ("auto", "ar-auto"))}
    runs = {}
    for method, raw in raws.items():
        env = raw["meta"]["environment"]
        assert env["git_commit"].startswith("817f570") and not env["git_dirty"] and env["cpu_capability"] == "AVX2"
        assert raw["meta"]["runtime"]["dtype_reason"] == "no-native-bf16-mixed"
        assert [m["label"] for m in raw["methods"]] == ["ar", method]
        assert all(r["ok"] for r in raw["runs"]) and all(s["agree_with_ar"] == 1.0 for s in raw["summary"])
        runs[method] = {(r["method"], r["concurrency"], r["pass"]): r for r in raw["runs"]}
    assert (raws["ar:gamma=4"]["meta"]["passes"], raws["auto"]["meta"]["passes"]) == (4, 6)
    rows = table("BENCHMARKS.md", "| two methods, balanced (AVX2, mixed kernels), C |")
    assert [(r[0], r[1]) for r in rows] == [("8", "`ar:gamma=4`"), ("4", "`auto`"), ("8", "`auto`")]
    for cells in rows:
        method, c = cells[1].strip("`"), int(cells[0])
        raw, run = raws[method], runs[method]
        (s,) = (s for s in raw["summary"] if (s["method"], s["concurrency"]) == (method, c))
        tps, ratios = _per_pass(run, method, c, raw["meta"]["passes"])
        check_cell(cells[2], [s["aggregate_tokens_per_second"]], "tok/s")
        check_cell(cells[3], tps, "per pass")
        check_cell(cells[4], ratios, "/ ar")
        check_cell(cells[5], [statistics.median(ratios)], "median")
    autos = [r for r in raws["auto"]["runs"] if r["method"] == "auto"]
    assert len(autos) == 12
    share = {c: [] for c in (4, 8)}
    for r in autos:
        _ran_ar_throughout(r, (1.084, 1.114))
        measured = sum(f["seconds"] for f in r["planner"]["forecasts"].values())
        share[r["concurrency"]].append(round(100 * r["planner"]["planning"]["seconds"] / measured, 2))
    assert (min(share[4]), max(share[4]), min(share[8]), max(share[8])) == (0.32, 0.39, 0.44, 0.66)
    wins = sum(
        r["aggregate_tokens_per_second"]
        > runs["auto"][("ar", r["concurrency"], r["pass"])]["aggregate_tokens_per_second"]
        for r in autos
    )
    assert wins == 7


def test_planner_replay_table_equals_its_raw_files():
    """BENCHMARKS.md, "Replayed offline": the engine-wide estimate's E[tokens] after 1 / 3 / 8
    `sd` requests and the replayed ratios, before and after, against
    docs/benchmarks/cpu/planner/simulate-{before,after}-avx2.json (scripts/simulate_planner.py)."""
    rows = table("BENCHMARKS.md", "| replay (AVX2 prices) |")
    assert [r[0] for r in rows] == ["before", "after"]
    for cells in rows:
        raw = load(DOCS / "benchmarks" / "cpu" / "planner" / f"simulate-{cells[0]}-avx2.json")
        env = raw["environment"]
        assert env["git_commit"].startswith("fa5ff40") and not env["git_dirty"] and env["cpu_capability"] == "AVX2"
        assert raw["command"].startswith("scripts/simulate_planner.py") and ("--before" in raw["command"]) == (
            cells[0] == "before"
        )
        assert raw["record"] == "docs/benchmarks/cpu/load-c1-avx2/mixed-planner/results.json" and raw["truth"] == 4.643
        for cell, e in zip(cells[1:4], raw["estimate"]):
            mean, sd = (float(x) for x in cell.split(" +- "))
            assert abs(mean - e["mean"]) <= 0.0051 and abs(sd - e["sd"]) <= 0.0051, (cell, e)
        r = raw["requests"]
        assert [float(c) for c in cells[4:]] == [
            round(r["auto_ar"], 2),
            round(r["auto_sd"], 2),
            round(r["sd_ar"], 2),
            round(r["speculated_steps_per_request"], 1),
        ]


def test_planner_cost_table_equals_its_raw_files():
    """BENCHMARKS.md, "What the planner costs a step": the median and p90 milliseconds of one
    `Planner.plans` call per row count, for each tree the header names by commit, against
    docs/benchmarks/cpu/planner/<name>-avx2.json (scripts/measure_planner.py)."""
    raws = [load(DOCS / "benchmarks" / "cpu" / "planner" / f"{n}-avx2.json") for n in ("before", "memo", "after")]
    header = next(
        line for line in (DOCS / "BENCHMARKS.md").read_text().splitlines() if line.startswith("| planner: rows")
    )
    for raw, cell in zip(raws, header.strip("|").split("|")[1:]):
        assert f"`{raw['environment']['git_commit'][:7]}`" in cell and raw["command"].startswith(
            "scripts/measure_planner.py"
        )
        assert raw["environment"]["cpu_capability"] == "AVX2"
    rows = table("BENCHMARKS.md", "| planner: rows")
    assert [int(r[0]) for r in rows] == [r["rows"] for r in raws[0]["results"]] == [1, 4, 8, 16]
    for i, cells in enumerate(rows):
        for raw, cell in zip(raws, cells[1:]):
            check_cell(cell, [raw["results"][i]["median_ms"], raw["results"][i]["p90_ms"]], f"{cells[0]} rows")


def test_avx2_load_table_equals_its_results_json():
    """BENCHMARKS.md, "The planner's own time and the exploration's catch-up": per concurrency and
    pass, `ar` / `sd` / `auto` tok/s, `auto` / `ar`, `auto`'s row-steps on `ar` and the mean
    seconds per verifier forward of `ar` and `auto`, against docs/benchmarks/cpu/load-auto-avx2."""
    raw = load(DOCS / "benchmarks" / "cpu" / "load-auto-avx2" / "results.json")
    assert raw["meta"]["cpu_capability"] == "AVX2" and raw["meta"]["runtime"]["dtype"] == "float32"
    assert (
        raw["meta"]["environment"]["git_commit"].startswith("e244efd") and not raw["meta"]["environment"]["git_dirty"]
    )
    by = {(r["method"], r["concurrency"], r["pass"]): r for r in raw["runs"]}

    def ms_a_forward(run):
        return 1e3 * statistics.mean(
            q["stats"]["seconds"]["full"] / q["stats"]["forwards"]["full"] for q in run["requests"]
        )

    rows = table("BENCHMARKS.md", "| AVX2 load (`float32`), C |")
    assert [(int(r[0]), int(r[1])) for r in rows] == [(c, p) for c in (4, 8, 16) for p in (0, 1)]
    for cells in rows:
        c, p = int(cells[0]), int(cells[1])
        tps = {m: by[m, c, p]["aggregate_tokens_per_second"] for m in ("ar", "sd", "auto")}
        plans = Counter()
        for q in by["auto", c, p]["requests"]:
            plans.update(q["stats"]["plans"])
        check_cell(cells[2], [tps["ar"]], "ar")
        check_cell(cells[3], [tps["sd"]], "sd")
        check_cell(cells[4], [tps["auto"]], "auto")
        check_cell(cells[5], [tps["auto"] / tps["ar"]], "auto / ar")
        check_cell(cells[6], [plans["ar"], sum(plans.values())], "ar row-steps")
        check_cell(cells[7], [ms_a_forward(by["ar", c, p]), ms_a_forward(by["auto", c, p])], "ms a forward")


def test_one_request_avx2_dtype_table_equals_its_results_json():
    """BENCHMARKS.md, "One request on the AVX2 CPU: the prompt decides the dtype": per run and
    method, aggregate and decode tok/s and TTFT p50, against docs/benchmarks/cpu/load-c1-avx2."""
    rows = table("BENCHMARKS.md", "| one request (AVX2), run |")
    shown = []
    for run, requested, commit in (
        ("auto", "auto", "e94040b"),
        ("float32", "float32", "e94040b"),
        ("auto-prompt", "auto", "92bc042"),
    ):
        raw = load(DOCS / "benchmarks" / "cpu" / "load-c1-avx2" / run / "results.json")
        meta = raw["meta"]
        assert meta["cpu_capability"] == "AVX2" and f"--dtype {requested}" in meta["command"]
        assert meta["environment"]["git_commit"].startswith(commit) and not meta["environment"]["git_dirty"]
        shown += [(f"`--dtype {requested}`", meta["runtime"]["dtype"], s) for s in raw["summary"]]
    assert len(rows) == len(shown) == 12
    for cells, (run, dtype, s) in zip(rows, shown):
        assert cells[0].startswith(run) and cells[1:3] == [f"`{dtype}`", f"`{s['method']}`"]
        check_cell(cells[3], [s["aggregate_tokens_per_second"]], "tok/s")
        check_cell(cells[4], [s["decode_tokens_per_second"]], "decode")
        check_cell(cells[5], [s["ttft_p50"]], "ttft")
    assert (shown[0][1], shown[8][1]) == (
        "bfloat16",
        "float32",
    )  # `auto`'s choice before and after it priced the prompt


# ------------------------------------------------------------------ docs/SERVING.md: one engine

ONE_ENGINE = DOCS / "benchmarks" / "cpu" / "one-engine"


def test_served_beside_in_process_table_equals_its_raw_file():
    """SERVING.md, "One engine, served and in process": the table is the one serve_throughput
    renders from the committed run (its command on the page; command, commit and machine inside),
    each figure the median of its passes; the greedy streams of both systems agree token for token
    but at the one near-tied bf16 position the text names, where both systems part alike."""
    serve_throughput = script_module("serve_throughput")
    raw = load(ONE_ENGINE / "serve-throughput-avx512.json")
    page = (DOCS / "SERVING.md").read_text()
    assert serve_throughput.markdown_table(raw) in page
    assert raw["summary"] == serve_throughput.summarize(raw["runs"]) and raw["ratios"] == serve_throughput.ratios(
        raw["summary"]
    )
    env = raw["environment"]
    assert env["cpu_capability"] == "AVX512" and "avx512_bf16" in env["cpu_flags"] and not env["git_dirty"]
    assert raw["pipeline"]["runtime"]["dtype"] == raw["in_process"]["runtime"]["dtype"] == "bfloat16"
    assert raw["passes"] == 2
    assert " ".join(shlex.split(raw["command"])[1:]) in commands_joined(page)
    parted = Counter()  # (prompt, first position where a stream leaves its prompt's first stream) -> systems
    first = {}
    for run in raw["runs"]:
        for prompt, ids in run["stream_token_ids"]:
            ref = first.setdefault(prompt, ids)
            if ids != ref:
                parted[(prompt, next(i for i, (a, b) in enumerate(zip(ref, ids)) if a != b), run["system"])] += 1
    assert {(p, i) for p, i, _ in parted} == {(1, 7)}  # prompt 1, its 8th token
    assert {s for _, _, s in parted} == {"in_process", "served"}
    assert sum(parted.values()) == raw["tokens"]["streams_mismatched"] == 21 and raw["tokens"]["streams_checked"] == 232


def test_draft_routes_table_equals_its_raw_file():
    """SERVING.md, "Draft data on the wire": the routes table is the one measure_draft_routes
    renders from the committed run, whose summary its functions recompute from the recorded steps
    and calls; (a) moves twice (b)'s bytes, (c) under a fifth of them."""
    routes = script_module("measure_draft_routes")
    raw = load(ONE_ENGINE / "draft-routes-avx512.json")
    page = (DOCS / "SERVING.md").read_text()
    assert routes.markdown_table(raw) in page
    assert raw["summary"] == [routes.summarize(p, raw["vocab_size"], raw["rows"]) for p in raw["passes"]]
    assert raw["environment"]["cpu_capability"] == "AVX512" and not raw["environment"]["git_dirty"]
    assert " ".join(shlex.split(raw["command"])[1:]) in commands_joined(page)
    for summary in raw["summary"]:
        mb = {route: r["mb_per_full_step"] for route, r in summary["routes"].items()}
        assert mb["through the engine"] == pytest.approx(2 * mb["drafter to verifier"], abs=0.01)
        assert mb["probability only"] < mb["drafter to verifier"] / 5


def test_step_breakdown_table_equals_its_raw_file():
    """BATCHING.md, "Host work per step": the table measure_step renders from the committed run;
    after batching, one host read a step and under half the time outside the forwards of a greedy
    16-row step, both sides' tokens/s within their A/A spread or better."""
    step = script_module("measure_step")
    raw = load(DOCS / "benchmarks" / "cpu" / "device-step" / "step-breakdown-avx512.json")
    page = (DOCS / "BATCHING.md").read_text()
    assert step.markdown_table(raw) in page
    assert raw["environment"]["cpu_capability"] == "AVX512" and not raw["environment"]["git_dirty"]
    assert " ".join(shlex.split(raw["command"])[1:]) in commands_joined(page)
    summary = step.summarize(raw)
    for method in ("ar", "sd", "sd-sampled"):
        before, after = summary["before"][method], summary["after"][method]
        assert after["host_reads"] == 1 and before["host_reads"] == 16 * (1 if method == "ar" else 10)
        assert after["outside_seconds"] < before["outside_seconds"]
        spread = max(before["spread"]["tokens_per_second"], after["spread"]["tokens_per_second"])
        assert after["tokens_per_second"] >= before["tokens_per_second"] * (1 - spread)
    assert summary["after"]["sd"]["outside_seconds"] < summary["before"]["sd"]["outside_seconds"] / 2
