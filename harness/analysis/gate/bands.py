"""A CI-gate baseline file (harness/analysis/gate/check.py's module doc gives its format and what each metric means):
its model (metrics, bands, checks), reading and validating one, the runs it needs (as sweeps to make: making them is
harness/analysis/experiments/check_runs.py's), and the finished runs it is held against, read through
harness/run/folder.py.

Below both of its users: harness/analysis/gate/check.py checks runs against a baseline,
harness/analysis/gate/baseline.py derives one from repeats and writes it.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from harness.analysis.gate.measures import measure
from harness.analysis.options import run_options
from harness.analysis.plan import SweepError, SweepSpec, check_keys, profile_name
from harness.errors import UserError, read_yaml
from harness.net.link import ProfileError
from harness.net.profiles import known_profiles, load_profile
from harness.run.config import check_method_options
from harness.run.folder import RunPaths, find_run_dirs, read_config, read_environment, read_summary
from harness.run.settings import format_value as format_setting
from trainers.registry import PluginError, is_file_spec, is_method, method_names, register_file

DEFAULT_REPEATS = 3
HEX = "0123456789abcdef"
# The reference code's runs: a sweep folder beside a check's own runs, in its --out folder.
REFERENCE_CODE_FOLDER = "reference-code"


@dataclass(frozen=True)
class Metric:
    """One gated quantity: the median over a check's runs of one of a run's measures
    (harness/analysis/gate/measures.py). Why each is gated, and how its floor was measured:
    harness/analysis/gate/check.py's module doc."""

    name: str
    floor: float  # the smallest tolerance `harness baseline` writes
    most: float  # a tolerance at or above this cannot catch what the gate is for: `harness baseline` refuses it
    what: str  # why `most` matters, for the refusal
    cause: str  # printed beside a value outside the band: what it most likely means
    measure: str = ""  # the run measure it is the median of [default: its name]
    # Moves with the machine's kind of CPU, so measured against the baseline's reference code on the machine that
    # checks, where the baseline names one (harness/analysis/experiments/reference_code.py), not against the stored
    # reference.
    on_machine: bool = False

    @property
    def measure_key(self) -> str:
        return self.measure or self.name


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric(
            "step_overhead", 0.06, 0.15, "could not catch a step 15% slower",
            "compute: the method's own work per step (all but waiting on the link) changed against its forward and "
            "backward pass: its step, compression or outer step got slower (or faster)",
            on_machine=True,
        ),
        Metric(
            "step_time_residual", 0.05, 0.25, "could not catch an exchange no longer hidden",
            "link: the run waited on the link longer (or shorter) than its bytes, schedule and link predict: an "
            "exchange no longer hidden, an extra exchange or round trip, or a link slower than its profile",
            on_machine=True,
        ),
        Metric(
            "payload_bytes_per_token", 0.001, 0.02, "could not catch 2% more bytes",
            "bytes: the method hands its collectives another number of bytes per applied token (its payload, its "
            "exchanges or the tokens they carry changed)",
        ),
        Metric(
            "wire_overhead", 0.015, 0.1, "could not catch 10% more bytes on the wire per payload byte",
            "link: another number of bytes crossed the link per payload byte (retransmissions, framing, or messages "
            "the method does not count as payload)",
        ),
        Metric(
            "final_val_loss", 0.002, 0.005, "could not catch a loss 0.5% higher",
            "loss: training at the fixed seed ended at another loss (the update, the data or the numerics changed)",
        ),
    )
}  # fmt: skip
BAND_KEYS = ("reference", "noise", "tolerance")
CHECK_KEYS = ("method", "profile")
TOP_KEYS = ("run", "checks")
OPTIONAL_TOP_KEYS = ("reference_code",)
RUN_KEYS = ("seed", "repeats", "methods")  # run: keys that are not sweep settings
# The order in which a mismatch is named: what a reader most likely changed first.
MISMATCH_ORDER = ("steps", "seed", "model", "clusters", "stages", "batch_size", "seq_len", "eval_every")
# Settings with their own `harness sweep` flag (the rest go through --set KEY=VALUE).
SWEEP_FLAGS = frozenset(
    {"model", "steps", "batch_size", "seq_len", "eval_every", "throughput_warmup_steps", "microbatches",
     "pipeline_schedule", "lr", "data", "clusters", "stages", "backend"}
)  # fmt: skip
# Metrics of the gate before it measured what does not move with the machine's compute (harness/analysis/gate/check.py).
FORMER_METRICS = ("utilisation", "ratio", "wire_bytes_per_token")


class BaselineError(UserError):
    """A baseline file that cannot be checked or written; the message is one sentence naming the fix."""


@dataclass(frozen=True)
class Band:
    metric: str
    reference: float
    noise: float  # one run's relative standard deviation over the repeats the band was derived from
    tolerance: float

    @property
    def lower(self) -> float:
        return self.reference / (1 + self.tolerance)

    @property
    def upper(self) -> float:
        return self.reference * (1 + self.tolerance)

    def holds(self, value: float) -> bool:
        return self.lower <= value <= self.upper


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
    # The git commit whose code `harness check` runs beside the checkout's on the checking machine, to hold the
    # metrics that move with the machine (Metric.on_machine) to what that code measures there rather than to the
    # stored reference (harness/analysis/gate/check.py).
    reference_code: str | None = None


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
    reference, noise, tolerance = (_number(entry[k]) for k in BAND_KEYS)
    if reference is None or reference <= 0:
        raise BaselineError(f"{where}: reference must be a positive number, got {entry['reference']!r}")
    if noise is None or noise < 0:
        raise BaselineError(f"{where}: noise must be a number of at least 0, got {entry['noise']!r}")
    if tolerance is None or tolerance < 0:
        raise BaselineError(f"{where}: tolerance must be a number of at least 0, got {entry['tolerance']!r}")
    return Band(metric, reference, noise, tolerance)


def _require_keys(entry: dict, required: Sequence[str], allowed: Sequence[str], where: str) -> None:
    """Every key of `required` and none outside `allowed`; `where` names the mapping in the error."""
    missing = [k for k in required if k not in entry]
    unknown = sorted(set(entry) - set(allowed))
    if missing or unknown:
        problem = f"lacks {', '.join(missing)}" if missing else f"has unknown key(s) {', '.join(unknown)}"
        raise BaselineError(f"{where} {problem}; allowed keys: {', '.join(allowed)}")


def _check(entry: Any, index: int, folder: Path) -> MethodCheck:
    where = f"checks[{index}]"
    allowed = (*CHECK_KEYS, *METRICS)
    if not isinstance(entry, dict):
        raise BaselineError(f"{where} must be a mapping with method, profile and metric bands ({', '.join(METRICS)})")
    former = [k for k in FORMER_METRICS if k in entry]
    if former:
        raise BaselineError(
            f"{where} gates {former[0]}, a metric of the gate before it measured only what does not move with the "
            "machine's compute speed; write a new baseline with `harness baseline RESULTS --out FILE` from a folder "
            "of repeats (`harness baseline --diff OLD NEW` shows what changed)"
        )
    _require_keys(entry, CHECK_KEYS, allowed, where)
    method = _resolve_method(entry["method"], where, folder)
    bands = tuple(_band(metric, entry[metric], where) for metric in METRICS if metric in entry)
    if not bands:
        raise BaselineError(f"{where} ({method}) has no band; give it at least one of {', '.join(METRICS)}")
    return MethodCheck(method, _resolve_profile(entry["profile"], where, folder), bands)


def _resolve_method(method: Any, where: str, folder: Path) -> str:
    """A check's method: a registered name, or path/to/file.py:Class (relative to the baseline's folder) registered
    from its file under the name it gives."""
    if isinstance(method, str) and is_file_spec(method):
        path, _, cls = method.rpartition(":")
        try:
            return register_file(f"{folder / Path(path).expanduser()}:{cls}")
        except PluginError as err:
            raise BaselineError(f"{where}: {err}") from None
    if not is_method(method):
        raise BaselineError(f"{where}: unknown method {method!r}; known methods: {', '.join(method_names())}")
    return method


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
    _require_keys(data, TOP_KEYS, (*TOP_KEYS, *OPTIONAL_TOP_KEYS), f"baseline file {path}")
    settings, methods, seed, repeats = _run_section(data["run"])
    reference_code = data.get("reference_code")
    if reference_code is not None and not (
        isinstance(reference_code, str) and len(reference_code) == 40 and set(reference_code) <= set(HEX)
    ):
        raise BaselineError(
            f"reference_code must be a full 40-digit git commit (as `git rev-parse COMMIT` prints it), got "
            f"{reference_code!r}"
        )
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
    return Baseline(checks, settings, methods, seed, repeats, reference_code)


# --- running what a baseline needs -------------------------------------------------------------------------------


def _needed_methods(checks: Sequence[MethodCheck], methods: Sequence[str] | None = None) -> list[str]:
    """The checks' methods (those of `methods` only, where given), in the baseline's order."""
    return [c.method for c in checks if methods is None or c.method in methods]


def _profiles(baseline: Baseline) -> dict[str, list[MethodCheck]]:
    by_profile: dict[str, list[MethodCheck]] = {}
    for check in baseline.checks:
        by_profile.setdefault(check.profile, []).append(check)
    return by_profile


def needed_runs(
    baseline: Baseline, repeats: int | None = None, methods: Sequence[str] | None = None
) -> list[SweepSpec]:
    """One sweep per profile over the methods its checks need (those of `methods` only, where given), `repeats`
    runs each (default: the baseline's)."""
    return [
        SweepSpec(
            methods=tuple(_needed_methods(checks, methods)),
            profiles=(profile,),
            seeds=(baseline.seed,),
            settings=baseline.settings,
            per_method=baseline.method_options,
            repeats=repeats or baseline.repeats,
        )
        for profile, checks in _profiles(baseline).items()
        if _needed_methods(checks, methods)
    ]


def sweep_command(
    baseline: Baseline,
    out: str,
    methods: Sequence[str] | None = None,
    repeats: int | None = None,
    force: bool = True,
) -> list[str]:
    """The `harness sweep` command(s) that make the runs `harness check` would make (of `methods` only, where
    given; `repeats` each, default the baseline's), into `out` (fresh where `force`, else resumed)."""
    commands = []
    for profile, checks in _profiles(baseline).items():
        wanted = _needed_methods(checks, methods)
        if not wanted:
            continue
        shown = profile if profile in known_profiles() else os.path.relpath(profile)
        words = ["harness", "sweep", "--methods", ",".join(wanted), "--profiles", shown]
        words += ["--seeds", str(baseline.seed), "--repeats", str(repeats or baseline.repeats)]
        for key, value in baseline.settings.items():
            if key in SWEEP_FLAGS:
                words += [f"--{key.replace('_', '-')}", format_setting(value)]
            else:
                words += ["--set", f"{key}={format_setting(value)}"]
        for method, options in baseline.method_options.items():
            words += [w for k, v in options.items() for w in ("--set", f"{method}.{k}={format_setting(v)}")]
        words += [*(["--force"] if force else []), "--out", out]
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
    run_dir: Path | None = None  # where it is, for its measures; None for a run known only by its files' contents

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

    @cached_property
    def measures(self) -> Mapping[str, float | None]:
        """What the gate measures of it (harness/analysis/gate/measures.py); none for a failed run."""
        if not self.ok or self.run_dir is None:
            return {}
        return measure(self.run_dir, self.summary)

    def settings(self) -> dict[str, Any]:
        return flat_settings(self.config, self.summary)

    def options(self) -> dict[str, Any] | None:
        """Every option the run's method ran with (harness/analysis/options.py); None where this checkout's method
        refuses the options of a run that did not record them."""
        return run_options(self.summary, self.config).resolved

    @property
    def options_recorded(self) -> bool:
        """False for a run folder that recorded only its given options: read over this checkout's defaults."""
        return run_options(self.summary, self.config).recorded


def load_stored_runs(paths: Sequence[Path]) -> list[StoredRun]:
    """Every finished run under `paths`; a file of one that cannot be read is an UnreadableResults naming it (a gate
    must not pass on the runs that happen to be readable)."""
    runs = []
    for run_dir, relative in find_run_dirs(paths):
        summary, files = read_summary(run_dir), RunPaths(run_dir)
        config = read_config(run_dir) if files.config.is_file() else {}
        environment = read_environment(run_dir) if files.environment.is_file() else {}
        runs.append(StoredRun(relative, summary, config, environment, run_dir))
    return runs


def flat_settings(config: Mapping[str, Any], summary: Mapping[str, Any] | None = None) -> dict[str, Any]:
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


def differences(want: Mapping[str, Any], have: Mapping[str, Any]) -> list[str]:
    keys = [k for k in want if k in have and want[k] != have[k]]
    first = [k for k in MISMATCH_ORDER if k in keys]
    return first + sorted(set(keys) - set(first))


# --- printing ----------------------------------------------------------------------------------------------------


def format_value(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric == "final_val_loss":
        return f"{value:.4f}"
    if metric == "payload_bytes_per_token":
        return f"{value:,.5g}"
    return f"{value:.4f}"
