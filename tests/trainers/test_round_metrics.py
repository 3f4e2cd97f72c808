"""DiLoCoX's round metrics (trainers/round_metrics.py) against their formulas worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.round_metrics import omega2_bounds, outer_step_monitor, weighted_omega2

# Rank 8 of d = 32 at 4 bits: r/d = 1/4, 2^-4 = 1/16.
PAPER_R8 = 1 - (1 / 4) / 16  # 0.984375
CORRECTED_R8 = (math.sqrt(3 / 4) + 1 / 4) ** 2  # (0.8660 + 0.25)^2 = 1.24551
# A tensor sent whole (r/d = 1) at 4 bits.
PAPER_WHOLE = 1 - 1 / 16  # 0.9375
CORRECTED_WHOLE = (0 + 1 / 4) ** 2  # 0.0625


def test_the_two_bounds_of_one_tensor():
    assert omega2_bounds(8, 32, 4) == pytest.approx((0.984375, 1.2455127), abs=1e-7)
    assert omega2_bounds(8, 32, 4) == pytest.approx((PAPER_R8, CORRECTED_R8))
    # Sent whole, only quantization's error is left in the corrected bound; the paper's stays near 1.
    assert omega2_bounds(5, 5, 4) == pytest.approx((PAPER_WHOLE, CORRECTED_WHOLE))
    # At 8 bits and full rank the corrected bound is 2^-8, the paper's 1 - 2^-8.
    assert omega2_bounds(3, 3, 8) == pytest.approx((1 - 1 / 256, 1 / 256))


def test_bounds_are_weighted_by_each_tensors_squared_norm():
    # A 64 x 32 matrix of ones (||c||^2 = 2,048) goes as rank-8 factors ((64 + 32) x 8 = 768 < 2,048 values); a
    # vector of ten 2s (||c||^2 = 40) and a 4 x 4 matrix of 3s (||c||^2 = 144; its rank-4 factors would be 32 > 16
    # values) go whole.
    tensors = [torch.ones(64, 32), torch.full((10,), 2.0), torch.full((4, 4), 3.0)]
    total = 2048 + 40 + 144
    got = weighted_omega2(tensors, rank=8, bits=4)
    assert got["omega2_paper"] == pytest.approx((2048 * PAPER_R8 + 184 * PAPER_WHOLE) / total)
    assert got["omega2_corrected"] == pytest.approx((2048 * CORRECTED_R8 + 184 * CORRECTED_WHOLE) / total)


def test_a_round_with_nothing_to_send_has_no_bound():
    assert weighted_omega2([torch.zeros(4, 4), torch.zeros(3)], rank=2, bits=4) == {
        "omega2_paper": None,
        "omega2_corrected": None,
    }


def test_the_outer_step_monitor_by_hand():
    before, after = [torch.zeros(2), torch.zeros(1)], [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    average = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    # The first applied average: the step moved theta by ||(3, 0, 4)|| = 5 for an average of norm 1.
    assert outer_step_monitor(before, after, average, None) == {
        "cosine": None,
        "step_norm_ratio": pytest.approx(5.0),
        "staleness": None,
    }
    # Against the last average (0, 2, 0): orthogonal, and ||Delta_t - Delta_{t-1}|| / ||Delta_{t-1}|| = sqrt(5) / 2.
    last = torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64)
    got = outer_step_monitor(before, after, average, last)
    assert got["cosine"] == pytest.approx(0.0) and got["staleness"] == pytest.approx(math.sqrt(5) / 2)
    # Pointing the same way as (2, 0, 0): cosine 1, staleness ||(-1, 0, 0)|| / 2 = 0.5.
    got = outer_step_monitor(before, after, average, torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64))
    assert got["cosine"] == pytest.approx(1.0) and got["staleness"] == pytest.approx(0.5)
    # A zero average has no ratio and no cosine.
    got = outer_step_monitor(before, after, torch.zeros(3, dtype=torch.float64), last)
    assert got["step_norm_ratio"] is None and got["cosine"] is None
