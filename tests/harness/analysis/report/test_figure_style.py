"""The style every figure shares (harness/analysis/report/figure_style.py)."""

from __future__ import annotations

from harness.analysis.report.figure_style import log_time


def test_wall_clock_goes_on_a_log_axis_where_methods_end_more_than_10x_apart():
    assert log_time([12.0, 130.0]) and not log_time([12.0, 119.0])
    # A time of 0 (nothing ran) cannot go on a log axis, and one method alone has nothing to spread out.
    assert not log_time([0.0, 500.0]) and not log_time([40.0]) and not log_time([])
