"""Results folders -> tidy tables -> the comparison a reader wants: speed, bytes, loss, relative to AllReduce.

Two tables, built from the files alone (summary.json and events/*.jsonl), so results copied from another machine
report the same; paths are kept relative to the folder the user named:

    runs    one row per run: the summary's figures plus `variant` (method and its options) and `path`
    events  one row per step or eval event of every rank, with `elapsed_s`: training wall-clock since the first step
            started, evaluation time left out (evaluation is identical for all methods and not training)

The comparison groups runs that are comparable (same profile, model, cluster shape and step count) and, per
variant, aggregates over seeds. Ratios are taken between group means: tokens/s over AllReduce's, AllReduce's wire
bytes per token over the variant's (the reduction), tokens/s over `local`'s (utilisation: local never
communicates, so it is the compute ceiling). Time and tokens to a target loss come from the first evaluation at or
below the target; the default target is the highest final validation loss of the group's synchronized methods
(local is left out: its loss is one unsynchronized replica's), so every such run reaches it.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.errors import UserError
from harness.events import read_events
from harness.units import format_rate

# What makes two runs comparable: everything but the method and the seed.
GROUP_KEYS = ["profile", "model", "clusters", "stages", "steps"]
BASELINE = "allreduce"
CEILING = "local"
# finish: communication a method completed after its last step (its blocked time is inside that step's step_s).
EVENT_KINDS = ("step", "eval", "finish")
_SUMMARY_SCALARS = (
    "run_id", "status", "failure", "method", "profile", "link_rate_bps", "backend", "clusters", "stages", "model",
    "param_count", "seed", "steps", "tokens", "throughput_warmup_steps", "wall_s", "tokens_per_s", "wire_bytes",
    "wire_bytes_per_token", "payload_bytes", "sync_count", "comm_blocked_s", "comm_overlapped_s",
    "overlap_hidden_fraction", "final_train_loss", "final_val_loss", "initial_val_loss", "link_busbw_bps",
)  # fmt: skip


class ReportError(UserError):
    """Nothing to report on, or an output that cannot be written; the message names the fix."""


@dataclass(frozen=True)
class RunTables:
    runs: pd.DataFrame
    events: pd.DataFrame


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


def load_runs(paths: Sequence[Path]) -> RunTables:
    runs, events = [], []
    for run_dir, relative in find_run_dirs(paths):
        summary = json.loads((run_dir / "summary.json").read_text())
        row = {key: summary.get(key) for key in _SUMMARY_SCALARS}
        options = summary.get("method_options") or {}
        row.update(variant=variant_of(summary["method"], options), options=json.dumps(options), path=relative)
        runs.append(row)
        for rank_file in sorted((run_dir / "events").glob("rank*.jsonl")):
            rank_events = [e for e in read_events(rank_file) if e.get("kind") in EVENT_KINDS]
            events += [{"run_id": summary["run_id"], **e} for e in _elapsed(rank_events)]
    runs_table = pd.DataFrame(runs)
    event_table = pd.DataFrame(events)
    if not event_table.empty:
        labels = runs_table[["run_id", "method", "variant", "profile", "model", "seed", "stages"]]
        event_table = event_table.merge(labels, on="run_id", how="left")
    return RunTables(runs_table, event_table)


def eval_curve(events: pd.DataFrame) -> pd.DataFrame:
    """Validation events as the summary reads them: from the last stage of cluster 0 (rank stages - 1)."""
    if events.empty or "val_loss" not in events:
        return pd.DataFrame(columns=["run_id", "step", "tokens", "val_loss", "elapsed_s"])
    evals = events[(events["kind"] == "eval") & (events["rank"] == events["stages"] - 1)]
    return evals.sort_values(["run_id", "step"])


def _reach(evals: pd.DataFrame, target: float) -> tuple[float, float]:
    """(tokens, elapsed seconds) at the first evaluation at or below `target`; NaN when never reached."""
    hit = evals[evals["val_loss"] <= target]
    if hit.empty:
        return math.nan, math.nan
    first = hit.iloc[0]
    return float(first["tokens"]), float(first["elapsed_s"])


def default_target(group: pd.DataFrame) -> float:
    synchronized = group[group["method"] != CEILING]["final_val_loss"].dropna()
    losses = synchronized if not synchronized.empty else group["final_val_loss"].dropna()
    return float(losses.max()) if not losses.empty else math.nan


def comparison(tables: RunTables, target_loss: float | None = None) -> pd.DataFrame:
    """One row per (comparable group, variant) over the successful runs; raw numbers (module doc)."""
    ok = tables.runs[tables.runs["status"] == "ok"].copy()
    if ok.empty:
        raise ReportError("no successful runs to compare (every run failed); see each run's summary.json")
    evals = eval_curve(tables.events)
    rows = []
    for group_key, group in ok.groupby(GROUP_KEYS, sort=True, dropna=False):
        target = target_loss if target_loss is not None else default_target(group)
        reached = {}
        for run_id in group["run_id"]:
            reached[run_id] = _reach(evals[evals["run_id"] == run_id], target)
        for variant, runs in group.groupby("variant", sort=False):
            tokens_to = [reached[r][0] for r in runs["run_id"] if not math.isnan(reached[r][0])]
            time_to = [reached[r][1] for r in runs["run_id"] if not math.isnan(reached[r][1])]
            rows.append(
                {
                    **dict(zip(GROUP_KEYS, group_key, strict=True)),
                    "variant": variant,
                    "method": runs["method"].iloc[0],
                    "seeds": ",".join(str(s) for s in sorted(runs["seed"].unique())),
                    "runs": len(runs),
                    "link_rate_bps": runs["link_rate_bps"].iloc[0],
                    "tokens_per_s": runs["tokens_per_s"].mean(),
                    "tokens_per_s_std": runs["tokens_per_s"].std(),
                    "wire_bytes_per_token": runs["wire_bytes_per_token"].mean(),
                    "sync_count": runs["sync_count"].mean(),
                    "final_val_loss": runs["final_val_loss"].mean(),
                    "final_val_loss_std": runs["final_val_loss"].std(),
                    "target_loss": target,
                    "reached": len(tokens_to),
                    "tokens_to_target": sum(tokens_to) / len(tokens_to) if tokens_to else math.nan,
                    "time_to_target_s": sum(time_to) / len(time_to) if time_to else math.nan,
                }
            )
    # The baseline first and the ceiling last, so every table reads the same way.
    order = {BASELINE: 0, CEILING: 2}
    table = pd.DataFrame(rows)
    table["_order"] = table["method"].map(lambda m: order.get(m, 1))
    table = table.sort_values([*GROUP_KEYS, "_order", "variant"]).drop(columns="_order").reset_index(drop=True)
    table["ratio_to_allreduce"] = _relative(table, BASELINE, "tokens_per_s", inverse=False)
    # A variant that never synchronized (local) sends only connection set-up bytes: a reduction would be noise.
    table["wire_reduction"] = _relative(table, BASELINE, "wire_bytes_per_token", inverse=True).where(
        table["sync_count"] > 0
    )
    table["utilisation"] = _relative(table, CEILING, "tokens_per_s", inverse=False)
    return table


def _relative(table: pd.DataFrame, reference: str, column: str, inverse: bool) -> pd.Series:
    """column / the reference variant's in the same group (or reference's / column's); NaN without a reference."""
    ref = table[table["variant"] == reference].set_index(GROUP_KEYS)[column]
    ref_values = table.set_index(GROUP_KEYS).index.map(lambda key: ref.get(key, math.nan))
    ref_values = pd.Series(list(ref_values), index=table.index, dtype=float)
    values = table[column].astype(float)
    return ref_values / values if inverse else values / ref_values


# --- markdown ----------------------------------------------------------------------------------------------------


def _num(value: float, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _mean_std(mean: float, std: float, fmt: str) -> str:
    text = _num(mean, fmt)
    return text if math.isnan(std) or text == "-" else f"{text} ± {format(std, fmt)}"


def _percent(share: float) -> str:
    return "-" if math.isnan(share) else f"{100 * share:.3g}%"


def _link(rate_bps: float | None) -> str:
    return "unshaped" if rate_bps is None or pd.isna(rate_bps) else format_rate(rate_bps)


def _times(value: float) -> str:
    if math.isnan(value):
        return "-"
    return "inf" if math.isinf(value) else f"{value:.3g}x"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int = 1) -> str:
    """A GitHub markdown table; the first `text_columns` left-aligned, the numbers after them right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    left = set(range(text_columns))

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(":" + "-" * (w + 1) if i in left else "-" * (w + 1) + ":" for i, w in enumerate(widths))
    return "\n".join([line(header), rule + "|", *(line(r) for r in rows)])


COLUMNS = (
    "method", "seeds", "tokens/s", "vs allreduce", "utilisation", "wire B/token", "wire reduction",
    "final val loss", "tokens to target", "time to target",
)  # fmt: skip


def _row(r: pd.Series) -> list[str]:
    partial = "" if r["reached"] in (0, r["runs"]) else f" ({r['reached']}/{r['runs']} runs)"
    return [
        r["variant"],
        r["seeds"],
        _mean_std(r["tokens_per_s"], r["tokens_per_s_std"], ",.0f"),
        _times(r["ratio_to_allreduce"]),
        _percent(r["utilisation"]),
        _num(r["wire_bytes_per_token"], ",.1f"),
        _times(r["wire_reduction"]),
        _mean_std(r["final_val_loss"], r["final_val_loss_std"], ".3f"),
        _num(r["tokens_to_target"], ",.0f") + partial if r["reached"] else "not reached",
        _num(r["time_to_target_s"], ",.1f") + " s" if r["reached"] else "not reached",
    ]


def markdown(table: pd.DataFrame, runs: pd.DataFrame) -> str:
    """The comparison as markdown: one section per comparable group, then the failed runs."""
    parts = []
    for key, group in table.groupby(GROUP_KEYS, sort=True, dropna=False):
        profile, model, clusters, stages, steps = key
        link = _link(group["link_rate_bps"].iloc[0])
        parts.append(
            f"### {profile} ({link}) · model {model} · {clusters} clusters x {stages} stage(s) · {steps} steps\n\n"
            f"Target validation loss: {group['target_loss'].iloc[0]:.3f}. "
            "Means over seeds (± standard deviation); ratios of group means.\n"
        )
        parts.append(markdown_table(COLUMNS, [_row(r) for _, r in group.iterrows()]) + "\n")
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
    """The tidy tables as folder/runs.csv and folder/events.csv."""
    return [write_csv(tables.runs, folder / "runs.csv"), write_csv(tables.events, folder / "events.csv")]
