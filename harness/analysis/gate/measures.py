"""What the CI gate measures of one finished run, chosen so that the machine's compute speed cancels out of each
(harness/analysis/gate/check.py says which band each feeds and why):

    step_overhead            a step's time not spent waiting on the link (step_s - sync_blocked_s: forward, backward,
                             optimizer, the method's compression and outer step) over its forward and backward
                             (compute_s), summed over every rank's steps after the throughput warm-up. Both halves
                             are timed in the same step on the same core, so a CPU twice as fast (or shared with
                             another job) halves (or stretches) both: what is left is the method's own work per unit
                             of the model's.
    step_time_residual       the run's measured window seconds (rank 0) over those harness project's link model
                             (harness/analysis/projection/link_model.py) predicts for it from the run's own compute
                             and its profile's link. The compute is the slowest rank's (a replica that waits for a
                             slower peer records the wait as blocked, but the run goes at the slower one's pace): its
                             mean step_s - sync_blocked_s, and compute_s, what an exchange in flight runs beside.
                             Its own compute is on both sides, so what is left is the time the run waited on the link
                             beyond what its bytes, schedule and link explain: ~1 on any machine while the method
                             hides (or exposes) its exchanges as its schedule declares.
    payload_bytes_per_token  bytes the method handed to its collectives, over applied tokens: fixed by the method, its
                             options and the model, so any change in what it sends shows, exactly.
    wire_overhead            bytes the kernel counted on the slow link over payload bytes: TCP/IP framing (~5%),
                             retransmissions and the collectives' own messages, the part of wire bytes the method
                             does not choose.
    final_val_loss           the last evaluation's loss at the fixed seed: deterministic on one build.

A measure a run cannot give is None: local sends nothing (no bytes, no schedule to predict), and a run without step
events has no step times.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.analysis.projection.link_model import Compute, LinkModel, ProjectionError, default_window_bytes, schedule
from harness.run.config import RunConfig
from harness.run.folder import RunPaths, read_events, read_rank_result

MEASURES = ("step_overhead", "step_time_residual", "payload_bytes_per_token", "wire_overhead", "final_val_loss")


def _positive(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and value > 0 else None


def _window_steps(run_dir: Path, config: RunConfig) -> dict[int, list[dict[str, Any]]]:
    """Each rank's timed steps after the throughput warm-up."""
    warmup = config.train.throughput_warmup_steps
    by_rank = {}
    for rank in RunPaths(run_dir).event_ranks():
        steps = [e for e in read_events(run_dir, rank) if e["kind"] == "step" and e["step"] >= warmup]
        if steps and all(e.get("compute_s") is not None for e in steps):
            by_rank[rank] = steps
    return by_rank


def _own_s(step: Mapping[str, Any]) -> float:
    return step["step_s"] - step.get("sync_blocked_s", 0.0)


def _residual(run_dir: Path, config: RunConfig, compute: Compute) -> float | None:
    """Measured window seconds over predicted (module doc); None for a method that declares no exchange."""
    window_s = _positive((read_rank_result(run_dir, 0) or {}).get("window_s"))
    if window_s is None or config.clusters < 2:
        return None
    link = LinkModel.of(config.profile, config.clusters, window_bytes=default_window_bytes())
    try:
        plan = schedule(config, link)
    except ProjectionError:
        return None
    train = config.train
    return window_s / plan.window_s(compute.step_s, compute.hide_s, train.steps, train.throughput_warmup_steps)


def measure(run_dir: Path, summary: Mapping[str, Any]) -> dict[str, float | None]:
    """The module doc's measures of one successful run."""
    measured: dict[str, float | None] = dict.fromkeys(MEASURES)
    measured["final_val_loss"] = _positive(summary.get("final_val_loss"))
    applied, payload, wire = (_positive(summary.get(k)) for k in ("applied_tokens", "payload_bytes", "wire_bytes"))
    if applied and payload:
        measured["payload_bytes_per_token"] = payload / applied
        measured["wire_overhead"] = wire / payload if wire else None
    paths = RunPaths(run_dir)
    if not paths.config.is_file():
        return measured
    config = RunConfig.load(paths.config)
    by_rank = _window_steps(run_dir, config)
    if not by_rank:
        return measured
    every = [e for steps in by_rank.values() for e in steps]
    measured["step_overhead"] = sum(map(_own_s, every)) / sum(e["compute_s"] for e in every)
    slowest = max(by_rank.values(), key=lambda steps: statistics.fmean(map(_own_s, steps)))
    compute = Compute(
        statistics.fmean(map(_own_s, slowest)), statistics.fmean(e["compute_s"] for e in slowest), run_dir.name
    )
    if summary.get("sync_count"):
        measured["step_time_residual"] = _residual(run_dir, config, compute)
    return measured
