"""PNG plots of a benchmark (matplotlib, Agg backend): one per plot group of the suite.

* bar:     speedup vs `ar` per method (median, whiskers min-max over passes) and rejection rate;
* line:    speedup vs `ar` and the escalation share against a swept parameter (one line per mode);
* heatmap: escalation share (the paper's "reliance on q", Figure 6) and speedup over (alpha1, alpha2).
"""

from __future__ import annotations

from pathlib import Path

from viasd.errors import require


def _setup():
    matplotlib = require("matplotlib", "bench")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _speedup(s: dict) -> tuple[float | None, float, float]:
    sp = s.get("speedup_vs_ar")
    if not sp:
        return None, 0.0, 0.0
    return sp["median"], sp["median"] - sp["min"], sp["max"] - sp["median"]


def _escalated(s: dict) -> float | None:
    tf = s.get("tier_fractions")
    return tf["escalated_to_full"] if tf else None


def _param(results: dict, label: str, name: str):
    m = next(m for m in results["methods"] if m["label"] == label)
    if name == "mode":
        return m["mode"]
    if name == "skip_ratio":
        mi = m.get("mask_info") or {}
        return mi.get("ratio", m.get("skip_ratio"))
    return m["params"].get(name)


def plot_bar(plt, results, summary, group, path: Path) -> None:
    labels = [lbl for lbl in group["methods"] if lbl in summary and "tokens" in summary[lbl]]
    sp = [_speedup(summary[lbl]) for lbl in labels]
    rej = [summary[lbl].get("rejection_rate") for lbl in labels]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(labels) + 4), 4.2))
    x = range(len(labels))
    a1.bar(x, [s[0] or 0 for s in sp], yerr=[[s[1] for s in sp], [s[2] for s in sp]], color="#4C72B0", capsize=3)
    a1.axhline(1.0, color="grey", lw=0.8, ls="--")
    a1.set_ylabel("tokens/s vs ar (x)")
    a1.set_title("speedup over ar (median, min-max)")
    a2.bar(x, [r or 0 for r in rej], color="#DD8452")
    for i, (sp_i, r) in enumerate(zip(sp, rej)):
        if sp_i[0] is not None:
            a1.text(i, sp_i[0] + sp_i[2], f"{sp_i[0]:.2f}", ha="center", va="bottom", fontsize=8)
        a2.text(i, r or 0, "n/a" if r is None else f"{r:.2f}", ha="center", va="bottom", fontsize=8)
    a2.set_ylabel("rejection rate")
    a2.set_ylim(0, max([0.05] + [1.25 * r for r in rej if r is not None]))
    a2.set_title("rejection rate (draft tokens replaced / decided)")
    for ax in (a1, a2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    fig.suptitle(group["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_line(plt, results, summary, group, path: Path) -> None:
    series: dict[str, list[tuple]] = {}
    for lbl in group["methods"]:
        s = summary.get(lbl)
        if not s or "tokens" not in s:
            continue
        key = str(_param(results, lbl, group["series"])) if group.get("series") else "via"
        x = _param(results, lbl, group["x"])
        series.setdefault(key, []).append((x, *_speedup(s), _escalated(s)))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, pts in series.items():
        pts.sort(key=lambda p: p[0])
        xs = [p[0] for p in pts]
        a1.errorbar(
            xs, [p[1] for p in pts], yerr=[[p[2] for p in pts], [p[3] for p in pts]], marker="o", capsize=3, label=key
        )
        esc = [(p[0], p[4]) for p in pts if p[4] is not None]
        if esc:
            a2.plot([e[0] for e in esc], [e[1] for e in esc], marker="o", label=key)
    a1.axhline(1.0, color="grey", lw=0.8, ls="--")
    a1.set_xlabel(group["x"])
    a1.set_ylabel("tokens/s vs ar (x)")
    a1.set_title("speedup over ar")
    a2.set_xlabel(group["x"])
    a2.set_ylabel("share of cycles escalated to q")
    a2.set_title("reliance on the full verifier")
    for ax in (a1, a2):
        if len(series) > 1 or group.get("series"):
            ax.legend()
    fig.suptitle(group["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heatmap(plt, results, summary, group, path: Path) -> None:
    cells = {}
    for lbl in group["methods"]:
        s = summary.get(lbl)
        if not s or "tokens" not in s:
            continue
        cells[(_param(results, lbl, group["y"]), _param(results, lbl, group["x"]))] = (_speedup(s)[0], _escalated(s))
    ys = sorted({k[0] for k in cells})
    xs = sorted({k[1] for k in cells})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, idx, title, cmap in (
        (axes[0], 1, "share of cycles escalated to q", "Blues"),
        (axes[1], 0, "speedup over ar (x)", "Greens"),
    ):
        grid = [[cells.get((y, x), (None, None))[idx] for x in xs] for y in ys]
        vals = [[float("nan") if v is None else v for v in row] for row in grid]
        im = ax.imshow(vals, cmap=cmap, origin="lower", aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v is not None:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_yticks(range(len(ys)))
        ax.set_yticklabels([str(y) for y in ys])
        ax.set_xlabel(group["x"])
        ax.set_ylabel(group["y"])
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
    fig.suptitle(group["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_plots(results: dict, summary: dict, out: Path) -> list[str]:
    """Write one PNG per plot group into `out`; returns the file names."""
    plt = _setup()
    written = []
    for group in results.get("groups", []):
        path = Path(out) / f"{group['name']}.png"
        {"bar": plot_bar, "line": plot_line, "heatmap": plot_heatmap}[group["plot"]](plt, results, summary, group, path)
        written.append(path.name)
    return written
