"""A low-rank exchange whose factors add: PowerSGD's shared-basis power iteration (Vogels et al., NeurIPS 2019,
Algorithm 1), as DiLoCoX's `--exchange reduce`.

DiLoCoX's own exchange (`gather`) sends each replica's rank-r factors of its pseudo-gradient to every other
replica, since a sum of factors is not the factor of the sum: each site sends (n - 1) payloads a round. Here every
replica starts each matrix's power iteration from the same Q (one seed, then the last round's), so the factors
of the replicas' matrices add, and two all-reduces carry them:

    P_i = M_i Q0            all-reduce  P = sum_i P_i             Q0 orthonormalised: only its span matters
    P^  = orth(P)           a reduced QR of the same P on every replica, so P^ is the same everywhere
    Q_i = M_i^T P^          all-reduce  Q = sum_i Q_i
    average         = P^ Q^T / n       the mean of the M_i projected onto span(P^)
    transmitted_i   = P^ Q_i^T         replica i's share: the average is the mean of the shares, so error
                                       feedback e_i = M_i - transmitted_i keeps what the average misses of M_i
    next round's Q0 = Q                the warm start (PowerSGD), the same on every replica

Each all-reduce is a ring (trainers/comm.py), so a site sends 2(n-1)/n of each buffer: the bytes per site do
not grow with the number of sites. The average is the low-rank part of the mean, not the mean of each replica's
low-rank part. One power iteration per round, as PowerSGD (a second would cost two more all-reduces, round trips
included); the warm start refines the subspace over rounds.

What travels (`wire`): bf16, summed in bf16 by gloo's ring all-reduce (fp16's range underflows on a small
pseudo-gradient's factors), or int8 or int4 codes with one fp16 scale per 128 values, through a ring by hand that
re-quantizes each hop's partial sum (comm.quantized_ring_sum: half or a quarter of bf16's bytes, n quantization
errors in the sum). Each of those errors is made by one replica, which knows it: its share gives up the rounding
it put on the wire (Q_i less its rounding, a whole tensor less its), so the shares still add up to the average
exactly and error feedback keeps the wire's rounding for the next round. The rounding of P needs no keeping: it
only moves span(P^), which every replica then uses alike. Under int8 and int4 every tensor's part of a buffer
starts on a bucket boundary, so no bucket mixes two tensors' scales.
A tensor whose factors would not be smaller than it (1-D, a small matrix; lowrank.goes_as_factors) travels
whole in the first all-reduce. `extra` (a few values, DiLoCoX's rank estimate) rides in the first buffer too, so it
needs no collective or round trip of its own.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from trainers.comm import allreduce_payload_bytes, quantized_ring_payload_bytes, quantized_ring_sum
from trainers.compression.lowrank import goes_as_factors, resized_basis
from trainers.compression.quantize import quantized_nbytes
from trainers.compression.shapes import Shape, matrix_shape

Wire = Literal["bf16", "int8", "int4", "fp32"]  # fp32: exact sums, for tests
RunWire = Literal["bf16", "int8", "int4"]  # what a run may choose (its setting's type lists these)
WIRES: tuple[str, ...] = typing.get_args(RunWire)
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CODE_BITS = {"int8": 8, "int4": 4}  # the wires that travel as codes through comm.quantized_ring_sum
CODE_BUCKET = 128
# The q of each wire in the compression-error bounds (trainers/round_metrics.py): bf16 keeps 8 significant bits, so
# its relative rounding error is at most 2^-8, which the bounds' 2^(-q/2) reads as q = 16.
WIRE_BITS = {"bf16": 16, **CODE_BITS}


@dataclass
class Reduced:
    """One exchange's outcome, the same on every replica except `transmitted` (this replica's share)."""

    average: list[torch.Tensor]
    transmitted: list[torch.Tensor]
    extra: torch.Tensor  # the sum over replicas of every replica's `extra`, fp32


def _align(wire: Wire) -> int:
    return CODE_BUCKET if wire in CODE_BITS else 1


def _padded(numel: int, align: int) -> int:
    return -(-numel // align) * align


def _unpadded(flat: torch.Tensor, sizes: Sequence[int], align: int) -> list[torch.Tensor]:
    """The parts of a buffer laid out by PowerSGDReducer._sum, without their padding."""
    chunks = flat.split([_padded(size, align) for size in sizes])
    return [chunk[:size] for chunk, size in zip(chunks, sizes, strict=True)]


def factor_rank(shape: Shape, rank: int) -> int | None:
    """r for a tensor sent as factors at `rank`; None for one sent whole."""
    return min(rank, *matrix_shape(shape)) if goes_as_factors(shape, rank) else None


def check_rank(shapes: Sequence[Shape], rank: int) -> None:
    """Refuse a rank that leaves no matrix factored: everything would travel whole, uncompressed but for bf16."""
    if any(goes_as_factors(shape, rank) for shape in shapes):
        return
    useful = [(m * n - 1) // (m + n) for m, n in (matrix_shape(s) for s in shapes if len(s) >= 2)]
    raise ValueError(
        f"rank={rank} leaves no matrix of this model factored under exchange=reduce (every rank-{rank} factor "
        f"pair is as large as its matrix); use --set rank={max(useful, default=1)} or lower"
    )


def buffer_numels(shapes: Sequence[Shape], rank: int, extra: int = 0, wire: Wire = "bf16") -> tuple[int, int]:
    """Values in the first (P and whole tensors, then `extra`) and the second (Q) all-reduce, each part padded to
    whole buckets under int8 and int4."""
    align = _align(wire)
    first, second = _padded(extra, align), 0
    for shape in shapes:
        r = factor_rank(shape, rank)
        if r is None:
            first += _padded(math.prod(shape), align)
        else:
            m, n = matrix_shape(shape)
            first, second = first + _padded(m * r, align), second + _padded(n * r, align)
    return first, second


def buffer_nbytes(numel: int, wire: Wire) -> int:
    """One replica's buffer of `numel` values as the wire holds it (a plan's all-reduce size)."""
    if wire in CODE_BITS:
        return quantized_nbytes(numel, CODE_BITS[wire], CODE_BUCKET)
    return numel * WIRE_DTYPES[wire].itemsize


def payload_bytes(shapes: Sequence[Shape], rank: int, replicas: int, extra: int = 0, wire: Wire = "bf16") -> int:
    """What each replica sends for one exchange: both ring all-reduces."""
    numels = buffer_numels(shapes, rank, extra, wire)
    if wire in CODE_BITS:
        return sum(quantized_ring_payload_bytes(n, replicas, CODE_BITS[wire], CODE_BUCKET) for n in numels)
    return sum(allreduce_payload_bytes(buffer_nbytes(n, wire), replicas) for n in numels)


class PowerSGDReducer:
    """The shared-basis exchange of one pipeline stage's tensors. The rank is given per exchange (DiLoCoX adapts
    it between rounds, identically on every replica); the basis follows it (lowrank.resized_basis)."""

    def __init__(self, seed: int, wire: Wire = "bf16") -> None:
        self.seed = seed  # the run's seed: the same on every replica, so their first Q0 agree
        self.wire = wire
        self._basis: dict[str, torch.Tensor] = {}  # Q per tensor key: the last round's, the same everywhere

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The shared basis Q per key, the last round's."""
        return dict(self._basis)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._basis = dict(state)

    def _start(self, key: str, shape: Shape, rank: int) -> torch.Tensor:
        """Q0, orthonormal: the same on every replica (the shared last Q, or one seed's Gaussian)."""
        m, n = matrix_shape(shape)
        q = resized_basis(self._basis.get(key), shape, rank, self.seed)
        if q is None:
            q = torch.randn(n, min(rank, m, n), generator=torch.Generator().manual_seed(self.seed))
        return torch.linalg.qr(q.float()).Q

    def _rounded(self, x: torch.Tensor) -> torch.Tensor:
        """What this replica's own share is worth once sent: bf16 rounds it; under int8 and int4 the sum is rounded
        on the way, not the share (_sum returns that rounding)."""
        return x.to(WIRE_DTYPES[self.wire]).float() if self.wire in WIRE_DTYPES else x

    def _sum(
        self, parts: Sequence[torch.Tensor], group: dist.ProcessGroup | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each part summed over the replicas (one buffer, one ring all-reduce), and the rounding this replica put
        on each part on the wire (zeros but under int8 and int4)."""
        align = _align(self.wire)
        sizes = [p.numel() for p in parts]
        flat = torch.cat(
            [torch.nn.functional.pad(p.reshape(-1).float(), (0, _padded(p.numel(), align) - p.numel())) for p in parts]
            or [torch.empty(0)]
        )
        rounding = torch.zeros_like(flat)
        if group is not None and flat.numel():
            if self.wire in CODE_BITS:
                flat, rounding = quantized_ring_sum(flat, group, CODE_BITS[self.wire], CODE_BUCKET)
            else:
                flat = flat.to(WIRE_DTYPES[self.wire])
                dist.all_reduce(flat, group=group)
        elif self.wire in WIRE_DTYPES:
            flat = flat.to(WIRE_DTYPES[self.wire])
        return _unpadded(flat.float(), sizes, align), _unpadded(rounding, sizes, align)

    def exchange(
        self,
        tensors: Sequence[torch.Tensor],
        keys: Sequence[str],
        rank: int,
        extra: torch.Tensor,
        group: dist.ProcessGroup | None,
        replicas: int,
    ) -> Reduced:
        """Both all-reduces and what lies between them, blocking (DiLoCoX runs it on a thread: comm.InThread).
        With no group (one replica) nothing travels and the result is the same compression applied locally."""
        ranks = [factor_rank(t.shape, rank) for t in tensors]
        matrices = [t.reshape(matrix_shape(t.shape)).float() for t in tensors]
        sent_first = [
            m if r is None else m @ self._start(key, t.shape, rank)
            for key, t, m, r in zip(keys, tensors, matrices, ranks, strict=True)
        ]
        (*summed_first, summed_extra), (*rounding_first, _) = self._sum([*sent_first, extra.float()], group)

        bases = [
            None if r is None else torch.linalg.qr(summed.view(m.shape[0], r)).Q
            for summed, m, r in zip(summed_first, matrices, ranks, strict=True)
        ]
        own_q = [None if p is None else self._rounded(m.T @ p) for m, p in zip(matrices, bases, strict=True)]
        summed_second, rounding_second = (iter(x) for x in self._sum([q for q in own_q if q is not None], group))

        average, transmitted = [], []
        for key, t, m, summed, rounding, p, q in zip(
            keys, tensors, matrices, summed_first, rounding_first, bases, own_q, strict=True
        ):
            if p is None:
                average.append((summed / replicas).view(t.shape))
                transmitted.append((self._rounded(m).view(-1) - rounding).view(t.shape))
                continue
            q_sum = next(summed_second).view(m.shape[1], p.shape[1])
            q_sent = q - next(rounding_second).view(q.shape)
            average.append((p @ q_sum.T / replicas).view(t.shape))
            transmitted.append((p @ q_sent.T).view(t.shape))
            self._basis[key] = q_sum
        return Reduced(average, transmitted, summed_extra)
