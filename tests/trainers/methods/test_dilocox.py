"""DiLoCoX: the adaptive rule and error feedback in one process; the exchange in two real processes (gloo over
loopback), driven step by step as the train loop does.

Every two-process scenario runs in one start of the ranks (the `two_replicas` fixture: one fork and one process
group, not one per test) and each test checks its own scenario's results.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist

from tests.trainers.bounds import unigram_entropy_nats
from tests.trainers.spawn import run_scenarios
from tests.trainers.toy import TOY_OPTIM, clones, known_offset, method_context, toy_backward, toy_model
from trainers.comm import allgather_payload_bytes, allreduce_payload_bytes
from trainers.compression.lowrank import low_rank_nbytes
from trainers.compression.quantize import quantized_nbytes
from trainers.config import OptimConfig
from trainers.data import load_corpus, replica_batches
from trainers.methods.dilocox import DiLoCoX, DiLoCoXConfig, adapted_schedule
from trainers.methods.opendiloco import OpenDiLoCo, OpenDiLoCoConfig
from trainers.models import DecoderLM, get_model_config
from trainers.registry import build_method, method_config

WORLD = 2


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"local_steps": 0}, "local_steps must be at least 1, got 0"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"rank": 0}, "rank must be at least 1, got 0"),
        ({"bits": 3}, "bits must be one of 2, 4, 8; got 3"),
        ({"bucket_size": 0}, "bucket_size"),
        ({"power_iterations": 0}, "power_iterations must be at least 1, got 0"),
        ({"rank_window": 0}, "rank_window"),
        ({"energy": 0.0}, "energy"),
        ({"energy": 1.5}, "energy"),
        ({"min_rank": 0}, "min_rank"),
        ({"rank": 8, "min_rank": 9}, "min_rank"),
        ({"local_steps": 10, "max_local_steps": 9}, "max_local_steps"),
    ],
)
def test_bad_config_names_the_setting(options, message):
    with pytest.raises(ValueError, match=message):
        DiLoCoXConfig(**options)
    with pytest.raises(ValueError, match=message):
        method_config("dilocox", options)


# ----------------------------------------------------------------------------------------------------------
# The adaptive rule
# ----------------------------------------------------------------------------------------------------------


def test_rank_follows_the_window_mean_within_bounds():
    cfg = DiLoCoXConfig(local_steps=10, rank=32, min_rank=4, rank_window=3)
    assert adapted_schedule([32, 32, 32], cfg) == (32, 10)
    assert adapted_schedule([20, 21, 22], cfg)[0] == 21
    assert adapted_schedule([20, 21, 21], cfg)[0] == 21  # 20.67 rounds up
    assert adapted_schedule([60, 70, 80], cfg)[0] == 32  # never above r_1
    assert adapted_schedule([1, 1, 2], cfg)[0] == 4  # never below min_rank

    # Fed one estimate per outer step, as the method does: the window starts full of r_1.
    window = deque([cfg.rank] * cfg.rank_window, maxlen=cfg.rank_window)
    ranks, steps = [], []
    for estimate in [8, 8, 8, 8, 30, 30, 30]:
        window.append(estimate)
        r, h = adapted_schedule(window, cfg)
        assert r == max(cfg.min_rank, min(cfg.rank, math.ceil(sum(window) / len(window))))
        ranks.append(r)
        steps.append(h)
    assert ranks == [24, 16, 8, 8, 16, 23, 30]
    # A smaller rank gives longer rounds: H is non-increasing in r, and capped at 4 H_1 by default.
    for (r1, h1), (r2, h2) in pairwise(zip(ranks, steps, strict=True)):
        assert (r2 - r1) * (h2 - h1) <= 0
    assert steps[:3] == [13, 20, 40]
    assert adapted_schedule([4, 4, 4], cfg)[1] == 40
    assert adapted_schedule([4, 4, 4], DiLoCoXConfig(local_steps=10, max_local_steps=25))[1] == 25


# ----------------------------------------------------------------------------------------------------------
# Error feedback (one cluster: the average is this replica's own transmitted pseudo-gradient)
# ----------------------------------------------------------------------------------------------------------


def test_error_feedback_conserves_the_signal_over_rounds():
    """With lr 1 and no momentum, theta_0 - theta_final is the sum of what was transmitted, so
    sum(delta) == (theta_0 - theta_final) + residual: compression delays signal, never loses it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(24, 16)
    # final_sync off: the sum below counts the completed rounds, whose offsets the reports mark.
    cfg = DiLoCoXConfig(
        local_steps=2,
        outer_lr=1.0,
        outer_momentum=0.0,
        rank=8,
        bits=2,
        min_rank=2,
        rank_window=2,
        final_sync=False,
        overlap="delayed",
    )
    method = DiLoCoX(method_context(model, TOY_OPTIM, 40, None), cfg)
    theta_0 = clones(method.global_params)
    g = torch.Generator().manual_seed(1)
    delta_sum = [torch.zeros_like(t) for t in theta_0]
    ranks = set()
    for step in range(40):
        # Set the local weights directly (no .grad, so the inner step leaves them): delta = -offset exactly.
        offsets = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        if step < 20:
            # Rank-1 progress first, full rank after: the estimate (on delta + residual) and so r fall, then rise.
            offsets[0] = torch.outer(torch.randn(16, generator=g), torch.randn(24, generator=g))
        with torch.no_grad():
            for p, global_param, offset in zip(model.parameters(), method.global_params, offsets, strict=True):
                p.copy_(global_param + offset)
        report = method.step(step)
        if report is not None:
            assert report.payload_bytes == 0 and report.fields["compression_error"] > 0.1
            ranks.add(report.fields["rank_r"])
            for total, offset in zip(delta_sum, offsets, strict=True):
                total -= offset
    method.finish()
    # The rank changed along the way, so payloads were decoded with the rank they were encoded with.
    assert len(ranks) > 1
    names = [name for name, _ in model.named_parameters()]
    for name, before, after, total in zip(names, theta_0, method.global_params, delta_sum, strict=True):
        residual = method.exchange.error_feedback.residuals[name]
        assert residual.abs().max() > 0.1
        torch.testing.assert_close((before - after) + residual, total, rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------
# Two processes
# ----------------------------------------------------------------------------------------------------------


def _equivalence_scenario(rank: int) -> dict:
    """OpenDiLoCo and DiLoCoX with every part off, side by side on copies of one model fed the same gradients."""
    steps, local_steps = 6, 2
    a = toy_model()
    b = copy.deepcopy(a)
    diloco = OpenDiLoCo(
        method_context(a, TOY_OPTIM, steps, dist.group.WORLD), OpenDiLoCoConfig(local_steps=local_steps)
    )
    cfg = DiLoCoXConfig(local_steps=local_steps, overlap=False, compression=False, adaptive=False)
    dilocox = DiLoCoX(method_context(b, TOY_OPTIM, steps, dist.group.WORLD), cfg)
    payloads = []
    for step in range(steps):
        toy_backward(a, rank, step)
        toy_backward(b, rank, step)
        reports = diloco.step(step), dilocox.step(step)
        if reports[0] is not None or reports[1] is not None:
            payloads.append(tuple(r.payload_bytes for r in reports))
    return {
        "initial": clones(toy_model().parameters()),
        "diloco": clones(diloco.global_params),
        "dilocox": clones(dilocox.global_params),
        "dilocox_local": clones(b.parameters()),
        "payloads": payloads,
        "finish": dilocox.finish(),  # a list of reports: empty when nothing is left
    }


def _delay_scenario(rank: int) -> dict:
    """Round length 2, the local weights set by hand at each round's end, fp16 exchange, lr 0.5, no momentum."""
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.fill_(0.25)
    cfg = DiLoCoXConfig(
        local_steps=2, outer_lr=0.5, outer_momentum=0.0, compression=False, adaptive=False, overlap="delayed"
    )
    method = DiLoCoX(method_context(model, TOY_OPTIM, 4, dist.group.WORLD), cfg)
    out = {"theta_0": clones(method.global_params), "after": [], "local_after": [], "reports": []}
    for step in range(4):
        if step % 2:
            # The round ends now: the replica's weights moved by a known offset from where the round started.
            with torch.no_grad():
                for p in model.parameters():
                    p += known_offset(rank, step // 2 + 1, p.shape)
        report = method.step(step)
        if report is not None:
            out["after"].append(clones(method.global_params))
            out["local_after"].append(clones(model.parameters()))
            out["reports"].append(report.as_event())
    (final,) = method.finish()
    out["finish"] = final.as_event()
    out["final"] = clones(method.global_params)
    out["final_local"] = clones(model.parameters())
    return out


def _train_scenario(rank: int) -> dict:
    """The `tiny` LM on this replica's shard, with every part of DiLoCoX on (overlap, compression, adaptation)."""
    steps = 60
    torch.manual_seed(0)
    model = DecoderLM(get_model_config("tiny"))
    batches = replica_batches(load_corpus(max_bytes=1 << 20), rank, WORLD, batch_size=8, seq_len=64, seed=0)
    ctx = method_context(model, OptimConfig(), steps, dist.group.WORLD)
    # r_1 = 32 (not the default 64): at 32 the estimate both falls below r_1 and rises again within 60 steps.
    options = {"local_steps": 10, "overlap": "delayed", "rank": 32}
    method = build_method("dilocox", method_config("dilocox", options), ctx)
    losses, reports = [], {}
    for step in range(steps):
        inputs, targets = next(batches)
        loss = model(inputs, targets)
        loss.backward()
        losses.append(loss.item())
        report = method.step(step)
        if report is not None:
            reports[step] = report.as_event()
    return {
        "losses": losses,
        "reports": reports,
        "finish": [r.as_event() for r in method.finish()],
        "global": clones(method.global_params),
        "rank_r": method.rank,
        "local_steps": method.local_steps,
        "shapes": [p.shape for p in model.parameters()],
        "state_bytes": method.optimizer_state_bytes(),
    }


def _all_scenarios(rank: int) -> dict:
    return {"equivalence": _equivalence_scenario(rank), "delay": _delay_scenario(rank), "train": _train_scenario(rank)}


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory) -> dict[str, list[dict]]:
    """Scenario name -> each rank's results."""
    return run_scenarios(_all_scenarios, tmp_path_factory.mktemp("dilocox"), WORLD)


def test_every_part_off_is_opendiloco(two_replicas):
    for out in two_replicas["equivalence"]:
        moved = max((a - b).abs().max().item() for a, b in zip(out["diloco"], out["initial"], strict=True))
        assert moved > 1e-2
        for theirs, ours, local in zip(out["diloco"], out["dilocox"], out["dilocox_local"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
            assert torch.equal(local, ours)
        # Three rounds, the same fp16 all-reduce bytes, and nothing left in flight.
        assert len(out["payloads"]) == 3 and all(a == b > 0 for a, b in out["payloads"])
        assert out["finish"] == []


def test_every_part_off_is_opendiloco_to_the_bit(two_replicas):
    """Why trainers/exchange.py's Fp16Sum may say `exactly as OpenDiLoCo does`."""
    for out in two_replicas["equivalence"]:
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(out["dilocox"], out["diloco"], strict=True))


def test_overlap_applies_exactly_the_previous_round_average(two_replicas):
    out, other = two_replicas["delay"]
    lr = 0.5

    def average(round_: int) -> list[torch.Tensor]:
        return [-(known_offset(0, round_, t.shape) + known_offset(1, round_, t.shape)) / 2 for t in out["theta_0"]]

    delta_1, delta_2 = average(1), average(2)
    # Round 1: no average to apply yet, theta stays theta_0 and both replicas restart from it.
    for theta_0, after, local in zip(out["theta_0"], out["after"][0], out["local_after"][0], strict=True):
        assert torch.equal(after, theta_0) and torch.equal(local, theta_0)
    # Round 2: theta_2 = theta_0 - lr * Delta_1, and Delta_2 (measured from theta_1 = theta_0) is still in flight.
    for theta_0, d1, after, local in zip(out["theta_0"], delta_1, out["after"][1], out["local_after"][1], strict=True):
        assert torch.equal(after, theta_0 - lr * d1) and torch.equal(local, after)
    # finish() lands Delta_2: training ends on a theta that holds both rounds.
    for theta_0, d1, d2, final, local in zip(
        out["theta_0"], delta_1, delta_2, out["final"], out["final_local"], strict=True
    ):
        assert not torch.equal(d2, torch.zeros_like(d2))
        assert torch.equal(final, theta_0 - lr * d1 - lr * d2) and torch.equal(local, final)
    assert [r["round"] for r in out["reports"]] == [1, 2]
    assert out["reports"][0]["blocked_s"] == out["reports"][0]["overlapped_s"] == 0.0
    assert out["reports"][1]["staleness"] is None  # the first average has none before it
    assert out["finish"]["payload_bytes"] == 0
    # ||Delta_2 - Delta_1|| / ||Delta_1|| with Delta_2 = 2 Delta_1.
    assert out["finish"]["staleness"] == pytest.approx(1.0)
    assert all(torch.equal(a, b) for a, b in zip(other["final"], out["final"], strict=True))


def _payload_formula(shapes: list[torch.Size], rank: int, bits: int = 4, bucket_size: int = 128) -> int:
    return sum(
        low_rank_nbytes(shape, rank, bits, bucket_size)
        if len(shape) >= 2
        else quantized_nbytes(math.prod(shape), bits, bucket_size)
        for shape in shapes
    )


def test_payload_on_the_wire_is_low_rank_int4(two_replicas):
    for out in two_replicas["train"]:
        assert out["reports"]
        for report in out["reports"].values():
            nbytes = _payload_formula(out["shapes"], report["rank_r"])
            # The payloads, and the rank estimate's [sum, count] in float64, all-reduced across the slow link.
            estimate = allreduce_payload_bytes(2 * 8, WORLD)
            assert report["payload_bytes"] == allgather_payload_bytes(nbytes, WORLD) + estimate
        # The tiny model at r_1 = 32: a 20x smaller exchange than fp32.
        fp32_bytes = 4 * sum(math.prod(shape) for shape in out["shapes"])
        assert fp32_bytes / _payload_formula(out["shapes"], 32) > 20
        # AdamW moments, outer momentum, theta and the residuals: five fp32 copies of the stage.
        numel = fp32_bytes // 4
        assert 5 * 4 * numel <= out["state_bytes"] < 5 * 4 * numel + 1024


def test_two_replicas_learn_agree_and_adapt(two_replicas):
    first, second = two_replicas["train"]
    for out in two_replicas["train"]:
        # From 5.56 (ln 256, uniform over bytes) to about 3.2 on either replica (overlap costs a round): within a
        # quarter nat of the training split's unigram entropy (3.14), the best a model that ignores context does,
        # so the replicas learned the bytes' statistics together (60 steps are too few to pass it).
        assert out["losses"][0] > 5.3
        assert sum(out["losses"][-10:]) / 10 < unigram_entropy_nats() + 0.25
        rounds = [r["round"] for r in out["reports"].values()]
        assert rounds == list(range(1, len(rounds) + 1)) and len(rounds) >= 3
        # finish() lands the last exchange and, rounds having grown past what is left, sends the partial last round.
        # One report per exchange sent or average applied, each with its own fields.
        assert len(out["finish"]) == 2 and out["finish"][0]["payload_bytes"] > 0
        assert out["finish"][-1]["payload_bytes"] == 0 and out["finish"][-1]["cosine"] is not None
        for report in out["reports"].values():
            assert 0 < report["compression_error"] < 1
            assert report["blocked_s"] >= 0 and report["overlapped_s"] >= 0
    # The rank fell and the rounds grew, then the rank rose again as the estimate did, identically on both
    # replicas: both derive them from the same estimate, averaged over the replicas.
    assert sorted(first["reports"]) == sorted(second["reports"])
    for step, report in first["reports"].items():
        for key in ("round", "rank_r", "local_steps_h", "estimated_rank", "staleness", "cosine", "payload_bytes"):
            assert report.get(key) == second["reports"][step].get(key), (step, key)
    assert (first["rank_r"], first["local_steps"]) == (second["rank_r"], second["local_steps"])
    ranks = [r["rank_r"] for r in first["reports"].values()] + [first["rank_r"]]
    lowest = ranks.index(min(ranks))
    assert min(ranks) < 32 and max(r["local_steps_h"] for r in first["reports"].values()) > 10
    assert max(ranks[lowest:]) > min(ranks)
    for a, b in zip(first["global"], second["global"], strict=True):
        assert torch.equal(a, b)
