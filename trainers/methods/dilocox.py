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

`overlap` says when Delta_t is applied and where round t+1 starts: `streaming` (the default, arXiv 2501.18512)
starts the exchange tau = `overlap_steps` steps before the round ends and blends at its end, theta_i = alpha theta_i
+ (1 - alpha) theta_t; `none` waits for it (blocking: streaming at tau = 0, alpha = 0, bit for bit); `delayed` (the
paper's Algorithm 2) applies Delta_{t-1} at the end of round t and restarts from that theta; `eager` (arXiv
2502.12996) commits as `delayed` but restarts from a look-ahead holding the replica's own fresh share,
s_i = theta_t - eta (1 + mu) D(P_i^t) / n. Each mode is a strategy of trainers/overlap.py, each exchange (gather,
reduce, fp16) one of trainers/exchange.py; the class below is the round they plug into.

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
from typing import Any

import torch
import torch.distributed as dist

from trainers.comm import flatten
from trainers.compression import powersgd
from trainers.compression.compressors import LowRankQuantizeCompressor
from trainers.compression.quantize import validate_quantization_flags
from trainers.exchange import EXCHANGES, ExchangeDesign, Sent, round_exchange
from trainers.method import (
    Method,
    MethodContext,
    NesterovRoundConfig,
    RoundConfig,
    SyncPlan,
    SyncReport,
    copy_into,
    default_of,
    tensor_bytes,
)
from trainers.optim import OuterOptimizer, validate_outer
from trainers.overlap import OVERLAP_MODES, OverlapMode, overlap_mode
from trainers.round_metrics import outer_step_monitor


@dataclass(frozen=True)
class DiLoCoXConfig(NesterovRoundConfig):
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

    local_steps: int = default_of(RoundConfig, "local_steps", 20)
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
            "under exchange=reduce or compression=false.",
            "applies_when": {"exchange": ("gather",), "compression": (True,)},
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
            "1. Unused under exchange=reduce (one warm-started iteration) or compression=false.",
            "applies_when": {"exchange": ("gather",), "compression": (True,)},
        },
    )
    overlap: OverlapMode = field(
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
            "study ran (5 at H = 50).",
            "applies_when": {"overlap": ("streaming",)},
        },
    )
    merge_alpha: float = field(
        default=0.5,
        metadata={
            "help": "alpha, under overlap=streaming: the local copy's weight when a replica blends its weights with "
            "the new theta at a round's end (torchft's alpha), in [0, 1]; 0 restarts from theta, dropping the steps "
            "taken while the exchange ran.",
            "applies_when": {"overlap": ("streaming",)},
        },
    )
    exchange: ExchangeDesign = field(
        default="gather",
        metadata={
            "help": "How the compressed pseudo-gradients travel: gather (the paper's: every replica's factors to every "
            "other, n-1 payloads per site) or reduce (PowerSGD's shared basis: factors add, 2(n-1)/n of one payload "
            "per site; bits and power_iterations unused, not with overlap=eager or compression=false; "
            "trainers/compression/powersgd.py).",
            "before_it_existed": "gather",
        },
    )
    reduce_wire: powersgd.RunWire = field(
        default="bf16",
        metadata={
            "help": "Under exchange=reduce, what the all-reduces carry: bf16, or int8 or int4 through a ring that "
            "re-quantizes each hop (half or a quarter of bf16's bytes).",
            "applies_when": {"exchange": ("reduce",)},
            "before_it_existed": "bf16",
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
    min_rank: int = field(
        default=4,
        metadata={
            "help": "The lowest rank adaptation may choose, between 1 and rank.",
            "applies_when": {"adaptive": (True,)},
        },
    )
    max_local_steps: int | None = field(
        default=None,
        metadata={
            "help": "The longest round adaptation may choose, in steps; at least local_steps. none: 4 x local_steps.",
            "applies_when": {"adaptive": (True,)},
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

    def checkpoint_refusal(self) -> str | None:
        if self.overlap in ("delayed", "eager"):
            return (
                f"overlap={self.overlap} keeps a round's exchange in flight through the next round, so no step is free "
                "of it to checkpoint; use --set dilocox.overlap=streaming or none with checkpoint_every"
            )
        return None

    def fault_tolerance_refusal(self) -> str | None:
        # A round under fault tolerance starts from a snapshot with nothing in flight, and a heal moves that
        # snapshot: delayed and eager carry an exchange across the round boundary. The reduce's ring is point to
        # point on the torch.distributed group, which torchft does not reconfigure.
        if self.overlap in ("delayed", "eager"):
            return (
                f"overlap={self.overlap} keeps a round's exchange in flight through the next round, which a replica "
                "that heals cannot fetch; use --set dilocox.overlap=streaming or none with fault tolerance"
            )
        if self.exchange == "reduce":
            return (
                "exchange=reduce sends its factors point to point, which torchft's group does not carry; use "
                "--set dilocox.exchange=gather (or compression=false) with fault tolerance"
            )
        return None

    @property
    def local_steps_cap(self) -> int:
        return 4 * self.local_steps if self.max_local_steps is None else self.max_local_steps

    def compressor(self, seed: int = 0) -> LowRankQuantizeCompressor:
        """C_Q o C_L at r_1; `seed` draws the power iteration's cold start (a payload's size does not depend on it)."""
        return LowRankQuantizeCompressor(
            self.rank, self.bits, self.bucket_size, seed=seed, power_iterations=self.power_iterations
        )

    def check_shapes(self, shapes: Sequence[torch.Size]) -> None:
        round_exchange(self).check_shapes(self, shapes)

    def sync_plan(self, shapes: Sequence[torch.Size]) -> SyncPlan:
        """Once a round the exchange's collectives at r_1 (trainers/exchange.py: the factors' all-gather, P's and Q's
        all-reduces, or the fp16 all-reduce) and, with adaptation, the rank estimate's all-reduce beside them,
        hidden behind the steps the overlap runs while they are in flight. At r_1 and H_1: adaptation lowers r and
        raises H from there."""
        exchanges, sequential = round_exchange(self).planned(self, shapes)
        hidden = overlap_mode(self).hidden_steps(self.local_steps)
        return SyncPlan(
            exchanges, self.local_steps, hidden, slow_start=True, adaptive=self.adaptive, sequential=sequential
        )


def adapted_schedule(estimates: Sequence[int], cfg: DiLoCoXConfig) -> tuple[int, int]:
    """(r, H) for the next round from the window of rank estimates (the rule in the module docstring)."""
    rank = min(cfg.rank, max(cfg.min_rank, math.ceil(sum(estimates) / len(estimates))))
    return rank, min(cfg.local_steps_cap, round(cfg.local_steps * cfg.rank / rank))


class DiLoCoX(Method):
    """The round of the module docstring: step() runs H_t inner steps and starts the exchange `lead` steps before
    the round's end (_send), _outer_step() applies what has landed (_apply: the outer step, then adaptation) and
    restarts the replica; finish() lands what is still in flight. The overlap mode and the exchange are strategies
    chosen once here, from the config."""

    config_class = DiLoCoXConfig
    keeps_global_copy = True  # theta
    # Under streaming and none nothing is in flight between rounds' exchanges; delayed and eager always hold one
    # (DiLoCoXConfig.checkpoint_refusal).
    resumable = True

    def __init__(self, ctx: MethodContext, cfg: DiLoCoXConfig):
        super().__init__(ctx, cfg)
        # The dual optimizer of this stage only: the inner AdamW (the base class's) on the local weights, the
        # outer Nesterov on theta.
        self.outer = OuterOptimizer(self.global_params, cfg.outer_lr, cfg.outer_momentum)
        self.overlap = overlap_mode(cfg, ctx.replicas)  # when the exchange runs and lands, where rounds restart
        self.exchange = round_exchange(cfg)(cfg, ctx)  # how the pseudo-gradients travel
        self.rank = cfg.rank  # r_t of the round in progress
        self.local_steps = cfg.local_steps  # H_t of the round in progress
        # The window starts full of r_1: an early estimate, from pseudo-gradients of the warm-up, moves r only
        # 1/c of the way, and r keeps falling only while the estimates stay low.
        self.rank_estimates = deque([cfg.rank] * cfg.rank_window, maxlen=cfg.rank_window)
        # s_i, where the round in progress started and its delta is measured from: theta itself, except that
        # eager restarts from its own look-ahead.
        self.round_start = self.overlap.round_start(self.global_params)
        self.round = 0  # rounds sent
        self.steps_in_round = 0
        self.unsent_steps = 0  # steps whose progress is only in the local weights, not yet in an exchange
        self.synchronized_steps = 0  # steps of the exchanges applied to theta so far
        self.sending: Sent | None = None  # this round's exchange, started `lead` steps before its end
        self.last_average: torch.Tensor | None = None  # for the monitor: the last Delta applied, flat

    def step(self, step: int) -> SyncReport | None:
        self.inner.step()
        self.steps_in_round += 1
        self.unsent_steps += 1
        lead = self.overlap.lead
        # The round in which training ends sends at its end, holding every step (the module docstring, finish()).
        ends_run = self.ctx.total_steps - 1 - step <= lead
        if self.steps_in_round == self.local_steps - lead and not ends_run:
            self.sending = self._send()
        if self.steps_in_round < self.local_steps:
            return None
        return self._outer_step()

    @torch.no_grad()
    def _outer_step(self) -> SyncReport:
        """The end of a round: send it (if it was not sent `lead` steps ago), apply what has landed, restart."""
        sent = self.sending if self.sending is not None else self._send()
        self.sending = None
        # This round's exchange, or, overlapped, the last round's (None in round 1: theta stays theta_0).
        arrived = self.overlap.land(sent)
        fields = {**sent.fields, "round_steps": self.steps_in_round}
        blocked_s = overlapped_s = 0.0
        if arrived is not None:
            blocked_s, overlapped_s, applied = self._apply(arrived)
            fields.update(applied)
        if self.overlap.restart(self.global_params, self.params, sent):
            self.unsent_steps = 0
        self.steps_in_round = 0
        return SyncReport(
            payload_bytes=sent.payload_bytes, blocked_s=blocked_s, overlapped_s=overlapped_s, fields=fields
        )

    @torch.no_grad()
    def _send(self) -> Sent:
        """Start exchanging the progress since the round started (and, alongside, the rank estimate)."""
        self.round += 1
        deltas = [s - p.float() for s, p in zip(self.round_start, self.params, strict=True)]
        steps, self.unsent_steps = self.unsent_steps, 0
        fields = {"round": self.round, "rank_r": self.rank, "local_steps_h": self.local_steps}
        sent = Sent(self.round, steps, self.rank, fields)
        self.exchange.send(deltas, sent, keep_own=self.overlap.keeps_own_share)
        return sent

    @torch.no_grad()
    def _apply(self, sent: Sent) -> tuple[float, float, dict]:
        """Wait for `sent`, take the outer step with its average and adapt; (blocked, overlapped, fields)."""
        landed = self.exchange.land(sent, self.global_params)
        before = [g.clone() for g in self.global_params]
        self.outer.step(landed.average)
        self.synchronized_steps += sent.steps

        fields = landed.fields
        fields.update(estimated_rank=self._estimated_rank(sent.rank_totals), **self._monitor(before, landed.average))
        if self.cfg.adaptive:
            self.rank_estimates.append(fields["estimated_rank"])
            # Takes effect from the round that starts now: its payload and its length.
            self.rank, self.local_steps = adapted_schedule(self.rank_estimates, self.cfg)
        return landed.blocked_s, landed.overlapped_s, fields

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
        pending = self.overlap.drain()
        if pending is not None:
            blocked_s, overlapped_s, fields = self._apply(pending)
            reports.append(SyncReport(0, blocked_s, overlapped_s, fields))
        copy_into(self.global_params, self.params)
        return reports

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

    def applied_steps(self, trained_steps: int) -> int:
        return self.synchronized_steps

    def checkpointable(self) -> bool:
        """Between a round's end and the step its next exchange starts (streaming: all but a round's last tau
        steps), where everything is local: the exchange, the outer step and adaptation are done."""
        return self.sending is None and self.overlap.idle()

    def state_dict(self) -> dict[str, Any]:
        if not self.checkpointable():
            raise RuntimeError("DiLoCoX's state was asked for with an exchange in flight")
        return {
            **super().state_dict(),
            "outer_optimizer": self.outer.state_dict(),
            "exchange": self.exchange.state_dict(),
            "rank": self.rank,
            "local_steps": self.local_steps,
            "rank_estimates": list(self.rank_estimates),
            "round": self.round,
            "steps_in_round": self.steps_in_round,
            "unsent_steps": self.unsent_steps,
            "synchronized_steps": self.synchronized_steps,
            "last_average": self.last_average,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.outer.load_state_dict(state["outer_optimizer"])
        self.exchange.load_state_dict(state.get("exchange", {}))
        self.rank_estimates.extend(state["rank_estimates"])  # a full window: maxlen drops the initial ones
        for name in ("rank", "local_steps", "round", "steps_in_round", "unsent_steps", "synchronized_steps"):
            setattr(self, name, state[name])
        self.last_average = state["last_average"]

    def optimizer_state_bytes(self) -> int:
        """Inner AdamW moments, theta, the outer momentum buffer, the error-feedback residuals and, under eager,
        the look-ahead the round started from, for this stage.

        Not counted: the compressor's warm-start factors Q (n x r per matrix), the monitor's last average, and the
        payload buffers of an exchange in flight: communication state, not optimizer state.
        """
        residuals = self.exchange.state_bytes()
        look_ahead = tensor_bytes(self.round_start) if self.round_start is not self.global_params else 0
        return super().optimizer_state_bytes() + self.outer.state_bytes() + residuals + look_ahead
