"""The contract between the train loop and a synchronization method.

The train loop owns forward and backward; a method owns everything after: how this rank's gradients or
parameters are synchronized with the same stage of the other clusters, and its optimizers. A method sees only its
own stage's parameters and two process groups; it knows nothing of namespaces, tc or Docker.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainers.config import OptimConfig


@dataclass
class MethodContext:
    """What a method is built from."""

    named_params: list[tuple[str, torch.nn.Parameter]]  # this rank's pipeline stage only
    data_parallel_group: dist.ProcessGroup | None  # same stage on every cluster: the slow link. None: 1 cluster
    pipeline_group: dist.ProcessGroup | None  # the stages of this cluster: fast links. None: 1 stage
    optim: OptimConfig
    total_steps: int
    seed: int

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_params]

    @property
    def replicas(self) -> int:
        return 1 if self.data_parallel_group is None else dist.get_world_size(self.data_parallel_group)


@dataclass
class SyncReport:
    """One synchronization across clusters, as the method accounts for it."""

    payload_bytes: int  # bytes this rank sent for it, by the collective's algorithm (see trainers/comm.py)
    blocked_s: float  # time the training thread waited on communication
    overlapped_s: float = 0.0  # time communication ran while the training thread computed
    fields: dict = field(default_factory=dict)  # method-specific measurements (compression error, rank, ...)

    def as_event(self) -> dict:
        return {
            "payload_bytes": self.payload_bytes,
            "blocked_s": self.blocked_s,
            "overlapped_s": self.overlapped_s,
            **self.fields,
        }


def copy_into(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """Copy tensor by tensor, without autograd (the targets are usually a stage's parameters)."""
    with torch.no_grad():
        torch._foreach_copy_(targets, sources)


@contextlib.contextmanager
def swapped_in(params: list[torch.nn.Parameter], values: list[torch.Tensor]) -> Iterator[None]:
    """`values` in `params` for the duration (evaluating on global weights); the local weights come back after."""
    local = [p.detach().clone() for p in params]
    copy_into(values, params)
    try:
        yield
    finally:
        copy_into(local, params)


class Method(ABC):
    """One synchronization strategy; `step` is called once per training step, after backward."""

    @abstractmethod
    def step(self, step: int) -> SyncReport | None:
        """Consume this step's gradients; return a report when this step synchronized across clusters."""

    def finish(self) -> SyncReport | None:
        """Complete communication still in flight at the end of training."""
        return None

    @contextlib.contextmanager
    def eval_parameters(self) -> Iterator[None]:
        """Parameters to evaluate on: the synchronized (global) ones. Plain data parallel: the model as is."""
        yield

    @abstractmethod
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (inner and outer)."""

    @property
    @abstractmethod
    def lr(self) -> float:
        """The inner learning rate in force."""
