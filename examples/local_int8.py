"""Local SGD with an int8 average: every local_steps steps each replica sends how far its weights moved since the
last average, as int8 codes and one fp32 scale, and all move the anchor by the mean (docs/writing-a-method.md)."""

from dataclasses import dataclass, field

import torch

from trainers.comm import all_gather_bytes, flatten, unflatten_into
from trainers.method import Exchange, Method, MethodConfig, SyncPlan, SyncReport, numel


@dataclass(frozen=True)
class LocalInt8Config(MethodConfig):
    local_steps: int = field(default=10, metadata={"help": "Inner steps between two averages."})

    def sync_plan(self, shapes):
        return SyncPlan((Exchange("all-gather", numel(shapes) + 4),), every_steps=self.local_steps)


class LocalInt8(Method):
    name = "localint8"
    config_class = LocalInt8Config

    def __init__(self, ctx, cfg):
        super().__init__(ctx, cfg)
        self.anchor = flatten(self.params).detach().clone()

    @torch.no_grad()
    def step(self, step):
        self.inner.step()
        if (step + 1) % self.cfg.local_steps or self.ctx.data_parallel_group is None:
            return None
        moved = flatten(self.params) - self.anchor
        scale = (moved.abs().max() / 127).clamp(min=1e-12).reshape(1)
        payload = torch.cat([torch.round(moved / scale).to(torch.int8).view(torch.uint8), scale.view(torch.uint8)])
        gathered, inflight = all_gather_bytes(payload, self.ctx.data_parallel_group)
        blocked_s, _ = inflight.wait()
        self.anchor += sum(g[:-4].view(torch.int8) * g[-4:].view(torch.float32) for g in gathered) / len(gathered)
        unflatten_into(self.anchor, self.params)
        return SyncReport(payload_bytes=inflight.payload_bytes, blocked_s=blocked_s)
