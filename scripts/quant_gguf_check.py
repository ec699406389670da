#!/usr/bin/env python
"""Check a built-in model's quantized linears against its GGUF file's own dequantized values.

For every linear that ``viasd.quant_gguf.gguf_weights`` maps (``--scheme int4``: Q4_K / Q4_1 /
Q4_0 blocks to int4 exactly, the other types requantized to int8 per channel; ``int8``: all to
int8), per GGUF type: how many, and over all of them

* ``max_abs_error``: max |W_mapped - W_gguf|, W_mapped the mapped weight dequantized in float32,
  W_gguf gguf's ``quants.dequantize`` of the tensor (transformers' row order);
* ``max_error_over_step``: that error over the channel's int8 step ``s[n]`` (int8 rounds to the
  nearest: at most 0.5);
* ``kernel_max_abs_error`` / ``kernel_max_rel_error``: the weight the integer kernel computes with
  in ``--dtype`` (int4: ``(q - 8) * s + z`` with ``s``, ``z`` rounded to it; int8: ``q * s``,
  ``s`` rounded) against W_gguf, absolute and over max |W_gguf| of the row;
* ``loaded_equal``: whether W_gguf rounded to the loaded dtype equals the loaded weight (the
  cached conversion of the same file) for every tensor: the condition under which the engine uses
  a mapped weight.

    flock /tmp/viasd-heavy.lock .venv/bin/python scripts/quant_gguf_check.py qwen2.5-coder-1.5b-instruct \\
        --out docs/benchmarks/cpu/quant/gguf-check-qwen2.5-coder-1.5b-instruct.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    from gguf import GGUFReader, quants

    from viasd import quant as Q
    from viasd import quant_gguf as G
    from viasd.models.loader import load_causal_lm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a built-in model name")
    ap.add_argument("--scheme", default="int4", choices=["int4", "int8"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    path = G.cached_gguf(args.model)
    model, _ = load_causal_lm(args.model, dtype=args.dtype)
    dt = getattr(torch, args.dtype)
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    mapped = G.gguf_weights(path, args.scheme, model.config)
    by_type: dict[str, dict] = {}
    for name, lin in model.named_modules():
        if type(lin) is not torch.nn.Linear or G.gguf_name(name) not in tensors:
            continue
        tensor = tensors[G.gguf_name(name)]
        ref = torch.from_numpy(np.array(quants.dequantize(np.asarray(tensor.data), tensor.tensor_type), np.float32))
        ref = ref.reshape(lin.weight.shape)  # [N, K]
        if model.config.model_type == "llama" and any(f".attn_{x}." in tensor.name for x in "qk"):
            heads = model.config.num_attention_heads if ".attn_q." in tensor.name else model.config.num_key_value_heads
            ref = ref[G._llama_rows(ref.shape[0], heads)]
        qw = mapped(name, lin)
        entry = by_type.setdefault(
            tensor.tensor_type.name,
            {
                "tensors": 0,
                "mapped_to": set(),
                "max_abs_error": 0.0,
                "max_error_over_step": 0.0,
                "kernel_max_abs_error": 0.0,
                "kernel_max_rel_error": 0.0,
                "loaded_equal": True,
            },
        )
        entry["tensors"] += 1
        entry["loaded_equal"] &= bool(torch.equal(ref.to(dt), lin.weight))
        if qw is None:
            entry["mapped_to"].add("none (does not match the loaded weight)")
            continue
        entry["mapped_to"].add(f"{qw.scheme}" + (f" g{qw.group}" if qw.group else "") + f" ({qw.source})")
        err = (qw.dequantize() - ref).abs()  # [N, K]
        entry["max_abs_error"] = max(entry["max_abs_error"], float(err.max()))
        if qw.scheme == "int8":
            entry["max_error_over_step"] = max(entry["max_error_over_step"], float((err / qw.scale[:, None]).max()))
        mod = Q.quantized_linear_class()(qw, None, dt)
        if qw.scheme == "int8":
            kernel_w = qw.q.float() * mod.scales.float()[:, None]
        else:
            s, z = mod.scales_zeros.float().transpose(0, 1).unbind(-1)  # [N, K/g]
            g = qw.group
            kernel_w = ((qw.q.float().reshape(*s.shape, g) - 8) * s[..., None] + z[..., None]).reshape(ref.shape)
        kerr = (kernel_w - ref).abs()
        row_max = ref.abs().amax(1, keepdim=True).clamp(min=1e-30)
        entry["kernel_max_abs_error"] = max(entry["kernel_max_abs_error"], float(kerr.max()))
        entry["kernel_max_rel_error"] = max(entry["kernel_max_rel_error"], float((kerr / row_max).max()))
    for entry in by_type.values():
        entry["mapped_to"] = sorted(entry["mapped_to"])
    root = Path(__file__).resolve().parent.parent
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
    doc = {
        "command": " ".join(["python", *sys.argv]),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain")),
        "model": args.model,
        "gguf_sha256": Path(str(path) + ".sha256").read_text().strip(),
        "scheme": args.scheme,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "by_gguf_type": by_type,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
