"""Sweeps: methods x profiles x seeds (x extra settings) run one after another into one folder.

Layout of a sweep folder OUT:

    OUT/sweep.json           the settings every run shares (a resumed sweep must be given the same ones) and
                             "command", the command line that made (or last resumed) the sweep
    OUT/index.csv            one row per combination: its settings, status, failure, path relative to OUT
    OUT/runs/<name>/         one ordinary results folder per combination (harness/run/folder.py)
    OUT/profiles/*.yaml      profiles the sweep derived itself (regime matching, harness/analysis/regime.py)
    OUT/.sweep.lock          while a sweep runs: its flock (and pid), so a second sweep into OUT refuses at once

A run's name is ``<method>-<profile>-s<seed>`` followed by ``-<key>=<value>`` for each varied setting (one given
several values) and ``-r<i>`` for repeats.

Order: round-robin. Seeds (and repeats of a seed) are the outermost loop, then profiles, then methods with their
swept values, so one seed's methods run back to back: a slow moment of a shared machine falls on every method
alike instead of on whichever method ran then.

Resuming goes by name: a combination whose folder holds a summary with status "ok" is skipped unless forced; any
other combination is run again from scratch, after its failed folder and any ``.<name>.partial`` staging folder left
by an interrupted run are removed, because the runner refuses to write over either. A finished run whose options,
defaults included, are not what this invocation would run (a default changed since) makes the sweep refuse to
resume, naming the option: its table would pool two variants under one name.

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from harness.analysis.options import run_options
from harness.errors import UserError
from harness.lock import owner_alive, staging_held
from harness.run import runner
from harness.run.config import RunConfig
from harness.run.folder import RunFolder, RunPaths, UnreadableResults, read_summary, run_key_of
from harness.run.settings import (
    CLUSTER_KEYS,
    TRAIN_KEYS,
    VARIANT_MARK,
    Assignment,
    format_value,
    method_of,
)
from trainers.registry import METHODS, option_names

SWEEP_LOCK = ".sweep.lock"
Grid = tuple[tuple[str, tuple[Any, ...]], ...]  # swept settings: key -> its values, in the order given


class SweepError(UserError):
    """A sweep that cannot start; the message names the fix."""


class SweepInterrupted(Exception):
    """Ctrl-C or SIGTERM stopped a run; the sweep stopped after recording it."""


def check_entries(entries: Sequence[str]) -> None:
    """Every --methods entry names a known method, once, with a label a run folder's name can hold."""
    unknown = [e for e in entries if method_of(e) not in METHODS]
    if unknown:
        raise SweepError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
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
    return frozenset().union(*(option_names(m) for m in METHODS))


def applies_to(key: str, method: str) -> bool:
    """Whether setting `key` means anything for `method`; unknown keys are refused by `check_keys` first."""
    return key not in all_option_names() or key in option_names(method)


def check_keys(keys: Sequence[str]) -> None:
    known = CLUSTER_KEYS | TRAIN_KEYS | all_option_names()
    unknown = sorted(set(keys) - known)
    if unknown:
        raise SweepError(
            f"unknown setting(s) {', '.join(unknown)}: no method has it and no run takes it; `harness methods` lists "
            "each method's settings, `harness run --help` the runs' (the seed is a sweep's --seeds)"
        )


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

    def combinations(self) -> list[Combination]:
        """Every distinct run, in the order they run (module doc: seed and repeat outermost, then profile, then
        method and swept values); a method that lacks a swept option is run once, not once per value."""
        keys = [key for key, _ in self.grid]
        seen: dict[str, Combination] = {}
        for seed, repeat, profile, method, values in product(
            self.seeds, range(self.repeats), self.profiles, self.methods, product(*(v for _, v in self.grid))
        ):
            varied = tuple((k, v) for k, v in zip(keys, values, strict=True) if applies_to(k, method_of(method)))
            combo = Combination(method, profile, seed, varied, repeat, self.repeats)
            seen.setdefault(combo.name, combo)
        return list(seen.values())

    def config(self, combo: Combination) -> RunConfig:
        settings = {**self.settings, **self.per_method.get(combo.method, {}), **dict(combo.varied)}
        return build_config(method_of(combo.method), combo.profile, combo.seed, settings)

    def warnings(self) -> list[str]:
        """RunConfig.warnings of every run, each prefixed with the run's name (call after validate)."""
        return [f"{combo.name}: {w}" for combo in self.combinations() for w in self.config(combo).warnings()]

    def validate(self, regime_pending: bool = False) -> None:
        """Refuse a bad method, profile, setting or value before the first run starts.

        With `regime_pending` a regime profile is still to be derived (minutes): the rest is checked first, with
        an unshaped link standing in for it, so a typo costs nothing.
        """
        if regime_pending:
            dataclasses.replace(self, profiles=(*self.profiles, "unshaped")).validate()
            return
        if not self.profiles:
            raise SweepError("name at least one profile with --profiles, or use --regime")
        if not (self.methods and self.seeds):
            raise SweepError("a sweep needs at least one method, one profile and one seed")
        if self.repeats < 1:
            raise SweepError(f"--repeats must be at least 1, got {self.repeats}")
        check_entries(self.methods)
        check_keys([*self.settings, *(k for k, _ in self.grid)])
        for entry, options in self.per_method.items():
            method = method_of(entry)
            if method not in METHODS:
                raise SweepError(f"options given for unknown method {entry!r}; known: {', '.join(METHODS)}")
            # A training setting may differ per method too (a comparison's per-method step counts).
            foreign = sorted(set(options) - option_names(method) - TRAIN_KEYS)
            if foreign:
                raise SweepError(
                    f"{', '.join(foreign)} is not a setting of {entry} nor a training setting; its settings: "
                    f"{', '.join(sorted(option_names(method))) or 'none'}"
                )
        for combo in self.combinations():
            try:
                # The link emulator too: the CLI validates before the user-namespace re-exec, where the delay line's
                # device is checked as the real user.
                runner.resolve_link_emulator(self.config(combo))
            except UserError as err:
                raise SweepError(f"{combo.name}: {err}") from None


@dataclass(frozen=True)
class IndexRow:
    """One line of index.csv."""

    combination: Combination
    status: str  # ok or failed
    path: str | None  # relative to the sweep folder; None when the run was refused before it had a folder
    failure: str | None = None
    tokens_per_s: float | None = None
    skipped: bool = False  # already finished in an earlier invocation

    def record(self) -> dict[str, Any]:
        combo = self.combination
        return {
            "name": combo.name,
            "method": combo.method,
            "profile": profile_name(combo.profile),
            "seed": combo.seed,
            "repeat": combo.repeat,
            **dict(combo.varied),
            "status": self.status,
            "tokens_per_s": self.tokens_per_s,
            "path": self.path,
            "failure": self.failure,
        }


class SweepObserver(Protocol):
    """What a sweep tells its caller, e.g. the CLI's progress display."""

    def started(self, combo: Combination, position: int, total: int) -> None:
        """A run starts (position counts from 1)."""

    def progress(self, state: dict[str, Any]) -> None:
        """A live update from the running run (harness.run.runner's on_progress)."""

    def finished(self, row: IndexRow) -> None:
        """A run ended, was refused, or was found finished already (row.skipped)."""


class SilentObserver:
    def started(self, combo: Combination, position: int, total: int) -> None:
        pass

    def progress(self, state: dict[str, Any]) -> None:
        pass

    def finished(self, row: IndexRow) -> None:
        pass


def finished_ok(run_dir: Path) -> dict[str, Any] | None:
    """The summary of a finished, successful run in `run_dir`, else None."""
    if not RunPaths(run_dir).summary.is_file():
        return None
    try:
        summary = read_summary(run_dir)
    except UnreadableResults:
        return None
    return summary if summary.get("status") == "ok" else None


def _check_settings(out: Path, spec: SweepSpec, force: bool, command: str | None = None) -> None:
    """A resumed sweep must share its runs' settings, or its table would compare unlike runs. Writes sweep.json
    with the settings and `command`, the command line that makes the sweep (None when not run from one)."""
    path = out / "sweep.json"
    shared = {**spec.settings, "per_method": {m: dict(o) for m, o in spec.per_method.items() if o}}
    settings = json.loads(json.dumps(shared, default=str))
    if path.is_file() and not force:
        previous = json.loads(path.read_text()).get("settings")
        if previous != settings:
            raise SweepError(
                f"{out} holds a sweep made with other settings ({previous}, now {settings}); "
                "pass the same flags to resume it, another --out, or --force to redo it"
            )
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "command": command}, indent=2) + "\n")


def _check_finished_options(out: Path, spec: SweepSpec, combos: Sequence[Combination]) -> None:
    """A finished run is kept only if it ran every option as this invocation would, defaults included: a default
    changed since would otherwise pool two variants under one name (harness/analysis/options.py)."""
    for combo in combos:
        done = finished_ok(out / "runs" / combo.name)
        if done is None:
            continue
        where, have = out / "runs" / combo.name, run_options(done)
        if not have.recorded:
            raise SweepError(
                f"{where} recorded only the options it was given, not the defaults it ran with, so whether it ran "
                "what this sweep would is unknown; pass another --out, or --force to redo the sweep"
            )
        want = spec.config(combo).resolved_options
        key = next((k for k in {**want, **have.resolved} if have.resolved.get(k) != want.get(k)), None)
        if key is not None:
            raise SweepError(
                f"{where} ran {combo.method} with {key}={have.resolved.get(key)!r} where this sweep would run "
                f"{key}={want.get(key)!r} (a default changed since, or other options were given); pass another "
                "--out, or --force to redo the sweep"
            )


def write_index(out: Path, rows: Sequence[IndexRow]) -> Path:
    """index.csv: this invocation's rows, plus earlier rows of other combinations (a sweep can be extended)."""
    path = out / "index.csv"
    table = pd.DataFrame([row.record() for row in rows])
    if path.is_file():
        earlier = pd.read_csv(path)
        table = pd.concat([earlier[~earlier["name"].isin(table["name"])], table], ignore_index=True)
    # Nullable dtypes: a setting that only some methods have stays an integer column, not 10.0.
    table.convert_dtypes().to_csv(path, index=False)
    return path


def _run_one(spec: SweepSpec, combo: Combination, out: Path, observer: SweepObserver) -> IndexRow:
    final = out / "runs" / combo.name
    relative = str(final.relative_to(out))
    # An interrupted run leaves its staging folder; a failed (or forced) run its final one. The runner refuses both.
    # A staging folder belongs to whoever holds its run lock: a live run's (`harness run --out` into this sweep) is
    # not ours to remove.
    staging = RunFolder(final).staging
    key = run_key_of(staging)
    if staging_held(staging) or (key and owner_alive(key)):
        owner = f"a live run ({key})" if key else "a live run"
        return IndexRow(combo, "failed", None, f"{staging} is being written by {owner}; resume when it ends")
    for stale in (staging, final):
        if stale.exists():
            shutil.rmtree(stale)
    try:
        summary = runner.run(spec.config(combo), final, on_progress=observer.progress)
    except runner.RunError as err:
        return IndexRow(combo, "failed", None, str(err))
    # One broken run must not end the sweep; the runner has finalized its folder before raising.
    except Exception as err:
        return IndexRow(combo, "failed", relative if final.exists() else None, f"{type(err).__name__}: {err}")
    return IndexRow(combo, summary["status"], relative, summary.get("failure"), summary.get("tokens_per_s"))


@contextlib.contextmanager
def _sweep_lock(out: Path) -> Iterator[None]:
    """An exclusive flock on OUT/.sweep.lock for the sweep's life: a second sweep into OUT would remove the first
    one's live staging folders and run its combinations again. The kernel drops it however the sweep ends."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / SWEEP_LOCK
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").split()
            os.close(fd)
            pid = holder[1] if len(holder) > 1 and holder[0] == "pid" else "?"
            raise SweepError(
                f"sweep folder {out} is being written by another sweep (pid {pid}); wait for it or pass another --out"
            ) from None
        # The previous holder deletes the file on its way out, maybe between our open and our lock: take the new one.
        if path.exists() and os.path.samestat(os.fstat(fd), os.stat(path)):
            break
        os.close(fd)
    else:
        raise SweepError(f"the sweep lock {path} keeps changing under this process; rerun")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}\n".encode())
        yield
    finally:
        # Deleted while still held, so nobody can take a lock on the file that is going away.
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def run_sweep(
    spec: SweepSpec,
    out: Path,
    force: bool = False,
    observer: SweepObserver | None = None,
    command: str | None = None,
) -> list[IndexRow]:
    """Run every combination not already finished; index.csv is rewritten after each run. `command`, the command
    line that makes this sweep, is recorded in sweep.json so the sweep can be regenerated from it."""
    spec.validate()
    observer = observer or SilentObserver()
    with _sweep_lock(out):
        _check_settings(out, spec, force, command)
        combos = spec.combinations()
        if not force:
            _check_finished_options(out, spec, combos)
        rows: list[IndexRow] = []
        for position, combo in enumerate(combos, start=1):
            done = None if force else finished_ok(out / "runs" / combo.name)
            if done is not None:
                row = IndexRow(combo, "ok", f"runs/{combo.name}", None, done.get("tokens_per_s"), skipped=True)
            else:
                observer.started(combo, position, len(combos))
                row = _run_one(spec, combo, out, observer)
            rows.append(row)
            write_index(out, rows)
            observer.finished(row)
            # The runner turns Ctrl-C into a failed run; the user meant the whole sweep.
            if row.failure and row.failure.startswith("interrupted"):
                raise SweepInterrupted(row.failure)
        return rows
