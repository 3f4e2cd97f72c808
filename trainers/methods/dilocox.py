"""DiLoCoX (arXiv 2506.21263): DiLoCo per pipeline stage, with compressed pseudo-gradients whose exchange overlaps
the next inner steps, and a compression rank and round length that adapt to the pseudo-gradients.

Each rank holds one pipeline stage of one replica and runs everything below for that stage alone, with the same
stage of the other clusters (the data-parallel group, across the slow link). theta is the stage's fp32 master copy,
identical on every replica. Round t runs H_t inner AdamW steps from the replica's start point s_i, then, per tensor:

    delta_i = s_i - theta_i                                 replica i's pseudo-gradient of round t
    c_i     = delta_i + e_i                                 error feedback: add what earlier rounds dropped
    P_i     = C_Q(C_L(c_i; r_t)),  e_i = c_i - D(P_i)       rank-r_t factors, int-q quantized (1-D: only int-q)
    Delta_t = mean_j D(P_j)                                 all-gather every payload, decode each, average
    m <- mu m + Delta_t,  theta <- theta - eta (Delta_t + mu m)          the outer Nesterov step, OuterSGD

The payloads are gathered, since a sum of low-rank factors is not the factor of a sum; every rank decodes them in
rank order, so Delta_t is bit-identical everywhere. `exchange=reduce` starts every replica from one shared basis so
the factors add and two all-reduces carry them (trainers/compression/powersgd.py). `compression=false` sends fp16
pseudo-gradients through an all-reduce, as OpenDiLoCo does; with overlap, compression and adaptation off this is
OpenDiLoCo exactly.

`overlap` says when Delta_t is applied and where round t+1 starts: `none` waits for it (blocking); `delayed` (the
paper's Algorithm 2) applies Delta_{t-1} at the end of round t and restarts from that theta; `eager` (arXiv
2502.12996) commits as `delayed` but restarts from a look-ahead holding the replica's own fresh share,
s_i = theta_t - eta (1 + mu) D(P_i^t) / n; `streaming` (the default, arXiv 2501.18512) starts the exchange tau =
`overlap_steps` steps before the round ends and blends at its end, theta_i = alpha theta_i + (1 - alpha) theta_t.

Adaptation (`adaptive`): each replica estimates the rank of c_i before compressing it (the mean over matrices of the
smallest rank holding `energy` of the squared norm), the estimates are averaged over replicas (16 bytes, sent with
the payload) and stages, and from the round after that exchange is applied r_t = clamp(ceil(mean of the last c =
`rank_window` estimates), `min_rank`, r_1) and H_t = min(`max_local_steps`, round(H_1 r_1 / r_t)) on every rank.

A run ends on an ordinary outer step in every mode (trainers/method.py, Method.finish): an unfinished last round is
exchanged as a shorter one (`final_sync=false` drops it), then everything in flight is applied. The formulas of each
mode, why `delayed` diverges at the paper's outer lr, and what each sync reports: docs/methods.md, "exactly".
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from trainers.comm import InFlight, InThread, all_gather_bytes, all_reduce_sum, flatten, unflatten_into
from trainers.compression import powersgd
from trainers.compression.compressors import LowRankQuantizeCompressor, mean_of_payloads
from trainers.compression.error_feedback import ErrorFeedback, relative_error
from trainers.compression.lowrank import estimate_rank
from trainers.compression.quantize import validate_quantization_flags
from trainers.method import (
    Exchange,
    Method,
    MethodConfig,
    MethodContext,
    SyncPlan,
    SyncReport,
    copy_into,
    numel,
    tensor_bytes,
)
from trainers.optim import OuterOptimizer, validate_outer
from trainers.round_metrics import outer_step_monitor, weighted_omega2

Overlap = Literal["none", "delayed", "eager", "streaming"]
OVERLAP_MODES: tuple[str, ...] = ("none", "delayed", "eager", "streaming")
ExchangeDesign = Literal["gather", "reduce"]
EXCHANGES: tuple[str, ...] = ("gather", "reduce")
# The rank estimate's all-reduce: [sum of the matrices' estimates, matrices] (_rank_totals).
RANK_TOTALS_DTYPE = torch.float64
RANK_TOTALS_BYTES = 2 * RANK_TOTALS_DTYPE.itemsize
# Under exchange=reduce the estimate rides in P's all-reduce: one value, the replica's mean over its matrices / n.
REDUCED_ESTIMATE_VALUES = 1


@dataclass(frozen=True)
class DiLoCoXConfig(MethodConfig):
    """DiLoCoX's published settings (int4, c = 5), with r_1 and the factoring chosen by our convergence study, the
    overlap that converged there (streaming) in place of the paper's one-step delay, which is `overlap="delayed"`,
    and a round length for the harness's runs in place of the paper's H_1 = 125 (`local_steps=125`).

    H_1 = 20: the harness's default run (tiny, 200 steps) synchronizes 7 times at it (six rounds, which adaptation
    lengthens from 20 to 44 steps, and a partial last one), enough for its throughput to say something about
    communication; at 125 it synchronized twice. The paper's 125 fits its runs of thousands of steps.

    r_1 = 64 with two power iterations trained closest to AllReduce while sending >= 500x fewer bytes (docs/studies.md,
    "DiLoCoX convergence"): +6.7% on the tiny model (r_1 = 32 with one: +10.5%), +4.4% on the small one (+8.5%);
    the paper does not say how it factors, and PowerSGD's one warm-started iteration lags a moving pseudo-gradient.
    It is hidden / 2 on tiny, where a 128 x 128 matrix's rank-64 factors are no smaller than the matrix, so those
    go whole until r_t falls below 64, and hidden / 6 on small; the paper's r_1 = 2048 is hidden / 4 of its 8192.
    """

    local_steps: int = field(
        default=20,
        metadata={
            "help": "H_1: inner AdamW steps of the first round (steps per round); adaptation lengthens later rounds "
            "up to max_local_steps. The paper's is 125."
        },
    )
    outer_lr: float = field(
        default=0.7, metadata={"help": "eta: learning rate of the outer Nesterov SGD step on theta; above 0."}
    )
    outer_momentum: float = field(
        default=0.9, metadata={"help": "mu: Nesterov momentum of the outer SGD step, in [0, 1)."}
    )
    rank: int = field(
        default=64,
        metadata={
            "help": "r_1: the rank of each pseudo-gradient matrix's low-rank factors in the first round, and the most "
            "adaptation ever raises it to; at least 1."
        },
    )
    bits: int = field(
        default=4,
        metadata={
            "help": "q: bits per value of the quantized factors (1-D tensors are only quantized): 2, 4 or 8. Unused "
            "under exchange=reduce or compression=false."
        },
    )
    bucket_size: int = field(
        default=128,
        metadata={"help": "Values per quantization bucket, each bucket with its own fp16 scale; at least 1."},
    )
    power_iterations: int = field(
        default=2,
        metadata={
            "help": "Power iterations per matrix per round that find the factors: compute only, no bytes; at least "
            "1. Unused under exchange=reduce (one warm-started iteration) or compression=false."
        },
    )
    overlap: Overlap = field(
        default="streaming",
        metadata={
            "help": "When a round's average is applied and where the next round starts (trainers/methods/dilocox.py): "
            "streaming (the exchange runs behind the round's last overlap_steps steps, then the local weights blend "
            "with theta by merge_alpha), none (blocking), eager (one round stale, restarting from a look-ahead that "
            "holds the replica's own fresh share), or delayed, the paper's one-step-delay update (Algorithm 2): with "
            "local_steps=125 it is DiLoCoX exactly as published, and diverges at its outer lr 0.7 and momentum 0.9 "
            "(docs/studies.md, 'DiLoCoX convergence'). true reads as delayed, false as none."
        },
    )
    overlap_steps: int | None = field(
        default=None,
        metadata={
            "help": "tau, under overlap=streaming: the exchange starts this many inner steps before the round ends "
            "and runs behind them; at least 0 and below local_steps. none: local_steps // 10, what the convergence "
            "study ran (5 at H = 50)."
        },
    )
    merge_alpha: float = field(
        default=0.5,
        metadata={
            "help": "alpha, under overlap=streaming: the local copy's weight when a replica blends its weights with "
            "the new theta at a round's end (torchft's alpha), in [0, 1]; 0 restarts from theta, dropping the steps "
            "taken while the exchange ran."
        },
    )
    exchange: ExchangeDesign = field(
        default="gather",
        metadata={
            "help": "How the compressed pseudo-gradients travel: gather (the paper's: every replica's factors to every "
            "other, n-1 payloads per site) or reduce (PowerSGD's shared basis: factors add, 2(n-1)/n of one payload "
            "per site; bits and power_iterations unused, not with overlap=eager or compression=false; "
            "trainers/compression/powersgd.py)."
        },
    )
    reduce_wire: powersgd.RunWire = field(
        default="bf16",
        metadata={
            "help": "Under exchange=reduce, what the all-reduces carry: bf16, or int8 or int4 through a ring that "
            "re-quantizes each hop (half or a quarter of bf16's bytes)."
        },
    )
    adaptive: bool = field(
        default=True,
        metadata={
            "help": "Adapt the rank and the round length every round from the pseudo-gradients' estimated rank (a "
            "lower rank, longer rounds); adaptive=false keeps rank and local_steps and only logs the estimate."
        },
    )
    compression: bool = field(
        default=True,
        metadata={
            "help": "Send rank-r, int-q factors with error feedback; compression=false sends fp16 pseudo-gradients "
            "through one fp16 all-reduce instead, as OpenDiLoCo does (the rank then only sets the round length)."
        },
    )
    rank_window: int = field(
        default=5,
        metadata={
            "help": "c: how many of the latest rank estimates the next rank is the mean of (rounded up, kept between "
            "min_rank and rank; the window starts as c copies of rank); at least 1."
        },
    )
    energy: float = field(
        default=0.9,
        metadata={
            "help": "A matrix's estimated rank is the smallest whose singular values hold this fraction of its squared "
            "norm, in (0, 1]."
        },
    )
    min_rank: int = field(default=4, metadata={"help": "The lowest rank adaptation may choose, between 1 and rank."})
    max_local_steps: int | None = field(
        default=None,
        metadata={
            "help": "The longest round adaptation may choose, in steps; at least local_steps. none: 4 x local_steps."
        },
    )
    final_sync: bool = field(
        default=True,
        metadata={
            "help": "Synchronize the steps of an unfinished last round at the end of the run (blocking), so every "
            "trained token is in the final theta; final_sync=false drops them, as DiLoCo does (they then do not "
            "count as applied tokens)."
        },
    )

    def __post_init__(self) -> None:
        # method_config turns the string "none" into None (its "switch it off"), so None is `none` too.
        if self.overlap is None or isinstance(self.overlap, bool):
            object.__setattr__(self, "overlap", "delayed" if self.overlap else "none")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAP_MODES)}; got {self.overlap!r}")
        validate_outer(self.local_steps, self.outer_lr, self.outer_momentum)
        if self.overlap_steps is None:
            object.__setattr__(self, "overlap_steps", self.local_steps // 10)
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}; got {self.exchange!r}")
        if self.reduce_wire not in powersgd.WIRES:
            raise ValueError(f"reduce_wire must be one of {', '.join(powersgd.WIRES)}; got {self.reduce_wire!r}")
        if self.exchange == "reduce" and not self.compression:
            raise ValueError(
                "exchange=reduce reduces low-rank factors, which compression=false turns off (it already sends fp16 "
                "pseudo-gradients through one all-reduce); drop one of the two"
            )
        if self.exchange == "reduce" and self.overlap == "eager":
            raise ValueError(
                "overlap=eager restarts from the replica's own decoded share, which exchange=reduce knows only "
                "once its first all-reduce is done; use --set overlap=streaming, none or delayed with it"
            )
        if self.overlap_steps < 0:
            raise ValueError(f"overlap_steps must be at least 0, got {self.overlap_steps}")
        # H_t never falls below H_1, so tau < H_1 leaves every round some steps before its exchange starts.
        if self.overlap == "streaming" and self.overlap_steps >= self.local_steps:
            raise ValueError(
                f"overlap_steps must be below local_steps ({self.local_steps}) with overlap=streaming, "
                f"got {self.overlap_steps}"
            )
        if not 0 <= self.merge_alpha <= 1:
            raise ValueError(f"merge_alpha must be in [0, 1], got {self.merge_alpha}")
        if self.rank < 1:
            raise ValueError(f"rank must be at least 1, got {self.rank}")
        validate_quantization_flags(self.bits, self.bucket_size)
        if self.power_iterations < 1:
            raise ValueError(f"power_iterations must be at least 1, got {self.power_iterations}")
        if self.rank_window < 1:
            raise ValueError(f"rank_window must be at least 1, got {self.rank_window}")
        if not 0 < self.energy <= 1:
            raise ValueError(f"energy must be in (0, 1], got {self.energy}")
        if not 1 <= self.min_rank <= self.rank:
            raise ValueError(f"min_rank must be between 1 and rank ({self.rank}), got {self.min_rank}")
        if self.max_local_steps is not None and self.max_local_steps < self.local_steps:
            raise ValueError(
                f"max_local_steps must be at least local_steps ({self.local_steps}), got {self.max_local_steps}"
            )

    def max_syncs(self, steps: int) -> int:
        """The most rounds a run of `steps` steps exchanges: H_t never falls below H_1."""
        return -(-steps // self.local_steps) if self.final_sync else steps // self.local_steps

    @property
    def local_steps_cap(self) -> int:
        return 4 * self.local_steps if self.max_local_steps is None else self.max_local_steps

    def compressor(self, seed: int = 0) -> LowRankQuantizeCompressor:
        """C_Q o C_L at r_1; `seed` draws the power iteration's cold start (a payload's size does not depend on it)."""
        return LowRankQuantizeCompressor(
            self.rank, self.bits, self.bucket_size, seed=seed, power_iterations=self.power_iterations
        )

    def check_shapes(self, shapes: Sequence[torch.Size]) -> None:
        if self.exchange == "reduce":
            powersgd.check_rank(shapes, self.rank)

    def sync_plan(self, shapes: Sequence[torch.Size]) -> SyncPlan:
        """Once a round the rank-r_1 int-q factors' all-gather (fp16 pseudo-gradients' all-reduce without
        compression) and, with adaptation, the rank estimate's all-reduce beside it, hidden behind what overlap
        runs while they are in flight. At r_1 and H_1: adaptation lowers r and raises H from there."""
        hidden = {"none": 0, "streaming": self.overlap_steps, "delayed": self.local_steps, "eager": self.local_steps}
        if self.exchange == "reduce":
            # P's all-reduce (the rank estimate inside it), then Q's, which needs P: one after the other.
            extra = REDUCED_ESTIMATE_VALUES if self.adaptive else 0
            numels = powersgd.buffer_numels(shapes, self.rank, extra, self.reduce_wire)
            exchanges = tuple(Exchange("all-reduce", powersgd.buffer_nbytes(n, self.reduce_wire)) for n in numels)
            return SyncPlan(
                exchanges,
                self.local_steps,
                hidden[self.overlap],
                slow_start=True,
                adaptive=self.adaptive,
                sequential=True,
            )
        if self.compression:
            compressor = self.compressor()
            exchanges = [Exchange("all-gather", sum(compressor.payload_nbytes(shape) for shape in shapes))]
        else:
            exchanges = [Exchange("all-reduce", torch.float16.itemsize * numel(shapes))]
        if self.adaptive:
            exchanges.append(Exchange("all-reduce", RANK_TOTALS_BYTES))
        return SyncPlan(
            tuple(exchanges), self.local_steps, hidden[self.overlap], slow_start=True, adaptive=self.adaptive
        )


def adapted_schedule(estimates: Sequence[int], cfg: DiLoCoXConfig) -> tuple[int, int]:
    """(r, H) for the next round from the window of rank estimates (the rule in the module docstring)."""
    rank = min(cfg.rank, max(cfg.min_rank, math.ceil(sum(estimates) / len(estimates))))
    return rank, min(cfg.local_steps_cap, round(cfg.local_steps * cfg.rank / rank))


@dataclass
class _Exchange:
    """One round's pseudo-gradients on their way to every replica."""

    round: int
    steps: int  # inner steps whose progress it carries: applied with it
    rank: int  # the r its payloads were encoded with: decoding them needs it, and r may change before they land
    buffers: list[torch.Tensor]  # compressed: every replica's payload; fp16: the one summed buffer (once done)
    inflight: InFlight
    rank_totals: torch.Tensor  # [sum of matrix rank estimates, matrices]: over the replicas once `estimate` is done
    estimate: InFlight  # the all-reduce of rank_totals (nothing on the wire without adaptation)
    fields: dict = field(default_factory=dict)  # measured when sent: r, H, compression error and its bounds
    own_share: list[torch.Tensor] | None = None  # eager: D(P_i), what this replica sent, decoded

    @property
    def payload_bytes(self) -> int:
        return self.inflight.payload_bytes + self.estimate.payload_bytes


class DiLoCoX(Method):
    config_class = DiLoCoXConfig
    keeps_global_copy = True  # theta

    def __init__(self, ctx: MethodContext, cfg: DiLoCoXConfig):
        super().__init__(ctx, cfg)
        # The dual optimizer of this stage only: the inner AdamW (the base class's) on the local weights, the
        # outer Nesterov on theta.
        self.outer = OuterOptimizer(self.global_params, cfg.outer_lr, cfg.outer_momentum)
        self.compressor = cfg.compressor(ctx.seed)  # under exchange=reduce it only holds r_t
        # The run's seed is every replica's, so their shared bases start equal.
        self.reducer = powersgd.PowerSGDReducer(ctx.seed, cfg.reduce_wire) if cfg.exchange == "reduce" else None
        self.error_feedback = ErrorFeedback()  # e_i, per parameter name
        self.local_steps = cfg.local_steps  # H_t of the round in progress
        # The window starts full of r_1: an early estimate, from pseudo-gradients of the warm-up, moves r only
        # 1/c of the way, and r keeps falling only while the estimates stay low.
        self.rank_estimates = deque([cfg.rank] * cfg.rank_window, maxlen=cfg.rank_window)
        # s_i, where the round in progress started and its delta is measured from: theta itself, except that
        # eager restarts from its own look-ahead.
        self.round_start = self.global_params
        if cfg.overlap == "eager":
            self.round_start = [g.clone() for g in self.global_params]
        self.round = 0  # rounds sent
        self.steps_in_round = 0
        self.unsent_steps = 0  # steps whose progress is only in the local weights, not yet in an exchange
        self.synchronized_steps = 0  # steps of the exchanges applied to theta so far
        self.sending: _Exchange | None = None  # streaming: this round's exchange, started tau steps before its end
        self.in_flight: _Exchange | None = None  # delayed, eager: the last round's exchange, not yet applied
        self.last_average: torch.Tensor | None = None  # for the monitor: the last Delta applied, flat

    def step(self, step: int) -> SyncReport | None:
        self.inner.step()
        self.steps_in_round += 1
        self.unsent_steps += 1
        lead = self.cfg.overlap_steps
        # The round in which training ends sends at its end, holding every step (the module docstring, finish()).
        ends_run = self.ctx.total_steps - 1 - step <= lead
        if self.cfg.overlap == "streaming" and self.steps_in_round == self.local_steps - lead and not ends_run:
            self.sending = self._send()
        if self.steps_in_round < self.local_steps:
            return None
        return self._outer_step()

    @torch.no_grad()
    def _outer_step(self) -> SyncReport:
        """The end of a round: send it (streaming sent it tau steps ago), apply what has landed, restart."""
        sent = self.sending if self.sending is not None else self._send()
        self.sending = None
        if self.cfg.overlap in ("delayed", "eager"):
            # This round's exchange runs behind the next round's inner steps; the last round's lands now.
            arrived, self.in_flight = self.in_flight, sent
        else:
            arrived = sent
        fields = {**sent.fields, "round_steps": self.steps_in_round}
        blocked_s = overlapped_s = 0.0
        if arrived is not None:
            blocked_s, overlapped_s, applied = self._apply(arrived)
            fields.update(applied)
        # Round 1 under delayed and eager applied nothing: theta is still theta_0.
        self._restart(sent)
        self.steps_in_round = 0
        return SyncReport(
            payload_bytes=sent.payload_bytes, blocked_s=blocked_s, overlapped_s=overlapped_s, fields=fields
        )

    def _restart(self, sent: _Exchange) -> None:
        """Where the replica's next round starts (see overlap in the module docstring)."""
        if self.cfg.overlap == "eager":
            # s_i = theta_t - eta (1 + mu) D(P_i^t) / n: the committed step had it held this replica's fresh share.
            scale = self.cfg.outer_lr * (1 + self.cfg.outer_momentum) / self.ctx.replicas
            for start, theta, own in zip(self.round_start, self.global_params, sent.own_share, strict=True):
                torch.sub(theta, own, alpha=scale, out=start)
            sent.own_share = None  # not needed while the exchange is in flight
            copy_into(self.round_start, self.params)
        elif self.cfg.overlap == "streaming":
            # torchft's merge: lerp(global, local, alpha). The steps after the snapshot stay in the local weights
            # at weight alpha, to travel with the next round's delta; at alpha = 0 they are gone.
            merged = [
                torch.lerp(g, p.detach().float(), self.cfg.merge_alpha)
                for g, p in zip(self.global_params, self.params, strict=True)
            ]
            copy_into(merged, self.params)
            if self.cfg.merge_alpha == 0:
                self.unsent_steps = 0
        else:
            copy_into(self.global_params, self.params)

    @torch.no_grad()
    def _send(self) -> _Exchange:
        """Start exchanging the progress since the round started (and, alongside, the rank estimate)."""
        self.round += 1
        fields = {"round": self.round, "rank_r": self.compressor.rank, "local_steps_h": self.local_steps}
        deltas = [s - p.float() for s, p in zip(self.round_start, self.params, strict=True)]
        steps, self.unsent_steps = self.unsent_steps, 0
        if not self.cfg.compression:
            # One flat fp16 bucket, summed in fp16 on the wire, exactly as OpenDiLoCo does.
            wire = flatten(deltas).to(torch.float16)
            own_share = None
            if self.cfg.overlap == "eager":
                own_share = [torch.empty_like(d) for d in deltas]
                unflatten_into(wire.float(), own_share)
            error = relative_error(flatten(deltas), wire)
            fields.update(
                compression_error=error, compression_error2=error**2, omega2_paper=None, omega2_corrected=None
            )
            totals, estimate = self._rank_totals(deltas)
            inflight = all_reduce_sum(wire, self.ctx.data_parallel_group)
            return _Exchange(
                self.round, steps, self.compressor.rank, [wire], inflight, totals, estimate, fields, own_share
            )
        if self.reducer is not None:
            return self._send_reduced(deltas, steps, fields)
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
        fields.update(
            compression_error=error,
            compression_error2=error**2,
            **weighted_omega2(compensated, self.compressor.rank, self.cfg.bits),
        )
        # Estimated on c, before compression: after it, at most r of its directions are left to see.
        totals, estimate = self._rank_totals(compensated)
        own_share = transmitted if self.cfg.overlap == "eager" else None
        return _Exchange(
            self.round, steps, self.compressor.rank, buffers, inflight, totals, estimate, fields, own_share
        )

    @torch.no_grad()
    def _send_reduced(self, deltas: list[torch.Tensor], steps: int, fields: dict) -> _Exchange:
        """exchange=reduce: start the shared-basis exchange (trainers/compression/powersgd.py) on a thread of its
        own, the rank estimate inside its first all-reduce. Its error feedback is set when its factors are known, so
        the exchange before must have landed before this round compensates (under delayed it may still be in flight:
        waiting here is time blocked on the link, reported with that exchange)."""
        if self.in_flight is not None:
            self.in_flight.inflight.wait()
        compensated = [self.error_feedback.compensate(n, d) for n, d in zip(self.names, deltas, strict=True)]
        totals, _ = self._rank_totals(compensated, exchange=False)
        total, count = totals.tolist()
        extra = torch.tensor([total / count / self.ctx.replicas] if self.cfg.adaptive and count else [])
        rank, group, replicas = self.compressor.rank, self.ctx.data_parallel_group, self.ctx.replicas

        def run() -> tuple[powersgd.Reduced, dict]:
            reduced = self.reducer.exchange(compensated, self.names, rank, extra, group, replicas)
            for name, c, t in zip(self.names, compensated, reduced.transmitted, strict=True):
                self.error_feedback.update(name, c, t)
            error = relative_error(flatten(compensated), flatten(reduced.transmitted))
            bounds = weighted_omega2(compensated, rank, powersgd.WIRE_BITS[self.cfg.reduce_wire])
            return reduced, {"compression_error": error, "compression_error2": error**2, **bounds}

        shapes = [d.shape for d in deltas]
        inflight = InThread(run, powersgd.payload_bytes(shapes, rank, replicas, extra.numel(), self.cfg.reduce_wire))
        if self.cfg.adaptive and count:
            # Filled in from the reduced estimate once the exchange lands (_apply): [mean x matrices, matrices].
            totals = torch.tensor([math.nan, count], dtype=RANK_TOTALS_DTYPE)
        return _Exchange(self.round, steps, rank, [], inflight, totals, InFlight(None, 0), fields)

    def _rank_totals(self, tensors: list[torch.Tensor], exchange: bool = True) -> tuple[torch.Tensor, InFlight]:
        """This stage's [sum of estimate_rank over its matrices, matrices], and, with adaptation (and `exchange`),
        its all-reduce over the data-parallel group started (so the window gets the replicas' mean)."""
        ranks = [estimate_rank(t.reshape(t.shape[0], -1), self.cfg.energy) for t in tensors if t.ndim >= 2]
        totals = torch.tensor([sum(ranks), len(ranks)], dtype=RANK_TOTALS_DTYPE, device=tensors[0].device)
        if not (self.cfg.adaptive and exchange):
            return totals, InFlight(None, 0)
        return totals, all_reduce_sum(totals, self.ctx.data_parallel_group)

    @torch.no_grad()
    def _apply(self, exchange: _Exchange) -> tuple[float, float, dict]:
        """Wait for `exchange`, take the outer step with its average and adapt; (blocked, overlapped, fields)."""
        blocked_s, overlapped_s = exchange.inflight.wait()
        waited_s, hidden_s = exchange.estimate.wait()
        fields = {}
        if self.reducer is not None:
            reduced, fields = exchange.inflight.result
            if self.cfg.adaptive and reduced.extra.numel():
                exchange.rank_totals[0] = float(reduced.extra[0]) * exchange.rank_totals[1]
        average = self._average(exchange)
        before = [g.clone() for g in self.global_params]
        self.outer.step(average)
        self.synchronized_steps += exchange.steps

        fields.update(estimated_rank=self._estimated_rank(exchange.rank_totals), **self._monitor(before, average))
        if self.cfg.adaptive:
            self.rank_estimates.append(fields["estimated_rank"])
            # Takes effect from the round that starts now: its payload and its length.
            self.compressor.rank, self.local_steps = adapted_schedule(self.rank_estimates, self.cfg)
        return blocked_s + waited_s, overlapped_s + hidden_s, fields

    def _average(self, exchange: _Exchange) -> list[torch.Tensor]:
        """Delta: the replicas' mean pseudo-gradient per parameter, identical on every rank."""
        if self.reducer is not None:
            reduced, _ = exchange.inflight.result
            return reduced.average
        if not self.cfg.compression:
            average = [torch.empty_like(g) for g in self.global_params]
            unflatten_into(exchange.buffers[0].float() / self.ctx.replicas, average)
            return average
        # Decoding needs only the shapes and the rank the payloads were made with.
        decoder = LowRankQuantizeCompressor(exchange.rank, self.cfg.bits, self.cfg.bucket_size)
        return mean_of_payloads(exchange.buffers, decoder, [g.shape for g in self.global_params], exchange.round)

    def _estimated_rank(self, totals: torch.Tensor) -> int:
        """rhat: the mean estimate over the matrices of every stage (and, with adaptation, every replica).

        The stages' sums and counts meet in one tiny all-reduce over the pipeline group (the fast link), so every
        stage of a cluster keeps the same round length; with adaptation `totals` already holds every replica's,
        so every cluster gets the same rhat too.
        """
        if self.ctx.pipeline_group is not None:
            totals = totals.clone()
            dist.all_reduce(totals, group=self.ctx.pipeline_group)
        total, count = totals.tolist()
        return math.ceil(total / count) if count else self.cfg.rank

    def _monitor(self, before: list[torch.Tensor], average: list[torch.Tensor]) -> dict:
        delta = flatten(average).double()
        fields = outer_step_monitor(before, self.global_params, delta, self.last_average)
        self.last_average = delta
        return fields

    def finish(self) -> list[SyncReport]:
        """Called after the run's ctx.total_steps steps: apply what is still in flight, so training ends on a theta
        that holds every round, and every replica holds theta. With final_sync an unfinished last round (one with
        inner steps since the last outer step) is exchanged as an ordinary, shorter round; then the exchange still
        in flight (delayed, eager) is applied. No outer step is taken on a round without inner steps: streaming's
        last round sent at its end (step()), so nothing trained is left outside an exchange. One report each, so
        each apply's monitor fields are logged at its own round."""
        reports = []
        if self.cfg.final_sync and self.steps_in_round:
            reports.append(self._outer_step())
        if self.in_flight is not None:
            exchange, self.in_flight = self.in_flight, None
            blocked_s, overlapped_s, fields = self._apply(exchange)
            reports.append(SyncReport(0, blocked_s, overlapped_s, fields))
        copy_into(self.global_params, self.params)
        return reports

    def applied_steps(self, trained_steps: int) -> int:
        return self.synchronized_steps

    def optimizer_state_bytes(self) -> int:
        """Inner AdamW moments, theta, the outer momentum buffer, the error-feedback residuals and, under eager,
        the look-ahead the round started from, for this stage.

        Not counted: the compressor's warm-start factors Q (n x r per matrix), the monitor's last average, and the
        payload buffers of an exchange in flight: communication state, not optimizer state.
        """
        residuals = tensor_bytes(self.error_feedback.residuals.values())
        look_ahead = tensor_bytes(self.round_start) if self.round_start is not self.global_params else 0
        return super().optimizer_state_bytes() + self.outer.state_bytes() + residuals + look_ahead
