"""The figures' formats: significant figures written out, never in exponent notation (a table printed '454.7 s ±
1e+02' and '1.01e+03x' until this was fixed)."""

from __future__ import annotations

import pytest

from harness.analysis.report.markdown import change, half_percent, percent, significant, times, with_spread


@pytest.mark.parametrize(
    ("value", "digits", "expected"),
    [
        (0.38, 2, "0.38"),
        (7.83, 2, "7.8"),
        (104.3, 2, "100"),
        (99.6, 2, "100"),
        (1_349.0, 2, "1,300"),
        (1_012.0, 3, "1,010"),
        (0.0497, 2, "0.05"),
        (-104.3, 2, "-100"),
    ],
)
def test_significant_figures_are_written_out(value, digits, expected):
    assert significant(value, digits) == expected


def test_a_signed_change_keeps_its_sign_past_a_hundred_percent():
    assert change(2.456) == "+146%"
    assert change(13.7) == "+1,270%"
    assert change(0.5) == "-50%"


def test_large_ratios_and_shares_read_as_numbers():
    assert times(1_012.4) == "1,010x"
    assert times(10.73) == "10.7x"
    assert percent(12.345) == "1,230%"
    assert half_percent(1.2) == "120%"


def test_a_spread_over_a_hundred_is_not_printed_in_exponent_notation():
    cell = with_spread(454.7, 3, 350.4, 559.0, lambda v: f"{v:,.1f} s", lambda v: significant(v, 2))
    assert cell == "454.7 s ± 100"
