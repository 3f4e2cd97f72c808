"""OpenDiLoCo (arXiv 2407.07852): H local AdamW steps, then an outer Nesterov step on the averaged
pseudo-gradient.

Every replica trains alone for H = local_steps inner steps, then all replicas agree on one update of the
global parameters theta_global, an fp32 copy of this stage that the method keeps, identical on every replica:

    delta_i      = theta_global - theta_i                   replica i's pseudo-gradient (this stage only)
    Delta        = mean_i cast(delta_i)                     all-reduce over the data-parallel group, in fp16
    theta_global = OuterSGD(theta_global, grad=Delta)       Nesterov momentum 0.9, lr 0.7
    theta_i      = theta_global                             every replica starts the next round from it

The all-reduce is blocking: nothing overlaps it. The inner AdamW keeps its moments across rounds, as
OpenDiLoCo does. With one cluster (no data-parallel group) the outer step still runs on the local
pseudo-gradient, so H and the outer learning rate mean the same at every cluster count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainers.comm import all_reduce_sum, flatten, unflatten_into
from trainers.compression.cast import CAST_DTYPES, CastDtype
from trainers.method import (
    BlockingRounds,
    Exchange,
    MethodContext,
    NesterovRoundConfig,
    SyncPlan,
    SyncReport,
    copy_into,
    numel,
)
from trainers.optim import OuterOptimizer, validate_outer


@dataclass(frozen=True)
class OpenDiLoCoConfig(NesterovRoundConfig):
    """OpenDiLoCo's published settings (DiLoCo's H = 500, outer lr 0.7, momentum 0.9: trainers/method.py's
    RoundConfig); benchmarks on small models use a much smaller H."""

    pseudo_grad_dtype: CastDtype = field(
        default="fp16",
        metadata={
            "help": "The dtype pseudo-gradients are cast to, sent and summed in by the all-reduce: fp16, bf16 or "
            "fp32 (2, 2 or 4 bytes per value)."
        },
    )

    def fault_tolerance_refusal(self) -> str | None:
        return None  # one all-reduce a round, on torchft's group; nothing in flight between rounds

    def sync_plan(self, shapes: Sequence[torch.Size]) -> SyncPlan:
        """The pseudo-gradients' all-reduce in pseudo_grad_dtype once a round, blocking."""
        nbytes = CAST_DTYPES[self.pseudo_grad_dtype].itemsize * numel(shapes)
        return SyncPlan((Exchange("all-reduce", nbytes),), self.local_steps, slow_start=True)

    def __post_init__(self) -> None:
        validate_outer(self.local_steps, self.outer_lr, self.outer_momentum)
        if self.pseudo_grad_dtype not in CAST_DTYPES:
            raise ValueError(
                f"pseudo_grad_dtype must be one of {', '.join(CAST_DTYPES)}, got {self.pseudo_grad_dtype!r}"
            )


class OpenDiLoCo(BlockingRounds):
    config_class = OpenDiLoCoConfig
    resumable = True

    def __init__(self, ctx: MethodContext, cfg: OpenDiLoCoConfig):
        super().__init__(ctx, cfg)
        self.outer = OuterOptimizer(self.global_params, cfg.outer_lr, cfg.outer_momentum)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "outer_optimizer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.outer.load_state_dict(state["outer_optimizer"])

    @torch.no_grad()
    def outer_step(self) -> SyncReport:
        pseudo_grads = [g - p for g, p in zip(self.global_params, self.params, strict=True)]
        # One flat bucket, cast before the all-reduce so the link carries pseudo_grad_dtype: gloo and NCCL sum
        # fp16 and bf16 natively. The sum is taken in the wire dtype, as OpenDiLoCo's fp16 all-reduce does.
        wire = flatten(pseudo_grads).to(CAST_DTYPES[self.cfg.pseudo_grad_dtype])
        inflight = all_reduce_sum(wire, self.ctx.data_parallel_group)
        blocked_s, _ = inflight.wait()
        averaged = wire.float() / self.ctx.replicas
        unflatten_into(averaged, pseudo_grads)

        self.outer.step(pseudo_grads)
        copy_into(self.global_params, self.params)
        fields = {"pseudo_grad_norm": averaged.norm().item(), "local_steps": self.steps_in_round}
        return SyncReport(payload_bytes=inflight.payload_bytes, blocked_s=blocked_s, fields=fields)

    def optimizer_state_bytes(self) -> int:
        """Inner AdamW moments, theta_global and the outer momentum buffer."""
        return super().optimizer_state_bytes() + self.outer.state_bytes()
