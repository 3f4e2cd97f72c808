"""Every method's declared use of the slow link (MethodConfig.sync_plan, what `harness project` models) against what
the method really sends: two replicas over gloo, every registered method, the bytes and the steps of its reports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.trainers.spawn import run_ranks
from tests.trainers.toy import TOY_OPTIM
from trainers.method import MethodConfig, MethodContext, SyncPlan
from trainers.registry import build_method, method_config, method_names, option_names

REPLICAS = 2


def _options(name: str) -> dict:
    """The method's defaults, with rounds short enough for a test; low-rank factors smaller than the toy's matrices."""
    names = option_names(name)
    return {k: v for k, v in {"local_steps": 3, "rank": 4}.items() if k in names}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def _plan(name: str) -> SyncPlan | None:
    return method_config(name, _options(name)).sync_plan([p.shape for p in _model().parameters()])


@pytest.mark.parametrize("name", method_names())
def test_every_method_declares_a_well_formed_plan(name):
    cfg = method_config(name)
    assert isinstance(cfg, MethodConfig), f"{name}'s config_class must subclass trainers.method.MethodConfig"
    steps = cfg.max_syncs(1000)
    assert steps is None or 0 < steps <= 1000
    plan = _plan(name)
    if plan is None:
        return
    assert plan.exchanges and plan.every_steps >= 1 and plan.hidden_steps >= 0 and plan.warmup_steps >= 0
    for exchange in (*plan.exchanges, *plan.warmup_exchanges):
        assert exchange.collective in ("all-reduce", "all-gather") and exchange.nbytes > 0, exchange
    assert bool(plan.warmup_steps) == bool(plan.warmup_exchanges)


def _reports(rank: int, names: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Per method: (step, payload bytes) of each report that sent something, over warm-up and one round."""
    sent = {}
    for name in names:
        model = _model()
        plan = _plan(name)
        steps = plan.warmup_steps + plan.every_steps if plan else 3
        ctx = MethodContext(list(model.named_parameters()), dist.group.WORLD, None, TOY_OPTIM, steps, seed=0)
        method = build_method(name, method_config(name, _options(name)), ctx)
        sent[name] = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * rank + step)
            x, y = torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
            report = method.step(step)
            if report is not None and report.payload_bytes:
                sent[name].append((step, report.payload_bytes))
        method.finish()
    return sent


def test_the_plan_is_what_the_method_sends(tmp_path: Path):
    names = method_names()
    results = run_ranks(_reports, (names,), tmp_path, world=REPLICAS)
    for name in names:
        plan = _plan(name)
        expected = []
        if plan is not None:
            warmup = sum(e.payload_bytes(REPLICAS) for e in plan.warmup_exchanges)
            expected = [(step, warmup) for step in range(plan.warmup_steps)]
            steady = sum(e.payload_bytes(REPLICAS) for e in plan.exchanges)
            expected.append((plan.warmup_steps + plan.every_steps - 1, steady))
        for rank, sent in enumerate(results):
            assert sent[name] == expected, (name, rank)
