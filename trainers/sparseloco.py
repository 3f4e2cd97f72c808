"""SparseLoCo (arXiv 2508.15706), the method of Templar's Covenant-72B run: DiLoCo's outer loop in which the global
outer momentum is replaced by a per-replica error-feedback accumulator, of which each replica sends only the chunked
top-k, 2-bit quantized.

Each rank holds one pipeline stage of one replica and runs everything below for that stage alone, with the same stage
of the other clusters (the data-parallel group); nothing needs the whole model, so pipeline stages work as they are.
theta is the stage's fp32 copy, identical on every replica, that evaluation runs on. Every H = `--local-steps` inner
AdamW steps, per parameter tensor, with beta = `--error-decay` and alpha = `--outer-lr`:

    delta_i = theta - theta_i                       replica i's pseudo-gradient of the round
    e_i     = beta e_i + alpha delta_i              error feedback in place of outer momentum (e_i starts at 0)
    P_i     = Q(TopK_chunks(e_i))                   per chunk the k largest |e_i|, their values 2-bit quantized
    e_i     = e_i - D(P_i)                          remove what was sent, as the others will decode it
    Delta   = mean over senders of D(P_j)           all-gather every payload; per coordinate, the mean over the
                                                    replicas that sent it (0 where none did)
    theta   = theta - alpha Delta,  theta_i = theta outer SGD, no momentum; every replica restarts from theta

A sum of sparse top-k sets is not itself a top-k set, so the payloads are gathered, not reduced, and every rank
decodes all of them in rank order: Delta, and theta, are bit-identical on every replica. With one replica (no
data-parallel group) nothing crosses a link and the outer step runs on the replica's own D(P_i), so H and the outer
learning rate mean the same at every cluster count.

The reference is the code of github.com/one-covenant/SparseLoCo (read through stored copies: its optimizer under the
repository's earlier name CCLoco, and a vendored copy of its later SparseLoCo class), and where it and the paper
differ we follow the code:

- Aggregation: the code scatters every replica's values with `scatter_reduce(reduce="mean", include_self=False)`, so
  a coordinate is averaged over the replicas that sent it; the paper, as we read it, states the plain mean
  (1/R) sum_r over all R replicas. The two agree where every replica sent a coordinate.
- The outer lr enters twice: the code adds lr times the pseudo-gradient to the error buffer and then takes an SGD step
  of lr on the aggregate (alpha^2 on a fresh coordinate). At the published lr 1 the two readings agree.
- Chunks: each dimension of a tensor is cut at its largest divisor not above `--chunk-size` (64); a matrix into
  h x w tiles (64 x 64 = 4096 elements for most), a 1-D tensor into runs of at most 64 elements. k per chunk scales
  with the chunk's size, k = max(1, round(density * chunk elements)) (the later code's round(len * top_k / 64^2)).
  Tensors of more than two dimensions, which the code does not chunk, are taken as the matrix (shape[0], rest).
- Quantization (the code's statistical quantizer, one per tensor over its selected values v): shift = mean(v),
  sigma = ||v - shift|| / sqrt(n - 1), scale = `--quantization-range` sigma / 2^b (1 where that is 0 or not finite),
  code = clamp(round((v - shift) / scale + 2^(b-1)), 0, 2^b - 1); decoding is lookup[code] + shift, where lookup holds
  each code's mean of v - shift (0 for an empty code). The shift and the lookup table are the tensor's "scales":
  the code gathers them as 1 + 2^b fp32 values per tensor, and so do we.
- Indices: the code gathers them as int64, the values' codes as uint8. On the wire here each code is packed into b
  bits and each index, the position inside its chunk, into ceil(log2 C) bits for a chunk of C elements: 12 bits for a
  4096-element chunk, as templar's 12-bit index packing does and as Covenant's stated 146x compression implies
  (32 / (1/64 x (2 + 12)) = 146.3).
- The code's optional decoupled weight decay and sign of the aggregate are off by default there and not kept here.

Payload, exact: a tensor of R chunks of C elements keeping k per chunk with b-bit values sends

    4 (1 + 2^b) + ceil(R k b / 8) + ceil(R k ceil(log2 C) / 8)  bytes            (ChunkedTopK.payload_nbytes)

(shift and lookup, the packed codes, the packed indices), and one synchronization's all-gather sends (n - 1) times
the stage's sum of it from every rank of n replicas. The tiny model (0.88M parameters) sends 25,245 bytes per
replica per round at the defaults, 0.72% of its fp32 size.

Per sync the method reports (the train loop prefixes `sync_`): round, local_steps, values_sent, pseudo_grad_norm
(||delta_i||), compression_error (||e_i - D(P_i)|| / ||e_i||, before the subtraction: the share of the accumulator
kept back), residual_norm (||e_i|| after it) and shared_fraction (of the coordinates in Delta, those that more than
one replica sent), all over the stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from trainers.comm import all_gather_bytes, flatten
from trainers.method import (
    BlockingRounds,
    Exchange,
    MethodConfig,
    MethodContext,
    SyncPlan,
    SyncReport,
    copy_into,
    tensor_bytes,
)
from trainers.optim import OuterOptimizer, validate_outer

_FP32_BYTES = 4


@dataclass(frozen=True)
class SparseLoCoConfig(MethodConfig):
    """SparseLoCo's published settings: H = 30 as Covenant-72B ran it; the rest the paper's and the reference code's
    (outer lr 1, error decay 0.95, 64 of every 64 x 64 = 4096 values, 2-bit values in a 6-sigma range)."""

    local_steps: int = 30  # H
    outer_lr: float = 1.0  # alpha
    error_decay: float = 0.95  # beta
    density: float = 64 / 4096  # k / C per chunk: Covenant's 1.56%
    chunk_size: int = 64
    bits: int = 2  # b: 2^b quantization levels
    quantization_range: float = 6.0  # sigmas
    # Synchronize the steps of an unfinished last round in finish(), so every trained token is in the final theta;
    # --no-final-sync drops them, as DiLoCo does (they then do not count as applied tokens).
    final_sync: bool = True

    def __post_init__(self) -> None:
        validate_outer(self.local_steps, self.outer_lr, 0.0)
        if not 0 <= self.error_decay <= 1:
            raise ValueError(f"--error-decay must be in [0, 1], got {self.error_decay}")
        if not 0 < self.density <= 1:
            raise ValueError(f"--density must be in (0, 1], got {self.density}")
        if self.chunk_size < 1:
            raise ValueError(f"--chunk-size must be at least 1, got {self.chunk_size}")
        # Codes are uint8 in the reference code: at most 8 bits.
        if self.bits not in range(1, 9):
            raise ValueError(f"--bits must be an integer from 1 to 8, got {self.bits}")
        if not 0 < self.quantization_range < math.inf:
            raise ValueError(f"--quantization-range must be a positive finite number, got {self.quantization_range}")

    def max_syncs(self, steps: int) -> int:
        """How many outer steps a run of `steps` steps takes."""
        return -(-steps // self.local_steps) if self.final_sync else steps // self.local_steps

    def compressor(self) -> ChunkedTopK:
        return ChunkedTopK(self.chunk_size, self.density, self.bits, self.quantization_range)

    def sync_plan(self, shapes: Sequence[torch.Size]) -> SyncPlan:
        """Once a round, blocking, the all-gather of every tensor's 4 (1 + 2^b) + ceil(R k b / 8)
        + ceil(R k ceil(log2 C) / 8) bytes (shift and lookup table, b-bit codes, in-chunk indices)."""
        compressor = self.compressor()
        nbytes = sum(compressor.payload_nbytes(shape) for shape in shapes)
        return SyncPlan((Exchange("all-gather", nbytes),), self.local_steps, slow_start=True)


# ----------------------------------------------------------------------------------------------------------
# Bit packing of unsigned integers of any width
# ----------------------------------------------------------------------------------------------------------


def packed_nbytes(count: int, width: int) -> int:
    return math.ceil(count * width / 8)


def _spans(count: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, range]:
    """Value i's bits start at bit i * width of the stream: (its first byte, its bit offset in that byte, the bytes
    after that first one it can reach: a value and its offset fit in ceil((7 + width) / 8) bytes)."""
    offsets = torch.arange(count, device=device) * width
    return offsets >> 3, offsets & 7, range((7 + width + 7) // 8)


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below 2^width as a uint8 stream of ``width`` bits each, low bits first.

    Each value is shifted to its bit offset and its bytes are added into the stream; values never share a bit, so
    the sums are the bits themselves. Built from shifts and masks, the bytes do not depend on the host's endianness.
    """
    flat = values.reshape(-1).to(torch.int64)
    nbytes = packed_nbytes(flat.numel(), width)
    if width == 0 or nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    first, shift, reach = _spans(flat.numel(), width, flat.device)
    shifted = flat << shift
    stream = torch.zeros(nbytes + len(reach), dtype=torch.int64, device=flat.device)
    for j in reach:
        stream.index_add_(0, first + j, (shifted >> (8 * j)) & 0xFF)
    return stream[:nbytes].to(torch.uint8)


def unpack_bits(buf: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``count`` values of ``width`` bits, as a LongTensor."""
    if buf.numel() != packed_nbytes(count, width):
        raise ValueError(f"{count} values of {width} bits are {packed_nbytes(count, width)} bytes; got {buf.numel()}")
    if width == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64, device=buf.device)
    first, shift, reach = _spans(count, width, buf.device)
    stream = torch.nn.functional.pad(buf.to(torch.int64), (0, len(reach)))
    window = sum(stream[first + j] << (8 * j) for j in reach)
    return (window >> shift) & ((1 << width) - 1)


# ----------------------------------------------------------------------------------------------------------
# The compressor: chunks, top-k per chunk, statistical quantization
# ----------------------------------------------------------------------------------------------------------


def chunk_side(n: int, target: int) -> int:
    """The largest divisor of ``n`` not above ``target``: the side a dimension of ``n`` is cut at."""
    return next(d for d in range(min(n, target), 0, -1) if n % d == 0)


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
        m, n = shape[0], math.prod(shape[1:])
        h, w = chunk_side(m, chunk_size), chunk_side(n, chunk_size)
        matrix, tile, rows, chunk = (m, n), (h, w), (m // h) * (n // w), h * w
    else:
        numel = math.prod(shape)
        side = chunk_side(numel, chunk_size)
        matrix, tile, rows, chunk = None, None, numel // side, side
    # Python's round, half to even, as the reference code computes k.
    return ChunkLayout(matrix, tile, rows, chunk, min(chunk, max(1, round(chunk * density))))


def quantize_statistical(values: torch.Tensor, bits: int, range_sigmas: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's statistical quantizer over a tensor's selected ``values`` (the rule in the module docstring).

    Returns (codes, as a LongTensor shaped like ``values``; [shift, lookup_0 .. lookup_{2^b - 1}], fp32): the
    table's mean-per-code decoding errs less than the code's centre would on skewed values.
    """
    levels = 2**bits
    v = values.to(torch.float32)
    shift = v.mean()
    centred = v - shift
    sigma = centred.norm() / math.sqrt(v.numel() - 1) if v.numel() > 1 else torch.zeros(())
    scale = float(range_sigmas * sigma / levels)
    if scale == 0 or not math.isfinite(scale):
        scale = 1.0
    codes = torch.round(centred / scale + levels // 2).clamp(0, levels - 1).to(torch.int64)
    flat_codes, flat_centred = codes.reshape(-1), centred.reshape(-1)
    sums = torch.zeros(levels, dtype=torch.float32, device=v.device).index_add_(0, flat_codes, flat_centred)
    counts = torch.bincount(flat_codes, minlength=levels).to(torch.float32)
    lookup = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return codes, torch.cat([shift.reshape(1), lookup])


def dequantize_statistical(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_statistical`` up to its rounding: lookup[code] + shift."""
    return table[1:][codes] + table[0]


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


# ----------------------------------------------------------------------------------------------------------
# The method
# ----------------------------------------------------------------------------------------------------------


class SparseLoCo(BlockingRounds):
    config_class = SparseLoCoConfig

    def __init__(self, ctx: MethodContext, cfg: SparseLoCoConfig):
        super().__init__(ctx, cfg)
        # The reference's outer step is plain SGD (momentum 0): the error buffers stand in for momentum.
        self.outer = OuterOptimizer(self.global_params, cfg.outer_lr, 0.0)
        self.compressor = cfg.compressor()
        self.error = [torch.zeros_like(g) for g in self.global_params]  # e_i, per tensor of this stage
        self.round = 0

    @torch.no_grad()
    def outer_step(self) -> SyncReport:
        self.round += 1
        payloads, fields = self._accumulate_and_compress()
        # Every replica's stage has the same shapes, so the payloads have equal sizes, as the all-gather needs.
        buffers, inflight = all_gather_bytes(torch.cat(payloads), self.ctx.data_parallel_group)
        blocked_s, _ = inflight.wait()
        average, shared = mean_over_senders(buffers, self.compressor, [g.shape for g in self.global_params])
        self.outer.step(average)
        copy_into(self.global_params, self.params)
        fields.update(round=self.round, local_steps=self.steps_in_round, shared_fraction=shared)
        return SyncReport(payload_bytes=inflight.payload_bytes, blocked_s=blocked_s, fields=fields)

    def _accumulate_and_compress(self) -> tuple[list[torch.Tensor], dict]:
        """e_i = beta e_i + alpha delta_i, the payloads of e_i's chunked top-k, and e_i minus what they carry."""
        payloads, delta_sq, before_sq, values_sent = [], 0.0, 0.0, 0
        for theta, local, error in zip(self.global_params, self.params, self.error, strict=True):
            delta = theta - local.detach().float()
            # The reference adds lr times the pseudo-gradient (its outer SGD's lr) to the error buffer.
            error.mul_(self.cfg.error_decay).add_(delta, alpha=self.cfg.outer_lr)
            payload = self.compressor.encode(error)
            # Decoded as every other replica will decode it, so e_i keeps the quantization error too.
            positions, values = self.compressor.decode(payload, error.shape)
            delta_sq += float(delta.double().pow(2).sum())
            before_sq += float(error.double().pow(2).sum())
            error.sub_(self.compressor.densify(positions, values, error.shape))
            payloads.append(payload)
            values_sent += values.numel()
        residual_norm = float(torch.linalg.vector_norm(flatten(self.error)))
        fields = {
            "values_sent": values_sent,
            "pseudo_grad_norm": math.sqrt(delta_sq),
            "compression_error": residual_norm / math.sqrt(before_sq) if before_sq else 0.0,
            "residual_norm": residual_norm,
        }
        return payloads, fields

    def optimizer_state_bytes(self) -> int:
        """Inner AdamW moments, theta and the error buffers (the outer SGD keeps no momentum)."""
        return super().optimizer_state_bytes() + self.outer.state_bytes() + tensor_bytes(self.error)
