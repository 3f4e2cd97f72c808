"""`harness compare`'s report (harness/analysis/report/time_to_target.py's Comparison) as people read it: the
markdown table per profile with its notes, the one-line summaries and composed vs measured (the files they go to:
harness/analysis/report/compare_files.py).

Every composed figure carries its label: the table's "how" column, the summary line's "composed estimate", the CSV's
and JSON's `how`, the figure's legend. A composed row whose trace failed the steadiness check
(harness/analysis/projection/composition.py) is marked with FLAG and its reason is in the notes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd

from harness.analysis.plan import BASELINE, CEILING, TRACES_DIR, profile_name
from harness.analysis.projection.composition import MIN_ROUNDS, MIN_STEADY_STEPS, STEADY_TOLERANCE, Cadence
from harness.analysis.projection.regime import REGIME_TOLERANCE
from harness.analysis.report.markdown import (
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
)
from harness.analysis.report.time_to_target import COMPOSED, MEASURED, Comparison
from harness.run.host_cpu import HOST_BUSY_SHARE

FLAG = "⚠"
HEADER = [
    "how", "method", "n", "steps", "time to target", "speed-up vs allreduce", "applied tokens/s",
    "utilisation (vs local)", "wire B/token", "final val loss", "loss vs allreduce (equal tokens)",
]  # fmt: skip
LEGEND = (
    "n: runs (seeds). Each figure is the mean, then ± the 95% confidence half-width (Student t) when n ≥ 3, the range "
    '(min–max) when n = 2, or "n=1, no spread"; time to target is over the runs that reached it. Speed-up is '
    "allreduce's time to target over the method's, utilisation the method's tokens/s over local's, and the loss gap "
    "the method's validation loss over allreduce's at the largest token count both evaluated: each paired per seed."
)


def ratio_cell(r: pd.Series, name: str, fmt: Callable[[float], str], half: Callable[[float], str]) -> str:
    """A paired ratio's cell: 1 for the reference itself, "n/a" without a reference (comparison.ratio's pairing)."""
    how = r[f"{name}_pairing"]
    if how == "reference":
        return fmt(1.0)
    if not how or blank(r[name]):
        return "n/a"
    if how == "ratio of means":
        return f"{fmt(r[name])} (ratio of means)"
    return spread_cell(r, name, fmt, half)


def _seconds(value: float) -> str:
    return f"{value:,.1f} s"


def half_figure(value: float) -> str:
    # Equal figures differ by float rounding only; 5.3e-07 would read as a measured spread.
    return half_times(value) if abs(value) >= 5e-3 else "0"


def unsteady(r: pd.Series) -> bool:
    """A composed row whose trace failed the steadiness check (its reasons are in `trace_problems`)."""
    problems = r.get("trace_problems")
    return r["how"] == COMPOSED and isinstance(problems, str) and bool(problems)


def how_label(r: pd.Series) -> str:
    """'measured', 'composed', or 'composed ⚠' for a composed row whose trace is not steady."""
    return f"{COMPOSED} {FLAG}" if unsteady(r) else str(r["how"])


def time_cell(r: pd.Series) -> str:
    if not r["reached"]:
        return f"not reached (best {r['best_val_loss']:.3f})"
    partial = "" if r["reached"] == r["runs"] else f" ({r['reached']}/{r['runs']} reached)"
    return spread_cell(r, "time_to_target_s", _seconds, half_figure) + partial


def variant_label(r: pd.Series) -> str:
    """The variant, marked where it is reported on seeds that chose its settings (--selected-on)."""
    return in_sample_label(r["variant"], r.get("in_sample_seeds"))


def _row(r: pd.Series) -> list[str]:
    return [
        how_label(r),
        variant_label(r),
        str(r["runs"]),
        str(r["steps"]),
        time_cell(r),
        ratio_cell(r, "speedup", times, half_figure),
        spread_cell(r, "tokens_per_s", count, count),
        ratio_cell(r, "utilisation", percent, half_percent),
        spread_cell(r, "wire_bytes_per_token", lambda v: f"{v:,.1f}", lambda v: f"{v:,.1f}"),
        spread_cell(r, "final_val_loss", lambda v: f"{v:.3f}", lambda v: f"{v:.3f}"),
        ratio_cell(r, "loss_vs_allreduce", change, half_percent),
    ]


def target_line(comparison: Comparison) -> str:
    target = comparison.target_loss
    if comparison.target_source == "given":
        return f"Target validation loss: {target:.4g} (--target-loss)."
    return f"Target validation loss: {target:.4g} ({comparison.target_rule})."


def settings_notes(comparison: Comparison) -> list[str]:
    """The steps and per-method settings every reading of the table needs (always printed)."""
    record = comparison.spec.record()
    steps = record["steps"]
    same = len(set(steps.values())) == 1
    lines = [
        f"Steps: {next(iter(steps.values()))} for every method (the same applied tokens)."
        if same
        else "Steps per method (--method-steps): " + ", ".join(f"{m} {s}" for m, s in steps.items()) + "."
    ]
    fixed = [f"{m}: " + ", ".join(f"{k}={v}" for k, v in o.items()) for m, o in record["per_method"].items()]
    lines.append("Per-method settings (--set METHOD.KEY=VALUE): " + ("; ".join(fixed) if fixed else "none") + ".")
    lines.append("Synchronization: " + ", ".join(_cadence(m, c) for m, c in comparison.spec.cadences().items()) + ".")
    shared = {k: v for k, v in record["settings"].items() if k != "steps"}
    if shared:
        lines.append("Shared settings: " + ", ".join(f"{k}={v}" for k, v in shared.items()) + ".")
    if line := _validation_cost(comparison.runs):
        lines.append(line)
    return lines


def _validation_cost(runs: pd.DataFrame) -> str | None:
    """How much held-out text each validation read and what evaluating cost the measured runs (left out of every
    time in the table)."""
    measured = runs[runs["how"] == MEASURED]
    tokens = pd.to_numeric(measured["val_tokens"], errors="coerce").dropna()
    if tokens.empty:
        return None
    count = f"{tokens.iloc[0]:,.0f}" if tokens.nunique() == 1 else f"{tokens.min():,.0f}-{tokens.max():,.0f}"
    eval_s = pd.to_numeric(measured["eval_s"], errors="coerce").dropna()
    cost = (
        f"; evaluating took {eval_s.mean():.1f} s a measured run (mean), left out of every time" if len(eval_s) else ""
    )
    return f"Validation: {count} held-out tokens an evaluation, the same windows for every method and seed{cost}."


def _cadence(method: str, cadence: Cadence) -> str:
    """'dilocox every 10 steps at first (it adapts H)': the rounds its config declares."""
    if cadence.every_steps == 1:
        return f"{method} every step"
    return f"{method} every {cadence.every_steps} steps" + (" at first (it adapts H)" if cadence.adaptive else "")


def composition_notes(comparison: Comparison) -> list[str]:
    """How the composed rows were made, and which of their traces are not to be trusted."""
    record = comparison.spec.record()
    if not record["composed"]:
        return []
    sources = ", ".join(f"{p} from its {t} runs" for p, t in record["trajectories"].items())
    lengths = ", ".join(f"{m} {s}" for m, s in record["trace_steps"].items())
    lines = [
        f"{COMPOSED} (an estimate, not a measurement): the validation-loss trajectory of a full run ({sources}; the "
        "per-step losses do not depend on the link) composed with the step times of a short trace run on the "
        f"profile ({lengths} steps, in {TRACES_DIR}/): its own steps up to the first round boundary after warm-up, "
        f"then its steady-state mean step time over whole synchronization rounds (at least {MIN_ROUNDS} rounds and "
        f"{MIN_STEADY_STEPS} steps; {FLAG}: the trace's two halves differ by more than {STEADY_TOLERANCE:.0%}, or it "
        "is too short). Composed tokens/s is tokens per step over that mean."
    ]
    for _, r in comparison.rows.iterrows():
        if unsteady(r):
            lines.append(
                f"{FLAG} {r['variant']} on {r['profile']} ({COMPOSED}): trace not steady: {r['trace_problems']}."
            )
    lines.extend(_composition_error_notes(comparison.rows))
    adaptive = [m for m, c in comparison.spec.cadences().items() if c.adaptive]
    if adaptive:
        lines.append(
            f"{', '.join(adaptive)} {'adapts its' if len(adaptive) == 1 else 'adapt their'} rounds during a run: the "
            f"trace holds the first rounds, which send the most bytes per step, so the {COMPOSED} time is likely an "
            "overestimate."
        )
    return lines


def _composition_error_notes(rows: pd.DataFrame) -> list[str]:
    """Which composed figures carry the composition's own error, and which could not (time_to_target's
    _with_composition_error)."""
    widened = [
        f"{r['variant']} on {r['profile']} (composed / measured {r['composition_error_low']:.3f}x–"
        f"{r['composition_error_high']:.3f}x)"
        for _, r in rows.iterrows()
        if r["how"] == COMPOSED and r["composition_error"] == "included"
    ]
    unchecked = [
        f"{r['variant']} on {r['profile']}" for _, r in rows.iterrows() if r["composition_error"] == "not checked"
    ]
    lines = []
    if widened:
        lines.append(
            "Composed intervals include the composition's own error, as this study checked it where the same method "
            "ran both ways: " + "; ".join(widened) + ". Time to target, tokens/s and every speed-up over or of a "
            "composed figure are widened by it (an interval shown as its two ends is no longer symmetric)."
        )
    if unchecked:
        lines.append(
            "Not checked in this study (no link where the method ran both measured and composed), so its interval is "
            "the seeds' alone: " + ", ".join(unchecked) + "."
        )
    return lines


def host_busy_note(comparison: Comparison) -> str | None:
    """The runs whose times were taken while other processes held more than HOST_BUSY_SHARE of the host's CPU
    (harness/run/host_cpu.py): a compute-bound method's time there is slower than this host can do. None where no
    timed run was busy (or none recorded it: runs from before it was)."""
    runs = comparison.runs
    if "host_other_cpu_share" not in runs:
        return None
    busy = runs[pd.to_numeric(runs["host_other_cpu_share"], errors="coerce") > HOST_BUSY_SHARE]
    if busy.empty:
        return None
    named = ", ".join(
        f"{r['variant']} on {r['profile']} seed {r['seed']}"
        + (" (its trace)" if r["how"] == COMPOSED else "")
        + f" {r['host_other_cpu_share']:.0%}"
        for _, r in busy.iterrows()
    )
    return (
        f"{FLAG} host busy: other processes took more than {HOST_BUSY_SHARE:.0%} of the host's CPU during "
        f"{len(busy)} timed run(s) ({named}): those times are slower than this host can do; rerun them on a quiet "
        "host (the runs' host_other_cpu_share)."
    )


def control_note(group: pd.DataFrame) -> str | None:
    """The flag for a target that `local`, which never communicates, reaches: a speed-up to it says nothing about
    communication. None where local did not run or reached it on no seed."""
    control = group[(group["method"] == CEILING) & (group["reached"] > 0)]
    if control.empty:
        return None
    r = control.iloc[0]
    return (
        f"{FLAG} {CEILING} reaches the target ({r['reached']} of {r['runs']} seeds, {r['how']}) without ever "
        "communicating: this target does not measure communication; pass a lower --target-loss or more --steps."
    )


def regime_note(group: pd.DataFrame) -> str | None:
    """On a regime-matched link: AllReduce's R achieved in this study against the target's, flagged beyond
    REGIME_TOLERANCE. None elsewhere, or without both AllReduce and local."""
    allreduce = group[group["method"] == BASELINE]
    if allreduce.empty or math.isnan(allreduce.iloc[0]["regime_target_r"]) or blank(allreduce.iloc[0]["achieved_r"]):
        return None
    r = allreduce.iloc[0]
    off = r["achieved_r"] / r["regime_target_r"] - 1
    flag = f" {FLAG} more than {REGIME_TOLERANCE:.0%} off" if abs(off) > REGIME_TOLERANCE else ""
    achieved = spread_cell(r, "achieved_r", lambda v: f"{v:.1f}", lambda v: f"{v:.1f}")
    return (
        f"achieved R (allreduce's step time over local's, minus 1, in this study): {achieved} against the link's "
        f"target {r['regime_target_r']:.1f} ({off:+.0%}){flag}."
    )


def split_note(comparison: Comparison, profile: str) -> str | None:
    """On a --regime link split between measured and composed methods: which are which, and why."""
    spec = comparison.spec
    link = spec.regime_link
    if link is None or profile_name(link) != profile:
        return None
    composed = spec.composed_methods.get(link, ())
    limit_min = (spec.measure_limit_s or 0) / 60
    hours = ", ".join(f"{m} {spec.predicted_run_s[m] / 3600:.1f} h" for m in composed)
    how = (
        f"composed: {', '.join(composed)} (the link model predicts {hours} end to end here, over --measure-limit "
        f"{limit_min:g} min); every other method measured end to end, and its speed-up divides a composed AllReduce "
        "time by a measured one"
        if composed
        else "every method measured end to end"
    )
    return f"Derived for --regime {spec.regime} when this study started, from local measured then; {how}."


def _profile_notes(group: pd.DataFrame) -> list[str]:
    notes = [note] if (note := control_note(group)) else []
    if note := regime_note(group):
        notes.append(note)
    if group["in_sample_seeds"].astype(bool).any():
        notes.append(
            "in-sample: reported on seeds its settings were chosen on (--selected-on), so its figures favour it; "
            "read the rows on other seeds."
        )
    if not (group["method"] == CEILING).any():
        notes.append(f"utilisation: n/a ({CEILING} did not run; add it to --methods).")
    if not (group["method"] == BASELINE).any():
        notes.append(f"speed-up and loss gap: n/a (no {BASELINE} in --methods).")
    return notes


def validation_table(comparison: Comparison) -> str:
    """Composed vs measured time to target, where a profile is both (empty otherwise)."""
    table = comparison.validation
    if table.empty:
        return ""
    rows = [
        [
            r["profile"], r["variant"], str(int(r["measured_s_n"])),
            spread_cell(r, "measured_s", _seconds, half_figure), spread_cell(r, "composed_s", _seconds, half_figure),
            ratio_cell(r, "composed_over_measured", lambda v: f"{v:.3f}x", half_times),
        ]
        for _, r in table.iterrows()
    ]  # fmt: skip
    header = ["profile", "method", "n", "measured time to target", f"{COMPOSED} time to target", "composed / measured"]
    worst = table["composed_over_measured"].dropna()
    line = ""
    if len(worst):
        far = worst.loc[(worst - 1).abs().idxmax()]
        line = f"\n\nLargest deviation of {COMPOSED} from measured: {100 * (far - 1):+.1f}%."
    return f"{COMPOSED.capitalize()} vs measured time to target:\n\n" + markdown_table(header, rows, 2) + line


def compare_markdown(comparison: Comparison, command: str | None = None) -> str:
    parts = ["# harness compare\n"]
    if command:
        parts.append(f"Command: `{command}`\n")
    parts.append(" ".join([target_line(comparison), *settings_notes(comparison)]) + "\n")
    parts.append(LEGEND + "\n")
    for profile, group in comparison.rows.groupby("profile", sort=False):
        hows = " and ".join(dict.fromkeys(group["how"]))
        text = f"## {profile} ({hows})\n\n" + markdown_table(HEADER, [_row(r) for _, r in group.iterrows()], 2)
        notes = _profile_notes(group)
        if note := split_note(comparison, profile):
            notes.insert(0, note)
        parts.append(text + ("\n\n" + " ".join(notes) if notes else "") + "\n")
    validation = validation_table(comparison)
    if validation:
        parts.append(validation + "\n")
    notes = composition_notes(comparison)
    if busy := host_busy_note(comparison):
        notes.append(busy)
    notes.append(
        "The speed-up at other targets, from AllReduce's loss at a quarter of its tokens down to its final loss: "
        "speedup_vs_target.csv and figures/speedup-vs-target-*.png (harness/analysis/report/target_curve.py)."
    )
    if comparison.failed:
        notes.append(f"{len(comparison.failed)} run(s) left out: " + "; ".join(comparison.failed))
    if notes:
        parts.append("\n".join(f"- {n}" for n in notes) + "\n")
    return "\n".join(parts)


def summary_lines(comparison: Comparison) -> list[str]:
    """One line per profile, how and method: its time to target and speed-up, labelled measured or composed."""
    lines = []
    for _, r in comparison.rows.iterrows():
        label = "composed estimate" if r["how"] == COMPOSED else MEASURED
        flag = f" {FLAG} trace not steady" if unsteady(r) else ""
        head = f"{r['profile']} ({label}{flag}): {variant_label(r)}"
        if not r["reached"]:
            lines.append(f"{head} did not reach {comparison.target_loss:.4g} (best {r['best_val_loss']:.3f})")
            continue
        line = f"{head} reached {comparison.target_loss:.4g} in {time_cell(r)}"
        if r["speedup_pairing"] not in ("", "reference") and not blank(r["speedup"]):
            line += f", speed-up over allreduce {ratio_cell(r, 'speedup', times, half_figure)}"
        lines.append(line)
    for profile, group in comparison.rows.groupby("profile", sort=False):
        for note in (control_note(group), regime_note(group)):
            if note:
                lines.append(f"{profile}: {note}")
    for _, r in comparison.validation.iterrows():
        if blank(r["composed_over_measured"]):  # never reached the target (local): no time to set beside another
            continue
        lines.append(
            f"{r['profile']}: {r['variant']} {COMPOSED} {_seconds(r['composed_s'])} vs measured "
            f"{_seconds(r['measured_s'])}: {COMPOSED} / measured = "
            f"{ratio_cell(r, 'composed_over_measured', lambda v: f'{v:.3f}x', half_figure)}"
        )
    return lines
