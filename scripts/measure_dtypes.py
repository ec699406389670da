#!/usr/bin/env python
"""What each weight dtype costs a decoding step on this CPU: one forward of 1, 2 and 6 tokens
(after 128 cached positions, best of 5) of each embedded model, in bf16 and float32, each with
the kernels the engine runs (oneDNN-prepacked linears where `optimize_linears` packs), beside
the probe products `dtype: auto` decides with (viasd.precision).

    flock /tmp/viasd-heavy.lock python scripts/measure_dtypes.py

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    from viasd.bench import provenance, write_raw
    from viasd.costs import _time_forwards
    from viasd.models.loader import load_causal_lm
    from viasd.precision import DECODE_SHAPES, decode_probe_seconds, decode_speed, optimize_linears
    from viasd.runtime import MaskedLM

    torch.set_num_threads(args.threads)
    probes = decode_probe_seconds()
    (one, _, _), (block, _, _) = DECODE_SHAPES
    record = {
        **provenance(),
        "probe_seconds": probes,
        "decode_speed": {d: decode_speed(probes[f"{d}@{one}"], probes[f"{d}@{block}"]) for d in DTYPES},
        "forwards": [],
    }
    for name in MODELS:
        for dtype in DTYPES:
            model = load_causal_lm(name, dtype=dtype, device="cpu")[0]
            report = optimize_linears(model, dtype, "cpu")
            lm = MaskedLM(model)
            _time_forwards(lm, None, 1, [1], 1)  # (first-call allocations stay out of the figures)
            seconds = _time_forwards(lm, None, 1, list(TOKENS), 5)
            row = {"model": name, "dtype": dtype, **report.as_dict(), "seconds": dict(zip(map(str, TOKENS), seconds))}
            row.pop("linears_skipped")
            record["forwards"].append(row)
            print(json.dumps(row), flush=True)
            del lm, model
            gc.collect()
    path = write_raw(OUT, "dtypes", record)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
