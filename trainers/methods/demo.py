"""DeMo, Decoupled Momentum optimization (arXiv 2411.19870; reference code bloc97/DeMo, demo.py and its OLMo
configs): every step each replica sends the fast components of its own momentum, and all step with the sign of
their average. The basis of Nous Research's DisTrO / Psyche runs.

There is no inner/outer loop and no AdamW: DeMo is the optimizer (the reference subclasses SGD and steps with a
sign). Every step t, on every replica i, for every tensor of this rank's pipeline stage, after backward:

    g_i = clip(grad)                                   the whole replica's clip at OptimConfig.grad_clip 1.0 (the
                                                       reference runs' max_grad_norm 1.0)
    m_i = beta m_i + eta_t g_i                         beta = compression_decay (0.999); eta_t below
    X_i = DCT(m_i)                                     chunked orthonormal DCT-II, (blocks, h*w)
                                                       (trainers/compression/dct.py)
    q_i = top-k of X_i by magnitude in every block     k = compression_topk (32), at most h*w
    m_i = m_i - IDCT(q_i)                              the momentum keeps exactly what was not sent
    all-gather the q_j (values and their indices)
    Q[b, c] = mean of q_j[b, c] over the replicas j that sent coefficient c of block b (0 where none did)
    theta = (1 - eta_t lambda) theta - eta_t sign(IDCT(Q))      lambda = demo_weight_decay (0)

eta_t = demo_lr (4e-4, the reference's OLMo-300M and 1B DeMo configs) times the shared schedule of
trainers/optim.py: linear warm-up, then cosine to OptimConfig.min_lr_ratio (0.1) of the peak, as the reference runs'
cosine_with_warmup with alpha_f 0.1. `--lr` is the AdamW peak every other method uses; DeMo steps no AdamW, so it
reads demo_lr instead (the two defaults are both the reference's 4e-4).

Where the paper (Algorithm 1 of v1; its text was not at hand here, so the paper's side is as we recall it) and the
reference code differ, this follows the code:

- the momentum accumulates the learning-rate-scaled gradient, m = beta m + eta_t g (the paper: m = beta m + g);
- the step is the sign of the decoded average, theta -= eta_t sign(IDCT(Q)) (the paper: theta -= eta Q);
- Synchronize averages each coefficient over the replicas that sent it (the code's scatter-reduce "mean" without
  the zero it scatters into), not over all replicas: a coefficient one replica of two sent counts whole;
- weight decay is decoupled, theta *= 1 - eta_t lambda before the step, on every tensor (1-D ones too), 0 by
  default as in the reference's DeMo configs.

Chunking follows the reference (trainers/compression/dct.py): a dimension of length n is cut into blocks of its
largest divisor <= compression_chunk (64), so nothing is padded (130 -> 26; a prime above 64 -> 1); 2-D tensors
are chunked in both dimensions (h x w blocks, up to 64 x 64 = 4096 coefficients, of which k are sent), 1-D ones along
their one dimension (w coefficients). Beyond the reference: 0-d tensors are read as (1, 1), tensors of more than two
dimensions as (shape[0], the rest).

What crosses the link, per replica per step: for every tensor, k' = min(k, h*w) coefficients of each block, the
value as the momentum's fp32 (the reference sends the parameter's dtype, fp32 under OLMo's amp) and its index in
the block as int64 (torch.topk's, which the reference gathers as is):

    payload_nbytes = sum over tensors of blocks * k' * (4 + 8)

all-gathered in one collective (the reference runs two per tensor; the bytes are the same), so each replica sends
(n - 1) payload_nbytes (trainers/comm.py). The `tiny` model: 10,432 coefficients, 125,184 bytes, 28.0x fewer than
its fp32 gradients (3,502,080; `small`: 1,211,904 bytes, 36.1x); the int64 indices are 2/3 of it.

Every replica decodes the same gathered bytes in the same order, so the replicas' weights stay identical (their
momenta do not): the average is summed replica by replica with scatter-add, each call writing a position at most once,
so the sum does not depend on the order of atomic adds on a GPU (the reference's scatter-reduce over the
concatenated coefficients carries a TODO that it is not deterministic across CUDA devices; not yet run on a GPU
here). With pipeline stages every rank does this for its own stage's tensors with the same
stage of the other clusters; the clip spans the whole replica. With one replica nothing is sent and it steps with
the sign of its own sent components.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainers.comm import all_gather_bytes
from trainers.compression.dct import ChunkedDCT
from trainers.method import (
    Exchange,
    Method,
    MethodConfig,
    MethodContext,
    SyncPlan,
    SyncReport,
    copy_into,
    tensor_bytes,
)
from trainers.optim import clip_grad_norm

# What one sent coefficient costs: its value (fp32) and its index within its block (int64), as the reference sends.
VALUE_DTYPE, INDEX_DTYPE = torch.float32, torch.int64
COEFFICIENT_BYTES = VALUE_DTYPE.itemsize + INDEX_DTYPE.itemsize


@dataclass(frozen=True)
class DeMoConfig(MethodConfig):
    """The reference's published settings (its demo.py defaults and OLMo DeMo configs)."""

    compression_decay: float = field(
        default=0.999, metadata={"help": "DeMo's momentum decay beta, in [0, 1): m = beta m + lr g."}
    )
    compression_topk: int = field(
        default=32,
        metadata={
            "help": "k: DCT coefficients of the momentum sent per chunk, the largest by magnitude (a 2-D tensor's "
            "chunk is h x w; at most the chunk's size is sent); an integer of at least 1."
        },
    )
    compression_chunk: int = field(
        default=64,
        metadata={
            "help": "Target chunk side, in elements: each dimension is cut at its largest divisor not above it; an "
            "integer of at least 1."
        },
    )
    demo_lr: float = field(
        default=4e-4,
        metadata={
            "help": "Peak learning rate of DeMo's sign step, on the run's warm-up and cosine schedule (DeMo steps no "
            "AdamW, so --lr is unused); a positive finite number."
        },
    )
    demo_weight_decay: float = field(
        default=0.0,
        metadata={
            "help": "Decoupled weight decay: theta *= 1 - lr * demo_weight_decay every step; at least 0, and times "
            "demo_lr below 1."
        },
    )

    def __post_init__(self) -> None:
        if not (_real(self.compression_decay) and 0 <= self.compression_decay < 1):
            raise ValueError(f"compression_decay must be in [0, 1), got {self.compression_decay}")
        for name, value in (
            ("compression_topk", self.compression_topk),
            ("compression_chunk", self.compression_chunk),
        ):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an integer of at least 1, got {value}")
        if not (_real(self.demo_lr) and 0 < self.demo_lr < math.inf):
            raise ValueError(f"demo_lr must be a positive finite number, got {self.demo_lr}")
        if not (_real(self.demo_weight_decay) and 0 <= self.demo_weight_decay < math.inf):
            raise ValueError(f"demo_weight_decay must be a finite number of at least 0, got {self.demo_weight_decay}")
        # The schedule never exceeds the peak, so this keeps 1 - lr * wd positive: decay shrinks, never flips.
        if self.demo_lr * self.demo_weight_decay >= 1:
            raise ValueError(
                f"demo_weight_decay times demo_lr must be below 1, got {self.demo_weight_decay} x {self.demo_lr}"
            )

    def transform(self, shape: Sequence[int]) -> ChunkedDCT:
        return ChunkedDCT(shape, self.compression_chunk)

    def kept(self, transform: ChunkedDCT) -> int:
        """k', the coefficients sent per block: compression_topk, at most the block's size (the reference clamps)."""
        return min(self.compression_topk, transform.block_size)

    def payload_nbytes(self, shape: Sequence[int]) -> int:
        """One tensor's share of a replica's payload: blocks * k' * (4 + 8) bytes (module docstring)."""
        transform = self.transform(shape)
        return transform.blocks * self.kept(transform) * COEFFICIENT_BYTES

    def fault_tolerance_refusal(self) -> str | None:
        return None  # one blocking all-gather a step; the momenta are in state_dict

    def sync_plan(self, shapes: Sequence[torch.Size]) -> SyncPlan:
        """Every step one all-gather of every tensor's coefficients, blocking: the step needs the average."""
        return SyncPlan((Exchange("all-gather", sum(self.payload_nbytes(shape) for shape in shapes)),))


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class DeMo(Method):
    config_class = DeMoConfig
    resumable = True

    def __init__(self, ctx: MethodContext, cfg: DeMoConfig):
        super().__init__(ctx, cfg)
        self.transforms = [cfg.transform(p.shape) for p in self.params]
        self.kept = [cfg.kept(t) for t in self.transforms]
        # m_i, this replica's own: it never crosses the link and differs between replicas.
        self.momenta = [torch.zeros_like(p, dtype=VALUE_DTYPE) for p in self.params]
        # The shared warm-up + cosine (trainers/optim.py) as a factor of the peak: the base class's AdamW scheduler
        # holds it; that AdamW is never stepped, so it holds no state either.
        self.schedule = self.inner.scheduler.lr_lambdas[0]
        self.next_step = 0

    def lr_at(self, step: int) -> float:
        """eta_t: demo_lr on the run's schedule."""
        return self.cfg.demo_lr * self.schedule(step)

    @property
    def lr(self) -> float:
        """The learning rate in force for the next step, as the other methods report their AdamW's."""
        return self.lr_at(self.next_step)

    def step(self, step: int) -> SyncReport | None:
        lr = self.lr_at(step)
        clip_grad_norm(self.params, self.ctx.optim.grad_clip, self.ctx.pipeline_group)
        payload, compression_error = self._extract(lr)
        gathered, inflight = all_gather_bytes(payload, self.ctx.data_parallel_group)
        blocked_s, _ = inflight.wait()
        self._apply(gathered, lr)
        for p in self.params:
            p.grad = None
        self.next_step = step + 1
        if self.ctx.data_parallel_group is None:
            return None
        return SyncReport(
            payload_bytes=inflight.payload_bytes,
            blocked_s=blocked_s,
            fields={"compression_error": compression_error},
        )

    @torch.no_grad()
    def _extract(self, lr: float) -> tuple[torch.Tensor, float]:
        """Accumulate the gradients, take each momentum's top-k DCT coefficients out of it; returns this replica's
        payload (every index, then every value, as raw bytes) and ||m after|| / ||m before|| over the stage."""
        indices, values, before, after = [], [], [], []
        for p, m, transform, k in zip(self.params, self.momenta, self.transforms, self.kept, strict=True):
            m.mul_(self.cfg.compression_decay)
            if p.grad is not None:  # a tensor without a gradient still decays and sends, so sizes match
                m.add_(p.grad, alpha=lr)
            coefficients = transform.encode(m)
            index = coefficients.abs().topk(k, dim=1, sorted=False).indices
            value = coefficients.gather(1, index)
            before.append(m.pow(2).sum())
            m.sub_(transform.decode(torch.zeros_like(coefficients).scatter_(1, index, value)))
            after.append(m.pow(2).sum())
            indices.append(index.reshape(-1))
            values.append(value.reshape(-1))
        # Indices first: the int64 block starts at byte 0 and the fp32 block at a multiple of 8, so a receiver
        # reads both as views of the gathered buffer.
        payload = torch.cat([torch.cat(indices).view(torch.uint8), torch.cat(values).view(torch.uint8)])
        before_sq, after_sq = torch.stack(before).sum().item(), torch.stack(after).sum().item()
        return payload, math.sqrt(after_sq / before_sq) if before_sq > 0 else 0.0

    def _unpack(self, payload: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One replica's payload -> (indices, values) per tensor, each (blocks, k')."""
        counts = [t.blocks * k for t, k in zip(self.transforms, self.kept, strict=True)]
        split = sum(counts) * INDEX_DTYPE.itemsize
        indices = payload[:split].view(INDEX_DTYPE).split(counts)
        values = payload[split:].view(VALUE_DTYPE).split(counts)
        return [
            (index.view(t.blocks, k), value.view(t.blocks, k))
            for index, value, t, k in zip(indices, values, self.transforms, self.kept, strict=True)
        ]

    @torch.no_grad()
    def _apply(self, gathered: list[torch.Tensor], lr: float) -> None:
        """Decode the average of every replica's coefficients and take the sign step (module docstring)."""
        replicas = [self._unpack(payload.to(self.momenta[0].device)) for payload in gathered]
        decay = 1 - lr * self.cfg.demo_weight_decay
        for i, (p, m, transform) in enumerate(zip(self.params, self.momenta, self.transforms, strict=True)):
            total = m.new_zeros(transform.blocks, transform.block_size)
            senders = torch.zeros_like(total)
            # A replica's indices are distinct within a block, so each scatter-add writes a position at most once.
            for sent in replicas:
                index, value = sent[i]
                total.scatter_add_(1, index, value)
                senders.scatter_add_(1, index, torch.ones_like(value))
            average = total / senders.clamp(min=1)
            if decay != 1:
                p.mul_(decay)
            p.add_(transform.decode(average).sign().to(p.dtype), alpha=-lr)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "momenta": self.momenta, "next_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        copy_into(state["momenta"], self.momenta)
        self.next_step = state["next_step"]

    def optimizer_state_bytes(self) -> int:
        """The momenta (the unstepped AdamW holds nothing)."""
        return super().optimizer_state_bytes() + tensor_bytes(self.momenta)
