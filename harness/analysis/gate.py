"""The CI gate: each method's throughput, bytes and loss must stay inside two-sided bands around a reference.

`harness check --baseline FILE` measures what the baseline names (the median of `repeats` short runs it makes, or
the runs --results holds) and holds each metric inside its band; `harness baseline RESULTS --out FILE` writes such a
file from a folder of repeats. The metrics, per method and profile, are chosen to carry across machines:

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

How `harness baseline` derives a band from the repeats (TOLERANCE_K, Metric.floor):

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

import dataclasses
import json
import math
import os
import shlex
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.analysis.sweep import SweepError, SweepObserver, SweepSpec, applies_to, check_keys, profile_name, run_sweep
from harness.errors import UserError, read_yaml
from harness.net.link import ProfileError
from harness.net.profiles import known_profiles, load_profile
from harness.run.config import RunConfig, check_method_options
from trainers.registry import METHODS

BASELINE = "allreduce"
CEILING = "local"
TOLERANCE_K = 3.0
DEFAULT_REPEATS = 3
MIN_REPEATS = 2


@dataclass(frozen=True)
class Metric:
    name: str
    floor: float  # the smallest tolerance `harness baseline` writes (module doc)
    most: float  # a tolerance at or above this gates nothing useful: `harness baseline` refuses it
    what: str  # why `most` matters, for the refusal
    relative_to: str | None = None  # tokens/s over this method's (the same profile's runs)
    upper_only: bool = False
    summary_key: str = "tokens_per_s"


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("utilisation", 0.35, 1.0, "could not catch a halving of its throughput", relative_to=CEILING),
        Metric("ratio", 0.9, math.inf, "", relative_to=BASELINE),
        Metric("wire_bytes_per_token", 0.1, 1.0, "could not catch twice the bytes", summary_key="wire_bytes_per_token"),
        Metric(
            "final_val_loss",
            0.02,
            0.1,
            "could not catch a loss 10% higher",
            upper_only=True,
            summary_key="final_val_loss",
        ),
    )
}
BAND_KEYS = ("reference", "spread", "tolerance")
CHECK_KEYS = ("method", "profile")
TOP_KEYS = ("run", "checks")
RUN_KEYS = ("seed", "repeats", "methods")  # run: keys that are not sweep settings
# Settings `harness baseline` always writes into run: (others only where a run differs from the default).
ALWAYS_WRITTEN = ("model", "steps", "batch_size", "eval_every", "clusters", "stages")
# The order in which a mismatch is named: what a reader most likely changed first.
MISMATCH_ORDER = ("steps", "seed", "model", "clusters", "stages", "batch_size", "seq_len", "eval_every")
# Settings with their own `harness sweep` flag (the rest go through --set KEY=VALUE).
SWEEP_FLAGS = frozenset(
    {"model", "steps", "batch_size", "seq_len", "eval_every", "throughput_warmup_steps", "microbatches",
     "pipeline_schedule", "lr", "data", "clusters", "stages", "backend"}
)  # fmt: skip


class BaselineError(UserError):
    """A baseline file that cannot be checked or written; the message is one sentence naming the fix."""


@dataclass(frozen=True)
class Band:
    metric: str
    reference: float
    spread: float  # relative spread of the repeats the band was derived from
    tolerance: float

    @property
    def lower(self) -> float | None:
        return None if METRICS[self.metric].upper_only else self.reference / (1 + self.tolerance)

    @property
    def upper(self) -> float:
        return self.reference * (1 + self.tolerance)

    def holds(self, value: float) -> bool:
        return (self.lower is None or value >= self.lower) and value <= self.upper


@dataclass(frozen=True)
class MethodCheck:
    method: str
    profile: str  # a profile name, or the resolved path of a profile YAML
    bands: tuple[Band, ...]

    @property
    def profile_name(self) -> str:
        return profile_name(self.profile)


@dataclass(frozen=True)
class Baseline:
    checks: tuple[MethodCheck, ...]
    settings: Mapping[str, Any] = field(default_factory=dict)  # run:, without seed, repeats and methods
    method_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    seed: int = 0
    repeats: int = DEFAULT_REPEATS


# --- reading a baseline file -------------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    """A finite YAML number, or None; PyYAML reads '1e9' (no dot) as a string, which a person surely meant as one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
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


def _band(metric: str, entry: Any, where: str) -> Band:
    where = f"{where}: {metric}"
    if not isinstance(entry, dict) or sorted(entry) != sorted(BAND_KEYS):
        raise BaselineError(f"{where} must be a mapping of exactly {', '.join(BAND_KEYS)}, got {entry!r}")
    reference, spread, tolerance = (_number(entry[k]) for k in BAND_KEYS)
    if reference is None or reference <= 0:
        raise BaselineError(f"{where}: reference must be a positive number, got {entry['reference']!r}")
    if spread is None or spread < 0:
        raise BaselineError(f"{where}: spread must be a number of at least 0, got {entry['spread']!r}")
    if tolerance is None or tolerance < 0:
        raise BaselineError(f"{where}: tolerance must be a number of at least 0, got {entry['tolerance']!r}")
    return Band(metric, reference, spread, tolerance)


def _check(entry: Any, index: int, folder: Path) -> MethodCheck:
    where = f"checks[{index}]"
    allowed = (*CHECK_KEYS, *METRICS)
    if not isinstance(entry, dict):
        raise BaselineError(f"{where} must be a mapping with method, profile and metric bands ({', '.join(METRICS)})")
    missing = [k for k in CHECK_KEYS if k not in entry]
    unknown = sorted(set(entry) - set(allowed))
    if missing or unknown:
        problem = f"lacks {', '.join(missing)}" if missing else f"has unknown key(s) {', '.join(unknown)}"
        raise BaselineError(f"{where} {problem}; allowed keys: {', '.join(allowed)}")
    if entry["method"] not in METHODS:
        raise BaselineError(f"{where}: unknown method {entry['method']!r}; known methods: {', '.join(METHODS)}")
    bands = tuple(_band(metric, entry[metric], where) for metric in METRICS if metric in entry)
    if not bands:
        raise BaselineError(f"{where} ({entry['method']}) has no band; give it at least one of {', '.join(METRICS)}")
    return MethodCheck(entry["method"], _resolve_profile(entry["profile"], where, folder), bands)


def _run_section(run: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]], int, int]:
    if not isinstance(run, dict):
        raise BaselineError(f"run must be a mapping of run settings, got {type(run).__name__}")
    settings = {k: v for k, v in run.items() if k not in RUN_KEYS}
    try:
        check_keys(list(settings))
    except SweepError as err:
        raise BaselineError(f"run: {err}") from None
    if "steps" not in settings:
        raise BaselineError("run: lacks steps; a baseline's bands hold at one step count, so name it (steps: 40)")
    seed = run.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise BaselineError(f"run: seed must be an integer, got {seed!r}")
    repeats = run.get("repeats", DEFAULT_REPEATS)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise BaselineError(f"run: repeats must be a positive integer, got {repeats!r}")
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
    return settings, methods, seed, repeats


def load_baseline(path: Path) -> Baseline:
    """Read and validate a baseline file; every problem is a BaselineError with one clear sentence."""
    data = read_yaml(path, "baseline file", BaselineError)
    if not isinstance(data, dict):
        raise BaselineError(f"baseline file {path} must be a YAML mapping with keys {' and '.join(TOP_KEYS)}")
    if "ratios" in data or "tolerance" in data:
        raise BaselineError(
            f"baseline file {path} is in the old one-sided format (tolerance, ratios); write a two-sided one "
            "with `harness baseline RESULTS --out FILE` from a folder of repeats"
        )
    missing = [k for k in TOP_KEYS if k not in data]
    unknown = sorted(set(data) - set(TOP_KEYS))
    if missing or unknown:
        problem = f"lacks {', '.join(missing)}" if missing else f"has unknown key(s) {', '.join(unknown)}"
        raise BaselineError(f"baseline file {path} {problem}; allowed keys: {', '.join(TOP_KEYS)}")
    settings, methods, seed, repeats = _run_section(data["run"])
    entries = data["checks"]
    if not isinstance(entries, list) or not entries:
        raise BaselineError("checks must be a non-empty list of {method, profile, <metric>: {reference, ...}}")
    checks = tuple(_check(entry, i, path.parent) for i, entry in enumerate(entries))
    seen: set[tuple[str, str]] = set()
    for check in checks:
        key = (check.method, check.profile_name)
        if key in seen:
            raise BaselineError(f"checks name {check.method} on {check.profile_name} twice; merge the two entries")
        seen.add(key)
    return Baseline(checks, settings, methods, seed, repeats)


# --- running what a baseline needs -------------------------------------------------------------------------------


def _needed_methods(checks: Sequence[MethodCheck]) -> list[str]:
    """The checks' methods plus those their metrics divide by, allreduce and local first."""
    wanted = [m for c in checks for m in (*(METRICS[b.metric].relative_to for b in c.bands), c.method) if m is not None]
    order = {BASELINE: 0, CEILING: 1}
    return sorted(dict.fromkeys(wanted), key=lambda m: order.get(m, 2))


def _profiles(baseline: Baseline) -> dict[str, list[MethodCheck]]:
    by_profile: dict[str, list[MethodCheck]] = {}
    for check in baseline.checks:
        by_profile.setdefault(check.profile, []).append(check)
    return by_profile


def needed_runs(baseline: Baseline, repeats: int | None = None) -> list[SweepSpec]:
    """One sweep per profile over the methods its checks need, `repeats` runs each (default: the baseline's)."""
    return [
        SweepSpec(
            methods=tuple(_needed_methods(checks)),
            profiles=(profile,),
            seeds=(baseline.seed,),
            settings=baseline.settings,
            per_method=baseline.method_options,
            repeats=repeats or baseline.repeats,
        )
        for profile, checks in _profiles(baseline).items()
    ]


def run_needed(
    baseline: Baseline, out: Path, repeats: int | None = None, observer: SweepObserver | None = None
) -> None:
    """Run (or resume) every run the baseline's checks need into the sweep folder `out`."""
    for spec in needed_runs(baseline, repeats):
        run_sweep(spec, out, observer=observer)


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "none" if value is None else str(value)


def sweep_command(baseline: Baseline, out: str) -> list[str]:
    """The `harness sweep` command(s) that make the runs `harness check` would make, into `out` (forced: fresh)."""
    commands = []
    for profile, checks in _profiles(baseline).items():
        shown = profile if profile in known_profiles() else os.path.relpath(profile)
        words = ["harness", "sweep", "--methods", ",".join(_needed_methods(checks)), "--profiles", shown]
        words += ["--seeds", str(baseline.seed), "--repeats", str(baseline.repeats)]
        for key, value in baseline.settings.items():
            if key in SWEEP_FLAGS:
                words += [f"--{key.replace('_', '-')}", _flag_value(value)]
            else:
                words += ["--set", f"{key}={_flag_value(value)}"]
        for method, options in baseline.method_options.items():
            words += [w for k, v in options.items() for w in ("--method-set", f"{method}:{k}={_flag_value(v)}")]
        words += ["--force", "--out", out]
        commands.append(shlex.join(words))
    return commands


# --- reading runs ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredRun:
    """One finished run folder: its summary.json and config.json as written."""

    path: str  # relative to the folder the user named
    summary: Mapping[str, Any]
    config: Mapping[str, Any]
    environment: Mapping[str, Any] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return self.summary["method"]

    @property
    def profile(self) -> str:
        return self.summary["profile"]

    @property
    def ok(self) -> bool:
        return self.summary.get("status") == "ok"

    def value(self, key: str) -> float | None:
        value = self.summary.get(key)
        return float(value) if isinstance(value, int | float) and math.isfinite(value) else None

    def settings(self) -> dict[str, Any]:
        return _flat(self.config, self.summary)

    def options(self) -> dict[str, Any] | None:
        return _options(self.method, self.summary.get("method_options") or self.config.get("method_options") or {})


def load_stored_runs(paths: Sequence[Path]) -> list[StoredRun]:
    from harness.analysis.report import find_run_dirs

    runs = []
    for run_dir, relative in find_run_dirs(paths):
        summary = json.loads((run_dir / "summary.json").read_text())
        config, environment = ({}, {})
        if (run_dir / "config.json").is_file():
            config = json.loads((run_dir / "config.json").read_text())
        if (run_dir / "environment.json").is_file():
            environment = json.loads((run_dir / "environment.json").read_text())
        runs.append(StoredRun(relative, summary, config, environment))
    return runs


def _flat(config: Mapping[str, Any], summary: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a band depends on besides the method and its options: training settings (the optimizer's included),
    seed and cluster shape, from a config.json or RunConfig.to_dict(); a summary fills in steps and seed."""
    train = dict(config.get("train") or {})
    optim = train.pop("optim", None) or {}
    flat = {**optim, **train}
    flat.update({k: config[k] for k in ("clusters", "stages", "backend") if k in config})
    for key in ("steps", "seed"):
        if key not in flat and summary and summary.get(key) is not None:
            flat[key] = summary[key]
    return json.loads(json.dumps(flat))  # tuples read back as lists, as from a file


def _options(method: str, options: Mapping[str, Any]) -> dict[str, Any] | None:
    """A method's options with its defaults filled in, so a default given explicitly is the same configuration;
    None when the method no longer takes them."""
    from trainers.registry import method_config

    try:
        return json.loads(json.dumps(dataclasses.asdict(method_config(method, dict(options))), default=str))
    except (ValueError, TypeError):
        return None


def _differences(want: Mapping[str, Any], have: Mapping[str, Any]) -> list[str]:
    keys = [k for k in want if k in have and want[k] != have[k]]
    first = [k for k in MISMATCH_ORDER if k in keys]
    return first + sorted(set(keys) - set(first))


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
        want = _flat(expected.to_dict())
        want_options = _options(method, expected.method_options)
        picked = [r for r in candidates if not _differences(want, r.settings()) and r.options() == want_options]
        if picked:
            return picked
        run = candidates[0]
        differences = _differences(want, run.settings())
        if differences:
            key = differences[0]
            what = f"{key}={run.settings()[key]!r} where the baseline's runs had {key}={want[key]!r}"
        else:
            what = f"options {run.summary.get('method_options')} where the baseline's runs had {dict(options)}"
        raise BaselineError(
            f"{self.where} holds {len(candidates)} {method} run(s) on {name} but none made with the baseline's "
            f"settings ({run.path} has {what}); the bands hold only for those settings, so pass runs made with "
            "them, or leave out --results and `harness check` makes them"
        )


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
            measured, count, missing = _median(own, metric.summary_key), str(len(own)), None
            if not own:
                missing = f"no successful {check.method} runs"
            elif measured is None:
                missing = f"{check.method}'s runs have no {metric.summary_key}"
            if metric.relative_to is not None and measured is not None:
                other = select(metric.relative_to, check.profile)
                divisor = _median(other, "tokens_per_s")
                count = f"{len(own)}/{len(other)}"
                if not divisor:
                    measured, missing = None, f"no successful {metric.relative_to} runs"
                else:
                    measured /= divisor
            results.append(BandResult(check.method, check.profile_name, band, measured, count, missing))
    return results


def check(baseline: Baseline, results_dirs: list[Path]) -> list[BandResult]:
    where = ", ".join(map(str, results_dirs))
    return evaluate(baseline, load_stored_runs(results_dirs), where)


# --- writing a baseline from repeats -----------------------------------------------------------------------------


def _spread(values: Sequence[float]) -> float:
    median = statistics.median(values)
    return (max(values) - min(values)) / abs(median) if median else 0.0


def _round_up(value: float, places: int = 3) -> float:
    return math.ceil(value * 10**places - 1e-9) / 10**places


def _significant(value: float, digits: int) -> float:
    return float(f"{value:.{digits}g}")


def derive_band(metric: str, reference: float, spreads: Sequence[float], where: str) -> Band:
    """The band of one metric (module doc): spread root-sum-squared over the sides, tolerance = max(floor, K x it)."""
    spec = METRICS[metric]
    spread = math.sqrt(sum(s * s for s in spreads))
    tolerance = _round_up(max(spec.floor, TOLERANCE_K * spread))
    if tolerance >= spec.most:
        raise BaselineError(
            f"{where}: {metric} varied by {spread:.0%} over the repeats, so its band (x{1 + tolerance:.2f} either "
            f"way) {spec.what}; measure the repeats again on a quieter machine"
        )
    return Band(metric, _significant(reference, 4), _significant(spread, 3), tolerance)


@dataclass(frozen=True)
class Derived:
    """A baseline derived from repeats, with what its file's comments say about them."""

    baseline: Baseline
    medians: Mapping[tuple[str, str], Mapping[str, float | None]]  # (method, profile) -> metric -> median
    runs: Mapping[tuple[str, str], int]
    results: str  # the folder, as the user named it
    machine: str = ""  # where the runs were measured, from their environment.json


def _one_configuration(runs: Sequence[StoredRun], results: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The settings every run shares and each method's options; refuses runs of several configurations."""
    first = runs[0]
    settings = first.settings()
    options: dict[str, tuple[StoredRun, dict[str, Any] | None]] = {}
    for run in runs:
        differences = _differences(settings, run.settings())
        if differences:
            key = differences[0]
            raise BaselineError(
                f"{results} mixes runs made with different settings ({first.path} has {key}={settings[key]!r}, "
                f"{run.path} {key}={run.settings()[key]!r}); derive a baseline from the repeats of one configuration "
                "(one `harness sweep --repeats 3`)"
            )
        seen = options.setdefault(run.method, (run, run.options()))
        if seen[1] != run.options():
            raise BaselineError(
                f"{results} holds {run.method} runs with different options ({seen[0].path}: "
                f"{seen[0].summary.get('method_options')}, {run.path}: {run.summary.get('method_options')}); "
                "derive a baseline from the repeats of one configuration per method"
            )
    given = {m: dict(r.summary.get("method_options") or {}) for m, (r, _) in options.items()}
    return settings, {m: o for m, o in given.items() if o}


def _run_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """run: settings: the usual ones always, the others where they differ from the defaults."""
    defaults = _flat(RunConfig.build(BASELINE, "unshaped").to_dict())
    written = {}
    for key, value in settings.items():
        if key == "seed" or key not in defaults:
            continue
        if key in ALWAYS_WRITTEN or value != defaults[key]:
            written[key] = value
    try:
        check_keys(list(written))
    except SweepError as err:
        raise BaselineError(f"the runs differ from the defaults in a setting a sweep cannot set: {err}") from None
    return {k: written[k] for k in (*ALWAYS_WRITTEN, *sorted(written)) if k in written}


def _profile_for(run: StoredRun, results: str) -> str:
    if run.profile in known_profiles():
        return run.profile
    source = (run.config.get("profile") or {}).get("source")
    if source and Path(source).is_file():
        return str(Path(source).resolve())
    raise BaselineError(
        f"{run.path} ran on profile {run.profile!r}, which is neither a known profile nor a file that still exists "
        f"({source}); restore the profile file and derive the baseline from {results} again"
    )


def derive_baseline(results: Path) -> Derived:
    """Two-sided bands from a folder of repeats (module doc): every method's, on every profile the runs used."""
    where = str(results)
    runs = load_stored_runs([results])
    failed = [r for r in runs if not r.ok]
    if failed:
        raise BaselineError(
            f"{len(failed)} run(s) in {where} failed ({failed[0].path}: {failed[0].summary.get('failure')}); run the "
            "sweep again (it redoes only the failed runs) before deriving a baseline"
        )
    settings, method_options = _one_configuration(runs, where)
    groups: dict[tuple[str, str], list[StoredRun]] = {}
    for run in runs:
        groups.setdefault((run.method, run.profile), []).append(run)
    profiles = {run.profile: _profile_for(run, where) for run in runs}
    for profile in profiles:
        for needed in (BASELINE, CEILING):
            if (needed, profile) not in groups:
                raise BaselineError(
                    f"{where} has no {needed} runs on {profile}; utilisation is tokens/s over local's and ratio "
                    f"over allreduce's, so run {BASELINE} and {CEILING} too"
                )
    for (method, profile), group in groups.items():
        if len(group) < MIN_REPEATS:
            raise BaselineError(
                f"{where} holds {len(group)} {method} run on {profile}; a baseline's tolerances come from the spread "
                f"of repeats, so run the sweep with --repeats {DEFAULT_REPEATS}"
            )

    def values(method: str, profile: str, key: str) -> list[float]:
        return [v for v in (r.value(key) for r in groups[(method, profile)]) if v is not None]

    order = {BASELINE: 0, CEILING: 1}
    checks, medians = [], {}
    for method, profile in sorted(groups, key=lambda k: (k[1], order.get(k[0], 2), k[0])):
        label = f"{method} on {profile}"
        bands = []
        tokens = values(method, profile, "tokens_per_s")
        syncs = values(method, profile, "sync_count")
        for name, metric in METRICS.items():
            if name == "wire_bytes_per_token" and not (syncs and statistics.median(syncs) > 0):
                continue  # a method that never synchronizes sends only connection set-up bytes
            if metric.relative_to is not None:
                if method in (BASELINE, CEILING):
                    continue  # 1 by definition, or a measure of the machine's speed rather than of the method
                divisor = values(metric.relative_to, profile, "tokens_per_s")
                if not tokens or not divisor:
                    continue
                reference = statistics.median(tokens) / statistics.median(divisor)
                bands.append(derive_band(name, reference, [_spread(tokens), _spread(divisor)], label))
                continue
            own = values(method, profile, metric.summary_key)
            if own and statistics.median(own) > 0:
                bands.append(derive_band(name, statistics.median(own), [_spread(own)], label))
        if bands:
            checks.append(MethodCheck(method, profiles[profile], tuple(bands)))
        medians[(method, profile)] = {
            key: statistics.median(v) if (v := values(method, profile, key)) else None
            for key in ("tokens_per_s", "wire_bytes_per_token", "final_val_loss")
        }
    seed = settings.get("seed", 0)
    repeats = min(len(g) for g in groups.values())
    baseline = Baseline(tuple(checks), _run_settings(settings), method_options, seed, repeats)
    counts = {key: len(group) for key, group in groups.items()}
    return Derived(baseline, medians, counts, where, _machine(runs))


def _machine(runs: Sequence[StoredRun]) -> str:
    """Where the repeats ran (CPUs, kernel, torch, code version), as their environment.json files say."""
    described = []
    for run in runs:
        env = run.environment
        if not env:
            continue
        torch = (env.get("packages") or {}).get("torch")
        commit = env.get("git_commit")
        parts = [
            f"{env['cpu_count']} CPUs" if env.get("cpu_count") else "",
            f"{env['machine']}" if env.get("machine") else "",
            f"kernel {env['kernel']}" if env.get("kernel") else "",
            f"torch {torch}" if torch else "",
            f"git {commit[:12]}{' (dirty)' if env.get('git_dirty') else ''}" if commit else "",
        ]
        text = ", ".join(p for p in parts if p)
        if text and text not in described:
            described.append(text)
    return "; ".join(described)


def _wrapped(commands: Sequence[str], width: int = 114) -> list[str]:
    """Shell commands, chained with &&, as comment lines of at most `width` characters continued with backslashes;
    a flag stays with its value."""
    lines: list[str] = []
    for index, command in enumerate(commands):
        words = [shlex.quote(w) for w in shlex.split(command)]
        groups: list[str] = []
        for word in words:
            if groups and groups[-1].startswith("--") and " " not in groups[-1] and not word.startswith("--"):
                groups[-1] += " " + word
            else:
                groups.append(word)
        line = "#   " + ("&& " if index else "")
        for group in groups:
            if len(line) + len(group) + 3 > width and line.strip("#& "):
                lines.append(line.rstrip() + " \\")
                line = "#       "
            line += group + " "
        lines.append(line.rstrip() + (" \\" if index < len(commands) - 1 else ""))
    return lines


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).removesuffix("...\n").strip()


def _shown_profile(profile: str, folder: Path) -> str:
    return profile if profile in known_profiles() else os.path.relpath(profile, folder.resolve())


def _band_comment(band: Band) -> str:
    if band.lower is None:
        return f"at most {_format(band.metric, band.upper)}"
    return f"{_format(band.metric, band.lower)} to {_format(band.metric, band.upper)}"


def baseline_text(derived: Derived, out: Path) -> str:
    """The baseline file: a header that says how to regenerate it and how its bands were derived, then the data."""
    baseline = derived.baseline
    commands = [*sweep_command(baseline, derived.results)]
    commands.append(shlex.join(["harness", "baseline", derived.results, "--out", str(out)]))
    floors = ", ".join(f"{m.name} {m.floor:g}" for m in METRICS.values())
    lines = [
        f"# The CI gate: `harness check --baseline {out}` (.ci/run runs it after the tests).",
        f"# Written by `harness baseline` from the runs in {derived.results}. Regenerate it, runs and all, with:",
        "#",
        *_wrapped(commands),
        "#",
    ]
    if derived.machine:
        lines += [f"# The runs were measured on: {derived.machine}.", "#"]
    lines += [
        "# Each band: reference = the median over the repeats (utilisation: tokens/s over local's; ratio: over",
        "# allreduce's; each a quotient of medians); spread = (max - min) / median over the repeats (for a quotient,",
        f"# both sides' spreads root-sum-squared); tolerance = max(floor, {TOLERANCE_K:g} x spread), floors:",
        f"# {floors}.",
        "# A band holds when reference / (1 + tolerance) <= measured <= reference x (1 + tolerance); final_val_loss",
        "# has only the upper bound. Each line's comment shows its band. Why these floors and K = 3: the docstring",
        "# of harness/analysis/gate.py.",
        "run:",
    ]
    lines += [f"  {key}: {_flow(value)}" for key, value in baseline.settings.items()]
    lines += [f"  seed: {baseline.seed}", f"  repeats: {baseline.repeats}"]
    if baseline.method_options:
        lines.append("  methods:")
        lines += [f"    {m}: {_flow(dict(o))}" for m, o in baseline.method_options.items()]
    lines.append("checks:")
    for check in baseline.checks:
        key = (check.method, check.profile_name)
        median = derived.medians[key]
        facts = [f"{derived.runs[key]} runs", f"median {median['tokens_per_s'] or 0:,.0f} tokens/s"]
        lines.append(f"  # {check.method} on {check.profile_name}: {', '.join(facts)}")
        lines.append(f"  - method: {check.method}")
        lines.append(f"    profile: {_flow(_shown_profile(check.profile, out.parent))}")
        width = max(len(b.metric) for b in check.bands) + 1
        for band in check.bands:
            data = _flow({k: getattr(band, k) for k in BAND_KEYS})
            lines.append(f"    {(band.metric + ':').ljust(width)} {data}  # {_band_comment(band)}")
    return "\n".join(lines) + "\n"


def write_baseline(results: Path, out: Path) -> Derived:
    """Derive a baseline from `results` and write it to `out`, read back (and checked) before it replaces `out`."""
    derived = derive_baseline(results)
    text = baseline_text(derived, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        load_baseline(Path(tmp))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return derived


# --- printing ----------------------------------------------------------------------------------------------------


def _format(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric == "ratio":
        return f"{value:.3g}x"
    if metric == "final_val_loss":
        return f"{value:.3f}"
    if metric == "utilisation":
        return f"{value:.3f}"
    return f"{value:,.4g}"


def results_table(results: Sequence[BandResult]) -> str:
    """Every band: measured, lower, upper, verdict (plain markdown: CI logs are narrow, a rich table wraps)."""
    from harness.analysis.report import markdown_table

    header = ["verdict", "method", "profile", "metric", "measured", "lower", "upper", "reference", "runs"]
    rows = [
        [
            r.verdict,
            r.method,
            r.profile,
            r.band.metric,
            _format(r.band.metric, r.measured) if r.measured is not None else (r.missing or "-"),
            _format(r.band.metric, r.band.lower),
            _format(r.band.metric, r.band.upper),
            _format(r.band.metric, r.band.reference),
            r.runs,
        ]
        for r in results
    ]
    return markdown_table(header, rows, text_columns=4)


def bands_table(baseline: Baseline) -> str:
    """What a baseline allows: each band's reference, spread, tolerance and bounds."""
    from harness.analysis.report import markdown_table

    header = ["method", "profile", "metric", "reference", "spread", "tolerance", "lower", "upper"]
    rows = [
        [
            c.method,
            c.profile_name,
            b.metric,
            _format(b.metric, b.reference),
            f"{b.spread:.3g}",
            f"{b.tolerance:g}",
            _format(b.metric, b.lower),
            _format(b.metric, b.upper),
        ]
        for c in baseline.checks
        for b in c.bands
    ]
    return markdown_table(header, rows, text_columns=3)
