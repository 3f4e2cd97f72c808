"""When a round's exchange runs and lands, and where the next round starts: DiLoCoX's overlap modes (`overlap`), one
strategy per mode, chosen once from the settings (`overlap_mode`). A round-based method asks its mode:

    lead                       how many inner steps before the round's end its exchange starts (0: at the end)
    land(sent)                 at the round's end, the exchange to apply now (None: none yet); the rest stays in flight
    restart(theta, params, sent)
                               where the replica's next round starts, once round `sent` is sent and what has landed
                               applied: written into `params`; True where the steps trained since `sent` are dropped
    drain()                    at the run's end, the exchange still in flight (None: nothing)
    round_start(theta)         s_i, where rounds start and their deltas are measured from: theta, or a look-ahead
                               that restart keeps up to date
    keeps_own_share            whether restart needs the replica's own decoded share of the exchange
    hidden_steps(local_steps)  inner steps that run while an exchange is in flight (the method's SyncPlan)

    Streaming  streaming (arXiv 2501.18512): the exchange starts tau = `lead` steps before the round's end and lands at
               its end, where the replica blends its weights with theta by alpha. `none`, blocking, is Streaming at
               tau = 0, alpha = 0: the exchange starts at the round's end and the replica restarts from theta
               (tests/trainers/methods/test_dilocox_overlap.py holds the two bit-identical)
    Delayed    delayed (the paper's Algorithm 2): round t's exchange runs behind round t + 1 and lands at its end;
               the replica restarts from the theta that holds round t - 1
    Eager      eager (arXiv 2502.12996): commits as Delayed, and restarts from a look-ahead that holds the
               replica's own fresh share, s_i = theta_t - eta (1 + mu) D(P_i^t) / n
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal, Protocol

import torch

from trainers.exchange import Sent
from trainers.method import copy_into

OverlapMode = Literal["none", "delayed", "eager", "streaming"]
OVERLAP_MODES: tuple[str, ...] = ("none", "delayed", "eager", "streaming")


class OverlapSettings(Protocol):
    """What the modes read of a method's settings (DiLoCoXConfig's fields)."""

    overlap: OverlapMode
    overlap_steps: int
    merge_alpha: float
    outer_lr: float
    outer_momentum: float


class Overlap(ABC):
    """The hooks every mode answers (the module docstring)."""

    lead = 0
    keeps_own_share = False

    def round_start(self, theta: list[torch.Tensor]) -> list[torch.Tensor]:
        return theta

    @abstractmethod
    def land(self, sent: Sent) -> Sent | None: ...

    @abstractmethod
    def restart(self, theta: list[torch.Tensor], params: list[torch.nn.Parameter], sent: Sent) -> bool: ...

    def drain(self) -> Sent | None:
        return None

    def idle(self) -> bool:
        """Nothing in flight between rounds (what a checkpoint needs)."""
        return True

    @abstractmethod
    def hidden_steps(self, local_steps: int) -> int: ...


class Streaming(Overlap):
    """Each round's exchange lands at its own end: started `lead` steps early, blended in by `alpha`."""

    def __init__(self, lead: int, alpha: float):
        self.lead = lead
        self.alpha = alpha

    def land(self, sent: Sent) -> Sent:
        return sent

    def restart(self, theta: list[torch.Tensor], params: list[torch.nn.Parameter], sent: Sent) -> bool:
        if self.alpha == 0:
            # At alpha = 0 torchft's merge is theta, g + 0 (p - g): the steps after the exchange started are gone.
            copy_into(theta, params)
            return True
        # torchft's merge: lerp(global, local, alpha). The steps after the exchange started stay in the local weights
        # at weight alpha, to travel with the next round's delta.
        merged = [torch.lerp(g, p.detach().float(), self.alpha) for g, p in zip(theta, params, strict=True)]
        copy_into(merged, params)
        return False

    def hidden_steps(self, local_steps: int) -> int:
        return self.lead


class Delayed(Overlap):
    """Each round's exchange runs behind the next round's inner steps; the last round's lands at a round's end."""

    def __init__(self) -> None:
        self.in_flight: Sent | None = None

    def land(self, sent: Sent) -> Sent | None:
        arrived, self.in_flight = self.in_flight, sent
        return arrived

    def restart(self, theta: list[torch.Tensor], params: list[torch.nn.Parameter], sent: Sent) -> bool:
        copy_into(theta, params)
        return False

    def drain(self) -> Sent | None:
        pending, self.in_flight = self.in_flight, None
        return pending

    def idle(self) -> bool:
        return self.in_flight is None

    def hidden_steps(self, local_steps: int) -> int:
        return local_steps


class Eager(Delayed):
    """Delayed's commits, restarting from theta_t - `look_ahead` D(P_i^t), look_ahead = eta (1 + mu) / n: where the
    committed step would be had it held this replica's fresh share."""

    keeps_own_share = True

    def __init__(self, look_ahead: float):
        super().__init__()
        self.look_ahead = look_ahead

    def round_start(self, theta: list[torch.Tensor]) -> list[torch.Tensor]:
        self.start = [g.clone() for g in theta]
        return self.start

    def restart(self, theta: list[torch.Tensor], params: list[torch.nn.Parameter], sent: Sent) -> bool:
        for s, g, own in zip(self.start, theta, sent.own_share, strict=True):
            torch.sub(g, own, alpha=self.look_ahead, out=s)
        sent.own_share = None  # not needed while the exchange is in flight
        copy_into(self.start, params)
        return False


def overlap_mode(settings: OverlapSettings, replicas: int = 1) -> Overlap:
    """The mode the settings choose, for `replicas` replicas (only eager's look-ahead depends on them)."""
    if settings.overlap == "none":
        return Streaming(0, 0.0)
    if settings.overlap == "streaming":
        return Streaming(settings.overlap_steps, settings.merge_alpha)
    if settings.overlap == "delayed":
        return Delayed()
    return Eager(settings.outer_lr * (1 + settings.outer_momentum) / replicas)
