"""Tokens that count are tokens in the final model: each method says how many trained steps its synchronized
parameters hold, and DiLoCo-style methods synchronize a partial last round unless told not to."""

from __future__ import annotations

import pytest
import torch

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
