"""Tokens that count are tokens in the final model: each method says how many trained steps its synchronized
parameters hold, DiLoCo-style methods synchronize a partial last round unless told not to, and every method ends
on the same kind of step (trainers/method.py, Method.finish)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.trainers.spawn import run_ranks
from tests.trainers.toy import clones, method_context, toy_backward, toy_model
from trainers.config import OptimConfig
from trainers.method import MethodContext
from trainers.registry import build_method, method_config

OPTIM = OptimConfig(lr=1e-2, warmup_fraction=0.0, min_lr_ratio=1.0)


def _train(method_name: str, options: dict, steps: int) -> tuple[int, list, torch.nn.Module, object]:
    """One replica (no data-parallel group: the outer step runs on its own pseudo-gradient), `steps` steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ctx = MethodContext(list(model.named_parameters()), None, None, OPTIM, steps, seed=0)
    method = build_method(method_name, method_config(method_name, options), ctx)
    reports = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        reports.append(method.step(step))
    reports += method.finish()
    return method.applied_steps(steps), [r for r in reports if r is not None], model, method


@pytest.mark.parametrize("method", ["allreduce", "cocktail", "local"])
def test_methods_that_apply_every_step_count_every_step(method):
    applied, _, _, _ = _train(method, {}, 13)
    assert applied == 13


@pytest.mark.parametrize(
    ("method", "options", "kept_without_final_sync"),
    [
        ("opendiloco", {"local_steps": 10}, 20),
        ("dilocox", {"local_steps": 10, "adaptive": False, "overlap": "delayed"}, 20),
        ("dilocox", {"local_steps": 10, "adaptive": False, "overlap": False}, 20),
        # streaming (the default) sends each round tau = 1 step early: round 1 carries 9 steps, round 2 the 10
        # since; the last round's lead step and the partial round are dropped.
        ("dilocox", {"local_steps": 10, "adaptive": False}, 19),
    ],
)
def test_a_partial_last_round_is_synchronized_by_default_and_dropped_without_final_sync(
    method, options, kept_without_final_sync
):
    applied, _, model, synced = _train(method, options, 25)
    assert applied == 25
    # The final synchronized parameters are what the replica holds after finish(): nothing is left local.
    for p, g in zip(model.parameters(), synced.global_params, strict=True):
        assert torch.equal(p.detach().float(), g)
    dropped, _, _, _ = _train(method, {**options, "final_sync": False}, 25)
    assert dropped == kept_without_final_sync


def test_the_overlapped_rounds_count_only_once_applied():
    """With one-step-delay overlap, round t lands at the end of round t+1: at step 25 (no finish yet) only round 1
    of the two completed rounds is in theta."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ctx = MethodContext(list(model.named_parameters()), None, None, OPTIM, 25, seed=0)
    options = {"local_steps": 10, "adaptive": False, "overlap": "delayed"}
    method = build_method("dilocox", method_config("dilocox", options), ctx)
    for step in range(25):
        torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
        method.step(step)
    assert method.applied_steps(25) == 10
    method.finish()
    assert method.applied_steps(25) == 25


def test_max_syncs_counts_the_partial_round():
    cfg = method_config("opendiloco", {"local_steps": 10})
    assert cfg.max_syncs(25) == 3 and cfg.max_syncs(20) == 2
    assert method_config("opendiloco", {"local_steps": 10, "final_sync": False}).max_syncs(25) == 2
    assert method_config("dilocox", {"local_steps": 125}).max_syncs(200) == 2


# ----------------------------------------------------------------------------------------------------------
# Equal ends: two replicas, a schedule that divides the steps evenly
# ----------------------------------------------------------------------------------------------------------

STEPS, ROUND = 20, 10
RUNS = {
    "allreduce": ("allreduce", {}),
    "local": ("local", {}),
    "cocktail": ("cocktail", {}),
    "demo": ("demo", {}),
    "opendiloco": ("opendiloco", {"local_steps": ROUND}),
    "sparseloco": ("sparseloco", {"local_steps": ROUND}),
    # streaming with alpha > 0 (the default overlap, tau = 1, alpha = 0.5), and the other overlap modes.
    **{
        f"dilocox-{overlap}": ("dilocox", {"local_steps": ROUND, "adaptive": False, "overlap": overlap})
        for overlap in ("streaming", "none", "delayed", "eager")
    },
}


def _ends(rank: int) -> dict:
    out = {}
    for name, (method_name, options) in RUNS.items():
        model = toy_model()
        ctx = method_context(model, OPTIM, STEPS, dist.group.WORLD)
        method = build_method(method_name, method_config(method_name, options), ctx)
        reports = []
        for step in range(STEPS):
            toy_backward(model, rank, step)
            report = method.step(step)
            if report is not None:
                reports.append(report.as_event())
        final = [r.as_event() for r in method.finish()]
        out[name] = {
            "applied": method.applied_steps(STEPS),
            "reports": reports,
            "finish": final,
            "theta": clones(method.global_params) if method.keeps_global_copy else [],
        }
    return out


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory) -> list[dict]:
    return run_ranks(_ends, (), tmp_path_factory.mktemp("ends"), 2)


def test_every_method_applies_every_trained_step(two_replicas):
    for out in two_replicas:
        assert {name: run["applied"] for name, run in out.items()} == dict.fromkeys(RUNS, STEPS)


def test_dilocox_ends_on_an_ordinary_outer_step_in_every_overlap_mode(two_replicas):
    """Streaming with alpha > 0 once exchanged a round of no new inner steps in finish() and took a whole Nesterov
    step on it: now its last round sends at its end, so every outer step ends a round of H inner steps."""
    for out in two_replicas:
        for overlap in ("streaming", "none", "delayed", "eager"):
            run = out[f"dilocox-{overlap}"]
            outer_steps = [r for r in run["reports"] + run["finish"] if "round_steps" in r]
            assert [r["round_steps"] for r in outer_steps] == [ROUND] * (STEPS // ROUND), overlap
            assert all(r["payload_bytes"] > 0 for r in outer_steps)
        # Nothing is left for streaming's finish(); delayed and eager apply their last exchange there, sending nothing.
        assert out["dilocox-streaming"]["finish"] == [] and out["dilocox-none"]["finish"] == []
        for overlap in ("delayed", "eager"):
            (landed,) = out[f"dilocox-{overlap}"]["finish"]
            assert landed["payload_bytes"] == 0 and "round_steps" not in landed
    first, second = (out["dilocox-streaming"]["theta"] for out in two_replicas)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
