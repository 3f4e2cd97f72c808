"""The comparison's figures (harness/analysis/compare.py), PNG and SVG, one per profile and how:

    compare-<profile>-<how>   validation loss vs tokens trained and vs training wall-clock (evaluation excluded), one
                              line per method: the mean over its seeds, with a ± 1 std band where n >= 2; the target
                              loss as a dashed line. For a composed profile the wall-clock is the composed estimate
                              (harness/analysis/composition.py), and the title and every legend entry say so.

A method keeps its colour across figures. Built as matplotlib Figure objects without pyplot (as
harness/analysis/plots.py), so they render with the Agg canvas whatever backend the machine is configured for.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from harness.analysis.compare import COMPOSED, Comparison

FORMATS = ("png", "svg")


def _colors(variants: list[str]) -> dict[str, str]:
    palette = matplotlib.colormaps["tab10"].colors
    return {v: matplotlib.colors.to_hex(palette[i % len(palette)]) for i, v in enumerate(variants)}


def _band(ax, x: pd.Series, mean: pd.Series, std: pd.Series, color: str) -> None:
    ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.15, linewidth=0)


def loss_figure(curves: pd.DataFrame, profile: str, how: str, target: float, colors: dict[str, str]) -> Figure:
    """Validation loss vs tokens and vs wall-clock for one profile and how (module doc)."""
    fig = Figure(figsize=(12, 4.8))
    by_tokens, by_time = fig.subplots(1, 2, sharey=True)
    finals = curves.groupby("variant")["elapsed_s"].max()
    # AllReduce on a slow link takes hundreds of times longer than the rest: a linear axis would hide them.
    log_time = bool(len(finals)) and finals.min() > 0 and finals.max() / finals.min() > 20
    for variant, mine in curves.groupby("variant", sort=False):
        per_step = mine.groupby("step")[["tokens", "val_loss", "elapsed_s"]]
        mean, std = per_step.mean(), per_step.std().fillna(0.0)
        # The evaluation before training (at 0 s) has no place on a log axis.
        timed = mean["elapsed_s"] > 0 if log_time else mean["elapsed_s"].notna()
        n = mine["seed"].nunique()
        label = f"{variant} ({how}, n={n}" + (", band ± 1 std)" if n >= 2 else ", no band)")
        color = colors[variant]
        by_tokens.plot(mean["tokens"], mean["val_loss"], "o-", ms=3, color=color, label=label)
        by_time.plot(mean["elapsed_s"][timed], mean["val_loss"][timed], "o-", ms=3, color=color, label=label)
        if n >= 2:
            _band(by_tokens, mean["tokens"], mean["val_loss"], std["val_loss"], color)
            _band(by_time, mean["elapsed_s"][timed], mean["val_loss"][timed], std["val_loss"][timed], color)
    for ax in (by_tokens, by_time):
        ax.axhline(target, color="black", linestyle="--", linewidth=0.8, label=f"target {target:.3f}")
        ax.grid(alpha=0.3)
    by_tokens.set_xlabel("tokens trained (all clusters)")
    by_tokens.set_ylabel("validation loss (nats per token)")
    by_tokens.xaxis.set_major_formatter(EngFormatter(sep=""))
    clock = "composed estimate: trajectory x trace" if how == COMPOSED else "measured"
    by_time.set_xlabel(f"training wall-clock (s{', log scale' if log_time else ''}, evaluation excluded; {clock})")
    if log_time:
        by_time.set_xscale("log")
    by_tokens.legend(title="method (how, n seeds)", fontsize=9)
    title = f"Validation loss on {profile} ({how}" + (": an estimate, not a measurement)" if how == COMPOSED else ")")
    fig.suptitle(f"{title}\nmean over each method's seeds; band ± 1 std where n ≥ 2")
    fig.tight_layout()
    return fig


def write_figures(comparison: Comparison, out: Path) -> list[Path]:
    """One loss figure per profile and how (module doc), into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    curves = comparison.curves
    colors = _colors(list(dict.fromkeys(comparison.rows["variant"])))
    paths = []
    for (profile, how), mine in curves.groupby(["profile", "how"], sort=False):
        fig = loss_figure(mine, profile, how, comparison.target_loss, colors)
        for fmt in FORMATS:
            path = out / f"compare-{profile}-{how}.{fmt}"
            fig.savefig(path, dpi=150, bbox_inches="tight")
            paths.append(path)
    return paths
