"""What DiLoCoX measures of each round besides its bytes: the compression error's two bounds and the outer-step
monitor. Pure functions of tensors; trainers/methods/dilocox.py reports them per sync (the train loop prefixes `sync_`).

omega2_paper is the paper's bound on the squared relative compression error (Lemma 3.6 as the public review quotes
it), 1 - (r/d) 2^-q, and omega2_corrected is (sqrt(1 - r/d) + 2^(-q/2))^2, the triangle inequality over the rank-r
truncation (||C_L(x) - x||^2 <= (1 - r/d) ||x||^2 with d = min(m, n), the top r of d singular values holding at
least r/d of the energy) and the quantization (||C_Q(y) - y||^2 <= 2^-q ||y||^2, ||y|| <= ||x||) that the review
says the paper's expression does not follow from. Both are weighted over a stage's tensors by ||c_W||^2, with r/d
= 1 for a tensor sent whole (1-D, or a matrix whose factors would not be smaller). The power iteration is not the
truncated SVD, so neither is a guarantee for what is measured.

The monitor, at every applied average: cosine(Delta_t, Delta_{t-1}) (the overlap's assumption is that consecutive
averages point the same way), step_norm_ratio = ||theta_t - theta_{t-1}|| / ||Delta_t|| (eta (1 + mu) on the first
step; it grows as momentum builds), and the old staleness = ||Delta_t - Delta_{t-1}|| / ||Delta_{t-1}||, all over
the stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trainers.comm import flatten
from trainers.compression.error_feedback import relative_error
from trainers.compression.lowrank import goes_as_factors
from trainers.compression.shapes import matrix_shape


def omega2_bounds(sent_rank: int, dim: int, bits: int) -> tuple[float, float]:
    """(paper omega^2, corrected bound) for one tensor sent at rank `sent_rank` of `dim`."""
    kept = sent_rank / dim
    return 1 - kept * 2.0**-bits, (math.sqrt(1 - kept) + 2.0 ** (-bits / 2)) ** 2


def weighted_omega2(compensated: Sequence[torch.Tensor], rank: int, bits: int) -> dict:
    """Both bounds for a round sent at (rank, bits), weighted over the tensors by ||c_W||^2."""
    weights, bounds = [], []
    for c in compensated:
        # The compressor's own rule for what goes as factors (r = min(r_t, d) of d = min(m, n)); a tensor sent
        # whole is only quantized: r / d = 1.
        dim = min(matrix_shape(c.shape)) if c.ndim >= 2 else 1
        sent_rank = min(rank, dim) if goes_as_factors(c.shape, rank) else dim
        weights.append(float(c.double().pow(2).sum()))
        bounds.append(omega2_bounds(sent_rank, dim, bits))
    total = sum(weights)
    if total == 0:
        return {"omega2_paper": None, "omega2_corrected": None}
    paper, corrected = (sum(w * b[i] for w, b in zip(weights, bounds, strict=True)) / total for i in (0, 1))
    return {"omega2_paper": paper, "omega2_corrected": corrected}


def outer_step_monitor(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], average: torch.Tensor, last: torch.Tensor | None
) -> dict:
    """cosine, step_norm_ratio and staleness of an outer step from `before` to `after` with the flat fp64 average
    `average`, against the last one applied (`last`, None at the first)."""
    norm = float(torch.linalg.vector_norm(average))
    step = float(torch.linalg.vector_norm(flatten(list(after)).double() - flatten(list(before)).double()))
    fields = {"cosine": None, "step_norm_ratio": step / norm if norm else None, "staleness": None}
    if last is not None:
        fields["staleness"] = relative_error(last, average)
        last_norm = float(torch.linalg.vector_norm(last))
        if norm and last_norm:
            fields["cosine"] = float(average @ last) / (norm * last_norm)
    return fields
