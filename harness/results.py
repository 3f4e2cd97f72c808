"""One folder per run: config.json, environment.json, events/, logs/, summary.json.

The folder is built under a hidden staging name next to its final place and renamed into place at the end, so a
results folder either holds a finished run (status "ok" or "failed") or does not exist.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.config import RunConfig
from harness.conformance import conforms, max_excess
from harness.errors import UserError
from harness.events import read_events
from harness.profiles import default_burst_bytes
from trainers.models import count_parameters, get_model_config
from trainers.registry import method_config

DEFAULT_RUNS_DIR = Path("results") / "runs"
SUMMARY_SCHEMA = 1


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


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    repo = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(extra: dict[str, Any]) -> dict[str, Any]:
    """What the numbers depend on: code version, packages, kernel, machine; plus the backend's own record."""
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty) if dirty is not None else None,
        "python": platform.python_version(),
        "packages": {p: _version(p) for p in ("harness", "torch", "numpy", "pyroute2", "click")},
        "kernel": platform.release(),
        "machine": platform.machine(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "euid": os.geteuid(),
        **extra,
    }


def _rank_results(run_dir: Path, world_size: int) -> dict[int, dict[str, Any]]:
    found = {}
    for rank in range(world_size):
        path = run_dir / "ranks" / f"rank{rank}.json"
        if path.exists():
            found[rank] = json.loads(path.read_text())
    return found


def _hidden_fraction(syncs: list[dict[str, Any]]) -> float | None:
    """Share of communication time that ran behind computation instead of blocking the training thread."""
    blocked = sum(e["sync_blocked_s"] for e in syncs)
    overlapped = sum(e["sync_overlapped_s"] for e in syncs)
    return overlapped / (blocked + overlapped) if blocked + overlapped > 0 else None


def _regime_target_r(profile_source: str) -> float | None:
    """R_target of a regime-matched profile: its record (harness/projection.py) lies beside it as .json."""
    record = Path(profile_source).with_suffix(".json") if profile_source else None
    try:
        return float(json.loads(record.read_text())["target_r"]) if record and record.is_file() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wire_samples(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(time, bytes sent since training started) at the start of training and at the end of every step."""
    steps = [e for e in events if e["kind"] == "step" and "wire_bytes" in e]
    # The counter's zero was read just before the first step started.
    return [(steps[0]["t"] - steps[0]["step_s"], 0)] + [(e["t"], e["wire_bytes"]) for e in steps] if steps else []


def summarize(config: RunConfig, run_dir: Path, failure: str | None, backend_record: dict[str, Any]) -> dict:
    """summary.json: the run's headline figures, from the ranks' results and events."""
    world = config.clusters * config.stages
    ranks = _rank_results(run_dir, world)
    events = {r: read_events(run_dir / "events" / f"rank{r}.jsonl") for r in range(world)}
    steps = [e for e in events[0] if e["kind"] == "step"]
    # A method's last exchange may complete in finish(), logged as its own event after the last step.
    syncs = [e for e in events[0] if e["kind"] in ("step", "finish") and "sync_payload_bytes" in e]
    last_stage = [c * config.stages + config.stages - 1 for c in range(config.clusters)]
    first_stage = [c * config.stages for c in range(config.clusters)]
    evals = [e for e in events[last_stage[0]] if e["kind"] == "eval"]
    status = "ok" if failure is None and len(ranks) == world else "failed"
    if status == "failed" and failure is None:
        failure = f"only {len(ranks)} of {world} ranks reported results"

    def from_ranks(key: str, which: list[int]) -> list:
        return [ranks[r][key] for r in which if r in ranks and ranks[r].get(key) is not None]

    window_s = ranks.get(0, {}).get("window_s")
    window_tokens = ranks.get(0, {}).get("window_tokens")
    # Tokens that count are tokens in the final model: those whose updates the synchronized parameters hold. A
    # stage-0 rank speaks for its replica (every stage of a replica synchronizes the same rounds).
    applied_tokens = ranks.get(0, {}).get("applied_tokens")
    window_applied_tokens = ranks.get(0, {}).get("window_applied_tokens", window_tokens)
    train_losses = from_ranks("final_train_loss", last_stage)
    wire = from_ranks("wire_bytes", first_stage)
    tokens = steps[-1]["tokens"] if steps else 0
    exchanges = [e for e in syncs if e.get("sync_payload_bytes")]
    link = config.profile.inter_cluster
    per_cluster = []
    for cluster, rank in enumerate(first_stage):
        # Each cluster's uplink at its own rate (a profile's `sites` may give it one).
        up, down = config.profile.uplink(cluster), config.profile.downlink(cluster)
        rate = up.rate_bps if config.clusters > 1 else None
        per_cluster.append(
            {
                "cluster": cluster,
                "uplink_rate_bps": up.rate_bps,
                "downlink_rate_bps": down.rate_bps,
                "wire_bytes": ranks.get(rank, {}).get("wire_bytes"),
                # How long this cluster's replica waited on the slow link (its stage-0 rank's blocked time).
                "comm_blocked_s": sum(
                    e.get("sync_blocked_s", 0.0) for e in events[rank] if e["kind"] in ("step", "finish")
                ),
                "link_max_excess": (
                    max_excess(_wire_samples(events[rank]), rate, default_burst_bytes(rate)) if rate else None
                ),
            }
        )
    excess = max((c["link_max_excess"] for c in per_cluster if c["link_max_excess"] is not None), default=None)
    retransmitted = from_ranks("tcp_retransmitted_segments", first_stage)
    out_segments = from_ranks("tcp_out_segments", first_stage)
    summary = {
        "schema": SUMMARY_SCHEMA,
        "run_id": config.run_id,
        "status": status,
        "failure": failure,
        "method": config.method,
        "method_options": config.method_options,
        # DiLoCoX's overlap mode in force (its default when the user set none); None for other methods.
        "overlap": getattr(method_config(config.method, config.method_options), "overlap", None),
        "profile": config.profile.name,
        "link_rate_bps": config.profile.inter_cluster.rate_bps,
        "backend": config.backend,
        "clusters": config.clusters,
        "stages": config.stages,
        "model": config.train.model,
        "param_count": count_parameters(get_model_config(config.train.model)),
        "seed": config.train.seed,
        "steps": len(steps),
        "tokens": tokens,
        "trained_tokens": tokens,
        "applied_tokens": applied_tokens,
        "throughput_warmup_steps": config.train.throughput_warmup_steps,
        "wall_s": (steps[-1]["t"] - steps[0]["t"] + steps[0]["step_s"]) if steps else None,
        "tokens_per_s": window_applied_tokens / window_s if window_s else None,
        "trained_tokens_per_s": window_tokens / window_s if window_s else None,
        "wire_bytes": sum(wire) if len(wire) == config.clusters and config.clusters > 1 else None,
        "wire_bytes_per_token": (
            sum(wire) / applied_tokens if wire and applied_tokens and config.clusters > 1 else None
        ),
        "link_burst_bytes": link.burst_bytes if link.rate_bps is not None else None,
        "regime_target_r": _regime_target_r(config.profile.source),
        "link_max_excess": excess,
        "per_cluster": per_cluster,
        "link_conforms": conforms(excess),
        "tcp_retransmitted_segments": sum(retransmitted) if retransmitted else None,
        "tcp_retransmit_fraction": sum(retransmitted) / sum(out_segments) if sum(out_segments or [0]) else None,
        "payload_bytes": sum(
            e.get("sync_payload_bytes", 0) for r in range(world) for e in events[r] if e["kind"] in ("step", "finish")
        ),
        # Exchanges that crossed the slow link (an event that only applied an earlier exchange is not one).
        "sync_count": len(exchanges),
        "comm_blocked_s": sum(e["sync_blocked_s"] for e in syncs),
        "comm_overlapped_s": sum(e["sync_overlapped_s"] for e in syncs),
        "overlap_hidden_fraction": _hidden_fraction(syncs),
        "final_train_loss": sum(train_losses) / len(train_losses) if train_losses else None,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "initial_val_loss": evals[0]["val_loss"] if evals else None,
        "optimizer_state_bytes_per_rank": [ranks[r].get("optimizer_state_bytes") for r in sorted(ranks)],
        "link_busbw_bps": ranks.get(0, {}).get("link_busbw_bps"),
        "device": ranks.get(0, {}).get("device"),
        "dist_backend": ranks.get(0, {}).get("dist_backend"),
        **backend_record,
    }
    return summary
