"""The runs `harness check` makes: every run a baseline's checks need (harness/analysis/gate/bands.py's needed_runs),
made by the sweep executor, and, where the baseline names reference code, the same runs of that code
(harness/analysis/experiments/reference_code.py) into OUT/reference-code, method by method in turn with the
checkout's. The check itself only reads them: harness/analysis/gate/check.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.analysis.experiments.reference_code import run_reference
from harness.analysis.experiments.sweep import SweepObserver, run_sweep
from harness.analysis.gate.bands import REFERENCE_CODE_FOLDER, Baseline, needed_runs


def run_needed(
    baseline: Baseline,
    out: Path,
    repeats: int | None = None,
    observer: SweepObserver | None = None,
    reference_code: str | None = None,
) -> None:
    """Run (or resume) every run the baseline's checks need into the sweep folder `out`; with `reference_code`, the
    same runs of that commit's code into out/reference-code, method by method in turn with the checkout's, so that
    both meet the same machine and the same load."""
    specs = needed_runs(baseline, repeats)
    if reference_code is None:
        for spec in specs:
            run_sweep(spec, out, observer=observer)
        return
    for spec in specs:
        for method in spec.methods:
            run_sweep(replace(spec, methods=(method,)), out, observer=observer)
            run_reference(
                replace(baseline, repeats=spec.repeats), reference_code, out / REFERENCE_CODE_FOLDER, [method]
            )
    # Each sweep's index.csv lists the runs of its last call; one more call over all of them (each one finished,
    # so skipped) lists them all.
    for spec in specs:
        run_sweep(spec, out)
    run_reference(replace(baseline, repeats=specs[0].repeats), reference_code, out / REFERENCE_CODE_FOLDER)
