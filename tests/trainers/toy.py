"""A toy problem for the DiLoCo-family method tests: a small linear model, reproducible gradients, known offsets."""

from __future__ import annotations

import math

import torch

from trainers.config import OptimConfig
from trainers.method import MethodContext

# A constant, large inner learning rate makes every inner step move the weights visibly.
TOY_OPTIM = OptimConfig(lr=1e-2, warmup_fraction=0.0, min_lr_ratio=1.0)


def toy_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def toy_loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    """The loss on replica `rank`'s batch at `step`."""
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def toy_backward(model: torch.nn.Module, rank: int, step: int) -> float:
    """The gradients of replica `rank`'s batch at `step`; its loss."""
    loss = toy_loss(model, rank, step)
    loss.backward()
    return loss.item()


def method_context(model: torch.nn.Module, optim: OptimConfig, steps: int, group) -> MethodContext:
    return MethodContext(list(model.named_parameters()), group, None, optim, steps, seed=0)


def clones(tensors) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def known_offset(rank: int, round_: int, shape: torch.Size) -> torch.Tensor:
    """A replica's known progress in a round: multiples of 1/8, exact in fp32 and fp16."""
    pattern = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) % 4 - 1.5
    return pattern * 0.125 * (rank + 1) * round_
