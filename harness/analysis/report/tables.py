"""Results folders -> tidy tables, built from the files alone (summary.json and events/*.jsonl, read through
harness/run/folder.py), so results copied from another machine report the same; paths are kept relative to the
folder the user named:

    runs    one row per run: the summary's figures, `variant` (the method and the options that differ from its
            defaults: harness/analysis/options.py, which also gives `options`, `options_given`, `options_recorded`
            and `options_commit`), `path`, the run's compute ceiling and `compute_utilisation` (below), and
            `in_sample`: its sweep (sweep.json's `selected_on`) says its method's settings were chosen on its seed
    events  one row per step or eval event of every rank, with `elapsed_s`: training wall-clock since the first step
            started, evaluation time left out (evaluation is identical for all methods and not training)
    sites   one row per run and cluster: the summary's `per_cluster` (the site's uplink and downlink rates, the wire
            bytes its uplink carried, and `comm_blocked_s`, the time its replica waited on the link)
    link_trace  one row per sample and cluster of a run that replayed a trace (link_trace.jsonl,
            harness/run/linktrace.py): `t_s`, `tx_bytes`, `backlog_bytes`, `trace_rate_bps`, `trace_delay_ms`

A run folder that cannot be read (a damaged summary.json or events file) is left out and listed in `skipped`, so one
bad folder does not hide a sweep's other runs.

compute_utilisation measures each run against its own machine: a shared machine moves tokens/s by tens of percent
from one run to the next. The run's compute ceiling is tokens per step / the median forward+backward time
(`compute_s`) of its steps after the throughput warm-up on rank 0 (with pipeline stages, the slowest stage of cluster
0's); compute_utilisation = tokens/s over that ceiling. A method that hides all its communication is near 1 whatever
the machine's speed (a little below: the optimizer step is not in compute_s).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.analysis.options import run_options_in, unique_labels
from harness.analysis.report.replica_spans import replica_spans
from harness.run.folder import (
    ResultsError,
    RunPaths,
    UnreadableResults,
    find_run_dirs,
    read_config,
    read_events,
    read_link_trace,
    read_summary,
    runs_without_summary,
)

# What makes two runs comparable: everything but the method and the seed. A loss per token compares only under one
# tokenizer.
GROUP_KEYS = ["profile", "model", "clusters", "stages", "steps", "tokenizer"]
# finish: communication a method completed after its last step (its blocked time is inside that step's step_s).
EVENT_KINDS = ("step", "eval", "finish")
_SUMMARY_SCALARS = (
    "run_id", "status", "failure", "method", "profile", "link_rate_bps", "backend", "clusters", "stages", "model",
    "param_count", "seed", "steps", "tokens", "trained_tokens", "applied_tokens", "throughput_warmup_steps", "wall_s",
    "tokens_per_s", "trained_tokens_per_s", "wire_bytes", "wire_bytes_per_token", "payload_bytes", "sync_count",
    "comm_blocked_s", "comm_overlapped_s", "overlap_hidden_fraction", "final_train_loss", "final_val_loss",
    "initial_val_loss", "final_val_bpb", "tokenizer", "val_tokens", "eval_s",
    "link_busbw_bps", "regime_target_r", "link_max_excess", "link_conforms", "link_emulator",
    "link_rtt_ms", "link_rtt_target_ms", "link_loss_measured", "link_loss_target", "link_check_ok",
    "link_trace_error", "link_trace_windows", "host_other_cpu_share", "host_steal_share",
    "fault_tolerance", "goodput_tokens_per_s", "ft_applied_fraction", "rounds_discarded",
)  # fmt: skip


@dataclass(frozen=True)
class Skipped:
    """A run folder left out of the tables: the file that could not be read, and why."""

    path: Path
    why: str


@dataclass(frozen=True)
class RunTables:
    """The tidy tables (module doc), and the run folders left out of them because a file could not be read."""

    runs: pd.DataFrame
    events: pd.DataFrame
    sites: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    skipped: tuple[Skipped, ...] = ()
    link_trace: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    # Per replica of a fault-tolerant run: its training, down and healing spans (replica_spans.py).
    replica_spans: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)


def skipped_note(skipped: Sequence[Skipped]) -> str:
    """'skipped 1 unreadable run: <file>: <why>', for the end of a report that left runs out."""
    runs = "run" if len(skipped) == 1 else "runs"
    return f"skipped {len(skipped)} unreadable {runs}: " + "; ".join(f"{s.path}: {s.why}" for s in skipped)


def missing(value: object) -> bool:
    return value is None or bool(pd.isna(value))


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
    usable = not (missing(tokens_per_s) or math.isnan(ceiling))
    return {
        "compute_ceiling_tokens_per_s": ceiling,
        "compute_utilisation": tokens_per_s / ceiling if usable else math.nan,
    }


def _val_tokens_of(config: dict) -> int | None:
    """The held-out tokens of an evaluation, for runs from before the summary recorded them (where seq_len was given;
    the model's context otherwise, which config.json does not hold)."""
    train = config.get("train") or {}
    sizes = [train.get(k) for k in ("eval_batches", "batch_size", "seq_len")]
    return math.prod(sizes) if all(isinstance(v, int) for v in sizes) else None


@dataclass(frozen=True)
class _Run:
    """One run folder's rows of the three tables."""

    row: dict
    events: list[dict]
    sites: list[dict]
    link_trace: list[dict]
    replica_spans: list[dict]


def _read_run(run_dir: Path, relative: str) -> _Run:
    summary = read_summary(run_dir)
    sites = [{"run_id": summary["run_id"], **site} for site in summary.get("per_cluster") or []]
    row = {key: summary.get(key) for key in _SUMMARY_SCALARS}
    # Runs from before --tokenizer existed trained on bytes.
    row["tokenizer"] = row["tokenizer"] or "bytes"
    config = read_config(run_dir)
    if row["val_tokens"] is None:
        row["val_tokens"] = _val_tokens_of(config)
    options = run_options_in(run_dir, summary)
    row.update(_fault_tolerance_columns(summary, config))
    # Runs under random failures are variants of their own: a failure rate is not the method's setting.
    failures = f" (mtbf {row['mtbf_s']:g} s)" if row["mtbf_s"] is not None else ""
    row.update(
        variant=options.label + failures, variant_key=options.key + failures, options=json.dumps(options.resolved),
        options_given=json.dumps(options.given), options_recorded=options.recorded, options_commit=options.commit,
        path=relative,
    )  # fmt: skip
    by_rank = {
        rank: [e for e in read_events(run_dir, rank) if e["kind"] in EVENT_KINDS]
        for rank in RunPaths(run_dir).event_ranks()
    }
    events = [{"run_id": summary["run_id"], **e} for rank_events in by_rank.values() for e in _elapsed(rank_events)]
    row.update(_ceiling_columns(summary, by_rank))
    if row["eval_s"] is None:
        evals = [e for e in by_rank.get((summary.get("stages") or 1) - 1, []) if e["kind"] == "eval"]
        row["eval_s"] = sum(e.get("eval_s") or 0.0 for e in evals) if evals else None
    row["in_sample"] = summary.get("seed") in _selected_on(run_dir).get(summary.get("method"), [])
    spans = replica_spans(summary["run_id"], summary, by_rank)
    return _Run(row, events, sites, _link_trace_rows(summary["run_id"], run_dir), spans)


def _selected_on(run_dir: Path) -> dict[str, list[int]]:
    """The seeds each method's settings were chosen on, as the sweep that holds `run_dir` (OUT/runs/<name>)
    records them (`harness sweep --selected-on`); {} for a run of no sweep, or of one that recorded none."""
    sweep_file = run_dir.parent.parent / "sweep.json"
    if run_dir.parent.name != "runs" or not sweep_file.is_file():
        return {}
    try:
        selected = json.loads(sweep_file.read_text()).get("selected_on") or {}
    except (OSError, ValueError, AttributeError) as err:
        raise UnreadableResults(sweep_file, f"not a sweep's record ({type(err).__name__})") from None
    return selected


def _fault_tolerance_columns(summary: dict, config: dict) -> dict:
    """A fault-tolerant run's failure rate (its config's mtbf_s), failures, and its heals' means (mtbf_s None and
    the rest missing for a run without fault tolerance)."""
    heals = [h for h in summary.get("heals") or [] if h.get("healed_to_step") is not None]
    mtbf_s = (config.get("fault_tolerance") or {}).get("mtbf_s")
    kills = [f for f in config.get("faults") or [] if f.startswith("kill:")]
    return {
        "mtbf_s": mtbf_s,
        # What failed on purpose: the random failures' rate, the --fault kills, or nothing (the reference).
        "failure_plan": f"mtbf {mtbf_s:g} s" if mtbf_s is not None else " ".join(kills) or "none",
        "failures": len(summary["heals"]) if summary.get("fault_tolerance") else None,
        "heal_s": sum(h["heal_s"] for h in heals) / len(heals) if heals else None,
        "heal_bytes_ratio": (
            sum(h["heal_received_bytes"] / h["heal_state_bytes"] for h in heals) / len(heals)
            if heals and all(h["heal_received_bytes"] for h in heals)
            else None
        ),
    }


def _link_trace_rows(run_id: str, run_dir: Path) -> list[dict]:
    rows = []
    for record in read_link_trace(run_dir):
        if record["kind"] != "sample":
            continue
        uplinks = zip(record["tx_bytes"], record["backlog_bytes"], strict=True)
        rows += [
            {
                "run_id": run_id, "cluster": cluster, "t_s": record["t_s"], "tx_bytes": tx, "backlog_bytes": backlog,
                "trace_rate_bps": record.get("trace_rate_bps"), "trace_delay_ms": record.get("trace_delay_ms"),
            }
            for cluster, (tx, backlog) in enumerate(uplinks)
        ]  # fmt: skip
    return rows


def load_runs(paths: Sequence[Path]) -> RunTables:
    """The tidy tables of every run folder under `paths` (module doc); raises ResultsError when none is readable."""
    runs: list[_Run] = []
    unreadable: list[UnreadableResults] = []
    for run_dir, relative in find_run_dirs(paths):
        try:
            runs.append(_read_run(run_dir, relative))
        except UnreadableResults as err:
            unreadable.append(err)
    skipped = tuple(Skipped(err.path, err.why) for err in unreadable) + tuple(
        Skipped(run_dir, "no summary.json (the run did not finish writing it)")
        for run_dir in runs_without_summary(paths)
    )
    if len(unreadable) == 1 and not runs:
        raise unreadable[0]
    if not runs:
        raise ResultsError(
            f"none of the {len(skipped)} run folders under {', '.join(map(str, paths))} is readable "
            f"({skipped_note(skipped)}); run them again or remove them"
        )
    runs_table = pd.DataFrame([run.row for run in runs])
    labels = unique_labels(dict(zip(runs_table["variant_key"], runs_table["variant"], strict=True)))
    runs_table["variant"] = runs_table["variant_key"].map(labels)
    event_table = pd.DataFrame([e for run in runs for e in run.events])
    if not event_table.empty:
        labels = runs_table[["run_id", "method", "variant", "profile", "model", "seed", "stages"]]
        event_table = event_table.merge(labels, on="run_id", how="left")
    return RunTables(
        runs_table,
        event_table,
        pd.DataFrame([s for run in runs for s in run.sites]),
        skipped,
        pd.DataFrame([row for run in runs for row in run.link_trace]),
        pd.DataFrame([row for run in runs for row in run.replica_spans]),
    )


def in_group(table: pd.DataFrame, key: tuple) -> pd.DataFrame:
    """The rows of `table` in the comparable group `key` (values of GROUP_KEYS, in order)."""
    return table[(table[GROUP_KEYS] == pd.Series(key, index=GROUP_KEYS)).all(axis=1)]


def eval_curve(events: pd.DataFrame) -> pd.DataFrame:
    """Validation events as the summary reads them: from the last stage of cluster 0 (rank stages - 1)."""
    if events.empty or "val_loss" not in events:
        return pd.DataFrame(columns=["run_id", "step", "tokens", "val_loss", "elapsed_s"])
    evals = events[(events["kind"] == "eval") & (events["rank"] == events["stages"] - 1)]
    return evals.sort_values(["run_id", "step"])
