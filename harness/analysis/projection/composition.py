"""Composed time to target: a run's validation-loss trajectory from one link, its step times from another.

The per-step losses of a run do not depend on the link: every method synchronizes at fixed steps and waits for what
it exchanges, so the same seed gives bit-identical losses on an unshaped link and a slow one (a test holds this,
tests/harness/analysis/experiments/test_compare.py). What the link changes is only how long each step takes. So on
a link too slow for AllReduce to reach a loss in reasonable time here, the time to that loss is composed from

    the trajectory   the full run on an unshaped link (or on the link itself, where it was measured too): the first
                     evaluation at or below the target, after k* steps
    the trace        a short run of the same settings on the slow link: its step times d_i (wall-clock between step
                     events, evaluation left out, as `elapsed_s` in harness/analysis/report/tables.py)

    T(k*) = sum of d_i for i < min(k*, s1)  +  max(0, k* - s1) x mean(d_i over the steady-state window [s0, s1))

The steady-state window starts at s0, the first synchronization-round boundary at or after the warm-up (the run's
throughput warm-up, the method's own warm-up exchanges, and the first round where its first exchange pays TCP's slow
start), and ends at s1, the trace's last round boundary: whole rounds only, so a round's one slow exchange step is
counted once per round. Where the trace covers k* the composed time is the trace's own; beyond it, exact where k*
falls on a round boundary (evaluations every multiple of H) and within one round's exchange time elsewhere.

The trace is trusted (steady) when its window holds at least MIN_ROUNDS whole rounds and MIN_STEADY_STEPS steps,
lasts at least MIN_TRACE_S of wall-clock, and the mean step times of its first and second halves (by rounds) differ by
at most STEADY_TOLERANCE; otherwise the composed figure is still computed and flagged with the reason. The time
floor is there because a compute-bound run's speed drifts on a shared machine: in the 2,000-step study, 100-step
windows of one run differed by 18-75%, and 20-step traces of DeMo and CocktailSGD composed 8-9% short of the measured
time. A trace is planned that long from its step time as the link model predicts it (Cadence.trace_steps).

A method that adapts its rounds during a run (DiLoCoX's H_t and r_t) has its first rounds in the trace, which its plan
says send the most bytes per step: its composed time is then likely an overestimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from harness.run.config import RunConfig

MIN_STEADY_STEPS = 20
MIN_ROUNDS = 2
MIN_TRACE_S = 30.0
STEADY_TOLERANCE = 0.10


@dataclass(frozen=True)
class Cadence:
    """When a method's synchronization rounds fall, as its config declares them (trainers.method.SyncPlan)."""

    every_steps: int  # H: a round's steps (1 for a method that synchronizes every step, or never)
    first_round_step: int  # rounds count from here: the steps before it are the method's warm-up exchanges
    steady_from: int  # the earliest step a steady-state window may start (module doc)
    adaptive: bool
    # Its finish() drains an exchange still in flight into the run's last step, which then ends no whole round.
    drains_at_end: bool = False

    @classmethod
    def of(cls, config: RunConfig) -> Cadence:
        # Imported here: building the model's shapes loads torch, which reading a finished comparison does not need.
        from harness.analysis.projection.link_model import parameter_shapes

        plan = config.method_config.sync_plan(parameter_shapes(config.train))
        every = plan.every_steps if plan else 1
        first = plan.warmup_steps if plan else 0
        slow_start = every if plan and plan.slow_start else 0
        steady_from = max(config.train.throughput_warmup_steps, first + slow_start, 1)
        return cls(every, first, steady_from, bool(plan and plan.adaptive), bool(plan and plan.hidden_steps))

    def trace_steps(self, full_steps: int, step_s: float | None = None) -> int:
        """Steps of a trace run: its warm-up to the first round boundary, then enough whole rounds for the check, and
        for MIN_TRACE_S at `step_s` a step when a prediction is given (one more round for a method whose rounds grow
        as it adapts, and one more for a method whose last round holds its drained exchange); never longer than the
        full run, which it would replace."""
        h = self.every_steps
        start = self.first_round_step + math.ceil((self.steady_from - self.first_round_step) / h) * h
        rounds = max(MIN_ROUNDS, math.ceil(MIN_STEADY_STEPS / h))
        if step_s is not None and step_s > 0:
            rounds = max(rounds, math.ceil(MIN_TRACE_S / (step_s * h)))
        return min(start + (rounds + self.adaptive + self.drains_at_end) * h, full_steps)


@dataclass(frozen=True)
class Trace:
    """A short run's step times on the composed link and its steady-state window (module doc)."""

    step_s: tuple[float, ...]  # d_i: wall-clock of step i, evaluation left out
    window_start: int  # s0, the window's first step
    window_end: int  # one past its last step
    rounds: int  # whole synchronization rounds in the window
    first_half_step_s: float  # mean step time of the window's first half of rounds
    second_half_step_s: float

    @property
    def window_steps(self) -> int:
        return max(0, self.window_end - self.window_start)

    @property
    def steady_step_s(self) -> float:
        """Mean step time over the window; NaN without one."""
        if not self.window_steps:
            return math.nan
        return sum(self.step_s[self.window_start : self.window_end]) / self.window_steps

    @property
    def window_s(self) -> float:
        """The window's wall-clock."""
        return float(sum(self.step_s[self.window_start : self.window_end]))

    @property
    def drift(self) -> float:
        """Second half's mean step time over the first's, less 1."""
        if not self.first_half_step_s > 0:
            return math.nan
        return self.second_half_step_s / self.first_half_step_s - 1

    @property
    def problem(self) -> str | None:
        """Why the trace is not steady (module doc), None when it is."""
        if self.rounds < MIN_ROUNDS:
            return f"{self.rounds} whole round(s) after warm-up, fewer than {MIN_ROUNDS}"
        if self.window_steps < MIN_STEADY_STEPS:
            return f"{self.window_steps} steady-state steps, fewer than {MIN_STEADY_STEPS}"
        if self.window_s < MIN_TRACE_S:
            return f"its steady-state window lasted {self.window_s:.1f} s, shorter than {MIN_TRACE_S:.0f} s"
        if math.isnan(self.drift) or abs(self.drift) > STEADY_TOLERANCE:
            return f"its halves' mean step times differ by {self.drift:+.0%}, more than {STEADY_TOLERANCE:.0%}"
        return None

    def time_to(self, steps: int) -> float:
        """T(steps): the trace's own steps up to the window's end s1, then the steady-state mean per step (module
        doc)."""
        measured = min(steps, self.window_end if self.window_steps else self.window_start, len(self.step_s))
        rest = steps - measured
        if rest <= 0:
            return float(sum(self.step_s[:measured]))
        return float(sum(self.step_s[:measured]) + rest * self.steady_step_s)


def step_times(steps: pd.DataFrame) -> list[float]:
    """d_i from one rank's step events (with `elapsed_s`, harness/analysis/report/tables.py), in step order."""
    elapsed = steps.sort_values("step")["elapsed_s"].astype(float).tolist()
    return [b - a for a, b in zip([0.0, *elapsed[:-1]], elapsed, strict=True)]


def _half_means(step_s: Sequence[float], bounds: Sequence[int]) -> tuple[float, float]:
    """Mean step time of the first and the second half of the rounds between consecutive `bounds`."""
    if len(bounds) < 3:
        return math.nan, math.nan
    middle = bounds[(len(bounds) - 1) // 2]

    def mean(lo: int, hi: int) -> float:
        return sum(step_s[lo:hi]) / (hi - lo)

    return mean(bounds[0], middle), mean(middle, bounds[-1])


def read_trace(steps: pd.DataFrame, cadence: Cadence, finished: bool) -> Trace:
    """The trace of one rank's step events (module doc). A step is a round's last when it carries an exchange
    (`sync_payload_bytes`); for a method that never exchanges, every step is a round. `finished`: the run logged a
    `finish` event, whose drained communication sits in its last step, which then ends no whole round."""
    step_s = step_times(steps)
    n = len(step_s)
    if "sync_payload_bytes" in steps and steps["sync_payload_bytes"].notna().any():
        synced = steps[steps["sync_payload_bytes"].notna()]["step"].astype(int)
        boundaries = sorted({s + 1 for s in synced})
    else:
        boundaries = list(range(1, n + 1))
    last = n - 1 if finished else n
    bounds = [b for b in boundaries if cadence.steady_from <= b <= last]
    if not bounds:
        return Trace(tuple(step_s), n, n, 0, math.nan, math.nan)
    first, second = _half_means(step_s, bounds)
    return Trace(tuple(step_s), bounds[0], bounds[-1], len(bounds) - 1, first, second)
