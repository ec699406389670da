#!/usr/bin/env python
"""What each weight dtype costs a decoding step on this CPU: one forward of 1, 2 and 6 tokens
(after 128 cached positions, best of 5) of each embedded model, in bf16 and float32, each with
the kernels the engine runs (oneDNN-prepacked linears where `optimize_linears` packs; bf16
without native bf16: mixed kernels), beside the probe products `dtype: auto` decides with
(viasd.precision). With ``--rows 1,8``, also at 8 requests a step: forwards of 8 rows of 1 and 6
tokens (best of 3), the probes at each row count and what ``auto`` chose there. With
``--plain-bf16``, bf16 also with plain ``F.linear`` (variant ``bfloat16-plain``); with
``--prompt N``, also a prompt of N tokens (best of 2).

    flock /tmp/viasd-heavy.lock python scripts/measure_dtypes.py [--rows 1,8] [--plain-bf16] [--prompt 118] [--stem dtypes]

Writes ``docs/benchmarks/cpu/dtypes/dtypes-<label>.json`` (viasd.bench.machine_label).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "cpu" / "dtypes"
MODELS = ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
DTYPES = ("bfloat16", "float32")
TOKENS = (1, 2, 6)
BATCH_TOKENS = (1, 6)  # tokens a row at more rows a step: `ar`'s step and a k = 5 block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1", help="requests a step, comma-separated (1 is always measured)")
    ap.add_argument("--stem", default="dtypes", help="raw file name: <stem>-<machine label>.json")
    ap.add_argument("--plain-bf16", action="store_true", help="also bf16 with plain F.linear")
    ap.add_argument("--prompt", type=int, default=0, help="also a prompt of this many tokens (0: none)")
    args = ap.parse_args()
    batches = sorted({1, *(int(r) for r in args.rows.split(",") if r.strip())})
    import torch

    from viasd.bench import provenance, write_raw
    from viasd.costs import _time_forwards
    from viasd.models.loader import load_causal_lm
    from viasd.precision import (
        LinearReport,
        decode_probe_seconds,
        decode_shapes,
        decode_speed,
        mixed_probe_seconds_cached,
        optimize_linears,
        resolve_dtype,
    )
    from viasd.runtime import MaskedLM

    torch.set_num_threads(args.threads)
    record = {**provenance(), "probe_seconds": {}, "decode_speed": {}, "auto": {}, "forwards": []}
    for rows in batches:  # what `auto` decides with at each row count, and what it chose
        probes = decode_probe_seconds(rows)
        (step, _, _), (block, _, _) = decode_shapes(rows)
        speed = {d: decode_speed(probes[f"{d}@{step}"], probes[f"{d}@{block}"], rows) for d in DTYPES}
        choice = resolve_dtype("auto", "cpu", rows=rows)  # (probes again: its own run)
        if rows == 1:  # the fields of the one-row records before --rows
            record["probe_seconds"], record["decode_speed"] = probes, speed
        else:
            record["probe_seconds"].update(probes)
            record.setdefault("decode_speed_by_rows", {})[str(rows)] = speed
        record["auto"][str(rows)] = {
            "dtype": choice.dtype,
            "reason": choice.reason,
            "probe_seconds": choice.probe_seconds,
        }
    record["mixed_probe_seconds"] = mixed_probe_seconds_cached()
    variants = [(d, False) for d in DTYPES] + ([("bfloat16", True)] if args.plain_bf16 else [])
    for name in MODELS:
        for dtype, plain in variants:
            model = load_causal_lm(name, dtype=dtype, device="cpu")[0]
            report = optimize_linears(model, dtype, "cpu") if not plain else LinearReport("plain")
            lm = MaskedLM(model)
            _time_forwards(lm, None, 1, [1], 1)  # (first-call allocations stay out of the figures)
            for rows in batches:
                tokens, repeats = (TOKENS, 5) if rows == 1 else (BATCH_TOKENS, 3)
                seconds = _time_forwards(lm, None, rows, list(tokens), repeats)
                if rows == 1 and args.prompt:
                    tokens, seconds = (*tokens, args.prompt), [*seconds, *_time_forwards(lm, None, 1, [args.prompt], 2)]
                row = {
                    "model": name,
                    "dtype": dtype,
                    "variant": f"{dtype}-plain" if plain else dtype,
                    **report.as_dict(),
                    "seconds": dict(zip(map(str, tokens), seconds)),
                }
                row.pop("linears_skipped")
                if rows > 1:
                    row["rows"] = rows
                record["forwards"].append(row)
                print(json.dumps(row), flush=True)
            del lm, model
            gc.collect()
    path = write_raw(OUT, args.stem, record)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
