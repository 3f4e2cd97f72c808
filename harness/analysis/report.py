"""Results folders -> tidy tables -> the comparison a reader wants: speed, bytes, loss, relative to AllReduce.

Two tables, built from the files alone (summary.json and events/*.jsonl), so results copied from another machine
report the same; paths are kept relative to the folder the user named:

    runs    one row per run: the summary's figures, `variant` (method and its options), `path`, and the run's
            compute ceiling and `compute_utilisation` (below)
    events  one row per step or eval event of every rank, with `elapsed_s`: training wall-clock since the first step
            started, evaluation time left out (evaluation is identical for all methods and not training)
    sites   one row per run and cluster: the summary's `per_cluster` (the site's uplink and downlink rates, the wire
            bytes its uplink carried, and `comm_blocked_s`, the time its replica waited on the link)

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
- compute_utilisation measures each run against its own machine: a shared machine moves tokens/s by tens of
  percent from one run to the next. The run's compute ceiling is tokens per step / the median forward+backward
  time (`compute_s`) of its steps after the throughput warm-up on rank 0 (with pipeline stages, the slowest stage
  of cluster 0's); compute_utilisation = tokens/s over that ceiling. A method that hides all its communication is
  near 1 whatever the machine's speed (a little below: the optimizer step is not in compute_s).
- Tokens and time to a target loss come from the first evaluation at or below the target. The default target is
  the group's AllReduce final validation loss (mean over its runs) x 1.05: "within 5% of AllReduce's loss". A run
  that never gets there is "not reached". A group without AllReduce has no default target: pass --target-loss, or
  those columns are not computed.
- Where sites differ (a profile's `sites`) or there are more than two, a per-site table follows each group's: per
  method and site, the wire bytes the site's uplink carried and the time its replica waited on the link, mean and
  spread over the method's runs as above: a straggler shows as the site everyone else waits for.
- A variant whose runs crossed the slow link fewer than harness.run.config.MIN_SYNCS (3) times is marked: its
  throughput says little about communication.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.errors import UserError
from harness.run.config import MIN_SYNCS
from harness.run.events import read_events
from harness.units import format_rate

# What makes two runs comparable: everything but the method and the seed.
GROUP_KEYS = ["profile", "model", "clusters", "stages", "steps"]
BASELINE = "allreduce"
CEILING = "local"
# The default target loss: AllReduce's final validation loss, this much higher.
TARGET_FACTOR = 1.05
# finish: communication a method completed after its last step (its blocked time is inside that step's step_s).
EVENT_KINDS = ("step", "eval", "finish")
_SUMMARY_SCALARS = (
    "run_id", "status", "failure", "method", "profile", "link_rate_bps", "backend", "clusters", "stages", "model",
    "param_count", "seed", "steps", "tokens", "trained_tokens", "applied_tokens", "throughput_warmup_steps", "wall_s",
    "tokens_per_s", "trained_tokens_per_s", "wire_bytes", "wire_bytes_per_token", "payload_bytes", "sync_count",
    "comm_blocked_s", "comm_overlapped_s", "overlap_hidden_fraction", "final_train_loss", "final_val_loss",
    "initial_val_loss", "link_busbw_bps", "regime_target_r", "link_max_excess", "link_conforms", "link_emulator",
    "link_rtt_ms", "link_rtt_target_ms", "link_loss_measured", "link_loss_target", "link_check_ok",
)  # fmt: skip
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


@dataclass(frozen=True)
class RunTables:
    runs: pd.DataFrame
    events: pd.DataFrame
    sites: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)


def variant_of(method: str, options: dict) -> str:
    """'opendiloco local_steps=10': a method and the options it ran with, which the comparison keeps apart."""
    return " ".join([method, *(f"{k}={v}" for k, v in sorted(options.items()))])


def find_run_dirs(paths: Sequence[Path]) -> list[tuple[Path, str]]:
    """(folder, path relative to what the user named) of every finished run folder in `paths`."""
    found: list[tuple[Path, str]] = []
    for root in paths:
        if (root / "summary.json").is_file():
            found.append((root, root.name))
            continue
        if not root.is_dir():
            raise ReportError(f"{root} is neither a run folder nor a folder of runs; pass a results folder")
        # A sweep's own runs only: its folder also holds helper runs (the regime's compute measurement).
        search = root / "runs" if (root / "sweep.json").is_file() else root
        for summary in sorted(search.rglob("summary.json")):
            relative = summary.parent.relative_to(root)
            # Hidden folders are staging areas of runs still in progress (or interrupted).
            if not any(part.startswith(".") for part in relative.parts):
                found.append((summary.parent, str(Path(root.name) / relative)))
    if not found:
        raise ReportError(f"no run folders (with summary.json) under {', '.join(map(str, paths))}")
    return found


def _elapsed(events: list[dict]) -> list[dict]:
    """Adds elapsed_s to one rank's step and eval events (module doc)."""
    steps = [e for e in events if e["kind"] == "step"]
    if not steps:
        return events
    start = steps[0]["t"] - steps[0]["step_s"]
    eval_s = 0.0
    for event in sorted(events, key=lambda e: e["t"]):
        if event["kind"] == "eval" and event["step"] > 0:
            event["elapsed_s"] = event["t"] - event["eval_s"] - start - eval_s
            eval_s += event["eval_s"]
        elif event["kind"] == "eval":
            event["elapsed_s"] = 0.0
        else:
            event["elapsed_s"] = event["t"] - start - eval_s
    return events


def _missing(value: object) -> bool:
    return value is None or bool(pd.isna(value))


def compute_ceiling(
    rank_events: Mapping[int, list[dict]], stages: int, warmup_steps: int, tokens_per_step: float
) -> float:
    """Tokens/s the run's own compute allows (module doc): tokens per step over the median `compute_s` of the steps
    after warm-up, on rank 0, or on the slowest of cluster 0's stages; NaN where steps carry no compute_s."""
    medians = []
    for rank in range(max(stages, 1)):
        steps = [e for e in rank_events.get(rank, []) if e["kind"] == "step" and e.get("compute_s") is not None]
        # A run no longer than its warm-up has no window; its steps still say how fast it computed.
        timed = [e for e in steps if e["step"] >= warmup_steps] or steps
        if not timed:
            return math.nan
        medians.append(statistics.median(e["compute_s"] for e in timed))
    slowest = max(medians)
    return tokens_per_step / slowest if slowest > 0 else math.nan


def _ceiling_columns(summary: dict, rank_events: Mapping[int, list[dict]]) -> dict[str, float]:
    steps, tokens = summary.get("steps"), summary.get("tokens")
    ceiling = math.nan
    if steps and tokens:
        ceiling = compute_ceiling(
            rank_events, summary.get("stages") or 1, summary.get("throughput_warmup_steps") or 0, tokens / steps
        )
    tokens_per_s = summary.get("tokens_per_s")
    usable = not (_missing(tokens_per_s) or math.isnan(ceiling))
    return {
        "compute_ceiling_tokens_per_s": ceiling,
        "compute_utilisation": tokens_per_s / ceiling if usable else math.nan,
    }


def load_runs(paths: Sequence[Path]) -> RunTables:
    runs, events, sites = [], [], []
    for run_dir, relative in find_run_dirs(paths):
        summary = json.loads((run_dir / "summary.json").read_text())
        sites += [{"run_id": summary["run_id"], **site} for site in summary.get("per_cluster") or []]
        row = {key: summary.get(key) for key in _SUMMARY_SCALARS}
        options = summary.get("method_options") or {}
        row.update(variant=variant_of(summary["method"], options), options=json.dumps(options), path=relative)
        by_rank: dict[int, list[dict]] = {}
        for rank_file in sorted((run_dir / "events").glob("rank*.jsonl")):
            rank_events = [e for e in read_events(rank_file) if e.get("kind") in EVENT_KINDS]
            rank = rank_file.stem.removeprefix("rank")
            if rank.isdigit():
                by_rank[int(rank)] = rank_events
            events += [{"run_id": summary["run_id"], **e} for e in _elapsed(rank_events)]
        row.update(_ceiling_columns(summary, by_rank))
        runs.append(row)
    runs_table = pd.DataFrame(runs)
    event_table = pd.DataFrame(events)
    if not event_table.empty:
        labels = runs_table[["run_id", "method", "variant", "profile", "model", "seed", "stages"]]
        event_table = event_table.merge(labels, on="run_id", how="left")
    return RunTables(runs_table, event_table, pd.DataFrame(sites))


def in_group(table: pd.DataFrame, key: tuple) -> pd.DataFrame:
    """The rows of `table` in the comparable group `key` (values of GROUP_KEYS, in order)."""
    return table[(table[GROUP_KEYS] == pd.Series(key, index=GROUP_KEYS)).all(axis=1)]


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
                    **_spread_columns("waited_s", waited),
                }
            )
    return pd.DataFrame(rows, columns=columns)


def eval_curve(events: pd.DataFrame) -> pd.DataFrame:
    """Validation events as the summary reads them: from the last stage of cluster 0 (rank stages - 1)."""
    if events.empty or "val_loss" not in events:
        return pd.DataFrame(columns=["run_id", "step", "tokens", "val_loss", "elapsed_s"])
    evals = events[(events["kind"] == "eval") & (events["rank"] == events["stages"] - 1)]
    return evals.sort_values(["run_id", "step"])


# --- aggregation -------------------------------------------------------------------------------------------------


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
    clean = [float(v) for v in values if not _missing(v)]
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


def _spread_columns(name: str, value: Spread) -> dict[str, float]:
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


def _reach(evals: pd.DataFrame, target: float) -> tuple[float, float]:
    """(tokens, elapsed seconds) at the first evaluation at or below `target`; NaN when never reached."""
    hit = evals[evals["val_loss"] <= target]
    if hit.empty:
        return math.nan, math.nan
    first = hit.iloc[0]
    return float(first["tokens"]), float(first["elapsed_s"])


def default_target(group: pd.DataFrame) -> float:
    """The group's AllReduce final validation loss (mean over its runs) x TARGET_FACTOR; NaN without AllReduce."""
    losses = group[group["method"] == BASELINE]["final_val_loss"].dropna().astype(float)
    return float(losses.mean()) * TARGET_FACTOR if not losses.empty else math.nan


def _numeric(runs: pd.DataFrame) -> pd.DataFrame:
    """Missing figures (None in older summaries) as NaN, so means and ratios skip them."""
    columns = [*SPREAD_METRICS, "wire_bytes_per_token", "sync_count", "final_val_loss"]
    return runs.assign(**{c: pd.to_numeric(runs[c], errors="coerce") for c in columns if c in runs})


def comparison(tables: RunTables, target_loss: float | None = None) -> pd.DataFrame:
    """One row per (comparable group, variant) over the successful runs; raw numbers (module doc)."""
    ok = _numeric(tables.runs[tables.runs["status"] == "ok"])
    if ok.empty:
        raise ReportError("no successful runs to compare (every run failed); see each run's summary.json")
    evals = eval_curve(tables.events)
    rows = []
    for group_key, group in ok.groupby(GROUP_KEYS, sort=True, dropna=False):
        key = dict(zip(GROUP_KEYS, group_key, strict=True))
        target = target_loss if target_loss is not None else default_target(group)
        source = "given" if target_loss is not None else (BASELINE if not math.isnan(target) else "")
        reached = {run_id: _reach(evals[evals["run_id"] == run_id], target) for run_id in group["run_id"]}
        for variant, runs in group.groupby("variant", sort=False):
            row = {
                **key,
                "variant": variant,
                "method": runs["method"].iloc[0],
                "seeds": ",".join(str(s) for s in sorted(runs["seed"].unique())),
                "runs": len(runs),
                "link_rate_bps": runs["link_rate_bps"].iloc[0],
            }
            for metric in SPREAD_METRICS:
                row.update(_spread_columns(metric, spread(runs[metric] if metric in runs else [])))
            row["tokens_per_s_std"] = runs["tokens_per_s"].std()
            row["final_val_loss_std"] = runs["final_val_loss"].std()
            for name, reference in RATIOS.items():
                if variant == reference:
                    value, how = Spread(1.0, len(runs)), "reference"
                else:
                    value, how = ratio(runs, group[group["variant"] == reference], "tokens_per_s")
                row.update(_spread_columns(name, value))
                row[f"{name}_pairing"] = how
            # Loss at equal applied tokens (every method applies every trained token by the end): the final
            # validation loss over AllReduce's, paired per seed.
            if variant == BASELINE:
                loss_ratio, loss_how = Spread(1.0, len(runs)), "reference"
            else:
                loss_ratio, loss_how = ratio(runs, group[group["variant"] == BASELINE], "final_val_loss")
            row.update(_spread_columns("loss_ratio_to_allreduce", loss_ratio))
            row["loss_ratio_to_allreduce_pairing"] = loss_how
            # On a regime-matched link (harness/analysis/regime.py) the ratio that compares with the published one is
            # (1 + R_target) x utilisation: the ratio this machine would show were its R exactly the target's.
            target_r = pd.to_numeric(runs.get("regime_target_r"), errors="coerce")
            scale = 1 + float(target_r.iloc[0]) if target_r is not None and not target_r.isna().all() else math.nan
            row["regime_target_r"] = scale - 1
            for suffix in ("", "_low", "_high"):
                row[f"normalized_ratio{suffix}"] = scale * row[f"utilisation{suffix}"]
            row["normalized_ratio_n"] = row["utilisation_n"]
            row["normalized_ratio_pairing"] = row["utilisation_pairing"]
            row["nonconforming_runs"] = int((runs.get("link_conforms", pd.Series(dtype=object)) == False).sum())  # noqa: E712
            fewest = runs["sync_count"].min()
            tokens_to = [reached[r][0] for r in runs["run_id"] if not math.isnan(reached[r][0])]
            time_to = [reached[r][1] for r in runs["run_id"] if not math.isnan(reached[r][1])]
            row.update(
                {
                    "wire_bytes_per_token": runs["wire_bytes_per_token"].mean(),
                    "sync_count": runs["sync_count"].mean(),
                    "sync_count_min": fewest,
                    # local never synchronizes, by design; one cluster has no slow link to cross.
                    "few_syncs": bool(
                        row["method"] != CEILING and key["clusters"] > 1 and not pd.isna(fewest) and fewest < MIN_SYNCS
                    ),
                    "target_loss": target,
                    "target_source": source,
                    "reached": len(tokens_to),
                    "tokens_to_target": sum(tokens_to) / len(tokens_to) if tokens_to else math.nan,
                    "time_to_target_s": sum(time_to) / len(time_to) if time_to else math.nan,
                }
            )
            rows.append(row)
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


# --- markdown ----------------------------------------------------------------------------------------------------


def _nan(value: object) -> bool:
    return _missing(value) or (isinstance(value, float) and math.isnan(value))


def _num(value: float, fmt: str) -> str:
    return "-" if _nan(value) else format(value, fmt)


def _percent(share: float) -> str:
    return "-" if _nan(share) else f"{100 * share:.3g}%"


def _link(rate_bps: float | None) -> str:
    return "unshaped" if rate_bps is None or pd.isna(rate_bps) else format_rate(rate_bps)


def _times(value: float) -> str:
    if _nan(value):
        return "-"
    return "inf" if math.isinf(value) else f"{value:.3g}x"


def with_spread(
    mean: float, n: int, low: float, high: float, fmt: Callable[[float], str], half: Callable[[float], str], note=""
) -> str:
    """'1,100 ± 248' (n >= 3), '1,100 (range 1,000–1,200)' (n = 2), '1,000 (n=1, no spread)'; `note` goes inside
    the parentheses."""
    if _nan(mean):
        return "-"
    extra = f", {note}" if note else ""
    if n >= 3 and not _nan(low):
        return f"{fmt(mean)} ± {half(high - mean)}" + (f" ({note})" if note else "")
    if n == 2 and not _nan(low):
        return f"{fmt(mean)} (range {fmt(low)}–{fmt(high)}{extra})"
    if n == 1:
        return f"{fmt(mean)} (n=1, no spread{extra})"
    return fmt(mean) + (f" ({note})" if note else "")


def _spread_cell(r: pd.Series, name: str, fmt: Callable[[float], str], half: Callable[[float], str]) -> str:
    return with_spread(r[name], r[f"{name}_n"], r[f"{name}_low"], r[f"{name}_high"], fmt, half)


def _ratio_cell(r: pd.Series, name: str, fmt: Callable[[float], str], half: Callable[[float], str]) -> str:
    how = r[f"{name}_pairing"]
    if how == "reference":
        return fmt(1.0)
    if how == "ratio of means":
        return f"{fmt(r[name])} (ratio of means)" if not _nan(r[name]) else "-"
    return with_spread(r[name], r[f"{name}_n"], r[f"{name}_low"], r[f"{name}_high"], fmt, half, how)


def _count(value: float) -> str:
    return format(value, ",.0f")


def _change(ratio: float) -> str:
    """A ratio as a relative change: 1.048 -> '+4.8%'."""
    return "-" if _nan(ratio) else f"{100 * (ratio - 1):+.3g}%"


def _half_times(value: float) -> str:
    return f"{value:.2g}"


def _half_percent(value: float) -> str:
    return f"{100 * value:.2g}%"


def _loss(value: float) -> str:
    return format(value, ".3f")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int = 1) -> str:
    """A GitHub markdown table; the first `text_columns` left-aligned, the numbers after them right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    left = set(range(text_columns))

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(":" + "-" * (w + 1) if i in left else "-" * (w + 1) + ":" for i, w in enumerate(widths))
    return "\n".join([line(header), rule + "|", *(line(r) for r in rows)])


LEGEND = (
    "n: runs aggregated (seeds x repeats). Each figure is the mean, then ± the 95% confidence half-width (Student t) "
    'when n ≥ 3, the range (min–max) when n = 2, or "n=1, no spread". Ratios are paired per seed with the '
    "reference's run of the same seed where there is one, else the ratio of means (no spread). applied tokens/s "
    "counts the tokens whose updates are in the final synchronized model; compute util. is that over the run's own "
    "compute ceiling (tokens per step / median forward+backward time after warm-up)."
)
FEW_SYNCS = "⚠"


def _differs(a: float, b: float) -> bool:
    return not (_nan(a) or _nan(b)) and not math.isclose(a, b, rel_tol=1e-9)


def _columns(trained: bool, target: bool) -> list[str]:
    return [
        "method", "n", "seeds", "applied tokens/s", *(["trained tokens/s"] if trained else []), "vs allreduce",
        "utilisation (vs local)", "compute util.", "wire B/token", "wire reduction", "final val loss",
        "val loss vs allreduce", *(["tokens to target", "time to target"] if target else []),
    ]  # fmt: skip


def _row(r: pd.Series, trained: bool, target: bool) -> list[str]:
    method = r["variant"]
    if r["few_syncs"]:
        syncs = int(r["sync_count_min"])
        method += f" {FEW_SYNCS} {syncs} sync" + ("" if syncs == 1 else "s")
    cells = [
        method,
        str(r["runs"]),
        r["seeds"],
        _spread_cell(r, "tokens_per_s", _count, _count),
        *([_spread_cell(r, "trained_tokens_per_s", _count, _count)] if trained else []),
        _ratio_cell(r, "ratio_to_allreduce", _times, _half_times),
        _ratio_cell(r, "utilisation", _percent, _half_percent),
        _spread_cell(r, "compute_utilisation", _percent, _half_percent),
        _num(r["wire_bytes_per_token"], ",.1f"),
        _times(r["wire_reduction"]),
        _spread_cell(r, "final_val_loss", _loss, _loss),
        _ratio_cell(r, "loss_ratio_to_allreduce", _change, _half_percent)
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
    if _nan(target):
        return (
            "Tokens and time to target: not computed (no allreduce run in this group to set the target); "
            "pass --target-loss."
        )
    return f"Target validation loss: {target:.3f} (allreduce's final {target / TARGET_FACTOR:.3f} x {TARGET_FACTOR})."


def _regime_table(group: pd.DataFrame) -> str:
    """Regime-matched groups: the raw ratio, utilisation, and the ratio normalized to the target regime."""
    target_r = group["regime_target_r"].iloc[0]
    rows = [
        [
            r["variant"],
            _ratio_cell(r, "ratio_to_allreduce", _times, _half_times),
            _ratio_cell(r, "utilisation", _percent, _half_percent),
            # local is utilisation's reference: its normalized ratio is 1 + R_target by definition.
            f"{1 + target_r:.1f}x (by definition)"
            if r["utilisation_pairing"] == "reference"
            else _ratio_cell(r, "normalized_ratio", _times, _half_times),
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
            _spread_cell(r, "waited_s", lambda v: f"{v:,.2f} s", lambda v: f"{v:,.2f}"),
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
    return (_nan(up) and _nan(down)) or up == down


def markdown(table: pd.DataFrame, runs: pd.DataFrame, sites: pd.DataFrame | None = None) -> str:
    """The comparison as markdown: a legend, one section per comparable group (with its per-site table where
    `sites`, from site_comparison, has rows for it), then the failed runs."""
    parts = [LEGEND + "\n"]
    for key, group in table.groupby(GROUP_KEYS, sort=True, dropna=False):
        profile, model, clusters, stages, steps = key
        link = _link(group["link_rate_bps"].iloc[0])
        trained = any(_differs(a, b) for a, b in zip(group["tokens_per_s"], group["trained_tokens_per_s"], strict=True))
        target = not _nan(group["target_loss"].iloc[0])
        parts.append(
            f"### {profile} ({link}) · model {model} · {clusters} clusters x {stages} stage(s) · {steps} steps\n\n"
            + _target_line(group)
            + "\n"
        )
        text = markdown_table(_columns(trained, target), [_row(r, trained, target) for _, r in group.iterrows()])
        if group["few_syncs"].any():
            text += (
                f"\n\n{FEW_SYNCS}: its runs crossed the slow link fewer than {MIN_SYNCS} times, so its throughput says "
                "little about communication; use more --steps or a smaller --local-steps."
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
    failed = runs[runs["status"] != "ok"]
    if not failed.empty:
        lines = [f"- {r['path']}: {r['failure']}" for _, r in failed.iterrows()]
        parts.append(f"{len(failed)} failed run(s), left out of the table:\n" + "\n".join(lines) + "\n")
    return "\n".join(parts)


# --- files -------------------------------------------------------------------------------------------------------


def parquet_engine() -> str | None:
    for engine in ("pyarrow", "fastparquet"):
        if importlib.util.find_spec(engine) is not None:
            return engine
    return None


def write_csv(table: pd.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path, index=False)
    return path


def write_parquet(table: pd.DataFrame, path: Path) -> Path:
    """Parquet needs pyarrow or fastparquet; neither is a dependency, so say so instead of failing deep in pandas."""
    engine = parquet_engine()
    if engine is None:
        raise ReportError(
            f"cannot write {path}: parquet needs pyarrow or fastparquet and neither is installed "
            "(pip install pyarrow), or use --csv"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(path, engine=engine, index=False)
    return path


def write_tables(tables: RunTables, folder: Path) -> list[Path]:
    """The tidy tables as folder/runs.csv, folder/events.csv and folder/sites.csv."""
    return [
        write_csv(tables.runs, folder / "runs.csv"),
        write_csv(tables.events, folder / "events.csv"),
        write_csv(tables.sites, folder / "sites.csv"),
    ]
