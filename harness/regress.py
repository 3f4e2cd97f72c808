"""The CI gate: throughput ratios between methods must not fall below a committed baseline.

Ratios, not absolute times: machines differ and are noisy, but how much faster one method trains than another on
the same link and the same machine is what the harness claims. The baseline file (YAML):

    tolerance: 0.25                # a ratio holds when measured >= min_ratio * (1 - tolerance)
    ratios:
      - {method: dilocox, baseline: allreduce, profile: 100mbps, metric: tokens_per_s, min_ratio: 5.0}
    run:                           # optional: how `harness check` runs what it needs (without --results)
      model: tiny                  # any sweep setting: model, steps, batch_size, clusters, stages, lr, ...
      steps: 30
      seed: 0
      methods:                     # options per method
        dilocox: {local_steps: 10}

A profile is a profile name or a path to a profile YAML, relative to the baseline file. Each side of a ratio is the
median over its runs (the `repeats` short runs of one configuration, or whatever --results holds for it): one short
run on a shared machine can be off by tens of percent, the median of three rarely is. With --results, the runs are
picked by method and profile name, narrowed by run.methods' options and by run's model, clusters, stages and steps;
if that still leaves two configurations of one method, the baseline is ambiguous and the check refuses to guess.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from harness.config import check_method_options
from harness.errors import UserError, read_yaml
from harness.profiles import ProfileError, known_profiles, load_profile
from harness.report import load_runs
from harness.sweep import SweepError, SweepObserver, SweepSpec, check_keys, profile_name, run_sweep
from trainers.registry import METHODS

METRICS = {"tokens_per_s": "training throughput, tokens/s"}
RATIO_KEYS = ("method", "baseline", "profile", "metric", "min_ratio")
TOP_KEYS = {"tolerance", "ratios", "run"}
# run: settings that narrow which stored runs a ratio compares (summary.json fields of the same name).
MATCH_KEYS = ("model", "clusters", "stages", "steps")


class BaselineError(UserError):
    """A baseline file that cannot be checked; the message is one sentence naming the fix."""


@dataclass(frozen=True)
class RatioSpec:
    method: str
    baseline: str
    profile: str  # a profile name, or the resolved path of a profile YAML
    metric: str
    min_ratio: float

    @property
    def profile_name(self) -> str:
        return profile_name(self.profile)

    def describe(self) -> str:
        return f"{self.method} / {self.baseline} {self.metric} on {self.profile_name}"


@dataclass(frozen=True)
class Baseline:
    tolerance: float
    ratios: tuple[RatioSpec, ...]
    settings: Mapping[str, Any] = field(default_factory=dict)  # run:, without seed and methods
    method_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    seed: int = 0


def _number(value: Any) -> float | None:
    """A YAML number, or None; PyYAML reads '1e9' (no dot) as a string, which a reader surely meant as a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _resolve_profile(value: Any, where: str, folder: Path) -> str:
    if not isinstance(value, str) or not value:
        raise BaselineError(f"{where}: profile must be a profile name or a path to a profile YAML, got {value!r}")
    if value.endswith((".yaml", ".yml")) or "/" in value:
        path = folder / value
        try:
            load_profile(str(path))
        except ProfileError as err:
            raise BaselineError(f"{where}: {err}") from None
        return str(path)
    if value not in known_profiles():
        raise BaselineError(f"{where}: unknown profile {value!r}; known: {', '.join(known_profiles())}")
    return value


def _ratio(entry: Any, index: int, folder: Path) -> RatioSpec:
    where = f"ratios[{index}]"
    if not isinstance(entry, dict):
        raise BaselineError(f"{where} must be a mapping with keys {', '.join(RATIO_KEYS)}")
    missing = [k for k in RATIO_KEYS if k not in entry]
    unknown = sorted(set(entry) - set(RATIO_KEYS))
    if missing or unknown:
        problem = f"lacks {', '.join(missing)}" if missing else f"has unknown key(s) {', '.join(unknown)}"
        raise BaselineError(f"{where} {problem}; each ratio needs exactly {', '.join(RATIO_KEYS)}")
    for key in ("method", "baseline"):
        if entry[key] not in METHODS:
            raise BaselineError(f"{where}: unknown {key} {entry[key]!r}; known methods: {', '.join(METHODS)}")
    if entry["metric"] not in METRICS:
        raise BaselineError(f"{where}: unknown metric {entry['metric']!r}; known: {', '.join(METRICS)}")
    min_ratio = _number(entry["min_ratio"])
    if min_ratio is None or not min_ratio > 0:
        raise BaselineError(f"{where}: min_ratio must be a positive number, got {entry['min_ratio']!r}")
    profile = _resolve_profile(entry["profile"], where, folder)
    return RatioSpec(entry["method"], entry["baseline"], profile, entry["metric"], min_ratio)


def _run_section(run: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]], int]:
    if not isinstance(run, dict):
        raise BaselineError(f"run must be a mapping of run settings, got {type(run).__name__}")
    settings = {k: v for k, v in run.items() if k not in ("methods", "seed")}
    try:
        check_keys(list(settings))
    except SweepError as err:
        raise BaselineError(f"run: {err}") from None
    seed = run.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise BaselineError(f"run: seed must be an integer, got {seed!r}")
    methods = run.get("methods") or {}
    if not isinstance(methods, dict):
        raise BaselineError("run: methods must map a method name to a mapping of its options")
    for name, options in methods.items():
        if not isinstance(options, dict):
            raise BaselineError(f"run: methods: {name} must map option names to values, got {options!r}")
        try:
            check_method_options(name, options)
        except UserError as err:
            raise BaselineError(f"run: methods: {err}") from None
    return settings, methods, seed


def load_baseline(path: Path) -> Baseline:
    """Read and validate a baseline file; every problem is a BaselineError with one clear sentence."""
    data = read_yaml(path, "baseline file", BaselineError)
    if not isinstance(data, dict):
        raise BaselineError(f"baseline file {path} must be a YAML mapping with keys tolerance and ratios")
    missing = sorted({"tolerance", "ratios"} - set(data))
    unknown = sorted(set(data) - TOP_KEYS)
    if missing or unknown:
        problem = f"lacks {', '.join(missing)}" if missing else f"has unknown key(s) {', '.join(unknown)}"
        raise BaselineError(f"baseline file {path} {problem}; allowed keys: {', '.join(sorted(TOP_KEYS))}")
    tolerance = _number(data["tolerance"])
    if tolerance is None or not 0 <= tolerance < 1:
        raise BaselineError(f"tolerance must be a number in [0, 1), got {data['tolerance']!r}")
    ratios = data["ratios"]
    if not isinstance(ratios, list) or not ratios:
        raise BaselineError("ratios must be a non-empty list of {method, baseline, profile, metric, min_ratio}")
    specs = tuple(_ratio(entry, i, path.parent) for i, entry in enumerate(ratios))
    settings, methods, seed = _run_section(data.get("run") or {})
    return Baseline(tolerance, specs, settings, methods, seed)


# --- running what a baseline needs -------------------------------------------------------------------------------


def needed_runs(baseline: Baseline, repeats: int) -> list[SweepSpec]:
    """One sweep per profile over the methods its ratios name, `repeats` runs each."""
    by_profile: dict[str, list[str]] = {}
    for spec in baseline.ratios:
        methods = by_profile.setdefault(spec.profile, [])
        methods += [m for m in (spec.baseline, spec.method) if m not in methods]
    return [
        SweepSpec(
            methods=tuple(methods),
            profiles=(profile,),
            seeds=(baseline.seed,),
            settings=baseline.settings,
            per_method=baseline.method_options,
            repeats=repeats,
        )
        for profile, methods in by_profile.items()
    ]


def run_needed(baseline: Baseline, out: Path, repeats: int, observer: SweepObserver | None = None) -> None:
    """Run (or resume) every run the baseline's ratios need into the sweep folder `out`."""
    for spec in needed_runs(baseline, repeats):
        run_sweep(spec, out, observer=observer)


# --- comparing ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RatioResult:
    spec: RatioSpec
    threshold: float  # min_ratio * (1 - tolerance)
    measured: float | None
    method_value: float | None
    baseline_value: float | None
    method_runs: int
    baseline_runs: int

    @property
    def ok(self) -> bool:
        return self.measured is not None and self.measured >= self.threshold


def _select(runs: pd.DataFrame, baseline: Baseline, method: str, profile: str) -> pd.DataFrame:
    picked = runs[(runs["status"] == "ok") & (runs["method"] == method) & (runs["profile"] == profile)]
    if method in baseline.method_options:
        wanted = json.dumps(dict(sorted(baseline.method_options[method].items())))
        picked = picked[picked["options"].map(lambda o: json.dumps(dict(sorted(json.loads(o).items())))) == wanted]
    for key in MATCH_KEYS:
        if key in baseline.settings:
            picked = picked[picked[key] == baseline.settings[key]]
    configurations = picked[["variant", *MATCH_KEYS]].drop_duplicates()
    if len(configurations) > 1:
        listed = "; ".join(
            f"{r.variant} ({', '.join(f'{k}={getattr(r, k)}' for k in MATCH_KEYS)})"
            for r in configurations.itertuples()
        )
        raise BaselineError(
            f"the results hold {len(configurations)} configurations of {method} on {profile} ({listed}); "
            "pin one with the baseline's run: settings (model, steps, ..., methods: options)"
        )
    return picked


def evaluate(baseline: Baseline, runs: pd.DataFrame) -> list[RatioResult]:
    """Each ratio, from the medians of the matching successful runs; a side with no runs makes its ratio fail."""
    results = []
    for spec in baseline.ratios:
        sides = [
            _select(runs, baseline, method, spec.profile_name)[spec.metric].dropna()
            for method in (spec.method, spec.baseline)
        ]
        values = [statistics.median(side) if len(side) else None for side in sides]
        measured = values[0] / values[1] if None not in values and values[1] else None
        results.append(
            RatioResult(
                spec=spec,
                threshold=spec.min_ratio * (1 - baseline.tolerance),
                measured=measured,
                method_value=values[0],
                baseline_value=values[1],
                method_runs=len(sides[0]),
                baseline_runs=len(sides[1]),
            )
        )
    return results


def check(baseline: Baseline, results_dirs: list[Path]) -> list[RatioResult]:
    return evaluate(baseline, load_runs(results_dirs).runs)
