"""The delay line's replayed delay (harness/net/delayline.py DelaySchedule): each frame gets the row in force when
it is read, counted from the start the harness sends; before the start, the first row; never a reordering."""

from __future__ import annotations

import pytest

from harness.net.delayline import DelaySchedule, Direction
from harness.net.trace import hop_delay_schedule
from harness.net.tracepoints import LinkTrace, TracePoint

SCHEDULE = DelaySchedule.parse("0.0:10.0,2.5:22.5,4:5")


def test_the_schedule_parses_the_harness_s_argument():
    assert SCHEDULE == DelaySchedule((0.0, 2.5, 4.0), (0.010, 0.0225, 0.005))
    trace = LinkTrace("t.csv", (TracePoint(0, 1_000_000, 20.0), TracePoint(2.5, 2_000_000, 45.0)))
    assert DelaySchedule.parse(hop_delay_schedule(trace)) == DelaySchedule((0.0, 2.5), (0.010, 0.0225))


@pytest.mark.parametrize(
    ("elapsed_s", "delay_s"),
    [
        (None, 0.010),
        (-1.0, 0.010),
        (0.0, 0.010),
        (2.49, 0.010),
        (2.5, 0.0225),
        (3.9, 0.0225),
        (4.0, 0.005),
        (1e6, 0.005),
    ],
)
def test_the_delay_at_a_time_is_the_row_in_force(elapsed_s, delay_s):
    assert SCHEDULE.delay_s_at(elapsed_s) == delay_s


def test_a_direction_follows_the_schedule_from_its_start():
    direction = Direction(0.5, 0.0, 0.0, False, seed=0, schedule=SCHEDULE)
    # Before the start: the first row (the link check runs then), not --delay-ms.
    assert direction.delay_at(100.0) == 0.010
    direction.started_at = 100.0
    assert direction.delay_at(101.0) == 0.010
    assert direction.delay_at(102.6) == 0.0225
    assert direction.release_time(103.0) == pytest.approx(103.0225)


def test_a_falling_delay_never_lets_a_frame_overtake_the_one_ahead():
    direction = Direction(0.0, 0.0, 0.0, False, seed=0, schedule=SCHEDULE)
    direction.started_at = 0.0
    before = direction.release_time(3.99)  # 22.5 ms
    after = direction.release_time(4.0)  # 5 ms, but behind the frame ahead of it
    assert after == before == pytest.approx(4.0125)
    assert direction.release_time(4.1) == pytest.approx(4.105)


def test_without_a_schedule_the_fixed_delay_holds():
    direction = Direction(0.02, 0.0, 0.0, False, seed=0)
    assert direction.delay_at(5.0) == 0.02
