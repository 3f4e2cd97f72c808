"""The chunked orthonormal DCT-II that DeMo compresses momentum in (arXiv 2411.19870, reference code bloc97/DeMo).

A tensor is read as a matrix and cut into equal h x w blocks; every block is transformed on its own by the
separable 2-D DCT-II, X = C_h B C_w^T, where C_n is the orthonormal n x n DCT-II matrix

    C_n[k, i] = s_k cos(pi (2i + 1) k / (2n)),    s_0 = sqrt(1/n), s_k = sqrt(2/n) for k > 0

so C_n^{-1} = C_n^T and the inverse is B = C_h^T X C_w. Orthonormal: a coefficient's magnitude is its share of the
block's energy, which is what top-k by magnitude selects on, and an inverse of a subset of coefficients is exactly
the part of the block they represent.

Which tensor becomes which blocks, as the reference does it (trainers/compression/shapes.py):

- the block side along a dimension of length n is the largest divisor of n that is at most the target chunk
  (n itself when n <= target), so blocks tile the tensor exactly, with no padding: 256 -> 64, 130 -> 26, and a
  prime above the target -> 1 (every position its own block along that dimension);
- a 2-D tensor (rows, cols) is chunked in both dimensions: blocks of h x w = up to 64 x 64 coefficients;
- a 1-D tensor (n,) is chunked along its one dimension: blocks of w coefficients. Here it is the matrix (1, n),
  whose row side is 1 (C_1 = [1]), which is the same transform;
- not in the reference (it handles 1-D and 2-D only): a 0-d tensor is read as (1, 1), and a tensor of more than
  two dimensions as the matrix (shape[0], the product of the rest).

The coefficients come out as a (blocks, h * w) matrix: blocks in row-major order of their place in the tensor,
each block's coefficients flattened row-major over (frequency along rows, frequency along columns), the reference's
order, so a coefficient's index is a number in [0, h * w).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from trainers.compression.shapes import chunk_length, matrix_shape


@functools.lru_cache(maxsize=64)
def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """C_n, the orthonormal DCT-II matrix (coefficients = C_n @ x). Built in float64, then cast, so its rounding
    is one cast's; cached, as a model has few distinct block sides."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    basis[0] /= math.sqrt(2)
    return basis.to(dtype=dtype, device=device)


class ChunkedDCT:
    """The blocks of one tensor shape and the transform both ways: `encode(x)` -> (blocks, h * w) coefficients,
    `decode(coefficients)` -> a tensor of the shape again."""

    def __init__(self, shape: Sequence[int], target_chunk: int):
        self.shape = torch.Size(shape)
        self.rows, self.cols = matrix_shape(self.shape)
        self.h, self.w = chunk_length(self.rows, target_chunk), chunk_length(self.cols, target_chunk)

    @property
    def blocks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def block_size(self) -> int:
        """Coefficients per block, h * w."""
        return self.h * self.w

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        c_h, c_w = self._bases(x)
        # (block row, block column, h, w), then X = C_h B C_w^T for every block B at once (two batched matmuls:
        # half the time of the equivalent three-operand einsum on CPU).
        blocks = x.reshape(self.rows // self.h, self.h, self.cols // self.w, self.w).transpose(1, 2)
        return (c_h @ blocks @ c_w.T).reshape(self.blocks, self.block_size)

    def decode(self, coefficients: torch.Tensor) -> torch.Tensor:
        c_h, c_w = self._bases(coefficients)
        grid = coefficients.reshape(self.rows // self.h, self.cols // self.w, self.h, self.w)
        # B = C_h^T X C_w, then each block back in its place in the tensor.
        blocks = c_h.T @ grid @ c_w
        return blocks.transpose(1, 2).reshape(self.shape)

    def _bases(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return dct_matrix(self.h, like.dtype, like.device), dct_matrix(self.w, like.dtype, like.device)
