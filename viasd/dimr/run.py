"""The whole run of `viasd dimr`: load the models, build the reference, search, write the artifacts."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from viasd.dimr.artifact import MaskArtifact, build_artifact, save_artifact
from viasd.dimr.calibration import file_calibration, humaneval_calibration
from viasd.dimr.objectives import OBJECTIVES, Costs, evaluate_mask, make_objective, measure_costs
from viasd.dimr.placement import PlacedLM, Placement, load_placed, search_devices
from viasd.dimr.reference import build_reference
from viasd.dimr.report import heldout_table, plot_trials, summary_table, table4
from viasd.dimr.search import search_mask
from viasd.dimr.space import evenly_spaced_skips, normalize_keep, num_skipped
from viasd.errors import InvalidParameterError
from viasd.runtime import LayerMask, MaskedLM


def _default_out(out: str | Path, ratio: float, sweep: bool) -> Path:
    out = str(out)
    if not sweep:
        return Path(out)
    if "{ratio}" in out:
        return Path(out.format(ratio=f"{ratio:g}"))
    p = Path(out)
    if p.suffix:
        return p.with_name(f"{p.stem}-r{ratio:g}{p.suffix}")
    return p / f"mask-r{ratio:g}.json"


def run_dimr(
    verifier: str,
    *,
    drafter: str | None = None,
    ratios: Sequence[float] = (0.45,),
    trials: int = 100,
    objective: str = "rkl",
    out: str | Path = "mask.json",
    seed: int = 0,
    theta: int = 5,
    keep: Sequence[int] = (0, -1),
    rungs: Sequence[float] = (0.25, 0.5),
    eta: float = 2.0,
    calibration: str = "humaneval",
    calib_tokens: int = 1024,
    max_seq_tokens: int = 256,
    calib_start: int = 0,
    heldout_tokens: int = 0,
    heldout_start: int = 100,
    cache_policy: str = "separate",
    gamma: int = 5,
    alpha1: float = 0.5,
    alpha2: float = 0.3,
    region_b: str = "rewrite",
    rkl_alpha: float = 0.0,
    rkl_beta: float = 1.0,
    costs: Costs | None = None,
    dtype: str = "bfloat16",
    device: str | None = None,
    devices: str | None = None,
    plot: str | Path | None = None,
    progress: bool = True,
    command: str | None = None,
    echo: Callable[[str], None] = print,
) -> list[MaskArtifact]:
    """Load the models, build the reference once, search one mask per ratio, write the artifacts.

    With `heldout_tokens`, also scores the searched and the evenly spaced mask on held-out
    HumanEval text (problems from `heldout_start`) with every objective and stores the figures
    in the artifact under "heldout". `costs` replaces the measured forward costs of the e2e
    objective (for reproducible e2e runs on a busy machine).

    Where it runs (`viasd.dimr.placement`): `device` (`cpu`, `cuda`, `cuda:N`) loads the models
    straight onto one device in `dtype` (``auto``: the engine's choice for that device);
    `devices` (`N` GPUs, `all`, or a list such as `cuda:0,cuda:1`) spreads the verifier's layers
    over several, the drafter on the first; neither: the CPU, as `load_causal_lm` loads it.
    Both are checked before anything loads (InvalidParameterError naming the flag). The artifact
    records the placement; the mask does not depend on it beyond the arithmetic of each device.
    """
    from viasd.models.loader import load_causal_lm

    if objective not in OBJECTIVES:
        raise InvalidParameterError(
            "objective", f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}"
        )
    if objective == "e2e" and drafter is None:
        raise InvalidParameterError("drafter", "the e2e objective needs --drafter")
    targets, flag = search_devices(device, devices)
    fixed_costs = costs
    t_all = time.perf_counter()
    if targets == (torch.device("cpu"),):  # the host, as the engine loads it
        model, tokenizer = load_causal_lm(verifier, dtype=dtype)
        placement = Placement.spread(targets, len(model.model.layers))
        vq = MaskedLM(model)
        vp = MaskedLM(load_causal_lm(drafter, dtype=dtype)[0]) if drafter else None
    else:
        model, tokenizer, placement = load_placed(verifier, targets, dtype=dtype, flag=flag)
        vq = PlacedLM(model)
        vp = PlacedLM(load_placed(drafter, targets[:1], dtype=dtype, flag=flag)[0]) if drafter else None
    load_s = time.perf_counter() - t_all
    echo(f"[dimr] verifier ({str(vq.dtype).removeprefix('torch.')}) on {placement.describe()}")
    if calibration == "humaneval":
        calib = humaneval_calibration(
            tokenizer, start=calib_start, max_tokens=calib_tokens, max_seq_tokens=max_seq_tokens
        )
    else:
        calib = file_calibration(calibration, tokenizer, max_tokens=calib_tokens, max_seq_tokens=max_seq_tokens)
    if heldout_tokens and calibration == "humaneval":
        n_cal = len(calib.sequences)
        if calib_start < heldout_start < calib_start + n_cal:
            raise InvalidParameterError(
                "heldout_start",
                f"held-out problems overlap the calibration problems {calib_start}..{calib_start + n_cal - 1}",
            )
    echo(f"[dimr] models loaded in {load_s:.1f}s; calibration: {calib.description}")
    t0 = time.perf_counter()
    ref = build_reference(vq, calib, cache_policy=cache_policy, gamma=gamma, drafter=vp)
    ref_s = time.perf_counter() - t0
    echo(f"[dimr] reference (full model once over the calibration text) in {ref_s:.1f}s: {ref!r}")
    held = None
    if heldout_tokens:
        held_cal = humaneval_calibration(
            tokenizer, start=heldout_start, max_tokens=heldout_tokens, max_seq_tokens=max_seq_tokens
        )
        held = (held_cal, build_reference(vq, held_cal, cache_policy=cache_policy, gamma=gamma, drafter=vp))

    artifacts = []
    sweep = len(ratios) > 1
    rows = []
    for ratio in ratios:
        t_ratio = time.perf_counter()
        free = [i for i in range(vq.num_layers) if i not in normalize_keep(keep, vq.num_layers)]
        even = LayerMask.from_skipped(evenly_spaced_skips(free, num_skipped(ratio, vq.num_layers)), vq.num_layers)
        if vp is not None and fixed_costs is None:
            costs = measure_costs(vq, vp, even, gamma=gamma)
        if costs is not None:
            echo(
                f"[dimr] {'given' if fixed_costs else 'measured'} costs (s): drafter token {costs.drafter:.4f}, slim block {costs.slim:.4f}, "
                f"full block {costs.full:.4f}, full token {costs.full_token:.4f}"
            )
        obj = make_objective(
            objective,
            rkl_alpha=rkl_alpha,
            rkl_beta=rkl_beta,
            costs=costs,
            gamma=gamma,
            alpha1=alpha1,
            alpha2=alpha2,
            rewrite=region_b == "rewrite",
        )
        result = search_mask(
            vq,
            ref,
            ratio=ratio,
            trials=trials,
            objective=obj,
            seed=seed,
            theta=theta,
            keep=keep,
            rungs=rungs,
            eta=eta,
            progress=progress,
            log=lambda m: print(m, file=sys.stderr),
        )
        # the search's wall time: forward costs, trials, and the reference pass (once, on the first ratio)
        seconds = time.perf_counter() - t_ratio + (ref_s if ratio == ratios[0] else 0.0)
        extra: dict[str, Any] = {
            "command": command,
            "reference_seconds": round(ref_s, 3),
            "placement": placement.as_dict(),
        }
        if held is not None:
            held_cal, held_ref = held
            objs = [
                make_objective(
                    n,
                    rkl_alpha=rkl_alpha,
                    rkl_beta=rkl_beta,
                    costs=costs,
                    gamma=gamma,
                    alpha1=alpha1,
                    alpha2=alpha2,
                    rewrite=region_b == "rewrite",
                )
                for n in OBJECTIVES
                if n != "e2e" or costs is not None
            ]
            extra["heldout"] = {
                "calibration": held_cal.to_dict(),
                "searched": evaluate_mask(vq, held_ref, result.mask, objs),
                "evenly_spaced": {"skipped_layers": list(even.skipped), **evaluate_mask(vq, held_ref, even, objs)},
            }
            if costs is not None:
                extra["heldout"]["costs"] = costs.to_dict()
        art = build_artifact(
            result,
            vq,
            calib,
            seconds=seconds,
            cache_policy=cache_policy,
            verifier_name=verifier,
            drafter_name=drafter,
            dtype=str(vq.dtype).removeprefix("torch."),  # the concrete dtype (`auto` resolved)
            extra=extra,
        )
        path = save_artifact(art, _default_out(out, ratio, sweep))
        echo(f"\n## skip ratio {ratio:g}: {len(result.mask.skipped)} of {vq.num_layers} layers\n")
        echo(summary_table(result))
        if held is not None:
            echo("\n" + heldout_table(extra["heldout"]))
        echo(f"\n[dimr] wrote {path}")
        if plot:
            ppath = _default_out(plot, ratio, sweep)
            echo(f"[dimr] plot {plot_trials(result, ppath.with_suffix('.png'))}")
        artifacts.append(art)
        rows.append(
            (
                f"{drafter or '-'} -> {verifier} (r={ratio:g}, {len(result.trials)} trials)",
                seconds,
                torch.get_num_threads(),
            )
        )
    gpus = len({d for d in placement.devices if d.type == "cuda"})
    echo("\n" + table4(rows, gpus=gpus))
    return artifacts
