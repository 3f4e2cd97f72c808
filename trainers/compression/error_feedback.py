"""Error feedback: what compression dropped from a tensor, added back to the next one; and the relative error that
measures how much was dropped."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ErrorFeedback:
    """What compression dropped from a tensor, added to the next tensor with the same key.

    Per key (e.g. parameter name): ``c = compensate(key, x)``, transmit ``t = decode(encode(c))``, then
    ``update(key, c, t)``. The residual is c - t, so after inputs x_1..x_T,
    sum(t_i) + residuals[key] == sum(x_i): nothing is lost, only delayed.
    """

    residuals: dict[str, torch.Tensor] = field(default_factory=dict)

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the residual kept under ``key`` (``x`` itself the first time)."""
        residual = self.residuals.get(key)
        return x if residual is None else x + residual

    def update(self, key: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """Keep what ``transmitted`` (the decoded payload) missed of ``compensated`` as ``key``'s residual."""
        self.residuals[key] = (compensated - transmitted).detach()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = dict(state)


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """||x_hat - x|| / ||x|| (Frobenius), computed in float64; 0 when ``x`` is all zero."""
    x64 = x.detach().to(torch.float64)
    norm = torch.linalg.vector_norm(x64)
    if norm == 0:
        return 0.0
    return float(torch.linalg.vector_norm(x_hat.detach().to(torch.float64) - x64) / norm)
