"""The CI gate: each method's own work per step, its wait on the link, its bytes and its loss must stay inside
two-sided bands around a reference, on any machine.

`harness check --baseline FILE` measures what the baseline names (the median of `repeats` short runs it makes, or
the runs --results holds) and holds each metric inside its band; `harness baseline RESULTS --out FILE` writes such a
file from a folder of >= 5 repeats (harness/analysis/gate/baseline.py; the file's model and reading, shared by both:
harness/analysis/gate/bands.py; `harness baseline --diff OLD NEW` says what changed between two). Why these metrics: a
gate on tokens/s, or on its ratio to AllReduce's or local's, moves with the machine's compute speed (AllReduce is
link-bound here, the others compute-bound, so a faster CPU raises their ratios), and on a 2-core machine whose
speed changes 2x from one day to the next a band wide enough for that catches no regression. Each metric below
divides out the machine's speed within the run itself (what is measured of a run: harness/analysis/gate/measures.py):

    metric                   the median over a check's runs of           it catches (the cause printed)
    step_overhead            a step's own time / its forward+backward    compute: a slower step, compression or outer
                                                                         step (a sleep of 15% of DiLoCoX's step: +15%)
    step_time_residual       measured / link-model-predicted window s,   link: an exchange no longer hidden, an extra
                             from the run's own compute                  exchange or round trip, a slower link
    payload_bytes_per_token  bytes handed to collectives / applied token bytes: any change in what the method sends
    wire_overhead            kernel-counted wire bytes / payload bytes   link: retransmissions, framing, messages the
                                                                         method does not count
    final_val_loss           the last evaluation's loss, fixed seed      loss: the update, the data or the numerics

Two of them do move with the machine's kind of CPU. step_overhead weighs a method's compression (memory-bound)
against its forward and backward (compute-bound): two hosts of the pool CI draws from read CocktailSGD's 2.25 and
1.76 with the same code. step_time_residual holds the link model's error, which depends on how the host overlaps
the ranks' compute with their sends: DiLoCoX's read 0.970 on one host and 0.923-0.929 on another, with the code that
made the stored reference. So a baseline may name `reference_code`, a commit of this repository: `harness check` then
makes the same runs with that commit's code on the machine it checks, method by method in turn with the checkout's
(so both meet the same CPU and the same load), and centres each band of these two metrics (Metric.on_machine) on
their median in place of the stored reference (harness/analysis/experiments/reference_code.py, the runs
harness/analysis/experiments/check_runs.py makes); the band's tolerance is
unchanged, and the table's reference column shows the value measured there. A 15% slower step, or an exchange no
longer hidden, is then measured against what the known code does on that very machine, whatever machine it is.
Bytes, wire overhead and loss do not move with the host (five checks on the second host: bytes and loss within
0.05% of the stored references, wire overhead within 0.3%; docs/comparisons.md), so they stay on the stored
references; the check prints how far this machine's reference-code runs read from the stored reference for every
metric. --stored-references holds every band to the file's references.

The baseline file (YAML):

    reference_code: 4715d0bc...          # optional: the commit whose runs on the checking machine centre the
                                         # metrics that move with the machine
    run:                                 # the settings of every run (any sweep setting); `harness check` makes its
      model: tiny                        # runs with them, and refuses --results runs made with others (another
      steps: 40                          # step count, seed, batch size, method option, ...)
      eval_every: 20
      seed: 0
      repeats: 3                         # runs per method a check makes; each metric is the median over them
      methods:                           # options per method
        dilocox: {local_steps: 10, overlap_steps: 5}
    checks:
      - method: dilocox
        profile: 10mbps                  # a profile name, or a path to a profile YAML relative to this file
        step_overhead: {reference: 1.23, noise: 0.011, tolerance: 0.06}
        ...

A band holds when reference / (1 + tolerance) <= measured <= reference x (1 + tolerance): a factor either way, as
fits ratios of positive quantities. Every band is two-sided: a method that got faster, sends less or learns more
than its reference changed too, and a baseline is regenerated on purpose, with `harness baseline --diff` to show
what moved.

How `harness baseline` derives a band from the repeats (baseline.TOLERANCE_K, Metric.floor in bands.py):

    reference  the median over the repeats
    noise      one run's relative standard deviation over the repeats (>= 5 of them)
    tolerance  max(floor, K x noise), K = 3.2

K = 3.2: a check compares the median of its 3 runs with the median of the baseline's 5; for normal noise their
difference has a standard deviation of 0.91 of one run's (sqrt(pi/2 x (1/3 + 1/5))), so the band's edge sits 3.5 of
those out: a false alarm in ~1 of 2,000 checks of a band whose tolerance the noise sets (most sit on their floors),
while a step 15% slower than a reference with 3% noise (CocktailSGD's, the noisiest) still lands 2.3 standard
deviations of a check's median beyond the edge. The floors cover what repeats on one machine in one hour cannot
show (another machine, another load, another day), and were measured so (docs/comparisons.md, "The CI gate"):

    step_overhead            0.06   between the 5 reference repeats and 4 checks over an hour on this machine, and
                                    under `taskset -c 0` (half its compute; local at 5,800 against 13,000 tokens/s),
                                    the medians moved by at most 4% (CocktailSGD, whose memory-bound compression
                                    drifts against the compute-bound forward and backward; the others by at most 2.2%);
                                    a step 15% slower still fails
    step_time_residual       0.05   the medians moved by at most 2.2% the same way (AllReduce's sits between 1 and the
                                    link model's own error as the compute's share of a step changes); an exchange no
                                    longer hidden added 11% at the gate's settings
    payload_bytes_per_token  0.001  fixed by the method, its options and the model: identical in every repeat; the
                                    floor leaves room for an adaptive rank that rounds the other way on another CPU
    wire_overhead            0.015  TCP/IP framing is fixed; retransmissions and ACK timing moved it by at most 0.5%
    final_val_loss           0.002  the training is deterministic at a fixed seed on one build (identical in every
                                    repeat and under taskset); another CPU or thread count sums in another order:
                                    with 2 threads per rank in place of 1 the final losses moved by at most 0.07%

`harness baseline` refuses to write a band that could not catch what it is for (Metric.most: a step 15% slower, an
exchange no longer hidden, 2% more bytes, a loss 0.5% higher): the repeats were too noisy, and the fix is to measure
them on a quieter machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from harness.analysis.gate.bands import (
    METRICS,
    REFERENCE_CODE_FOLDER,
    Band,
    Baseline,
    BaselineError,
    StoredRun,
    differences,
    flat_settings,
    format_value,
    load_stored_runs,
)
from harness.analysis.options import AS_GIVEN
from harness.analysis.plan import applies_to, profile_name
from harness.analysis.report.markdown import markdown_table
from harness.run.config import RunConfig

# --- comparing ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BandResult:
    method: str
    profile: str  # the profile's name
    band: Band
    measured: float | None
    runs: str  # how many runs the value is the median of
    missing: str | None = None  # why there is no value
    # The reference of the baseline file, where the band is centred on the reference code's runs on this machine.
    stored_reference: float | None = None
    # The reference code's median on this machine, for every band where its runs were given (centred or not): how
    # far this machine reads from the stored references' machine.
    reference_code_value: float | None = None

    @property
    def ok(self) -> bool:
        return self.measured is not None and self.band.holds(self.measured)

    @property
    def verdict(self) -> str:
        if self.measured is None:
            return "MISSING"
        if self.ok:
            return "holds"
        return "ABOVE" if self.measured > self.band.upper else "BELOW"

    @property
    def cause(self) -> str:
        """What a value outside the band most likely means (bands.Metric.cause); empty where it holds."""
        if self.ok:
            return ""
        return self.missing or METRICS[self.band.metric].cause


class _Selector:
    """The successful runs of one method on one profile made with the baseline's settings; refuses a folder whose
    runs of that method were all made with other settings (the bands hold only for the baseline's). The reference
    code's runs are held to the settings only: an option added since it was written is not one it could record."""

    def __init__(self, baseline: Baseline, runs: Sequence[StoredRun], where: str, with_options: bool = True):
        self.baseline = baseline
        self.runs = runs
        self.where = where
        self.with_options = with_options
        self.cache: dict[tuple[str, str], list[StoredRun]] = {}

    def __call__(self, method: str, profile: str) -> list[StoredRun]:
        key = (method, profile)
        if key not in self.cache:
            self.cache[key] = self._select(method, profile)
        return self.cache[key]

    def _select(self, method: str, profile: str) -> list[StoredRun]:
        name = profile_name(profile)
        candidates = [r for r in self.runs if r.ok and r.method == method and r.profile == name]
        if not candidates:
            return []
        options = self.baseline.method_options.get(method, {})
        settings = {k: v for k, v in {**self.baseline.settings, **options}.items() if applies_to(k, method)}
        expected = RunConfig.build(method, profile, seed=self.baseline.seed, **settings)
        want = flat_settings(expected.to_dict())
        want_options = expected.resolved_options
        picked = [
            r
            for r in candidates
            if not differences(want, r.settings()) and (not self.with_options or r.options() == want_options)
        ]
        if picked:
            return picked
        run = candidates[0]
        differing = differences(want, run.settings())
        if differing:
            key = differing[0]
            what = f"{key}={run.settings()[key]!r} where the baseline's runs had {key}={want[key]!r}"
        else:
            have = run.options() or {}
            key = next(k for k in {**want_options, **have} if have.get(k) != want_options.get(k))
            what = f"{key}={have.get(key)!r} where the baseline's runs had {key}={want_options.get(key)!r}"
        raise BaselineError(
            f"{self.where} holds {len(candidates)} {method} run(s) on {name} but none made with the baseline's "
            f"settings ({run.path} has {what}); the bands hold only for those settings, so pass runs made with "
            "them, or leave out --results and `harness check` makes them"
        )


def _count(runs: Sequence[StoredRun]) -> str:
    """How many runs; marked where some recorded only their given options (harness/analysis/options.py)."""
    return str(len(runs)) + ("" if all(r.options_recorded for r in runs) else f" {AS_GIVEN}")


def _median(runs: Sequence[StoredRun], key: str) -> float | None:
    values = [v for v in (r.measures.get(key) for r in runs) if v is not None]
    return statistics.median(values) if values else None


def evaluate(
    baseline: Baseline,
    runs: Sequence[StoredRun],
    where: str = "the results",
    reference_runs: Sequence[StoredRun] | None = None,
    reference_where: str = "the reference code's runs",
) -> list[BandResult]:
    """Every band, measured from the medians of the matching successful runs; a band without runs fails. With
    `reference_runs` (the baseline's reference code run on this machine), each band of a metric measured on the
    machine (Metric.on_machine) is centred on their median in place of the stored reference."""
    select = _Selector(baseline, runs, where)
    on_machine = None if reference_runs is None else _Selector(baseline, reference_runs, reference_where, False)
    results = []
    for check in baseline.checks:
        own = select(check.method, check.profile)
        theirs = None if on_machine is None else on_machine(check.method, check.profile)
        for band in check.bands:
            metric = METRICS[band.metric]
            key = metric.measure_key
            measured, missing = _median(own, key), None
            count, stored = _count(own), None
            here = None if theirs is None else _median(theirs, key)
            if theirs is not None and metric.on_machine:
                stored = band.reference
                count = f"{count} vs {len(theirs)}"
                if here is None:
                    missing = f"no {key} of the reference code's {check.method} runs on this machine"
                else:
                    band = replace(band, reference=here)
            if not own:
                missing = f"no successful {check.method} runs"
            elif measured is None:
                missing = f"{check.method}'s runs have no {key}"
            result = BandResult(check.method, check.profile_name, band, measured, count, missing, stored, here)
            results.append(replace(result, measured=None) if missing else result)
    return results


def check(baseline: Baseline, results_dirs: list[Path], reference_dir: Path | None = None) -> list[BandResult]:
    """The bands over the runs in `results_dirs`; with `reference_dir`, the reference code's runs on this machine
    (experiments/check_runs.py's out/reference-code) re-centre the bands measured on the machine."""
    where = ", ".join(map(str, results_dirs))
    if reference_dir is None:
        return evaluate(baseline, load_stored_runs(results_dirs), where)
    reference = load_stored_runs([reference_dir])
    return evaluate(baseline, load_stored_runs(results_dirs), where, reference, str(reference_dir))


def reference_dir_for(results: Path, given: Path | None) -> Path | None:
    """The reference code's runs to pair with `results`: those given, else the ones a check made beside them."""
    if given is not None:
        return given
    beside = results / REFERENCE_CODE_FOLDER
    return beside if (beside / "sweep.json").is_file() else None


# --- printing ----------------------------------------------------------------------------------------------------


def results_table(results: Sequence[BandResult]) -> str:
    """Every band: measured, lower, upper, verdict (plain markdown: CI logs are narrow, a rich table wraps)."""
    header = ["verdict", "method", "profile", "metric", "measured", "lower", "upper", "reference", "runs"]
    rows = [
        [
            r.verdict,
            r.method,
            r.profile,
            r.band.metric,
            format_value(r.band.metric, r.measured) if r.measured is not None else "-",
            format_value(r.band.metric, r.band.lower),
            format_value(r.band.metric, r.band.upper),
            format_value(r.band.metric, r.band.reference),
            r.runs,
        ]
        for r in results
    ]
    return markdown_table(header, rows, text_columns=4)


def on_machine_text(results: Sequence[BandResult], commit: str | None) -> str:
    """What the bands centred on the reference code's runs here were centred on, and, for every metric, how far the
    reference code's runs on this machine read from the stored references (the shift a stored band would have had to
    absorb: where it is large for a metric held to the stored references, that metric moves with the host too)."""
    paired = [r for r in results if r.stored_reference is not None]
    readings = [r for r in results if r.reference_code_value is not None]
    if not paired and not readings:
        return ""
    code = f" ({commit[:12]})" if commit else ""
    lines = []
    if paired:
        metrics = sorted({r.band.metric for r in paired})
        lines.append(
            f"{', '.join(metrics)}: each band centred on the reference code{code} run on this machine (runs: this "
            "checkout's vs the reference code's), not on the stored reference"
        )
    by_metric: dict[str, list[str]] = {}
    for r in readings:
        stored = r.band.reference if r.stored_reference is None else r.stored_reference
        by_metric.setdefault(r.band.metric, []).append(f"{r.method} {r.reference_code_value / stored - 1:+.1%}")
    if by_metric:
        shifts = "; ".join(f"{metric} {', '.join(values)}" for metric, values in by_metric.items())
        lines.append(f"the reference code's runs on this machine against the stored references: {shifts}")
    return "\n".join(lines)


def failures_text(results: Sequence[BandResult]) -> str:
    """One paragraph per band that does not hold: the method, the metric, measured against its band, by how much,
    and its likely cause."""
    lines = []
    for r in results:
        if r.ok:
            continue
        if r.measured is None:
            lines.append(f"- {r.method} on {r.profile}: {r.band.metric} MISSING: {r.cause}")
            continue
        band = f"{format_value(r.band.metric, r.band.lower)} to {format_value(r.band.metric, r.band.upper)}"
        change = r.measured / r.band.reference - 1
        lines.append(
            f"- {r.method} on {r.profile}: {r.band.metric} {format_value(r.band.metric, r.measured)} is "
            f"{r.verdict} its band {band} ({change:+.1%} from the reference "
            f"{format_value(r.band.metric, r.band.reference)}); likely cause: {r.cause}"
        )
    return "\n".join(lines)
