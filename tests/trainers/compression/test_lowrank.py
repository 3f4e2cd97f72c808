"""Low rank (trainers/compression/lowrank.py and DiLoCoX's LowRankQuantizeCompressor): the power iteration, the
fall-back to quantizing small matrices, payload sizes, warm starts across ranks, the rank estimator."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.compression.compressors import LowRankQuantizeCompressor
from trainers.compression.error_feedback import relative_error
from trainers.compression.lowrank import estimate_rank, low_rank, low_rank_nbytes
from trainers.compression.quantize import quantized_nbytes


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------------
# Low rank (DiLoCoX)
# --------------------------------------------------------------------------------------------------------


def _rank2_matrix() -> torch.Tensor:
    return _randn(300, 2, seed=6) @ _randn(200, 2, seed=7).T


@pytest.mark.parametrize("rank", [2, 3, 8])
def test_low_rank_recovers_a_rank2_matrix(rank: int) -> None:
    x = _rank2_matrix()
    p, q = low_rank(x, rank)
    assert p.shape == (300, rank) and q.shape == (200, rank)
    assert relative_error(x, p @ q.T) < 1e-4
    compressor = LowRankQuantizeCompressor(rank, bits=None)
    assert relative_error(x, compressor.decode(compressor.encode(x, 0), x.shape, 0)) < 1e-4


def _decaying_spectrum_matrix(m: int = 200, n: int = 120, decay: float = 0.9) -> torch.Tensor:
    """A full-rank matrix whose singular values fall geometrically: no rank-r factors are exact, as with a
    pseudo-gradient, so how close the factors come to the best rank-r approximation shows."""
    u = torch.linalg.qr(_randn(m, n, seed=11)).Q
    v = torch.linalg.qr(_randn(n, n, seed=12)).Q
    return (u * decay ** torch.arange(n, dtype=torch.float32)) @ v.T


def test_more_power_iterations_approach_the_best_rank_r_approximation() -> None:
    x, rank = _decaying_spectrum_matrix(), 8
    singular_values = torch.linalg.svdvals(x)
    best = (singular_values[rank:].square().sum() / singular_values.square().sum()).sqrt().item()
    errors = []
    for iterations in (1, 2, 8):
        p, q = low_rank(x, rank, iterations=iterations)
        errors.append(relative_error(x, p @ q.T))
    assert errors[0] > errors[1] > errors[2] >= best - 1e-6
    assert errors[0] > 1.2 * best and errors[2] < 1.02 * best
    # The compressor passes its setting to every matrix it factors (bits=None: the factors' error alone).
    one, eight = (LowRankQuantizeCompressor(rank, bits=None, power_iterations=i) for i in (1, 8))
    assert relative_error(x, one.decode(one.encode(x, 0), x.shape, 0)) == pytest.approx(errors[0], rel=1e-4)
    assert relative_error(x, eight.decode(eight.encode(x, 0), x.shape, 0)) == pytest.approx(errors[2], rel=1e-4)
    with pytest.raises(ValueError, match="power_iterations must be >= 1; got 0"):
        LowRankQuantizeCompressor(rank, power_iterations=0)


def test_low_rank_clips_rank_and_falls_back_to_quantizing_small_matrices() -> None:
    p, q = low_rank(_randn(5, 40), rank=16)
    assert p.shape == (5, 5) and q.shape == (40, 5)
    # 30 x 20 at rank 16: factors (16 * 50 values) would outgrow the matrix (600), so it goes quantized.
    compressor = LowRankQuantizeCompressor(16)
    x = _randn(30, 20)
    assert compressor.payload_nbytes(x.shape) == quantized_nbytes(600, 4, 128) == compressor.encode(x, 0).numel()
    assert relative_error(x, compressor.decode(compressor.encode(x, 0), x.shape, 0)) < 0.15


@pytest.mark.parametrize("shape", [(300, 200), (128, 3, 5), (1000, 64)])
def test_low_rank_payload_matches_formula(shape: tuple[int, ...]) -> None:
    compressor = LowRankQuantizeCompressor(rank=4)
    payload = compressor.encode(_randn(*shape), 0)
    m, n = shape[0], math.prod(shape[1:])
    expected = quantized_nbytes(m * 4, 4, 128) + quantized_nbytes(n * 4, 4, 128)
    assert payload.numel() == low_rank_nbytes(shape, 4, 4, 128) == expected
    # 1-D tensors are only quantized.
    assert compressor.encode(_randn(1000), 0).numel() == quantized_nbytes(1000, 4, 128)


def test_low_rank_quantized_error_and_ratio() -> None:
    # Rank-2 matrix, rank 4, int4 factors: error comes from quantizing P and Q (measured 0.21).
    x = _rank2_matrix()
    compressor = LowRankQuantizeCompressor(rank=4)
    payload = compressor.encode(x, 0)
    assert relative_error(x, compressor.decode(payload, x.shape, 0)) < 0.3
    assert 4 * x.numel() / payload.numel() > 50


def test_rank_can_change_between_calls_and_warm_start_converges() -> None:
    # A 256 x 128 matrix with singular values exp(-i / 8): the best rank-8 error is exp(-1) = 0.368.
    u = torch.linalg.qr(_randn(256, 128, seed=8)).Q
    v = torch.linalg.qr(_randn(128, 128, seed=9)).Q
    x = u * torch.exp(-torch.arange(128.0) / 8) @ v.T
    compressor = LowRankQuantizeCompressor(rank=8, bits=None)
    errors = [relative_error(x, compressor.decode(compressor.encode(x, t, key="w"), x.shape, t)) for t in range(4)]
    assert errors[-1] < errors[0] - 0.1
    assert errors[-1] < 1.05 * math.exp(-1)

    compressor.rank = 2  # the remembered Q no longer fits and is replaced
    payload = compressor.encode(x, 4, key="w")
    assert payload.numel() == low_rank_nbytes(x.shape, 2, None) == 4 * 2 * (256 + 128)
    assert compressor.decode(payload, x.shape, 4).shape == x.shape


def test_estimate_rank_on_known_spectrum() -> None:
    # Singular values 3, 2, 1 and five of 0.1: energy shares 0.641, 0.925, 0.996, then +0.0007 each.
    u = torch.linalg.qr(_randn(40, 8, seed=10)).Q
    v = torch.linalg.qr(_randn(30, 8, seed=11)).Q
    x = u * torch.tensor([3.0, 2.0, 1.0] + [0.1] * 5) @ v.T
    assert [estimate_rank(x, e) for e in (0.5, 0.6, 0.9, 0.99, 0.999)] == [1, 1, 2, 3, 7]
    assert estimate_rank(x) == 2
    assert estimate_rank(torch.zeros(6, 4)) == 1
    # A wide matrix is estimated through its transpose (same spectrum, faster): the same answers either way.
    assert [estimate_rank(x.T, e) for e in (0.5, 0.6, 0.9, 0.99, 0.999)] == [1, 1, 2, 3, 7]
