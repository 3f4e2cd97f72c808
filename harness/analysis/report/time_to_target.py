"""`harness compare`'s finding, read from a compare folder (its runs: harness/analysis/experiments/compare.py): on
each link, how much sooner than AllReduce does each method reach a given loss? (Its markdown, CSV and JSON:
harness/analysis/report/compare.py; its figures: harness/analysis/report/compare_figures.py.)

Per profile, how (below) and method, over its seeds, each figure as harness/analysis/report/aggregates.py aggregates
it (the mean with n, and its 95% interval for n >= 3 or range for n = 2): the time to the target loss (the first
evaluation at or below it), the speed-up over AllReduce in that time (AllReduce's time over the method's, paired per
seed), applied tokens/s, utilisation (tokens/s over local's, paired per seed; n/a where local did not run), wire
bytes per applied token, the final validation loss, and the loss at equal tokens over AllReduce's (each at the
largest token count both evaluated, interpolated between evaluations; the final losses where their steps agree),
paired per seed.

The target defaults to one that measures communication (aggregates.default_target): halfway between the highest final
validation loss AllReduce ended at on any seed and the lowest loss local, which never communicates, reached on any
seed, over the full runs (the loss does not depend on the link); x 1.05 on AllReduce's mean final loss where no local
ran. --target-loss gives it instead, and is the only way to compare without AllReduce, which then leaves the
speed-ups and loss gaps out.

Every row says how its times were got: "measured" (the full run on the link) or "composed" (the trajectory composed
with a trace on the link, harness/analysis/projection/composition.py); a composed figure is never shown without that
label. Where a profile is both measured and composed, the composed time to target is set beside the measured one,
their ratio paired per seed: the check that the composition holds. That check's interval then goes into the composed
figures it can be carried to (_with_composition_error): on a link where a method is only composed, its time to
target, tokens/s and the speed-ups that divide by or into it are widened to cover composed / measured as this study
measured it for the same method.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.analysis.plan import (
    BASELINE,
    CEILING,
    TRACES_DIR,
    Combination,
    CompareError,
    CompareSpec,
    profile_name,
)
from harness.analysis.projection.composition import Trace, read_trace
from harness.analysis.report.aggregates import (
    DefaultTarget,
    Spread,
    default_target,
    ratio,
    reach,
    spread,
    spread_columns,
)
from harness.analysis.report.tables import RunTables, eval_curve, load_runs
from harness.run.folder import RunPaths

MEASURED, COMPOSED = "measured", "composed"
SPLIT = "split"  # a link where some methods are measured and the others composed (CompareSpec.composed_methods)
# Per-run figures aggregated with their spread into each row (module doc).
FIGURES = ("time_to_target_s", "tokens_to_target", "tokens_per_s", "wire_bytes_per_token", "final_val_loss")


@dataclass(frozen=True)
class Comparison:
    """What a comparison found (module doc)."""

    spec: CompareSpec
    target_loss: float
    target_source: str  # BASELINE (the default) or "given"
    target_rule: str  # how the default was derived (aggregates.DefaultTarget.rule); "" when given
    target_label: str  # the rule in a few words (DefaultTarget.label); "--target-loss" when given
    rows: pd.DataFrame  # one per (profile, how, variant): the aggregates
    runs: pd.DataFrame  # one per (profile, how, variant, seed): the per-run figures
    curves: pd.DataFrame  # one per (profile, how, variant, seed, evaluation): tokens, val_loss, elapsed_s
    validation: pd.DataFrame  # one per (profile, variant) measured and composed: composed vs measured time to target
    failed: tuple[str, ...] = ()  # "run name: why" of the runs left out


@dataclass(frozen=True)
class _Loaded:
    """The finished runs of one sweep folder, by combination name, and what kept the others out."""

    tables: RunTables
    by_name: dict[str, pd.Series]
    failed: tuple[str, ...]


def _load(folder: Path, combos: Sequence[Combination]) -> _Loaded:
    names = [c.name for c in combos]
    present = [folder / "runs" / n for n in names if RunPaths(folder / "runs" / n).summary.is_file()]
    failed = []
    index = folder / "index.csv"
    if index.is_file():
        rows = pd.read_csv(index)
        for _, r in rows[rows["name"].isin(names) & (rows["status"] != "ok")].iterrows():
            failed.append(f"{r['name']}: {r['failure']}")
    if not present:
        return _Loaded(RunTables(pd.DataFrame(), pd.DataFrame()), {}, tuple(failed))
    tables = load_runs(present)
    failed += [f"{s.path}: {s.why}" for s in tables.skipped]
    ok = tables.runs[tables.runs["status"] == "ok"]
    by_name = {r["path"]: r for _, r in ok.iterrows()}
    return _Loaded(tables, by_name, tuple(dict.fromkeys(failed)))


def _curve(loaded: _Loaded, run: pd.Series) -> pd.DataFrame:
    evals = eval_curve(loaded.tables.events)
    return evals[evals["run_id"] == run["run_id"]][["step", "tokens", "val_loss", "elapsed_s"]].reset_index(drop=True)


def _steps_of(loaded: _Loaded, run: pd.Series) -> tuple[pd.DataFrame, bool]:
    """The step events of the rank whose evaluations count (the last stage of cluster 0), and whether the run logged
    a `finish` event there."""
    events = loaded.tables.events
    mine = events[(events["run_id"] == run["run_id"]) & (events["rank"] == events["stages"] - 1)]
    return mine[mine["kind"] == "step"], bool((mine["kind"] == "finish").any())


def _figures(profile: str, how: str, run: pd.Series, curve: pd.DataFrame, target: float) -> dict[str, Any]:
    tokens, seconds = reach(curve, target) if len(curve) else (math.nan, math.nan)
    return {
        "profile": profile_name(profile),
        "how": how,
        "variant": run["variant"],
        "method": run["method"],
        "seed": int(run["seed"]),
        "steps": int(run["steps"]),
        "time_to_target_s": seconds,
        "tokens_to_target": tokens,
        # 1 / time: AllReduce's time over a method's is then aggregates.ratio of this column.
        "speed": 1 / seconds if seconds > 0 else math.nan,
        "tokens_per_s": float(run["tokens_per_s"]),
        "wire_bytes_per_token": float(run["wire_bytes_per_token"]),
        "final_val_loss": float(run["final_val_loss"]),
        "best_val_loss": float(curve["val_loss"].min()) if len(curve) else math.nan,
        "regime_target_r": pd.to_numeric(run.get("regime_target_r"), errors="coerce"),
        "val_tokens": pd.to_numeric(run.get("val_tokens"), errors="coerce"),
        "eval_s": pd.to_numeric(run.get("eval_s"), errors="coerce"),
        # The run whose step times the row's time comes from (the trace, for a composed row): absent before it was
        # recorded (harness/run/host_cpu.py).
        "host_other_cpu_share": pd.to_numeric(run.get("host_other_cpu_share"), errors="coerce"),
        "timed_run": run["path"],
    }


def _measured(spec: CompareSpec, full: _Loaded, target: float) -> tuple[list[dict], list[pd.DataFrame]]:
    figures, curves = [], []
    for combo in spec.full_sweep().combinations():
        run = full.by_name.get(combo.name)
        if combo.profile not in spec.profiles or run is None:
            continue
        curve = _curve(full, run)
        figures.append(_figures(combo.profile, MEASURED, run, curve, target))
        curves.append(_labelled(curve, figures[-1]))
    return figures, curves


def _labelled(curve: pd.DataFrame, figures: dict[str, Any]) -> pd.DataFrame:
    return curve.assign(**{k: figures[k] for k in ("profile", "how", "variant", "method", "seed")})


def _composed_run(trajectory: pd.Series, trace_run: pd.Series, trace: Trace) -> dict[str, Any]:
    """What the trace adds to a composed run's figures."""
    tokens_per_step = float(trace_run["tokens"]) / float(trace_run["steps"])
    return {
        "tokens_per_s": tokens_per_step / trace.steady_step_s if trace.steady_step_s > 0 else math.nan,
        "trace_steps": int(trace_run["steps"]),
        "trace_window_steps": trace.window_steps,
        "trace_rounds": trace.rounds,
        "trace_step_s": trace.steady_step_s,
        "trace_drift": trace.drift,
        "trace_problem": trace.problem,
        "trajectory": trajectory["path"],
        "trace": trace_run["path"],
        "host_other_cpu_share": pd.to_numeric(trace_run.get("host_other_cpu_share"), errors="coerce"),
        "timed_run": trace_run["path"],
    }


def _composed(spec: CompareSpec, full: _Loaded, traces: _Loaded, target: float) -> tuple[list[dict], list]:
    figures, curves = [], []
    cadences = spec.cadences() if spec.composed else {}
    for combo in spec.trace_sweep().combinations() if spec.composed else []:
        source = Combination(combo.method, spec.trajectory_of(combo.profile), combo.seed)
        trajectory, trace_run = full.by_name.get(source.name), traces.by_name.get(combo.name)
        if trajectory is None or trace_run is None:
            continue
        steps, finished = _steps_of(traces, trace_run)
        trace = read_trace(steps, cadences[combo.method], finished)
        curve = _curve(full, trajectory)
        curve = curve.assign(elapsed_s=[trace.time_to(int(s)) for s in curve["step"]])
        row = _figures(combo.profile, COMPOSED, trajectory, curve, target)
        row.update(_composed_run(trajectory, trace_run, trace), trajectory_profile=profile_name(source.profile))
        figures.append(row)
        curves.append(_labelled(curve, row))
    return figures, curves


def _target(spec: CompareSpec, full: _Loaded) -> DefaultTarget:
    """The given target, or aggregates.default_target over every full run (the loss does not depend on the link)."""
    if spec.target_loss is not None:
        return DefaultTarget(spec.target_loss, "", "--target-loss")
    runs = full.tables.runs
    ok = runs[runs["status"] == "ok"] if not runs.empty else runs
    target = default_target(ok, eval_curve(full.tables.events)) if not ok.empty else DefaultTarget(math.nan, "")
    if math.isnan(target.loss):
        raise CompareError(
            f"no {BASELINE} run finished, so there is no default target (see the failures in index.csv); "
            "rerun to retry them, or pass --target-loss"
        )
    return target


def loss_at_tokens(curve: pd.DataFrame, tokens: float) -> float:
    """The validation loss at `tokens`, interpolated between the evaluations around it."""
    return float(np.interp(tokens, curve["tokens"].astype(float), curve["val_loss"].astype(float)))


def _equal_token_losses(mine: pd.DataFrame, reference: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per seed both have: each one's loss at the largest token count both evaluated (module doc)."""
    rows_mine, rows_ref = [], []
    for seed, curve in mine.groupby("seed"):
        theirs = reference[reference["seed"] == seed]
        if curve.empty or theirs.empty:
            continue
        tokens = min(curve["tokens"].max(), theirs["tokens"].max())
        rows_mine.append({"seed": seed, "loss_at_equal_tokens": loss_at_tokens(curve, tokens)})
        rows_ref.append({"seed": seed, "loss_at_equal_tokens": loss_at_tokens(theirs, tokens)})
    columns = ["seed", "loss_at_equal_tokens"]
    return pd.DataFrame(rows_mine, columns=columns), pd.DataFrame(rows_ref, columns=columns)


def _against(name: str, mine: pd.DataFrame, reference: pd.DataFrame, column: str, is_reference: bool) -> dict:
    """aggregates.ratio of `column` as spread columns, and how it was paired ("" where there is no reference)."""
    if is_reference:
        value, how = Spread(1.0, len(mine)), "reference"
    elif reference.empty:
        value, how = Spread(math.nan, 0), ""
    else:
        value, how = ratio(mine, reference, column)
    return {**spread_columns(name, value), f"{name}_pairing": how}


def _variant_row(spec: CompareSpec, runs: pd.DataFrame, group: pd.DataFrame, curves: pd.DataFrame) -> dict[str, Any]:
    first = runs.iloc[0]
    variant, method = first["variant"], first["method"]
    ar = group[group["method"] == BASELINE]
    local = group[group["method"] == CEILING]
    row = {k: first[k] for k in ("profile", "how", "variant", "method")}
    row.update(steps=int(runs["steps"].max()), seeds=",".join(str(s) for s in sorted(runs["seed"])), runs=len(runs))
    row["in_sample_seeds"] = ",".join(str(s) for s in spec.in_sample_seeds(method, [int(s) for s in runs["seed"]]))
    for figure in FIGURES:
        row.update(spread_columns(figure, spread(runs[figure])))
    row["reached"] = int(runs["time_to_target_s"].notna().sum())
    row["best_val_loss"] = float(runs["best_val_loss"].min())
    row.update(_against("speedup", runs, ar, "speed", method == BASELINE))
    row.update(_against("utilisation", runs, local, "tokens_per_s", method == CEILING))
    row.update(_achieved_r(runs, local, group))
    mine_eq, ar_eq = _equal_token_losses(curves[curves["variant"] == variant], curves[curves["method"] == BASELINE])
    row.update(_against("loss_vs_allreduce", mine_eq, ar_eq, "loss_at_equal_tokens", method == BASELINE))
    if first["how"] == COMPOSED:
        problems = [
            f"seed {r['seed']}: {r['trace_problem']}" for _, r in runs.iterrows() if isinstance(r["trace_problem"], str)
        ]
        row.update(
            trace_steps=int(runs["trace_steps"].max()),
            trace_window_steps=int(runs["trace_window_steps"].min()),
            trace_steady=not problems,
            trace_problems="; ".join(problems),
            trajectory_profile=first["trajectory_profile"],
        )
    return row


def _achieved_r(runs: pd.DataFrame, local: pd.DataFrame, group: pd.DataFrame) -> dict[str, Any]:
    """R = the run's step time over local's, minus 1 (local's tokens/s over the run's, paired per seed): how
    communication-bound the run was in this study. AllReduce's is the link's regime R (harness/analysis/projection/
    regime.py), measured when the study ran rather than when the link was derived. The link's target R is the
    profile's: a composed run (no run of its own on the link) takes it from the group's measured ones."""
    value, how = ratio(local, runs, "tokens_per_s") if not local.empty else (Spread(math.nan, 0), "")
    shifted = Spread(value.mean - 1, value.n, value.low - 1, value.high - 1)
    target = runs["regime_target_r"].dropna()
    if target.empty:
        target = group["regime_target_r"].dropna()
    return {
        **spread_columns("achieved_r", shifted),
        "achieved_r_pairing": how,
        "regime_target_r": float(target.iloc[0]) if not target.empty else math.nan,
    }


def _order(methods: Sequence[str]) -> dict[str, int]:
    """The baseline first and the ceiling last (as harness report), the rest as --methods lists them."""
    middle = [m for m in methods if m not in (BASELINE, CEILING)]
    return {m: i for i, m in enumerate([BASELINE, *middle, CEILING])}


def _rows(spec: CompareSpec, runs: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    order = _order(spec.methods)
    profiles = {profile_name(p): i for i, p in enumerate(dict.fromkeys([*spec.profiles, *spec.composed]))}
    split = {profile_name(p) for p in spec.composed_methods}
    rows = []
    for (profile, how), group in runs.groupby(["profile", "how"], sort=False):
        # On a split link each method is either measured or composed: AllReduce and local are found in either.
        if profile in split:
            group = runs[runs["profile"] == profile]
        mine = curves[(curves["profile"] == profile) & ((curves["how"] == how) | (profile in split))]
        for _, variant_runs in group[group["how"] == how].groupby("variant", sort=False):
            rows.append(_variant_row(spec, variant_runs.sort_values("seed"), group, mine))
    table = pd.DataFrame(rows)
    keys = pd.DataFrame(
        {
            "p": table["profile"].map(profiles),
            "h": table["how"].map({MEASURED: 0, COMPOSED: 1}),
            "m": table["method"].map(order),
        }
    )
    return table.loc[keys.sort_values(["p", "h", "m"], kind="stable").index].reset_index(drop=True)


def _validation(spec: CompareSpec, runs: pd.DataFrame) -> pd.DataFrame:
    """Per profile both measured and composed, per variant: the two times to target and composed / measured, paired
    per seed."""
    rows = []
    both = (profile_name(p) for p in spec.composed if p in spec.profiles and p not in spec.composed_methods)
    for profile in both:
        mine = runs[runs["profile"] == profile]
        for variant, both in mine.groupby("variant", sort=False):
            measured, composed = both[both["how"] == MEASURED], both[both["how"] == COMPOSED]
            value, how = ratio(composed, measured, "time_to_target_s")
            rows.append(
                {
                    "profile": profile,
                    "variant": variant,
                    "method": both["method"].iloc[0],
                    **spread_columns("measured_s", spread(measured["time_to_target_s"])),
                    **spread_columns("composed_s", spread(composed["time_to_target_s"])),
                    **spread_columns("composed_over_measured", value),
                    "composed_over_measured_pairing": how,
                }
            )
    return pd.DataFrame(rows)


def _composition_errors(validation: pd.DataFrame) -> dict[str, tuple[float, float]]:
    """Per variant, the interval of composed / measured time to target over the links it was checked on (their
    union; the mean alone where n = 1)."""
    errors: dict[str, tuple[float, float]] = {}
    for _, r in validation.iterrows():
        mean = r["composed_over_measured"]
        if pd.isna(mean):
            continue
        low, high = r["composed_over_measured_low"], r["composed_over_measured_high"]
        low, high = (mean, mean) if pd.isna(low) else (low, high)
        seen = errors.get(r["variant"], (low, high))
        errors[r["variant"]] = (min(seen[0], low), max(seen[1], high))
    return errors


def _widened(row: dict[str, Any], name: str, low_factor: float, high_factor: float) -> None:
    """`name`'s interval stretched outwards by the factors (each only ever widens); a figure without an interval
    (n < 2) gets one from the factors alone."""
    mean, low, high = row[name], row[f"{name}_low"], row[f"{name}_high"]
    if pd.isna(mean):
        return
    low, high = (mean, mean) if pd.isna(low) else (low, high)
    row[f"{name}_low"], row[f"{name}_high"] = low * min(1.0, low_factor), high * max(1.0, high_factor)


def _with_composition_error(rows: pd.DataFrame, validation: pd.DataFrame) -> pd.DataFrame:
    """Rows whose figures rest on a composition not checked on their own link, widened by the error the check found
    for that variant elsewhere in the study (module doc). With r = composed / measured in [r_low, r_high], the true
    time is the composed one over r: time to target widens to [low / r_high, high / r_low], tokens/s to [low x r_low,
    high x r_high], and a speed-up by the method's r (when it is composed) over AllReduce's (when AllReduce is),
    each only outwards. `composition_error_low/high` record the r used (NaN where none was); `composition_error`
    says what was done: "checked here" (the link is the check), "included", "not checked" (a composed row whose
    variant ran both ways on no link of this study), or "" (a measured row no composed figure enters)."""
    errors = _composition_errors(validation)
    checked = set(zip(validation.get("profile", []), validation.get("variant", []), strict=True))
    out = []
    for _, group in rows.groupby("profile", sort=False):
        baseline = group[(group["method"] == BASELINE) & (group["how"] == COMPOSED)]
        base = errors.get(baseline["variant"].iloc[0]) if not baseline.empty else None
        for _, r in group.iterrows():
            row = {**r.to_dict(), "composition_error_low": math.nan, "composition_error_high": math.nan}
            own = errors.get(r["variant"]) if r["how"] == COMPOSED else None
            if (r["profile"], r["variant"]) in checked:
                row["composition_error"] = "checked here"
            elif r["how"] == COMPOSED:
                row["composition_error"] = "included" if own else "not checked"
            else:
                row["composition_error"] = "included" if base and r["method"] != BASELINE else ""
            if row["composition_error"] == "included":
                if own:
                    row["composition_error_low"], row["composition_error_high"] = own
                    _widened(row, "time_to_target_s", 1 / own[1], 1 / own[0])
                    _widened(row, "tokens_per_s", own[0], own[1])
                if r["method"] != BASELINE:
                    mine, theirs = own or (1.0, 1.0), base or (1.0, 1.0)
                    _widened(row, "speedup", mine[0] / theirs[1], mine[1] / theirs[0])
            out.append(row)
    extra = ["composition_error", "composition_error_low", "composition_error_high"]
    return pd.DataFrame(out, columns=[*rows.columns, *extra])


def _unreachable(runs: pd.DataFrame, target: float, out: Path) -> CompareError:
    closest = runs.loc[runs["best_val_loss"].idxmin()]
    return CompareError(
        f"no method reached the target validation loss {target:.4g} on any profile; the closest was "
        f"{closest['variant']} ({closest['how']} on {closest['profile']}, seed {closest['seed']}) with a best "
        f"validation loss of {closest['best_val_loss']:.4g}; the runs are kept in {out}: rerun with a higher "
        "--target-loss (finished runs are reused) or more --steps"
    )


def analyse(spec: CompareSpec, out: Path) -> Comparison:
    """The comparison of the finished runs in `out` (module doc); raises CompareError where there is none."""
    full = _load(out, spec.full_sweep().combinations())
    trace_spec = spec.trace_sweep()
    traces = _load(out / TRACES_DIR, trace_spec.combinations() if trace_spec else [])
    if not full.by_name:
        raise CompareError(f"no run in {out} finished ({'; '.join(full.failed) or 'none ran'}); rerun to retry them")
    chosen = _target(spec, full)
    target = chosen.loss
    measured, measured_curves = _measured(spec, full, target)
    composed, composed_curves = _composed(spec, full, traces, target)
    runs = pd.DataFrame([*measured, *composed])
    if runs.empty:
        raise CompareError(f"no run in {out} finished on the profiles asked for; rerun to retry them")
    if runs["time_to_target_s"].isna().all():
        raise _unreachable(runs, target, out)
    curves = pd.concat([*measured_curves, *composed_curves], ignore_index=True)
    validation = _validation(spec, runs)
    return Comparison(
        spec, target, "given" if spec.target_loss is not None else BASELINE, chosen.rule, chosen.label,
        _with_composition_error(_rows(spec, runs, curves), validation),
        runs, curves, validation, (*full.failed, *traces.failed),
    )  # fmt: skip
