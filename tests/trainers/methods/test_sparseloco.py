"""SparseLoCo: the compressor and the outer update against the rule written out by hand, in one process (one
replica) and in real processes over gloo (two replicas; two replicas of two pipeline stages).

The pseudo-gradients are fixed tensors: a test writes theta_i = theta - delta into the model and steps the method
without gradients, so the inner AdamW leaves the weights alone and the round's pseudo-gradient is exactly delta.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.trainers.spawn import run_ranks
from tests.trainers.toy import TOY_OPTIM, clones
from trainers.comm import allgather_payload_bytes
from trainers.compression.chunked_topk import ChunkedTopK, chunk_layout
from trainers.method import MethodContext
from trainers.methods.sparseloco import SparseLoCo, SparseLoCoConfig
from trainers.registry import build_method, method_config

WORLD = 2
# Small chunks so the toy's tensors hold several: the weight 24 x 16 is six 8 x 8 tiles keeping 8 of 64 values
# each, the bias 24 three runs of 8 keeping 1 each (round(8 / 8) = 1).
SETTINGS = {"local_steps": 1, "chunk_size": 8, "density": 0.125, "bits": 2, "error_decay": 0.95}


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(24, 16))
        self.bias = torch.nn.Parameter(torch.randn(24))


def _context(named_params, dp_group=None, pipeline_group=None, steps: int = 10) -> MethodContext:
    return MethodContext(named_params, dp_group, pipeline_group, TOY_OPTIM, steps, seed=0)


def _delta(rank: int, round_: int, shape: torch.Size, shared: float = 1.0) -> torch.Tensor:
    """Replica `rank`'s pseudo-gradient of a round: a part common to the replicas plus its own, so their top-k sets
    overlap in some coordinates and not in others."""
    common = torch.randn(shape, generator=torch.Generator().manual_seed(round_))
    own = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * (rank + 1) + round_))
    return shared * common + own


# ----------------------------------------------------------------------------------------------------------
# The rule, by hand
# ----------------------------------------------------------------------------------------------------------


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _hand_chunks(shape: torch.Size, chunk_size: int) -> list[tuple[slice, ...]]:
    """The chunks of a 1-D or 2-D tensor as index slices: runs, or tiles in row-major order of the tile grid."""
    if len(shape) == 1:
        side = _largest_divisor(shape[0], chunk_size)
        return [(slice(i, i + side),) for i in range(0, shape[0], side)]
    h, w = _largest_divisor(shape[0], chunk_size), _largest_divisor(shape[1], chunk_size)
    return [(slice(y, y + h), slice(x, x + w)) for y in range(0, shape[0], h) for x in range(0, shape[1], w)]


def _hand_quantize(v: torch.Tensor, bits: int, range_sigmas: float) -> torch.Tensor:
    """The reference's statistical quantizer, written out: what the selected values decode to."""
    bins = 2**bits
    shift = v.mean()
    c = v - shift
    sigma = math.sqrt(float((c * c).sum()) / (v.numel() - 1))
    scale = range_sigmas * sigma / bins
    codes = torch.clamp(torch.round(c / scale + bins // 2), 0, bins - 1)
    decoded = torch.empty_like(v)
    for code in range(bins):
        chosen = codes == code
        if chosen.any():
            decoded[chosen] = c[chosen].mean() + shift
    return decoded


def _hand_sent(e: torch.Tensor, chunk_size: int, density: float, bits: int = 2, range_sigmas: float = 6.0):
    """(what a replica sends of accumulator e, dense; the mask of the coordinates it sends)."""
    mask = torch.zeros_like(e, dtype=torch.bool)
    for chunk in _hand_chunks(e.shape, chunk_size):
        block = e[chunk]
        k = min(block.numel(), max(1, round(block.numel() * density)))
        keep = torch.zeros(block.numel(), dtype=torch.bool)
        keep[block.reshape(-1).abs().argsort(descending=True)[:k]] = True
        mask[chunk] = keep.reshape(block.shape)
    sent = torch.zeros_like(e)
    sent[mask] = _hand_quantize(e[mask], bits, range_sigmas)
    return sent, mask


def _hand_nbytes(shape: torch.Size, chunk_size: int, density: float, bits: int) -> int:
    """4 (1 + 2^b) + ceil(R k b / 8) + ceil(R k ceil(log2 C) / 8)."""
    chunks = _hand_chunks(shape, chunk_size)
    size = math.prod(s.stop - s.start for s in chunks[0])
    k = min(size, max(1, round(size * density)))
    sent = len(chunks) * k
    return 4 * (1 + 2**bits) + math.ceil(sent * bits / 8) + math.ceil(sent * math.ceil(math.log2(size)) / 8)


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        ({"density": 0.0}, "density"),
        ({"density": -0.01}, "density"),
        ({"density": 1.5}, "density"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"bits": 0}, "bits"),
        ({"bits": 9}, "bits"),
        ({"bits": None}, "bits"),
        ({"error_decay": -0.1}, "error_decay"),
        ({"error_decay": 1.1}, "error_decay"),
        ({"quantization_range": 0.0}, "quantization_range"),
        ({"local_steps": 0}, "local_steps"),
        ({"outer_lr": 0.0}, "outer_lr"),
    ],
)
def test_bad_settings_name_the_setting(options, setting):
    with pytest.raises(ValueError, match=setting):
        SparseLoCoConfig(**options)
    if options.get("bits", 1) is not None:
        with pytest.raises(ValueError, match=setting):
            method_config("sparseloco", options)


def test_defaults_are_the_published_ones():
    cfg = method_config("sparseloco", {})
    assert (cfg.local_steps, cfg.outer_lr, cfg.error_decay, cfg.chunk_size, cfg.bits) == (30, 1.0, 0.95, 64, 2)
    assert cfg.density * 64 * 64 == 64  # 64 of every 4096: 1.56%
    assert SparseLoCoConfig(density=1.0, bits=8, error_decay=1.0).density == 1.0  # the closed ends are allowed


# ----------------------------------------------------------------------------------------------------------
# The compressor
# ----------------------------------------------------------------------------------------------------------


def test_layout_cuts_at_the_largest_divisor():
    tokens = chunk_layout((256, 128), 64, 64 / 4096)
    assert (tokens.tile, tokens.rows, tokens.chunk, tokens.k, tokens.index_bits) == ((64, 64), 8, 4096, 64, 12)
    positions = chunk_layout((130, 128), 64, 64 / 4096)  # 130's largest divisor up to 64 is 26
    assert (positions.tile, positions.rows, positions.k) == ((26, 64), 10, 26)
    norm = chunk_layout((128,), 64, 64 / 4096)  # runs of 64, at least one value each
    assert (norm.tile, norm.rows, norm.chunk, norm.k, norm.index_bits) == (None, 2, 64, 1, 6)
    assert chunk_layout((4, 6, 8), 8, 0.5).matrix == (4, 48)  # more than 2-D: the matrix (shape[0], rest)
    assert chunk_layout((1,), 64, 0.01).index_bits == 0  # a one-element chunk needs no index bits


@pytest.mark.parametrize(
    ("shape", "chunk_size", "density", "bits"),
    [((24, 16), 8, 0.125, 2), ((24,), 8, 0.125, 2), ((130, 128), 64, 64 / 4096, 2), ((40, 30), 16, 0.05, 4)],
)
def test_payload_decodes_to_the_hand_rule_and_has_the_formula_size(shape, chunk_size, density, bits):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    compressor = ChunkedTopK(chunk_size, density, bits)
    payload = compressor.encode(x)
    assert payload.dtype == torch.uint8
    assert payload.numel() == compressor.payload_nbytes(shape) == _hand_nbytes(shape, chunk_size, density, bits)
    expected, mask = _hand_sent(x, chunk_size, density, bits)
    got = compressor.densify(*compressor.decode(payload, shape), shape)
    assert torch.equal(got != 0, mask)
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# One replica
# ----------------------------------------------------------------------------------------------------------


def _set_local(model: torch.nn.Module, theta: list[torch.Tensor], deltas: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, t, d in zip(model.parameters(), theta, deltas, strict=True):
            p.copy_(t - d)


@pytest.mark.parametrize("outer_lr", [1.0, 0.5])
def test_one_replica_outer_update_is_the_hand_rule(outer_lr):
    """e <- beta e + alpha delta; send Q(TopK(e)); e <- e - sent; theta <- theta - alpha sent (the replica's own)."""
    model = _Toy()
    cfg = SparseLoCoConfig(**SETTINGS, outer_lr=outer_lr)
    method = SparseLoCo(_context(list(model.named_parameters())), cfg)
    theta, error = clones(method.global_params), [torch.zeros_like(p) for p in model.parameters()]
    for round_ in (1, 2, 3):
        deltas = [_delta(0, round_, p.shape) for p in model.parameters()]
        _set_local(model, theta, deltas)
        report = method.step(round_ - 1)
        assert report is not None and report.payload_bytes == 0  # nothing crosses a link
        for i, delta in enumerate(deltas):
            accumulated = cfg.error_decay * error[i] + outer_lr * delta
            sent, _ = _hand_sent(accumulated, cfg.chunk_size, cfg.density)
            # Error feedback keeps what was dropped, the quantization error included.
            error[i] = accumulated - sent
            theta[i] = theta[i] - outer_lr * sent
            assert torch.allclose(method.error[i], error[i], rtol=0, atol=1e-5), f"e, round {round_}"
            assert torch.allclose(method.global_params[i], theta[i], rtol=0, atol=1e-5), f"theta, round {round_}"
            assert torch.equal(list(model.parameters())[i], method.global_params[i])  # the replica restarts there
        assert report.fields["values_sent"] == 6 * 8 + 3 * 1
        assert 0 < report.fields["compression_error"] < 1


def test_rounds_final_sync_and_state():
    model = _Toy()
    numel = sum(p.numel() for p in model.parameters())
    for final_sync, applied in ((True, 7), (False, 6)):
        method = SparseLoCo(
            _context(list(model.named_parameters()), steps=7), SparseLoCoConfig(local_steps=3, final_sync=final_sync)
        )
        reports = []
        for step in range(7):
            (model.weight.sum() + model.bias.sum()).backward()
            if method.step(step) is not None:
                reports.append(step)
        assert reports == [2, 5]
        assert len(method.finish()) == (1 if final_sync else 0)
        assert method.applied_steps(7) == applied
        # Inner AdamW moments, theta and the error buffers: 4 x fp32 per weight, no outer momentum.
        assert 4 * 4 * numel <= method.optimizer_state_bytes() < 4 * 4 * numel + 64


def test_sync_plan_declares_the_formula():
    cfg = SparseLoCoConfig(**SETTINGS)
    shapes = [torch.Size((24, 16)), torch.Size((24,))]
    plan = cfg.sync_plan(shapes)
    assert plan.every_steps == cfg.local_steps and plan.hidden_steps == 0
    (exchange,) = plan.exchanges
    assert exchange.collective == "all-gather"
    assert exchange.nbytes == sum(_hand_nbytes(s, 8, 0.125, 2) for s in shapes) == (20 + 12 + 36) + (20 + 1 + 2)


# ----------------------------------------------------------------------------------------------------------
# Two replicas (and two stages) over gloo
# ----------------------------------------------------------------------------------------------------------


def _recording_gather(log: list):
    """trainers.methods.sparseloco's all-gather, recording the bytes this rank hands to the collective and receives."""
    from trainers import comm

    def gather(payload, group):
        buffers, inflight = comm.all_gather_bytes(payload, group)
        log.append((payload.numel(), buffers))
        return buffers, inflight

    return gather


def _replicas_scenario(rank: int, rounds: int, stages: int) -> dict:
    """`WORLD` replicas of `stages` stages (rank = replica * stages + stage); each rank syncs its own stage."""
    import trainers.methods.sparseloco as sparseloco

    replica, stage = divmod(rank, stages)
    dp_groups = [dist.new_group([r * stages + s for r in range(WORLD)]) for s in range(stages)]
    pp_groups = [dist.new_group([r * stages + s for s in range(stages)]) for r in range(WORLD)]
    model = _Toy()
    named = list(model.named_parameters())
    named = named if stages == 1 else named[stage : stage + 1]
    log: list = []
    sparseloco.all_gather_bytes = _recording_gather(log)
    method = build_method(
        "sparseloco",
        method_config("sparseloco", SETTINGS),
        _context(named, dp_groups[stage], pp_groups[replica] if stages > 1 else None),
    )
    out = {"theta": [clones(method.global_params)], "error": [], "deltas": [], "reports": [], "local": []}
    for round_ in range(1, rounds + 1):
        deltas = [_delta(replica, round_, p.shape) for _, p in named]
        with torch.no_grad():
            for (_, p), t, d in zip(named, method.global_params, deltas, strict=True):
                p.copy_(t - d)
        out["reports"].append(method.step(round_ - 1).as_event())
        out["deltas"].append(deltas)
        out["theta"].append(clones(method.global_params))
        out["error"].append(clones(method.error))
        out["local"].append(clones(p for _, p in named))
    out["sent_nbytes"] = [n for n, _ in log]
    out["received_nbytes"] = [[b.numel() for b in buffers] for _, buffers in log]
    out["shapes"] = [p.shape for _, p in named]
    return out


def _check_replicas(results: list[dict], rounds: int) -> list[float]:
    """Every rank against the hand rule over its stage's replicas; returns each round's shared fraction."""
    cfg = SparseLoCoConfig(**SETTINGS)
    shared = []
    for out in results:
        assert len(out["reports"]) == rounds
    for round_ in range(rounds):
        for tensor in range(len(results[0]["shapes"])):
            sents, masks = [], []
            for out in results:
                error = out["error"][round_ - 1][tensor] if round_ else torch.zeros_like(out["theta"][0][tensor])
                accumulated = cfg.error_decay * error + cfg.outer_lr * out["deltas"][round_][tensor]
                sent, mask = _hand_sent(accumulated, cfg.chunk_size, cfg.density)
                assert torch.allclose(out["error"][round_][tensor], accumulated - sent, rtol=0, atol=1e-5)
                sents.append(sent)
                masks.append(mask)
            senders = sum(m.to(torch.float32) for m in masks)
            # Each coordinate's mean over the replicas that sent it: not the sum over all replicas / R.
            average = sum(sents) / senders.clamp(min=1)
            assert ((senders == 1) & (average != sum(sents) / WORLD)).any(), "the check must tell the two apart"
            theta = results[0]["theta"][round_][tensor] - cfg.outer_lr * average
            for out in results:
                assert torch.allclose(out["theta"][round_ + 1][tensor], theta, rtol=0, atol=1e-5), f"round {round_}"
                assert torch.equal(out["theta"][round_ + 1][tensor], results[0]["theta"][round_ + 1][tensor])
                assert torch.equal(out["local"][round_][tensor], out["theta"][round_ + 1][tensor])
        shared.append(results[0]["reports"][round_]["shared_fraction"])
    return shared


def _check_payload(results: list[dict]) -> None:
    """The bytes handed to the all-gather are the formula's, every rank received as many from each, and the report
    and the declared plan say the same."""
    for out in results:
        nbytes = sum(_hand_nbytes(shape, 8, 0.125, 2) for shape in out["shapes"])
        assert out["sent_nbytes"] == [nbytes] * len(out["reports"])
        assert out["received_nbytes"] == [[nbytes] * WORLD] * len(out["reports"])
        plan = SparseLoCoConfig(**SETTINGS).sync_plan(out["shapes"])
        for report in out["reports"]:
            assert report["payload_bytes"] == allgather_payload_bytes(nbytes, WORLD) == (WORLD - 1) * nbytes
            assert report["payload_bytes"] == plan.exchanges[0].payload_bytes(WORLD)


def test_two_replicas_average_over_senders(tmp_path: Path):
    rounds = 3
    results = run_ranks(_replicas_scenario, (rounds, 1), tmp_path, WORLD)
    shared = _check_replicas(results, rounds)
    # The replicas' top-k sets overlap in part: the mean over senders differs from the mean over replicas there.
    assert all(0 < s < 1 for s in shared)
    _check_payload(results)


def test_pipeline_stages_sync_their_own_stage(tmp_path: Path):
    """Two replicas of two stages: stage 0 holds the weight, stage 1 the bias; each syncs with its own stage of the
    other replica, and the stages' payloads add up to the whole model's plan."""
    stages, rounds = 2, 2
    results = run_ranks(_replicas_scenario, (rounds, stages), tmp_path, WORLD * stages)
    for stage in range(stages):
        _check_replicas(results[stage::stages], rounds)
        _check_payload(results[stage::stages])
    whole = SparseLoCoConfig(**SETTINGS).sync_plan([torch.Size((24, 16)), torch.Size((24,))]).exchanges[0].nbytes
    assert sum(results[stage]["sent_nbytes"][0] for stage in range(stages)) == whole
