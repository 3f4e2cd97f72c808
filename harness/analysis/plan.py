"""What a sweep or a comparison will run, checked before anything runs; nothing here runs it
(harness/analysis/experiments/ does: sweep.py, compare.py).

A sweep is methods x profiles x seeds (x extra settings), one run each. A run's name is
``<method>-<profile>-s<seed>`` followed by ``-<key>=<value>`` for each varied setting (one given several values) and
``-r<i>`` for repeats.

Order: round-robin. Seeds (and repeats of a seed) are the outermost loop, then profiles, then methods with their
swept values, so one seed's methods run back to back: a slow moment of a shared machine falls on every method
alike instead of on whichever method ran then.

Settings are one flat mapping of names to values, as RunConfig.build takes them: cluster shape (clusters, stages,
backend), training (TrainConfig fields), lr, or a method's setting, all given as --set (harness/run/settings.py). A
method's setting goes only to the methods whose config has it: ``--set local_steps=10,50`` varies opendiloco's H
and leaves allreduce as one run, instead of failing on the setting allreduce does not have
(trainers.registry.method_config refuses unknown ones, so they are filtered by the method's config fields first). As
on the command line, the value "none" switches an optional setting off. A setting fixed for one method
(`per_method`, ``--set METHOD.KEY=VALUE``) is one of its settings or a training setting (its step count, say), which
then differs from the other methods' for that method alone. One method may run as several variants side by side:
``--methods dilocox,dilocox@paper --set dilocox@paper.overlap=delayed`` runs ``dilocox-...`` and
``dilocox@paper-...``; the label only names the runs, and analysis keys variants on the options the runs record,
never on the label.

A comparison (`harness compare`, CompareSpec) is two sweeps: the full runs, every method x --profile x seed to the
same steps unless --method-steps says otherwise, plus the unshaped runs that give a composed profile its trajectory
where that profile is not measured too; and, for each --composed profile, the short trace runs whose step times are
composed with those trajectories (harness/analysis/projection/composition.py), in the compare folder's TRACES_DIR.
Every comparison is relative to BASELINE (AllReduce: speed-ups, loss gaps) and CEILING (local, which never
communicates: utilisation, and the control the default target is set against).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

from harness.analysis.projection.composition import Cadence
from harness.errors import UserError
from harness.run.config import RunConfig
from harness.run.settings import (
    RUN_KEYS,
    TRAIN_KEYS,
    VARIANT_MARK,
    Assignment,
    format_value,
    method_of,
)
from trainers.registry import is_method, method_names, option_names

Grid = tuple[tuple[str, tuple[Any, ...]], ...]  # swept settings: key -> its values, in the order given
# What every comparison is relative to (module doc).
BASELINE = "allreduce"
CEILING = "local"
# The default target loss where local did not run: AllReduce's final validation loss, this much higher
# (harness/analysis/report/aggregates.default_target).
TARGET_FACTOR = 1.05
# A compare folder's parts (harness/analysis/experiments/compare.py makes them).
TRACES_DIR = "traces"
TRAJECTORY_PROFILE = "unshaped"


class SweepError(UserError):
    """A sweep that cannot start; the message names the fix."""


def check_entries(entries: Sequence[str]) -> None:
    """Every --methods entry names a known method, once, with a label a run folder's name can hold."""
    unknown = [e for e in entries if not is_method(method_of(e))]
    if unknown:
        raise SweepError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(method_names())}")
    repeated = sorted({e for e in entries if entries.count(e) > 1})
    if repeated:
        raise SweepError(
            f"--methods names {', '.join(repeated)} more than once; give a variant a label (dilocox@paper)"
        )
    bad = [e for e in entries if VARIANT_MARK in e and not re.fullmatch(r"[a-z0-9_]+", e.partition(VARIANT_MARK)[2])]
    if bad:
        raise SweepError(
            f"the label of {', '.join(bad)} must be lower-case letters, digits or underscores (dilocox@paper)"
        )


def all_option_names() -> frozenset[str]:
    return frozenset().union(*(option_names(m) for m in method_names()))


def applies_to(key: str, method: str) -> bool:
    """Whether setting `key` means anything for `method`; unknown keys are refused by `check_keys` first."""
    return key not in all_option_names() or key in option_names(method)


def check_keys(keys: Sequence[str]) -> None:
    known = RUN_KEYS | all_option_names()
    unknown = sorted(set(keys) - known)
    if unknown:
        raise SweepError(
            f"unknown setting(s) {', '.join(unknown)}: no method has it and no run takes it; `harness methods` lists "
            "each method's settings, `harness run --help` the runs' (the seed is a sweep's --seeds)"
        )


def check_keys_apply(keys: Sequence[str], methods: Sequence[str]) -> None:
    """A method setting given for every run must be a setting of at least one method that runs: otherwise nothing
    reads it, and the study's notes would still list it as a shared setting."""
    names = {entry: option_names(method_of(entry)) for entry in methods}
    unread = sorted(k for k in set(keys) - RUN_KEYS if not any(k in n for n in names.values()))
    if unread:
        owners = sorted(m for m in method_names() if unread[0] in option_names(m))
        raise SweepError(
            f"--set {unread[0]} is a setting of {', '.join(owners)}, which --methods ({', '.join(methods)}) does not "
            "run; add the method or leave the setting out"
        )


def unrun_scope_warnings(per_method: Mapping[str, Any], methods: Sequence[str]) -> list[str]:
    """Settings scoped to a method or variant that --methods does not run: read by nothing. Warned about, not
    refused: the gate's stored sweeps give every method's settings to each group of methods they run."""
    return [
        f"--set {entry}.KEY=VALUE ({', '.join(sorted(per_method[entry]))}) is scoped to {entry}, which --methods "
        f"({', '.join(methods)}) does not run, so it changes nothing; add {entry} to --methods or leave it out"
        for entry in sorted(set(per_method) - set(methods))
        if per_method[entry]
    ]


def sweep_settings(assignments: Sequence[Assignment]) -> tuple[dict[str, Any], Grid, dict[str, dict[str, Any]]]:
    """(fixed, grid, per_method) from a sweep's --set assignments. One without a method is fixed for every run that
    has it when it gives one value, and swept when it gives several (each run's name then says its value); one
    scoped to a method, or to a METHOD@LABEL variant, is that entry's own, one value."""
    fixed: dict[str, Any] = {}
    grid: dict[str, tuple[Any, ...]] = {}
    per_method: dict[str, dict[str, Any]] = {}
    for assignment in assignments:
        if assignment.scope is None:
            if len(assignment.values) == 1:
                fixed[assignment.key] = assignment.values[0]
            else:
                grid[assignment.key] = assignment.values
            continue
        if len(assignment.values) != 1:
            raise SweepError(
                f"--set {assignment.text} gives one method several values; run each as a variant "
                f"(--methods {assignment.scope}@a,{assignment.scope}@b with --set {assignment.scope}@a.{assignment.key}"
                "=...) or sweep every method that has it (leave out the method)"
            )
        per_method.setdefault(assignment.scope, {})[assignment.key] = assignment.values[0]
    return fixed, tuple(grid.items()), per_method


def fixed_settings(assignments: Sequence[Assignment], what: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(settings, per_method) from --set assignments that each give one value (`what` runs each setting once)."""
    fixed, grid, per_method = sweep_settings(assignments)
    if grid:
        key, values = grid[0]
        raise SweepError(
            f"--set {key}={','.join(map(format_value, values))} gives several values, and {what} runs one; "
            "`harness sweep` varies them"
        )
    return fixed, per_method


def profile_name(profile: str) -> str:
    """A profile's name as the results record it: the file stem for a path, else the name itself."""
    return Path(profile).stem


def _format_value(value: Any) -> str:
    return format_value(value).replace("/", "_")


@dataclass(frozen=True)
class Combination:
    """One run of a sweep."""

    method: str
    profile: str  # a profile name or a path to a profile YAML
    seed: int
    varied: tuple[tuple[str, Any], ...] = ()  # the swept settings that apply to this method
    repeat: int = 0
    repeats: int = 1

    @property
    def name(self) -> str:
        parts = [self.method, profile_name(self.profile), f"s{self.seed}"]
        parts += [f"{key}={_format_value(value)}" for key, value in self.varied]
        if self.repeats > 1:
            parts.append(f"r{self.repeat}")
        return "-".join(parts)


def build_config(method: str, profile: str, seed: int, settings: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from flat settings; method options that `method` does not have are left out (module doc)."""
    check_keys(list(settings))
    config = RunConfig.build(method, profile, seed=seed, **{k: v for k, v in settings.items() if applies_to(k, method)})
    config.validate()
    return config


@dataclass(frozen=True)
class SweepSpec:
    methods: tuple[str, ...]
    profiles: tuple[str, ...]
    seeds: tuple[int, ...]
    grid: Grid = ()  # swept settings, from --set KEY=V1,V2
    settings: Mapping[str, Any] = field(default_factory=dict)  # common to every run
    per_method: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # method -> its own options
    repeats: int = 1
    # (method, profile) pairs left out: a comparison composes some methods on a link where it measures the others.
    skip: frozenset[tuple[str, str]] = frozenset()
    # --selected-on: the seeds on which each method's settings were chosen (sweep.json records them; a report labels
    # that method's rows on those seeds in-sample).
    selected_on: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def combinations(self) -> list[Combination]:
        """Every distinct run, in the order they run (module doc: seed and repeat outermost, then profile, then
        method and swept values); a method that lacks a swept option is run once, not once per value."""
        keys = [key for key, _ in self.grid]
        seen: dict[str, Combination] = {}
        for seed, repeat, profile, method, values in product(
            self.seeds, range(self.repeats), self.profiles, self.methods, product(*(v for _, v in self.grid))
        ):
            if (method, profile) in self.skip:
                continue
            varied = tuple((k, v) for k, v in zip(keys, values, strict=True) if applies_to(k, method_of(method)))
            combo = Combination(method, profile, seed, varied, repeat, self.repeats)
            seen.setdefault(combo.name, combo)
        return list(seen.values())

    def config(self, combo: Combination) -> RunConfig:
        settings = {**self.settings, **self.per_method.get(combo.method, {}), **dict(combo.varied)}
        return build_config(method_of(combo.method), combo.profile, combo.seed, settings)

    def warnings(self) -> list[str]:
        """Settings scoped to a method that does not run, then RunConfig.warnings of every run, each prefixed with
        the run's name (call after validate)."""
        return unrun_scope_warnings(self.per_method, self.methods) + [
            f"{combo.name}: {w}" for combo in self.combinations() for w in self.config(combo).warnings()
        ]

    def validate(self, regime_pending: bool = False, link_check: Callable[[RunConfig], object] | None = None) -> None:
        """Refuse a bad method, profile, setting or value before the first run starts.

        With `regime_pending` a regime profile is still to be derived (minutes): the rest is checked first, with
        an unshaped link standing in for it, so a typo costs nothing. `link_check`, where given, is called with every
        run's config and refuses a link this machine cannot emulate (harness/analysis/experiments/sweep.py passes
        the runner's; nothing outside experiments/ imports the runner).
        """
        if regime_pending:
            dataclasses.replace(self, profiles=(*self.profiles, "unshaped")).validate(link_check=link_check)
            return
        if not self.profiles:
            raise SweepError("name at least one profile with --profiles, or use --regime")
        if not (self.methods and self.seeds):
            raise SweepError("a sweep needs at least one method, one profile and one seed")
        if self.repeats < 1:
            raise SweepError(f"--repeats must be at least 1, got {self.repeats}")
        check_entries(self.methods)
        unknown = sorted(set(self.selected_on) - {method_of(m) for m in self.methods})
        if unknown:
            raise SweepError(f"--selected-on names {', '.join(unknown)}, which --methods does not run")
        check_keys([*self.settings, *(k for k, _ in self.grid)])
        check_keys_apply([*self.settings, *(k for k, _ in self.grid)], self.methods)
        for entry, options in self.per_method.items():
            method = method_of(entry)
            if not is_method(method):
                raise SweepError(f"options given for unknown method {entry!r}; known: {', '.join(method_names())}")
            # A training setting may differ per method too (a comparison's per-method step counts).
            foreign = sorted(set(options) - option_names(method) - TRAIN_KEYS)
            if foreign:
                raise SweepError(
                    f"{', '.join(foreign)} is not a setting of {entry} nor a training setting; its settings: "
                    f"{', '.join(sorted(option_names(method))) or 'none'}"
                )
        for combo in self.combinations():
            try:
                config = self.config(combo)
                if link_check is not None:
                    link_check(config)
            except UserError as err:
                raise SweepError(f"{combo.name}: {err}") from None


# --- a comparison ------------------------------------------------------------------------------------------------


class CompareError(UserError):
    """A comparison that cannot be made; the message names the fix."""


def parse_method_steps(specs: Sequence[str]) -> dict[str, int]:
    """'dilocox=240' -> {'dilocox': 240}, for every --method-steps."""
    steps: dict[str, int] = {}
    for spec in specs:
        method, equals, count = spec.partition("=")
        try:
            value = int(count)
        except ValueError:
            value = 0
        if not (equals and method.strip()) or value < 1:
            raise CompareError(f"--method-steps {spec!r} must look like METHOD=STEPS with STEPS >= 1 (dilocox=240)")
        steps[method.strip()] = value
    return steps


def with_control(methods: Sequence[str]) -> tuple[str, ...]:
    """`methods` with CEILING (local) last where it is missing: trained the same way with no communication, it is the
    compute floor and the check that a target measures communication (a target it reaches does not)."""
    return tuple(methods) if CEILING in methods else (*methods, CEILING)


def parse_selected_on(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """'dilocox=3,4,5' -> {'dilocox': (3, 4, 5)}, for every --selected-on."""
    chosen: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        method, equals, seeds = spec.partition("=")
        try:
            values = tuple(int(seed) for seed in seeds.split(","))
        except ValueError:
            values = ()
        if not (equals and method.strip() and values):
            raise UserError(f"--selected-on {spec!r} must look like METHOD=SEEDS (dilocox=3,4,5)")
        chosen[method.strip()] = values
    return chosen


@dataclass(frozen=True)
class CompareSpec:
    """What `harness compare` runs: methods x profiles x seeds, measured and composed (module doc)."""

    methods: tuple[str, ...]
    profiles: tuple[str, ...]  # measured end to end: profile names or YAML paths
    composed: tuple[str, ...] = ()  # estimated by composition
    seeds: tuple[int, ...] = (0,)
    settings: Mapping[str, Any] = field(default_factory=dict)  # every run's (as a sweep's)
    per_method: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # --method-set
    method_steps: Mapping[str, int] = field(default_factory=dict)  # --method-steps
    # --selected-on: the seeds on which each method's settings were chosen; its rows on those seeds are in-sample.
    selected_on: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    target_loss: float | None = None
    # A link both measured and composed split by method: profile -> the methods composed there (too slow to run end
    # to end here); the others are measured. --regime's link (harness/analysis/experiments/compare.py) is one.
    composed_methods: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    regime: str | None = None  # --regime: the published regime whose link this comparison derives
    # With --regime: each method's full run on its link as the link model predicts it, and the limit over which it
    # is composed there (harness/analysis/experiments/compare.py).
    predicted_run_s: Mapping[str, float] = field(default_factory=dict)
    measure_limit_s: float | None = None
    # Each composed method's step time on its --composed link as the link model predicts it, from a compute time
    # measured when the comparison ran: what makes its trace long enough in wall-clock (projection/composition.py).
    trace_step_s: Mapping[str, float] = field(default_factory=dict)

    def trajectory_of(self, profile: str) -> str:
        """Where a composed profile's loss trajectory comes from: its own full runs where measured; for a split link
        (composed_methods), the first link measured whole; else unshaped (the loss does not depend on the link)."""
        whole = [p for p in self.profiles if p not in self.composed_methods]
        if profile in whole:
            return profile
        return whole[0] if profile in self.composed_methods and whole else TRAJECTORY_PROFILE

    @property
    def regime_link(self) -> str | None:
        """The --regime link once derived: the profile added last (harness/analysis/experiments/compare.py)."""
        return self.profiles[-1] if self.regime is not None and self.predicted_run_s else None

    def composed_on(self, profile: str) -> tuple[str, ...]:
        """The methods composed on a --composed profile: all of them, or a split link's composed_methods."""
        return tuple(self.composed_methods.get(profile, self.methods))

    def _split_skip(self, composed: bool) -> frozenset[tuple[str, str]]:
        """The (method, profile) runs a split link leaves out of the full sweep (composed=False: its composed methods)
        or of the traces (composed=True: its measured ones)."""
        return frozenset(
            (m, p) for p, chosen in self.composed_methods.items() for m in self.methods if (m in chosen) != composed
        )

    def full_sweep(self) -> SweepSpec:
        trajectories = [self.trajectory_of(p) for p in self.composed]
        profiles = list(dict.fromkeys([*self.profiles, *trajectories]))
        per_method = {m: {**self.per_method.get(m, {})} for m in self.methods}
        for method, steps in self.method_steps.items():
            per_method.setdefault(method, {})["steps"] = steps
        return SweepSpec(
            self.methods, tuple(profiles), self.seeds, settings=self.settings, per_method=per_method,
            skip=self._split_skip(composed=False), selected_on=self.selected_on,
        )  # fmt: skip

    @functools.cached_property
    def _full_configs(self) -> dict[str, RunConfig]:
        # Built once: validating a config reads the corpus (~0.2 s), and the table's notes ask for them often.
        sweep = self.full_sweep()
        return {m: sweep.config(Combination(m, TRAJECTORY_PROFILE, self.seeds[0])) for m in self.methods}

    def full_config(self, method: str) -> RunConfig:
        """The RunConfig of `method`'s full runs (on an unshaped link: only what does not depend on the link is
        asked of it)."""
        return self._full_configs[method]

    @functools.cached_property
    def _cadences(self) -> dict[str, Cadence]:
        return {m: Cadence.of(self.full_config(m)) for m in self.methods}

    def cadences(self) -> dict[str, Cadence]:
        """Each method's synchronization rounds, as its config declares them (projection/composition.py)."""
        return self._cadences

    def trace_steps(self) -> dict[str, int]:
        """Each method's trace length (projection/composition.py's Cadence.trace_steps, at its trace_step_s where
        predicted); none without --composed."""
        if not self.composed:
            return {}
        return {
            m: c.trace_steps(self.full_config(m).train.steps, self.trace_step_s.get(m))
            for m, c in self.cadences().items()
        }

    def trace_sweep(self) -> SweepSpec | None:
        if not self.composed:
            return None
        full = self.full_sweep()
        per_method = {m: {**full.per_method.get(m, {}), "steps": s} for m, s in self.trace_steps().items()}
        return SweepSpec(
            self.methods, self.composed, self.seeds, settings=self.settings, per_method=per_method,
            skip=self._split_skip(composed=True), selected_on=self.selected_on,
        )  # fmt: skip

    def validate(self, link_check: Callable[[RunConfig], object] | None = None) -> None:
        """Every refusal before anything is created; each is one sentence naming the fix (`link_check`: as
        SweepSpec.validate's)."""
        if not (self.profiles or self.composed):
            raise CompareError("name at least one link with --profile (measured) or --composed (composed estimate)")
        if not self.methods:
            raise CompareError(f"name the methods to compare with --methods; known: {', '.join(method_names())}")
        if BASELINE not in self.methods and self.target_loss is None:
            raise CompareError(
                f"--methods lacks {BASELINE}, which sets the default target (with {CEILING}) and every speed-up: "
                "add it, or pass --target-loss to compare without speed-ups"
            )
        if self.target_loss is not None and not (math.isfinite(self.target_loss) and self.target_loss > 0):
            raise CompareError(f"--target-loss must be a positive validation loss, got {self.target_loss}")
        clusters = {self.settings.get("clusters"), *(o.get("clusters") for o in self.per_method.values())} - {None}
        if any(count < 2 for count in clusters):
            raise CompareError(
                "a comparison measures what crosses the link between clusters, and --clusters 1 has none (every "
                "method would run as local); use --clusters 2 or more"
            )
        # Scoped to a method that does not exist: a typo, not a method left out (warned about, unrun_scope_warnings).
        strangers = sorted(entry for entry in self.per_method if not is_method(method_of(entry)))
        if strangers:
            raise CompareError(f"options given for unknown method {strangers[0]!r}; known: {', '.join(method_names())}")
        strangers = sorted(set(self.method_steps) - set(self.methods))
        if strangers:
            raise CompareError(f"--method-steps names {', '.join(strangers)}, which --methods does not run")
        if self.measure_limit_s is not None and self.regime is None:
            raise CompareError("--measure-limit applies only with --regime (the link it decides what to measure on)")
        for profile, chosen in self.composed_methods.items():
            if not (profile in self.profiles and profile in self.composed and set(chosen) <= set(self.methods)):
                raise CompareError(f"a link split between measured and composed methods must be both; {profile} is not")
        self.full_sweep().validate(link_check=link_check)
        trace = self.trace_sweep()
        if trace is not None:
            trace.validate(link_check=link_check)

    def warnings(self) -> list[str]:
        """As SweepSpec.warnings, for the comparison's runs (call after validate)."""
        return unrun_scope_warnings(self.per_method, self.methods) + self.full_sweep().warnings()

    def record(self) -> dict[str, Any]:
        """The settings as compare.json records them."""
        return {
            "methods": list(self.methods),
            "profiles": [profile_name(p) for p in self.profiles],
            "composed": [profile_name(p) for p in self.composed],
            "trajectories": {profile_name(p): profile_name(self.trajectory_of(p)) for p in self.composed},
            "seeds": list(self.seeds),
            "settings": {k: v for k, v in self.settings.items()},
            "per_method": {m: dict(o) for m, o in self.per_method.items() if o},
            "steps": {m: self.full_config(m).train.steps for m in self.methods},
            "trace_steps": self.trace_steps(),
            "target_loss": self.target_loss,
            "regime": self.regime,
            "measure_limit_s": self.measure_limit_s,
            "predicted_run_s": dict(self.predicted_run_s),
            "trace_step_s": dict(self.trace_step_s),
            "composed_methods": {profile_name(p): list(ms) for p, ms in self.composed_methods.items()},
            "selected_on": {m: list(seeds) for m, seeds in self.selected_on.items()},
        }

    def in_sample_seeds(self, method: str, seeds: Sequence[int]) -> list[int]:
        """Those of `seeds` that chose `method`'s settings (--selected-on): a row on them is in-sample."""
        return sorted(set(seeds) & set(self.selected_on.get(method, ())))
