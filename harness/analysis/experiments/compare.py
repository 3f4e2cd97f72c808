"""`harness compare`'s runs: the comparison's two sweeps (harness/analysis/plan.py's CompareSpec), seed by seed.

A compare folder OUT is a sweep folder (harness/analysis/experiments/sweep.py) with the comparison's own outputs
beside it:

    OUT/sweep.json, index.csv, runs/   the full runs: every method x --profile x seed, all to the same steps unless
                                       --method-steps says otherwise (so to the same applied tokens: every method
                                       applies every trained token by the end), plus the unshaped runs that give a
                                       composed profile its trajectory where that profile is not measured too
    OUT/traces/                        a sweep folder of its own: the short runs on each --composed profile whose step
                                       times are composed with the trajectories
                                       (harness/analysis/projection/composition.py)
    OUT/compare.json, compare.md, compare.csv, figures/   (harness/analysis/report/compare.py, compare_figures.py)

    OUT/profiles/<target>.yaml, .json   with --regime: the link derived for the published regime when the study
                                       started (harness/analysis/experiments/regime.py), reused when it resumes
    OUT/compute/compute.json            with --composed and no --regime: the compute time per step measured when the
                                       study started (`local`, unshaped), reused when it resumes

A trace is made long enough in wall-clock to average a machine whose speed drifts (MIN_TRACE_S,
harness/analysis/projection/composition.py): its steps come from its step time on its composed link as the link model
predicts it (predicted_run_s) from the compute time measured when the study started (--regime's T_c, or
OUT/compute/). A method composed on several links shares one trace length, the one its slowest-stepping link needs
(the fewest steps), so that link's trace stays affordable; on a faster link the trace may then last less than
MIN_TRACE_S, and is flagged not steady.

With --regime the comparison derives its link first, from `local` measured then, so the study runs at the regime it
claims; on that link every method whose run the link model predicts to take at most --measure-limit here is
measured end to end, and the rest (AllReduce, typically) are composed from a trace on it and their full runs on the
first link measured whole (a split link: CompareSpec.composed_methods).

What is found in it: harness/analysis/report/time_to_target.py. Rerunning the same command resumes both sweeps
(finished runs are skipped) and writes the outputs again.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.analysis.experiments.regime import check_request, measure_compute, regime_profile
from harness.analysis.experiments.sweep import IndexRow, SilentObserver, SweepObserver, run_sweep
from harness.analysis.plan import TRACES_DIR, TRAJECTORY_PROFILE, Combination, CompareSpec, SweepSpec
from harness.analysis.projection.link_model import LinkModel, ProjectionError, default_window_bytes, schedule
from harness.analysis.projection.regime import get_target
from harness.analysis.report.time_to_target import Comparison, analyse
from harness.run import runner

# --measure-limit's default: a run predicted to take longer on the regime link is composed instead.
MEASURE_LIMIT_S = 1800.0


def validate_compare(spec: CompareSpec) -> None:
    """CompareSpec.validate, and every run's link checked against what this machine can emulate (as
    experiments/sweep.py's validate_sweep). A --regime link still to be derived is stood in for by an unshaped one,
    so a typo costs nothing."""
    if spec.regime is not None and not spec.predicted_run_s:
        check_request(spec.regime, spec.settings)
        spec = dataclasses.replace(spec, profiles=(*spec.profiles, TRAJECTORY_PROFILE))
    spec.validate(link_check=runner.resolve_link_emulator)


def predicted_run_s(spec: CompareSpec, method: str, profile: str, compute_s: float) -> float:
    """The link model's time for `method`'s full run on `profile` at `compute_s` a step (harness/analysis/projection/
    link_model.py): what decides whether it is measured there. A step's compression is left out, so it errs short."""
    one = dataclasses.replace(spec, profiles=(profile,), composed=(), composed_methods={})
    config = one.full_sweep().config(Combination(method, profile, spec.seeds[0]))
    steps = config.train.steps
    try:
        plan = schedule(config, LinkModel.of(config.profile, config.clusters, window_bytes=default_window_bytes()))
    except ProjectionError:  # local: nothing crosses the link
        return steps * compute_s
    return plan.window_s(compute_s, compute_s, steps, 0)


def with_regime_link(
    spec: CompareSpec,
    out: Path,
    force: bool,
    measure_limit_s: float,
    progress: Callable[[str], None] = lambda line: None,
) -> CompareSpec:
    """`spec` with its --regime link derived (or the one derived when the study started) and split: measured for
    the methods predicted to finish within `measure_limit_s`, composed for the others (module doc). `progress` is
    told of the derivation's measurements."""
    path, _ = regime_profile(spec.regime, dict(spec.settings), out, force, progress=progress)
    compute_s = float(json.loads(path.with_suffix(".json").read_text())["compute_s"])
    link = str(path)
    predicted = {m: predicted_run_s(spec, m, link, compute_s) for m in spec.methods}
    slow = tuple(m for m in spec.methods if predicted[m] > measure_limit_s)
    return dataclasses.replace(
        spec,
        profiles=(*spec.profiles, link),
        composed=(*spec.composed, link) if slow else spec.composed,
        composed_methods={**spec.composed_methods, link: slow} if slow else spec.composed_methods,
        predicted_run_s=predicted,
        measure_limit_s=measure_limit_s,
    )


def with_trace_step_s(spec: CompareSpec, out: Path, progress: Callable[[str], None] = lambda line: None) -> CompareSpec:
    """`spec` with each composed method's predicted step time on its composed links (module doc): the longest over
    them, which plans the fewest steps. T_c is measured once per study, even with --force, so that its traces keep
    their length."""
    if spec.regime is not None:
        compute_s = float(
            json.loads((out / "profiles" / f"{get_target(spec.regime).name}.json").read_text())["compute_s"]
        )
    else:
        record = out / "compute" / "compute.json"
        if not record.is_file():
            measured = measure_compute(dict(spec.settings), record.parent, progress)
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"compute_s": measured}, indent=2) + "\n")
        compute_s = float(json.loads(record.read_text())["compute_s"])
    step_s: dict[str, float] = {}
    for link in spec.composed:
        for method in spec.composed_on(link):
            steps = spec.full_config(method).train.steps
            predicted = predicted_run_s(spec, method, link, compute_s) / steps
            step_s[method] = max(step_s.get(method, 0.0), predicted)
    return dataclasses.replace(spec, trace_step_s=step_s)


def run_compare(
    spec: CompareSpec,
    out: Path,
    force: bool = False,
    observer: SweepObserver | None = None,
    command: str | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> Comparison:
    """Run what is not finished yet and compare it; report/compare_files.py's write_outputs writes the comparison's
    files.

    With --regime (spec.regime), its link is derived first (with_regime_link). Seed by seed, and within a seed
    method by method: a method's full runs (round-robin over profiles) and its traces side by side (_paired), so a
    trace sees the same host as the full run it is checked against on a machine whose speed drifts.
    """
    validate_compare(spec)
    if spec.regime is not None and not spec.predicted_run_s:
        spec = with_regime_link(spec, out, force, spec.measure_limit_s or MEASURE_LIMIT_S, progress)
        validate_compare(spec)
    if spec.composed and not spec.trace_step_s:
        spec = with_trace_step_s(spec, out, progress)
    traces = spec.trace_sweep()
    total = len(spec.full_sweep().combinations()) + (len(traces.combinations()) if traces is not None else 0)
    counted = _Counted(observer or SilentObserver(), total)
    for position, seed in enumerate(spec.seeds):
        one = dataclasses.replace(spec, seeds=(seed,))
        for sweep, folder in _paired(one, out, trace_first=position % 2 == 1):
            run_sweep(sweep, folder, force=force, observer=counted, command=command)
    return analyse(spec, out)


def _paired(one_seed: CompareSpec, out: Path, trace_first: bool) -> list[tuple[SweepSpec, Path]]:
    """One seed's sweeps, method by method: its full runs and its traces next to each other. The order within a pair
    alternates from seed to seed (trace_first), so a host that slows or speeds up steadily biases composed / measured
    one way on half the seeds and the other way on the rest, instead of the same way on all of them (a trace's
    tokens/s over its full run's ranged 0.84-1.36 when every method's full runs came before the traces). Each part
    keeps its sweep's settings (sweep.json) and only skips the other methods' runs."""
    parts = [(one_seed.full_sweep(), out)]
    traces = one_seed.trace_sweep()
    if traces is not None:
        parts.append((traces, out / TRACES_DIR))
    if trace_first:
        parts.reverse()
    return [(_only(sweep, method), folder) for method in one_seed.methods for sweep, folder in parts]


def _only(sweep: SweepSpec, method: str) -> SweepSpec:
    others = {(m, p) for m in sweep.methods if m != method for p in sweep.profiles}
    return dataclasses.replace(sweep, skip=sweep.skip | others)


@dataclasses.dataclass
class _Counted:
    """Positions over the whole comparison: its sweeps run seed by seed, and each counts only its own runs (the
    progress once read "run 2/2" twice for four runs)."""

    observer: SweepObserver
    total: int
    done: int = 0

    def started(self, combo: Combination, position: int, total: int) -> None:
        self.observer.started(combo, self.done + 1, self.total)

    def progress(self, state: dict[str, Any]) -> None:
        self.observer.progress(state)

    def finished(self, row: IndexRow) -> None:
        self.done += 1
        self.observer.finished(row)
