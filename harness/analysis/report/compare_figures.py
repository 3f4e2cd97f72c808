"""`harness compare`'s figures (harness/analysis/report/time_to_target.py's Comparison), PNG and SVG, one per profile
and how:

    compare-<profile>-<how>   validation loss vs tokens trained and vs training wall-clock (evaluation excluded), one
                              line per method: the mean over its seeds, with a ± 1 std band where n >= 2; the
                              control (local) dashed; the target loss dotted, labelled with how it was set; the
                              legend below the axes; wall-clock on a log axis where methods end 10x apart (figure_
                              style.LOG_TIME_RATIO). For a composed profile the wall-clock is the composed estimate
                              (harness/analysis/projection/composition.py), and the title and every legend entry say
                              so; on a --regime link split between the two (compare-<profile>-split), each line.

A method keeps its colour across figures; the style every figure shares: harness/analysis/report/figure_style.py.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from harness.analysis.plan import CEILING, profile_name
from harness.analysis.report.figure_style import (
    GRID_ALPHA,
    LOSS_FIGSIZE,
    band,
    log_time,
    loss_axes,
    save,
    variant_colors,
)
from harness.analysis.report.time_to_target import COMPOSED, MEASURED, SPLIT, Comparison


def target_loss_figure(
    curves: pd.DataFrame, profile: str, how: str, target: float, colors: dict[str, str], target_label: str = ""
) -> Figure:
    """Validation loss vs tokens and vs wall-clock on one profile, measured or composed, against the target loss
    (module doc)."""
    fig = Figure(figsize=LOSS_FIGSIZE, layout="constrained")
    by_tokens, by_time = loss_axes(fig)
    # AllReduce on a slow link takes hundreds of times longer than the rest: a linear axis would hide them.
    logarithmic = log_time(curves.groupby("variant")["elapsed_s"].max())
    for variant, mine in curves.groupby("variant", sort=False):
        per_step = mine.groupby("step")[["tokens", "val_loss", "elapsed_s"]]
        mean, std = per_step.mean(), per_step.std().fillna(0.0)
        # The evaluation before training (at 0 s) has no place on a log axis.
        timed = mean["elapsed_s"] > 0 if logarithmic else mean["elapsed_s"].notna()
        n = mine["seed"].nunique()
        label = f"{variant} ({mine['how'].iloc[0]}, n={n}" + (", band ± 1 std)" if n >= 2 else ", no band)")
        control = mine["method"].iloc[0] == CEILING
        label += ": the control, no communication" if control else ""
        # The control is drawn apart (dashed): one replica that never synchronized, not a trained global model.
        color, style = colors[variant], "o--" if control else "o-"
        by_tokens.plot(mean["tokens"], mean["val_loss"], style, ms=3, color=color, label=label)
        by_time.plot(mean["elapsed_s"][timed], mean["val_loss"][timed], style, ms=3, color=color, label=label)
        if n >= 2:
            band(by_tokens, mean["tokens"], mean["val_loss"], std["val_loss"], color)
            band(by_time, mean["elapsed_s"][timed], mean["val_loss"][timed], std["val_loss"][timed], color)
    source = f" ({target_label})" if target_label else ""
    for ax in (by_tokens, by_time):
        ax.axhline(target, color="black", linestyle=":", linewidth=1.0, label=f"target {target:.3f}{source}")
        ax.grid(alpha=GRID_ALPHA)
    clock = {COMPOSED: "composed estimate: trajectory x trace", MEASURED: "measured"}.get(
        how, "composed where labelled"
    )
    by_time.set_xlabel(f"training wall-clock (s{', log scale' if logarithmic else ''}, evaluation excluded; {clock})")
    if logarithmic:
        by_time.set_xscale("log")
    # Outside the axes, below them: over the curves it hid the methods that finish early.
    handles, labels = by_tokens.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=9, title="method (how, n seeds)")
    title = f"Validation loss on {profile} ({how}" + (": an estimate, not a measurement)" if how == COMPOSED else ")")
    if how not in (COMPOSED, MEASURED):
        title = f"Validation loss on {profile} (measured; composed estimates where labelled)"
    fig.suptitle(f"{title}\nmean over each method's seeds; band ± 1 std where n ≥ 2")
    return fig


def write_figures(comparison: Comparison, out: Path) -> list[Path]:
    """One loss figure per profile and how (module doc), into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    curves = comparison.curves
    colors = variant_colors(list(dict.fromkeys(comparison.rows["variant"])))
    split = {profile_name(p) for p in comparison.spec.composed_methods}
    paths = []
    for (profile, how), mine in curves.groupby(["profile", "how"], sort=False):
        if profile not in split:
            fig = target_loss_figure(mine, profile, how, comparison.target_loss, colors, comparison.target_label)
            paths += save(fig, out, f"compare-{profile}-{how}")
    # A link split between measured and composed methods: one figure, each line labelled with how it was got.
    for profile in split:
        mine = curves[curves["profile"] == profile]
        fig = target_loss_figure(mine, profile, SPLIT, comparison.target_loss, colors, comparison.target_label)
        paths += save(fig, out, f"compare-{profile}-{SPLIT}")
    return paths
