"""The replayed-link figure, one per run that replayed a profile's trace (harness/run/linktrace.py), from its
link_trace.jsonl alone (harness/analysis/report/tables.py's link_trace table), in the style of every figure
(harness/analysis/report/figure_style.py):

    link-trace-<run id>  top: per cluster, the rate its uplink achieved (centred over WINDOW_S), the busy windows
                         link_trace_error is computed on (thick segments at the rate achieved over each), and the
                         trace's rate (black steps); bottom, for a trace with a delay column: the one-way delay the
                         delay line replayed (the trace's, not measured during the run)
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from harness.analysis.report.figure_style import GRID_ALPHA, palette
from harness.analysis.report.tables import RunTables
from harness.run.linktrace import WINDOW_S, LinkSample, busy_spans


def trace_figures(tables: RunTables) -> list[tuple[str, Figure]]:
    """(name, figure) for every run in `tables` that replayed a trace."""
    if tables.link_trace.empty:
        return []
    figures = []
    for run_id, samples in tables.link_trace.groupby("run_id", sort=True):
        run = tables.runs[tables.runs["run_id"] == run_id].iloc[0]
        figures.append((f"link-trace-{run_id}", trace_figure(run, samples)))
    return figures


def trace_figure(run: pd.Series, samples: pd.DataFrame) -> Figure:
    """Achieved against trace rate over time for one run (module doc); `samples` are its link_trace rows."""
    delays = samples["trace_delay_ms"].notna().any() if "trace_delay_ms" in samples else False
    fig = Figure(figsize=(14, 6.5 if delays else 4.8))
    axes = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1)) if delays else [fig.subplots()]
    rate_ax = axes[0]
    colors = palette()
    for cluster, mine in samples.sort_values("t_s").groupby("cluster"):
        color = colors[int(cluster) % len(colors)]
        t, sent = mine["t_s"].to_numpy(float), mine["tx_bytes"].to_numpy(float)
        half = WINDOW_S / 2
        inside = (t >= t[0] + half) & (t <= t[-1] - half)
        centred = (np.interp(t + half, t, sent) - np.interp(t - half, t, sent)) * 8 / WINDOW_S
        rate_ax.plot(t[inside], centred[inside], color=color, linewidth=0.8, alpha=0.7,
                     label=f"cluster {cluster}'s uplink, achieved (over {WINDOW_S:g} s)")  # fmt: skip
        rows = mine.itertuples(index=False)
        spans = busy_spans([LinkSample(r.t_s, r.tx_bytes, r.backlog_bytes) for r in rows])
        for i, (first, last) in enumerate(spans):
            achieved = (last.tx_bytes - first.tx_bytes) * 8 / (last.t_s - first.t_s)
            rate_ax.plot([first.t_s, last.t_s], [achieved, achieved], color=color, linewidth=4, solid_capstyle="butt",
                         label=f"cluster {cluster}: busy windows (n={len(spans)})" if i == 0 else None)  # fmt: skip
    trace = samples[samples["cluster"] == samples["cluster"].min()].sort_values("t_s")
    if trace["trace_rate_bps"].notna().any():
        rate_ax.step(trace["t_s"], trace["trace_rate_bps"], where="post", color="black", linewidth=1.5,
                     label="trace rate")  # fmt: skip
    rate_ax.set_ylabel("rate (bit/s)")
    rate_ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    rate_ax.set_ylim(bottom=0)
    rate_ax.grid(alpha=GRID_ALPHA)
    rate_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if delays:
        axes[1].step(trace["t_s"], trace["trace_delay_ms"], where="post", color="black", linewidth=1.2)
        axes[1].set_ylabel("one-way delay (ms)\nthe trace's, replayed")
        axes[1].grid(alpha=GRID_ALPHA)
    axes[-1].set_xlabel("seconds since training started (t0)")
    error = run.get("link_trace_error")
    measured = (
        f"link_trace_error {error:.3f} over {int(run['link_trace_windows'])} busy windows"
        if error is not None and not pd.isna(error)
        else "no busy window (the link never stayed backlogged for a window)"
    )
    fig.suptitle(
        f"Replayed link: achieved vs trace rate · {measured}\nrun {run['run_id']} · {run['method']} on "
        f"{run['profile']} · model {run['model']} · {run['clusters']} clusters",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
