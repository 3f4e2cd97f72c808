"""The speed-up over AllReduce as a function of the target loss: what the choice of one target hides.

A single target can favour a method (an early, loose target rewards fast-but-sloppy methods; a tight one can be out
of reach). So beside the table's one number, every comparison gets the curve: for targets evenly spaced from
AllReduce's validation loss at a quarter of its tokens (its mean over seeds, interpolated between evaluations) down
to its final loss, each variant's time to reach the target over AllReduce's, paired per seed as the table's speed-up
is (harness/analysis/report/aggregates.py `ratio`). A variant that reaches a target on no seed has no point there;
`reached` says on how many seeds it did. Read from the comparison's loss curves: nothing is rerun.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from harness.analysis.plan import BASELINE, profile_name
from harness.analysis.report.aggregates import ratio, reach, spread_columns
from harness.analysis.report.figure_style import GRID_ALPHA, save, variant_colors
from harness.analysis.report.time_to_target import SPLIT, Comparison, loss_at_tokens

POINTS = 12  # targets per profile: enough to see the curve's shape, few enough to read in the CSV


def target_grid(allreduce_curves: pd.DataFrame, points: int = POINTS) -> np.ndarray:
    """From AllReduce's loss at a quarter of its tokens down to its final loss, both means over its seeds."""
    quarter, final = [], []
    for _, curve in allreduce_curves.groupby("seed"):
        curve = curve.sort_values("tokens")
        quarter.append(loss_at_tokens(curve, float(curve["tokens"].max()) / 4))
        final.append(float(curve["val_loss"].iloc[-1]))
    return np.linspace(float(np.mean(quarter)), float(np.mean(final)), points)


def _speeds(curves: pd.DataFrame, target: float) -> pd.DataFrame:
    """Per seed: 1 / time to reach `target` (NaN where the seed never does)."""
    rows = []
    for seed, curve in curves.groupby("seed"):
        _, seconds = reach(curve.sort_values("tokens"), target)
        rows.append({"seed": seed, "speed": 1 / seconds if seconds > 0 else np.nan})
    return pd.DataFrame(rows, columns=["seed", "speed"])


def speedup_curve(comparison: Comparison, points: int = POINTS) -> pd.DataFrame:
    """One row per (profile, how, variant, target): the speed-up over AllReduce to that target (module doc). `panel`
    is the row's how, or "split" on a link where some methods are measured and the others composed (AllReduce among
    them): one figure holds both."""
    rows = []
    split = {profile_name(p) for p in comparison.spec.composed_methods}
    panels = comparison.curves["how"].where(~comparison.curves["profile"].isin(split), SPLIT)
    for (profile, panel), curves in comparison.curves.groupby(["profile", panels], sort=False):
        allreduce = curves[curves["method"] == BASELINE]
        if allreduce.empty:
            continue
        for target in target_grid(allreduce, points):
            reference = _speeds(allreduce, target)
            for variant, mine in curves.groupby("variant", sort=False):
                speeds = _speeds(mine, target)
                value, pairing = ratio(speeds.dropna(), reference, "speed")
                rows.append(
                    {
                        "profile": profile,
                        "how": mine["how"].iloc[0],
                        "panel": panel,
                        "variant": variant,
                        "method": mine["method"].iloc[0],
                        "target_loss": float(target),
                        "reached": int(speeds["speed"].notna().sum()),
                        "runs": len(speeds),
                        **spread_columns("speedup", value),
                        "speedup_pairing": pairing,
                    }
                )
    return pd.DataFrame(rows)


def speedup_curve_figures(curve: pd.DataFrame, target_loss: float, out: Path) -> list[Path]:
    """One figure per profile and how: speed-up (log) against the target, the table's target marked."""
    paths: list[Path] = []
    if curve.empty:
        return paths
    colors = variant_colors(list(dict.fromkeys(curve["variant"])))
    for (profile, how), mine in curve.groupby(["profile", "panel"], sort=False):
        fig = Figure(figsize=(8, 4.5))
        ax = fig.subplots()
        for variant, points in mine.groupby("variant", sort=False):
            reached = points[points["speedup"].notna()]
            ax.plot(reached["target_loss"], reached["speedup"], marker="o", color=colors[variant], label=variant)
        ax.axvline(target_loss, color="black", linestyle=":", linewidth=1, label=f"table's target {target_loss:.3f}")
        ax.set_yscale("log")
        ax.invert_xaxis()  # tighter targets to the right
        ax.set_xlabel("target validation loss (AllReduce's loss at 1/4 of its tokens -> its final loss)")
        ax.set_ylabel(f"time to target: {BASELINE} / method")
        ax.set_title(f"Speed-up over {BASELINE} by target, {profile} ({how})")
        ax.grid(alpha=GRID_ALPHA)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        fig.tight_layout()
        paths += save(fig, out, f"speedup-vs-target-{profile}-{how}")
    return paths
