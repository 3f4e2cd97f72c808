"""The composite compressors the methods use, each with ``encode(x, step)``, ``decode(payload, shape, step)`` and
``payload_nbytes(shape)``: ``SparseQuantizeCompressor`` (CocktailSGD) and ``LowRankQuantizeCompressor`` (DiLoCoX's
C_Q o C_L); and ``mean_of_payloads``, the mean of what every replica's payload decodes to."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainers.compression.checks import check_positive, check_ratio
from trainers.compression.lowrank import goes_as_factors, low_rank, low_rank_nbytes, resized_basis
from trainers.compression.quantize import check_bits, decode_values, encode_values, values_nbytes
from trainers.compression.shapes import Shape, matrix_shape
from trainers.compression.sparsify import (
    decode_indices,
    encode_indices,
    index_width,
    mask_size,
    random_mask_indices,
    topk_count,
    topk_select,
)


@dataclass
class SparseQuantizeCompressor:
    """CocktailSGD's chain: random mask -> top-k within it -> int-``bits`` quantization of what is kept.

    1. ``random_keep``: keep the coordinates ``random_mask_indices(numel, random_keep, step, seed)``. Every
       rank derives them alone, so this stage sends no positions.
    2. ``topk_keep``: of those, keep the ``topk_count`` largest magnitudes. Their positions within the masked
       subset are sent with ``encode_indices``, narrower than positions into the whole tensor.
    3. ``bits``: quantize the kept values; ``bits=None`` sends them as fp32.

    Payload: the encoded positions, then the values. Decoding scatters the values into zeros. A stage is off
    at ratio 1.0 (or ``bits=None``); with all three off the payload is the fp32 tensor and the round trip is
    exact. The defaults are CocktailSGD's: 0.1, 0.2, 4 bits in buckets of 128.
    """

    random_keep: float = 0.1
    topk_keep: float = 0.2
    bits: int | None = 4
    bucket_size: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        check_ratio("random_keep", self.random_keep)
        check_ratio("topk_keep", self.topk_keep)
        check_bits(self.bits, allow_none=True)
        check_positive("bucket_size", self.bucket_size)

    def _layout(self, numel: int) -> tuple[int, int, int]:
        """(coordinates in the random mask, values kept by top-k, bytes of their positions) for ``numel``."""
        masked = mask_size(numel, self.random_keep) if self.random_keep < 1 else numel
        if self.topk_keep == 1:
            return masked, masked, 0
        kept = topk_count(masked, self.topk_keep)
        return masked, kept, kept * index_width(masked)

    def encode(self, x: torch.Tensor, step: int) -> torch.Tensor:
        flat = x.detach().reshape(-1).to(torch.float32)
        masked, _, _ = self._layout(flat.numel())
        values = flat
        if self.random_keep < 1:
            values = flat[random_mask_indices(flat.numel(), self.random_keep, step, self.seed, flat.device)]
        position_bytes = flat.new_empty(0, dtype=torch.uint8)
        if self.topk_keep < 1:
            positions, values = topk_select(values, self.topk_keep)
            position_bytes = encode_indices(positions, masked)
        return torch.cat([position_bytes, encode_values(values, self.bits, self.bucket_size)])

    def decode(self, payload: torch.Tensor, shape: torch.Size, step: int) -> torch.Tensor:
        numel = math.prod(shape)
        masked, kept, position_nbytes = self._layout(numel)
        values = decode_values(payload[position_nbytes:], self.bits, self.bucket_size, (kept,))
        if self.topk_keep < 1:
            subset = values.new_zeros(masked)
            subset[decode_indices(payload[:position_nbytes], kept, masked)] = values
            values = subset
        if self.random_keep < 1:
            out = values.new_zeros(numel)
            out[random_mask_indices(numel, self.random_keep, step, self.seed, payload.device)] = values
            values = out
        return values.reshape(shape)

    def payload_nbytes(self, shape: torch.Size) -> int:
        _, kept, position_nbytes = self._layout(math.prod(shape))
        return position_nbytes + values_nbytes(kept, self.bits, self.bucket_size)


class LowRankQuantizeCompressor:
    """DiLoCoX's C_Q o C_L: low-rank factors of each matrix, then int-``bits`` quantization of the factors.

    A tensor of two or more dimensions is compressed as the matrix (shape[0], rest): factors P [m, r] and
    Q [n, r] from ``power_iterations`` power iterations (``low_rank``, r = min(rank, m, n)), each quantized with
    its own bucket scales; the payload is P's bytes then Q's. Where the factors would not be smaller than the
    matrix (r * (m + n) >= m * n, e.g. a small matrix under a large rank), the matrix itself is quantized instead.
    1-D tensors are only quantized. ``bits=None`` sends fp32 values (low rank alone).

    ``rank`` may be changed between calls (DiLoCoX adapts it). All ranks of a group must use the same value
    for a step, because the receiver derives the payload layout from it; decoding needs no other state.

    Warm start: ``encode(x, step, key=name)`` remembers Q per ``key`` and starts that key's next power
    iteration from it (PowerSGD), which converges towards the top-r subspace over calls. Without a key every call
    starts from the Gaussian Q drawn from ``seed``. PowerSGD's one iteration per call suits a gradient that changes
    little between calls; a round's pseudo-gradient moves further, and more iterations, which cost only compute
    (two matrix products each, once a round) and no bytes, bring the factors closer to its best rank-r
    approximation. The refined subspace survives a change of rank (``warm_start``): a lower rank keeps Q's leading
    columns, a higher one appends fresh Gaussian columns, so that DiLoCoX, which changes r almost every round,
    does not restart from noise each time.
    """

    def __init__(
        self, rank: int, bits: int | None = 4, bucket_size: int = 128, seed: int = 0, power_iterations: int = 1
    ) -> None:
        check_bits(bits, allow_none=True)
        check_positive("bucket_size", bucket_size)
        check_positive("power_iterations", power_iterations)
        self.rank = rank
        self.power_iterations = power_iterations
        self.bits = bits
        self.bucket_size = bucket_size
        self.seed = seed
        self._warm_q: dict[str, torch.Tensor] = {}

    @property
    def rank(self) -> int:
        return self._rank

    @rank.setter
    def rank(self, rank: int) -> None:
        check_positive("rank", rank)
        self._rank = rank

    def _factored(self, shape: Shape) -> bool:
        return goes_as_factors(shape, self.rank)

    def encode(self, x: torch.Tensor, step: int, key: str | None = None) -> torch.Tensor:
        if not self._factored(x.shape):
            return encode_values(x, self.bits, self.bucket_size)
        matrix = x.reshape(matrix_shape(x.shape))
        p, q = low_rank(matrix, self.rank, self.warm_start(key, x.shape), self.seed, self.power_iterations)
        if key is not None:
            self._warm_q[key] = q
        return torch.cat([encode_values(f, self.bits, self.bucket_size) for f in (p, q)])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The warm-start Q per key: what the next power iterations start from."""
        return dict(self._warm_q)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._warm_q = dict(state)

    def warm_start(self, key: str | None, shape: Shape) -> torch.Tensor | None:
        """The Q [n, r] that ``key``'s next power iteration starts from at the current rank (``resized_basis``), or
        None (cold start)."""
        q = self._warm_q.get(key) if key is not None else None
        return resized_basis(q, shape, self.rank, self.seed)

    def decode(self, payload: torch.Tensor, shape: torch.Size, step: int) -> torch.Tensor:
        if not self._factored(shape):
            return decode_values(payload, self.bits, self.bucket_size, shape)
        m, n = matrix_shape(shape)
        r = min(self.rank, m, n)
        p_nbytes = values_nbytes(m * r, self.bits, self.bucket_size)
        p = decode_values(payload[:p_nbytes], self.bits, self.bucket_size, (m, r))
        q = decode_values(payload[p_nbytes:], self.bits, self.bucket_size, (n, r))
        return (p @ q.T).reshape(shape)

    def payload_nbytes(self, shape: torch.Size) -> int:
        if not self._factored(shape):
            return values_nbytes(math.prod(shape), self.bits, self.bucket_size)
        return low_rank_nbytes(shape, self.rank, self.bits, self.bucket_size)


def mean_of_payloads(
    gathered: list[torch.Tensor], compressor, shapes: list[torch.Size], step: int
) -> list[torch.Tensor]:
    """Per tensor, the mean of what every replica's payload decodes to.

    `gathered` holds one flat buffer per replica (an all-gather's output), each the concatenated payloads of
    `shapes` as `compressor` encoded them at `step`. Summed in rank order, so the mean is bit-identical on every
    rank: a sum of compressed payloads (low-rank factors, sparse values) is not itself a payload, so averaging
    happens after decoding.
    """
    sizes = [compressor.payload_nbytes(shape) for shape in shapes]
    decoded = [
        [compressor.decode(payload, shape, step) for payload, shape in zip(buffer.split(sizes), shapes, strict=True)]
        for buffer in gathered
    ]
    return [torch.stack(per_replica).mean(dim=0) for per_replica in zip(*decoded, strict=True)]
