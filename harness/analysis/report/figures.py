"""`harness plot`: the comparison figures, PNG and SVG, one set per comparable group of runs
(harness/analysis/report/tables.py's GROUP_KEYS).

    loss-<group>        validation loss vs tokens and vs training wall-clock, per method: the mean over its n runs,
                        with a ± 1 std band only where n >= 2 (each legend entry says n)
    throughput-<group>  applied tokens/s per method on a log axis, each bar labelled with its ratio to AllReduce and
                        n; error bars as the report's: the 95% interval of the mean (n >= 3), the range (n = 2)
    breakdown-<group>   where a training step's time goes: compute, communication the training thread waited for
                        (blocked), and communication that ran during compute (overlapped, hidden)
    monitor-<group>     DiLoCoX's per-synchronization monitor (trainers/methods/dilocox.py), only for a group with a run
                        that logs it, and only its variants that do: against the synchronization round t,
                        cosine(Delta_t, Delta_{t-1}); ||outer step|| / ||Delta_t||; the estimated rank and the chosen
                        r_t, with H_t on a right axis; the measured compression error^2 beside omega^2 (paper) and
                        omega^2 (corrected), dashed. Rank 0's events (cluster 0, stage 0), so each sync counts once; a
                        variant's line is the mean over its n runs per round, with a ± 1 std band over rounds that two
                        runs or more reach
    sites-<group>       per site and method: the time the site's replica waited on the link and the bytes its
                        uplink carried, only for groups with sites of different rates or more than two sites (the
                        report's per-site table), bars as the report's intervals
    rtt-<model>-<rate>  applied tokens/s per method against the link's round-trip time (the profile's), across the
                        profiles of one rate whose runs share model, cluster shape and steps; drawn where they span two
                        RTTs or more (a latency sweep), with the report's intervals
    link-trace-<run id> for every run that replayed a profile's trace: the rate achieved against the trace's
                        (harness/analysis/report/trace_figure.py)
    ft-timeline-<run id> for every fault-tolerant run with failures: per replica, training, down and healing
                        (harness/analysis/report/ft_timeline.py)

A group is named <profile>-<model>, with the cluster shape and step count appended when several groups share both.
A method keeps its colour in every figure; the style every figure shares: harness/analysis/report/figure_style.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter, LogLocator, MaxNLocator, NullFormatter

from harness.analysis.plan import BASELINE, CEILING
from harness.analysis.report.aggregates import comparison, site_comparison
from harness.analysis.report.figure_style import (
    BAND_ALPHA,
    GRID_ALPHA,
    LOSS_FIGSIZE,
    band,
    log_time,
    loss_axes,
    save,
    variant_colors,
)
from harness.analysis.report.files import output_folder
from harness.analysis.report.ft_timeline import timeline_figures
from harness.analysis.report.tables import GROUP_KEYS, RunTables, eval_curve, in_group
from harness.analysis.report.trace_figure import trace_figures
from harness.units import format_rate

COMPUTE, BLOCKED, OVERLAPPED = "#4c72b0", "#c44e52", "#dd8452"


def _title(kind: str, group: pd.DataFrame) -> str:
    run = group.iloc[0]
    rate = run["link_rate_bps"]
    link = "unshaped" if rate is None or pd.isna(rate) else format_rate(rate)
    stages = f"{run['stages']} stage" + ("s" if run["stages"] != 1 else "")
    return (
        f"{kind}\nprofile {run['profile']} ({link} between clusters) · model {run['model']} "
        f"({run['param_count'] / 1e6:.2f}M params) · {run['clusters']} clusters x {stages} · {run['steps']} steps"
    )


def _slug(key: tuple, keys: list[tuple]) -> str:
    profile, model, clusters, stages, steps, tokenizer = key
    slug = f"{profile}-{model}"
    if sum(1 for k in keys if k[:2] == key[:2]) > 1:
        slug += f"-c{clusters}s{stages}-{steps}steps"
    if tokenizer != "bytes":
        slug += f"-{tokenizer.replace(':', '')}"
    return slug


def group_loss_figure(group: pd.DataFrame, evals: pd.DataFrame, colors: dict[str, str]) -> Figure:
    """One comparable group's validation loss vs tokens and vs wall-clock, a line per variant: the mean over its n
    runs, banded only on the tokens side (module doc); the ceiling dashed."""
    fig = Figure(figsize=LOSS_FIGSIZE)
    by_tokens, by_time = loss_axes(fig)
    curves = {}
    for variant in colors:
        run_ids = group[group["variant"] == variant]["run_id"]
        curve = evals[evals["run_id"].isin(run_ids)].groupby("step")[["tokens", "val_loss", "elapsed_s"]]
        if len(curve):
            curves[variant] = (len(run_ids), curve.mean(), curve.std().fillna(0.0))
    # Slow baselines on a regime-matched link take hundreds of times longer; a linear axis would hide the rest.
    logarithmic = log_time([mean["elapsed_s"].iloc[-1] for _, mean, _ in curves.values()])
    for variant, (n, mean, std) in curves.items():
        # One run has no spread to show: no band, and the legend says so.
        label = f"{variant} (n={n}" + (", band ± 1 std)" if n >= 2 else ", no band)")
        label += ", unsynchronized" if variant == CEILING else ""
        # The ceiling is drawn dashed: its loss is one unsynchronized replica's, not a trained global model's.
        style = "o--" if variant == CEILING else "o-"
        by_tokens.plot(mean["tokens"], mean["val_loss"], style, ms=3, color=colors[variant], label=label)
        if n >= 2:
            band(by_tokens, mean["tokens"], mean["val_loss"], std["val_loss"], colors[variant])
        # The evaluation before training (at 0 s) has no place on a log axis.
        timed = mean[mean["elapsed_s"] > 0] if logarithmic else mean
        by_time.plot(timed["elapsed_s"], timed["val_loss"], style, ms=3, color=colors[variant], label=label)
    by_tokens.set_title("vs tokens: sample efficiency")
    by_time.set_xlabel("training wall-clock (s, evaluation excluded)")
    by_time.set_title("vs wall-clock: what the link costs")
    if logarithmic:
        by_time.set_xscale("log")
        by_time.set_xlabel("training wall-clock (s, log scale, evaluation excluded)")
    for ax in (by_tokens, by_time):
        ax.grid(alpha=GRID_ALPHA)
    by_tokens.legend(title="method (n runs)", fontsize=9)
    fig.suptitle(_title("Validation loss (mean over a method's n runs; band: ± 1 std where n ≥ 2)", group))
    fig.tight_layout()
    return fig


def throughput_figure(group: pd.DataFrame, compared: pd.DataFrame, colors: dict[str, str]) -> Figure:
    rows = compared.set_index("variant").loc[list(colors)]
    fig = Figure(figsize=(max(6.0, 1.5 * len(rows) + 2), 5))
    ax = fig.subplots()
    x = range(len(rows))
    # The report's interval: 95% of the mean (n >= 3) or the range (n = 2); none at all (NaN) for one run.
    below = (rows["tokens_per_s"] - rows["tokens_per_s_low"]).clip(lower=0.0)
    above = (rows["tokens_per_s_high"] - rows["tokens_per_s"]).clip(lower=0.0)
    ax.bar(
        x, rows["tokens_per_s"], yerr=[below.to_numpy(), above.to_numpy()], capsize=4,
        color=[colors[v] for v in rows.index], edgecolor="black", linewidth=0.5,
    )  # fmt: skip
    ax.set_yscale("log")
    has_baseline = BASELINE in rows.index
    tops = rows["tokens_per_s"] + above.fillna(0.0)
    for i, (_, row) in enumerate(rows.iterrows()):
        ratio = f"{row['ratio_to_allreduce']:.3g}x" if has_baseline else ""
        ax.annotate(
            f"{ratio}\n{row['tokens_per_s']:,.0f} tok/s\nn={row['runs']}".strip(),
            (i, tops.iloc[i]), xytext=(0, 6), textcoords="offset points",
            ha="center", va="bottom", fontsize=9, fontweight="bold",
        )  # fmt: skip
    # A wide interval of few runs can reach below zero, which a log axis cannot show: stop at a tenth of the bar.
    bottoms = (rows["tokens_per_s"] - below.fillna(0.0)).clip(lower=rows["tokens_per_s"] / 10)
    ax.set_ylim(bottoms.min() / 3, tops.max() * 4)  # room for the labels above the tallest bar on a log axis
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(list(x), [v.replace(" ", "\n") for v in rows.index])
    ax.set_ylabel("applied throughput (tokens/s, log scale)")
    ax.grid(axis="y", which="both", alpha=GRID_ALPHA)
    subtitle = "labels: ratio to allreduce on the same link" if has_baseline else "no allreduce run to compare with"
    bars = "bars: 95% interval of the mean for n ≥ 3, range for n = 2"
    ax.set_title(_title(f"Training throughput (mean over n runs; {subtitle})\n{bars}", group), fontsize=10)
    fig.tight_layout()
    return fig


def step_breakdown(group: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """Seconds per step of compute, blocked and overlapped communication per variant (after throughput warm-up).

    Communication a method completes after its last step is logged as a `finish` event; its time is inside that
    step's step_s, so it is added to that step's communication here.
    """
    sync = ["sync_blocked_s", "sync_overlapped_s"]
    keys = ["run_id", "rank", "step"]
    mine = events[events["run_id"].isin(group["run_id"]) & events["kind"].isin(["step", "finish"])]
    mine = mine.reindex(columns=[*keys, "kind", "variant", "step_s", *sync]).fillna({c: 0.0 for c in sync})
    comm = mine.groupby(keys)[sync].sum()
    steps = mine[mine["kind"] == "step"].drop(columns=sync).join(comm, on=keys)
    steps = steps.merge(group[["run_id", "throughput_warmup_steps"]], on="run_id")
    steps = steps[steps["step"] >= steps["throughput_warmup_steps"]]
    parts = pd.DataFrame(
        {
            "variant": steps["variant"],
            "run_id": steps["run_id"],
            "compute": steps["step_s"] - steps["sync_blocked_s"],
            "blocked": steps["sync_blocked_s"],
            "overlapped": steps["sync_overlapped_s"],
        }
    )
    # Mean over the run's steps and ranks, then over the variant's runs (seeds).
    per_run = parts.groupby(["variant", "run_id"]).mean()
    return per_run.groupby("variant").mean()


def breakdown_figure(group: pd.DataFrame, events: pd.DataFrame, colors: dict[str, str]) -> Figure:
    parts = step_breakdown(group, events).reindex([v for v in colors])
    shares = parts.div(parts.sum(axis=1), axis=0) * 100
    fig = Figure(figsize=(max(12.0, 2.4 * len(parts) + 4), 5))
    absolute, relative = fig.subplots(1, 2)
    labels = [v.replace(" ", "\n") for v in parts.index]
    legend = {
        "compute": ("compute (forward, backward, optimizer)", COMPUTE, None),
        "blocked": ("communication: blocked (training waits)", BLOCKED, None),
        "overlapped": ("communication: overlapped (hidden, runs during compute)", OVERLAPPED, "//"),
    }
    for ax, table in ((absolute, parts), (relative, shares)):
        bottom = pd.Series(0.0, index=table.index)
        for column, (label, color, hatch) in legend.items():
            ax.bar(
                labels, table[column], bottom=bottom, label=label, color=color, hatch=hatch,
                edgecolor="black", linewidth=0.5,
            )  # fmt: skip
            bottom += table[column]
        ax.grid(axis="y", alpha=GRID_ALPHA)
    for i, step_s in enumerate(parts["compute"] + parts["blocked"]):
        absolute.annotate(
            f"{step_s:.3g} s/step", (i, parts.iloc[i].sum()), xytext=(0, 4), textcoords="offset points",
            ha="center", va="bottom", fontsize=9,
        )  # fmt: skip
    absolute.set_ylabel("seconds per training step (mean)")
    absolute.set_title("time per step (labels: wall-clock per step)")
    absolute.set_ylim(0, parts.sum(axis=1).max() * 1.15)
    relative.set_ylabel("share of the step's activity (%)")
    relative.set_title("share of each part")
    relative.set_ylim(0, 100)
    handles, names = absolute.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(_title("Where a training step's time goes (after throughput warm-up)", group))
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


# DiLoCoX's per-sync fields (trainers/methods/dilocox.py's module doc), as the train loop logs them in step and finish
# events.
# Measured when a round is sent, of that round:
SENT_FIELDS = (
    "sync_rank_r",
    "sync_local_steps_h",
    "sync_compression_error2",
    "sync_omega2_paper",
    "sync_omega2_corrected",
)
# Measured when an exchange's average is applied, of that average:
APPLIED_FIELDS = ("sync_cosine", "sync_step_norm_ratio", "sync_estimated_rank")


def sync_rounds(group: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """One row per run and synchronization round t of the group's runs that log DiLoCoX's sync fields: `variant`,
    `run_id`, `round` and the fields, from rank 0's events (cluster 0, stage 0: each sync once).

    The fields of round t sent (rank, H, compression error and its bounds) sit at its `sync_round`. Those of an
    applied average (cosine, step ratio, estimated rank) sit at the round it carried: an event logs both, and under
    a delayed overlap the average it applies is the previous round's. Exchanges are applied in order, once each, and
    every apply is logged once (a `finish` event per apply at the end), so the k-th applied average is round k's.
    Empty when no run logs the fields.
    """
    fields = [*SENT_FIELDS, *APPLIED_FIELDS]
    columns = ["run_id", "variant", "rank", "kind", "step", "sync_round", *fields]
    mine = events[events["run_id"].isin(group["run_id"]) & events["kind"].isin(["step", "finish"])]
    mine = mine.reindex(columns=columns)
    mine = mine[mine["rank"] == 0]
    numeric = ["sync_round", *fields]
    mine = mine.assign(**{c: pd.to_numeric(mine[c], errors="coerce") for c in numeric})
    mine = mine[mine[numeric].notna().any(axis=1)]
    if mine.empty:
        return pd.DataFrame(columns=["variant", "run_id", "round", *fields])
    # A step's finish event comes after the step's own.
    mine = mine.assign(_finish=mine["kind"] == "finish").sort_values(["run_id", "step", "_finish"], kind="stable")
    rows = []
    for run_id, run in mine.groupby("run_id", sort=False):
        sent = run[run["sync_round"].notna()]
        sent = sent.assign(round=sent["sync_round"].astype(int)).groupby("round")[list(SENT_FIELDS)].last()
        applied = run[run[list(APPLIED_FIELDS)].notna().any(axis=1)]
        applied = applied.assign(round=range(1, len(applied) + 1)).groupby("round")[list(APPLIED_FIELDS)].last()
        table = sent.join(applied, how="outer").reset_index()
        rows.append(table.assign(run_id=run_id, variant=run["variant"].iloc[0]))
    table = pd.concat(rows, ignore_index=True)
    return table[["variant", "run_id", "round", *fields]]


def _mean_line(ax, rounds: pd.DataFrame, column: str, color: str, style: str, label: str | None = None) -> None:
    """The mean over runs of `column` per round, with a ± 1 std band over the rounds that two runs or more have."""
    stats = rounds.groupby("round")[column].agg(["mean", "std", "count"]).dropna(subset=["mean"])
    if stats.empty:
        return
    marker = "o" if len(stats) <= 60 else None
    ax.plot(stats.index, stats["mean"], style, marker=marker, ms=3, color=color, label=label)
    banded = stats["count"] >= 2
    if banded.any():
        spread = stats["std"].fillna(0.0)
        ax.fill_between(
            stats.index, stats["mean"] - spread, stats["mean"] + spread, where=banded.to_numpy(),
            color=color, alpha=BAND_ALPHA, linewidth=0,
        )  # fmt: skip


def monitor_figure(group: pd.DataFrame, rounds: pd.DataFrame, colors: dict[str, str]) -> Figure:
    """DiLoCoX's monitor per synchronization round (sync_rounds' table), one colour per variant (module doc)."""
    fig = Figure(figsize=(13, 9.5))
    (cosine, ratio), (rank, error) = fig.subplots(2, 2, sharex=True)
    steps = rank.twinx()
    variants = [v for v in colors if v in set(rounds["variant"])]
    handles = []
    for variant in variants:
        mine = rounds[rounds["variant"] == variant]
        color = colors[variant]
        n = mine["run_id"].nunique()
        label = f"{variant} (n={n}" + (", band ± 1 std)" if n >= 2 else ", no band)")
        handles.append(Line2D([], [], color=color, marker="o", ms=3, label=label))
        _mean_line(cosine, mine, "sync_cosine", color, "-")
        _mean_line(ratio, mine, "sync_step_norm_ratio", color, "-")
        _mean_line(rank, mine, "sync_estimated_rank", color, "-")
        _mean_line(rank, mine, "sync_rank_r", color, "--")
        _mean_line(steps, mine, "sync_local_steps_h", color, ":")
        _mean_line(error, mine, "sync_compression_error2", color, "-")
        _mean_line(error, mine, "sync_omega2_paper", color, "--")
        _mean_line(error, mine, "sync_omega2_corrected", color, "-.")
    cosine.axhline(0.0, color="black", linewidth=0.6)
    cosine.set_ylabel("cosine(Δ_t, Δ_{t-1})")
    cosine.set_title("consecutive averages' cosine (the overlap assumes they point the same way)", fontsize=10)
    ratio.set_ylabel("||θ_t − θ_{t-1}|| / ||Δ_t||")
    ratio.set_title("outer step over the average it applies (η(1+μ) at first; grows with momentum)", fontsize=10)
    rank.set_ylabel("rank")
    steps.set_ylabel("local steps H_t (dotted)")
    rank.set_title("estimated rank r̂ (solid) and chosen r_t (dashed); H_t (dotted, right axis)", fontsize=10)
    error.set_ylabel("relative squared error")
    error.set_title("compression error² ||c − D(P)||² / ||c||² (solid) vs ω² bounds", fontsize=10)
    positive = rounds[["sync_compression_error2", "sync_omega2_paper", "sync_omega2_corrected"]].stack()
    positive = positive[positive > 0]
    # Uncompressed fp16 rounds err by ~1e-7 and compressed ones by ~1e-1: a linear axis would hide one of them.
    if len(positive) and positive.max() / positive.min() > 20:
        error.set_yscale("log")
        error.set_ylabel("relative squared error (log scale)")
    styles = [
        Line2D([], [], color="gray", linestyle="-", label="measured error²"),
        Line2D([], [], color="gray", linestyle="--", label="ω² (paper, 1 − (r/d) 2^-q)"),
        Line2D([], [], color="gray", linestyle="-.", label="ω² (corrected, (√(1 − r/d) + 2^(-q/2))²)"),
    ]
    error.legend(handles=styles, fontsize=8)
    rank.legend(
        handles=[
            Line2D([], [], color="gray", linestyle="-", label="estimated rank r̂ (of the average applied)"),
            Line2D([], [], color="gray", linestyle="--", label="chosen rank r_t (of the round sent)"),
            Line2D([], [], color="gray", linestyle=":", label="local steps H_t (right axis)"),
        ],
        fontsize=8,
    )
    for ax in (cosine, ratio, rank, error):
        ax.grid(alpha=GRID_ALPHA)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (rank, error):
        ax.set_xlabel("synchronization round t (an applied average at the round it carried)")
    fig.legend(handles=handles, loc="lower center", ncol=min(3, len(handles)), fontsize=9, frameon=False,
               title="variant (n runs)")  # fmt: skip
    stages = group["stages"].iloc[0]
    where = "rank 0: cluster 0" + (f", stage 0 of {stages}" if stages != 1 else "")
    fig.suptitle(_title(f"DiLoCoX monitor per synchronization round ({where}; mean over a variant's n runs, "
                        "band: ± 1 std where n ≥ 2)", group))  # fmt: skip
    fig.tight_layout(rect=(0, 0.03 + 0.025 * math.ceil(len(handles) / 3), 1, 1))
    return fig


def plot_all(tables: RunTables, out: Path) -> list[Path]:
    """Every figure for every comparable group of successful runs; returns the files written."""
    output_folder(out)
    compared = comparison(tables)
    ok = tables.runs[tables.runs["status"] == "ok"]
    evals = eval_curve(tables.events)
    palette = variant_colors(list(dict.fromkeys(compared["variant"])))
    keys = [k for k, _ in ok.groupby(GROUP_KEYS, sort=True, dropna=False)]
    sites = site_comparison(tables)
    written: list[Path] = []
    for key, group in ok.groupby(GROUP_KEYS, sort=True, dropna=False):
        slug = _slug(key, keys)
        group_compared = in_group(compared, key)
        group_sites = in_group(sites, key)
        colors = {v: palette[v] for v in group_compared["variant"]}
        written += save(group_loss_figure(group, evals, colors), out, f"loss-{slug}")
        written += save(throughput_figure(group, group_compared, colors), out, f"throughput-{slug}")
        if not tables.events.empty:
            written += save(breakdown_figure(group, tables.events, colors), out, f"breakdown-{slug}")
            rounds = sync_rounds(group, tables.events)
            if not rounds.empty:
                written += save(monitor_figure(group, rounds, colors), out, f"monitor-{slug}")
        if not group_sites.empty:
            written += save(sites_figure(group, group_sites, colors), out, f"sites-{slug}")
    written += _rtt_figures(ok, compared, palette, out)
    for name, fig in [*trace_figures(tables), *timeline_figures(tables)]:
        written += save(fig, out, name)
    return written


def sites_figure(group: pd.DataFrame, sites: pd.DataFrame, colors: dict[str, str]) -> Figure:
    """Grouped bars, one group per site (labelled with its uplink), one bar per method: waited seconds, wire MB."""
    fig = Figure(figsize=(10, 5))
    waited_ax, wire_ax = fig.subplots(1, 2)
    clusters = sorted(sites["cluster"].unique())
    variants = [v for v in colors if v in set(sites["variant"])]
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        rows = sites[sites["variant"] == variant].set_index("cluster").reindex(clusters)
        x = [c + (i - (len(variants) - 1) / 2) * width for c in range(len(clusters))]
        below = (rows["waited_s"] - rows["waited_s_low"]).clip(lower=0.0).fillna(0.0)
        above = (rows["waited_s_high"] - rows["waited_s"]).clip(lower=0.0).fillna(0.0)
        n = int(rows["waited_s_n"].max())
        waited_ax.bar(x, rows["waited_s"], width, yerr=[below.to_numpy(), above.to_numpy()], capsize=3,
                      color=colors[variant], edgecolor="black", linewidth=0.5, label=f"{variant} (n={n})")  # fmt: skip
        wire_ax.bar(x, rows["wire_bytes"] / 1e6, width, color=colors[variant], edgecolor="black", linewidth=0.5)
    first = sites.drop_duplicates("cluster").set_index("cluster").reindex(clusters)
    labels = [
        f"site {c}\n{'unshaped' if pd.isna(r) else format_rate(r)}"
        for c, r in zip(clusters, first["uplink_rate_bps"], strict=True)
    ]
    for ax, label in ((waited_ax, "time the replica waited on the link (s)"), (wire_ax, "wire bytes (MB)")):
        ax.set_xticks(range(len(clusters)), labels)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=GRID_ALPHA)
    wire_ax.set_yscale("log")
    waited_ax.legend(fontsize=8)
    fig.suptitle(_title("Per site: waiting on the link and bytes sent (bars: 95% interval n ≥ 3, range n = 2)", group),
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    return fig


# Runs that differ only in their link's round-trip time: same model, cluster shape, steps and rate.
RTT_FAMILY_KEYS = ["model", "clusters", "stages", "steps", "link_rate_bps"]


def rtt_families(ok: pd.DataFrame, compared: pd.DataFrame) -> list[tuple[str, pd.DataFrame, pd.DataFrame]]:
    """(figure name, the comparison's rows with their rtt_ms, the runs) of every family of runs at two RTTs or more."""
    families = []
    # A profile without delay has no link check; its RTT is the emulator's own (well under a millisecond).
    runs = ok.assign(rtt_ms=ok["link_rtt_target_ms"].astype(float).fillna(0.0))
    for key, family in runs.groupby(RTT_FAMILY_KEYS, sort=True, dropna=False):
        rtt_by_profile = family.groupby("profile")["rtt_ms"].first()
        if rtt_by_profile.nunique() < 2:
            continue
        mask = compared["profile"].isin(rtt_by_profile.index)
        for column, value in zip(RTT_FAMILY_KEYS[:4], key[:4], strict=True):
            mask &= compared[column] == value
        rows = compared[mask]
        rows = rows.assign(rtt_ms=rows["profile"].map(rtt_by_profile)).sort_values("rtt_ms")
        model, rate = key[0], key[4]
        link = "unshaped" if pd.isna(rate) else format_rate(rate)
        families.append((f"rtt-{model}-{link.replace(' ', '').replace('/', '')}", rows, family))
    return families


def _rtt_figures(ok: pd.DataFrame, compared: pd.DataFrame, palette: dict[str, str], out: Path) -> list[Path]:
    """rtt-<model>-<rate>: tokens/s against RTT, for every family of runs at two RTTs or more."""
    written: list[Path] = []
    for name, rows, family in rtt_families(ok, compared):
        written += save(rtt_figure(rows, palette, family), out, name)
    return written


def rtt_figure(rows: pd.DataFrame, palette: dict[str, str], family: pd.DataFrame) -> Figure:
    """Applied tokens/s per variant against the link's round-trip time, log scale, with the report's intervals."""
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for variant, line in rows.groupby("variant", sort=False):
        below = (line["tokens_per_s"] - line["tokens_per_s_low"]).clip(lower=0.0).fillna(0.0)
        above = (line["tokens_per_s_high"] - line["tokens_per_s"]).clip(lower=0.0).fillna(0.0)
        ax.errorbar(
            line["rtt_ms"], line["tokens_per_s"], yerr=[below.to_numpy(), above.to_numpy()], marker="o", capsize=4,
            color=palette.get(variant), label=f"{variant} (n={int(line['runs'].min())}-{int(line['runs'].max())})",
        )  # fmt: skip
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_xlabel("round-trip time between clusters (ms, the profile's)")
    ax.set_ylabel("applied throughput (tokens/s, log scale)")
    ax.grid(which="both", alpha=GRID_ALPHA)
    ax.legend(fontsize=8)
    run = family.iloc[0]
    rate = run["link_rate_bps"]
    link = "unshaped" if pd.isna(rate) else format_rate(rate)
    ax.set_title(
        f"Throughput vs round-trip time at {link}\nmodel {run['model']} · {run['clusters']} clusters x "
        f"{run['stages']} stages · {run['steps']} steps · bars: 95% interval (n ≥ 3), range (n = 2)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
