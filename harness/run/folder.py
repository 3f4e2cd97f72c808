"""One folder per run: config.json, environment.json, events/, logs/, summary.json.

The folder is built under a hidden staging name next to its final place and renamed into place at the end, so a
results folder either holds a finished run (status "ok" or "failed") or does not exist.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from harness.errors import UserError

DEFAULT_RUNS_DIR = Path("results") / "runs"


class ResultsError(UserError):
    """The results folder cannot be written; the message names the fix."""


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


def _shown(name: str, limit: int = 48) -> str:
    return name if len(name) <= limit else name[: limit - 3] + "..."


def _limit(path: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


class RunFolder:
    def __init__(self, final: Path):
        self.final = final
        self.staging = final.parent / f".{final.name}{STAGING_SUFFIX}"

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
        folder at once, one gets it and the other a ResultsError, with nothing of its own left behind."""
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

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        tmp = self.staging / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        os.replace(tmp, self.staging / name)

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
