"""`harness cleanup`: remove what harnesses that died without tearing down (SIGKILL) left behind.

Ownership decides (harness/lock.py): everything of a run whose lock file exists and is free is removed, nothing
of a run whose lock is held. This module claims the dead runs' locks, asks each backend to remove its part
(namespaces, delay lines; containers, networks), removes the results staging folders, then deletes the lock files
of the runs nothing is left of. A run without a lock file (a harness of an older version) falls back to the rules
that version relied on (no process in any of its namespaces; its owner pid gone; an idle staging folder).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from harness.backends import netns
from harness.errors import UserError
from harness.lock import (
    RUN_KEY,
    claim_dead_locks,
    claimed_keys,
    claimed_stagings,
    is_real_root,
    owner_alive,
    release_claims,
)
from harness.run.folder import DEFAULT_RUNS_DIR, STAGING_SUFFIX, RunPaths, run_key_of
from trainers.checkpoint import latest_complete

# A results staging folder: `.<name>.partial` next to where the finished folder will be (harness/run/folder.py).
PARTIAL_FOLDER = re.compile(r"^\..+" + re.escape(STAGING_SUFFIX) + "$")
DEFAULT_RESULTS_DIRS = (DEFAULT_RUNS_DIR,)
# A staging folder whose run left no lock file is removed only after this long without a change to any of its files.
STALE_PARTIAL_AGE_S = 3600.0


def _is_partial(folder: Path) -> str | None:
    """The run key of a results staging folder, or None when `folder` is not one (checked before anything is
    removed: a hidden `.<name>.partial` folder, not a link, holding a config.json with a run key)."""
    if not PARTIAL_FOLDER.match(folder.name) or folder.is_symlink() or not folder.is_dir():
        return None
    return run_key_of(folder)


def _last_change(folder: Path) -> float:
    """The newest modification time of the folder or anything in it."""
    newest = folder.lstat().st_mtime
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
            except OSError:
                continue
    return newest


def stale_partials(
    results_dirs: Iterable[Path] = DEFAULT_RESULTS_DIRS, run_key: str | None = None, now: float | None = None
) -> list[Path]:
    """Results staging folders left by dead runs, directly under each of `results_dirs` (default results/runs,
    relative to the working directory; one level deep), of `run_key` only when given.

    A folder counts only if it is named `.<name>.partial`, is not a link, and holds a config.json whose run_key is of
    the form hx + 6 hex digits. It is stale when that run's lock file exists and is free (its owner died), or when the
    run has no lock file (a harness of an older version) and nothing in the folder has changed for
    STALE_PARTIAL_AGE_S (one hour). A run whose lock is held is never stale.
    """
    now = time.time() if now is None else now
    found = []
    for directory in results_dirs:
        try:
            entries = sorted(Path(directory).iterdir())
        except OSError:
            continue
        for folder in entries:
            key = _is_partial(folder)
            if key is None or (run_key and key != run_key):
                continue
            alive = owner_alive(key)
            if alive is False or (alive is None and now - _last_change(folder) > STALE_PARTIAL_AGE_S):
                found.append(folder)
    return found


def _staging_of_dead_runs(run_key: str | None) -> list[Path]:
    """The staging folders named in the claimed (dead) lock files this user owns: found wherever --out put them."""
    return [staging for key, staging in claimed_stagings(run_key) if _is_partial(staging) == key]


@dataclass
class CleanupReport:
    """What `cleanup` removed, and, in sentences, what it could not check or remove and why."""

    namespaces: list[str] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    networks: list[str] = field(default_factory=list)
    partial_folders: list[Path] = field(default_factory=list)
    lock_files: list[Path] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: "removed 2 namespaces (hx123456-sw, hx123456-c0), 0 containers, 0 networks, 0 results folders"."""

        def part(items: list, one: str, many: str) -> str:
            text = f"{len(items)} {one if len(items) == 1 else many}"
            return text + (f" ({', '.join(map(str, items))})" if items else "")

        return "removed " + ", ".join(
            [
                part(self.namespaces, "namespace", "namespaces"),
                part(self.containers, "container", "containers"),
                part(self.networks, "network", "networks"),
                part(self.partial_folders, "results folder", "results folders"),
            ]
        )


def cleanup(run_key: str | None = None, results_dirs: Iterable[Path] | None = None) -> CleanupReport:
    """Remove what harnesses that died without tearing down (SIGKILL) left: their namespaces, containers, networks
    and results staging folders (under `results_dirs`, default results/runs, and wherever their lock file says),
    then their lock files. Never anything of a run whose harness lives. With `run_key`, only that run's."""
    if run_key is not None and not RUN_KEY.match(run_key):
        raise UserError(f"run key {run_key!r} is not one; pass hx and 6 hex digits, as in a run's config.json")
    results_dirs = list(DEFAULT_RESULTS_DIRS if results_dirs is None else results_dirs)
    report = CleanupReport()
    failed = False
    claim_dead_locks(run_key)
    try:
        report.namespaces += netns.cleanup(run_key, report.not_checked)
        _cleanup_docker(run_key, report)
        partials = stale_partials(results_dirs, run_key)
        partials += [p for p in _staging_of_dead_runs(run_key) if p not in partials]
        for folder in partials:
            if latest_complete(RunPaths(folder).checkpoints) is not None:
                # The run's training so far: `harness run --resume` continues it (harness/run/resume.py).
                final = folder.parent / folder.name[1 : -len(STAGING_SUFFIX)]
                report.not_checked.append(
                    f"results folder {folder} kept: it holds a checkpoint; continue its run with harness run "
                    f"--resume {final}, or remove the folder"
                )
                continue
            try:
                shutil.rmtree(folder)
                report.partial_folders.append(folder)
            except OSError as err:
                report.not_checked.append(f"results folder {folder} not removed ({err.strerror or err})")
    except BaseException:
        failed = True
        raise
    finally:
        # A dead run's lock file goes only once nothing of it is left: until then it proves that the run is dead.
        removed, not_removed = release_claims(set() if failed else claimed_keys() - _keys_left(run_key, results_dirs))
        report.lock_files += removed
        report.not_checked += not_removed
    return report


def _cleanup_docker(run_key: str | None, report: CleanupReport) -> None:
    """The docker backend's part; without the SDK or an engine there is nothing of it to check."""
    try:
        import docker

        from harness.backends.docker import cleanup as cleanup_containers
    except ImportError:
        report.not_checked.append(
            "docker containers and networks not checked: the docker SDK is not installed "
            "(pip install 'harness[docker]')"
        )
        return
    try:
        containers, networks = cleanup_containers(run_key)
        report.containers += containers
        report.networks += networks
    except docker.errors.APIError as err:
        report.not_checked.append(f"docker containers and networks not all checked: the engine refused ({err})")
    except docker.errors.DockerException as err:
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        if "Permission denied" in str(err):
            report.not_checked.append(
                f"docker containers and networks not checked: this user may not use the docker engine at {where}; "
                "run `harness cleanup` as root (sudo)"
            )
        else:
            report.not_checked.append(
                f"docker containers and networks not checked: no docker engine answers at {where} "
                f"({type(err).__name__})"
            )


def _keys_left(run_key: str | None, results_dirs: list[Path]) -> set[str]:
    """Run keys that still have a namespace or a results staging folder we can see."""
    keys: set[str] = set()
    try:
        names = os.listdir(netns.NETNS_DIR) if is_real_root() else []
    except OSError:
        names = []
    keys |= {m.group(1) for m in map(netns.OWN_NETNS.match, names) if m}
    for directory in [*results_dirs, *(p.parent for p in _staging_of_dead_runs(run_key))]:
        try:
            entries = list(Path(directory).iterdir())
        except OSError:
            continue
        keys |= {key for key in map(_is_partial, entries) if key}
    return keys
