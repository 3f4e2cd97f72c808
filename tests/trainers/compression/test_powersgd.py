"""The shared-basis exchange (trainers/compression/powersgd.py) and DiLoCoX's `--exchange reduce`: the rule by hand
on fixed tensors with one replica; a known low-rank mean, error feedback and the payload in two real processes (gloo
over loopback), in one spawn."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.trainers.spawn import run_scenarios
from tests.trainers.toy import TOY_OPTIM, clones, method_context, toy_backward, toy_model
from trainers.comm import allreduce_payload_bytes, quantized_ring_payload_bytes
from trainers.compression.powersgd import PowerSGDReducer, buffer_numels, factor_rank, payload_bytes
from trainers.methods.dilocox import DiLoCoX, DiLoCoXConfig

WORLD = 2


def _matrices(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(12, 20, generator=g), torch.randn(7, generator=g)


def test_one_replica_is_the_power_iteration_by_hand():
    matrix, vector = _matrices(0)
    reducer = PowerSGDReducer(seed=3, wire="fp32")
    out = reducer.exchange([matrix, vector], ["w", "b"], 4, torch.tensor([5.0]), None, 1)

    q0 = torch.linalg.qr(torch.randn(20, 4, generator=torch.Generator().manual_seed(3))).Q
    p = torch.linalg.qr(matrix @ q0).Q
    q = matrix.T @ p
    torch.testing.assert_close(out.average[0], p @ q.T)
    torch.testing.assert_close(out.transmitted[0], p @ q.T)
    torch.testing.assert_close(out.average[1], vector)  # a 1-D tensor travels whole
    torch.testing.assert_close(out.extra, torch.tensor([5.0]))

    # The next round starts from this round's Q: a second iteration on the same matrix.
    again = reducer.exchange([matrix, vector], ["w", "b"], 4, torch.zeros(0), None, 1)
    p2 = torch.linalg.qr(matrix @ torch.linalg.qr(q).Q).Q
    torch.testing.assert_close(again.average[0], p2 @ (matrix.T @ p2).T)


def test_bf16_on_the_wire_rounds_what_travels():
    matrix, vector = _matrices(1)
    out = PowerSGDReducer(seed=0).exchange([matrix, vector], ["w", "b"], 4, torch.zeros(0), None, 1)
    torch.testing.assert_close(out.average[1], vector.bfloat16().float())
    assert 0 < (out.average[1] - vector).abs().max() < 1e-2


def test_payload_is_two_ring_all_reduces_of_the_factors():
    shapes = [torch.Size([12, 20]), torch.Size([7]), torch.Size([4, 4])]
    # 12 x 20 at rank 4 goes as factors (4 * 32 < 240); 4 x 4 at rank 4 would not be smaller: whole.
    assert [factor_rank(s, 4) for s in shapes] == [4, None, None]
    assert buffer_numels(shapes, 4, extra=1) == (12 * 4 + 7 + 16 + 1, 20 * 4)
    for n in (2, 4, 8, 20):
        expected = allreduce_payload_bytes(2 * 72, n) + allreduce_payload_bytes(2 * 80, n)
        assert payload_bytes(shapes, 4, n, extra=1) == expected
        # 2(n-1)/n of one payload: flat in n, unlike a gather's n - 1.
        assert payload_bytes(shapes, 4, n, extra=1) <= 2 * (72 + 80) * 2


def test_int8_payload_pads_each_part_to_whole_buckets_and_rides_the_quantized_ring():
    shapes = [torch.Size([12, 20]), torch.Size([7])]
    # P: 48 -> 128, the vector 7 -> 128, the estimate 1 -> 128; Q: 80 -> 128.
    assert buffer_numels(shapes, 4, extra=1, wire="int8") == (384, 128)
    for n in (2, 4, 8):
        expected = quantized_ring_payload_bytes(384, n, 8, 128) + quantized_ring_payload_bytes(128, n, 8, 128)
        assert payload_bytes(shapes, 4, n, extra=1, wire="int8") == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"exchange": "scatter"}, "exchange must be one of gather, reduce"),
        ({"exchange": "reduce", "compression": False}, "exchange=reduce reduces low-rank factors"),
        ({"exchange": "reduce", "overlap": "eager"}, "overlap=eager restarts"),
        ({"exchange": "reduce", "reduce_wire": "int2"}, "reduce_wire must be one of bf16, int8, int4"),
    ],
)
def test_bad_exchange_settings_name_the_setting(options, message):
    with pytest.raises(ValueError, match=message):
        DiLoCoXConfig(**options)


def test_sync_plan_declares_both_all_reduces_one_after_the_other():
    shapes = [torch.Size([12, 20]), torch.Size([7])]
    plan = DiLoCoXConfig(exchange="reduce", rank=4).sync_plan(shapes)
    assert plan.sequential
    assert [(e.collective, e.nbytes) for e in plan.exchanges] == [("all-reduce", 2 * (48 + 7 + 1)), ("all-reduce", 160)]


# ----------------------------------------------------------------------------------------------------------
# Two processes
# ----------------------------------------------------------------------------------------------------------


def _reducer_scenario(rank: int) -> dict:
    """Each replica's matrix is a shared rank-2 part plus its own full-rank noise, which cancels in the mean."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(16, 2, generator=g) @ torch.randn(2, 24, generator=g)
    noise = torch.randn(16, 24, generator=g)
    mine = shared + (noise if rank == 0 else -noise)
    reducer = PowerSGDReducer(seed=0, wire="fp32")
    out = reducer.exchange([mine], ["w"], 2, torch.tensor([float(rank + 1)]), dist.group.WORLD, WORLD)
    vector = torch.randn(200, generator=torch.Generator().manual_seed(rank))
    coded = {
        wire: PowerSGDReducer(seed=0, wire=wire).exchange(
            [mine, vector], ["w", "b"], 2, torch.tensor([1.0]), dist.group.WORLD, WORLD
        )
        for wire in ("int8", "int4")
    }
    return {
        "shared": shared,
        "mine": mine,
        "average": out.average[0],
        "transmitted": out.transmitted[0],
        "extra": out.extra,
        "coded": {wire: (r.average, r.transmitted) for wire, r in coded.items()},
    }


def _dilocox_scenario(rank: int) -> dict:
    """DiLoCoX with the reduce exchange on the toy model, streaming and delayed, with adaptation."""
    out = {}
    for overlap, wire in (("streaming", "bf16"), ("delayed", "bf16"), ("streaming", "int8"), ("delayed", "int4")):
        model = toy_model()
        steps = 12
        cfg = DiLoCoXConfig(local_steps=4, exchange="reduce", rank=2, min_rank=1, overlap=overlap, reduce_wire=wire)
        method = DiLoCoX(method_context(model, TOY_OPTIM, steps, dist.group.WORLD), cfg)
        reports = []
        for step in range(steps):
            toy_backward(model, rank, step)
            report = method.step(step)
            if report is not None:
                reports.append(report)
        reports += method.finish()
        out[f"{overlap}-{wire}"] = {
            "theta": clones(method.global_params),
            "payloads": [r.payload_bytes for r in reports],
            "fields": [r.fields for r in reports],
            "shapes": [p.shape for p in model.parameters()],
            "applied": method.applied_steps(steps),
            "wire": wire,
        }
    return out


def _all_scenarios(rank: int) -> dict:
    return {"reducer": _reducer_scenario(rank), "dilocox": _dilocox_scenario(rank)}


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory) -> dict[str, list[dict]]:
    return run_scenarios(_all_scenarios, tmp_path_factory.mktemp("powersgd"), WORLD)


def test_a_low_rank_mean_is_recovered_exactly_at_its_rank(two_replicas):
    # Each replica's matrix is full rank; their mean is rank 2, and the rank-2 exchange returns it exactly: the
    # low-rank part of the mean, not the mean of each replica's low-rank part.
    for out in two_replicas["reducer"]:
        torch.testing.assert_close(out["average"], out["shared"], rtol=0, atol=1e-4)
        torch.testing.assert_close(out["extra"], torch.tensor([3.0]))
    a, b = two_replicas["reducer"]
    torch.testing.assert_close(a["average"], b["average"], rtol=0, atol=0)


def test_error_feedback_keeps_what_the_average_misses(two_replicas):
    # The shares add up to the average, and each replica keeps the rest of its own matrix as its residual.
    a, b = two_replicas["reducer"]
    torch.testing.assert_close((a["transmitted"] + b["transmitted"]) / 2, a["average"], rtol=0, atol=1e-5)
    for out in (a, b):
        residual = out["mine"] - out["transmitted"]
        assert torch.linalg.norm(residual) > 0.5 * torch.linalg.norm(out["mine"] - out["shared"])


def test_coded_wires_keep_their_rounding_in_the_shares(two_replicas):
    # Under int8 and int4 the sum is rounded hop by hop; each replica's share gives up the rounding it made, so the
    # shares still add up to the average, and error feedback carries the wire's rounding to the next round.
    a, b = two_replicas["reducer"]
    for wire, level in (("int8", 127), ("int4", 7)):
        (average, mine), (other_average, other) = a["coded"][wire], b["coded"][wire]
        for x, y in zip(average, other_average, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        for avg, t_a, t_b in zip(average, mine, other, strict=True):
            torch.testing.assert_close((t_a + t_b) / 2, avg, rtol=0, atol=1e-5)
        # The whole vector's average misses the exact mean by no more than the ring's two roundings allow.
        exact = (
            torch.randn(200, generator=torch.Generator().manual_seed(0))
            + torch.randn(200, generator=torch.Generator().manual_seed(1))
        ) / 2
        assert 0 < (average[1] - exact).abs().max() < 2 * 0.5 * 8.0 / level


def test_dilocox_reduce_agrees_across_replicas_and_counts_its_bytes(two_replicas):
    for variant in ("streaming-bf16", "delayed-bf16", "streaming-int8", "delayed-int4"):
        a, b = (out[variant] for out in two_replicas["dilocox"])
        for x, y in zip(a["theta"], b["theta"], strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        assert a["applied"] == 12
        sent = [p for p in a["payloads"] if p]
        assert sent, variant
        # Every exchange is both all-reduces at that round's rank (the estimate inside the first).
        ranks = [f["rank_r"] for f in a["fields"] if "rank_r" in f]
        assert sent == [payload_bytes(a["shapes"], r, WORLD, extra=1, wire=a["wire"]) for r in ranks]
        errors = [f["compression_error"] for f in a["fields"] if f.get("compression_error") is not None]
        assert errors and all(0 <= e < 1 for e in errors) and not any(math.isnan(e) for e in errors)
