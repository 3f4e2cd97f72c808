"""AllReduce: the baseline every low-communication method is measured against.

Every step, the gradients of this stage are averaged over the data-parallel group (the same stage on every
cluster, across the slow link) in fp32, then the inner AdamW steps. Replicas stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainers.comm import all_reduce_sum, flatten, unflatten_into
from trainers.method import Exchange, Method, MethodConfig, SyncPlan, SyncReport, numel


@dataclass(frozen=True)
class AllReduceConfig(MethodConfig):
    """AllReduce has no knobs of its own: fp32 gradients, one flat bucket, every step."""

    def fault_tolerance_refusal(self) -> str | None:
        return None  # FT-DDP: the all-reduce runs on torchft's group, and the inner AdamW is all the state

    def sync_plan(self, shapes: Sequence[torch.Size]) -> SyncPlan:
        """The fp32 gradients' all-reduce, every step, blocking."""
        return SyncPlan((Exchange("all-reduce", torch.float32.itemsize * numel(shapes)),))


class AllReduce(Method):
    config_class = AllReduceConfig
    resumable = True  # the inner AdamW is all it keeps: the base class's state_dict

    def step(self, step: int) -> SyncReport | None:
        grads = [p.grad for p in self.params]
        # One flat bucket: a single large message keeps the link busy instead of paying per-tensor latency.
        flat = flatten(grads)
        inflight = all_reduce_sum(flat, self.ctx.data_parallel_group)
        blocked_s, _ = inflight.wait()
        unflatten_into(flat / self.ctx.replicas, grads)

        self.inner.step()
        if self.ctx.data_parallel_group is None:
            return None
        return SyncReport(payload_bytes=inflight.payload_bytes, blocked_s=blocked_s)
