"""The collectives of trainers/comm.py that are not gloo's own: the quantized ring, in three real processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.trainers.spawn import run_ranks
from trainers.comm import quantized_ring_payload_bytes, quantized_ring_sum, ring_chunk_numel
from trainers.compression.quantize import quantized_nbytes

WORLD = 3


def _ring_scenario(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    # Not a multiple of n x bucket, and the buckets' scales differ by 1,000x: each bucket is quantized on its own.
    flat = torch.cat([torch.randn(300, generator=g), 1e-3 * torch.randn(200, generator=g)])
    out = {"flat": flat}
    for bits in (8, 4):
        out[f"sum{bits}"], out[f"rounding{bits}"] = quantized_ring_sum(flat, dist.group.WORLD, bits, 128)
    return out


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory) -> list[dict]:
    """The ring scenario's results, spawned once for the tests that read them."""
    return run_ranks(_ring_scenario, (), tmp_path_factory.mktemp("ring"), WORLD)


def test_the_quantized_ring_sums_to_the_same_bytes_everywhere(ring_results):
    results = ring_results
    exact = sum(r["flat"] for r in results)
    for bits, level in ((8, 127), (4, 7)):
        for r in results:
            torch.testing.assert_close(r[f"sum{bits}"], results[0][f"sum{bits}"], rtol=0, atol=0)
        # n roundings, each at most half a level of its bucket's scale (the bucket's max |partial sum| / L).
        error = (results[0][f"sum{bits}"] - exact).abs()
        assert error[:256].max() < WORLD * 0.5 * 3 * 4.0 / level
        assert error[384:].max() < WORLD * 0.5 * 3 * 4e-3 / level
        assert error.max() > 0  # it is quantized


def test_each_rank_knows_the_rounding_it_put_on_the_wire(ring_results):
    # Every rounding is made by the rank that sent the codes: together they are all the sum lost.
    results = ring_results
    exact = sum(r["flat"] for r in results)
    for bits in (8, 4):
        lost = exact - results[0][f"sum{bits}"]
        torch.testing.assert_close(sum(r[f"rounding{bits}"] for r in results), lost, rtol=0, atol=1e-6)
        assert all(r[f"rounding{bits}"].abs().max() > 0 for r in results)


def test_the_quantized_ring_sends_2_n_minus_1_chunks():
    assert ring_chunk_numel(500, 3, 128) == 256
    assert quantized_ring_payload_bytes(500, 3, 8, 128) == 2 * 2 * quantized_nbytes(256, 8, 128)
    assert quantized_ring_payload_bytes(500, 1, 8, 128) == 0
    alone = torch.arange(5.0)
    summed, rounding = quantized_ring_sum(alone, None, 8)
    assert torch.equal(summed, alone) and not rounding.any()  # one rank: nothing travels, nothing rounds
