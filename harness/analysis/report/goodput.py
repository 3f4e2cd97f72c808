"""Failures that heal, reported: for runs made with `--set fault_tolerance=torchft`, each method's goodput at each
failure rate (`--set mtbf_s`) or set of `--fault kill`s, beside the same method's runs without failures.

Goodput is the tokens in the final model over the run's whole wall time (summary.json's `goodput_tokens_per_s`);
its share of the failure-free runs' is paired by seed (runs/aggregates.py's `ratio`). A heal's figures are each run's
mean over its heals: seconds from restart to healed, and bytes received over the state's serialized size.
"""

from __future__ import annotations

import pandas as pd

from harness.analysis.report.aggregates import in_sample_seeds, ratio, spread
from harness.analysis.report.markdown import IN_SAMPLE_NOTE, in_sample_label, markdown_table, with_spread

NO_FAILURES = "none"


def goodput_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (profile, method, steps, failure plan: the random failures' rate, --fault kills, or none) of the
    fault-tolerant runs that ended ok."""
    ft = runs[(runs["status"] == "ok") & runs["fault_tolerance"].fillna("none").ne("none")].copy()
    if ft.empty:
        return pd.DataFrame()
    rows = []
    for (profile, method, steps), group in ft.groupby(["profile", "method", "steps"], sort=True):
        reference = group[group["failure_plan"] == NO_FAILURES]
        plans = sorted(group.groupby("failure_plan"), key=lambda item: (item[0] != NO_FAILURES, item[0]))
        for plan, runs_at in plans:
            share, how = ratio(runs_at, reference, "goodput_tokens_per_s") if plan != NO_FAILURES else (spread([]), "")
            rows.append(
                {
                    "profile": profile, "method": method, "steps": steps, "failures_by": plan, "runs": len(runs_at),
                    "in_sample_seeds": in_sample_seeds(runs_at),
                    "failures": spread(runs_at["failures"]), "goodput": spread(runs_at["goodput_tokens_per_s"]),
                    "share": share, "share_how": how, "heal_s": spread(runs_at["heal_s"]),
                    "heal_bytes_ratio": spread(runs_at["heal_bytes_ratio"]),
                    "applied": spread(runs_at["ft_applied_fraction"]), "val_loss": spread(runs_at["final_val_loss"]),
                }
            )  # fmt: skip
    return pd.DataFrame(rows)


def _cell(value, fmt) -> str:
    return with_spread(value.mean, value.n, value.low, value.high, fmt, fmt)


def goodput_markdown(table: pd.DataFrame) -> str:
    """The table as markdown, one section per profile and run length; empty when there is nothing to say."""
    if table.empty:
        return ""
    header = [
        "method", "failures", "runs", "failures / run", "goodput tokens/s", "of no failures (paired)", "heal s",
        "heal bytes / state", "applied", "final val loss",
    ]  # fmt: skip
    parts = ["## Failures that heal (fault_tolerance=torchft)\n"]
    for (profile, steps), group in table.groupby(["profile", "steps"], sort=True):
        rows = [
            [
                in_sample_label(r["method"], r["in_sample_seeds"]), r["failures_by"], str(r["runs"]),
                _cell(r["failures"], lambda v: f"{v:.1f}"),
                _cell(r["goodput"], lambda v: f"{v:,.0f}"), _cell(r["share"], lambda v: f"{v:.1%}"),
                _cell(r["heal_s"], lambda v: f"{v:.1f}"), _cell(r["heal_bytes_ratio"], lambda v: f"{v:.3f}"),
                _cell(r["applied"], lambda v: f"{v:.1%}"), _cell(r["val_loss"], lambda v: f"{v:.4f}"),
            ]
            for _, r in group.iterrows()
        ]  # fmt: skip
        parts.append(f"### {profile} · {steps} steps\n\n" + markdown_table(header, rows, text_columns=2) + "\n")
    if table["in_sample_seeds"].astype(bool).any():
        parts.append(IN_SAMPLE_NOTE + "\n")
    parts.append(
        "Goodput: tokens in the final model over the whole wall time; of no failures: over the same method's runs "
        "without failures, seed by seed (± the 95% t interval, n >= 3). Heal s: restart to healed (start-up, the wait "
        "for the others' next round, the fetch); heal bytes / state: what the replica's uplink received during the "
        "fetch over the state's serialized size. Applied: the share of every replica's steps in the final model.\n"
    )
    return "\n".join(parts)
