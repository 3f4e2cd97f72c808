"""A comparison's headline (OUT/headline.md, written by `harness compare`): the compact tables README prints, so
README's figures are the study's own output rather than a copy made by hand (tests/test_readme.py holds README's
block equal to the committed file).

One table per link: each method's time to the target, its speed-up over AllReduce, applied tokens/s, wire bytes per
token, final validation loss and loss gap at equal tokens, each with its interval, and how the time was got. Where a
method ran both ways on a link (to check the composition), its measured row stands in the table and the check is one
line below it: composed / measured per method, paired per seed. compare.md keeps every row.
"""

from __future__ import annotations

import pandas as pd

from harness.analysis.plan import BASELINE, CEILING
from harness.analysis.report.compare import (
    control_note,
    half_figure,
    how_label,
    ratio_cell,
    regime_note,
    target_line,
    time_cell,
    variant_label,
)
from harness.analysis.report.markdown import blank, change, count, half_percent, markdown_table, spread_cell, times
from harness.analysis.report.time_to_target import MEASURED, Comparison

HEADER = [
    "method", "how", "time to target", "speed-up vs allreduce", "applied tokens/s", "wire B/token", "final val loss",
    "loss vs allreduce (equal tokens)",
]  # fmt: skip


def _row(r: pd.Series) -> list[str]:
    return [
        variant_label(r),
        how_label(r),
        time_cell(r),
        ratio_cell(r, "speedup", times, half_figure),
        spread_cell(r, "tokens_per_s", count, count),
        f"{r['wire_bytes_per_token']:,.1f}",
        spread_cell(r, "final_val_loss", lambda v: f"{v:.3f}", lambda v: f"{v:.3f}"),
        ratio_cell(r, "loss_vs_allreduce", change, half_percent),
    ]


def headline_rows(group: pd.DataFrame) -> pd.DataFrame:
    """A link's rows, one per method: measured where the method ran end to end there, else composed; AllReduce, the
    reference, first and the control last, however each was got."""
    measured = set(group.loc[group["how"] == MEASURED, "variant"])
    kept = group[(group["how"] == MEASURED) | ~group["variant"].isin(measured)]
    place = kept["method"].map({BASELINE: 0, CEILING: 2}).fillna(1)
    return kept.iloc[place.argsort(kind="stable")]


def _composition_line(comparison: Comparison, profile: str) -> str | None:
    """The composition checked on this link: composed / measured time to target per method (None: not checked)."""
    validation = comparison.validation
    if validation.empty:
        return None
    checked = validation[(validation["profile"] == profile) & ~validation["composed_over_measured"].map(blank)]
    if checked.empty:
        return None
    ratios = ", ".join(
        f"{r['variant']} {ratio_cell(r, 'composed_over_measured', lambda v: f'{v:.3f}x', half_figure)}"
        for _, r in checked.iterrows()
    )
    return f"The composition checked here (composed / measured time to target, paired per seed): {ratios}."


def headline_markdown(comparison: Comparison) -> str:
    """The headline tables with the notes a reader needs beside them (the target, the control, achieved R)."""
    parts = [target_line(comparison) + "\n"]
    for profile, group in comparison.rows.groupby("profile", sort=False):
        rows = headline_rows(group)
        runs = ", ".join(sorted({str(n) for n in rows["runs"]}))
        text = f"**{profile}** (n = {runs} seeds a row)\n\n" + markdown_table(
            HEADER, [_row(r) for _, r in rows.iterrows()], 2
        )
        notes = [
            note for note in (control_note(group), regime_note(group), _composition_line(comparison, profile)) if note
        ]
        parts.append(text + ("\n\n" + " ".join(notes) if notes else "") + "\n")
    return "\n".join(parts)
