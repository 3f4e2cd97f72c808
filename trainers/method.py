"""The contract between the train loop and a synchronization method.

The train loop owns forward and backward; a method owns everything after: how this rank's gradients or
parameters are synchronized with the same stage of the other clusters, and its optimizers. A method sees only its
own stage's parameters and two process groups; it knows nothing of namespaces, tc or Docker. Its config declares
how it uses the slow link (`MethodConfig.sync_plan`), which is what `harness project` models.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist

from trainers.comm import allgather_payload_bytes, allreduce_payload_bytes
from trainers.config import OptimConfig
from trainers.fault_tolerance import ManagedGroup
from trainers.optim import InnerOptimizer, optimizer_state

Collective = Literal["all-reduce", "all-gather"]


@dataclass(frozen=True)
class Exchange:
    """One collective over the data-parallel group, as the method calls it (trainers/comm.py).

    all-reduce: `nbytes` is the buffer every replica sums (the same size on all); all-gather: `nbytes` is each
    replica's own payload, which every other replica receives.
    """

    collective: Collective
    nbytes: int

    def payload_bytes(self, replicas: int) -> int:
        """What each replica sends for it: the method's SyncReport counts the same."""
        if self.collective == "all-reduce":
            return allreduce_payload_bytes(self.nbytes, replicas)
        return allgather_payload_bytes(self.nbytes, replicas)


@dataclass(frozen=True)
class SyncPlan:
    """How a method uses the slow link, as its config declares it (`MethodConfig.sync_plan`). Nothing here knows
    the link: `harness project` turns a plan into time with its link model, the same way for every method.

    A synchronization starts `exchanges` together, each as its own collective (gloo works a group's collectives
    side by side), so their bytes add up and the longest sets its time; `sequential`: one after another (each needs
    the one before: PowerSGD's P then Q), so their times add up too. It comes every `every_steps` steps (1: every
    step; H: once a round). `hidden_steps` steps of forward and backward run while it is in flight before the
    method waits for it: 0 blocks at once, 1 hides it behind the next step, tau behind a round's last tau steps, H
    behind the whole next round. The first `warmup_steps` steps each synchronize with `warmup_exchanges` instead,
    blocking. `slow_start`: the first synchronization after the warm-up is the first large transfer on fresh
    connections, so TCP's slow start lengthens it (a method that synchronizes from step 0 leaves it off: that first
    exchange falls in the run's throughput warm-up, outside tokens/s). `adaptive`: the method changes its rounds
    during a run; the plan is its first round's, from which adaptation only lowers the bytes per step.
    """

    exchanges: tuple[Exchange, ...]
    every_steps: int = 1
    hidden_steps: int = 0
    warmup_steps: int = 0
    warmup_exchanges: tuple[Exchange, ...] = ()
    slow_start: bool = False
    adaptive: bool = False
    sequential: bool = False


def numel(shapes: Iterable[Sequence[int]]) -> int:
    return sum(math.prod(shape) for shape in shapes)


class MethodConfig:
    """What every method's config (a frozen dataclass subclassing this, `Method.config_class`) answers besides its
    fields, the method's settings. The defaults: no bound on synchronizations to warn of, nothing declared sent."""

    def max_syncs(self, steps: int) -> int | None:
        """The most synchronizations a run of `steps` steps makes; None: synchronizes every step or never."""
        return None

    def check_shapes(self, shapes: Sequence[torch.Size]) -> None:
        """Refuse, with a ValueError naming the flag, settings that cannot work on a model of these parameter
        shapes (checked before a run starts); the default accepts every model."""

    def checkpoint_refusal(self) -> str | None:
        """Why a run with these settings cannot be checkpointed, as the fix to make (None: it can, where the
        method is `resumable`)."""
        return None

    def fault_tolerance_refusal(self) -> str | None:
        """Why fault tolerance (trainers/fault_tolerance.py) cannot carry a run with these settings, as the fix to
        make; None: it can. A method is carried once every exchange it makes runs on the ManagedGroup and its state
        between rounds is all in its state_dict (what a rejoining replica fetches); the default says it is not."""
        return (
            "its exchange does not run on torchft's reconfigurable group yet; use allreduce, opendiloco, dilocox, "
            "sparseloco or demo with fault tolerance (a method of your own that can be carried says so: "
            "docs/writing-a-method.md)"
        )

    def sync_plan(self, shapes: Sequence[torch.Size]) -> SyncPlan | None:
        """How the method uses the slow link when a replica's parameters have these shapes (the whole model: a
        pipeline stage sends its own share of it); None: it sends nothing across clusters."""
        return None


@dataclass(frozen=True)
class RoundConfig(MethodConfig):
    """The settings of a DiLoCo-family round, each documented here once: `local_steps` inner steps alone, then a
    synchronization; what BlockingRounds reads. The default H is DiLoCo's; a method with another published value
    declares it with `default_of`, keeping the doc."""

    local_steps: int = field(
        default=500,
        metadata={
            "help": "H: inner AdamW steps each replica trains alone between two outer steps (steps per round); the "
            "first round's, H_1, where adaptation lengthens later rounds (up to max_local_steps)."
        },
    )
    final_sync: bool = field(
        default=True,
        metadata={
            "help": "Synchronize the steps of an unfinished last round at the end of the run (blocking), so every "
            "trained token is in the final model; final_sync=false drops them, as DiLoCo does (they then do not "
            "count as applied tokens)."
        },
    )

    def max_syncs(self, steps: int) -> int:
        """The most outer steps a run of `steps` steps takes: rounds are never shorter than local_steps."""
        return -(-steps // self.local_steps) if self.final_sync else steps // self.local_steps


@dataclass(frozen=True)
class NesterovRoundConfig(RoundConfig):
    """A round that ends in DiLoCo's outer step, Nesterov SGD on theta fed the replicas' mean pseudo-gradient
    (trainers/optim.py, OuterOptimizer), at DiLoCo's lr 0.7 and momentum 0.9."""

    outer_lr: float = field(
        default=0.7,
        metadata={
            "help": "eta: learning rate of the outer Nesterov SGD step on theta, the global weights, fed the "
            "replicas' averaged pseudo-gradient; above 0."
        },
    )
    outer_momentum: float = field(
        default=0.9, metadata={"help": "mu: Nesterov momentum of the outer SGD step, in [0, 1)."}
    )


def default_of(config: type, name: str, default: Any) -> Any:
    """Field `name` of `config` with another default and the same doc: a method's own value of a shared setting."""
    (shared,) = [f for f in fields(config) if f.name == name]
    return field(default=default, metadata=shared.metadata)


@dataclass
class MethodContext:
    """What a method is built from."""

    named_params: list[tuple[str, torch.nn.Parameter]]  # this rank's pipeline stage only
    # The same stage on every cluster: the slow link (a ManagedGroup under fault tolerance). None: 1 cluster.
    data_parallel_group: dist.ProcessGroup | ManagedGroup | None
    pipeline_group: dist.ProcessGroup | None  # the stages of this cluster: fast links. None: 1 stage
    optim: OptimConfig
    total_steps: int
    seed: int

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_params]

    @property
    def replicas(self) -> int:
        """The replicas an exchange averages over: the data-parallel group's, or under fault tolerance those in
        the current quorum (trainers/fault_tolerance.py)."""
        group = self.data_parallel_group
        if group is None:
            return 1
        return group.size() if isinstance(group, ManagedGroup) else dist.get_world_size(group)


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


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Method(ABC):
    """One synchronization strategy; `step` is called once per training step, after backward.

    The base class holds what every method shares: its config (`self.cfg`), this stage's parameters, the inner
    optimizer (`self.inner`, and `lr` from it) and, for methods that set `keeps_global_copy`, the global
    parameters theta_global: an fp32 copy of this stage, identical on every replica, that evaluation runs on.
    A subclass is its config and its algorithm.
    """

    config_class: ClassVar[type[MethodConfig]]  # the method's settings; the CLI's flags come from its fields
    # Whether state_dict holds all the method keeps, so a checkpointed run resumes bit for bit (checkpoint_every).
    resumable: ClassVar[bool] = False
    # A method from outside the repository: the name its runs carry (default: the class's name in lower case). A
    # built-in's name is its key in trainers/registry.py.
    name: ClassVar[str | None] = None
    keeps_global_copy: ClassVar[bool] = False

    def __init__(self, ctx: MethodContext, cfg: MethodConfig):
        self.ctx = ctx
        self.cfg = cfg
        self.names = [name for name, _ in ctx.named_params]
        self.params = ctx.params
        self.inner = InnerOptimizer(self.params, ctx.optim, ctx.total_steps, ctx.pipeline_group)
        # Replicas start from identical weights (same seed), so copying the local model makes theta_global
        # identical on every replica without a broadcast.
        self.global_params = [p.detach().clone().float() for p in self.params] if self.keeps_global_copy else []

    @abstractmethod
    def step(self, step: int) -> SyncReport | None:
        """Consume this step's gradients; return a report when this step synchronized across clusters."""

    def finish(self) -> list[SyncReport]:
        """Complete communication still in flight at the end of training: one report per exchange sent or average
        applied here, in order (the train loop logs each as its own `finish` event).

        Every method ends the same way, so runs compare at equal ends: the last update is of the same kind as the
        run's others and carries the steps trained since the one before (an average or outer step is taken only on
        a round with new inner steps, never an extra one on nothing new), and where the schedule divides the steps
        evenly every trained step is applied (applied tokens = trained tokens; DiLoCoX's streaming at alpha = 0,
        which drops each round's last tau steps by design, aside)."""
        return []

    def applied_steps(self, trained_steps: int) -> int:
        """How many of the `trained_steps` steps have their updates in the synchronized parameters now: the tokens
        that count. Always a prefix of the run (updates are applied in order). Methods that apply every step's
        update by the end (after `finish`) keep this default."""
        return trained_steps

    def eval_parameters(self) -> contextlib.AbstractContextManager[None]:
        """Parameters to evaluate on: theta_global where the method keeps one, else the model as it is."""
        if self.keeps_global_copy:
            return swapped_in(self.params, self.global_params)
        return contextlib.nullcontext()

    def state_dict(self) -> dict[str, Any]:
        """Everything the method keeps between steps besides the model's own weights, as torch tensors and plain
        values: what a checkpoint saves (trainers/checkpoint.py) so that a resumed run continues bit for bit. The
        base class's part: the inner AdamW and its schedule, and theta_global. A method that keeps more extends it
        and `load_state_dict`; one that cannot be resumed leaves `resumable` False (the run refuses
        checkpoint_every for it)."""
        return {
            "inner_optimizer": self.inner.optimizer.state_dict(),
            "inner_schedule": self.inner.scheduler.state_dict(),
            "global_params": self.global_params,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict`'s output, on a method built from the same config and context."""
        self.inner.optimizer.load_state_dict(optimizer_state(state["inner_optimizer"]))
        self.inner.scheduler.load_state_dict(state["inner_schedule"])
        if self.global_params:
            copy_into(state["global_params"], self.global_params)

    def checkpointable(self) -> bool:
        """Whether the state now is all in `state_dict`: nothing in flight on the link. A checkpoint is taken at
        the first step where this holds once the interval is due, the same step on every rank (the methods'
        schedules are identical everywhere)."""
        return True

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: the inner AdamW moments and theta_global.

        theta_global counts as optimizer state because it exists only for the method's outer update; a plain
        data-parallel run would not hold it. Methods add what else they keep (outer momentum, residuals).
        """
        return self.inner.state_bytes() + tensor_bytes(self.global_params)

    @property
    def lr(self) -> float:
        """The inner learning rate in force."""
        return self.inner.lr


class BlockingRounds(Method):
    """A DiLoCo-style method whose rounds block: `local_steps` inner steps (its RoundConfig's), then
    `outer_step()`, which synchronizes across clusters and returns its report. With `final_sync` the steps of an
    unfinished last round are synchronized in `finish()`, so every trained token is in the final model."""

    keeps_global_copy = True
    cfg: RoundConfig

    def __init__(self, ctx: MethodContext, cfg: RoundConfig):
        super().__init__(ctx, cfg)
        self.steps_in_round = 0
        self.synchronized_steps = 0

    @abstractmethod
    def outer_step(self) -> SyncReport:
        """Synchronize this round's progress and start the next round from the result."""

    def step(self, step: int) -> SyncReport | None:
        self.inner.step()
        self.steps_in_round += 1
        if self.steps_in_round < self.cfg.local_steps:
            return None
        return self._end_round()

    def finish(self) -> list[SyncReport]:
        if self.cfg.final_sync and self.steps_in_round:
            return [self._end_round()]
        return []

    def applied_steps(self, trained_steps: int) -> int:
        return self.synchronized_steps

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "steps_in_round": self.steps_in_round,
            "synchronized_steps": self.synchronized_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps_in_round = state["steps_in_round"]
        self.synchronized_steps = state["synchronized_steps"]

    def _end_round(self) -> SyncReport:
        report = self.outer_step()
        self.synchronized_steps += self.steps_in_round
        self.steps_in_round = 0
        return report
