"""The CI gate: each method's throughput, bytes and loss must stay inside two-sided bands around a reference.

`harness check --baseline FILE` measures what the baseline names (the median of `repeats` short runs it makes, or
the runs --results holds) and holds each metric inside its band; `harness baseline RESULTS --out FILE` writes such a
file from a folder of repeats (harness/analysis/baseline.py; the file's model and reading, shared by both:
harness/analysis/bands.py). The metrics, per method and profile, are chosen to carry across machines:

    utilisation            tokens/s over `local`'s tokens/s, medians of the same check's runs. `local` never
                           communicates, so this is the share of this machine's compute a method turns into applied
                           tokens: near 1 for a method that hides its communication, on a fast CPU or a slow one.
                           The tight throughput gate: a method that got slower fails it.
    ratio                  tokens/s over allreduce's, medians. At a fixed link it moves with how fast the CPU
                           computes (on a slower CPU every low-communication method gains less), so its band is
                           wide: it catches a ratio far above the reference (something stopped working, e.g. a
                           method that no longer waits for the link) or far below, not a 20% slowdown.
    wire_bytes_per_token   bytes on the slow link per applied token, median. Fixed by the method and the model: a
                           method that stops sending, or sends twice as much, falls outside.
    final_val_loss         at the fixed seed, median; an upper bound only: a method that learns less fails.

tokens/s counts applied tokens (harness.run.summary.summarize). The baseline file (YAML):

    run:                                 # the settings of every run (any sweep setting); `harness check` makes its
      model: tiny                        # runs with them, and refuses --results runs made with others (another
      steps: 40                          # step count, seed, batch size, method option, ...)
      eval_every: 20
      seed: 0
      repeats: 3                         # runs per method; each metric is the median over them
      methods:                           # options per method
        dilocox: {local_steps: 10}
    checks:
      - method: dilocox
        profile: 100mbps                 # a profile name, or a path to a profile YAML relative to this file
        utilisation: {reference: 0.97, spread: 0.05, tolerance: 0.25}
        ratio: {reference: 4.1, spread: 0.07, tolerance: 0.9}
        wire_bytes_per_token: {reference: 45.3, spread: 0.002, tolerance: 0.1}
        final_val_loss: {reference: 3.71, spread: 0.0, tolerance: 0.02}

A band holds when reference / (1 + tolerance) <= measured <= reference x (1 + tolerance): a factor either way,
as fits ratios of positive quantities (a tolerance of 1.0 reads "within 2x"); final_val_loss has the upper bound
only. A check needs the runs of `local` (utilisation) and `allreduce` (ratio) on the same profile; it runs them.

How `harness baseline` derives a band from the repeats (baseline.TOLERANCE_K, Metric.floor):

    reference  the median over the repeats (for utilisation and ratio: the quotient of the two methods' medians)
    spread     (max - min) / median over the repeats; for a quotient, both sides' spreads root-sum-squared
    tolerance  max(floor, K x spread), K = 3

K = 3: with 3 repeats the range is about 1.7 standard deviations of one run, and the median of 3 a check measures
differs from the reference median by about 0.95 of one, so the band's edge sits about 5 of those out: run-to-run
noise of the size the repeats showed fails a check rarely, even where 3 repeats underestimate it by half. The
floors cover what repeats on one quiet machine cannot show (another machine of the same kind, another day):

    utilisation           0.35  methods that block on the link part of the time move with the CPU's speed: between
                                two machines of the same kind opendiloco and cocktail moved ~10% against dilocox,
                                and a machine shared with other jobs (where the reference may be measured) against
                                a quiet one (where CI runs) moves cocktail's compression compute and its link time
                                differently; a halving (factor 2, outside 1/1.35) still fails
    ratio                 0.9   within 1.9x: another machine of the same kind measured 0.56x (dilocox) and 0.61x
                                (opendiloco) the reference machine's ratios at 100 Mbit/s, which pass (the lower
                                bound is 0.53x); a halving fails
    wire_bytes_per_token  0.1   payload sizes are fixed by the method and the model; TCP/IP overhead and
                                retransmissions vary by a few percent
    final_val_loss        0.02  the training is deterministic at a fixed seed, so repeats on one machine agree
                                (their spread shows how closely); another CPU or torch build rounds differently;
                                2% of a loss of ~3.5 is ~0.07 nats

`harness baseline` refuses to write a band that could not catch what it is for (Metric.most: utilisation and wire
bytes a factor of 2, loss 10%): the repeats were too noisy, and the fix is to measure them on a quieter machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.analysis.bands import (
    METRICS,
    Band,
    Baseline,
    BaselineError,
    StoredRun,
    differences,
    flat_settings,
    format_value,
    load_stored_runs,
    needed_runs,
)
from harness.analysis.options import AS_GIVEN
from harness.analysis.report import markdown_table
from harness.analysis.sweep import SweepObserver, applies_to, profile_name, run_sweep
from harness.run.config import RunConfig


def run_needed(
    baseline: Baseline, out: Path, repeats: int | None = None, observer: SweepObserver | None = None
) -> None:
    """Run (or resume) every run the baseline's checks need into the sweep folder `out`."""
    for spec in needed_runs(baseline, repeats):
        run_sweep(spec, out, observer=observer)


# --- comparing ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BandResult:
    method: str
    profile: str  # the profile's name
    band: Band
    measured: float | None
    runs: str  # how many runs the value is the median of: "3", or "3/3" for a quotient of two methods' medians
    missing: str | None = None  # why there is no value

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


class _Selector:
    """The successful runs of one method on one profile made with the baseline's settings; refuses a folder whose
    runs of that method were all made with other settings (the bands hold only for the baseline's)."""

    def __init__(self, baseline: Baseline, runs: Sequence[StoredRun], where: str):
        self.baseline = baseline
        self.runs = runs
        self.where = where
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
        picked = [r for r in candidates if not differences(want, r.settings()) and r.options() == want_options]
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
    values = [v for v in (r.value(key) for r in runs) if v is not None]
    return statistics.median(values) if values else None


def evaluate(baseline: Baseline, runs: Sequence[StoredRun], where: str = "the results") -> list[BandResult]:
    """Every band, measured from the medians of the matching successful runs; a band without runs fails."""
    select = _Selector(baseline, runs, where)
    results = []
    for check in baseline.checks:
        own = select(check.method, check.profile)
        for band in check.bands:
            metric = METRICS[band.metric]
            measured, count, missing = _median(own, metric.summary_key), _count(own), None
            if not own:
                missing = f"no successful {check.method} runs"
            elif measured is None:
                missing = f"{check.method}'s runs have no {metric.summary_key}"
            if metric.relative_to is not None and measured is not None:
                other = select(metric.relative_to, check.profile)
                divisor = _median(other, "tokens_per_s")
                count = f"{_count(own)}/{_count(other)}"
                if not divisor:
                    measured, missing = None, f"no successful {metric.relative_to} runs"
                else:
                    measured /= divisor
            results.append(BandResult(check.method, check.profile_name, band, measured, count, missing))
    return results


def check(baseline: Baseline, results_dirs: list[Path]) -> list[BandResult]:
    where = ", ".join(map(str, results_dirs))
    return evaluate(baseline, load_stored_runs(results_dirs), where)


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
            format_value(r.band.metric, r.measured) if r.measured is not None else (r.missing or "-"),
            format_value(r.band.metric, r.band.lower),
            format_value(r.band.metric, r.band.upper),
            format_value(r.band.metric, r.band.reference),
            r.runs,
        ]
        for r in results
    ]
    return markdown_table(header, rows, text_columns=4)
