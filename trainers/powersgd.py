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
    transmitted_i   = P^ Q_i^T         replica i's share: the average is the mean of the shares (up to the
                                       rounding of the sum on the wire), so error feedback e_i = M_i -
                                       transmitted_i keeps what the average misses of M_i
    next round's Q0 = Q                the warm start (PowerSGD), the same on every replica

Each all-reduce is a ring (trainers/comm.py), so a site sends 2(n-1)/n of each buffer: the bytes per site do
not grow with the number of sites. The average is the low-rank part of the mean, not the mean of each replica's
low-rank part. One power iteration per round, as PowerSGD (a second would cost two more all-reduces, round trips
included); the warm start refines the subspace over rounds.

What travels is bf16, summed in bf16 on the wire: gloo sums what it is given, so an int4/int8 payload cannot be
re-quantized per hop without a hand-made ring, and fp16's range underflows on a small pseudo-gradient's factors.
A tensor whose factors would not be smaller than it (1-D, a small matrix; compression.goes_as_factors) travels
whole in the first all-reduce. `extra` (a few values, DiLoCoX's rank estimate) rides in the first buffer too, so it
needs no collective or round trip of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainers.comm import allreduce_payload_bytes
from trainers.compression import Shape, goes_as_factors, resized_basis

WIRE_DTYPE = torch.bfloat16  # what travels, unless a test asks for fp32 (exact sums)


@dataclass
class Reduced:
    """One exchange's outcome, the same on every replica except `transmitted` (this replica's share)."""

    average: list[torch.Tensor]
    transmitted: list[torch.Tensor]
    extra: torch.Tensor  # the sum over replicas of every replica's `extra`, fp32


def _matrix(shape: Shape) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def factor_rank(shape: Shape, rank: int) -> int | None:
    """r for a tensor sent as factors at `rank`; None for one sent whole."""
    return min(rank, *_matrix(shape)) if goes_as_factors(shape, rank) else None


def buffer_numels(shapes: Sequence[Shape], rank: int, extra: int = 0) -> tuple[int, int]:
    """Values in the first (P and whole tensors, then `extra`) and the second (Q) all-reduce."""
    first, second = extra, 0
    for shape in shapes:
        r = factor_rank(shape, rank)
        if r is None:
            first += math.prod(shape)
        else:
            m, n = _matrix(shape)
            first, second = first + m * r, second + n * r
    return first, second


def payload_bytes(
    shapes: Sequence[Shape], rank: int, replicas: int, extra: int = 0, wire_dtype: torch.dtype = WIRE_DTYPE
) -> int:
    """What each replica sends for one exchange: both ring all-reduces."""
    return sum(
        allreduce_payload_bytes(numel * wire_dtype.itemsize, replicas) for numel in buffer_numels(shapes, rank, extra)
    )


class PowerSGDReducer:
    """The shared-basis exchange of one pipeline stage's tensors. The rank is given per exchange (DiLoCoX adapts
    it between rounds, identically on every replica); the basis follows it (compression.resized_basis)."""

    def __init__(self, seed: int, wire_dtype: torch.dtype = WIRE_DTYPE) -> None:
        self.seed = seed  # the run's seed: the same on every replica, so their first Q0 agree
        self.wire_dtype = wire_dtype
        self._basis: dict[str, torch.Tensor] = {}  # Q per tensor key: the last round's, the same everywhere

    def _start(self, key: str, shape: Shape, rank: int) -> torch.Tensor:
        """Q0, orthonormal: the same on every replica (the shared last Q, or one seed's Gaussian)."""
        m, n = _matrix(shape)
        q = resized_basis(self._basis.get(key), shape, rank, self.seed)
        if q is None:
            q = torch.randn(n, min(rank, m, n), generator=torch.Generator().manual_seed(self.seed))
        return torch.linalg.qr(q.float()).Q

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
        matrices = [t.reshape(_matrix(t.shape)).float() for t in tensors]
        sent_first = [
            m if r is None else m @ self._start(key, t.shape, rank)
            for key, t, m, r in zip(keys, tensors, matrices, ranks, strict=True)
        ]
        first = torch.cat([x.reshape(-1) for x in sent_first] + [extra.float().reshape(-1)]).to(self.wire_dtype)
        self._all_reduce(first, group)
        *summed_first, summed_extra = first.float().split([x.numel() for x in sent_first] + [extra.numel()])

        bases = [
            None if r is None else torch.linalg.qr(summed.view(m.shape[0], r)).Q
            for summed, m, r in zip(summed_first, matrices, ranks, strict=True)
        ]
        own_q = [None if p is None else (m.T @ p).to(self.wire_dtype) for m, p in zip(matrices, bases, strict=True)]
        sent_second = [q.reshape(-1) for q in own_q if q is not None]
        second = torch.cat(sent_second) if sent_second else torch.empty(0, dtype=self.wire_dtype)
        self._all_reduce(second, group)
        summed_second = iter(second.float().split([q.numel() for q in sent_second]))

        average, transmitted = [], []
        for key, t, m, summed, p, q in zip(keys, tensors, matrices, summed_first, bases, own_q, strict=True):
            if p is None:
                average.append((summed / replicas).view(t.shape))
                transmitted.append(m.to(self.wire_dtype).float().view(t.shape))
                continue
            q_sum = next(summed_second).view(m.shape[1], p.shape[1])
            average.append((p @ q_sum.T / replicas).view(t.shape))
            transmitted.append((p @ q.float().T).view(t.shape))
            self._basis[key] = q_sum
        return Reduced(average, transmitted, summed_extra)

    @staticmethod
    def _all_reduce(buffer: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        if group is not None and buffer.numel():
            dist.all_reduce(buffer, group=group)
