"""How a round's pseudo-gradients travel between replicas (DiLoCoX's `exchange` and `compression`): one strategy
per design, chosen once from the settings (`round_exchange`), each with the same hooks:

    send(deltas, sent, keep_own)    start round `sent`'s exchange (and the rank estimate's, alongside), recording in
                                    `sent` what is in flight and what sending measured (compression error, bounds)
    land(sent, theta)               wait for it: the average, the replicas' mean pseudo-gradient shaped like theta
                                    and bit-identical on every rank, with the time blocked and what landing measured
    planned(settings, shapes)       the collectives one exchange starts, as a SyncPlan declares them
    check_shapes(settings, shapes)  refuse a model the design cannot send
    state_bytes()                   what it keeps between rounds: the error-feedback residuals

    Fp16Sum            compression=false: one flat fp16 buffer summed by an all-reduce, as OpenDiLoCo sends
    LowRankGather      gather: rank-r int-q factors of c = delta + e (error feedback), all-gathered, every payload
                       decoded in rank order
    SharedBasisReduce  reduce: PowerSGD's shared basis, whose factors add: two all-reduces on a thread of their own
                       (trainers/compression/powersgd.py)

The rank estimate rides along: each replica's [sum of its matrices' estimated ranks, matrices], summed over the
replicas by a 16-byte all-reduce beside the payload (under reduce: one value inside the first all-reduce) when the
rank adapts, and this replica's own otherwise.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

import torch

from trainers.comm import InFlight, InThread, all_gather_bytes, all_reduce_sum, flatten, unflatten_into
from trainers.compression import powersgd
from trainers.compression.compressors import LowRankQuantizeCompressor, mean_of_payloads
from trainers.compression.error_feedback import ErrorFeedback, relative_error
from trainers.compression.lowrank import estimate_rank
from trainers.method import Exchange, MethodContext, numel, tensor_bytes
from trainers.round_metrics import weighted_omega2

ExchangeDesign = Literal["gather", "reduce"]
EXCHANGES: tuple[str, ...] = ("gather", "reduce")
# The rank estimate's all-reduce: [sum of the matrices' estimates, matrices] (rank_totals).
RANK_TOTALS_DTYPE = torch.float64
RANK_TOTALS_BYTES = 2 * RANK_TOTALS_DTYPE.itemsize
# Under exchange=reduce the estimate rides in P's all-reduce: one value, the replica's mean over its matrices / n.
REDUCED_ESTIMATE_VALUES = 1


class ExchangeSettings(Protocol):
    """What the strategies read of a method's settings (DiLoCoXConfig's fields)."""

    compression: bool
    exchange: ExchangeDesign
    rank: int
    bits: int
    bucket_size: int
    reduce_wire: powersgd.RunWire
    adaptive: bool
    energy: float

    def compressor(self, seed: int = 0) -> LowRankQuantizeCompressor: ...


@dataclass
class Sent:
    """One round's pseudo-gradients on their way to every replica: the round as the method sent it, and what its
    exchange put in flight (`send`)."""

    round: int
    steps: int  # inner steps whose progress it carries: applied with it
    rank: int  # the r its payloads were encoded with: decoding them needs it, and r may change before they land
    fields: dict  # measured when sent: r, H, compression error and its bounds
    inflight: InFlight | InThread = field(default_factory=lambda: InFlight(None, 0))
    buffers: list[torch.Tensor] = field(default_factory=list)  # gathered payloads, or the one summed fp16 buffer
    rank_totals: torch.Tensor | None = None  # [sum of matrix rank estimates, matrices], over the replicas once landed
    estimate: InFlight = field(default_factory=lambda: InFlight(None, 0))  # rank_totals' all-reduce, if adaptive
    own_share: list[torch.Tensor] | None = None  # keep_own: this replica's D(P_i), what it sent, decoded

    @property
    def payload_bytes(self) -> int:
        return self.inflight.payload_bytes + self.estimate.payload_bytes


class Landed(NamedTuple):
    average: list[torch.Tensor]  # Delta: the replicas' mean pseudo-gradient per parameter
    blocked_s: float
    overlapped_s: float
    fields: dict  # measured on landing


class RoundExchange(ABC):
    """The hooks every design answers (the module docstring); the rank estimate and the waiting are shared."""

    def __init__(self, settings: ExchangeSettings, ctx: MethodContext):
        self.settings = settings
        self.names = [name for name, _ in ctx.named_params]
        self.ctx, self.group = ctx, ctx.data_parallel_group
        self.error_feedback = ErrorFeedback()  # e_i, per parameter name

    @property
    def replicas(self) -> int:
        """The replicas an exchange averages over, asked each time: under fault tolerance the quorum changes."""
        return self.ctx.replicas

    @classmethod
    @abstractmethod
    def planned(cls, settings: ExchangeSettings, shapes: Sequence[torch.Size]) -> tuple[tuple[Exchange, ...], bool]:
        """The collectives one exchange starts for a replica of these parameter shapes at r_1, and whether they run
        one after another (`SyncPlan.sequential`)."""

    @classmethod
    def check_shapes(cls, settings: ExchangeSettings, shapes: Sequence[torch.Size]) -> None:
        """Every design but reduce sends any model."""
        return None

    @abstractmethod
    def send(self, deltas: list[torch.Tensor], sent: Sent, keep_own: bool) -> None:
        """Start exchanging `deltas`; `keep_own`: record this replica's own decoded share in `sent.own_share`."""

    def land(self, sent: Sent, theta: list[torch.Tensor]) -> Landed:
        blocked_s, overlapped_s = sent.inflight.wait()
        waited_s, hidden_s = sent.estimate.wait()
        average, fields = self._average(sent, theta)
        return Landed(average, blocked_s + waited_s, overlapped_s + hidden_s, fields)

    @abstractmethod
    def _average(self, sent: Sent, theta: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
        """Once `sent` has landed: the average, and what landing measured."""

    def state_bytes(self) -> int:
        return tensor_bytes(self.error_feedback.residuals.values())

    def state_dict(self) -> dict[str, Any]:
        """What carries from one exchange to the next (a checkpoint's, between exchanges): e_i per parameter."""
        return {"error_feedback": self.error_feedback.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A checkpoint drops empty mappings (nothing to save before the first exchange).
        self.error_feedback.load_state_dict(state.get("error_feedback", {}))

    def _estimate(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, InFlight]:
        """rank_totals of `tensors`, and, where the rank adapts, their all-reduce over the replicas started (so the
        window gets the replicas' mean)."""
        totals = rank_totals(tensors, self.settings.energy)
        if not self.settings.adaptive:
            return totals, InFlight(None, 0)
        return totals, all_reduce_sum(totals, self.group)


def rank_totals(tensors: list[torch.Tensor], energy: float) -> torch.Tensor:
    """[sum of estimate_rank over the matrices among `tensors`, matrices]."""
    ranks = [estimate_rank(t.reshape(t.shape[0], -1), energy) for t in tensors if t.ndim >= 2]
    return torch.tensor([sum(ranks), len(ranks)], dtype=RANK_TOTALS_DTYPE, device=tensors[0].device)


def _with_estimate(settings: ExchangeSettings, payload: Exchange) -> tuple[tuple[Exchange, ...], bool]:
    estimate = (Exchange("all-reduce", RANK_TOTALS_BYTES),) if settings.adaptive else ()
    return (payload, *estimate), False


class Fp16Sum(RoundExchange):
    """compression=false: the pseudo-gradients in one flat fp16 bucket, summed in fp16 on the wire, exactly as
    OpenDiLoCo does (the rank then only sets the round length).

    DiLoCoX with this, overlap=none and adaptive=false is OpenDiLoCo to the bit (tests/trainers/methods/
    test_dilocox.py), yet OpenDiLoCo does not send through it: besides the same three calls (cast, comm's
    all_reduce_sum, the mean) this also estimates every matrix's rank (an SVD each round), measures the wire's
    error and keeps eager's own share, work OpenDiLoCo's step must not pay for."""

    @classmethod
    def planned(cls, settings: ExchangeSettings, shapes: Sequence[torch.Size]) -> tuple[tuple[Exchange, ...], bool]:
        return _with_estimate(settings, Exchange("all-reduce", torch.float16.itemsize * numel(shapes)))

    def send(self, deltas: list[torch.Tensor], sent: Sent, keep_own: bool) -> None:
        wire = flatten(deltas).to(torch.float16)
        if keep_own:
            sent.own_share = [torch.empty_like(d) for d in deltas]
            unflatten_into(wire.float(), sent.own_share)
        error = relative_error(flatten(deltas), wire)
        sent.fields.update(
            compression_error=error, compression_error2=error**2, omega2_paper=None, omega2_corrected=None
        )
        sent.rank_totals, sent.estimate = self._estimate(deltas)
        sent.buffers, sent.inflight = [wire], all_reduce_sum(wire, self.group)

    def _average(self, sent: Sent, theta: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
        average = [torch.empty_like(g) for g in theta]
        unflatten_into(sent.buffers[0].float() / self.replicas, average)
        return average, {}


class LowRankGather(RoundExchange):
    """exchange=gather, the paper's: c_i = delta_i + e_i, P_i = C_Q(C_L(c_i; r)), e_i = c_i - D(P_i); every payload
    all-gathered and decoded in rank order, so the average is bit-identical everywhere."""

    def __init__(self, settings: ExchangeSettings, ctx: MethodContext):
        super().__init__(settings, ctx)
        self.compressor = settings.compressor(ctx.seed)  # C_Q o C_L, at the rank of the round it encodes

    @classmethod
    def planned(cls, settings: ExchangeSettings, shapes: Sequence[torch.Size]) -> tuple[tuple[Exchange, ...], bool]:
        compressor = settings.compressor()
        return _with_estimate(settings, Exchange("all-gather", sum(compressor.payload_nbytes(s) for s in shapes)))

    def send(self, deltas: list[torch.Tensor], sent: Sent, keep_own: bool) -> None:
        self.compressor.rank = sent.rank
        payloads, compensated, transmitted = [], [], []
        for name, delta in zip(self.names, deltas, strict=True):
            c = self.error_feedback.compensate(name, delta)
            payload = self.compressor.encode(c, sent.round, key=name)
            # The residual is what this replica's payload really carries short of c: decode it as others will.
            t = self.compressor.decode(payload, c.shape, sent.round)
            self.error_feedback.update(name, c, t)
            payloads.append(payload)
            compensated.append(c)
            transmitted.append(t)
        # Every replica of the group uses the same shapes and r, so the buffers have equal sizes, as gather needs.
        sent.buffers, sent.inflight = all_gather_bytes(torch.cat(payloads), self.group)
        error = relative_error(flatten(compensated), flatten(transmitted))
        sent.fields.update(
            compression_error=error,
            compression_error2=error**2,
            **weighted_omega2(compensated, sent.rank, self.settings.bits),
        )
        # Estimated on c, before compression: after it, at most r of its directions are left to see.
        sent.rank_totals, sent.estimate = self._estimate(compensated)
        sent.own_share = transmitted if keep_own else None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "warm_start": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.compressor.load_state_dict(state.get("warm_start", {}))

    def _average(self, sent: Sent, theta: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
        # Decoding needs only the shapes and the rank the payloads were made with.
        decoder = LowRankQuantizeCompressor(sent.rank, self.settings.bits, self.settings.bucket_size)
        return mean_of_payloads(sent.buffers, decoder, [g.shape for g in theta], sent.round), {}


class SharedBasisReduce(RoundExchange):
    """exchange=reduce: every replica starts from one shared basis, so the factors add and two all-reduces carry
    them, on a thread of their own; the rank estimate rides in the first (trainers/compression/powersgd.py)."""

    def __init__(self, settings: ExchangeSettings, ctx: MethodContext):
        super().__init__(settings, ctx)
        # The run's seed is every replica's, so their shared bases start equal.
        self.reducer = powersgd.PowerSGDReducer(ctx.seed, settings.reduce_wire)
        self.pending: InThread | None = None  # the last exchange sent, until it lands

    @classmethod
    def planned(cls, settings: ExchangeSettings, shapes: Sequence[torch.Size]) -> tuple[tuple[Exchange, ...], bool]:
        # P's all-reduce (the rank estimate inside it), then Q's, which needs P: one after the other.
        extra = REDUCED_ESTIMATE_VALUES if settings.adaptive else 0
        numels = powersgd.buffer_numels(shapes, settings.rank, extra, settings.reduce_wire)
        return tuple(Exchange("all-reduce", powersgd.buffer_nbytes(n, settings.reduce_wire)) for n in numels), True

    @classmethod
    def check_shapes(cls, settings: ExchangeSettings, shapes: Sequence[torch.Size]) -> None:
        powersgd.check_rank(shapes, settings.rank)

    def send(self, deltas: list[torch.Tensor], sent: Sent, keep_own: bool) -> None:
        """Its error feedback is set when its factors are known, so the exchange before must have landed before this
        round compensates (under delayed it may still be in flight: waiting here is time blocked on the link,
        reported with that exchange). No own share: it is known only once the first all-reduce is done."""
        if self.pending is not None:
            self.pending.wait()
        compensated = [self.error_feedback.compensate(n, d) for n, d in zip(self.names, deltas, strict=True)]
        sent.rank_totals = rank_totals(compensated, self.settings.energy)
        total, count = sent.rank_totals.tolist()
        adapts = self.settings.adaptive and count > 0
        extra = torch.tensor([total / count / self.replicas] if adapts else [])
        rank, wire = sent.rank, self.settings.reduce_wire

        def run() -> tuple[powersgd.Reduced, dict]:
            reduced = self.reducer.exchange(compensated, self.names, rank, extra, self.group, self.replicas)
            for name, c, t in zip(self.names, compensated, reduced.transmitted, strict=True):
                self.error_feedback.update(name, c, t)
            error = relative_error(flatten(compensated), flatten(reduced.transmitted))
            bounds = weighted_omega2(compensated, rank, powersgd.WIRE_BITS[wire])
            return reduced, {"compression_error": error, "compression_error2": error**2, **bounds}

        shapes = [d.shape for d in deltas]
        sent.inflight = InThread(run, powersgd.payload_bytes(shapes, rank, self.replicas, extra.numel(), wire))
        self.pending = sent.inflight
        if adapts:
            # Filled in from the reduced estimate once the exchange lands (_average): [mean x matrices, matrices].
            sent.rank_totals = torch.tensor([math.nan, count], dtype=RANK_TOTALS_DTYPE)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "basis": self.reducer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.reducer.load_state_dict(state.get("basis", {}))

    def _average(self, sent: Sent, theta: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
        if self.pending is sent.inflight:
            self.pending = None
        reduced, fields = sent.inflight.result
        if self.settings.adaptive and reduced.extra.numel():
            sent.rank_totals[0] = float(reduced.extra[0]) * sent.rank_totals[1]
        return reduced.average, fields


def round_exchange(settings: ExchangeSettings) -> type[RoundExchange]:
    """The design the settings choose."""
    if not settings.compression:
        return Fp16Sum
    return SharedBasisReduce if settings.exchange == "reduce" else LowRankGather
