"""The collectives of trainers/comm.py that are not gloo's own: the quantized ring, in three real processes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.trainers.spawn import run_ranks
from trainers.comm import quantized_ring_payload_bytes, quantized_ring_sum, ring_chunk_numel
from trainers.compression import quantized_nbytes

WORLD = 3


def _ring_scenario(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    # Not a multiple of n x bucket, and the buckets' scales differ by 1,000x: each bucket is quantized on its own.
    flat = torch.cat([torch.randn(300, generator=g), 1e-3 * torch.randn(200, generator=g)])
    return {"flat": flat, "sum": quantized_ring_sum(flat, dist.group.WORLD, 8, 128)}


def test_the_quantized_ring_sums_to_the_same_bytes_everywhere(tmp_path):
    results = run_ranks(_ring_scenario, (), tmp_path, WORLD)
    exact = sum(r["flat"] for r in results)
    for r in results:
        torch.testing.assert_close(r["sum"], results[0]["sum"], rtol=0, atol=0)
    # n roundings, each at most half a level of its bucket's scale (the bucket's max |partial sum| / 127).
    error = (results[0]["sum"] - exact).abs()
    assert error[:256].max() < WORLD * 0.5 * 3 * 4.0 / 127
    assert error[384:].max() < WORLD * 0.5 * 3 * 4e-3 / 127
    assert error.max() > 0  # it is quantized


def test_the_quantized_ring_sends_2_n_minus_1_chunks():
    assert ring_chunk_numel(500, 3, 128) == 256
    assert quantized_ring_payload_bytes(500, 3, 8, 128) == 2 * 2 * quantized_nbytes(256, 8, 128)
    assert quantized_ring_payload_bytes(500, 1, 8, 128) == 0
    alone = torch.arange(5.0)
    assert torch.equal(quantized_ring_sum(alone, None, 8), alone)  # one rank: nothing travels, nothing rounds
