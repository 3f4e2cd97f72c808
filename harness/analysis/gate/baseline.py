"""`harness baseline`: a baseline file derived from a folder of repeats, and written with a header that says how to
regenerate it. How a band is derived (reference, noise, tolerance = max(floor, K x noise)) and why those floors:
harness/analysis/gate/check.py's module doc. What changed between two baseline files:
harness/analysis/gate/baseline_diff.py.
"""

from __future__ import annotations

import math
import os
import shlex
import statistics
import tempfile
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.analysis.gate.bands import (
    BAND_KEYS,
    METRICS,
    Band,
    Baseline,
    BaselineError,
    MethodCheck,
    StoredRun,
    differences,
    flat_settings,
    format_value,
    load_baseline,
    load_stored_runs,
    sweep_command,
)
from harness.analysis.options import RunOptions, run_options
from harness.analysis.plan import SweepError, check_keys
from harness.analysis.report.markdown import markdown_table
from harness.net.profiles import known_profiles
from harness.run.config import RunConfig
from trainers.registry import is_file_spec, options_shown

TOLERANCE_K = 3.2
MIN_REPEATS = 5
# Runs per method a check makes (the file's run: repeats): the median of 3 against the bands' median of >= 5 keeps
# the check within 5 minutes on 2 cores (gate/check.py's module doc, K).
CHECK_REPEATS = 3
# Bands not derived, with why: a metric that moves more between the hosts CI draws than a regression it must catch.
UNGATED = {
    ("cocktail", "step_overhead"): "read 2.25 on one host and 1.76 on another with the same code (-22%, its "
    "memory-bound compression against the forward and backward), more than the 15% slowdown it must catch; per-host "
    "references would gate it",
}
# Settings `harness baseline` always writes into run: (others only where a run differs from the default).
ALWAYS_WRITTEN = ("model", "steps", "batch_size", "eval_every", "clusters", "stages")


def _noise(values: Sequence[float]) -> float:
    """One run's relative standard deviation over the repeats."""
    median = statistics.median(values)
    return statistics.stdev(values) / abs(median) if median and len(values) > 1 else 0.0


def _round_up(value: float, places: int = 3) -> float:
    return math.ceil(value * 10**places - 1e-9) / 10**places


def _significant(value: float, digits: int) -> float:
    return float(f"{value:.{digits}g}")


def derive_band(metric: str, values: Sequence[float], where: str) -> Band:
    """The band of one metric from its repeats (gate/check.py's module doc): reference = their median, tolerance =
    max(floor, K x noise)."""
    spec = METRICS[metric]
    noise = _noise(values)
    tolerance = _round_up(max(spec.floor, TOLERANCE_K * noise), 4)
    if tolerance >= spec.most:
        raise BaselineError(
            f"{where}: {metric} varied by {noise:.1%} (one standard deviation) over the repeats, so its band "
            f"(x{1 + tolerance:.3f} either way) {spec.what}; measure the repeats again on a quieter machine"
        )
    return Band(metric, _significant(statistics.median(values), 6), _significant(noise, 3), tolerance)


@dataclass(frozen=True)
class Derived:
    """A baseline derived from repeats, with what its file's comments say about them."""

    baseline: Baseline
    medians: Mapping[tuple[str, str], Mapping[str, float | None]]  # (method, profile) -> metric -> median
    runs: Mapping[tuple[str, str], int]
    results: str  # the folder, as the user named it
    repeats: int  # the repeats the bands were derived from (the file's run: repeats is what a check makes)
    machine: str = ""  # where the runs were measured, from their environment.json
    # A method from a file (trainers/registry.py) -> its /abs/file.py:Class, which the file names relative to itself.
    method_files: Mapping[str, str] = field(default_factory=dict)


def _one_configuration(runs: Sequence[StoredRun], results: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The settings every run shares and each method's options; refuses runs of several configurations."""
    first = runs[0]
    settings = first.settings()
    chosen: dict[str, tuple[StoredRun, RunOptions]] = {}
    for run in runs:
        differing = differences(settings, run.settings())
        if differing:
            key = differing[0]
            raise BaselineError(
                f"{results} mixes runs made with different settings ({first.path} has {key}={settings[key]!r}, "
                f"{run.path} {key}={run.settings()[key]!r}); derive a baseline from the repeats of one configuration "
                f"(one `harness sweep --repeats {MIN_REPEATS}`)"
            )
        mine = run_options(run.summary, run.config)
        seen, theirs = chosen.setdefault(run.method, (run, mine))
        if theirs.key != mine.key:
            raise BaselineError(
                f"{results} holds {run.method} runs with different options ({seen.path}: {theirs.label}, {run.path}: "
                f"{mine.label}); derive a baseline from the repeats of one configuration per method"
            )
    # The options that differ from the defaults: they give the runs' resolved options over this checkout's.
    written = {m: o.given if o.resolved is None else options_shown(m, o.resolved) for m, (_, o) in chosen.items()}
    return settings, {m: o for m, o in written.items() if o}


def _run_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """run: settings: the usual ones always, the others where they differ from the defaults."""
    defaults = flat_settings(RunConfig.build("allreduce", "unshaped").to_dict())
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


def derive_baseline(results: Path, reference_code: str | None = None) -> Derived:
    """Two-sided bands from a folder of repeats (gate/check.py's module doc): every method's, on every profile the runs
    used."""
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
    for (method, profile), group in groups.items():
        if len(group) < MIN_REPEATS:
            raise BaselineError(
                f"{where} holds {len(group)} {method} run(s) on {profile}; a baseline's tolerances come from the "
                f"noise of at least {MIN_REPEATS} repeats, so run the sweep with --repeats {MIN_REPEATS}"
            )

    order = {"allreduce": 0, "local": 1}
    checks, medians = [], {}
    for method, profile in sorted(groups, key=lambda k: (k[1], order.get(k[0], 2), k[0])):
        group = groups[(method, profile)]
        label = f"{method} on {profile}"
        bands = []
        for name, metric in METRICS.items():
            if (method, name) in UNGATED:
                continue
            values = [v for v in (r.measures.get(metric.measure_key) for r in group) if v is not None]
            if len(values) == len(group):
                bands.append(derive_band(name, values, label))
        if bands:
            checks.append(MethodCheck(method, profiles[profile], tuple(bands)))
        tokens = [v for v in (r.value("tokens_per_s") for r in group) if v is not None]
        medians[(method, profile)] = {"tokens_per_s": statistics.median(tokens) if tokens else None}
    seed = settings.get("seed", 0)
    repeats = min(len(g) for g in groups.values())
    baseline = Baseline(tuple(checks), _run_settings(settings), method_options, seed, CHECK_REPEATS, reference_code)
    counts = {key: len(group) for key, group in groups.items()}
    files = {run.method: run.config.get("method_source", "") for run in runs}
    files = {method: source for method, source in files.items() if is_file_spec(source)}
    return Derived(baseline, medians, counts, where, repeats, _machine(runs), files)


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


def _shown_method(method: str, files: Mapping[str, str], folder: Path) -> str:
    """A check's method as the file names it: a built-in's or installed method's name, or a method's file relative
    to the baseline's folder (bands.py reads it back from there), so the baseline checks it without a hand edit."""
    if method not in files:
        return method
    path, _, cls = files[method].rpartition(":")
    return f"{os.path.relpath(path, folder.resolve())}:{cls}"


def _band_comment(band: Band) -> str:
    return f"{format_value(band.metric, band.lower)} to {format_value(band.metric, band.upper)}"


def baseline_text(derived: Derived, out: Path) -> str:
    """The baseline file: a header that says how to regenerate it and how its bands were derived, then the data."""
    baseline = derived.baseline
    commands = [*sweep_command(baseline, derived.results, repeats=derived.repeats)]
    code = ["--reference-code", baseline.reference_code] if baseline.reference_code else []
    commands.append(shlex.join(["harness", "baseline", derived.results, "--out", str(out), *code]))
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
    if baseline.reference_code:
        on_machine = " and ".join(m.name for m in METRICS.values() if m.on_machine)
        text = textwrap.wrap(
            f"{on_machine} move with the kind of CPU, so `harness check` runs the same runs with the code of "
            f"reference_code (a commit of this repository) on the machine it checks, in turn with the checkout's, "
            "and centres those bands on what they measure there; the references below are those of the machines named "
            "above (--stored-references holds the bands to them).",
            112,
        )
        lines += [*(f"# {line}" for line in text), "#"]
    for (method, metric), why in UNGATED.items():
        text = textwrap.wrap(f"Not gated: {method} {metric}, which {why}.", 112)
        lines += [*(f"# {line}" for line in text), "#"]
    lines += [
        "# Each band: reference = the median over the repeats; noise = one run's relative standard deviation over",
        f"# them; tolerance = max(floor, {TOLERANCE_K:g} x noise), floors:",
        f"# {floors}.",
        "# A band holds when reference / (1 + tolerance) <= measured <= reference x (1 + tolerance). Each line's",
        "# comment shows its band. What each metric is, why these floors and K: the docstring of",
        "# harness/analysis/gate/check.py. What changed against an older baseline: harness baseline --diff OLD NEW.",
    ]
    if baseline.reference_code:
        lines.append(f"reference_code: {baseline.reference_code}")
    lines.append("run:")
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
        lines.append(f"  - method: {_shown_method(check.method, derived.method_files, out.parent)}")
        lines.append(f"    profile: {_flow(_shown_profile(check.profile, out.parent))}")
        width = max(len(b.metric) for b in check.bands) + 1
        for band in check.bands:
            data = _flow({k: getattr(band, k) for k in BAND_KEYS})
            lines.append(f"    {(band.metric + ':').ljust(width)} {data}  # {_band_comment(band)}")
    return "\n".join(lines) + "\n"


def write_baseline(results: Path, out: Path, reference_code: str | None = None) -> Derived:
    """Derive a baseline from `results` and write it to `out`, read back (and checked) before it replaces `out`;
    `reference_code`: the full commit `harness check` runs beside the checkout
    (harness/analysis/experiments/reference_code.py)."""
    derived = derive_baseline(results, reference_code)
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


def bands_table(baseline: Baseline) -> str:
    """What a baseline allows: each band's reference, noise, tolerance and bounds."""
    header = ["method", "profile", "metric", "reference", "noise", "tolerance", "lower", "upper"]
    rows = [
        [
            c.method,
            c.profile_name,
            b.metric,
            format_value(b.metric, b.reference),
            f"{b.noise:.3g}",
            f"{b.tolerance:g}",
            format_value(b.metric, b.lower),
            format_value(b.metric, b.upper),
        ]
        for c in baseline.checks
        for b in c.bands
    ]
    return markdown_table(header, rows, text_columns=3)
