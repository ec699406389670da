"""Reports of a search: Markdown tables and the trial plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from viasd.dimr.search import SearchResult
from viasd.errors import require


def summary_table(result: SearchResult, top: int = 5) -> str:
    """Markdown: the best masks, then the search's counts and times."""
    obj = result.objective
    done = sorted(
        (r for r in result.trials if r.value is not None and not r.duplicate), key=lambda r: obj.loss(r.value)
    )
    lines = [
        f"| rank | trial | proposal | {obj.name} ({obj.direction}) | skipped layers |",
        "|---|---|---|---|---|",
    ]
    for rank, r in enumerate(done[:top], 1):
        lines.append(f"| {rank} | {r.number} | {r.proposal} | {r.value:.5g} | {list(r.skipped)} |")
    if result.baseline is not None and result.baseline.value is not None:
        lines.append(f"| evenly spaced | 0 | evenly | {result.baseline.value:.5g} | {list(result.baseline.skipped)} |")
    n = len(result.trials)
    tokens = sum(r.tokens for r in result.trials)
    full = sum(not r.duplicate for r in result.trials) * result.settings["calibration_tokens"]
    lines.append("")
    lines.append(
        f"trials {n} (pruned {result.num_pruned}, duplicates {result.num_duplicates}); "
        f"{tokens} calibration tokens scored ({tokens / max(full, 1):.0%} of scoring every trial on all); "
        f"{result.seconds:.1f} s ({result.seconds / n:.2f} s/trial)"
    )
    return "\n".join(lines)


def table4(rows: Sequence[tuple[str, float, int]], gpus: int = 0) -> str:
    """The paper's Table 4 layout: (model pair, seconds, CPU threads) -> wall time and core-hours;
    with `gpus` (the search held that many GPUs) GPU-hours instead of core-hours."""
    unit = "GPU-hours" if gpus else "CPU core-hours"
    lines = [f"| Model | Wall-clock Time | {unit} |", "| --- | --- | --- |"]
    for name, seconds, threads in rows:
        if gpus:
            used = f"{seconds * gpus / 3600:.2f} h ({gpus} GPU{'s' if gpus > 1 else ''})"
        else:
            used = f"{seconds * threads / 3600:.2f} h ({threads} threads)"
        lines.append(f"| {name} | {seconds / 60:.1f} min | {used} |")
    return "\n".join(lines)


def plot_trials(result: SearchResult, path: str | Path) -> Path:
    """PNG: objective against trial (completed and pruned trials), with the best so far."""
    matplotlib = require("matplotlib", "dimr")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    obj = result.objective
    fig, ax = plt.subplots(figsize=(7, 4))
    done = [(r.number, r.value) for r in result.trials if r.value is not None]
    pruned = [(r.number, r.rung_values[-1]) for r in result.trials if r.pruned and r.rung_values]
    if done:
        ax.scatter(*zip(*done), s=14, label="scored on all tokens")
    if pruned:
        ax.scatter(*zip(*pruned), s=14, marker="x", alpha=0.6, label="pruned (value at last rung)")
    best, xs, ys = None, [], []
    for r in result.trials:
        if r.value is not None and (best is None or obj.loss(r.value) < obj.loss(best)):
            best = r.value
        if best is not None:
            xs.append(r.number)
            ys.append(best)
    ax.step(xs, ys, where="post", color="black", label="best so far")
    if result.baseline is not None and result.baseline.value is not None:
        ax.axhline(result.baseline.value, color="grey", linestyle="--", label="evenly spaced")
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{obj.name} ({obj.direction})")
    ax.set_title(
        f"DIMR search, skip ratio {result.ratio:g} ({len(result.mask.skipped)} of {result.mask.num_layers} layers)"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heldout_table(held: dict[str, Any]) -> str:
    """Markdown: searched vs evenly spaced mask on held-out text, every objective."""
    s, e = held["searched"], held["evenly_spaced"]
    names = [n for n in ("top1", "rkl", "kl", "tv", "e2e") if n in s]
    lines = [
        f"held-out: {held['calibration']['description']}",
        "",
        "| mask | " + " | ".join(names) + (" | paper E[C] (s/token) |" if "e2e" in s else " |"),
        "|---|" + "---|" * len(names) + ("---|" if "e2e" in s else ""),
    ]
    for label, row in (("searched", s), ("evenly spaced", e)):
        cells = [f"{row[n]:.4f}" for n in names]
        if "e2e" in row:
            cells.append(f"{row['e2e_detail']['paper_expected_cost_s']:.4f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
