"""Tests for trainers/compression.py: byte layouts, error bounds, payload sizes and the shared random mask."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers.compression import (
    ErrorFeedback,
    LowRankQuantizeCompressor,
    Quantized,
    SparseQuantizeCompressor,
    decode_indices,
    dequantize,
    encode_indices,
    estimate_rank,
    low_rank,
    low_rank_nbytes,
    quantize,
    quantized_nbytes,
    random_mask_indices,
    relative_error,
    topk_select,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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


# --------------------------------------------------------------------------------------------------------
# Random mask
# --------------------------------------------------------------------------------------------------------

_MASK_SCRIPT = "from trainers.compression import random_mask_indices as m; print(m(1003, 0.1, 42, seed=7).tolist())"


def test_random_mask_is_the_same_on_every_rank() -> None:
    here = random_mask_indices(1003, 0.1, step=42, seed=7)
    assert torch.equal(here, random_mask_indices(1003, 0.1, step=42, seed=7))
    # A fresh interpreter with a different string-hash seed stands in for another rank.
    repo = Path(__file__).resolve().parents[2]
    fresh = subprocess.run(
        [sys.executable, "-c", _MASK_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        cwd=repo,
        env={**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(repo)},
    )
    assert json.loads(fresh.stdout) == here.tolist()


def test_random_mask_rotates_and_covers_every_coordinate() -> None:
    numel, keep = 1003, 0.1
    stride = 10
    masks = [random_mask_indices(numel, keep, step) for step in range(17, 17 + stride)]
    for mask in masks:
        assert mask.dtype == torch.int64
        assert mask.numel() == math.ceil(numel / stride)  # same size at every step: payload size is fixed
        assert mask.unique().numel() == mask.numel()
        assert mask.min() >= 0 and mask.max() < numel
    assert not torch.equal(masks[0], masks[1])
    assert torch.equal(torch.cat(masks).unique(), torch.arange(numel))
    assert abs(masks[0].numel() / numel - keep) < 0.01


def test_random_mask_depends_on_seed_and_handles_tiny_tensors() -> None:
    offsets = {int(random_mask_indices(1000, 0.1, step=0, seed=seed)[0]) for seed in range(10)}
    assert len(offsets) > 1
    # Fewer elements than the stride: one coordinate a step, still covering everything over `stride` steps.
    tiny = [random_mask_indices(3, 0.1, step) for step in range(10)]
    assert all(m.numel() == 1 for m in tiny)
    assert torch.cat(tiny).unique().tolist() == [0, 1, 2]


# --------------------------------------------------------------------------------------------------------
# Top-k and index encoding
# --------------------------------------------------------------------------------------------------------


def test_topk_picks_largest_magnitudes() -> None:
    values = _randn(1000, seed=4)
    positions, kept = topk_select(values, 0.05)
    assert positions.dtype == torch.int64 and positions.numel() == 50
    expected = values.abs().argsort(descending=True)[:50]
    assert set(positions.tolist()) == set(expected.tolist())
    assert torch.equal(kept, values[positions])
    assert kept.abs().min() >= values.abs().sort(descending=True).values[50]


@pytest.mark.parametrize(
    ("numel", "width"), [(200, 1), (256, 1), (50_000, 2), (2**16, 2), (2**16 + 1, 4), (300_000, 4)]
)
def test_index_encoding_round_trip(numel: int, width: int) -> None:
    generator = torch.Generator().manual_seed(numel)
    positions = torch.cat([torch.randint(numel, (100,), generator=generator), torch.tensor([0, numel - 1])])
    buf = encode_indices(positions, numel)
    assert buf.dtype == torch.uint8 and buf.numel() == positions.numel() * width
    assert torch.equal(decode_indices(buf, positions.numel(), numel), positions)


# --------------------------------------------------------------------------------------------------------
# Composite compressors: sizes, splitting a gathered buffer
# --------------------------------------------------------------------------------------------------------

COMPRESSORS = {
    # Both sparsification stages off: the whole tensor quantized, as ``quantize(x).to_bytes()``.
    "quant-2": SparseQuantizeCompressor(random_keep=1.0, topk_keep=1.0, bits=2),
    "quant-4-bucket-50": SparseQuantizeCompressor(random_keep=1.0, topk_keep=1.0, bits=4, bucket_size=50),
    "quant-8": SparseQuantizeCompressor(random_keep=1.0, topk_keep=1.0, bits=8),
    "sparse-default": SparseQuantizeCompressor(),
    "sparse-random-only": SparseQuantizeCompressor(random_keep=0.3, topk_keep=1.0, bits=None),
    "sparse-topk-only": SparseQuantizeCompressor(random_keep=1.0, topk_keep=0.1, bits=8),
    "sparse-off": SparseQuantizeCompressor(random_keep=1.0, topk_keep=1.0, bits=None),
    "lowrank-4": LowRankQuantizeCompressor(rank=4),
    "lowrank-fp32": LowRankQuantizeCompressor(rank=3, bits=None),
    "lowrank-2bit-bucket-7": LowRankQuantizeCompressor(rank=2, bits=2, bucket_size=7),
}
# Odd sizes, 1-D, 2-D and 3-D; 70_000 elements puts the sparse index width at 2 bytes, 700_000 at 4.
SHAPES = [(1,), (7,), (1000,), (33, 17), (128, 3, 5), (2, 300), (70_000,), (700, 1000)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_payload_nbytes_matches_encode(name: str, device: str) -> None:
    compressor = COMPRESSORS[name]
    for i, shape in enumerate(SHAPES):
        x = _randn(*shape, seed=i).to(device)
        payload = compressor.encode(x, 5)
        assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.device == x.device
        assert payload.numel() == compressor.payload_nbytes(torch.Size(shape)), shape
        x_hat = compressor.decode(payload, torch.Size(shape), 5)
        assert x_hat.dtype == torch.float32 and x_hat.shape == shape and x_hat.device == x.device


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_gathered_buffer_splits_by_payload_nbytes(name: str) -> None:
    # What a method does: concatenate several tensors' payloads, send, split by the known sizes, decode.
    compressor = COMPRESSORS[name]
    tensors = [_randn(*shape, seed=i) for i, shape in enumerate([(33, 17), (7,), (128, 3, 5)])]
    payloads = [compressor.encode(t, 3) for t in tensors]
    sizes = [compressor.payload_nbytes(t.shape) for t in tensors]
    for t, payload, part in zip(tensors, payloads, torch.cat(payloads).split(sizes), strict=True):
        assert torch.equal(compressor.decode(part, t.shape, 3), compressor.decode(payload, t.shape, 3))


@pytest.mark.parametrize("name", ["quant-2", "quant-4-bucket-50", "sparse-off", "lowrank-4", "lowrank-fp32"])
def test_decoding_does_not_depend_on_alignment(name: str) -> None:
    # A slice of a gathered buffer can start at an odd byte offset, where fp16 scales and fp32 values cannot be
    # viewed in place; decoding must give the same tensor there.
    compressor = COMPRESSORS[name]
    x = _randn(33, 17)
    payload = compressor.encode(x, 0)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), payload])[1:]
    assert shifted.storage_offset() == 1
    assert torch.equal(compressor.decode(shifted, x.shape, 0), compressor.decode(payload, x.shape, 0))


@pytest.mark.parametrize(("bits", "bucket_size"), [(2, 128), (4, 50), (8, 128)])
def test_sparse_with_both_stages_off_is_plain_quantization(bits: int, bucket_size: int) -> None:
    compressor = SparseQuantizeCompressor(random_keep=1.0, topk_keep=1.0, bits=bits, bucket_size=bucket_size)
    x = _randn(33, 17)
    payload = compressor.encode(x, 0)
    q = quantize(x, bits, bucket_size)
    assert torch.equal(payload, q.to_bytes())
    assert payload.numel() == compressor.payload_nbytes(x.shape) == quantized_nbytes(x.numel(), bits, bucket_size)
    assert torch.equal(compressor.decode(payload, x.shape, 0), dequantize(q, x.shape))


def test_constructors_validate() -> None:
    with pytest.raises(ValueError, match=r"bits must be one of 2, 4, 8; got 3"):
        quantize(_randn(10), 3)
    with pytest.raises(ValueError, match=r"bits must be one of 2, 4, 8 or None"):
        SparseQuantizeCompressor(bits=3)
    with pytest.raises(ValueError, match=r"random_keep must be in \(0, 1\]; got 0"):
        SparseQuantizeCompressor(random_keep=0)
    with pytest.raises(ValueError, match=r"topk_keep must be in \(0, 1\]; got 1.5"):
        SparseQuantizeCompressor(topk_keep=1.5)
    with pytest.raises(ValueError, match=r"keep_ratio must be in \(0, 1\]"):
        random_mask_indices(100, 0.0, step=0)
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        topk_select(_randn(10), 1.5)
    with pytest.raises(ValueError, match=r"rank must be >= 1; got 0"):
        LowRankQuantizeCompressor(rank=0)
    with pytest.raises(ValueError, match=r"bucket_size must be >= 1; got 0"):
        quantize(_randn(10), 4, bucket_size=0)
    with pytest.raises(ValueError, match=r"bucket_size must be >= 1; got 0"):
        SparseQuantizeCompressor(bucket_size=0)
    with pytest.raises(ValueError, match=r"bucket_size must be >= 1; got 0"):
        LowRankQuantizeCompressor(rank=4, bucket_size=0)
    compressor = LowRankQuantizeCompressor(rank=4)
    with pytest.raises(ValueError, match=r"rank must be >= 1"):
        compressor.rank = 0
    with pytest.raises(ValueError, match=r"1000-element 4-bit payload is 516 bytes; got 515"):
        Quantized.from_bytes(torch.zeros(515, dtype=torch.uint8), 1000, 4, 128)


# --------------------------------------------------------------------------------------------------------
# SparseQuantizeCompressor (CocktailSGD)
# --------------------------------------------------------------------------------------------------------


def test_sparse_all_stages_off_is_exact() -> None:
    compressor = SparseQuantizeCompressor(random_keep=1.0, topk_keep=1.0, bits=None)
    x = _randn(33, 17)
    payload = compressor.encode(x, 0)
    assert payload.numel() == 4 * x.numel()
    assert torch.equal(compressor.decode(payload, x.shape, 0), x)


def test_sparse_defaults_compress_1m_elements_44x() -> None:
    # 1M elements: mask of 100_000, top-k keeps 20_000. Positions into the mask take 4 bytes each (it
    # exceeds 2^16): 80_000 B; values at 4 bits: 10_000 B + 157 fp16 scales = 314 B. 4 MB / 90_314 B = 44.3x.
    compressor = SparseQuantizeCompressor()
    x = _randn(1000, 1000, seed=5)
    payload = compressor.encode(x, 11)
    assert payload.numel() == compressor.payload_nbytes(x.shape) == 90_314
    ratio = 4 * x.numel() / payload.numel()
    assert ratio >= 30 and ratio == pytest.approx(44.29, abs=0.01)

    x_hat = compressor.decode(payload, x.shape, 11).reshape(-1)
    mask = random_mask_indices(x.numel(), 0.1, step=11)
    kept = x_hat.nonzero().squeeze(1)
    assert kept.numel() <= 20_000 and set(kept.tolist()) <= set(mask.tolist())
    # The kept coordinates are the largest of the mask, each within its 4-bit quantization step.
    top_positions, top_values = topk_select(x.reshape(-1)[mask], 0.2)
    assert set(kept.tolist()) <= set(mask[top_positions].tolist())
    assert torch.allclose(x_hat[mask[top_positions]], top_values, atol=top_values.abs().max().item() / 7)
    # Decoding with another step's mask puts the values elsewhere: the step really is part of the code.
    assert not torch.equal(compressor.decode(payload, x.shape, 12), compressor.decode(payload, x.shape, 11))


# --------------------------------------------------------------------------------------------------------
# Error feedback
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sparse-default", "quant-2", "lowrank-4"])
def test_error_feedback_conserves_signal(name: str) -> None:
    compressor = COMPRESSORS[name]
    feedback = ErrorFeedback()
    shape = torch.Size((64, 50))
    total_in = torch.zeros(shape, dtype=torch.float64)
    total_out = torch.zeros(shape, dtype=torch.float64)
    for step in range(20):
        x = _randn(*shape, seed=100 + step)
        compensated = feedback.compensate("w", x)
        transmitted = compressor.decode(compressor.encode(compensated, step), shape, step)
        feedback.update("w", compensated, transmitted)
        total_in += x
        total_out += transmitted
    residual = feedback.residuals["w"].double()
    assert residual.norm() > 0.1 * total_in.norm()  # the compressor really is lossy
    assert torch.allclose(total_out + residual, total_in, atol=1e-5 * total_in.abs().max().item())


def test_error_feedback_keys_are_independent() -> None:
    feedback = ErrorFeedback()
    feedback.update("a", torch.ones(3), torch.zeros(3))
    assert torch.equal(feedback.compensate("a", torch.ones(3)), torch.full((3,), 2.0))
    assert torch.equal(feedback.compensate("b", torch.ones(3)), torch.ones(3))


def test_relative_error() -> None:
    assert relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0])) == pytest.approx(0.8)
    assert relative_error(torch.zeros(5), torch.zeros(5)) == 0.0


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
