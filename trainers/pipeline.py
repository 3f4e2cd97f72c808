"""Pipeline stages inside a cluster.

A `Stage` is this rank's part of one replica and how it runs forward and backward for one training step. With
one stage per cluster it is the whole model; with S stages the model is cut into S consecutive parts and a
torch.distributed.pipelining schedule moves micro-batches between the cluster's ranks over its fast links.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainers.models import DecoderLM, ModelConfig

if TYPE_CHECKING:
    from trainers.hf_models import HFDecoder, HFModelConfig

    LanguageModel = DecoderLM | HFDecoder

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


class Stage(ABC):
    """This rank's slice of one replica."""

    module: nn.Module  # the parameters this rank owns and updates
    is_first: bool
    is_last: bool

    @abstractmethod
    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One step's forward and backward on this stage's parameters; returns the replica's mean loss."""

    @abstractmethod
    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss of the replica on `batches`, forward only."""


class WholeModel(Stage):
    """One stage per cluster: the rank holds the whole replica."""

    is_first = True
    is_last = True

    def __init__(self, model: LanguageModel):
        self.module = model

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = self.module(inputs, targets)
        loss.backward()
        return loss.item()

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        return sum(self.module(x, y).item() for x, y in batches) / len(batches)


def split_points(n_layers: int, stages: int) -> list[int]:
    """Block boundaries of a cut into `stages` parts: stage i runs blocks[points[i]:points[i + 1]].

    The first `n_layers % stages` stages take one block more than the rest, e.g. 6 layers into 4 stages gives
    [0, 2, 4, 5, 6].
    """
    if not 1 <= stages <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {stages} stages; use between 1 and {n_layers} stages")
    base, extra = divmod(n_layers, stages)
    points = [0]
    for i in range(stages):
        points.append(points[-1] + base + (i < extra))
    return points


def _check_cut(cfg: ModelConfig | HFModelConfig, stages: int) -> None:
    """The checks on cutting a model into `stages` parts that need no batch shape."""
    if stages < 1:
        raise ValueError(f"--stages must be at least 1, got {stages}")
    if stages > cfg.n_layers:
        raise ValueError(
            f"--stages {stages} exceeds the {cfg.n_layers} layers of model {cfg.name!r}; use at most {cfg.n_layers}"
        )
    if stages > 1 and not cfg.splittable:
        raise ValueError(
            f"model {cfg.name!r} is a {cfg.model_type} model, and pipeline stages cut only opt, llama, qwen2, qwen3 "
            f"and mistral models at decoder-layer boundaries; use --stages 1"
        )
    if stages > 1 and cfg.tie_embeddings:
        raise ValueError(
            f"model {cfg.name!r} ties its lm head to the token embedding, so the first and last stage would "
            f"share one weight on two ranks; use --stages 1 or a model with untied embeddings"
        )


def validate_pipeline(model_cfg: ModelConfig | HFModelConfig, stages: int, microbatches: int, batch_size: int) -> None:
    """Reject a pipeline layout before any process starts; micro-batches only matter when stages > 1."""
    _check_cut(model_cfg, stages)
    if stages == 1:
        return
    if microbatches < stages:
        raise ValueError(
            f"--microbatches {microbatches} is fewer than --stages {stages}, which would leave stages idle; "
            f"use at least {stages}"
        )
    if batch_size % microbatches:
        raise ValueError(
            f"--batch-size {batch_size} is not divisible by --microbatches {microbatches}; "
            f"use a batch size that is a multiple of {microbatches}"
        )


class StageModule(nn.Module):
    """Blocks [start, stop) of a model, with its embedding on the first stage and its head on the last.

    Parameters keep the names they have in the whole model ("embed.tokens.weight", "blocks.2.attn.q.weight",
    "head.proj.weight"), so logs, checkpoints and the same stage on other clusters agree on what each tensor
    is.
    """

    def __init__(self, model: LanguageModel, start: int, stop: int, first: bool, last: bool):
        super().__init__()
        self.embed: nn.Module | None = model.embed if first else None
        # A ModuleDict keyed by the original index: a ModuleList would renumber the blocks from 0.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, stop)})
        self.head: nn.Module | None = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


class PipelinedStage(Stage):
    """One of `stages` consecutive parts of the replica, run by a GPipe or 1F1B schedule over `group`.

    Gradients: the schedule runs one backward per micro-batch, so `.grad` receives the sum of the micro-batch
    losses' gradients. Its own remedy (scale_grads=True) divides every `.grad` of the stage by the number of
    micro-batches after each step, which also shrinks gradient accumulated before the step, and in torch 2.13
    `eval()` runs that division too. So scaling is off and the loss divides each micro-batch's mean loss by
    the number of micro-batches instead: over equal micro-batches these terms sum to the full-batch mean loss,
    and backward adds its gradient to `.grad` exactly as `loss.backward()` does for the unsplit model.

    Every batch given to `forward_backward` or `evaluate` must split into `microbatches` equal parts, and all
    batches of one mode (training or evaluation) must have one shape: the schedule infers the shapes it
    sends between stages from the first batch after each switch between the two, by running that batch's
    first micro-batch through the stage once more.
    """

    def __init__(
        self,
        model: LanguageModel,
        stage_index: int,
        stages: int,
        group: dist.ProcessGroup,
        microbatches: int,
        schedule: ScheduleName = "1f1b",
    ):
        _check_cut(model.cfg, stages)
        if dist.get_world_size(group) != stages or dist.get_rank(group) != stage_index:
            raise ValueError(
                f"stage {stage_index} of {stages} needs a pipeline group of {stages} ranks in which it is "
                f"rank {stage_index}; got rank {dist.get_rank(group)} of {dist.get_world_size(group)}"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
        points = split_points(model.cfg.n_layers, stages)
        self.is_first = stage_index == 0
        self.is_last = stage_index == stages - 1
        start, stop = points[stage_index], points[stage_index + 1]
        self.module = StageModule(model, start, stop, self.is_first, self.is_last)
        self.group = group
        self.microbatches = microbatches
        self.device = next(model.parameters()).device
        self._last_rank = stages - 1  # a rank in `group`, where ranks are stage indices
        # Imported here, not with the module: torch.distributed.pipelining pulls in torch._dynamo and DTensor, 3 s of
        # every worker's start-up on these cores, which a run of one stage per cluster never uses.
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        pipeline_stage = PipelineStage(self.module, stage_index, stages, self.device, group=group)
        self.schedule = schedule_class(
            pipeline_stage, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False
        )

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the full-batch mean cross-entropy (see the class docstring)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / self.microbatches

    def _run(self, step: Callable[..., object], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run `step` (the schedule's step or eval) on one batch; the batch's mean loss on the last stage."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        # Logits are not kept for merging: only the losses are needed, and [B, T, vocab] can be large.
        if self.is_last:
            step(*args, target=targets, losses=losses, return_outputs=False)
            return torch.stack(losses).sum().detach()
        step(*args, return_outputs=False)
        return torch.zeros((), dtype=torch.float32, device=self.device)

    def _from_last(self, loss: torch.Tensor) -> float:
        """The last stage's value on every stage: one scalar over the fast link."""
        dist.broadcast(loss, group=self.group, group_src=self._last_rank)
        return loss.item()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return self._from_last(self._run(self.schedule.step, inputs, targets))

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        total = torch.stack([self._run(self.schedule.eval, x, y) for x, y in batches]).sum()
        return self._from_last(total) / len(batches)


def build_stage(
    model: LanguageModel,
    stage_index: int,
    stages: int,
    group: dist.ProcessGroup | None,
    microbatches: int,
    schedule: str,
) -> Stage:
    """This rank's stage: the whole model when a cluster has one stage, else its part of the pipeline."""
    if stages == 1:
        return WholeModel(model)
    if group is None:
        raise ValueError(f"{stages} pipeline stages need a pipeline process group; got None")
    return PipelinedStage(model, stage_index, stages, group, microbatches, schedule)
