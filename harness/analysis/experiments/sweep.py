"""The sweep executor: a sweep's runs (harness/analysis/plan.py's SweepSpec) made one after another into one folder.

Layout of a sweep folder OUT:

    OUT/sweep.json           the settings every run shares (a resumed sweep must be given the same ones),
                             "command", the command line that made (or last resumed) the sweep, and "selected_on",
                             the seeds each method's settings were chosen on (--selected-on: its runs on them are
                             in-sample, and `harness report` labels them so)
    OUT/index.csv            one row per combination: its settings, status, failure, path relative to OUT
    OUT/runs/<name>/         one ordinary results folder per combination (harness/run/folder.py)
    OUT/profiles/*.yaml      profiles the sweep derived itself (regime matching, harness/analysis/experiments/regime.py)
    OUT/.sweep.lock          while a sweep runs: its flock (and pid), so a second sweep into OUT refuses at once

Resuming goes by name: a combination whose folder holds a summary with status "ok" is skipped unless forced; one
whose interrupted run left a checkpoint (`--set checkpoint_every=N`) continues from it, in its folder
(harness/run/resume.py); any other is run again from scratch, after its failed folder and any ``.<name>.partial``
staging folder left by an interrupted run are removed, because the runner refuses to write over either. A finished
run whose options, defaults included, are not what this invocation would run (a default changed since) makes the
sweep refuse to resume, naming the option: its table would pool two variants under one name.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from harness.analysis.options import run_options
from harness.analysis.plan import Combination, SweepError, SweepSpec, profile_name
from harness.lock import owner_alive, staging_held
from harness.run import runner
from harness.run.folder import RunFolder, RunPaths, UnreadableResults, read_summary, run_key_of
from trainers.checkpoint import latest_complete

SWEEP_LOCK = ".sweep.lock"


class SweepInterrupted(Exception):
    """Ctrl-C or SIGTERM stopped a run; the sweep stopped after recording it."""


def validate_sweep(spec: SweepSpec, regime_pending: bool = False) -> None:
    """SweepSpec.validate, and every run's link checked against what this machine can emulate (the runner's link
    emulator: the CLI validates before the user-namespace re-exec, where the delay line's device is checked as the
    real user)."""
    spec.validate(regime_pending, link_check=runner.resolve_link_emulator)


@dataclass(frozen=True)
class IndexRow:
    """One line of index.csv."""

    combination: Combination
    status: str  # ok or failed
    path: str | None  # relative to the sweep folder; None when the run was refused before it had a folder
    failure: str | None = None
    tokens_per_s: float | None = None
    skipped: bool = False  # already finished in an earlier invocation
    # Its summary's figure (harness/run/host_cpu.py), for the progress line; index.csv leaves it to the summary.
    host_other_cpu_share: float | None = None

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
    if path.is_file():
        previous = json.loads(path.read_text()).get("settings")
        # --force reruns this sweep's runs only: the others, made with other settings, would stay beside them.
        if previous != settings:
            raise SweepError(
                f"{out} holds a sweep made with other settings ({previous}, now {settings}); pass the same flags to "
                "resume it (or, with --force, to redo it), or another --out"
            )
    out.mkdir(parents=True, exist_ok=True)
    # Which seeds chose which method's settings is said of the study, not of its runs: a resumed sweep records what
    # its latest command says.
    selected_on = {method: list(seeds) for method, seeds in spec.selected_on.items()}
    record = {"settings": settings, "command": command, "selected_on": selected_on}
    path.write_text(json.dumps(record, indent=2) + "\n")


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
    resume = _checkpointed(final)
    if resume is None:
        for stale in (staging, final):
            if stale.exists():
                shutil.rmtree(stale)
    try:
        if resume is None:
            summary = runner.run(spec.config(combo), final, on_progress=observer.progress)
        else:
            summary = runner.execute(runner.validate_resume(final), on_progress=observer.progress)
    except runner.RunError as err:
        return IndexRow(combo, "failed", None, str(err))
    # One broken run must not end the sweep; the runner has finalized its folder before raising.
    except Exception as err:
        return IndexRow(combo, "failed", relative if final.exists() else None, f"{type(err).__name__}: {err}")
    return IndexRow(
        combo,
        summary["status"],
        relative,
        summary.get("failure"),
        summary.get("tokens_per_s"),
        host_other_cpu_share=summary.get("host_other_cpu_share"),
    )


def _checkpointed(final: Path) -> int | None:
    """The checkpoint an interrupted run of this combination can resume from (--set checkpoint_every=N), if one
    is left in its folder or in the staging folder a killed harness left; the sweep continues the run from it."""
    folder = RunFolder(final)
    if not folder.current.is_dir() or finished_ok(folder.current) is not None:
        return None
    return latest_complete(RunPaths(folder.current).checkpoints)


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
    validate_sweep(spec)
    if out.exists() and not out.is_dir():
        raise SweepError(f"--out {out} is a file; pass a folder (a new one, or one a sweep or comparison wrote)")
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
                row = IndexRow(
                    combo,
                    "ok",
                    f"runs/{combo.name}",
                    None,
                    done.get("tokens_per_s"),
                    skipped=True,
                    host_other_cpu_share=done.get("host_other_cpu_share"),
                )
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
