"""Sparsification (trainers/compression/sparsify.py): the shared random mask, top-k, index encoding."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers.compression.sparsify import decode_indices, encode_indices, random_mask_indices, topk_select


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------------
# Random mask
# --------------------------------------------------------------------------------------------------------

_MASK_SCRIPT = (
    "from trainers.compression.sparsify import random_mask_indices as m; print(m(1003, 0.1, 42, seed=7).tolist())"
)


def test_random_mask_is_the_same_on_every_rank() -> None:
    here = random_mask_indices(1003, 0.1, step=42, seed=7)
    assert torch.equal(here, random_mask_indices(1003, 0.1, step=42, seed=7))
    # A fresh interpreter with a different string-hash seed stands in for another rank.
    repo = Path(__file__).resolve().parents[3]
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
