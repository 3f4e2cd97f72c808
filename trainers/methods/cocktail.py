"""CocktailSGD (ICML 2023; reference code DS3Lab/CocktailSGD): every step a compressed model delta, applied
one step late.

Every replica i trains its own model x_i with the inner AdamW; all replicas keep the same fp32 global model g.
The first warmup_steps steps average the whole model exactly (blocking fp32 all-reduce: g = x_i = mean_j x_j).
After that, at step t, right after the inner step:

    1. Finish step t-1, whose gather ran while this step computed. Every rank decodes every rank's payload:
           U = mean_j D(P_j)                                 the workers' average (transmitted) delta
           u = D(C_{t-1}(U + s)),  s = U + s - u             aggregating side: compression with residual s
           x_i = (g + u) + (x_i - g - D(P_i))                = x_i + u - D(P_i)
           g = g + u
    2. Send step t:
           delta_i = x_i - g                                 the model delta since the last global model
           P_i = C_t(delta_i)
       and start all-gathering the P_i without waiting for them.

C_t is the SparseQuantizeCompressor at step t: the rotating random mask (every rank derives the same one from
t and the seed), top-k within it, int-bits quantization. Each parameter tensor is compressed on its own, as
CocktailSGD does per parameter, so top-k picks within a tensor and positions mostly fit in 2 bytes; the
stage's payloads are concatenated into one buffer and gathered with one collective.

Worker-side error feedback lives in the local model. Every worker applies the same average u, and takes off
its lead over g only what it transmitted, D(P_i). So after step 1, x_i - g = e_i + (what this step's inner
step added), where e_i = delta_i - D(P_i) is exactly error feedback's residual from step t-1, and step 2
compresses delta_i = e_i + progress: the compensated input of error feedback, with no separate buffer to
count it twice. Replicas differ from g (and from each other) by what compression has held back so far, and
gradients are taken on a model that keeps all of its own progress. With error_feedback=false the whole
delta_i is taken off instead (x_i = x_i + u - delta_i) and what compression dropped is lost. With every
compression off both are plain averaging of deltas one step late: g after step t+1 = mean_j x_j after step t.

The aggregating side. In CocktailSGD each worker is the server of one shard: it averages the workers'
compressed shards, compresses that average again with its own residual, and broadcasts it. Here every rank
gathers every payload, so every rank computes the same average U and runs the server's compression itself;
the residual s is identical on every rank, and g moves by exactly what the server would have broadcast. With
an all-gather the second compression saves no bytes (nothing more is sent) and only delays part of U; it is
kept, as server_compression (default on), to reproduce CocktailSGD's update; server_compression=false
applies U itself. Wire bytes: an all-gather sends (n-1) payloads per rank, CocktailSGD's all-to-all plus
all-gather of the compressed average about 2(n-1)/n: the same for two clusters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trainers.comm import InFlight, all_gather_bytes, all_reduce_sum, flatten, unflatten_into
from trainers.compression.compressors import SparseQuantizeCompressor, mean_of_payloads
from trainers.compression.error_feedback import ErrorFeedback, relative_error
from trainers.compression.quantize import validate_quantization_flags
from trainers.method import Exchange, Method, MethodConfig, MethodContext, SyncPlan, SyncReport, numel, tensor_bytes


@dataclass(frozen=True)
class CocktailConfig(MethodConfig):
    """CocktailSGD's published settings (0.1 x 0.2 x 4 bits)."""

    random_keep: float = field(
        default=0.1,
        metadata={
            "help": "Fraction of each tensor's coordinates in the step's random mask, which every rank derives from "
            "the step and the seed (no positions sent), in (0, 1]; 1 turns the mask off."
        },
    )
    topk_keep: float = field(
        default=0.2,
        metadata={
            "help": "Fraction of the masked coordinates sent: their top-k by magnitude, positions sent with them, in "
            "(0, 1]; 1 turns top-k off."
        },
    )
    bits: int | None = field(
        default=4,
        metadata={"help": "Bits per sent value, quantized in buckets: 2, 4 or 8; bits=none sends fp32 values."},
    )
    bucket_size: int = field(
        default=128,
        metadata={"help": "Values per quantization bucket, each bucket with its own fp16 scale; at least 1."},
    )
    warmup_steps: int = field(
        default=10,
        metadata={
            "help": "How many steps at the start average the whole model exactly (each a blocking fp32 all-reduce) "
            "before compressed deltas take over; at least 0."
        },
    )
    error_feedback: bool = field(
        default=True,
        metadata={
            "help": "Error feedback: a replica gives up only what it transmitted of its lead over the global model, so "
            "what compression held back is sent in later steps (the aggregating side keeps its own residual too); "
            "error_feedback=false gives up the whole delta, losing what compression dropped."
        },
    )
    server_compression: bool = field(
        default=True,
        metadata={
            "help": "Compress the average of the deltas again, as CocktailSGD's aggregating side does, to reproduce "
            "its update (no bytes saved here: every rank gathers every payload); server_compression=false "
            "applies the average itself."
        },
    )

    def __post_init__(self) -> None:
        for name, ratio in (("random_keep", self.random_keep), ("topk_keep", self.topk_keep)):
            if not 0 < ratio <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {ratio}")
        validate_quantization_flags(self.bits, self.bucket_size, allow_fp32=True)
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be at least 0, got {self.warmup_steps}")

    def compressor(self, seed: int = 0) -> SparseQuantizeCompressor:
        """C_t; `seed` keys the random mask (a payload's size does not depend on it)."""
        return SparseQuantizeCompressor(self.random_keep, self.topk_keep, self.bits, self.bucket_size, seed=seed)

    def fault_tolerance_refusal(self) -> str | None:
        return (
            "its gather runs behind the next step (an update applied one step late), so a step always ends with an "
            "exchange in flight, which a replica that heals cannot fetch; use allreduce, opendiloco, dilocox, "
            "sparseloco or demo with fault tolerance"
        )

    def sync_plan(self, shapes: Sequence[torch.Size]) -> SyncPlan:
        """Every step the compressed deltas' all-gather, hidden behind the next step; the warm-up's steps each
        all-reduce the fp32 model, blocking."""
        compressor = self.compressor()
        return SyncPlan(
            (Exchange("all-gather", sum(compressor.payload_nbytes(shape) for shape in shapes)),),
            hidden_steps=1,
            warmup_steps=self.warmup_steps,
            warmup_exchanges=(Exchange("all-reduce", torch.float32.itemsize * numel(shapes)),),
        )


class Cocktail(Method):
    config_class = CocktailConfig
    keeps_global_copy = True  # g

    def __init__(self, ctx: MethodContext, cfg: CocktailConfig):
        super().__init__(ctx, cfg)
        # The run's seed keys the random mask: every rank derives the same mask at a step, nothing exchanged.
        self.compressor = cfg.compressor(ctx.seed)
        self.server_residuals = ErrorFeedback()  # s, identical on every rank
        self.pending: _Round | None = None

    def step(self, step: int) -> SyncReport | None:
        self.inner.step()
        if step < self.cfg.warmup_steps:
            return self._average_models()
        blocked_s, overlapped_s = self._apply_pending()
        payload_bytes, compression_error = self._send(step)
        return SyncReport(
            payload_bytes=payload_bytes,
            blocked_s=blocked_s,
            overlapped_s=overlapped_s,
            fields={"compression_error": compression_error, "stale_steps": 1},
        )

    def finish(self) -> list[SyncReport]:
        """Apply the last step's update, so the final global model holds every step."""
        if self.pending is None:
            return []
        blocked_s, overlapped_s = self._apply_pending()
        return [SyncReport(payload_bytes=0, blocked_s=blocked_s, overlapped_s=overlapped_s)]

    @torch.no_grad()
    def _average_models(self) -> SyncReport:
        """Warm-up: the exact average of the whole model, blocking, in fp32 (one flat bucket)."""
        flat = flatten(self.params).float()
        inflight = all_reduce_sum(flat, self.ctx.data_parallel_group)
        blocked_s, _ = inflight.wait()
        flat /= self.ctx.replicas
        unflatten_into(flat, self.global_params)
        unflatten_into(flat, self.params)
        return SyncReport(
            payload_bytes=inflight.payload_bytes,
            blocked_s=blocked_s,
            fields={"compression_error": 0.0, "stale_steps": 0},
        )

    @torch.no_grad()
    def _send(self, step: int) -> tuple[int, float]:
        """Compress delta_i per parameter and start the gather; returns (payload bytes, relative error)."""
        deltas = [p.float() - g for p, g in zip(self.params, self.global_params, strict=True)]
        payloads = [self.compressor.encode(delta, step) for delta in deltas]
        transmitted = [
            self.compressor.decode(payload, delta.shape, step) for payload, delta in zip(payloads, deltas, strict=True)
        ]
        gathered, inflight = all_gather_bytes(torch.cat(payloads), self.ctx.data_parallel_group)
        retired = transmitted if self.cfg.error_feedback else deltas
        self.pending = _Round(step, retired, gathered, inflight)
        return inflight.payload_bytes, relative_error(flatten(deltas), flatten(transmitted))

    @torch.no_grad()
    def _apply_pending(self) -> tuple[float, float]:
        """Wait for the last step's gather, apply its update u to g and x_i; returns (blocked, overlapped)."""
        if self.pending is None:
            return 0.0, 0.0
        sent, self.pending = self.pending, None
        blocked_s, overlapped_s = sent.inflight.wait()
        shapes = [g.shape for g in self.global_params]
        averages = mean_of_payloads(sent.gathered, self.compressor, shapes, sent.step)
        for i, (name, g, p, average) in enumerate(
            zip(self.names, self.global_params, self.params, averages, strict=True)
        ):
            update = self._server_compress(name, average, sent.step)
            kept = p - g - sent.retired[i]  # the lead x_i keeps: held-back residual and this step's progress
            g += update
            p.copy_(g + kept)
        return blocked_s, overlapped_s

    def _server_compress(self, name: str, average: torch.Tensor, step: int) -> torch.Tensor:
        """What CocktailSGD's aggregating side broadcasts for `average` (see the module docstring)."""
        if not self.cfg.server_compression:
            return average
        c = self.server_residuals.compensate(name, average) if self.cfg.error_feedback else average
        update = self.compressor.decode(self.compressor.encode(c, step), c.shape, step)
        if self.cfg.error_feedback:
            self.server_residuals.update(name, c, update)
        return update

    def optimizer_state_bytes(self) -> int:
        """Inner AdamW moments and g, plus the server's residual s."""
        return super().optimizer_state_bytes() + tensor_bytes(self.server_residuals.residuals.values())


@dataclass
class _Round:
    """A step whose payloads are still being gathered."""

    step: int
    retired: list[torch.Tensor]  # per parameter, what leaves x_i's lead over g when the round lands
    gathered: list[torch.Tensor]  # every rank's payload, filled once `inflight` is done
    inflight: InFlight
