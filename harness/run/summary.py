"""summary.json and environment.json: a finished run's headline figures and what they depend on.

`summarize` reads what the ranks wrote into the run folder (their events and ranks/rank<R>.json, through
harness/run/folder.py) and reduces it to the figures every report, figure and gate reads.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.net.conformance import conforms, max_excess
from harness.net.link import default_burst_bytes
from harness.run.config import RunConfig
from harness.run.events import read_events
from trainers.models import count_parameters, get_model_config
from trainers.registry import method_config

SUMMARY_SCHEMA = 1


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    repo = Path(__file__).resolve().parents[2]
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
    """R_target of a regime-matched profile: its record (harness/analysis/regime.py) lies beside it as .json."""
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
