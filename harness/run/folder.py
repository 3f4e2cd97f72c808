"""One folder per run, and the one module that knows its layout:

    config.json          the RunConfig (harness/run/config.py), written first
    environment.json     what the numbers depend on (harness/run/summary.py's environment)
    summary.json         the headline figures (harness/run/summary.py's summarize), written last
    link_check.json      what the link emulator delivered (harness/net/linkprobe.py), when it was measured
    link_trace.jsonl     a replayed trace's start, rate changes and uplink samples (harness/run/linktrace.py)
    events/rank<R>.jsonl one JSON object per line: what rank R did (harness/run/events.py writes them)
    events/faults.jsonl  the faults injected (harness/run/faults.py)
    ranks/rank<R>.json   rank R's own result, written when it finishes
    logs/rank<R>.log     rank R's output
    tensorboard/         the run's scalars as TensorBoard event files, with --tensorboard (harness/run/tensorboard.py)
    wandb/               the run's Weights & Biases files, with --wandb (harness/run/weights_and_biases.py)
    checkpoints/         every rank's training state at the latest checkpoint, with --set checkpoint_every=N
                         (trainers/checkpoint.py); `harness run --resume` continues from it

The folder is built under a hidden staging name next to its final place and renamed into place at the end, so a
results folder either holds a finished run (status "ok" or "failed") or does not exist.

Everything that reads a run folder reads it through `read_summary`, `read_config`, `read_environment`,
`read_rank_result`, `read_events` and `read_link_trace`: a file that is empty, binary, cut short, not a JSON object
or without the keys its readers index raises an `UnreadableResults` naming the file, instead of a traceback deep in
a report.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import UserError
from harness.lock import RUN_KEY, staging_held

DEFAULT_RUNS_DIR = Path("results") / "runs"
# A folder holding one is a finished run: it is written last.
SUMMARY_NAME = "summary.json"
STAGING_SUFFIX = ".partial"
# Kept free under the file system's path limit for what a run writes inside its folder ("events/rank12.jsonl").
INNER_PATH_BYTES = 64
# Why a directory refused the write probe, for the errors that say more than "No such file or directory" (/proc).
_PROBE_REASONS = {
    errno.EROFS: "is on a read-only file system",
    errno.ENOSPC: "has no space left",
    errno.EDQUOT: "is over its disk quota",
    errno.EACCES: "is not writable (permission denied)",
    errno.EPERM: "is not writable (operation not permitted)",
}


class ResultsError(UserError):
    """A results folder that cannot be written or read; the message names the folder or file and the fix."""


class UnreadableResults(ResultsError):
    """A file of a run folder that its readers cannot use: `why` says what is wrong with `path`."""

    def __init__(self, path: Path, why: str):
        self.path = path
        self.why = why
        super().__init__(f"{path}: {why}; run it again (resuming its sweep redoes it) or remove its run folder")


@dataclass(frozen=True)
class RunPaths:
    """Where each file of the run folder `root` lies (module doc)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def environment(self) -> Path:
        return self.root / "environment.json"

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_NAME

    @property
    def link_check(self) -> Path:
        return self.root / "link_check.json"

    @property
    def link_trace(self) -> Path:
        return self.root / "link_trace.jsonl"

    @property
    def events_dir(self) -> Path:
        return self.root / "events"

    @property
    def faults(self) -> Path:
        return self.events_dir / "faults.jsonl"

    @property
    def ranks_dir(self) -> Path:
        return self.root / "ranks"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def events(self, rank: int) -> Path:
        return self.events_dir / f"rank{rank}.jsonl"

    def rank_result(self, rank: int) -> Path:
        return self.ranks_dir / f"rank{rank}.json"

    def log(self, rank: int) -> Path:
        return self.logs_dir / f"rank{rank}.log"

    def event_ranks(self) -> list[int]:
        """The ranks that have an events file, in order."""
        names = (p.name.removeprefix("rank").removesuffix(".jsonl") for p in self.events_dir.glob("rank*.jsonl"))
        return sorted(int(n) for n in names if n.isdecimal() and n.isascii())


def _shown(name: str, limit: int = 48) -> str:
    return name if len(name) <= limit else name[: limit - 3] + "..."


def _limit(path: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


class RunFolder:
    def __init__(self, final: Path, resuming: bool = False):
        self.final = final
        self.staging = final.parent / f".{final.name}{STAGING_SUFFIX}"
        # An interrupted run continued in place (`harness run --resume`): `create` moves its folder back to staging.
        self.resuming = resuming

    @classmethod
    def interrupted(cls, given: Path) -> RunFolder:
        """The folder of a run to resume, named by its results folder or by the staging folder a killed harness
        left; ResultsError if it is neither, or a live run is writing it."""
        name = given.name
        if name.startswith(".") and name.endswith(STAGING_SUFFIX):
            given = given.parent / name[1 : -len(STAGING_SUFFIX)]
        folder = cls(given, resuming=True)
        if not folder.current.is_dir():
            raise ResultsError(f"{given} is not a run folder; pass the folder of the run to resume")
        if os.path.lexists(folder.staging) and (os.path.lexists(folder.final) or staging_held(folder.staging)):
            raise ResultsError(folder._busy())
        return folder

    @property
    def current(self) -> Path:
        """Where the run's files are now: staging while it runs (or after its harness was killed), else final."""
        return self.staging if os.path.lexists(self.staging) else self.final

    def check(self) -> None:
        """Refuse, before anything is created, a folder that exists, that another run is writing, whose names the
        file system cannot hold, or a place we cannot write. Creates nothing (the write probe is removed)."""
        ancestor = self._nearest_existing()
        if os.path.lexists(self.final):
            raise ResultsError(f"results folder {self.final} already exists; pass another --out or remove it")
        if os.path.lexists(self.staging):
            raise ResultsError(self._busy())
        self._check_lengths(ancestor)
        if not ancestor.is_dir():
            raise ResultsError(
                f"cannot write results under {self.final.parent} ({ancestor} is not a directory); pass a writable --out"
            )
        # A real probe: permission bits say nothing for root, and some file systems (/proc) refuse regardless.
        try:
            os.rmdir(tempfile.mkdtemp(dir=ancestor, prefix=".harness-probe-"))
        except OSError as err:
            reason = _PROBE_REASONS.get(err.errno, "does not accept new folders")
            who = "it" if ancestor == self.final.parent else str(ancestor)
            raise ResultsError(
                f"cannot write results under {self.final.parent} ({who} {reason}); pass a writable --out"
            ) from None

    def _nearest_existing(self) -> Path:
        """The closest existing ancestor of the folder (where it, and any missing parents, will be created)."""
        ancestor = self.final.parent
        while True:
            try:
                ancestor.lstat()
                return ancestor
            except (FileNotFoundError, NotADirectoryError):
                pass
            except OSError as err:
                # A name too long does not exist; the length check names it. Anything else (a folder we may not
                # search) stops here.
                if err.errno != errno.ENAMETOOLONG:
                    raise ResultsError(
                        f"cannot write results under {self.final.parent} ({ancestor}: {err.strerror}); "
                        "pass a writable --out"
                    ) from None
            if ancestor.parent == ancestor:
                return ancestor
            ancestor = ancestor.parent

    def _check_lengths(self, ancestor: Path) -> None:
        """Every name to be created fits the file system's NAME_MAX, and the folder's paths its PATH_MAX."""
        name_max = _limit(ancestor, "PC_NAME_MAX", 255)
        path_max = _limit(ancestor, "PC_PATH_MAX", 4096)
        new = self.final.relative_to(ancestor).parts if self.final.is_relative_to(ancestor) else ()
        for part in new[:-1]:
            if len(os.fsencode(part)) > name_max:
                raise ResultsError(
                    f"folder name {_shown(part)} in {self.final} is {len(os.fsencode(part)):,} bytes, more than the "
                    f"{name_max} this file system allows; pass a shorter --out"
                )
        name = os.fsencode(self.final.name)
        most = name_max - len(f".{STAGING_SUFFIX}")
        if len(name) > most:
            if self.final.parent == DEFAULT_RUNS_DIR:
                raise ResultsError(
                    f"run id {_shown(self.final.name)} is {len(name):,} bytes, too long for a results folder name "
                    f"here (at most {most}: the staging folder .<run id>{STAGING_SUFFIX} must fit in {name_max}); "
                    "rename the profile file (its name is part of the run id) or pass --out"
                )
            raise ResultsError(
                f"results folder name {_shown(self.final.name)} is {len(name):,} bytes, more than the {most} this file "
                f"system allows (the staging folder .<name>{STAGING_SUFFIX} must fit in {name_max}); pass a shorter "
                "--out"
            )
        longest = len(os.fsencode(str(self.staging))) + INNER_PATH_BYTES
        if longest >= path_max:
            raise ResultsError(
                f"results folder {_shown(str(self.final))} is {len(os.fsencode(str(self.final))):,} bytes long, too "
                f"long for this file system's {path_max:,}-byte paths with the files a run writes inside; pass a "
                "shorter --out"
            )

    def _busy(self) -> str:
        return (
            f"results folder {self.final} is being written by another run now, or a killed run left its staging "
            f"folder {self.staging}; wait for that run, or remove {self.staging} if no run is writing it"
        )

    def create(self) -> Path:
        """The staging folder (and missing parents), made atomically: of two runs that passed `check` for the same
        folder at once, one gets it and the other a ResultsError, with nothing of its own left behind. Resuming, the
        run's folder moves back to staging (unless a killed harness left it there)."""
        if self.resuming:
            if not os.path.lexists(self.staging):
                os.replace(self.final, self.staging)
            return self.staging
        missing = []
        parent = self.staging.parent
        while not os.path.lexists(parent) and parent.parent != parent:
            missing.append(parent)
            parent = parent.parent
        made: list[Path] = []
        try:
            for folder in reversed(missing):
                try:
                    folder.mkdir()
                    made.append(folder)
                except FileExistsError:
                    pass  # another run made it first: fine, it is a shared parent
            self.staging.mkdir()
        except FileExistsError:
            _remove_empty(made)
            raise ResultsError(self._busy()) from None
        except OSError as err:
            _remove_empty(made)
            raise ResultsError(
                f"cannot create results folder {self.staging} ({err.strerror}); pass a writable --out"
            ) from None
        if os.path.lexists(self.final):
            # A run with the same folder finished between our check and now: its results stay, ours go elsewhere.
            _remove_empty([*made, self.staging])
            raise ResultsError(f"results folder {self.final} already exists; pass another --out or remove it")
        return self.staging

    @property
    def paths(self) -> RunPaths:
        """The files of the staging folder, where the run writes until `commit`."""
        return RunPaths(self.staging)

    def write_environment(self, environment: dict[str, Any]) -> None:
        _replace(self.paths.environment, json.dumps(environment, indent=2, default=str) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        _replace(self.paths.summary, json.dumps(summary, indent=2, default=str) + "\n")

    def commit(self) -> Path:
        os.replace(self.staging, self.final)
        return self.final


def _remove_empty(folders: list[Path]) -> None:
    """Remove folders this process made, deepest first, where still empty (another run may be using one)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            pass


def _replace(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a reader (or a run killed meanwhile) never sees half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_rank_result(run_dir: Path, rank: int, result: dict[str, Any]) -> None:
    paths = RunPaths(run_dir)
    paths.ranks_dir.mkdir(exist_ok=True)
    _replace(paths.rank_result(rank), json.dumps(result))


# --- reading -----------------------------------------------------------------------------------------------------

# The keys the readers of summary.json index (reports group and label by them, the gate and projections select by
# them); every other figure is read with a default.
SUMMARY_KEYS = ("run_id", "status", "method", "profile", "model", "clusters")
EVENT_KEYS = ("t", "kind")
# Per kind, what summarize, the reports and the runner's failure description index.
EVENT_KIND_KEYS = {
    "step": ("step", "step_s", "tokens"),
    "eval": ("step", "tokens", "val_loss", "eval_s"),
    "error": ("error",),
}
# An event that reports an exchange reports its timing with it.
SYNC_KEYS = ("sync_blocked_s", "sync_overlapped_s")


def _text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UnreadableResults(path, "missing") from None
    except OSError as err:
        raise UnreadableResults(path, f"unreadable ({err.strerror})") from None
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise UnreadableResults(path, "binary, not JSON text") from None
    # UTF-8 can hold NUL bytes, JSON text cannot: a file of zeros (a disk that filled up) is not text either.
    if "\0" in text:
        raise UnreadableResults(path, "binary, not JSON text")
    return text


def _record(
    text: str, path: Path, required: Callable[[dict[str, Any]], Iterable[str]], where: str = ""
) -> dict[str, Any]:
    """The JSON object `text` holds, with the keys `required` names for it; `where` places it in a file of several.
    Every reader of a run folder comes through here."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if not text.strip():
            raise UnreadableResults(path, f"{where}empty") from None
        if err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string"):
            raise UnreadableResults(path, f"{where}cut short (its JSON ends mid-value)") from None
        raise UnreadableResults(
            path, f"{where}not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        ) from None
    if not isinstance(data, dict):
        raise UnreadableResults(path, f"{where}a JSON {_json_type(data)}, not an object")
    missing = sorted(set(required(data)) - set(data))
    if missing:
        raise UnreadableResults(path, f"{where}lacks {', '.join(missing)}")
    return data


def _json_type(value: object) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


def _event_keys(event: dict[str, Any]) -> list[str]:
    kind = event.get("kind")
    keys = [*EVENT_KEYS, *EVENT_KIND_KEYS.get(kind, ())] if isinstance(kind, str) else list(EVENT_KEYS)
    return keys + list(SYNC_KEYS) if "sync_payload_bytes" in event else keys


def _read(path: Path, required: Sequence[str] = ()) -> dict[str, Any]:
    return _record(_text(path), path, lambda _: required)


def read_summary(run_dir: Path) -> dict[str, Any]:
    return _read(RunPaths(run_dir).summary, SUMMARY_KEYS)


def read_config(run_dir: Path) -> dict[str, Any]:
    """config.json as written (RunConfig.load makes the RunConfig); its readers take each key with a default."""
    return _read(RunPaths(run_dir).config)


def read_environment(run_dir: Path) -> dict[str, Any]:
    return _read(RunPaths(run_dir).environment)


def run_key_of(run_dir: Path) -> str | None:
    """The run key config.json names, or None where it names no well-formed one or cannot be read: a staging folder
    of a run killed before it wrote its config, or a folder that is not a run's."""
    try:
        key = read_config(run_dir).get("run_key")
    except UnreadableResults:
        return None
    return key if isinstance(key, str) and RUN_KEY.match(key) else None


def read_rank_result(run_dir: Path, rank: int) -> dict[str, Any] | None:
    """ranks/rank<R>.json, or None where the rank never finished."""
    path = RunPaths(run_dir).rank_result(rank)
    return _read(path) if path.exists() else None


def read_events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """All complete events of one rank, [] where it logged none; a last line cut short by a killed writer is
    skipped, anything else that is not an event raises UnreadableResults."""
    return _read_lines(RunPaths(run_dir).events(rank), _event_keys)


def _read_lines(path: Path, required: Callable[[dict[str, Any]], Iterable[str]]) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, [] where it does not exist (read_events)."""
    if not path.exists():
        return []
    lines = _text(path).splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(_record(line, path, required, f"line {number}: "))
        except UnreadableResults:
            # Only the last line can be cut short by a writer killed mid-line; that is not damage.
            if number < len(lines) or _complete(line):
                raise
    return records


# Per kind of link_trace.jsonl record, what summarize and the trace figure index.
LINK_TRACE_KEYS = {
    "start": ("t0_monotonic", "t0_wall", "clusters"),
    "rate": ("t_s", "rate_bps"),
    "sample": ("t_s", "tx_bytes", "backlog_bytes"),
    "error": ("error",),
}


def read_link_trace(run_dir: Path) -> list[dict[str, Any]]:
    """link_trace.jsonl's records, [] where the run replayed no trace (or never started training); as read_events."""
    return _read_lines(RunPaths(run_dir).link_trace, _link_trace_keys)


def _link_trace_keys(record: dict[str, Any]) -> list[str]:
    kind = record.get("kind")
    return ["kind", *LINK_TRACE_KEYS.get(kind, ())] if isinstance(kind, str) else ["kind"]


def _complete(line: str) -> bool:
    """Whether a line is whole JSON (so its problem is not that the writer died mid-line)."""
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def runs_without_summary(paths: Sequence[Path]) -> list[Path]:
    """Run folders under `paths` (with config.json, not hidden staging areas) that hold no summary.json: a run whose
    end was lost (a killed harness, a copy cut short). Readers name them rather than leave them out unsaid."""
    found = []
    for root in paths:
        if not root.is_dir():
            continue
        search = root / "runs" if (root / "sweep.json").is_file() else root
        for config in sorted(search.rglob("config.json")):
            relative = config.parent.relative_to(root)
            hidden = any(part.startswith(".") for part in relative.parts)
            if config.is_file() and not hidden and not (config.parent / SUMMARY_NAME).is_file():
                found.append(config.parent)
    return found


def find_run_dirs(paths: Sequence[Path]) -> list[tuple[Path, str]]:
    """(folder, path relative to what the user named) of every finished run folder in `paths`: run folders, or
    folders of them (a sweep's, harness/analysis/experiments/sweep.py: its own runs only) at any depth."""
    found: list[tuple[Path, str]] = []
    for root in paths:
        if RunPaths(root).summary.is_file():
            found.append((root, root.name))
            continue
        if not root.is_dir():
            raise ResultsError(f"{root} is neither a run folder nor a folder of runs; pass a results folder")
        # A sweep's own runs only: its folder also holds helper runs (the regime's compute measurement).
        search = root / "runs" if (root / "sweep.json").is_file() else root
        for summary in sorted(search.rglob(SUMMARY_NAME)):
            relative = summary.parent.relative_to(root)
            # Hidden folders are staging areas of runs still in progress (or interrupted).
            if not any(part.startswith(".") for part in relative.parts):
                found.append((summary.parent, str(Path(root.name) / relative)))
    if not found:
        raise ResultsError(f"no run folders (with summary.json) under {', '.join(map(str, paths))}")
    return found
