"""Quality of every three-tier setting on enough problems to tell them apart (issue 20).

    flock /tmp/viasd-heavy.lock python scripts/quality_eval.py --humaneval 40 --stdlib 40 \
        --out docs/benchmarks/quality

Greedy settings run on HumanEval (pass@1) and the standard-library corpus (agreement with `ar`),
with the loaded mask's calibrated gates added when it has them;
sampled settings (temperature 1) run on HumanEval with every seed of --seeds. Every lossy setting
gets its matched baseline (the verifier with min-p = alpha1) added. Writes results.json (the raw
runs, the summary, the command, the commit and the machine) and results.md (the table).
See viasd/bench/quality.py for what is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from viasd.bench import provenance
from viasd.bench.methods import matched_baseline, parse_method, split_specs
from viasd.bench.quality import Setting, evaluate, markdown, stdlib_functions
from viasd.bench.workloads import humaneval
from viasd.config import parse_engine_config, parse_params
from viasd.engine import Engine, cost_cache_dir
from viasd.llm import LLM

GREEDY = "ar;sd;via:alpha1=0.5:alpha2=0.3;via:alpha1=0.7:region_b=escalate;via:rule=staged"
SAMPLED = "ar:temperature=1;via:alpha1=0.5:alpha2=0.3:temperature=1;via:rule=staged:temperature=1"


def settings_from(spec: str, seeds: tuple[int, ...], base) -> list[Setting]:
    out: dict[str, Setting] = {}
    for s in split_specs(spec):
        m = parse_method(s, base)
        mb = matched_baseline(m, base) if m.lossy and not m.params.greedy else None
        out.setdefault(m.label, Setting(m, seeds if not m.params.greedy else (0,), mb.label if mb else None))
        if mb is not None:
            out.setdefault(mb.label, Setting(mb, seeds))
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--humaneval", type=int, default=40, help="HumanEval problems (from the first)")
    ap.add_argument("--stdlib", type=int, default=40, help="standard-library functions (viasd.bench.quality)")
    ap.add_argument("--greedy", default=GREEDY, help="greedy settings (';'-separated method specs)")
    ap.add_argument("--sampled", default=SAMPLED, help="sampled settings, HumanEval only ('' for none)")
    ap.add_argument("--seeds", default="0,1", help="seeds of the sampled settings")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--max-batch", type=int, default=8, help="rows decoding together")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    seeds = tuple(int(s) for s in args.seeds.split(","))
    base = parse_params(max_tokens=args.max_tokens)
    greedy = settings_from(args.greedy, (0,), base)
    sampled = settings_from(args.sampled, seeds, base) if args.sampled else []
    llm = LLM(parse_engine_config(threads=args.threads))
    if llm.engine.gates is not None:  # the mask's calibrated gates, spelled out (viasd.gates)
        greedy = settings_from(";".join([*(s.label for s in greedy), llm.engine.gates.spec()]), (0,), base)
    engine = Engine(
        llm.verifier,
        llm.drafter,
        mask=llm.engine.mask,
        eos_token_ids=llm.engine.eos_token_ids,
        max_batch=args.max_batch,
        cost_cache_dir=cost_cache_dir(),
    )
    he, lib = humaneval(args.humaneval), stdlib_functions(args.stdlib)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    res_g = evaluate(engine, llm.tokenizer, greedy, {"humaneval": he, "stdlib": lib}, log=log)
    res_s = evaluate(engine, llm.tokenizer, sampled, {"humaneval": he}, log=log) if sampled else None
    summary = {**res_g["summary"], **(res_s["summary"] if res_s else {})}
    results = {
        "meta": {
            **provenance(str(llm.verifier.device)),
            "runtime": llm.runtime_info(),
            "mask": {"skipped_layers": list(llm.engine.mask.skipped), "source": llm.mask_source},
            "max_tokens": args.max_tokens,
            "max_batch": args.max_batch,
            "seeds": list(seeds),
            "corpora": {"humaneval": [p.id for p in he], "stdlib": [p.id for p in lib]},
            "wall_seconds": res_g["wall_seconds"] + (res_s["wall_seconds"] if res_s else 0.0),
        },
        "summary": summary,
        "runs": res_g["runs"] + (res_s["runs"] if res_s else []),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(summary, ["humaneval", "stdlib"])
    (out / "results.md").write_text(
        f"wall time of the whole evaluation: {results['meta']['wall_seconds']:.0f} s\n\n" + table
    )
    print(table)
    print(f"wall time {results['meta']['wall_seconds']:.0f} s; wrote {out}/results.json, results.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
