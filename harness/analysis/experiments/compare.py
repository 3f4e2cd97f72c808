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

What is found in it: harness/analysis/report/time_to_target.py. Rerunning the same command resumes both sweeps
(finished runs are skipped) and writes the outputs again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from harness.analysis.experiments.sweep import IndexRow, SilentObserver, SweepObserver, run_sweep
from harness.analysis.plan import TRACES_DIR, Combination, CompareSpec
from harness.analysis.report.time_to_target import Comparison, analyse
from harness.run import runner


def validate_compare(spec: CompareSpec) -> None:
    """CompareSpec.validate, and every run's link checked against what this machine can emulate (as
    experiments/sweep.py's validate_sweep)."""
    spec.validate(link_check=runner.resolve_link_emulator)


def run_compare(
    spec: CompareSpec,
    out: Path,
    force: bool = False,
    observer: SweepObserver | None = None,
    command: str | None = None,
) -> Comparison:
    """Run what is not finished yet and compare it; report/compare.py's write_outputs writes the comparison's
    files.

    Seed by seed, as a sweep goes: one seed's full runs (round-robin over profiles and methods), then its traces, so
    a trace runs close in time to the full runs it is checked against on a machine whose speed drifts.
    """
    validate_compare(spec)
    traces = spec.trace_sweep()
    total = len(spec.full_sweep().combinations()) + (len(traces.combinations()) if traces is not None else 0)
    counted = _Counted(observer or SilentObserver(), total)
    for seed in spec.seeds:
        one = dataclasses.replace(spec, seeds=(seed,))
        run_sweep(one.full_sweep(), out, force=force, observer=counted, command=command)
        traces = one.trace_sweep()
        if traces is not None:
            run_sweep(traces, out / TRACES_DIR, force=force, observer=counted, command=command)
    return analyse(spec, out)


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
