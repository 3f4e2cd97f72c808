"""Quantization: int-k codes with per-bucket max-abs scaling (CocktailSGD, DiLoCoX, the int8/int4 wires of the
quantized ring), and the statistical quantizer with a per-tensor lookup table (SparseLoCo)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainers.compression.bitpack import pack_bits, unpack_bits
from trainers.compression.checks import check_positive
from trainers.compression.shapes import Shape

SUPPORTED_BITS = (2, 4, 8)
_FP16_MAX = 65504.0
_FP32_BYTES = 4


def check_bits(bits: int | None, allow_none: bool = False) -> None:
    if bits is None and allow_none:
        return
    if bits not in SUPPORTED_BITS:
        options = "2, 4, 8 or None (fp32 values)" if allow_none else "2, 4, 8"
        raise ValueError(f"bits must be one of {options}; got {bits}")


def validate_quantization_flags(bits: int | None, bucket_size: int, allow_fp32: bool = False) -> None:
    """A method's --bits and --bucket-size, checked with the flags' names (None: fp32 values, where allowed)."""
    if bits not in (*SUPPORTED_BITS, *((None,) if allow_fp32 else ())):
        options = "2, 4, 8 or none (fp32 values)" if allow_fp32 else "2, 4, 8"
        raise ValueError(f"bits must be one of {options}; got {bits}")
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be at least 1, got {bucket_size}")


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

    Code i of a byte sits at bits ``i * bits`` and up (low bits first, ``pack_bits``). ``to_bytes`` lays out the
    packed codes followed by the scales' bytes: that is what goes on the wire.
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
        check_bits(bits)
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
    check_bits(bits)
    check_positive("bucket_size", bucket_size)
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
    return Quantized(pack_bits(codes, bits), scales, numel, bits, bucket_size)


def dequantize(q: Quantized, shape: Shape) -> torch.Tensor:
    """Inverse of ``quantize`` up to its rounding: a float32 tensor of ``shape`` (``q.numel`` elements)."""
    if math.prod(shape) != q.numel:
        raise ValueError(f"shape {tuple(shape)} does not hold the {q.numel} quantized elements")
    level = _levels(q.bits)
    codes = unpack_bits(q.packed, q.bits, q.numel).to(torch.float32) - level
    per_element = q.scales.to(torch.float32).repeat_interleave(q.bucket_size)[: q.numel]
    return (codes * per_element / level).reshape(shape)


def values_nbytes(numel: int, bits: int | None, bucket_size: int) -> int:
    """Bytes for ``numel`` values quantized to ``bits``, or sent as fp32 when ``bits`` is None."""
    return _FP32_BYTES * numel if bits is None else quantized_nbytes(numel, bits, bucket_size)


def encode_values(x: torch.Tensor, bits: int | None, bucket_size: int) -> torch.Tensor:
    if bits is None:
        return x.detach().reshape(-1).to(torch.float32).contiguous().view(torch.uint8)
    return quantize(x, bits, bucket_size).to_bytes()


def decode_values(buf: torch.Tensor, bits: int | None, bucket_size: int, shape: Shape) -> torch.Tensor:
    if bits is None:
        return _as_dtype(buf, torch.float32).reshape(shape)
    return dequantize(Quantized.from_bytes(buf, math.prod(shape), bits, bucket_size), shape)


# ----------------------------------------------------------------------------------------------------------
# Statistical quantization (SparseLoCo)
# ----------------------------------------------------------------------------------------------------------


def quantize_statistical(values: torch.Tensor, bits: int, range_sigmas: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The SparseLoCo reference's statistical quantizer over a tensor's selected ``values``.

    shift = mean(v), sigma = ||v - shift|| / sqrt(n - 1), scale = ``range_sigmas`` sigma / 2^b (1 where that is 0
    or not finite), code = clamp(round((v - shift) / scale + 2^(b-1)), 0, 2^b - 1). Returns (codes, as a LongTensor
    shaped like ``values``; [shift, lookup_0 .. lookup_{2^b - 1}], fp32), where lookup holds each code's mean of
    v - shift (0 for an empty code): the table's mean-per-code decoding errs less than the code's centre would on
    skewed values.
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
