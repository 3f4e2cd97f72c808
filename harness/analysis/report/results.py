"""`harness report`: the comparison a reader wants, as markdown: speed, bytes, loss, relative to AllReduce.

What the numbers are: harness/analysis/report/tables.py (the tidy tables read from the results folders: runs, events,
sites; compute utilisation) and harness/analysis/report/aggregates.py (the aggregates, their spread, the ratios and
the target loss). This module renders them: a legend, one section per comparable group (with its regime-matched and
per-site tables where they apply), then the failed runs. The tables as files: harness/analysis/report/files.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd

from harness.analysis.options import not_recorded_note
from harness.analysis.report.markdown import (
    IN_SAMPLE_NOTE,
    blank,
    change,
    count,
    half_percent,
    half_times,
    in_sample_label,
    markdown_table,
    percent,
    spread_cell,
    times,
    with_spread,
)
from harness.analysis.report.tables import GROUP_KEYS, in_group
from harness.run.config import MIN_SYNCS
from harness.units import format_rate


def _num(value: float, fmt: str) -> str:
    return "-" if blank(value) else format(value, fmt)


def _link(rate_bps: float | None) -> str:
    return "unshaped" if rate_bps is None or pd.isna(rate_bps) else format_rate(rate_bps)


def _ratio_cell(r: pd.Series, name: str, fmt: Callable[[float], str], half: Callable[[float], str]) -> str:
    how = r[f"{name}_pairing"]
    if how == "reference":
        return fmt(1.0)
    if how == "ratio of means":
        return f"{fmt(r[name])} (ratio of means)" if not blank(r[name]) else "-"
    return with_spread(r[name], r[f"{name}_n"], r[f"{name}_low"], r[f"{name}_high"], fmt, half, how)


def _loss(value: float) -> str:
    return format(value, ".3f")


LEGEND = (
    "n: runs aggregated (seeds x repeats). Each figure is the mean, then ± the 95% confidence half-width (Student t) "
    'when n ≥ 3, the range (min–max) when n = 2, or "n=1, no spread". Ratios are paired per seed with the '
    "reference's run of the same seed where there is one, else the ratio of means (no spread). applied tokens/s "
    "counts the tokens whose updates are in the final synchronized model; compute util. is that over the run's own "
    "compute ceiling (tokens per step / median forward+backward time after warm-up). A method's row is one variant: "
    "the runs that ran with equal options, defaults included; it names only the options that differ from the "
    "method's defaults."
)
FEW_SYNCS = "⚠"


def _differs(a: float, b: float) -> bool:
    return not (blank(a) or blank(b)) and not math.isclose(a, b, rel_tol=1e-9)


def _columns(trained: bool, target: bool) -> list[str]:
    return [
        "method", "n", "seeds", "applied tokens/s", *(["trained tokens/s"] if trained else []), "vs allreduce",
        "utilisation (vs local)", "compute util.", "wire B/token", "wire reduction", "final val loss",
        "val loss vs allreduce", *(["tokens to target", "time to target"] if target else []),
    ]  # fmt: skip


def _row(r: pd.Series, trained: bool, target: bool) -> list[str]:
    method = in_sample_label(r["variant"], r.get("in_sample_seeds"))
    if r["few_syncs"]:
        syncs = int(r["sync_count_min"])
        method += f" {FEW_SYNCS} {syncs} sync" + ("" if syncs == 1 else "s")
    cells = [
        method,
        str(r["runs"]),
        r["seeds"],
        spread_cell(r, "tokens_per_s", count, count),
        *([spread_cell(r, "trained_tokens_per_s", count, count)] if trained else []),
        _ratio_cell(r, "ratio_to_allreduce", times, half_times),
        _ratio_cell(r, "utilisation", percent, half_percent),
        spread_cell(r, "compute_utilisation", percent, half_percent),
        _num(r["wire_bytes_per_token"], ",.1f"),
        times(r["wire_reduction"]),
        spread_cell(r, "final_val_loss", _loss, _loss),
        _ratio_cell(r, "loss_ratio_to_allreduce", change, half_percent)
        if r["loss_ratio_to_allreduce_pairing"]
        else "-",
    ]
    if target:
        partial = "" if r["reached"] in (0, r["runs"]) else f" ({r['reached']}/{r['runs']} runs)"
        cells += [
            _num(r["tokens_to_target"], ",.0f") + partial if r["reached"] else "not reached",
            _num(r["time_to_target_s"], ",.1f") + " s" + partial if r["reached"] else "not reached",
        ]
    return cells


def _target_line(group: pd.DataFrame) -> str:
    target, source = group["target_loss"].iloc[0], group["target_source"].iloc[0]
    if source == "given":
        return f"Target validation loss: {target:.3f} (--target-loss)."
    if blank(target):
        return (
            "Tokens and time to target: not computed (no allreduce run in this group to set the target); "
            "pass --target-loss."
        )
    return f"Target validation loss: {target:.3f} ({group['target_rule'].iloc[0]})."


def _regime_table(group: pd.DataFrame) -> str:
    """Regime-matched groups: the raw ratio, utilisation, and the ratio normalized to the target regime."""
    target_r = group["regime_target_r"].iloc[0]
    rows = [
        [
            r["variant"],
            _ratio_cell(r, "ratio_to_allreduce", times, half_times),
            _ratio_cell(r, "utilisation", percent, half_percent),
            # local is utilisation's reference: its normalized ratio is 1 + R_target by definition.
            f"{1 + target_r:.1f}x (by definition)"
            if r["utilisation_pairing"] == "reference"
            else _ratio_cell(r, "normalized_ratio", times, half_times),
        ]
        for _, r in group.iterrows()
    ]
    header = ["method", "vs allreduce (raw)", "utilisation (vs local)", f"(1 + {target_r:.1f}) x utilisation"]
    return (
        f"Regime-matched link (R_target = {target_r:.1f}): the raw ratio depends on the R this machine achieved; "
        "(1 + R_target) x utilisation is the ratio at exactly the target's R, the one to compare with the "
        "published.\n\n" + markdown_table(header, rows)
    )


def _site_table(sites: pd.DataFrame) -> str:
    """Per method and site: its uplink, the bytes it carried and how long its replica waited on the link."""
    rows = [
        [
            r["variant"],
            str(r["cluster"]),
            _link(r["uplink_rate_bps"]) + ("" if _same_rate(r) else f" up, {_link(r['downlink_rate_bps'])} down"),
            _num(r["wire_bytes"] / 1e6, ",.1f"),
            spread_cell(r, "waited_s", lambda v: f"{v:,.2f} s", lambda v: f"{v:,.2f}"),
        ]
        for _, r in sites.iterrows()
    ]
    return (
        "Per site: the bytes each site's uplink carried and the time its replica waited on the link (blocked in "
        "communication), per method.\n\n"
        + markdown_table(["method", "site", "link", "wire MB", "waited"], rows, text_columns=3)
    )


def _same_rate(r: pd.Series) -> bool:
    up, down = r["uplink_rate_bps"], r["downlink_rate_bps"]
    return (blank(up) and blank(down)) or up == down


def report_markdown(table: pd.DataFrame, runs: pd.DataFrame, sites: pd.DataFrame | None = None) -> str:
    """The comparison as markdown: a legend, one section per comparable group (with its per-site table where
    `sites`, from site_comparison, has rows for it), then the failed runs."""
    parts = [LEGEND + "\n"]
    for key, group in table.groupby(GROUP_KEYS, sort=True, dropna=False):
        profile, model, clusters, stages, steps, tokenizer = key
        link = _link(group["link_rate_bps"].iloc[0])
        trained = any(_differs(a, b) for a, b in zip(group["tokens_per_s"], group["trained_tokens_per_s"], strict=True))
        target = not blank(group["target_loss"].iloc[0])
        parts.append(
            f"### {profile} ({link}) · model {model} · {clusters} clusters x {stages} stage(s) · {steps} steps"
            + ("" if tokenizer == "bytes" else f" · tokenizer {tokenizer}")
            + "\n\n"
            + _target_line(group)
            + "\n"
        )
        text = markdown_table(_columns(trained, target), [_row(r, trained, target) for _, r in group.iterrows()])
        if group["few_syncs"].any():
            text += (
                f"\n\n{FEW_SYNCS}: its runs crossed the slow link fewer than {MIN_SYNCS} times, so its throughput says "
                "little about communication; use more --steps or a smaller --set local_steps."
            )
        if not group["regime_target_r"].isna().all():
            text += "\n\n" + _regime_table(group)
        if group["nonconforming_runs"].sum():
            text += (
                f"\n\n{int(group['nonconforming_runs'].sum())} run(s) here broke the link's rate (link_max_excess "
                "above 1.02: their bytes ran ahead of rate x window + burst); their throughput is not a rate-true "
                "measurement."
            )
        if sites is not None and not sites.empty:
            mine = in_group(sites, key)
            if not mine.empty:
                text += "\n\n" + _site_table(mine)
        parts.append(text + "\n")
    if "in_sample_seeds" in table and table["in_sample_seeds"].fillna("").astype(bool).any():
        parts.append(IN_SAMPLE_NOTE + "\n")
    if "options_recorded" in runs and not runs["options_recorded"].all():
        parts.append(not_recorded_note(list(runs[~runs["options_recorded"].astype(bool)]["options_commit"])) + "\n")
    failed = runs[runs["status"] != "ok"]
    if not failed.empty:
        lines = [f"- {r['path']}: {r['failure']}" for _, r in failed.iterrows()]
        parts.append(f"{len(failed)} failed run(s), left out of the table:\n" + "\n".join(lines) + "\n")
    return "\n".join(parts)
