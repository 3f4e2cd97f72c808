"""Regime matching: the link rate at which a small model on this machine is as communication-bound as the paper.

A 10M-parameter model over 1 Gbit/s is compute-bound, so its AllReduce barely suffers and no low-communication
method can show a speed-up. What carries over from the paper is not the link rate but the ratio of AllReduce's
communication time to its computation time per step. We measure the computation, and pick the rate that gives the
paper's ratio.

Derivation (one AllReduce step; T_c = computation per step, T_comm = blocking gradient all-reduce per step):

    AllReduce tokens/s      X_ar = B / (T_c + T_comm)         B = global tokens per step
    compute ceiling         X_c  = B / T_c                    what a method that hides all communication reaches
    =>  R = T_comm / T_c = X_c / X_ar - 1

The paper (DiLoCoX, arXiv 2506.21263, Qwen1.5-107B over 1 Gbit/s) reports X_ar = 10.4 and DiLoCoX 3,728 tokens/s.
DiLoCoX overlaps its (compressed) communication with H local steps, so we take its throughput as the compute
ceiling X_c; then R = 3728 / 10.4 - 1 = 357.5. If DiLoCoX fell short of the ceiling, the true R would be larger,
so 357.5 is a lower bound on how communication-bound the paper's AllReduce was.

Here, AllReduce (trainers/methods/allreduce.py) ring-all-reduces the fp32 gradient of every stage across the n
clusters; each cluster's uplink carries, per step, in each direction (trainers/comm.py):

    P = 2 (n - 1) / n * 4 bytes * N_params            (summed over the cluster's pipeline stages)
    T_comm = 8 P / rate   =>   rate = 8 P / (R * T_c)

T_c is measured, not modelled: a few steps of `local` (the same training step with the cross-cluster all-reduce left
out) on the same model, batch, clusters and stages, on an unshaped link; we take the median step time after the
warm-up steps, over all ranks (measure_compute_s, of the run harness/analysis/experiments/regime.py makes). Measure
on a quiet machine: T_c scales with load, and the rate with it.

The achieved ratio lands above the target: TCP/IP headers, ACKs and tbf make the real T_comm longer than 8 P / rate
(at ~286 kbit/s on the 2-core project machine the tiny model's all-reduce took 117 s against 98 s predicted, ~84% of
the set rate), and compute time drifts with load between the measurement and the runs. So the rate is corrected
closed-loop (harness/analysis/experiments/regime.py) until short `local` and `allreduce` runs on it measure an
achieved R = X_local / X_allreduce - 1 within REGIME_TOLERANCE of the target (`Probe`s, recorded in the `Regime`).

Consequence worth knowing before a sweep: in this regime an AllReduce step takes (1 + R) T_c, e.g. ~6 minutes for a
1-second step, so AllReduce runs on a regime-matched profile should be short (tokens/s is a steady-state figure).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harness.errors import UserError
from harness.run.folder import read_events
from harness.units import format_rate
from trainers.comm import allreduce_payload_bytes

GRADIENT_BYTES_PER_PARAM = 4  # AllReduce reduces fp32 gradients
# The workers' collective timeout unless HARNESS_TIMEOUT_S says otherwise (harness/run/worker.py).
DEFAULT_COLLECTIVE_TIMEOUT_S = 300
# The closed loop's goal: an achieved R within this of the target.
REGIME_TOLERANCE = 0.10


class RegimeError(UserError):
    """The regime cannot be derived; the message names the fix."""


@dataclass(frozen=True)
class RegimeTarget:
    """A published comparison whose communication-to-computation ratio we reproduce."""

    name: str
    source: str
    allreduce_tokens_per_s: float
    ceiling_tokens_per_s: float  # the overlapped method's throughput, taken as the compute ceiling

    @property
    def comm_to_compute(self) -> float:
        """R = T_comm / T_c of the published AllReduce (module doc)."""
        return self.ceiling_tokens_per_s / self.allreduce_tokens_per_s - 1


TARGETS: dict[str, RegimeTarget] = {
    "paper-107b": RegimeTarget(
        name="paper-107b",
        source="DiLoCoX (arXiv 2506.21263), Qwen1.5-107B over 1 Gbit/s: AllReduce 10.4, DiLoCoX 3,728 tokens/s",
        allreduce_tokens_per_s=10.4,
        ceiling_tokens_per_s=3728.0,
    ),
}


def get_target(name: str) -> RegimeTarget:
    if name not in TARGETS:
        raise RegimeError(f"unknown regime {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[name]


@dataclass(frozen=True)
class Probe:
    """One closed-loop measurement: `local` and `allreduce` tokens/s on a link of `rate_bps`."""

    rate_bps: int
    local_tokens_per_s: float
    allreduce_tokens_per_s: float

    @property
    def achieved_r(self) -> float:
        """R = X_local / X_allreduce - 1, as measured (module doc)."""
        return self.local_tokens_per_s / self.allreduce_tokens_per_s - 1


@dataclass(frozen=True)
class Regime:
    """The derived link for one model and cluster shape."""

    target: RegimeTarget
    model: str
    clusters: int
    param_count: int
    compute_s: float  # T_c, measured
    tokens_per_step: int
    probes: tuple[Probe, ...] = ()  # the closed loop's measurements, in order; the last is at rate_bps

    @property
    def payload_bytes(self) -> int:
        """P: bytes one cluster's uplink carries per AllReduce step, each direction."""
        return allreduce_payload_bytes(GRADIENT_BYTES_PER_PARAM * self.param_count, self.clusters)

    @property
    def open_loop_rate_bps(self) -> int:
        """rate = 8 P / (R T_c): the link the derivation predicts."""
        return round(8 * self.payload_bytes / (self.target.comm_to_compute * self.compute_s))

    @property
    def rate_bps(self) -> int:
        """The link the closed loop settled on (the open-loop rate when nothing was measured)."""
        return self.probes[-1].rate_bps if self.probes else self.open_loop_rate_bps

    @property
    def achieved_r(self) -> float | None:
        return self.probes[-1].achieved_r if self.probes else None

    @property
    def converged(self) -> bool:
        return (
            self.achieved_r is not None and abs(self.achieved_r / self.target.comm_to_compute - 1) <= REGIME_TOLERANCE
        )

    def record(self) -> dict[str, Any]:
        """regime.json: what was targeted, measured and corrected."""
        return {
            "target": self.target.name,
            "target_r": self.target.comm_to_compute,
            "achieved_r": self.achieved_r,
            "converged": self.converged,
            "tolerance": REGIME_TOLERANCE,
            "rate_bps": self.rate_bps,
            "open_loop_rate_bps": self.open_loop_rate_bps,
            "compute_s": self.compute_s,
            "model": self.model,
            "clusters": self.clusters,
            "probes": [{**dataclasses.asdict(p), "achieved_r": p.achieved_r} for p in self.probes],
        }

    @property
    def allreduce_step_s(self) -> float:
        """(1 + R) T_c: the predicted AllReduce step on the derived link."""
        return (1 + self.target.comm_to_compute) * self.compute_s

    def describe(self) -> str:
        r = self.target.comm_to_compute
        lines = [
            f"target {self.target.name}: {self.target.source}",
            f"R = T_comm / T_c = {self.target.ceiling_tokens_per_s:g} / {self.target.allreduce_tokens_per_s:g}"
            f" - 1 = {r:.1f}",
            f"model {self.model}: N = {self.param_count:,} parameters, {self.clusters} clusters",
            f"P = 2(n-1)/n * 4 B * N = {self.payload_bytes:,} bytes per step per uplink",
            f"T_c = {self.compute_s:.4f} s per step (measured, median of `local` steps)",
            f"rate = 8 P / (R T_c) = {format_rate(self.open_loop_rate_bps)} ({self.open_loop_rate_bps:,} bit/s)",
            *(
                f"closed loop {i}: at {format_rate(p.rate_bps)} local {p.local_tokens_per_s:,.0f} and allreduce "
                f"{p.allreduce_tokens_per_s:,.1f} tokens/s: achieved R = {p.achieved_r:.1f}"
                for i, p in enumerate(self.probes, start=1)
            ),
            f"link: {format_rate(self.rate_bps)} ({self.rate_bps:,} bit/s); achieved R "
            + (f"{self.achieved_r:.1f} vs target {r:.1f}" if self.achieved_r is not None else "not measured")
            + ("" if self.converged or not self.probes else f": NOT within {REGIME_TOLERANCE:.0%}"),
            f"predicted: compute ceiling {self.tokens_per_step / self.compute_s:,.0f} tokens/s, AllReduce "
            f"{self.tokens_per_step / self.allreduce_step_s:,.1f} tokens/s ({self.allreduce_step_s:.1f} s/step)",
        ]
        # One all-reduce must finish within the workers' collective timeout, or AllReduce runs fail on this link.
        comm_s = r * self.compute_s
        timeout_s = float(os.environ.get("HARNESS_TIMEOUT_S", DEFAULT_COLLECTIVE_TIMEOUT_S))
        if comm_s > timeout_s / 2:
            lines.append(
                f"note: one all-reduce takes ~{comm_s:.0f} s, near or above the workers' collective timeout of "
                f"{timeout_s:.0f} s; run with HARNESS_TIMEOUT_S={math.ceil(3 * comm_s)}"
            )
        return "\n".join(lines)

    def profile_yaml(self) -> str:
        """A profile file (netem_profiles format) with the derivation in its comments."""
        comments = "".join(f"# {line}\n" for line in self.describe().splitlines())
        body = {
            "description": (
                f"regime-matched to {self.target.name}: AllReduce of model {self.model} communicates "
                f"{self.target.comm_to_compute:.1f}x as long as it computes"
            ),
            "inter_cluster": {"rate": f"{self.rate_bps}bit"},
            "intra_cluster": {},
        }
        return comments + yaml.safe_dump(body, sort_keys=False)


def measure_compute_s(run_dir: Path, stages: int, clusters: int, warmup_steps: int) -> float:
    """Median step time of a finished `local` run after its warm-up steps, over all ranks."""
    times = [
        e["step_s"]
        for rank in range(clusters * stages)
        for e in read_events(run_dir, rank)
        if e["kind"] == "step" and e["step"] >= warmup_steps
    ]
    if not times:
        raise RegimeError(f"the compute measurement in {run_dir} logged no steps; see its logs/")
    return statistics.median(times)


def write_regime_profile(regime: Regime, path: Path) -> Path:
    """The profile YAML, and beside it (same name, .json) the regime's record: target_r, achieved_r, probes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(regime.profile_yaml())
    path.with_suffix(".json").write_text(json.dumps(regime.record(), indent=2) + "\n")
    return path
