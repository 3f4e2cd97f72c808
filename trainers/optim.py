"""Optimizers shared by the methods: the inner AdamW with its schedule, and the outer Nesterov SGD."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from trainers.config import OptimConfig


def inner_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warm-up to cfg.lr, then cosine decay to cfg.lr * cfg.min_lr_ratio at total_steps."""
    params = list(params)
    # Norms and biases are not decayed (the usual GPT recipe); they are the 1-D parameters.
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, foreach=True)
    warmup = max(1, int(cfg.warmup_fraction * total_steps))

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


class InnerOptimizer:
    """The inner step every method takes after backward: clip over the whole replica, AdamW, schedule, zero."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        cfg: OptimConfig,
        total_steps: int,
        pipeline_group: dist.ProcessGroup | None,
    ):
        self.params = params
        self.grad_clip = cfg.grad_clip
        self.pipeline_group = pipeline_group
        self.optimizer, self.scheduler = inner_optimizer(params, cfg, total_steps)

    def step(self) -> None:
        clip_grad_norm(self.params, self.grad_clip, self.pipeline_group)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)


def validate_outer(local_steps: int, outer_lr: float, outer_momentum: float) -> None:
    """The DiLoCo family's round length and outer optimizer, checked with the flags' names."""
    if local_steps < 1:
        raise ValueError(f"local_steps must be at least 1, got {local_steps}")
    if not 0 < outer_lr < math.inf:
        raise ValueError(f"outer_lr must be a positive finite number, got {outer_lr}")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")


class OuterOptimizer:
    """DiLoCo's outer step: SGD with Nesterov momentum on theta_global, fed the replicas' averaged pseudo-gradient.

    A pseudo-gradient theta_global - theta_i points from where a round ended back to where it started, so a
    descent step on it with lr 1 and no momentum moves theta_global to the replicas' average.
    """

    def __init__(self, global_params: list[torch.Tensor], lr: float, momentum: float):
        self.global_params = global_params
        self.optimizer = torch.optim.SGD(global_params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    @torch.no_grad()
    def step(self, pseudo_grads: list[torch.Tensor]) -> None:
        for global_param, pseudo_grad in zip(self.global_params, pseudo_grads, strict=True):
            global_param.grad = pseudo_grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        """The momentum buffer."""
        return optimizer_state_bytes(self.optimizer)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(optimizer_state(state))


def optimizer_state(saved: dict) -> dict:
    """A torch optimizer's state_dict as a checkpoint gives it back, ready for load_state_dict:
    torch.distributed.checkpoint keeps dict keys as strings, and an optimizer's state is keyed by the parameters'
    integer positions."""
    return {**saved, "state": {int(index): value for index, value in saved.get("state", {}).items()}}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by an optimizer's state tensors (moments, momentum buffers)."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float, pipeline_group: dist.ProcessGroup | None
) -> float:
    """Clip by the norm of the whole replica's gradient, which spans every pipeline stage of the cluster."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    if pipeline_group is not None:
        dist.all_reduce(sq, group=pipeline_group)
    norm = sq.sqrt().item()
    if norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm
