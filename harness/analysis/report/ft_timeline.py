"""The fault-tolerance timeline, one per run that had failures (`--set fault_tolerance=torchft`), from the tables'
replica spans (harness/analysis/report/replica_spans.py), in the style of every figure:

    ft-timeline-<run id>  per replica, against seconds from the training's start: up (training, or waiting for the
                          others), down (killed, not restarted yet), healing (restarted: start-up, the wait for the
                          others' next round, the fetch)
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from harness.analysis.report.figure_style import GRID_ALPHA
from harness.analysis.report.replica_spans import DOWN, HEALING, UP
from harness.analysis.report.tables import RunTables

COLORS = {UP: "#55a868", DOWN: "#c44e52", HEALING: "#dd8452"}
LABELS = {UP: "up (training, or waiting for the others)", DOWN: "down (killed)", HEALING: "healing (restarted)"}


def timeline_figures(tables: RunTables) -> list[tuple[str, Figure]]:
    """(name, figure) for every run in `tables` with a replica that was ever down."""
    spans = tables.replica_spans
    if spans.empty:
        return []
    failed = spans[spans["state"] != UP]["run_id"].unique()
    return [(f"ft-timeline-{run_id}", timeline_figure(run_id, spans[spans["run_id"] == run_id])) for run_id in failed]


def timeline_figure(run_id: str, spans: pd.DataFrame) -> Figure:
    ranks = sorted(spans["rank"].unique())
    fig = Figure(figsize=(10, 1.2 + 0.6 * len(ranks)))
    ax = fig.add_subplot()
    for row, rank in enumerate(ranks):
        for state, color in COLORS.items():
            mine = spans[(spans["rank"] == rank) & (spans["state"] == state)]
            bars = list(zip(mine["start_s"], mine["end_s"] - mine["start_s"], strict=True))
            ax.broken_barh(bars, (row - 0.35, 0.7), color=color, label=LABELS[state] if row == 0 else None)
    ax.set_yticks(range(len(ranks)), [f"replica {rank}" for rank in ranks])
    ax.set_xlabel("seconds from the training's start")
    ax.set_title(f"{run_id}: each replica up, down and healing")
    ax.grid(axis="x", alpha=GRID_ALPHA)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig
