"""`harness compare`'s figures (harness/analysis/report/time_to_target.py's Comparison), PNG and SVG, one per profile
and how:

    compare-<profile>-<how>   validation loss vs tokens trained and vs training wall-clock (evaluation excluded), one
                              line per method: the mean over its seeds, with a ± 1 std band where n >= 2; the target
                              loss as a dashed line. For a composed profile the wall-clock is the composed estimate
                              (harness/analysis/projection/composition.py), and the title and every legend entry say so.

A method keeps its colour across figures; the style every figure shares: harness/analysis/report/figure_style.py.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from harness.analysis.report.figure_style import (
    GRID_ALPHA,
    LOSS_FIGSIZE,
    band,
    log_time,
    loss_axes,
    save,
    variant_colors,
)
from harness.analysis.report.time_to_target import COMPOSED, Comparison


def target_loss_figure(curves: pd.DataFrame, profile: str, how: str, target: float, colors: dict[str, str]) -> Figure:
    """Validation loss vs tokens and vs wall-clock on one profile, measured or composed, against the target loss
    (module doc)."""
    fig = Figure(figsize=LOSS_FIGSIZE)
    by_tokens, by_time = loss_axes(fig)
    # AllReduce on a slow link takes hundreds of times longer than the rest: a linear axis would hide them.
    logarithmic = log_time(curves.groupby("variant")["elapsed_s"].max())
    for variant, mine in curves.groupby("variant", sort=False):
        per_step = mine.groupby("step")[["tokens", "val_loss", "elapsed_s"]]
        mean, std = per_step.mean(), per_step.std().fillna(0.0)
        # The evaluation before training (at 0 s) has no place on a log axis.
        timed = mean["elapsed_s"] > 0 if logarithmic else mean["elapsed_s"].notna()
        n = mine["seed"].nunique()
        label = f"{variant} ({how}, n={n}" + (", band ± 1 std)" if n >= 2 else ", no band)")
        color = colors[variant]
        by_tokens.plot(mean["tokens"], mean["val_loss"], "o-", ms=3, color=color, label=label)
        by_time.plot(mean["elapsed_s"][timed], mean["val_loss"][timed], "o-", ms=3, color=color, label=label)
        if n >= 2:
            band(by_tokens, mean["tokens"], mean["val_loss"], std["val_loss"], color)
            band(by_time, mean["elapsed_s"][timed], mean["val_loss"][timed], std["val_loss"][timed], color)
    for ax in (by_tokens, by_time):
        ax.axhline(target, color="black", linestyle="--", linewidth=0.8, label=f"target {target:.3f}")
        ax.grid(alpha=GRID_ALPHA)
    clock = "composed estimate: trajectory x trace" if how == COMPOSED else "measured"
    by_time.set_xlabel(f"training wall-clock (s{', log scale' if logarithmic else ''}, evaluation excluded; {clock})")
    if logarithmic:
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
    colors = variant_colors(list(dict.fromkeys(comparison.rows["variant"])))
    paths = []
    for (profile, how), mine in curves.groupby(["profile", "how"], sort=False):
        fig = target_loss_figure(mine, profile, how, comparison.target_loss, colors)
        paths += save(fig, out, f"compare-{profile}-{how}")
    return paths
