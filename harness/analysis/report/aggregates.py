"""The tidy tables (harness/analysis/report/tables.py) -> the comparison (`harness report`'s aggregates): per
comparable group and variant, what its runs rest on, with their spread, relative to AllReduce.

The comparison groups runs that are comparable (same profile, model, cluster shape and step count) and, per variant,
aggregates its n runs (seeds, and repeats of a seed). Every aggregate says what it rests on: the mean, then
± the 95% confidence half-width t_{0.975,n-1} s / sqrt(n) (Student t, s the sample standard deviation) when
n >= 3, the range (min-max) when n = 2, and "n=1, no spread" when n = 1.

- tokens/s is applied tokens per second: tokens whose updates are in the final synchronized parameters. Trained
  tokens per second is shown beside it where the two differ.
- Ratios to a reference (tokens/s over AllReduce's; utilisation: over `local`'s, which never communicates) are
  paired where they can be: per seed, the variant's tokens/s over the reference's with the same seed (each a mean
  over repeats), then aggregated as above. Where the reference lacks one of the variant's seeds, the ratio of the
  two means, without spread. Wire reduction is AllReduce's wire bytes per token over the variant's (of means).
- compute_utilisation: tokens/s over the run's own compute ceiling (harness/analysis/report/tables.py).
- Tokens and time to a target loss come from the first evaluation at or below the target. The default target is
  the group's AllReduce final validation loss (mean over its runs) x 1.05: "within 5% of AllReduce's loss". A run
  that never gets there is "not reached". A group without AllReduce has no default target: pass --target-loss, or
  those columns are not computed.
- Where sites differ (a profile's `sites`) or there are more than two, the per-site comparison gives, per method
  and site, the wire bytes the site's uplink carried and the time its replica waited on the link, mean and spread
  over the method's runs as above: a straggler shows as the site everyone else waits for.
- A variant whose runs crossed the slow link fewer than harness.run.config.MIN_SYNCS (3) times is marked: its
  throughput says little about communication.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd

from harness.analysis.plan import BASELINE, CEILING, TARGET_FACTOR
from harness.analysis.report.tables import GROUP_KEYS, RunTables, eval_curve, missing
from harness.errors import UserError
from harness.run.config import MIN_SYNCS

# Per-run figures the comparison aggregates with their spread (module doc).
SPREAD_METRICS = ("tokens_per_s", "trained_tokens_per_s", "compute_utilisation", "final_val_loss")
# Ratio columns -> the variant whose tokens/s they divide by.
RATIOS = {"ratio_to_allreduce": BASELINE, "utilisation": CEILING}
# t_{0.975, df} for df = 1..30 (checked against a numerical integration of Student's t density).
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604, 2.1448,
    2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484,
    2.0452, 2.0423,
)  # fmt: skip


class ReportError(UserError):
    """Nothing to report on, or an output that cannot be written; the message names the fix."""


# --- statistics --------------------------------------------------------------------------------------------------


def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (two-sided 95%)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    # Cornish-Fisher expansion in 1/df around the normal quantile: within 1e-4 of the exact value from df = 30 on.
    z = 1.959963984540054
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


@dataclass(frozen=True)
class Spread:
    """The mean of n values and how far it can be trusted: `low`-`high` is the 95% confidence interval of the mean
    when n >= 3, the range (min, max) when n = 2, NaN when n < 2 (module doc)."""

    mean: float
    n: int
    low: float = math.nan
    high: float = math.nan


def spread(values: Iterable[object]) -> Spread:
    """Spread of the values that are not missing."""
    clean = [float(v) for v in values if not missing(v)]
    n = len(clean)
    if n == 0:
        return Spread(math.nan, 0)
    mean = sum(clean) / n
    if n == 1:
        return Spread(mean, 1)
    if n == 2:
        return Spread(mean, 2, min(clean), max(clean))
    # Equal values have no spread; stdev of their float sum's rounding would print as 1e-14.
    std = 0.0 if max(clean) - min(clean) <= 1e-12 * abs(mean) else statistics.stdev(clean)
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return Spread(mean, n, mean - half, mean + half)


def spread_columns(name: str, value: Spread) -> dict[str, float]:
    return {name: value.mean, f"{name}_n": value.n, f"{name}_low": value.low, f"{name}_high": value.high}


def ratio(runs: pd.DataFrame, reference: pd.DataFrame, column: str) -> tuple[Spread, str]:
    """`column` of `runs` over the reference's, and how it was taken: "paired" (per seed, each side's mean over
    repeats, then aggregated), "ratio of means" (the reference lacks one of the seeds; no spread), "" (no reference).
    """
    if reference.empty or reference[column].isna().all():
        return Spread(math.nan, 0), ""
    mine = runs.groupby("seed")[column].mean()
    theirs = reference.groupby("seed")[column].mean()
    if set(mine.index) <= set(theirs.index):
        return spread(mine / theirs.reindex(mine.index)), "paired"
    return Spread(float(runs[column].mean() / reference[column].mean()), len(runs)), "ratio of means"


# --- the comparison ----------------------------------------------------------------------------------------------


def reach(evals: pd.DataFrame, target: float) -> tuple[float, float]:
    """(tokens, elapsed seconds) at the first evaluation at or below `target`; NaN when never reached."""
    hit = evals[evals["val_loss"] <= target]
    if hit.empty:
        return math.nan, math.nan
    first = hit.iloc[0]
    return float(first["tokens"]), float(first["elapsed_s"])


@dataclass(frozen=True)
class DefaultTarget:
    """The loss a group is compared at when no --target-loss is given, and one sentence saying how it was derived."""

    loss: float
    rule: str
    label: str = ""  # the rule in a few words, for a figure's legend


def default_target(group: pd.DataFrame, evals: pd.DataFrame) -> DefaultTarget:
    """Halfway between the highest final validation loss AllReduce ended at on any seed (so every AllReduce run
    reaches it) and the lowest validation loss local reached on any seed (so no local run does): a target that
    measures what communication buys. Without a local run, AllReduce's final loss (mean over its runs) x
    TARGET_FACTOR; where local reached AllReduce's worst final loss, that loss (the control note then says local
    reaches it). NaN without AllReduce. `evals`: the group's evaluations (run_id, val_loss)."""
    finals = group[group["method"] == BASELINE]["final_val_loss"].dropna().astype(float)
    if finals.empty:
        return DefaultTarget(math.nan, "")
    local_ids = set(group[group["method"] == CEILING]["run_id"])
    local_losses = evals[evals["run_id"].isin(local_ids)]["val_loss"].dropna().astype(float)
    if local_losses.empty:
        return DefaultTarget(
            float(finals.mean()) * TARGET_FACTOR,
            f"{BASELINE}'s final validation loss {finals.mean():.4g} (mean over its runs) x {TARGET_FACTOR}; no "
            f"{CEILING} run to check it against",
            f"{BASELINE}'s mean final x {TARGET_FACTOR}",
        )
    worst, floor = float(finals.max()), float(local_losses.min())
    if floor <= worst:
        return DefaultTarget(
            worst,
            f"{BASELINE}'s highest final validation loss over its runs, {worst:.4g}; {CEILING} reached {floor:.4g}, "
            "below it, so no target at allreduce's quality separates communication from none",
            f"{BASELINE}'s worst final; {CEILING} reaches it",
        )
    return DefaultTarget(
        (worst + floor) / 2,
        f"halfway between {BASELINE}'s highest final validation loss over its runs ({worst:.4g}: every {BASELINE} "
        f"run reaches it) and the lowest {CEILING} reached on any seed ({floor:.4g}: no {CEILING} run reaches it)",
        f"midway from {BASELINE}'s worst final to {CEILING}'s best",
    )


def _numeric(runs: pd.DataFrame) -> pd.DataFrame:
    """Missing figures (None in older summaries) as NaN, so means and ratios skip them."""
    columns = [*SPREAD_METRICS, "wire_bytes_per_token", "sync_count", "final_val_loss"]
    return runs.assign(**{c: pd.to_numeric(runs[c], errors="coerce") for c in columns if c in runs})


@dataclass(frozen=True)
class _Target:
    """A group's target loss, where it came from ("given", BASELINE, "" for none), and each run's (tokens, seconds)
    to reach it."""

    loss: float
    source: str
    rule: str  # DefaultTarget.rule; "" when given or none
    reached: dict[str, tuple[float, float]]


def _target(group: pd.DataFrame, evals: pd.DataFrame, target_loss: float | None) -> _Target:
    chosen = DefaultTarget(target_loss, "") if target_loss is not None else default_target(group, evals)
    source = "given" if target_loss is not None else (BASELINE if not math.isnan(chosen.loss) else "")
    reached = {run_id: reach(evals[evals["run_id"] == run_id], chosen.loss) for run_id in group["run_id"]}
    return _Target(chosen.loss, source, chosen.rule, reached)


def _against(variant: str, reference: str, runs: pd.DataFrame, group: pd.DataFrame, column: str, name: str) -> dict:
    """The spread columns of `column` over the reference variant's, and how they were paired."""
    if variant == reference:
        value, how = Spread(1.0, len(runs)), "reference"
    else:
        value, how = ratio(runs, group[group["variant"] == reference], column)
    return {**spread_columns(name, value), f"{name}_pairing": how}


def _regime_columns(runs: pd.DataFrame, row: dict) -> dict:
    """On a regime-matched link (harness/analysis/projection/regime.py) the ratio that compares with the published one
    is (1 + R_target) x utilisation: the ratio this machine would show were its R exactly the target's."""
    target_r = pd.to_numeric(runs.get("regime_target_r"), errors="coerce")
    scale = 1 + float(target_r.iloc[0]) if target_r is not None and not target_r.isna().all() else math.nan
    return {
        "regime_target_r": scale - 1,
        **{f"normalized_ratio{suffix}": scale * row[f"utilisation{suffix}"] for suffix in ("", "_low", "_high")},
        "normalized_ratio_n": row["utilisation_n"],
        "normalized_ratio_pairing": row["utilisation_pairing"],
    }


def _sync_and_target_columns(key: dict, method: str, runs: pd.DataFrame, target: _Target) -> dict:
    fewest = runs["sync_count"].min()
    tokens_to = [target.reached[r][0] for r in runs["run_id"] if not math.isnan(target.reached[r][0])]
    time_to = [target.reached[r][1] for r in runs["run_id"] if not math.isnan(target.reached[r][1])]
    return {
        "wire_bytes_per_token": runs["wire_bytes_per_token"].mean(),
        "sync_count": runs["sync_count"].mean(),
        "sync_count_min": fewest,
        # local never synchronizes, by design; one cluster has no slow link to cross.
        "few_syncs": bool(method != CEILING and key["clusters"] > 1 and not pd.isna(fewest) and fewest < MIN_SYNCS),
        "target_loss": target.loss,
        "target_source": target.source,
        "target_rule": target.rule,
        "reached": len(tokens_to),
        "tokens_to_target": sum(tokens_to) / len(tokens_to) if tokens_to else math.nan,
        "time_to_target_s": sum(time_to) / len(time_to) if time_to else math.nan,
    }


def _variant_row(key: dict, group: pd.DataFrame, variant: str, runs: pd.DataFrame, target: _Target) -> dict:
    row = {
        **key,
        "variant": variant,
        "method": runs["method"].iloc[0],
        "seeds": ",".join(str(s) for s in sorted(runs["seed"].unique())),
        "in_sample_seeds": in_sample_seeds(runs),
        "runs": len(runs),
        "link_rate_bps": runs["link_rate_bps"].iloc[0],
    }
    for metric in SPREAD_METRICS:
        row.update(spread_columns(metric, spread(runs[metric] if metric in runs else [])))
    row["tokens_per_s_std"] = runs["tokens_per_s"].std()
    row["final_val_loss_std"] = runs["final_val_loss"].std()
    for name, reference in RATIOS.items():
        row.update(_against(variant, reference, runs, group, "tokens_per_s", name))
    # Loss at equal applied tokens (every method applies every trained token by the end): the final validation loss
    # over AllReduce's, paired per seed.
    row.update(_against(variant, BASELINE, runs, group, "final_val_loss", "loss_ratio_to_allreduce"))
    row.update(_regime_columns(runs, row))
    row["nonconforming_runs"] = int((runs.get("link_conforms", pd.Series(dtype=object)) == False).sum())  # noqa: E712
    row.update(_sync_and_target_columns(key, row["method"], runs, target))
    return row


def in_sample_seeds(runs: pd.DataFrame) -> str:
    """The runs' seeds their method's settings were chosen on, "0,1,2" ("" for none): a row on them is in-sample."""
    if "in_sample" not in runs:
        return ""
    chosen = runs[runs["in_sample"].fillna(False).astype(bool)]
    return ",".join(str(s) for s in sorted(chosen["seed"].unique()))


def comparison(tables: RunTables, target_loss: float | None = None) -> pd.DataFrame:
    """One row per (comparable group, variant) over the successful runs; raw numbers (module doc)."""
    ok = _numeric(tables.runs[tables.runs["status"] == "ok"])
    if ok.empty:
        raise ReportError("no successful runs to compare (every run failed); see each run's summary.json")
    evals = eval_curve(tables.events)
    rows = []
    for group_key, group in ok.groupby(GROUP_KEYS, sort=True, dropna=False):
        key = dict(zip(GROUP_KEYS, group_key, strict=True))
        target = _target(group, evals, target_loss)
        rows += [
            _variant_row(key, group, variant, runs, target) for variant, runs in group.groupby("variant", sort=False)
        ]
    # The baseline first and the ceiling last, so every table reads the same way.
    order = {BASELINE: 0, CEILING: 2}
    table = pd.DataFrame(rows)
    table["_order"] = table["method"].map(lambda m: order.get(m, 1))
    table = table.sort_values([*GROUP_KEYS, "_order", "variant"]).drop(columns="_order").reset_index(drop=True)
    # A variant that never synchronized (local) sends only connection set-up bytes: a reduction would be noise.
    table["wire_reduction"] = _relative(table, BASELINE, "wire_bytes_per_token", inverse=True).where(
        table["sync_count"] > 0
    )
    return table


def _relative(table: pd.DataFrame, reference: str, column: str, inverse: bool) -> pd.Series:
    """column / the reference variant's in the same group (or reference's / column's); NaN without a reference."""
    ref = table[table["variant"] == reference].set_index(GROUP_KEYS)[column]
    ref_values = table.set_index(GROUP_KEYS).index.map(lambda key: ref.get(key, math.nan))
    ref_values = pd.Series(list(ref_values), index=table.index, dtype=float)
    values = table[column].astype(float)
    return ref_values / values if inverse else values / ref_values


def site_comparison(tables: RunTables) -> pd.DataFrame:
    """One row per (comparable group, variant, site) of the successful runs, in groups with sites of different rates
    or more than two sites (module doc): the site's rates, its uplink's wire bytes (mean) and the time its replica
    waited on the link (`waited_s`, with its spread)."""
    columns = [*GROUP_KEYS, "variant", "cluster", "uplink_rate_bps", "downlink_rate_bps", "wire_bytes",
               "waited_s", "waited_s_low", "waited_s_high", "waited_s_n"]  # fmt: skip
    if tables.sites.empty or tables.runs.empty:
        return pd.DataFrame(columns=columns)
    ok = tables.runs[tables.runs["status"] == "ok"][["run_id", *GROUP_KEYS, "variant"]]
    sites = tables.sites.merge(ok, on="run_id")
    rows = []
    for key, group in sites.groupby(GROUP_KEYS, sort=True, dropna=False):
        rates = group[["uplink_rate_bps", "downlink_rate_bps"]].astype(float).fillna(-1.0)
        if group["cluster"].nunique() <= 2 and len(rates.drop_duplicates()) <= 1:
            continue
        for (variant, cluster), runs in group.groupby(["variant", "cluster"], sort=True):
            waited = spread(runs["comm_blocked_s"])
            rows.append(
                {
                    **dict(zip(GROUP_KEYS, key, strict=True)),
                    "variant": variant,
                    "cluster": int(cluster),
                    "uplink_rate_bps": runs["uplink_rate_bps"].iloc[0],
                    "downlink_rate_bps": runs["downlink_rate_bps"].iloc[0],
                    "wire_bytes": pd.to_numeric(runs["wire_bytes"], errors="coerce").mean(),
                    **spread_columns("waited_s", waited),
                }
            )
    return pd.DataFrame(rows, columns=columns)
