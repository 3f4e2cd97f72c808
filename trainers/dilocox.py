"""DiLoCoX (arXiv 2506.21263): DiLoCo per pipeline stage, with compressed pseudo-gradients applied one round late
and a compression rank and round length that adapt to the pseudo-gradients.

Each rank holds one pipeline stage of one replica and runs everything below for that stage alone, with the same
stage of the other clusters (the data-parallel group, across the slow link); nothing holds the whole model.
theta is the stage's fp32 master copy, identical on every replica. Round t runs H_t inner AdamW steps from
theta_{t-1}, then, per parameter tensor:

    delta_i = theta_{t-1} - theta_i                         replica i's pseudo-gradient of round t
    c_i     = delta_i + e_i                                 error feedback: add what earlier rounds dropped
    P_i     = C_Q(C_L(c_i; r_t)),  e_i = c_i - D(P_i)       rank-r_t factors, int-q quantized (1-D: only int-q)
    Delta_t = mean_j D(P_j)                                 all-gather every payload, decode each, average

A sum of low-rank factors is not the factor of a sum, so the payloads are gathered (one flat uint8 buffer per
replica) and every rank decodes and averages all of them, in rank order, so Delta_t is bit-identical everywhere.

One-step-delay overlap (the default): at the end of round t the gather of round t starts, then the method waits
for round t-1's gather, which ran behind round t's inner steps, and applies it:

    theta_t = OuterSGD(theta_{t-1}, grad=Delta_{t-1})       Nesterov momentum, on the master copy
    theta_i = theta_t                                       every replica starts round t+1 from theta_t

Round 1 has no average before it: theta_1 = theta_0, and every replica restarts round 2 from theta_0, its round-1
progress travelling as delta_1 (applied at the end of round 2). So each round's delta is measured from the theta
the round started from, and the update is exactly one round stale. finish() exchanges the steps of an unfinished
last round as a shorter round (`--no-final-sync` drops them, as DiLoCo does), then waits for the last gather and
applies it, so training ends on a theta holding every round. `--no-overlap` applies Delta_t at the end of round t
itself: blocking DiLoCo with compression. `--no-compression` sends fp16 pseudo-gradients through an fp16 all-reduce
instead, as OpenDiLoCo does, without error feedback; with overlap, compression and adaptation all off this is
OpenDiLoCo exactly.

Adaptation (`--no-adaptive` keeps r_1 and H_1). When an average Delta arrives, every rank derives from it the
rank and round length of the round that starts now. Delta is identical across clusters, so nothing more crosses
the slow link; the stages of a cluster pool their estimates in one scalar all-reduce over the fast pipeline link,
so every rank of every cluster applies the same r and H:

    rhat = ceil(mean over the replica's matrices W of estimate_rank(Delta_W, energy))
                  estimate_rank: the smallest rank whose singular values hold `energy` of ||Delta_W||^2
    r    = clamp(ceil(mean of the window), min_rank, r_1)     the window: the last c = rank_window values of
                                                              rhat, initially c copies of r_1
    H    = min(max_local_steps, round(H_1 * r_1 / r))

so a smaller rank gives longer rounds, and the bytes per token, proportional to r / H = r^2 / (H_1 r_1), fall
with the rank. The mean over matrices rather than the max: one r serves every matrix of the replica, and the max
is set by the single highest-rank matrix (on the tiny model the token and position embeddings, about 4x the median)
and so barely moves, while error feedback carries what a matrix's rank-r payload misses into its next round.
With compression on, Delta is an average of rank-r payloads, so rhat sees only what was sent (at most
replicas * r): it asks how much of the sent rank was needed. With compression off, r only sets H.

Staleness monitor: ||Delta_t - Delta_{t-1}|| / ||Delta_{t-1}|| over the stage, at every applied average: the
one-step delay assumes it stays well below 1.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainers.comm import InFlight, all_gather_bytes, all_reduce_sum, flatten, unflatten_into
from trainers.compression import (
    ErrorFeedback,
    LowRankQuantizeCompressor,
    estimate_rank,
    mean_of_payloads,
    relative_error,
    validate_quantization_flags,
)
from trainers.method import Method, MethodContext, SyncReport, copy_into, tensor_bytes
from trainers.optim import OuterOptimizer, validate_outer


@dataclass(frozen=True)
class DiLoCoXConfig:
    """DiLoCoX's published settings (H_1 = 125, int4, c = 5), with r_1 scaled to our models.

    The paper's r_1 = 2048 at hidden size 8192 (hidden / 4) halves a square matrix; 32 does the same at the
    tiny model's 128 and is hidden / 12 on the small model's 384.
    """

    local_steps: int = 125  # H_1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    rank: int = 32  # r_1, and the most r_t ever is
    bits: int = 4  # q
    bucket_size: int = 128
    overlap: bool = True
    adaptive: bool = True
    compression: bool = True
    rank_window: int = 5  # c
    energy: float = 0.9
    min_rank: int = 4
    max_local_steps: int | None = None  # None: 4 * local_steps
    # Synchronize the steps of an unfinished last round in finish() (blocking), so every trained token is in the
    # final theta; --no-final-sync drops them, as DiLoCo does (they then do not count as applied tokens).
    final_sync: bool = True

    def __post_init__(self) -> None:
        validate_outer(self.local_steps, self.outer_lr, self.outer_momentum)
        if self.rank < 1:
            raise ValueError(f"--rank must be at least 1, got {self.rank}")
        validate_quantization_flags(self.bits, self.bucket_size)
        if self.rank_window < 1:
            raise ValueError(f"--rank-window must be at least 1, got {self.rank_window}")
        if not 0 < self.energy <= 1:
            raise ValueError(f"--energy must be in (0, 1], got {self.energy}")
        if not 1 <= self.min_rank <= self.rank:
            raise ValueError(f"--min-rank must be between 1 and --rank ({self.rank}), got {self.min_rank}")
        if self.max_local_steps is not None and self.max_local_steps < self.local_steps:
            raise ValueError(
                f"--max-local-steps must be at least --local-steps ({self.local_steps}), got {self.max_local_steps}"
            )

    def max_syncs(self, steps: int) -> int:
        """The most rounds a run of `steps` steps exchanges: H_t never falls below H_1."""
        return -(-steps // self.local_steps) if self.final_sync else steps // self.local_steps

    @property
    def local_steps_cap(self) -> int:
        return 4 * self.local_steps if self.max_local_steps is None else self.max_local_steps


def adapted_schedule(estimates: Sequence[int], cfg: DiLoCoXConfig) -> tuple[int, int]:
    """(r, H) for the next round from the window of rank estimates (the rule in the module docstring)."""
    rank = min(cfg.rank, max(cfg.min_rank, math.ceil(sum(estimates) / len(estimates))))
    return rank, min(cfg.local_steps_cap, round(cfg.local_steps * cfg.rank / rank))


@dataclass
class _Exchange:
    """One round's pseudo-gradients on their way to every replica."""

    round: int
    steps: int  # inner steps the round trained: applied with it
    rank: int  # the r its payloads were encoded with: decoding them needs it, and r may change before they land
    buffers: list[torch.Tensor]  # compressed: every replica's payload; fp16: the one summed buffer (once done)
    inflight: InFlight


class DiLoCoX(Method):
    config_class = DiLoCoXConfig
    keeps_global_copy = True  # theta

    def __init__(self, ctx: MethodContext, cfg: DiLoCoXConfig):
        super().__init__(ctx, cfg)
        # The dual optimizer of this stage only: the inner AdamW (the base class's) on the local weights, the
        # outer Nesterov on theta.
        self.outer = OuterOptimizer(self.global_params, cfg.outer_lr, cfg.outer_momentum)
        self.compressor = LowRankQuantizeCompressor(cfg.rank, cfg.bits, cfg.bucket_size, seed=ctx.seed)
        self.error_feedback = ErrorFeedback()  # e_i, per parameter name
        self.local_steps = cfg.local_steps  # H_t of the round in progress
        # The window starts full of r_1: an early estimate, from pseudo-gradients of the warm-up, moves r only
        # 1/c of the way, and r keeps falling only while the estimates stay low.
        self.rank_estimates = deque([cfg.rank] * cfg.rank_window, maxlen=cfg.rank_window)
        self.round = 0  # rounds completed
        self.steps_in_round = 0
        self.synchronized_steps = 0  # steps of the rounds applied to theta so far
        self.in_flight: _Exchange | None = None  # with overlap: the last round's exchange, not yet applied
        self.last_average: list[torch.Tensor] | None = None  # for the staleness monitor

    def step(self, step: int) -> SyncReport | None:
        self.inner.step()
        self.steps_in_round += 1
        if self.steps_in_round < self.local_steps:
            return None
        return self._outer_step()

    @torch.no_grad()
    def _outer_step(self) -> SyncReport:
        self.round += 1
        fields = {"round": self.round, "rank_r": self.compressor.rank, "local_steps_h": self.local_steps}
        deltas = [g - p.float() for g, p in zip(self.global_params, self.params, strict=True)]
        sent, fields["compression_error"] = self._send(deltas)
        if self.cfg.overlap:
            # This round's exchange runs behind the next round's inner steps; the last round's lands now.
            arrived, self.in_flight = self.in_flight, sent
        else:
            arrived = sent
        blocked_s = overlapped_s = 0.0
        if arrived is not None:
            blocked_s, overlapped_s, applied = self._apply(arrived)
            fields.update(applied)
        # Round 1 under overlap applied nothing: theta is still theta_0, and the replicas restart from it.
        copy_into(self.global_params, self.params)
        self.steps_in_round = 0
        return SyncReport(
            payload_bytes=sent.inflight.payload_bytes, blocked_s=blocked_s, overlapped_s=overlapped_s, fields=fields
        )

    def _send(self, deltas: list[torch.Tensor]) -> tuple[_Exchange, float]:
        """Start exchanging this round's pseudo-gradients; returns the exchange and the compression error.

        The error is the compressor's on its input (delta + residual), ||c - D(P)|| / ||c||: the quantity the
        paper's bound omega^2 is about.
        """
        if not self.cfg.compression:
            # One flat fp16 bucket, summed in fp16 on the wire, exactly as OpenDiLoCo does.
            wire = flatten(deltas).to(torch.float16)
            error = relative_error(flatten(deltas), wire)
            inflight = all_reduce_sum(wire, self.ctx.data_parallel_group)
            return _Exchange(self.round, self.steps_in_round, self.compressor.rank, [wire], inflight), error
        payloads, compensated, transmitted = [], [], []
        for name, delta in zip(self.names, deltas, strict=True):
            c = self.error_feedback.compensate(name, delta)
            payload = self.compressor.encode(c, self.round, key=name)
            # The residual is what this replica's payload really carries short of c: decode it as others will.
            t = self.compressor.decode(payload, c.shape, self.round)
            self.error_feedback.update(name, c, t)
            payloads.append(payload)
            compensated.append(c)
            transmitted.append(t)
        # Every replica of the group uses the same shapes and r, so the buffers have equal sizes, as gather needs.
        buffers, inflight = all_gather_bytes(torch.cat(payloads), self.ctx.data_parallel_group)
        error = relative_error(flatten(compensated), flatten(transmitted))
        return _Exchange(self.round, self.steps_in_round, self.compressor.rank, buffers, inflight), error

    @torch.no_grad()
    def _apply(self, exchange: _Exchange) -> tuple[float, float, dict]:
        """Wait for `exchange`, take the outer step with its average and adapt; (blocked, overlapped, fields)."""
        blocked_s, overlapped_s = exchange.inflight.wait()
        average = self._average(exchange)
        self.outer.step(average)
        self.synchronized_steps += exchange.steps

        fields = {"staleness": None, "estimated_rank": self._estimate_rank(average)}
        if self.last_average is not None:
            fields["staleness"] = relative_error(flatten(self.last_average), flatten(average))
        self.last_average = average
        if self.cfg.adaptive:
            self.rank_estimates.append(fields["estimated_rank"])
            # Takes effect from the round that starts now: its payload and its length.
            self.compressor.rank, self.local_steps = adapted_schedule(self.rank_estimates, self.cfg)
        return blocked_s, overlapped_s, fields

    def _average(self, exchange: _Exchange) -> list[torch.Tensor]:
        """Delta: the replicas' mean pseudo-gradient per parameter, identical on every rank."""
        if not self.cfg.compression:
            average = [torch.empty_like(g) for g in self.global_params]
            unflatten_into(exchange.buffers[0].float() / self.ctx.replicas, average)
            return average
        # Decoding needs only the shapes and the rank the payloads were made with.
        decoder = LowRankQuantizeCompressor(exchange.rank, self.cfg.bits, self.cfg.bucket_size)
        return mean_of_payloads(exchange.buffers, decoder, [g.shape for g in self.global_params], exchange.round)

    def _estimate_rank(self, average: list[torch.Tensor]) -> int:
        """rhat: the mean of estimate_rank over the matrices of the whole replica (see the module docstring).

        The stages' sums and counts meet in one tiny all-reduce over the pipeline group (the fast link), so every
        stage of a cluster keeps the same round length; each stage's average is identical on every cluster, so
        every cluster gets the same rhat too.
        """
        ranks = [estimate_rank(d.reshape(d.shape[0], -1), self.cfg.energy) for d in average if d.ndim >= 2]
        totals = torch.tensor([sum(ranks), len(ranks)], dtype=torch.float64, device=average[0].device)
        if self.ctx.pipeline_group is not None:
            dist.all_reduce(totals, group=self.ctx.pipeline_group)
        total, count = totals.tolist()
        return math.ceil(total / count) if count else self.cfg.rank

    def finish(self) -> SyncReport | None:
        """Apply what is still in flight, so training ends on a theta that holds every round: with final_sync the
        partial last round is exchanged first (as an ordinary, shorter round), then the last exchange is applied."""
        payload_bytes = blocked_s = overlapped_s = 0.0
        fields: dict = {}
        if self.cfg.final_sync and self.steps_in_round:
            partial = self._outer_step()
            payload_bytes, blocked_s, overlapped_s = partial.payload_bytes, partial.blocked_s, partial.overlapped_s
            fields = partial.fields
        if self.in_flight is not None:
            exchange, self.in_flight = self.in_flight, None
            waited_s, hidden_s, fields = self._apply(exchange)
            blocked_s, overlapped_s = blocked_s + waited_s, overlapped_s + hidden_s
            copy_into(self.global_params, self.params)
        if not fields:
            return None
        return SyncReport(
            payload_bytes=int(payload_bytes), blocked_s=blocked_s, overlapped_s=overlapped_s, fields=fields
        )

    def applied_steps(self, trained_steps: int) -> int:
        return self.synchronized_steps

    def optimizer_state_bytes(self) -> int:
        """Inner AdamW moments, theta, the outer momentum buffer and the error-feedback residuals, for this stage.

        Not counted: the compressor's warm-start factors Q (n x r per matrix), the staleness monitor's last
        average, and the payload buffers of an exchange in flight: communication state, not optimizer state.
        """
        residuals = tensor_bytes(self.error_feedback.residuals.values())
        return super().optimizer_state_bytes() + self.outer.state_bytes() + residuals
