"""SparseLoCo's compressor: per tensor the chunked top-k, values statistically quantized, positions bit-packed.

Each dimension of a tensor is cut at its largest divisor not above the chunk size (``chunk_length``): a matrix
(``matrix_shape``: a tensor of more than two dimensions is (shape[0], rest)) into h x w tiles, a 1-D tensor into runs.
Every chunk keeps its k largest magnitudes; their values go through ``quantize_statistical`` and their positions
inside the chunk are packed ``ceil(log2 C)`` bits each for a chunk of C elements (``pack_bits``).
trainers/methods/sparseloco.py says where this follows the reference code and what the payload costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from trainers.compression.bitpack import pack_bits, packed_nbytes, unpack_bits
from trainers.compression.quantize import dequantize_statistical, quantize_statistical
from trainers.compression.shapes import chunk_length, matrix_shape

_FP32_BYTES = 4


@dataclass(frozen=True)
class ChunkLayout:
    """How a tensor is cut: ``rows`` chunks of ``chunk`` elements, ``k`` of them kept per chunk. A matrix is cut into
    (m / h) x (n / w) tiles of h x w (``tile``); anything else into runs of ``chunk`` elements (``tile`` None)."""

    matrix: tuple[int, int] | None
    tile: tuple[int, int] | None
    rows: int
    chunk: int
    k: int

    @property
    def index_bits(self) -> int:
        """ceil(log2 chunk): the bits of a position inside a chunk (0 for one-element chunks: it is always 0)."""
        return (self.chunk - 1).bit_length()

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as [rows, chunk]: tile by tile, each tile's elements row-major."""
        if self.tile is None:
            return x.reshape(self.rows, self.chunk)
        (m, n), (h, w) = self.matrix, self.tile
        return x.reshape(m // h, h, n // w, w).permute(0, 2, 1, 3).reshape(self.rows, self.chunk)

    def from_chunks(self, chunks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.tile is None:
            return chunks.reshape(shape)
        (m, n), (h, w) = self.matrix, self.tile
        return chunks.reshape(m // h, n // w, h, w).permute(0, 2, 1, 3).reshape(shape)


@cache
def chunk_layout(shape: tuple[int, ...], chunk_size: int, density: float) -> ChunkLayout:
    if len(shape) >= 2:
        m, n = matrix_shape(shape)
        h, w = chunk_length(m, chunk_size), chunk_length(n, chunk_size)
        matrix, tile, rows, chunk = (m, n), (h, w), (m // h) * (n // w), h * w
    else:
        numel = math.prod(shape)
        side = chunk_length(numel, chunk_size)
        matrix, tile, rows, chunk = None, None, numel // side, side
    # Python's round, half to even, as the reference code computes k.
    return ChunkLayout(matrix, tile, rows, chunk, min(chunk, max(1, round(chunk * density))))


@dataclass(frozen=True)
class ChunkedTopK:
    """Per tensor: the ``k`` largest magnitudes of every chunk, their values quantized to ``bits``.

    Payload, all of it what crosses the wire: [shift, lookup] as 1 + 2^bits fp32 values, then the values' codes
    packed ``bits`` each, then their positions inside their chunks packed ``index_bits`` each, chunk by chunk.
    Every rank derives the layout from the shape alone, so nothing else travels.
    """

    chunk_size: int = 64
    density: float = 64 / 4096
    bits: int = 2
    quantization_range: float = 6.0

    def layout(self, shape: Sequence[int]) -> ChunkLayout:
        return chunk_layout(tuple(shape), self.chunk_size, self.density)

    def _sizes(self, shape: Sequence[int]) -> tuple[int, int, int]:
        """(table, codes, indices) bytes of a ``shape`` tensor's payload."""
        lay = self.layout(shape)
        sent = lay.rows * lay.k
        return _FP32_BYTES * (1 + 2**self.bits), packed_nbytes(sent, self.bits), packed_nbytes(sent, lay.index_bits)

    def payload_nbytes(self, shape: Sequence[int]) -> int:
        return sum(self._sizes(shape))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        lay = self.layout(x.shape)
        chunks = lay.to_chunks(x.detach().to(torch.float32))
        positions = torch.topk(chunks.abs(), lay.k, dim=1, sorted=False).indices
        codes, table = quantize_statistical(chunks.gather(1, positions), self.bits, self.quantization_range)
        return torch.cat(
            [table.contiguous().view(torch.uint8), pack_bits(codes, self.bits), pack_bits(positions, lay.index_bits)]
        )

    def decode(self, payload: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions inside their chunks, values), both [rows, k]: what ``payload`` says of a ``shape`` tensor."""
        lay = self.layout(shape)
        table_nbytes, codes_nbytes, _ = self._sizes(shape)
        # A slice of a gathered buffer may start off a 4-byte boundary, which a float view refuses: copy it.
        table = payload[:table_nbytes].clone().view(torch.float32)
        codes = unpack_bits(payload[table_nbytes : table_nbytes + codes_nbytes], self.bits, lay.rows * lay.k)
        positions = unpack_bits(payload[table_nbytes + codes_nbytes :], lay.index_bits, lay.rows * lay.k)
        values = dequantize_statistical(codes, table)
        return positions.view(lay.rows, lay.k), values.view(lay.rows, lay.k)

    def densify(self, positions: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The sparse [rows, k] pair as a dense ``shape`` tensor (zeros elsewhere)."""
        lay = self.layout(shape)
        chunks = values.new_zeros(lay.rows, lay.chunk).scatter_(1, positions, values)
        return lay.from_chunks(chunks, shape)


def mean_over_senders(
    gathered: list[torch.Tensor], compressor: ChunkedTopK, shapes: list[torch.Size]
) -> tuple[list[torch.Tensor], float]:
    """Per tensor, every coordinate's mean over the replicas whose payload holds it (0 where none does), and the
    fraction of the coordinates held that more than one replica sent.

    `gathered` holds one flat buffer per replica (an all-gather's output). Added replica by replica in rank order,
    each replica's positions distinct within a chunk, so the sums and the mean are bit-identical on every rank.
    """
    sizes = [compressor.payload_nbytes(shape) for shape in shapes]
    decoded = [list(zip(buffer.split(sizes), shapes, strict=True)) for buffer in gathered]
    means, held, shared = [], 0, 0
    for i, shape in enumerate(shapes):
        lay = compressor.layout(shape)
        total = torch.zeros(lay.rows, lay.chunk, dtype=torch.float32, device=gathered[0].device)
        senders = torch.zeros_like(total)
        for per_replica in decoded:
            positions, values = compressor.decode(*per_replica[i])
            total.scatter_add_(1, positions, values)
            senders.scatter_add_(1, positions, torch.ones_like(values))
        means.append(lay.from_chunks(total / senders.clamp(min=1), shape))
        held += int((senders > 0).sum())
        shared += int((senders > 1).sum())
    return means, shared / held if held else 0.0
