"""Composed time to target (harness/analysis/projection/composition.py): the trace's own warm-up then its steady mean
per step, the steadiness check, and how long a trace each method's cadence needs."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from harness.analysis.plan import build_config
from harness.analysis.projection.composition import (
    MIN_STEADY_STEPS,
    MIN_TRACE_S,
    STEADY_TOLERANCE,
    Cadence,
    read_trace,
)


def steps_frame(step_s: list[float], sync_steps: set[int]) -> pd.DataFrame:
    elapsed = pd.Series(step_s).cumsum()
    return pd.DataFrame(
        {
            "step": range(len(step_s)),
            "elapsed_s": elapsed,
            "sync_payload_bytes": [100.0 if s in sync_steps else math.nan for s in range(len(step_s))],
        }
    )


def test_composition_adds_the_traces_own_steps_then_its_steady_mean_per_step():
    # H = 5: four compute steps of 1 s, then the exchange step of 6 s; the first round pays 10 s more.
    step_s = [1.0, 1.0, 1.0, 1.0, 16.0] + [1.0, 1.0, 1.0, 1.0, 6.0] * 4
    steps = steps_frame(step_s, {4, 9, 14, 19, 24})
    trace = read_trace(steps, Cadence(5, 0, 5, False), finished=False)
    assert (trace.window_start, trace.window_end, trace.rounds) == (5, 25, 4)
    assert trace.steady_step_s == pytest.approx(2.0) and trace.drift == pytest.approx(0.0)
    assert trace.window_s == pytest.approx(40.0) and trace.problem is None
    assert trace.time_to(3) == pytest.approx(3.0)
    # Inside the trace its own steps, not the window's mean: 20 s of warm-up round, then 1 + 1 + 1 + 1 + 6 + 1 + 1.
    assert trace.time_to(12) == pytest.approx(32.0)
    # Beyond it, 2 s a step: exact on a round boundary, a round's mean elsewhere.
    assert trace.time_to(105) == pytest.approx(sum(step_s) + 80 * 2.0)
    assert trace.time_to(25) == pytest.approx(sum(step_s))


def test_a_finish_event_takes_the_last_step_out_of_the_window():
    steps = steps_frame([0.1] * 30, set(range(30)))
    assert read_trace(steps, Cadence(1, 0, 5, False), finished=True).window_end == 29
    # A method that never exchanges counts every step as a round.
    never = steps_frame([0.1] * 30, set()).drop(columns="sync_payload_bytes")
    assert read_trace(never, Cadence(1, 0, 5, False), finished=False).rounds == 25


@pytest.mark.parametrize(
    ("step_s", "expect"),
    [
        # Window: steps 5-29 (37.5 s at 1.5 s a step), halves 5-16 and 17-29.
        ([1.5] * 17 + [1.95] * 13, "differ by +30%, more than 10%"),
        ([1.5] * 17 + [1.575] * 13, None),
        ([1.5] * 14, "fewer than 20"),
        # Steady and long enough in steps, but 2.5 s of wall-clock: too short to average a machine's drift.
        ([0.1] * 30, "its steady-state window lasted 2.5 s, shorter than 30 s"),
    ],
)
def test_the_steadiness_check(step_s, expect):
    trace = read_trace(steps_frame(step_s, set(range(len(step_s)))), Cadence(1, 0, 5, False), finished=False)
    assert trace.problem == expect if expect is None else expect in trace.problem
    rounds = read_trace(steps_frame([0.1] * 40, {19, 39}), Cadence(20, 0, 5, False), finished=False)
    assert rounds.problem == "1 whole round(s) after warm-up, fewer than 2"
    assert STEADY_TOLERANCE == 0.10 and MIN_STEADY_STEPS == 20 and MIN_TRACE_S == 30.0


@pytest.mark.parametrize(
    ("method", "options", "expect"),
    [
        ("allreduce", {}, 25),  # 5 warm-up steps, then 20 one-step rounds
        ("local", {}, 25),
        ("opendiloco", {"local_steps": 10}, 30),  # the slow-start round, then two rounds
        ("cocktail", {}, 31),  # its 10 blocking warm-up steps, then 20, then the step its finish() drains into
        ("dilocox", {"local_steps": 10}, 50),  # adaptive: one round more, as its rounds grow; one for the drain
        ("dilocox", {"local_steps": 10, "overlap": "none", "adaptive": False}, 30),  # blocking: nothing drained
        ("dilocox", {"local_steps": 125}, 200),  # H = 125: never longer than the full run
    ],
)
def test_a_trace_holds_the_warm_up_and_enough_whole_rounds(method, options, expect):
    config = build_config(method, "1gbps", 0, {"steps": 200, **options})
    assert Cadence.of(config).trace_steps(config.train.steps) == expect


@pytest.mark.parametrize(
    ("cadence", "step_s", "expect"),
    [
        (Cadence(1, 0, 5, False), None, 25),  # no prediction: the rounds' minimum only
        (Cadence(1, 0, 5, False), 2.0, 25),  # 20 steps of 2 s already last 40 s
        (Cadence(1, 0, 5, False), 0.05, 5 + 600),  # 30 s at 50 ms a step
        (Cadence(10, 0, 10, False), 0.1, 10 + 30 * 10),  # 30 rounds of ten 0.1 s steps
        (Cadence(10, 0, 10, True, True), 0.1, 10 + 32 * 10),  # and one round for adapting, one for the drain
        (Cadence(1, 0, 5, False), 0.001, 2000),  # never longer than the full run
    ],
)
def test_a_trace_is_planned_to_last_min_trace_s_at_its_predicted_step_time(cadence, step_s, expect):
    assert cadence.trace_steps(2000, step_s) == expect
