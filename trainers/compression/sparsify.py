"""Sparsification: CocktailSGD's deterministic rotating random mask, top-k selection, and the compact encoding of
the positions kept."""

from __future__ import annotations

import math

import torch

from trainers.compression.checks import check_ratio

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
    check_ratio("keep_ratio", keep_ratio)
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
    check_ratio("ratio", ratio)
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
