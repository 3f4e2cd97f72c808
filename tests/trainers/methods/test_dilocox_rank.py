"""DiLoCoX's rank adaptation: the estimate is taken on each replica's compressor input (delta + residual) before
compression, averaged over the replicas (its bytes counted), and can bring r back up to r_1; the power iteration's
warm-start Q survives the changes of r."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.trainers.spawn import run_ranks
from trainers.comm import allreduce_payload_bytes
from trainers.compression.compressors import LowRankQuantizeCompressor
from trainers.compression.lowrank import low_rank
from trainers.config import OptimConfig
from trainers.method import MethodContext
from trainers.methods.dilocox import DiLoCoX, DiLoCoXConfig, adapted_schedule

OPTIM = OptimConfig(lr=1e-2, warmup_fraction=0.0, min_lr_ratio=1.0)
M, N = 48, 64  # the synthetic weight matrix


def _known_rank(k: int, seed: int) -> torch.Tensor:
    """An M x N matrix with k equal singular values of 0.05 and no others: its 99%-energy rank is k (k < 100).
    Its singular vectors depend on `seed` and k only: consecutive rounds of one rank share their subspace, as
    consecutive pseudo-gradients share much of theirs."""
    g = torch.Generator().manual_seed(1000 * seed + k)
    u = torch.linalg.qr(torch.randn(M, k, generator=g)).Q
    v = torch.linalg.qr(torch.randn(N, k, generator=g)).Q
    return 0.05 * u @ v.T


def _rounds(ranks: list[int], options: dict, group=None, seed: int = 0) -> list[dict]:
    """One round per entry: the replica's pseudo-gradient of the weight has exactly that rank (the weights are set
    by hand; no gradients, so the inner steps leave them). Blocking, so each round's estimate is used at once."""
    torch.manual_seed(0)
    model = torch.nn.Linear(N, M)
    cfg = DiLoCoXConfig(
        local_steps=1, max_local_steps=100, rank=32, min_rank=2, rank_window=2, energy=0.99, overlap="none",
        **options,
    )  # fmt: skip
    method = DiLoCoX(MethodContext(list(model.named_parameters()), group, None, OPTIM, 100, seed=0), cfg)
    reports = []
    for t, k in enumerate(ranks):
        with torch.no_grad():
            model.weight.copy_(method.global_params[0] - _known_rank(k, seed))
            model.bias.copy_(method.global_params[1])
        for _ in range(method.local_steps):
            report = method.step(t)
        reports.append(report.as_event())
    return reports


TRUE_RANKS = [12] * 4 + [30] * 4 + [48] * 2 + [6] * 3


def test_the_estimate_recovers_the_true_rank_and_r_falls_and_rises():
    """Without compression c is the pseudo-gradient itself: the estimate is exact, and r follows the window both
    ways (the old estimator, on the average of rank-r payloads, could never see more than the r already sent)."""
    reports = _rounds(TRUE_RANKS, {"compression": False})
    assert [r["estimated_rank"] for r in reports] == TRUE_RANKS
    window, expected = [32, 32], []
    for k in TRUE_RANKS:
        window = [*window[1:], k]
        expected.append(
            adapted_schedule(window, DiLoCoXConfig(local_steps=1, max_local_steps=100, rank=32, min_rank=2))
        )
    # Each report carries the r and H of the round it sent, set by the estimates before it.
    assert [(r["rank_r"], r["local_steps_h"]) for r in reports[1:]] == expected[:-1]
    ranks = [r["rank_r"] for r in reports]
    assert min(ranks[:5]) == 12 and max(ranks[5:10]) == 32 and ranks[-1] == 6
    assert max(r["local_steps_h"] for r in reports) == round(32 / 6)


def test_with_compression_the_estimate_sees_beyond_the_rank_sent():
    """The compressor input c = delta + residual: at r = 12 a rank-30 pseudo-gradient is estimated near 30, so r
    rises; 8-bit factors keep the quantization noise under the 1% of energy the estimate leaves out."""
    reports = _rounds(TRUE_RANKS, {"bits": 8})
    for report, k in zip(reports, TRUE_RANKS, strict=True):
        assert abs(report["estimated_rank"] - k) <= 2, (report["estimated_rank"], k)
    assert reports[4]["rank_r"] == 12 and reports[4]["estimated_rank"] >= 28  # sent at 12, seen at about 30
    ranks = [r["rank_r"] for r in reports]
    assert ranks[4] <= 13 and max(ranks[5:10]) == 32 and ranks[-1] <= 8
    for report in reports:
        assert 0 < report["compression_error"] < 1 and report["compression_error2"] == report["compression_error"] ** 2
        assert 0 < report["omega2_corrected"] and 0 < report["omega2_paper"] < 1


def _averaged(rank: int) -> dict:
    """Replica 0's pseudo-gradients have rank 6, replica 1's rank 18."""
    k = 6 if rank == 0 else 18
    return {
        "adaptive": _rounds([k] * 2, {"compression": False}, dist.group.WORLD, seed=10 * rank),
        "fixed": _rounds([k] * 2, {"compression": False, "adaptive": False}, dist.group.WORLD, seed=10 * rank),
    }


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory) -> list[dict]:
    return run_ranks(_averaged, (), tmp_path_factory.mktemp("rank_estimator"), 2)


def test_the_estimate_is_averaged_over_the_replicas_and_its_bytes_counted(two_replicas):
    fp16_bytes = allreduce_payload_bytes(2 * (M * N + M), 2)
    for out in two_replicas:
        for report in out["adaptive"]:
            assert report["estimated_rank"] == math.ceil((6 + 18) / 2)
            # The [sum, count] pair, float64, rides the slow link with the payload.
            assert report["payload_bytes"] == fp16_bytes + allreduce_payload_bytes(16, 2)
    for key in ("estimated_rank", "rank_r", "local_steps_h"):
        assert [r[key] for r in two_replicas[0]["adaptive"]] == [r[key] for r in two_replicas[1]["adaptive"]]
    # Without adaptation nothing is exchanged for it: each replica logs its own estimate.
    assert [r["estimated_rank"] for r in two_replicas[0]["fixed"]] == [6, 6]
    assert [r["estimated_rank"] for r in two_replicas[1]["fixed"]] == [18, 18]
    assert all(r["payload_bytes"] == fp16_bytes for out in two_replicas for r in out["fixed"])


# ----------------------------------------------------------------------------------------------------------
# The warm start across rank changes
# ----------------------------------------------------------------------------------------------------------


def test_warm_start_q_survives_a_change_of_rank():
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(3))
    compressor = LowRankQuantizeCompressor(8, bits=None, seed=5)
    compressor.encode(x, 0, key="w")
    q8 = compressor.warm_start("w", x.shape)
    assert q8.shape == (24, 8)

    # r falls: the leading columns are kept, and the power iteration starts from them.
    compressor.rank = 4
    start = compressor.warm_start("w", x.shape)
    assert torch.equal(start, q8[:, :4])
    payload = compressor.encode(x, 1, key="w")
    p, q = low_rank(x, 4, q8[:, :4])
    assert torch.equal(
        payload, torch.cat([p.reshape(-1).contiguous().view(torch.uint8), q.reshape(-1).view(torch.uint8)])
    )
    q4 = compressor.warm_start("w", x.shape)
    assert q4.shape == (24, 4) and torch.equal(q4, q)

    # r rises: every column is kept and fresh ones come from the seed, those a cold start at r = 12 would draw.
    compressor.rank = 12
    start = compressor.warm_start("w", x.shape)
    cold = torch.randn(24, 12, generator=torch.Generator().manual_seed(5))
    assert start.shape == (24, 12)
    assert torch.equal(start[:, :4], q4) and torch.equal(start[:, 4:], cold[:, 4:])
    # Deterministic: another replica's compressor derives the same columns.
    twin = LowRankQuantizeCompressor(4, bits=None, seed=5)
    twin.encode(x, 0, key="w")  # a cold start at r = 4 this time: its Q differs, the fresh columns do not
    twin.rank = 12
    assert torch.equal(twin.warm_start("w", x.shape)[:, 4:], cold[:, 4:])
    compressor.encode(x, 2, key="w")
    assert compressor.warm_start("w", x.shape).shape == (24, 12)

    # No Q for a key never seen, or for another shape: a cold start.
    assert compressor.warm_start("other", x.shape) is None
    assert compressor.warm_start("w", (40, 30)) is None


def test_the_kept_subspace_is_what_the_warm_start_is_for():
    """After a fall in rank the kept columns go on refining the same top subspace: the first payload at the new
    rank is as good as if the rank had never changed, and better than a cold start's."""
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(64, 16, generator=g)).Q
    v = torch.linalg.qr(torch.randn(48, 16, generator=g)).Q
    x = u @ torch.diag(torch.logspace(0, -2, 16)) @ v.T + 1e-3 * torch.randn(64, 48, generator=g)

    def error(compressor: LowRankQuantizeCompressor, key: str | None) -> float:
        decoded = compressor.decode(compressor.encode(x, 0, key=key), x.shape, 0)
        return float(torch.linalg.matrix_norm(decoded - x) / torch.linalg.matrix_norm(x))

    warm = LowRankQuantizeCompressor(8, bits=None, seed=1)
    for _ in range(4):
        error(warm, "w")
    warm.rank = 6
    cold = LowRankQuantizeCompressor(6, bits=None, seed=1)
    assert error(warm, "w") < error(cold, None)
