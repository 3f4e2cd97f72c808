"""The composite compressors (trainers/compression/compressors.py): payload sizes, splitting a gathered buffer,
CocktailSGD's chain, argument checks, and error feedback conserving what they drop."""

from __future__ import annotations

import pytest
import torch

from trainers.compression.compressors import LowRankQuantizeCompressor, SparseQuantizeCompressor
from trainers.compression.error_feedback import ErrorFeedback, relative_error
from trainers.compression.quantize import Quantized, dequantize, quantize, quantized_nbytes
from trainers.compression.sparsify import random_mask_indices, topk_select

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


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
