"""How a compressor sees a tensor: as a matrix, and each of its dimensions cut into blocks that pad nothing."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Shape = torch.Size | tuple[int, ...]


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The (rows, cols) matrix a tensor of ``shape`` is compressed as: (shape[0], everything else) for two or more
    dimensions; a 1-D tensor is one row, a 0-d tensor (1, 1)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def chunk_length(n: int, target: int) -> int:
    """The block side along a dimension of length `n`: its largest divisor that is at most `target`."""
    if n < 1 or target < 1:
        raise ValueError(f"a dimension and its target chunk must be at least 1, got {n} and {target}")
    if n <= target:
        return n
    # The divisors of n come in pairs (d, n // d); the largest one <= target is found among all of them.
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for divisor in (d, n // d):
                if divisor <= target:
                    best = max(best, divisor)
    return best
