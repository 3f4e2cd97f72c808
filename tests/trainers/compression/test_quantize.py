"""Int-k quantization (trainers/compression/quantize.py): byte layout, error bounds, stochastic rounding."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.compression.error_feedback import relative_error
from trainers.compression.quantize import Quantized, dequantize, quantize, quantized_nbytes


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------------
# Int-k quantization
# --------------------------------------------------------------------------------------------------------


def _bucketed_data() -> torch.Tensor:
    """1000 values: 7 full buckets of 128 at very different scales, bucket 2 all zero, a 104-element tail."""
    x = _randn(1000, seed=1)
    x *= torch.logspace(-4, 2, 8).repeat_interleave(128)[:1000]
    x[256:384] = 0.0
    return x


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_round_trip_and_error_bound(bits: int) -> None:
    x = _bucketed_data()
    q = quantize(x, bits, bucket_size=128)
    level = 2 ** (bits - 1) - 1

    assert q.packed.dtype == torch.uint8 and q.packed.numel() == math.ceil(1000 * bits / 8)
    assert q.scales.dtype == torch.float16 and q.scales.numel() == 8  # 7 full buckets + the tail
    wire = q.to_bytes()
    assert wire.dtype == torch.uint8 and wire.numel() == quantized_nbytes(1000, bits, 128)

    x_hat = dequantize(q, x.shape)
    again = dequantize(Quantized.from_bytes(wire, 1000, bits, 128), x.shape)
    assert torch.equal(x_hat, again)

    # The stored scale is the bucket's max-abs rounded up, and bounds the error of every element of it.
    scale = q.scales.float().repeat_interleave(128)[:1000]
    max_abs = x.abs().view(-1).split(128)
    assert all(s >= m.max() for s, m in zip(q.scales.float(), max_abs, strict=True))
    assert torch.all((x - x_hat).abs() <= scale / level / 2 * (1 + 1e-6))
    assert torch.all(x_hat[256:384] == 0)
    # Decoded values sit exactly on the levels -L..L of their bucket.
    on_level = x_hat / scale * level
    nonzero = scale > 0
    assert torch.allclose(on_level[nonzero], on_level[nonzero].round(), atol=1e-4)


def test_quantize_4bit_size_example() -> None:
    # 1000 values at 4 bits: two per byte = 500 bytes, plus 8 fp16 scales.
    q = quantize(_randn(1000), 4)
    assert q.packed.numel() == 500
    assert q.to_bytes().numel() == quantized_nbytes(1000, 4, 128) == 500 + 16


def test_quantize_byte_layout() -> None:
    # 2 bits: L = 1, codes q + 1; [1, -1, 0, 1] -> codes 2, 0, 1, 2 packed low bits first into one byte.
    q = quantize(torch.tensor([1.0, -1.0, 0.0, 1.0]), 2)
    assert q.packed.tolist() == [2 | 0 << 2 | 1 << 4 | 2 << 6]
    assert q.scales.tolist() == [1.0]
    # 4 bits: L = 7; [-1, 1, 0] -> codes 0, 14, 7 -> bytes 0 | 14 << 4 and 7 (padded).
    assert quantize(torch.tensor([-1.0, 1.0, 0.0]), 4).packed.tolist() == [14 << 4, 7]


# Measured on 100k standard-normal values, bucket 128: 8-bit 0.0065, 4-bit 0.118, 2-bit 0.770. Two bits
# with symmetric levels -1, 0, 1 zero every value below half the bucket's max, hence the large 2-bit error.
@pytest.mark.parametrize(("bits", "bound"), [(8, 0.01), (4, 0.15), (2, 0.85)])
def test_quantize_relative_error_on_gaussian(bits: int, bound: float) -> None:
    x = _randn(100_000, seed=2)
    assert relative_error(x, dequantize(quantize(x, bits), x.shape)) < bound


def test_stochastic_rounding_is_unbiased_and_within_one_level() -> None:
    x = _randn(1024, seed=3)
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([dequantize(quantize(x, 4, stochastic=True, generator=generator), x.shape) for _ in range(400)])
    step = quantize(x, 4).scales.float().repeat_interleave(128) / 7
    assert torch.all((draws - x).abs() < step * (1 + 1e-6))
    # Each draw errs by under one level; the mean of 400 unbiased draws lands within a fraction of one.
    assert torch.all((draws.mean(dim=0) - x).abs() < 0.2 * step)
    assert (draws != draws[0]).any()


def test_quantize_empty_tensor() -> None:
    q = quantize(torch.empty(0), 4)
    assert q.to_bytes().numel() == 0 and dequantize(q, (0,)).numel() == 0
