"""Compressors for the low-communication methods (opendiloco, cocktail, dilocox).

Every compressor turns a float tensor into a flat ``torch.uint8`` tensor, the bytes that really cross the
network (the methods all-gather them as uint8), and decodes it back from those bytes plus the tensor shape,
which every rank knows. Anything else the receiver needs (bucket scales) travels inside the bytes, so
``payload_nbytes(shape)`` is the exact size on the wire and lets a receiver split a gathered buffer.

Building blocks, each usable alone:

- cast: the fp16 / bf16 / fp32 dtypes OpenDiLoCo's all-reduce sums in (``CAST_DTYPES``)
- int-k quantization: per-bucket max-abs scaling, symmetric levels, k in {2, 4, 8}, packed into bytes
- random sparsification: a deterministic rotating strided mask every rank derives alone (CocktailSGD)
- top-k selection with compact index encoding
- low rank: PowerSGD's warm-started power iteration, and the spectral-energy rank estimator DiLoCoX adapts with
- error feedback: what compression dropped, added back to the next tensor

and the two composites the methods use, each with ``encode(x, step)``, ``decode(payload, shape, step)`` and
``payload_nbytes(shape)``: ``SparseQuantizeCompressor`` (CocktailSGD) and ``LowRankQuantizeCompressor`` (DiLoCoX's
C_Q o C_L).

Everything stays in torch on the tensor's device. Multi-byte layouts are built from shifts and masks, so the bytes
do not depend on the host's endianness (fp16/fp32 values excepted: raw little-endian memory wherever this runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

CastDtype = Literal["fp16", "bf16", "fp32"]

# Plain casts: OpenDiLoCo sends its pseudo-gradients as fp16, summed on the wire in that dtype.
CAST_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_SUPPORTED_BITS = (2, 4, 8)
_FP16_MAX = 65504.0
_FP32_BYTES = 4

Shape = torch.Size | tuple[int, ...]


# ----------------------------------------------------------------------------------------------------------
# Validation shared by the functions and the constructors
# ----------------------------------------------------------------------------------------------------------


def _check_bits(bits: int | None, allow_none: bool = False) -> None:
    if bits is None and allow_none:
        return
    if bits not in _SUPPORTED_BITS:
        options = "2, 4, 8 or None (fp32 values)" if allow_none else "2, 4, 8"
        raise ValueError(f"bits must be one of {options}; got {bits}")


def validate_quantization_flags(bits: int | None, bucket_size: int, allow_fp32: bool = False) -> None:
    """A method's --bits and --bucket-size, checked with the flags' names (None: fp32 values, where allowed)."""
    if bits not in (*_SUPPORTED_BITS, *((None,) if allow_fp32 else ())):
        options = "2, 4, 8 or none (fp32 values)" if allow_fp32 else "2, 4, 8"
        raise ValueError(f"--bits must be one of {options}; got {bits}")
    if bucket_size < 1:
        raise ValueError(f"--bucket-size must be at least 1, got {bucket_size}")


def _check_ratio(name: str, ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"{name} must be in (0, 1]; got {ratio}")


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")


def _as_dtype(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the uint8 bytes ``buf`` as ``dtype``.

    A slice of a gathered buffer can start at an offset that is not a multiple of the item size, which
    ``Tensor.view(dtype)`` refuses; such a slice is copied first.
    """
    buf = buf.contiguous()
    if buf.storage_offset() % dtype.itemsize:
        buf = buf.clone()
    return buf.view(dtype)


# ----------------------------------------------------------------------------------------------------------
# Int-k quantization
# ----------------------------------------------------------------------------------------------------------


def quantized_nbytes(numel: int, bits: int, bucket_size: int = 128) -> int:
    """Bytes of a quantized ``numel``-element tensor: the packed codes plus one fp16 scale per bucket."""
    return math.ceil(numel * bits / 8) + 2 * math.ceil(numel / bucket_size)


@dataclass
class Quantized:
    """A tensor quantized by ``quantize``: ``bits``-bit codes packed into bytes, one fp16 scale per bucket.

    Code i of a byte sits at bits ``i * bits`` and up (low bits first). ``to_bytes`` lays out the packed codes
    followed by the scales' bytes: that is what goes on the wire.
    """

    packed: torch.Tensor  # uint8, ceil(numel * bits / 8) bytes
    scales: torch.Tensor  # float16, one per bucket: the bucket's max-abs, rounded up to fp16
    numel: int
    bits: int
    bucket_size: int

    def to_bytes(self) -> torch.Tensor:
        """The wire payload, ``quantized_nbytes(numel, bits, bucket_size)`` long."""
        return torch.cat([self.packed, self.scales.contiguous().view(torch.uint8)])

    @classmethod
    def from_bytes(cls, buf: torch.Tensor, numel: int, bits: int, bucket_size: int = 128) -> Quantized:
        """Inverse of ``to_bytes``, given the ``numel``, ``bits`` and ``bucket_size`` it was made with."""
        _check_bits(bits)
        expected = quantized_nbytes(numel, bits, bucket_size)
        if buf.numel() != expected:
            raise ValueError(f"a {numel}-element {bits}-bit payload is {expected} bytes; got {buf.numel()}")
        n_packed = math.ceil(numel * bits / 8)
        return cls(buf[:n_packed], _as_dtype(buf[n_packed:], torch.float16), numel, bits, bucket_size)


def _levels(bits: int) -> int:
    """L = 2^(bits-1) - 1: codes stand for the symmetric integer levels -L..L (3, 15 or 255 of them)."""
    return 2 ** (bits - 1) - 1


def _fp16_ceil(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 ``x`` rounded up to a float16.

    Rounding up keeps a stored scale at or above the max-abs it stands for, so no code is ever clipped and the
    error bound holds with the stored scale. Values beyond the fp16 range saturate at 65504 (and get clipped).
    """
    x = x.clamp(max=_FP16_MAX)
    h = x.to(torch.float16)
    # Non-negative fp16 values are ordered like their bit patterns, so +1 on the bits is the next float16 up.
    bumped = (h.view(torch.int16) + 1).view(torch.float16)
    return torch.where(h.to(torch.float32) < x, bumped, h)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (each < 2^bits) into bytes, ``8 // bits`` per byte, low bits first."""
    per_byte = 8 // bits
    codes = torch.nn.functional.pad(codes, (0, -codes.numel() % per_byte)).view(-1, per_byte)
    packed = codes[:, 0].clone()
    for i in range(1, per_byte):
        packed |= codes[:, i] << (i * bits)
    return packed


def _unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of ``_pack``: the first ``numel`` codes, as uint8."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(1) >> shifts) & (2**bits - 1)
    return codes.reshape(-1)[:numel]


def quantize(
    x: torch.Tensor,
    bits: int,
    bucket_size: int = 128,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> Quantized:
    """Quantize ``x`` (flattened) to ``bits`` in {2, 4, 8} with symmetric per-bucket max-abs scaling.

    The flat tensor is cut into buckets of ``bucket_size`` elements (the last one may be shorter). A bucket's
    scale s is its max |x| rounded up to float16. Each element becomes the level q in -L..L,
    L = 2^(bits-1) - 1, nearest to x * L / s, and decodes to q * s / L: round-to-nearest errs by at most
    s / L / 2 per element, and an all-zero bucket is exact. ``stochastic=True`` instead rounds up or down with
    probability given by the distance (unbiased, error < s / L), drawing from ``generator``. A code is stored
    as q + L, which fits in ``bits`` bits (2-bit uses three of its four codes).
    """
    _check_bits(bits)
    _check_positive("bucket_size", bucket_size)
    flat = x.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    buckets = torch.nn.functional.pad(flat, (0, -numel % bucket_size)).view(-1, bucket_size)
    scales = _fp16_ceil(buckets.abs().amax(dim=1))
    level = _levels(bits)
    s = scales.to(torch.float32).unsqueeze(1)
    # An all-zero bucket has scale 0; dividing by 1 there keeps its codes at level 0 rather than NaN.
    y = buckets * (level / torch.where(s > 0, s, torch.ones_like(s)))
    if stochastic:
        y = torch.floor(y + torch.rand(y.shape, generator=generator, device=y.device))
    else:
        y = torch.round(y)
    codes = (y.clamp(-level, level) + level).to(torch.uint8).reshape(-1)[:numel]
    return Quantized(_pack(codes, bits), scales, numel, bits, bucket_size)


def dequantize(q: Quantized, shape: Shape) -> torch.Tensor:
    """Inverse of ``quantize`` up to its rounding: a float32 tensor of ``shape`` (``q.numel`` elements)."""
    if math.prod(shape) != q.numel:
        raise ValueError(f"shape {tuple(shape)} does not hold the {q.numel} quantized elements")
    level = _levels(q.bits)
    codes = _unpack(q.packed, q.bits, q.numel).to(torch.float32) - level
    per_element = q.scales.to(torch.float32).repeat_interleave(q.bucket_size)[: q.numel]
    return (codes * per_element / level).reshape(shape)


def _values_nbytes(numel: int, bits: int | None, bucket_size: int) -> int:
    """Bytes for ``numel`` values quantized to ``bits``, or sent as fp32 when ``bits`` is None."""
    return _FP32_BYTES * numel if bits is None else quantized_nbytes(numel, bits, bucket_size)


def _encode_values(x: torch.Tensor, bits: int | None, bucket_size: int) -> torch.Tensor:
    if bits is None:
        return x.detach().reshape(-1).to(torch.float32).contiguous().view(torch.uint8)
    return quantize(x, bits, bucket_size).to_bytes()


def _decode_values(buf: torch.Tensor, bits: int | None, bucket_size: int, shape: Shape) -> torch.Tensor:
    if bits is None:
        return _as_dtype(buf, torch.float32).reshape(shape)
    return dequantize(Quantized.from_bytes(buf, math.prod(shape), bits, bucket_size), shape)


# ----------------------------------------------------------------------------------------------------------
# Random sparsification (CocktailSGD)
# ----------------------------------------------------------------------------------------------------------


def _mix64(value: int) -> int:
    """SplitMix64 finaliser: a well-spread 64-bit hash that, unlike ``hash()``, agrees across processes."""
    z = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def mask_stride(keep_ratio: float) -> int:
    """Stride of the random mask: every ``round(1 / keep_ratio)``-th coordinate is kept (0.3 keeps 1/3)."""
    _check_ratio("keep_ratio", keep_ratio)
    return max(1, round(1 / keep_ratio))


def mask_size(numel: int, keep_ratio: float) -> int:
    """How many coordinates ``random_mask_indices`` keeps: ceil(numel / stride), the same at every step."""
    return math.ceil(numel / mask_stride(keep_ratio))


def random_mask_indices(
    numel: int, keep_ratio: float, step: int, seed: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Coordinates CocktailSGD's random sparsification keeps at ``step``: every stride-th, from an offset.

    stride = round(1 / keep_ratio) and offset = (hash(seed) + step) % stride, so every rank that knows
    ``step`` and ``seed`` selects the same coordinates without exchanging anything, the mask moves by one
    coordinate each step, and any ``stride`` consecutive steps together cover every coordinate once.

    The ``ceil(numel / stride)`` indices are offset, offset + stride, ... taken modulo ``numel``. The wrap
    keeps the count (so the payload size) the same at every step, and never repeats an index because the
    span stride * (count - 1) is below ``numel``. Returns a LongTensor on ``device``, increasing until the
    wrap.
    """
    stride = mask_stride(keep_ratio)
    offset = (_mix64(seed) + step) % stride
    count = math.ceil(numel / stride)
    return (offset + stride * torch.arange(count, device=device)) % max(numel, 1)


# ----------------------------------------------------------------------------------------------------------
# Top-k and index encoding
# ----------------------------------------------------------------------------------------------------------


def topk_count(numel: int, ratio: float) -> int:
    """How many of ``numel`` values top-k keeps: round(ratio * numel), at least one of a non-empty tensor."""
    _check_ratio("ratio", ratio)
    return min(numel, max(1, round(ratio * numel)))


def topk_select(values: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk_count(values.numel(), ratio)`` entries of flattened ``values`` with the largest magnitude.

    Returns (their positions in the flattened tensor as a LongTensor, their values), in no particular order.
    """
    flat = values.reshape(-1)
    positions = torch.topk(flat.abs(), topk_count(flat.numel(), ratio), sorted=False).indices
    return positions, flat[positions]


def index_width(numel: int) -> int:
    """Bytes per position into a ``numel``-element tensor: 1 up to 2^8 elements, 2 up to 2^16, else 4."""
    if numel > 2**32:
        raise ValueError(f"positions are encoded in at most 4 bytes, so numel must be <= 2^32; got {numel}")
    return 1 if numel <= 2**8 else 2 if numel <= 2**16 else 4


def encode_indices(positions: torch.Tensor, numel: int) -> torch.Tensor:
    """Positions into a ``numel``-element tensor as ``index_width(numel)`` little-endian bytes each."""
    p = positions.reshape(-1, 1).to(torch.int64)
    shifts = 8 * torch.arange(index_width(numel), device=p.device)
    return ((p >> shifts) & 0xFF).to(torch.uint8).reshape(-1)


def decode_indices(buf: torch.Tensor, count: int, numel: int) -> torch.Tensor:
    """Inverse of ``encode_indices``: ``count`` positions into a ``numel``-element tensor, as a LongTensor."""
    width = index_width(numel)
    if buf.numel() != count * width:
        raise ValueError(f"{count} positions of width {width} are {count * width} bytes; got {buf.numel()}")
    shifts = 8 * torch.arange(width, device=buf.device)
    return (buf.reshape(count, width).to(torch.int64) << shifts).sum(dim=1)


# ----------------------------------------------------------------------------------------------------------
# Low rank (PowerSGD iteration, DiLoCoX rank estimator)
# ----------------------------------------------------------------------------------------------------------


def matrix_shape(shape: Shape) -> tuple[int, int]:
    """Tensors of two or more dimensions are compressed as the matrix (shape[0], everything else)."""
    return shape[0], math.prod(shape[1:])


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
    _check_positive("rank", rank)
    _check_positive("iterations", iterations)
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
    return _values_nbytes(m * r, bits, bucket_size) + _values_nbytes(n * r, bits, bucket_size)


def estimate_rank(x2d: torch.Tensor, energy: float = 0.9) -> int:
    """DiLoCoX's adaptive-rank estimator: the smallest r whose top-r singular values hold ``energy``.

    The share is of the squared Frobenius norm, sum(sigma_i^2) over torch.linalg.svdvals, so ``energy=0.9``
    asks for the rank that keeps 90% of the matrix's energy. A zero matrix gets rank 1, the smallest rank a
    compressor accepts.
    """
    _check_ratio("energy", energy)
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


# ----------------------------------------------------------------------------------------------------------
# Error feedback and error measurement
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ErrorFeedback:
    """What compression dropped from a tensor, added to the next tensor with the same key.

    Per key (e.g. parameter name): ``c = compensate(key, x)``, transmit ``t = decode(encode(c))``, then
    ``update(key, c, t)``. The residual is c - t, so after inputs x_1..x_T,
    sum(t_i) + residuals[key] == sum(x_i): nothing is lost, only delayed.
    """

    residuals: dict[str, torch.Tensor] = field(default_factory=dict)

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the residual kept under ``key`` (``x`` itself the first time)."""
        residual = self.residuals.get(key)
        return x if residual is None else x + residual

    def update(self, key: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """Keep what ``transmitted`` (the decoded payload) missed of ``compensated`` as ``key``'s residual."""
        self.residuals[key] = (compensated - transmitted).detach()


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """||x_hat - x|| / ||x|| (Frobenius), computed in float64; 0 when ``x`` is all zero."""
    x64 = x.detach().to(torch.float64)
    norm = torch.linalg.vector_norm(x64)
    if norm == 0:
        return 0.0
    return float(torch.linalg.vector_norm(x_hat.detach().to(torch.float64) - x64) / norm)


# ----------------------------------------------------------------------------------------------------------
# Composite compressors: what the methods use
# ----------------------------------------------------------------------------------------------------------


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
        _check_ratio("random_keep", self.random_keep)
        _check_ratio("topk_keep", self.topk_keep)
        _check_bits(self.bits, allow_none=True)
        _check_positive("bucket_size", self.bucket_size)

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
        return torch.cat([position_bytes, _encode_values(values, self.bits, self.bucket_size)])

    def decode(self, payload: torch.Tensor, shape: torch.Size, step: int) -> torch.Tensor:
        numel = math.prod(shape)
        masked, kept, position_nbytes = self._layout(numel)
        values = _decode_values(payload[position_nbytes:], self.bits, self.bucket_size, (kept,))
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
        return position_nbytes + _values_nbytes(kept, self.bits, self.bucket_size)


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
        _check_bits(bits, allow_none=True)
        _check_positive("bucket_size", bucket_size)
        _check_positive("power_iterations", power_iterations)
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
        _check_positive("rank", rank)
        self._rank = rank

    def _factored(self, shape: Shape) -> bool:
        return goes_as_factors(shape, self.rank)

    def encode(self, x: torch.Tensor, step: int, key: str | None = None) -> torch.Tensor:
        if not self._factored(x.shape):
            return _encode_values(x, self.bits, self.bucket_size)
        matrix = x.reshape(matrix_shape(x.shape))
        p, q = low_rank(matrix, self.rank, self.warm_start(key, x.shape), self.seed, self.power_iterations)
        if key is not None:
            self._warm_q[key] = q
        return torch.cat([_encode_values(f, self.bits, self.bucket_size) for f in (p, q)])

    def warm_start(self, key: str | None, shape: Shape) -> torch.Tensor | None:
        """The Q [n, r] that ``key``'s next power iteration starts from at the current rank (``resized_basis``), or
        None (cold start)."""
        q = self._warm_q.get(key) if key is not None else None
        return resized_basis(q, shape, self.rank, self.seed)

    def decode(self, payload: torch.Tensor, shape: torch.Size, step: int) -> torch.Tensor:
        if not self._factored(shape):
            return _decode_values(payload, self.bits, self.bucket_size, shape)
        m, n = matrix_shape(shape)
        r = min(self.rank, m, n)
        p_nbytes = _values_nbytes(m * r, self.bits, self.bucket_size)
        p = _decode_values(payload[:p_nbytes], self.bits, self.bucket_size, (m, r))
        q = _decode_values(payload[p_nbytes:], self.bits, self.bucket_size, (n, r))
        return (p @ q.T).reshape(shape)

    def payload_nbytes(self, shape: torch.Size) -> int:
        if not self._factored(shape):
            return _values_nbytes(math.prod(shape), self.bits, self.bucket_size)
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
