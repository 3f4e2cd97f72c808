"""summary.json and environment.json: a finished run's headline figures and what they depend on.

`summarize` reads what the ranks wrote into the run folder (their events and ranks/rank<R>.json, through
harness/run/folder.py) and reduces it to the figures every report, figure and gate reads.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.lock import _host_uid
from harness.net.conformance import conforms, max_excess
from harness.net.delayline import delay_line_log_name, read_counters
from harness.net.link import default_burst_bytes
from harness.net.trace import max_rate_bps
from harness.run.config import RunConfig
from harness.run.fault_tolerance import summarize_fault_tolerance
from harness.run.folder import RunPaths, UnreadableResults, read_events, read_link_trace, read_rank_result
from harness.run.linktrace import summarize_link_trace
from trainers.models import count_parameters

SUMMARY_SCHEMA = 1

# What a run imports or reads of the checkout. Only these decide `git_dirty`: a study that writes its results into
# the checkout (results/) must not mark its own later runs as made from changed code.
CODE_PATHS = ("harness", "trainers", "netem_profiles", "compose", "pyproject.toml")
CHECKOUT = Path(__file__).resolve().parents[2]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str, repo: Path = CHECKOUT) -> str | None:
    try:
        # Without root the harness runs as root of its own user namespace, where the checkout's owner is unmapped
        # and git refuses it as of "dubious ownership": this is our own code, read-only.
        command = ["git", "-c", f"safe.directory={repo}", "-C", str(repo), *args]
        out = subprocess.run(command, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def checkout_commit() -> str | None:
    """The commit the checkout's HEAD names; None where git cannot tell."""
    return _git("rev-parse", "HEAD")


def code_dirty(repo: Path = CHECKOUT) -> bool | None:
    """Whether the checkout's code (CODE_PATHS) differs from its commit; None where git cannot tell."""
    changes = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS, repo=repo)
    return bool(changes) if changes is not None else None


def environment(extra: dict[str, Any]) -> dict[str, Any]:
    """What the numbers depend on: code version, packages, kernel, machine; plus the backend's own record."""
    return {
        "git_commit": checkout_commit(),
        "git_dirty": code_dirty(),
        "python": platform.python_version(),
        "packages": {p: _version(p) for p in ("harness", "torch", "numpy", "pyroute2", "click")},
        "kernel": platform.release(),
        "machine": platform.machine(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        # In the user namespace of a run without root euid is 0; the host's uid says who really ran it.
        "euid": os.geteuid(),
        "host_uid": _host_uid(),
        **extra,
    }


def _hidden_fraction(syncs: list[dict[str, Any]]) -> float | None:
    """Share of communication time that ran behind computation instead of blocking the training thread."""
    blocked = sum(e["sync_blocked_s"] for e in syncs)
    overlapped = sum(e["sync_overlapped_s"] for e in syncs)
    return overlapped / (blocked + overlapped) if blocked + overlapped > 0 else None


def _regime_target_r(profile_source: str) -> float | None:
    """R_target of a regime-matched profile: its record (harness/analysis/projection/regime.py) lies beside it as
    .json."""
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


@dataclass(frozen=True)
class _Records:
    """What the ranks left in the run folder: each one's result (ranks/, where it finished) and events."""

    config: RunConfig
    ranks: dict[int, dict[str, Any]]
    events: dict[int, list[dict[str, Any]]]
    # A replayed trace's records (harness/run/linktrace.py).
    link_trace: tuple[dict[str, Any], ...] = ()

    @classmethod
    def read(cls, config: RunConfig, run_dir: Path) -> _Records:
        world = config.clusters * config.stages
        results = {rank: read_rank_result(run_dir, rank) for rank in range(world)}
        ranks = {rank: result for rank, result in results.items() if result is not None}
        events = {rank: read_events(run_dir, rank) for rank in range(world)}
        return cls(config, ranks, events, tuple(read_link_trace(run_dir)))

    @property
    def first_stage(self) -> list[int]:
        return [c * self.config.stages for c in range(self.config.clusters)]

    @property
    def last_stage(self) -> list[int]:
        return [c * self.config.stages + self.config.stages - 1 for c in range(self.config.clusters)]

    @property
    def steps(self) -> list[dict[str, Any]]:
        """Rank 0's steps, each once: under fault tolerance a discarded round's steps are trained (and logged)
        again, and the later event is the one that stands."""
        last = {e["step"]: e for e in self.events[0] if e["kind"] == "step"}
        return [last[step] for step in sorted(last)]

    @property
    def step_count(self) -> int:
        """Steps any replica logged: under fault tolerance a replica killed after its share of a round's exchange went
        through, but before it logged the step, heals past that step, so rank 0's own log can lack a step that is in
        the final model."""
        return len({e["step"] for rank in self.first_stage for e in self.events.get(rank, []) if e["kind"] == "step"})

    @property
    def syncs(self) -> list[dict[str, Any]]:
        """Rank 0's events that carry an exchange: a method's last one may complete in finish(), logged as its own
        event after the last step."""
        return [e for e in self.events[0] if e["kind"] in ("step", "finish") and "sync_payload_bytes" in e]

    def rank0(self, key: str, default: Any = None) -> Any:
        return self.ranks.get(0, {}).get(key, default)

    def from_ranks(self, key: str, which: list[int]) -> list:
        return [self.ranks[r][key] for r in which if r in self.ranks and self.ranks[r].get(key) is not None]


def _identity(config: RunConfig, status: str, failure: str | None) -> dict[str, Any]:
    """What ran, where, and how it ended."""
    return {
        "schema": SUMMARY_SCHEMA,
        "run_id": config.run_id,
        "status": status,
        "failure": failure,
        "method": config.method,
        # Every option the method ran with, defaults included (variants are keyed on these); and those given.
        "method_options": config.resolved_options,
        "method_options_given": config.method_options,
        # DiLoCoX's overlap mode in force (its default when the user set none); None for other methods.
        "overlap": getattr(config.method_config, "overlap", None),
        "profile": config.profile.name,
        "link_rate_bps": config.profile.inter_cluster.rate_bps,
        "backend": config.backend,
        "clusters": config.clusters,
        "stages": config.stages,
        "model": config.train.model,
        "tokenizer": config.train.tokenizer,
        "param_count": count_parameters(config.train.model_config()),
        "seed": config.train.seed,
    }


def _throughput(records: _Records) -> dict[str, Any]:
    steps = records.steps
    tokens = steps[-1]["tokens"] if steps else 0
    window_s = records.rank0("window_s")
    window_tokens = records.rank0("window_tokens")
    return {
        "steps": records.step_count,
        "tokens": tokens,
        "trained_tokens": tokens,
        # Tokens that count are tokens in the final model: those whose updates the synchronized parameters hold. A
        # stage-0 rank speaks for its replica (every stage of a replica synchronizes the same rounds).
        "applied_tokens": records.rank0("applied_tokens"),
        "throughput_warmup_steps": records.config.train.throughput_warmup_steps,
        "wall_s": (steps[-1]["t"] - steps[0]["t"] + steps[0]["step_s"]) if steps else None,
        "tokens_per_s": records.rank0("window_applied_tokens", window_tokens) / window_s if window_s else None,
        "trained_tokens_per_s": window_tokens / window_s if window_s else None,
    }


def _per_cluster(records: _Records) -> list[dict[str, Any]]:
    config = records.config
    per_cluster = []
    for cluster, rank in enumerate(records.first_stage):
        # Each cluster's uplink at its own rate (a profile's `sites` may give it one).
        up, down = config.profile.uplink(cluster), config.profile.downlink(cluster)
        rate = up.rate_bps if config.clusters > 1 else None
        if rate and config.profile.trace is not None:
            # A replayed rate moves: the run is held to the trace's fastest row (link_trace_error, to each row).
            rate = max_rate_bps(config.profile.trace) or rate
        events = records.events[rank]
        per_cluster.append(
            {
                "cluster": cluster,
                "uplink_rate_bps": up.rate_bps,
                "downlink_rate_bps": down.rate_bps,
                "wire_bytes": records.ranks.get(rank, {}).get("wire_bytes"),
                # How long this cluster's replica waited on the slow link (its stage-0 rank's blocked time).
                "comm_blocked_s": sum(e.get("sync_blocked_s", 0.0) for e in events if e["kind"] in ("step", "finish")),
                "link_max_excess": (
                    max_excess(_wire_samples(events), rate, default_burst_bytes(rate)) if rate else None
                ),
            }
        )
    return per_cluster


def _link(records: _Records) -> dict[str, Any]:
    """The slow link: bytes on it, whether they kept to its rate, and how TCP fared."""
    config, link = records.config, records.config.profile.inter_cluster
    wire = records.from_ranks("wire_bytes", records.first_stage)
    applied_tokens = records.rank0("applied_tokens")
    per_cluster = _per_cluster(records)
    excess = max((c["link_max_excess"] for c in per_cluster if c["link_max_excess"] is not None), default=None)
    retransmitted = records.from_ranks("tcp_retransmitted_segments", records.first_stage)
    out_segments = records.from_ranks("tcp_out_segments", records.first_stage)
    return {
        "wire_bytes": sum(wire) if len(wire) == config.clusters and config.clusters > 1 else None,
        "wire_bytes_per_token": (
            sum(wire) / applied_tokens if wire and applied_tokens and config.clusters > 1 else None
        ),
        "link_burst_bytes": link.burst_bytes if link.rate_bps is not None else None,
        "link_queue_bytes": link.queue_bytes,
        "link_queue_delay_ms": link.queue_delay_ms,
        "regime_target_r": _regime_target_r(config.profile.source),
        "link_max_excess": excess,
        "per_cluster": per_cluster,
        "link_conforms": conforms(excess),
        "tcp_retransmitted_segments": sum(retransmitted) if retransmitted else None,
        "tcp_retransmit_fraction": sum(retransmitted) / sum(out_segments) if sum(out_segments or [0]) else None,
    }


def _link_loss(config: RunConfig, run_dir: Path) -> dict[str, Any]:
    """The inter_cluster link's loss as configured, beside what the delay lines dropped over the whole run (link
    check included; their counters, None under netem or without an emulator). A loss model runs once per direction
    on what each cluster sends (harness/net/delayline.py): its figures are the to_switch directions'. Independent
    loss runs on every hop: measured per hop, the rate composed over a path's two, and the burst is one hop's
    (1 / (1 - hop loss) configured). Sites with a loss of their own are left out of the measured figures."""
    profile, link = config.profile, config.profile.inter_cluster
    model = link.loss_model
    uplinks = [profile.uplink(c) for c in range(config.clusters)]
    alike = [c for c, up in enumerate(uplinks) if (up.loss_pct, up.loss_model) == (link.loss_pct, model)]
    logs = [read_counters(RunPaths(run_dir).logs_dir / delay_line_log_name(c)) for c in alike]
    directions = ("to_switch",) if model is not None else ("to_switch", "to_cluster")
    seen = [log[d] for log in logs if log is not None for d in directions] if None not in logs else []
    frames, dropped, bursts = (sum(d[key] for d in seen) for key in ("frames", "dropped", "bursts"))
    share = dropped / frames if frames else None
    if model is not None:
        configured, burst_configured, measured = model.loss_rate, model.mean_burst_packets, share
    else:
        hop = link.hop_loss_pct / 100
        configured, burst_configured = link.loss_pct / 100, 1 / (1 - hop) if hop else None
        measured = 1 - (1 - share) ** 2 if share is not None else None
    return {
        "link_loss_model": model.to_dict() if model is not None else None,
        "link_loss_configured": configured,
        # link_loss_measured is the link check's probe (harness/net/linkprobe.py); this is the whole run's.
        "link_loss_run_measured": measured,
        "link_loss_burst_configured": burst_configured,
        "link_loss_burst_measured": dropped / bursts if bursts else None,
        "link_loss_packets": frames if seen else None,
    }


def _communication(records: _Records) -> dict[str, Any]:
    syncs = records.syncs
    return {
        "payload_bytes": sum(
            e.get("sync_payload_bytes", 0)
            for events in records.events.values()
            for e in events
            if e["kind"] in ("step", "finish")
        ),
        # Exchanges that crossed the slow link (an event that only applied an earlier exchange is not one).
        "sync_count": len([e for e in syncs if e.get("sync_payload_bytes")]),
        "comm_blocked_s": sum(e["sync_blocked_s"] for e in syncs),
        "comm_overlapped_s": sum(e["sync_overlapped_s"] for e in syncs),
        "overlap_hidden_fraction": _hidden_fraction(syncs),
    }


def _outcome(records: _Records) -> dict[str, Any]:
    """Where training ended up, and what each rank ran on."""
    train_losses = records.from_ranks("final_train_loss", records.last_stage)
    evals = [e for e in records.events[records.last_stage[0]] if e["kind"] == "eval"]
    return {
        "final_train_loss": sum(train_losses) / len(train_losses) if train_losses else None,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "initial_val_loss": evals[0]["val_loss"] if evals else None,
        # Per byte of text, not per token: runs with different tokenizers compare (absent from older runs).
        "final_val_bpb": evals[-1].get("val_bpb") if evals else None,
        # The held-out tokens each evaluation read, and all evaluations' time, which tokens/s leaves out.
        "val_tokens": evals[-1].get("val_tokens") if evals else None,
        "eval_s": sum(e["eval_s"] for e in evals) if evals else None,
        "optimizer_state_bytes_per_rank": [
            records.ranks[r].get("optimizer_state_bytes") for r in sorted(records.ranks)
        ],
        # Each rank's largest resident set (absent from runs before it was recorded).
        "peak_rss_bytes_per_rank": [records.ranks[r].get("peak_rss_bytes") for r in sorted(records.ranks)],
        "link_busbw_bps": records.rank0("link_busbw_bps"),
        "device": records.rank0("device"),
        "dist_backend": records.rank0("dist_backend"),
    }


def summarize(config: RunConfig, run_dir: Path, failure: str | None, backend_record: dict[str, Any]) -> dict:
    """summary.json: the run's headline figures, from the ranks' results and events."""
    try:
        records = _Records.read(config, run_dir)
    except UnreadableResults as err:
        # The run's own folder: whatever damaged it, teardown still writes a summary, failed and saying why.
        records = _Records(config, {}, {rank: [] for rank in range(config.clusters * config.stages)})
        failure = f"{failure}; {err}" if failure else str(err)
    world = config.clusters * config.stages
    # Under fault tolerance a replica restarted after the others had finished leaves without a result.
    left = [rank for rank, events in records.events.items() if any(e["kind"] == "left" for e in events)]
    status = "ok" if failure is None and records.ranks and len(records.ranks) == world - len(left) else "failed"
    if status == "failed" and failure is None:
        failure = f"only {len(records.ranks)} of {world} ranks reported results"
    tolerance = summarize_fault_tolerance(config, records.events, backend_record)
    throughput = _throughput(records)
    if tolerance:
        # A restarted rank's own window covers its last incarnation only: under fault tolerance tokens/s is
        # goodput, the tokens in the final model over the training's whole wall time.
        throughput.update(tokens_per_s=tolerance["goodput_tokens_per_s"], trained_tokens_per_s=None)
    return {
        **_identity(config, status, failure),
        **throughput,
        **tolerance,
        **_link(records),
        **_link_loss(config, run_dir),
        **_communication(records),
        **_outcome(records),
        **summarize_link_trace(config.profile, records.link_trace),
        **backend_record,
    }
