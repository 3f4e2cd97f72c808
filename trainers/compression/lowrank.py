"""Low rank: PowerSGD's warm-started power iteration, which tensors go as factors, and DiLoCoX's spectral-energy
rank estimator."""

from __future__ import annotations

import torch

from trainers.compression.checks import check_positive, check_ratio
from trainers.compression.quantize import values_nbytes
from trainers.compression.shapes import Shape, matrix_shape


def low_rank(
    x2d: torch.Tensor, rank: int, warm_q: torch.Tensor | None = None, seed: int = 0, iterations: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors P [m, r] and Q [n, r] with ``x2d`` ≈ P @ Q.T, r = min(rank, m, n), by ``iterations`` power iterations.

    From a start Q0 [n, r], each iteration: P = x2d @ Q orthonormalised by a reduced QR, then Q = x2d.T @ P. P @ Q.T
    is the projection of ``x2d`` onto span(P), exact whenever rank(x2d) <= r, and each iteration brings span(P)
    closer to the top-r singular subspace, whose projection is the best rank-r approximation (Eckart-Young). Q0 is
    ``warm_q`` when given with shape [n, r]: the Q of the previous call, as in PowerSGD, since consecutive
    pseudo-gradients are correlated and the calls then keep refining the same subspace. Otherwise Q0 is Gaussian,
    drawn from ``seed`` on the CPU so that the result does not depend on the device.
    """
    check_positive("rank", rank)
    check_positive("iterations", iterations)
    m, n = x2d.shape
    r = min(rank, m, n)
    x = x2d.detach().to(torch.float32)
    if warm_q is not None and warm_q.shape == (n, r):
        q = warm_q.to(device=x.device, dtype=torch.float32)
    else:
        q = torch.randn(n, r, generator=torch.Generator().manual_seed(seed)).to(x.device)
    for _ in range(iterations):
        p = torch.linalg.qr(x @ q).Q
        q = x.T @ p
    return p, q


def goes_as_factors(shape: Shape, rank: int) -> bool:
    """Whether a ``shape`` tensor goes as rank-``rank`` factors: a matrix whose factors are smaller than it."""
    if len(shape) < 2:
        return False
    m, n = matrix_shape(shape)
    return min(rank, m, n) * (m + n) < m * n


def resized_basis(q: torch.Tensor | None, shape: Shape, rank: int, seed: int) -> torch.Tensor | None:
    """A warm start Q [n, r] for a ``shape`` matrix at ``rank`` from the last call's ``q``, or None (cold start).

    QR orthonormalises columns in order, so the first k columns of P = qr(x @ Q0) span the same space whatever Q0's
    later columns are: the iteration on Q's leading r columns is the rank-r iteration, and a fall in rank keeps them.
    A rise keeps every column and appends columns r_old..r-1 of the Gaussian that a cold start at rank r draws from
    ``seed``: deterministic, and orthogonalised against the kept ones by the QR.
    """
    m, n = matrix_shape(shape)
    r = min(rank, m, n)
    if q is None or q.shape[0] != n:
        return None
    if q.shape[1] >= r:
        return q[:, :r]
    fresh = torch.randn(n, r, generator=torch.Generator().manual_seed(seed))[:, q.shape[1] :]
    return torch.cat([q, fresh.to(device=q.device, dtype=q.dtype)], dim=1)


def low_rank_nbytes(shape: Shape, rank: int, bits: int | None, bucket_size: int = 128) -> int:
    """Bytes of the factors P [m, r], Q [n, r] of a ``shape`` matrix, quantized to ``bits`` (None: fp32)."""
    m, n = matrix_shape(shape)
    r = min(rank, m, n)
    return values_nbytes(m * r, bits, bucket_size) + values_nbytes(n * r, bits, bucket_size)


def estimate_rank(x2d: torch.Tensor, energy: float = 0.9) -> int:
    """DiLoCoX's adaptive-rank estimator: the smallest r whose top-r singular values hold ``energy``.

    The share is of the squared Frobenius norm, sum(sigma_i^2) over torch.linalg.svdvals, so ``energy=0.9``
    asks for the rank that keeps 90% of the matrix's energy. A zero matrix gets rank 1, the smallest rank a
    compressor accepts.
    """
    check_ratio("energy", energy)
    # A matrix and its transpose share their singular values; LAPACK on CPU takes a wide one ~6x longer (0.22 s
    # tall, 1.44 s wide for a 896 x 4864 MLP matrix on one thread).
    x = x2d.detach().to(torch.float32)
    sq = torch.linalg.svdvals(x.T if x.shape[0] < x.shape[1] else x) ** 2
    total = sq.sum()
    if total == 0:
        return 1
    share = torch.cumsum(sq, dim=0) / total
    # Float rounding can leave the last share a hair below 1.0; the min keeps r within the spectrum then.
    return min(int(torch.searchsorted(share, energy).item()) + 1, sq.numel())
