"""DeMo against its rule written out by hand and against the reference optimizer's published formula (bloc97/DeMo,
rebuilt here from its definition: DCT-II basis, divisor chunking, top-k by magnitude, mean over senders, sign step),
with one replica in this process and two over gloo.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trainers.methods.demo as demo_module
from tests.trainers.spawn import run_ranks
from trainers.comm import allgather_payload_bytes
from trainers.config import OptimConfig
from trainers.method import MethodContext
from trainers.methods.demo import DeMo, DeMoConfig
from trainers.models import DecoderLM, get_model_config
from trainers.registry import method_config, method_options

# A constant schedule at --demo-lr; the clip is part of the rule and is kept in the reference below.
CONSTANT = OptimConfig(warmup_fraction=0.0, min_lr_ratio=1.0, grad_clip=1.0)
NO_CLIP = OptimConfig(warmup_fraction=0.0, min_lr_ratio=1.0, grad_clip=1e9)
SMALL = DeMoConfig(compression_decay=0.9, compression_topk=3, compression_chunk=4, demo_lr=0.01, demo_weight_decay=0.1)
# 4x4 blocks; 3 x 2 blocks (6 and 10 have no divisor 4); a prime above the chunk (blocks of 1); a 1-D tensor of one
# block smaller than k (all sent); a 1-D tensor of two blocks.
SMALL_SHAPES = [(8, 12), (6, 10), (7,), (3,), (8,)]
DEFAULT_SHAPES = [(130, 128), (256, 128), (512,)]


def _context(named_params, optim: OptimConfig, steps: int, group, pipeline_group=None) -> MethodContext:
    return MethodContext(named_params, group, pipeline_group, optim, steps, seed=0)


def _params(shapes) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(7)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(shape, generator=g))) for i, shape in enumerate(shapes)]


def _grads(shapes, replica: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    return [torch.randn(shape, generator=g) for shape in shapes]


# ----------------------------------------------------------------------------------------------------------
# The reference's formula, from its definition (float64)
# ----------------------------------------------------------------------------------------------------------


def ref_basis(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix, entry by entry: coefficient k of x is sum_i C[k, i] x[i]."""
    return torch.tensor(
        [[math.sqrt((1 if k == 0 else 2) / n) * math.cos(math.pi * (2 * i + 1) * k / (2 * n)) for i in range(n)]
         for k in range(n)],
        dtype=torch.float64,
    )  # fmt: skip


def ref_split(n: int, target: int) -> int:
    """The reference's _get_smaller_split: the largest divisor of n that is at most the target."""
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= target)


def ref_encode(x: torch.Tensor, target: int) -> torch.Tensor:
    """(blocks, coefficients): 1-D tensors in chunks of w, 2-D ones in h x w blocks (C_h B C_w^T), row-major."""
    if x.ndim == 1:
        w = ref_split(x.shape[0], target)
        return x.reshape(-1, w) @ ref_basis(w).T
    h, w = ref_split(x.shape[0], target), ref_split(x.shape[1], target)
    blocks = x.reshape(x.shape[0] // h, h, x.shape[1] // w, w).permute(0, 2, 1, 3)
    return (ref_basis(h) @ blocks @ ref_basis(w).T).reshape(-1, h * w)


def ref_decode(coefficients: torch.Tensor, shape, target: int) -> torch.Tensor:
    if len(shape) == 1:
        w = ref_split(shape[0], target)
        return (coefficients @ ref_basis(w)).reshape(shape)
    h, w = ref_split(shape[0], target), ref_split(shape[1], target)
    grid = coefficients.reshape(shape[0] // h, shape[1] // w, h, w)
    return (ref_basis(h).T @ grid @ ref_basis(w)).permute(0, 2, 1, 3).reshape(shape)


def ref_step(params, momenta, grads, cfg: DeMoConfig, clip: float):
    """One step of the reference on every replica: `momenta[r]` and `grads[r]` per replica (updated in place);
    returns (new params, the decoded averages)."""
    lr, target = cfg.demo_lr, cfg.compression_chunk
    sent = []
    for m, g in zip(momenta, grads, strict=True):
        norm = math.sqrt(sum(float((x.double() ** 2).sum()) for x in g))
        scale = clip / (norm + 1e-6) if norm > clip else 1.0
        replica = []
        for i, grad in enumerate(g):
            m[i] = cfg.compression_decay * m[i] + lr * scale * grad.double()
            coefficients = ref_encode(m[i], target)
            k = min(cfg.compression_topk, coefficients.shape[1])
            index = coefficients.abs().topk(k, dim=1).indices
            value = coefficients.gather(1, index)
            m[i] = m[i] - ref_decode(torch.zeros_like(coefficients).scatter(1, index, value), m[i].shape, target)
            replica.append((index, value))
        sent.append(replica)
    new, decoded = [], []
    for i, p in enumerate(params):
        index = torch.cat([replica[i][0] for replica in sent], dim=1)
        value = torch.cat([replica[i][1] for replica in sent], dim=1)
        blocks = ref_encode(torch.zeros(p.shape, dtype=torch.float64), target)
        average = torch.zeros_like(blocks).scatter_reduce(1, index, value, reduce="mean", include_self=False)
        decoded.append(ref_decode(average, p.shape, target))
        new.append(p.double() * (1 - lr * cfg.demo_weight_decay) - lr * decoded[-1].sign())
    return new, decoded


def assert_matches_reference(actual, expected, decoded) -> None:
    """Equal, except where the reference's decoded average is within rounding of 0 (its sign is then either)."""
    for a, e, d in zip(actual, expected, decoded, strict=True):
        off = (a.double() - e).abs() > 1e-6
        assert not off.any() or d[off].abs().max() < 1e-9, f"{int(off.sum())} elements differ"
        assert torch.allclose(a.double()[~off], e[~off], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        ({"compression_decay": -0.1}, "compression_decay"),
        ({"compression_decay": 1.0}, "compression_decay"),
        ({"compression_decay": math.nan}, "compression_decay"),
        ({"compression_topk": 0}, "compression_topk"),
        ({"compression_topk": 2.5}, "compression_topk"),
        ({"compression_chunk": 0}, "compression_chunk"),
        ({"demo_lr": 0.0}, "demo_lr"),
        ({"demo_lr": math.inf}, "demo_lr"),
        ({"demo_weight_decay": -1.0}, "demo_weight_decay"),
        ({"demo_lr": 0.5, "demo_weight_decay": 2.0}, "demo_weight_decay"),
    ],
)
def test_bad_config_names_the_setting(options, setting):
    with pytest.raises(ValueError, match=setting):
        DeMoConfig(**options)


def test_registered_with_the_reference_defaults():
    cfg = method_config("demo")
    assert (cfg.compression_decay, cfg.compression_topk, cfg.compression_chunk) == (0.999, 32, 64)
    assert (cfg.demo_lr, cfg.demo_weight_decay) == (4e-4, 0.0)
    assert cfg.max_syncs(100) is None  # every step
    options = method_options()  # every method's fields reconcile into one flag set
    assert options["compression_topk"].defaults["demo"] == 32


def test_chunks_and_basis_follow_the_reference():
    from trainers.compression.dct import ChunkedDCT, dct_matrix
    from trainers.compression.shapes import chunk_length

    for n in (1, 3, 7, 26, 64, 67, 100, 128, 130, 256, 4096):
        for target in (1, 4, 64):
            assert chunk_length(n, target) == ref_split(n, target), (n, target)
    for n in (1, 2, 5, 64):
        assert torch.allclose(dct_matrix(n, torch.float64), ref_basis(n), atol=1e-12, rtol=0)
    g = torch.Generator().manual_seed(0)
    for shape in [*SMALL_SHAPES, *DEFAULT_SHAPES]:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        transform = ChunkedDCT(shape, 64 if shape in DEFAULT_SHAPES else 4)
        target = 64 if shape in DEFAULT_SHAPES else 4
        assert torch.allclose(transform.encode(x), ref_encode(x, target), atol=1e-10, rtol=0)
        assert torch.allclose(transform.decode(transform.encode(x)), x, atol=1e-10, rtol=0)
    # Beyond the reference: more than two dimensions read as (shape[0], the rest); 0-d as one coefficient.
    for shape in [(2, 3, 8), ()]:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        assert torch.allclose(ChunkedDCT(shape, 4).decode(ChunkedDCT(shape, 4).encode(x)), x, atol=1e-10)


# ----------------------------------------------------------------------------------------------------------
# One update, written out by hand
# ----------------------------------------------------------------------------------------------------------

# One 2 x 2 block (chunk 2), whose DCT is X00 = (a+b+c+d)/2, X01 = (a-b+c-d)/2, X10 = (a+b-c-d)/2,
# X11 = (a-b-c+d)/2 for [[a, b], [c, d]] (and the inverse the same formulas), flattened X00, X01, X10, X11.
HAND = DeMoConfig(compression_decay=0.5, compression_topk=2, compression_chunk=2, demo_lr=0.5, demo_weight_decay=0.2)
# Replica 0: coefficients of lr * g = 0.5 * (4, 2, 1, 0) = (2, 1, 0.5, 0): sends #0 = 2 and #1 = 1, keeps #2.
# Replica 1: 0.5 * (-2, 0, 0, -3.5) = (-1, 0, 0, -1.75): sends #3 = -1.75 and #0 = -1, keeps nothing.
HAND_GRADS = [[[3.5, 1.5], [2.5, 0.5]], [[-2.75, 0.75], [0.75, -2.75]]]
HAND_MOMENTA = [[[0.25, 0.25], [-0.25, -0.25]], [[0.0, 0.0], [0.0, 0.0]]]  # 0.5 at #2, decoded
# Each step: theta = (1 - lr wd) theta - lr sign(decoded) = 0.9 - 0.5 sign(decoded), from theta = 1.
# One replica: its own (2, 1, 0, 0) decodes to [[1.5, 0.5], [1.5, 0.5]]: all +.
# Two: #0 is the mean of both senders, 0.5; #1 = 1 and #3 = -1.75 were each sent by one replica and count whole:
# Q = (0.5, 1, 0, -1.75) decodes to [[-0.125, 0.625], [1.625, -1.125]]. (Averaging over both replicas instead,
# Q = (0.5, 0.5, 0, -0.875), would give +0.0625 first.)
HAND_THETA = {1: [[0.4, 0.4], [0.4, 0.4]], 2: [[1.4, 0.4], [0.4, 1.4]]}


def _hand_step(rank: int, group) -> dict:
    weight = torch.nn.Parameter(torch.ones(2, 2))
    method = DeMo(_context([("w", weight)], NO_CLIP, 1, group), HAND)
    weight.grad = torch.tensor(HAND_GRADS[rank])
    report = method.step(0)
    event = None if report is None else report.as_event()
    return {"theta": weight.detach().clone(), "momentum": method.momenta[0].clone(), "report": event}


def _hand_scenario(rank: int) -> dict:
    return _hand_step(rank, dist.group.WORLD)


def test_one_update_by_hand_with_one_replica():
    out = _hand_step(0, None)
    assert out["report"] is None  # nothing crossed a link
    assert torch.allclose(out["theta"], torch.tensor(HAND_THETA[1]), atol=1e-6, rtol=0)
    assert torch.allclose(out["momentum"], torch.tensor(HAND_MOMENTA[0]), atol=1e-6, rtol=0)


def test_one_update_by_hand_with_two_replicas(tmp_path: Path):
    results = run_ranks(_hand_scenario, (), tmp_path)
    for rank, out in enumerate(results):
        assert torch.allclose(out["theta"], torch.tensor(HAND_THETA[2]), atol=1e-6, rtol=0)
        assert torch.allclose(out["momentum"], torch.tensor(HAND_MOMENTA[rank]), atol=1e-6, rtol=0)
        # 2 coefficients of (4 + 8) bytes, sent to the one other replica.
        assert out["report"]["payload_bytes"] == 2 * 12


# ----------------------------------------------------------------------------------------------------------
# Against the reference's formula, over steps
# ----------------------------------------------------------------------------------------------------------


def _trajectory(rank: int, group, cfg: DeMoConfig, shapes, steps: int) -> dict:
    named = _params(shapes)
    method = DeMo(_context(named, CONSTANT, steps, group), cfg)
    out = {"theta": [], "momenta": [], "reports": []}
    for step in range(steps):
        for (_, p), g in zip(named, _grads(shapes, rank, step), strict=True):
            p.grad = g.clone()
        report = method.step(step)
        out["reports"].append(None if report is None else report.as_event())
        out["theta"].append([p.detach().clone() for _, p in named])
        out["momenta"].append([m.clone() for m in method.momenta])
    return out


def _trajectory_scenario(rank: int, cfg: DeMoConfig, shapes, steps: int) -> dict:
    return _trajectory(rank, dist.group.WORLD, cfg, shapes, steps)


def _reference_trajectory(world: int, cfg: DeMoConfig, shapes, steps: int) -> list:
    params = [p.detach().double() for _, p in _params(shapes)]
    momenta = [[torch.zeros(shape, dtype=torch.float64) for shape in shapes] for _ in range(world)]
    trajectory = []
    for step in range(steps):
        grads = [_grads(shapes, r, step) for r in range(world)]
        params, decoded = ref_step(params, momenta, grads, cfg, CONSTANT.grad_clip)
        trajectory.append((params, decoded, [list(m) for m in momenta]))
    return trajectory


@pytest.mark.parametrize(("cfg", "shapes"), [(SMALL, SMALL_SHAPES), (DeMoConfig(), DEFAULT_SHAPES)])
def test_matches_the_reference_with_one_replica(cfg, shapes):
    steps = 3
    out = _trajectory(0, None, cfg, shapes, steps)
    for step, (params, decoded, momenta) in enumerate(_reference_trajectory(1, cfg, shapes, steps)):
        assert_matches_reference(out["theta"][step], params, decoded)
        for m, m_ref in zip(out["momenta"][step], momenta[0], strict=True):
            assert torch.allclose(m.double(), m_ref, atol=1e-7, rtol=1e-5), step
    assert out["reports"] == [None] * steps


@pytest.mark.parametrize(("cfg", "shapes"), [(SMALL, SMALL_SHAPES), (DeMoConfig(), DEFAULT_SHAPES)])
def test_matches_the_reference_with_two_replicas(tmp_path: Path, cfg, shapes):
    steps = 3
    results = run_ranks(_trajectory_scenario, (cfg, shapes, steps), tmp_path)
    reference = _reference_trajectory(2, cfg, shapes, steps)
    for rank, out in enumerate(results):
        for step, (params, decoded, momenta) in enumerate(reference):
            assert_matches_reference(out["theta"][step], params, decoded)
            for m, m_ref in zip(out["momenta"][step], momenta[rank], strict=True):
                assert torch.allclose(m.double(), m_ref, atol=1e-7, rtol=1e-5), (rank, step)
    # The replicas' weights stay identical, bit for bit; their momenta do not.
    for step in range(steps):
        for a, b in zip(results[0]["theta"][step], results[1]["theta"][step], strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(results[0]["momenta"][-1][0], results[1]["momenta"][-1][0])


# ----------------------------------------------------------------------------------------------------------
# The momentum keeps what was not sent; the payload on the wire
# ----------------------------------------------------------------------------------------------------------


def _capture_payloads(install=lambda f: setattr(demo_module, "all_gather_bytes", f)) -> list[torch.Tensor]:
    """Record every payload the method hands to the all-gather, then gather it as usual. In a spawned rank the
    patch dies with the process; in this one `install` is monkeypatch's."""
    captured, gather = [], demo_module.all_gather_bytes

    def capture(payload, group):
        captured.append(payload.clone())
        return gather(payload, group)

    install(capture)
    return captured


def _decode_payload(payload: torch.Tensor, cfg: DeMoConfig, shapes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The wire format, read from its description: every tensor's int64 indices, then every tensor's fp32 values."""
    counts = []
    for shape in shapes:
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        h, w = ref_split(rows, cfg.compression_chunk), ref_split(cols, cfg.compression_chunk)
        counts.append((rows // h * (cols // w), min(cfg.compression_topk, h * w)))
    total = sum(b * k for b, k in counts)
    assert payload.dtype == torch.uint8 and payload.numel() == total * 12
    indices = payload[: 8 * total].view(torch.int64).split([b * k for b, k in counts])
    values = payload[8 * total :].view(torch.float32).split([b * k for b, k in counts])
    return [(i.view(b, k), v.view(b, k)) for i, v, (b, k) in zip(indices, values, counts, strict=True)]


def test_momentum_after_is_decayed_plus_gradient_minus_what_was_sent(monkeypatch):
    cfg, shapes, steps = SMALL, SMALL_SHAPES, 4
    captured = _capture_payloads(lambda f: monkeypatch.setattr(demo_module, "all_gather_bytes", f))
    named = _params(shapes)
    method = DeMo(_context(named, NO_CLIP, steps, None), cfg)
    for step in range(steps):
        before = [m.double().clone() for m in method.momenta]
        grads = _grads(shapes, 0, step)
        for (_, p), g in zip(named, grads, strict=True):
            p.grad = g.clone()
        method.step(step)
        sent = _decode_payload(captured[step], cfg, shapes)
        for m_before, g, m_after, (index, value), shape in zip(
            before, grads, method.momenta, sent, shapes, strict=True
        ):
            accumulated = cfg.compression_decay * m_before + cfg.demo_lr * g.double()
            coefficients = ref_encode(accumulated, cfg.compression_chunk)
            # What was sent is the accumulated momentum's own coefficients, the largest of every block.
            assert torch.allclose(value.double(), coefficients.gather(1, index), atol=1e-7, rtol=0)
            smallest_sent = value.abs().min(dim=1).values.double()
            unsent = coefficients.abs().scatter(1, index, 0.0).max(dim=1).values
            assert (unsent <= smallest_sent + 1e-7).all()
            dense = torch.zeros_like(coefficients).scatter(1, index, value.double())
            expected = accumulated - ref_decode(dense, shape, cfg.compression_chunk)
            assert torch.allclose(m_after.double(), expected, atol=1e-7, rtol=0), step


def _payload_scenario(rank: int, steps: int) -> dict:
    captured = _capture_payloads()
    torch.manual_seed(0)
    model = DecoderLM(get_model_config("tiny"))
    method = DeMo(_context(list(model.named_parameters()), OptimConfig(), steps, dist.group.WORLD), DeMoConfig())
    g = torch.Generator().manual_seed(rank)
    reports = []
    for step in range(steps):
        tokens = torch.randint(0, 256, (4, 33), generator=g)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        reports.append(method.step(step).as_event())
    return {"reports": reports, "payload_numel": [p.numel() for p in captured], "lr": method.lr}


def test_payload_bytes_equal_the_formula_and_the_collective(tmp_path: Path):
    steps = 2
    results = run_ranks(_payload_scenario, (steps,), tmp_path)
    cfg = DeMoConfig()
    shapes = [p.shape for p in DecoderLM(get_model_config("tiny")).parameters()]
    formula = 0
    for shape in shapes:
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        h, w = ref_split(rows, 64), ref_split(cols, 64)
        formula += (rows // h) * (cols // w) * min(32, h * w) * (4 + 8)
    assert formula == 125_184  # the `tiny` model: 10,432 coefficients, 28x fewer than its fp32 gradients
    assert sum(cfg.payload_nbytes(s) for s in shapes) == formula
    (exchange,) = cfg.sync_plan(shapes).exchanges
    assert (exchange.collective, exchange.nbytes) == ("all-gather", formula)
    for out in results:
        assert out["payload_numel"] == [formula] * steps  # what was handed to the collective, each step
        for report in out["reports"]:
            assert report["payload_bytes"] == allgather_payload_bytes(formula, 2) == exchange.payload_bytes(2)
            assert 0 < report["compression_error"] < 1
    # The shared schedule: after 2 of 2 steps the cosine has reached its floor, min_lr_ratio x --demo-lr.
    assert results[0]["lr"] == pytest.approx(OptimConfig().min_lr_ratio * cfg.demo_lr)


# ----------------------------------------------------------------------------------------------------------
# Pipeline stages
# ----------------------------------------------------------------------------------------------------------


def _stage_scenario(rank: int) -> dict:
    """Two stages of one replica (no data-parallel group): each rank holds its own tensor."""
    captured = _capture_payloads()
    weight = torch.nn.Parameter(torch.zeros(4))
    cfg = DeMoConfig(compression_topk=4, compression_chunk=4, demo_lr=0.5)
    method = DeMo(_context([("w", weight)], CONSTANT, 1, None, pipeline_group=dist.group.WORLD), cfg)
    weight.grad = torch.full((4,), 3.0 if rank == 0 else 4.0)  # stage norms 6 and 8: the replica's is 10
    report = method.step(0)
    ((_, value),) = _decode_payload(captured[0], cfg, [(4,)])
    return {"report": None if report is None else report.as_event(), "dc": value.max().item()}


def test_each_stage_sends_its_own_tensors_clipped_over_the_whole_replica(tmp_path: Path):
    for rank, out in enumerate(run_ranks(_stage_scenario, (), tmp_path)):
        assert out["report"] is None  # one cluster: nothing crosses the slow link
        # The DC coefficient of lr * g / 10 (clip 1 of norm 10) = 0.5 * (3 or 4) / 10 * sqrt(4).
        assert out["dc"] == pytest.approx(0.5 * (3.0 if rank == 0 else 4.0) / 10 * 2, rel=1e-5)
