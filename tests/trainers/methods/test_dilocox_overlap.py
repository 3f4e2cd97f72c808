"""DiLoCoX's overlap modes (--overlap none|delayed|eager|streaming): configuration and flags, what each applies
when, where each restarts the replica, and which steps each counts as applied.

One replica in this process where the rule is visible alone; the two-replica scenarios run in one spawn (gloo over
loopback), each test checking its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.trainers.spawn import run_scenarios
from tests.trainers.toy import TOY_OPTIM, clones, known_offset, method_context, toy_backward, toy_loss, toy_model
from trainers.method import MethodContext
from trainers.methods.dilocox import DiLoCoX, DiLoCoXConfig
from trainers.registry import build_method, method_config

WORLD = 2
TIMINGS = ("blocked_s", "overlapped_s")


# ----------------------------------------------------------------------------------------------------------
# Configuration and flags
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "mode"),
    [(True, "delayed"), (False, "none"), (None, "none"), ("none", "none"), ("eager", "eager")],
)
def test_the_old_switch_maps_to_modes(given, mode):
    """Sweeps pass overlap=true/false as bools (the committed reference sweep did); method_config reads the string
    'none' as None."""
    assert DiLoCoXConfig(overlap=given).overlap == mode
    if given is not None:  # to method_config, None means "not set"
        assert method_config("dilocox", {"overlap": given}).overlap == mode
    assert DiLoCoXConfig().overlap == "streaming"


def test_the_default_lead_is_a_tenth_of_the_round():
    """tau = H_1 // 10 unless given: what the convergence study ran (5 at H = 50), and never a lead the round lacks."""
    assert DiLoCoXConfig(local_steps=50).overlap_steps == 5
    assert DiLoCoXConfig().overlap_steps == 2  # H_1 = 20
    assert DiLoCoXConfig(local_steps=5).overlap_steps == 0
    assert DiLoCoXConfig(local_steps=50, overlap_steps=7).overlap_steps == 7


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"overlap": "sometimes"},
            r"overlap (must be|takes) one of none, delayed, eager, streaming[;,] got 'sometimes'",
        ),
        ({"overlap_steps": -1}, "overlap_steps must be at least 0, got -1"),
        ({"overlap": "streaming", "local_steps": 5, "overlap_steps": 5}, "overlap_steps must be below local_steps"),
        ({"merge_alpha": 1.5}, r"merge_alpha must be in \[0, 1\], got 1.5"),
        ({"merge_alpha": -0.1}, "merge_alpha"),
    ],
)
def test_bad_overlap_settings_name_the_setting(options, message):
    with pytest.raises(ValueError, match=message):
        DiLoCoXConfig(**options)
    with pytest.raises(ValueError, match=message):
        method_config("dilocox", options)


def test_tau_is_checked_only_where_it_is_used():
    assert DiLoCoXConfig(overlap="delayed", local_steps=2, overlap_steps=5).overlap == "delayed"
    assert DiLoCoXConfig(overlap="streaming", local_steps=6, overlap_steps=5, merge_alpha=1.0).overlap_steps == 5


def test_the_modes_are_a_setting_and_a_switch_of_before_still_reads():
    """--set overlap=MODE; a recorded or swept true/false (overlap was a switch) reads as delayed/none."""
    from harness.run.settings import parse_assignments, run_settings

    given = run_settings("dilocox", parse_assignments(["overlap=eager"]))
    assert method_config("dilocox", given).overlap == "eager"
    assert method_config("dilocox", run_settings("dilocox", parse_assignments(["overlap=none"]))).overlap == "none"
    assert method_config("dilocox", {"overlap": False}).overlap == "none"
    assert method_config("dilocox", {"overlap": True}).overlap == "delayed"


# ----------------------------------------------------------------------------------------------------------
# One replica
# ----------------------------------------------------------------------------------------------------------


def _run(options: dict, steps: int, finish: bool = True, group=None, rank: int = 0) -> dict:
    """The toy model trained `steps` steps with real gradients; what the method reported and holds."""
    model = toy_model()
    method = DiLoCoX(method_context(model, TOY_OPTIM, steps, group), DiLoCoXConfig(**options))
    reports, restarts, thetas, losses = [], [], [], []
    for step in range(steps):
        losses.append(toy_backward(model, rank, step))
        report = method.step(step)
        if report is not None:
            reports.append({k: v for k, v in report.as_event().items() if k not in TIMINGS})
            restarts.append(clones(model.parameters()))
            thetas.append(clones(method.global_params))
    final = method.finish() if finish else []
    with method.eval_parameters(), torch.no_grad():
        val = toy_loss(model, 99, 0).item()
    return {
        "losses": losses,
        "val": val,
        "reports": reports,
        "restarts": restarts,
        "thetas": thetas,
        "finish": [{k: v for k, v in r.as_event().items() if k not in TIMINGS} for r in final],
        "global": clones(method.global_params),
        "local": clones(model.parameters()),
        "applied": method.applied_steps(steps),
    }


@pytest.mark.parametrize(
    ("rank", "compression"),
    # At r_1 = 4 the toy's 4 x 8 weight goes whole and r adapts (H 4 -> 5); at 2 it goes as factors.
    [(4, True), (2, True), (4, False)],
)
def test_streaming_without_lead_or_blend_is_none(rank, compression):
    """tau = 0 starts the exchange at the round's end and alpha = 0 takes theta whole: blocking DiLoCo, bit for bit
    (adaptation on, and a partial last round for finish())."""
    common = {"local_steps": 4, "rank": rank, "min_rank": 1, "rank_window": 2, "compression": compression}
    none = _run({**common, "overlap": "none"}, 25)
    streaming = _run({**common, "overlap": "streaming", "overlap_steps": 0, "merge_alpha": 0.0}, 25)
    assert len(none["reports"]) >= 5 and none["finish"]
    assert none["reports"] == streaming["reports"] and none["finish"] == streaming["finish"]
    for key in ("global", "local"):
        assert all(torch.equal(a, b) for a, b in zip(none[key], streaming[key], strict=True)), key
    assert none["applied"] == streaming["applied"] == 25
    # Not vacuous: a lead of one step changes the result.
    led = _run({**common, "overlap": "streaming", "overlap_steps": 1, "merge_alpha": 0.0}, 25)
    assert not all(torch.equal(a, b) for a, b in zip(none["global"], led["global"], strict=True))


@pytest.mark.parametrize(
    "exchange",
    [
        {"compression": False},
        {"exchange": "gather"},
        {"exchange": "reduce"},
        {"exchange": "reduce", "reduce_wire": "int4"},
    ],
    ids=["fp16", "gather", "reduce", "reduce-int4"],
)
@pytest.mark.parametrize("adaptive", [True, False])
def test_none_and_streaming_without_lead_or_blend_lose_the_same_step_by_step(exchange, adaptive):
    """Why trainers/overlap.py runs overlap=none as streaming at tau = 0, alpha = 0: every step's loss and the final
    theta's val loss are equal to the bit, with every exchange, adapting or not, with a partial last round."""
    common = {"local_steps": 4, "rank": 2, "min_rank": 1, "rank_window": 2, "adaptive": adaptive, **exchange}
    none = _run({**common, "overlap": "none"}, 25)
    streaming = _run({**common, "overlap": "streaming", "overlap_steps": 0, "merge_alpha": 0.0}, 25)
    assert none["losses"] == streaming["losses"] and none["val"] == streaming["val"]
    # Not vacuous: a lead of one step loses differently.
    led = _run({**common, "overlap": "streaming", "overlap_steps": 1, "merge_alpha": 0.0}, 25)
    assert led["losses"] != none["losses"]


def test_eager_with_one_replica_restarts_where_blocking_diloco_is():
    """One replica, no momentum: its fresh share is the whole of Delta_t, so the look-ahead s = theta_t - eta
    D(P^t) is the theta that applying round t gives one round later (under delayed, the restart lacks it)."""
    common = {"local_steps": 3, "outer_momentum": 0.0, "rank": 4, "min_rank": 1, "rank_window": 2}
    eager = _run({**common, "overlap": "eager"}, 15, finish=False)
    delayed = _run({**common, "overlap": "delayed"}, 15, finish=False)
    for t in range(len(eager["reports"]) - 1):
        for restart, theta_next in zip(eager["restarts"][t], eager["thetas"][t + 1], strict=True):
            torch.testing.assert_close(restart, theta_next, rtol=0, atol=1e-6)
        # Delayed restarts from the committed theta itself.
        assert all(torch.equal(a, b) for a, b in zip(delayed["restarts"][t], delayed["thetas"][t], strict=True))
    assert max((a - b).abs().max().item() for a, b in zip(eager["restarts"][0], eager["thetas"][0], strict=True)) > 1e-3


def _hand_streaming() -> dict:
    """One replica, H = 4, tau = 1, alpha = 0.5, fp16 exchange, lr 0.5, no momentum; weights set by hand. The first
    round of an 8-step run (the round a run ends in sends at its end, not tau steps early)."""
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.fill_(0.25)
    cfg = DiLoCoXConfig(
        local_steps=4, outer_lr=0.5, outer_momentum=0.0, compression=False, adaptive=False, overlap="streaming",
        overlap_steps=1, merge_alpha=0.5,
    )  # fmt: skip
    method = DiLoCoX(method_context(model, TOY_OPTIM, 8, None), cfg)
    theta_0 = clones(method.global_params)
    weights = []
    for step in range(4):
        # No gradients, so the inner step leaves the weights; they move by a known offset per step instead.
        with torch.no_grad():
            for p in model.parameters():
                p += known_offset(0, 1, p.shape)
        weights.append(clones(model.parameters()))
        method.step(step)
    return {"theta_0": theta_0, "weights": weights, "theta": clones(method.global_params),
            "local": clones(model.parameters())}  # fmt: skip


def test_streaming_sends_tau_steps_early_and_blends():
    out = _hand_streaming()
    lr = 0.5
    for theta_0, w3, w4, theta, local in zip(
        out["theta_0"], out["weights"][2], out["weights"][3], out["theta"], out["local"], strict=True
    ):
        # The pseudo-gradient is the weights' after step H - tau = 3, not after step 4.
        expected = theta_0 - lr * (theta_0 - w3)
        torch.testing.assert_close(theta, expected, rtol=0, atol=1e-7)
        assert not torch.allclose(theta, theta_0 - lr * (theta_0 - w4))
        # The replica continues from lerp(theta, local, alpha): half its own weights, half theta.
        torch.testing.assert_close(local, 0.5 * w4 + 0.5 * theta, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# Applied steps in every mode
# ----------------------------------------------------------------------------------------------------------

OPTIM = TOY_OPTIM
MODES = {
    "none": {"overlap": "none"},
    "delayed": {"overlap": "delayed"},
    "eager": {"overlap": "eager"},
    "streaming": {"overlap": "streaming", "overlap_steps": 2, "merge_alpha": 0.0},
    "streaming-blend": {"overlap": "streaming", "overlap_steps": 2, "merge_alpha": 0.5},
}


def _applied(options: dict, steps: int, finish: bool) -> tuple[int, list, list]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ctx = MethodContext(list(model.named_parameters()), None, None, OPTIM, steps, seed=0)
    method = build_method("dilocox", method_config("dilocox", {"local_steps": 10, "adaptive": False, **options}), ctx)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        method.step(step)
    if finish:
        method.finish()
    return method.applied_steps(steps), clones(model.parameters()), clones(method.global_params)


@pytest.mark.parametrize(
    ("mode", "steps", "before_finish", "final_sync", "no_final_sync"),
    [
        # Rounds end at steps 10 and 20; a blocking round is in theta at once, an overlapped one a round later.
        ("none", 25, 20, 25, 20),
        ("delayed", 25, 10, 25, 20),
        ("eager", 25, 10, 25, 20),
        # tau = 2: a round's exchange carries its first 8 steps; alpha = 0 drops the other 2, and the last 5 go as
        # a partial round.
        ("streaming", 25, 16, 21, 16),
        # ... alpha = 0.5 carries them into the next round's exchange.
        ("streaming-blend", 25, 18, 25, 18),
        # At 29 steps the third round would start its exchange at step 28, within tau of the end: the round in which
        # training ends sends at its end instead (in finish(), all its 9 steps), or is dropped without final sync.
        ("streaming", 29, 16, 25, 16),
        ("streaming-blend", 29, 18, 29, 18),
    ],
)
def test_applied_steps_in_every_mode(mode, steps, before_finish, final_sync, no_final_sync):
    assert _applied(MODES[mode], steps, finish=False)[0] == before_finish
    applied, local, theta = _applied(MODES[mode], steps, finish=True)
    assert applied == final_sync
    # Training ends on theta, on every replica.
    assert all(torch.equal(p.float(), g) for p, g in zip(local, theta, strict=True))
    assert _applied({**MODES[mode], "final_sync": False}, steps, finish=True)[0] == no_final_sync


# ----------------------------------------------------------------------------------------------------------
# Two processes
# ----------------------------------------------------------------------------------------------------------

HAND_LR, HAND_MOMENTUM = 0.5, 0.5


def _hand_rounds(rank: int, overlap: str) -> dict:
    """Round length 2, the local weights moved by a known offset at each round's end, fp16 exchange, Nesterov."""
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.fill_(0.25)
    cfg = DiLoCoXConfig(
        local_steps=2, outer_lr=HAND_LR, outer_momentum=HAND_MOMENTUM, compression=False, adaptive=False,
        overlap=overlap,
    )  # fmt: skip
    method = DiLoCoX(method_context(model, TOY_OPTIM, 6, dist.group.WORLD), cfg)
    out = {"theta_0": clones(method.global_params), "theta": [], "restart": []}
    for step in range(6):
        if step % 2:
            with torch.no_grad():
                for p in model.parameters():
                    p += known_offset(rank, step // 2 + 1, p.shape)
        if method.step(step) is not None:
            out["theta"].append(clones(method.global_params))
            out["restart"].append(clones(model.parameters()))
    method.finish()
    out["final"] = clones(method.global_params)
    out["final_local"] = clones(model.parameters())
    return out


def _streaming_vs_none(rank: int) -> dict:
    common = {"local_steps": 4, "rank": 4, "min_rank": 1, "rank_window": 2}
    return {
        "none": _run({**common, "overlap": "none"}, 14, group=dist.group.WORLD, rank=rank),
        "streaming": _run(
            {**common, "overlap": "streaming", "overlap_steps": 0, "merge_alpha": 0.0},
            14,
            group=dist.group.WORLD,
            rank=rank,
        ),
    }


def _all_scenarios(rank: int) -> dict:
    return {
        "delayed": _hand_rounds(rank, "delayed"),
        "eager": _hand_rounds(rank, "eager"),
        "streaming_vs_none": _streaming_vs_none(rank),
    }


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory) -> dict[str, list[dict]]:
    return run_scenarios(_all_scenarios, tmp_path_factory.mktemp("dilocox_overlap"), WORLD)


def test_eager_commits_the_delayed_recursion_and_restarts_ahead_by_its_fresh_share(two_replicas):
    for rank, (delayed, eager) in enumerate(zip(two_replicas["delayed"], two_replicas["eager"], strict=True)):
        # theta is the delayed one, bit for bit, round after round: same averages, same momentum, one step each.
        # (Each round's delta is measured from where the round started, the look-ahead, and equals -offset.)
        for ours, theirs in zip(eager["theta"] + [eager["final"]], delayed["theta"] + [delayed["final"]], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        # Round 1 commits nothing; round t's restart is theta_t - eta (1 + mu) D(P_i^t) / n, D(P_i^t) = -offset.
        scale = HAND_LR * (1 + HAND_MOMENTUM) / WORLD
        for t, (theta, restart) in enumerate(zip(eager["theta"], eager["restart"], strict=True), start=1):
            for theta_w, restart_w in zip(theta, restart, strict=True):
                fresh = -known_offset(rank, t, theta_w.shape)
                torch.testing.assert_close(restart_w, theta_w - scale * fresh, rtol=0, atol=1e-7)
                # Not the stale share swapped in on the committed theta: that restart lacks round t-1's own share.
                if t > 1:
                    stale = -known_offset(rank, t - 1, theta_w.shape)
                    assert (restart_w - (theta_w - scale * (fresh - stale))).abs().max() > 1e-2
        assert all(torch.equal(a, b) for a, b in zip(delayed["restart"][0], delayed["theta_0"], strict=True))
        # finish() leaves every replica on the committed theta.
        assert all(torch.equal(a, b) for a, b in zip(eager["final_local"], eager["final"], strict=True))
    # The committed theta is identical on both replicas; their restart points are not.
    first, second = two_replicas["eager"]
    assert all(torch.equal(a, b) for a, b in zip(first["final"], second["final"], strict=True))
    assert not torch.equal(first["restart"][0][0], second["restart"][0][0])


def test_streaming_without_lead_or_blend_is_none_on_two_replicas(two_replicas):
    for out in two_replicas["streaming_vs_none"]:
        none, streaming = out["none"], out["streaming"]
        assert none["reports"] == streaming["reports"] and none["finish"] == streaming["finish"]
        assert none["reports"][0]["payload_bytes"] > 0
        for key in ("global", "local"):
            assert all(torch.equal(a, b) for a, b in zip(none[key], streaming[key], strict=True)), key
    first, second = (out["streaming"]["global"] for out in two_replicas["streaming_vs_none"])
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
