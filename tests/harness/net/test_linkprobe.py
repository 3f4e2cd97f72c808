"""The link check's arithmetic (harness/net/linkprobe.py): tolerances of `evaluate`, `histogram` bins, `plan`'s pace.

Pure functions: no namespace, no socket.
"""

from __future__ import annotations

import math

import pytest

from harness.net.linkprobe import (
    HISTOGRAM_BIN_MS,
    MAX_PROBES,
    PROBE_BYTES,
    PROBE_WINDOW_S,
    RATE_SHARE,
    evaluate,
    histogram,
    plan,
)


def measured(rtt_ms: float, sent: int = 20_000, received: int | None = 20_000, one_way: list[float] | None = None):
    """Probe results whose median RTT is exactly `rtt_ms` (values on both sides of it, an odd count)."""
    rtts = [rtt_ms - 3.0, rtt_ms - 0.5, rtt_ms, rtt_ms + 0.5, rtt_ms + 30.0]
    return {
        "sent": sent,
        "server_received": received,
        "rtt_ms": rtts,
        "one_way_ms": one_way if one_way is not None else [r / 2 for r in rtts],
    }


# --- RTT: max(5 %, 1 ms) of the target, plus twice the jitter -------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "jitter", "inside", "outside"),
    [
        (40.0, 0.0, [40.0, 41.9, 38.1], [42.1, 37.9, 80.0, 20.0]),  # 5 % of 40 ms = 2 ms
        (10.0, 0.0, [10.9, 9.1], [11.1, 8.9]),  # 5 % is 0.5 ms: the 1 ms floor applies
        (2.0, 0.0, [2.9, 1.1], [3.1, 0.9]),
        (40.0, 2.0, [45.9, 34.1], [46.1, 33.9]),  # 2 ms + 2 x 2 ms
        (10.0, 0.5, [11.9, 8.1], [12.1, 7.9]),  # 1 ms floor + 2 x 0.5 ms
    ],
)
def test_evaluate_accepts_an_rtt_inside_the_tolerance_and_flags_one_outside(target, jitter, inside, outside):
    for rtt in inside:
        fields = evaluate(measured(rtt), target, jitter, 0.0)
        assert fields["link_check_ok"] is True, (rtt, target, jitter, fields)
        assert fields["link_rtt_ms"] == rtt
        assert fields["link_rtt_target_ms"] == target
    for rtt in outside:
        fields = evaluate(measured(rtt), target, jitter, 0.0)
        assert fields["link_check_ok"] is False, (rtt, target, jitter, fields)


def test_evaluate_judges_the_median_rtt_not_the_mean_nor_the_tail():
    # A few very late echoes (a retransmit, a busy server) do not fail the check; a shifted median does.
    rtts = [40.0] * 99 + [400.0] * 10
    fields = evaluate({"sent": 109, "server_received": 109, "rtt_ms": rtts, "one_way_ms": [20.0]}, 40.0, 0.0, 0.0)
    assert fields["link_rtt_ms"] == 40.0 and fields["link_check_ok"] is True
    rtts = [40.0] * 40 + [43.0] * 60
    fields = evaluate({"sent": 100, "server_received": 100, "rtt_ms": rtts, "one_way_ms": [20.0]}, 40.0, 0.0, 0.0)
    assert fields["link_rtt_ms"] == 43.0 and fields["link_check_ok"] is False


def test_the_floor_is_the_fastest_echo_whatever_the_tail():
    rtts = [20.3, 20.1, 29.0, 31.5, 28.7]
    fields = evaluate({"sent": 5, "server_received": 5, "rtt_ms": rtts, "one_way_ms": [10.0]}, 20.0, 0.0, 0.0)
    assert fields["link_rtt_min_ms"] == 20.1 and fields["link_rtt_ms"] == 28.7


def test_evaluate_without_any_echo_fails_and_reports_none():
    fields = evaluate({"sent": 100, "server_received": 0, "rtt_ms": [], "one_way_ms": []}, 40.0, 0.0, 0.0)
    assert fields["link_check_ok"] is False
    assert fields["link_rtt_ms"] is None and fields["link_rtt_min_ms"] is None
    assert fields["link_one_way_delay_p50_ms"] is None and fields["link_one_way_delay_p99_ms"] is None
    assert fields["link_loss_measured"] == 1.0


# --- loss: 20 % relative plus three binomial standard errors --------------------------------------------------------


def loss_allowed(target: float, sent: int) -> float:
    return 0.2 * target + 3 * math.sqrt(max(target, 1 / sent) / sent)


@pytest.mark.parametrize(("target", "sent"), [(0.01, 20_000), (0.01, 1_000), (0.05, 20_000), (0.001, 100)])
def test_evaluate_loss_tolerance_both_ways(target, sent):
    allowed = loss_allowed(target, sent)
    # The largest and smallest whole numbers of lost probes still inside, and the first ones outside.
    most_inside = math.floor((target + allowed) * sent - 1e-9)
    fewest_inside = max(0, math.ceil((target - allowed) * sent + 1e-9))
    cases = [(most_inside, True), (most_inside + 2, False), (round(target * sent), True)]
    if fewest_inside >= 2:
        cases += [(fewest_inside, True), (fewest_inside - 2, False)]
    for lost, ok in cases:
        fields = evaluate(measured(40.0, sent, sent - lost), 40.0, 0.0, target)
        assert fields["link_loss_measured"] == pytest.approx(lost / sent)
        assert fields["link_loss_target"] == target
        assert fields["link_check_ok"] is ok, (target, sent, lost, allowed, fields)


def test_evaluate_loss_tolerance_in_figures():
    """The issue's acceptance profile: 1 % over 20,000 probes allows 0.2 % + 0.21 % = 0.41 % either way."""
    sent = 20_000
    for lost, ok in [(200, True), (282, True), (285, False), (400, False), (118, True), (115, False), (0, False)]:
        assert evaluate(measured(40.0, sent, sent - lost), 40.0, 0.0, 0.01)["link_check_ok"] is ok, lost


def test_evaluate_without_loss_in_the_profile_allows_three_standard_errors_of_one_probe():
    sent = 20_000  # 3 x sqrt((1/sent)/sent) = 3/sent: up to 3 lost probes
    assert evaluate(measured(40.0, sent, sent), 40.0, 0.0, 0.0)["link_check_ok"] is True
    assert evaluate(measured(40.0, sent, sent - 2), 40.0, 0.0, 0.0)["link_check_ok"] is True
    assert evaluate(measured(40.0, sent, sent - 4), 40.0, 0.0, 0.0)["link_check_ok"] is False
    assert evaluate(measured(40.0, sent, sent - 200), 40.0, 0.0, 0.0)["link_check_ok"] is False


def test_evaluate_without_the_servers_count_fails():
    fields = evaluate(measured(40.0, 20_000, None), 40.0, 0.0, 0.0)
    assert fields["link_loss_measured"] is None and fields["link_check_ok"] is False


def test_evaluate_needs_both_the_rtt_and_the_loss_inside():
    good = evaluate(measured(40.0, 20_000, 19_800), 40.0, 0.0, 0.01)
    bad_rtt = evaluate(measured(43.0, 20_000, 19_800), 40.0, 0.0, 0.01)
    bad_loss = evaluate(measured(40.0, 20_000, 19_000), 40.0, 0.0, 0.01)
    assert (good["link_check_ok"], bad_rtt["link_check_ok"], bad_loss["link_check_ok"]) == (True, False, False)


def test_evaluate_one_way_percentiles_and_probe_count():
    one_way = [float(v) for v in range(200, 0, -1)]  # 1..200 ms, unsorted
    fields = evaluate(measured(40.0, 1234, 1234, one_way=one_way), 40.0, 0.0, 0.0)
    assert fields["link_one_way_delay_p50_ms"] == 101.0  # sorted[100]
    assert fields["link_one_way_delay_p99_ms"] == 199.0  # sorted[int(200 * 0.99)] = sorted[198]
    assert fields["link_probes"] == 1234


# --- histogram ------------------------------------------------------------------------------------------------------


def test_histogram_bins_and_counts_a_known_list():
    values = [0.0, 0.1, 0.25, 0.3, 1.0, 0.24, 0.75]
    assert histogram(values, 0.25) == {
        "bin_start_ms": [0.0, 0.25, 0.5, 0.75, 1.0],
        "count": [3, 2, 0, 1, 1],
    }


def test_histogram_starts_at_the_smallest_values_bin_and_counts_every_value():
    values = [40.3, 40.1, 40.6, 41.9, 40.26, 40.49]
    result = histogram(values)  # bins of 0.25 ms
    assert HISTOGRAM_BIN_MS == 0.25
    assert result["bin_start_ms"] == [40.0, 40.25, 40.5, 40.75, 41.0, 41.25, 41.5, 41.75]
    assert result["count"] == [1, 3, 1, 0, 0, 0, 0, 1]
    assert sum(result["count"]) == len(values)


def test_histogram_of_negative_values_and_of_one_value_and_of_nothing():
    assert histogram([-0.1, 0.6], 0.25) == {"bin_start_ms": [-0.25, 0.0, 0.25, 0.5], "count": [1, 0, 0, 1]}
    assert histogram([20.1], 0.5) == {"bin_start_ms": [20.0], "count": [1]}
    assert histogram([], 0.25) == {"bin_start_ms": [], "count": []}


def test_histogram_with_another_bin_width():
    assert histogram([1, 2, 3, 4, 5, 6], 2.0) == {"bin_start_ms": [0.0, 2.0, 4.0, 6.0], "count": [1, 2, 2, 1]}


# --- plan -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate_bps", [64_000, 1_000_000, 10_000_000, 50_000_000, 100_000_000, 150_000_000])
def test_plan_never_takes_more_than_five_percent_of_a_slow_link(rate_bps):
    count, pps = plan(rate_bps)
    assert RATE_SHARE == 0.05
    assert pps * PROBE_BYTES * 8 <= 0.05 * rate_bps * (1 + 1e-12)
    assert pps == pytest.approx(0.05 * rate_bps / (PROBE_BYTES * 8))
    assert 100 <= count <= MAX_PROBES
    # Within the window when the pace allows more than the floor of 100 probes.
    if pps * PROBE_WINDOW_S >= 100:
        assert count == int(pps * PROBE_WINDOW_S)


@pytest.mark.parametrize("rate_bps", [None, 0, 1_000_000_000, 10_000_000_000, 100_000_000_000])
def test_plan_caps_at_max_probes(rate_bps):
    count, pps = plan(rate_bps)
    assert count == MAX_PROBES
    assert pps == MAX_PROBES / PROBE_WINDOW_S
    if rate_bps:
        assert pps * PROBE_BYTES * 8 <= 0.05 * rate_bps


def test_plan_of_the_acceptance_profile():
    # 1 Gbit/s: 5 % would be 31,250 probes/s; the cap of 10,000 probes in 2 s (5,000/s) comes first.
    assert plan(1_000_000_000) == (10_000, 5_000.0)
    # 10 Mbit/s: 5 % = 500 kbit/s = 312.5 probes of 200 bytes per second, 625 in the window.
    assert plan(10_000_000) == (625, 312.5)
