"""Bursty packet loss: the Gilbert-Elliott model, as netem's ``loss gemodel`` defines it.

A link is in a good or a bad state. Each packet finds it in one of them and is delivered with that state's chance
(``k`` in the good state, ``h`` in the bad one); then the state moves on: good turns bad with chance ``p``, bad turns
good with chance ``r``. The simple Gilbert model (``h = 0, k = 1``) loses exactly the packets sent in the bad state,
so its losses come in runs of mean length 1/r; with ``p = 0`` the model is independent (Bernoulli) loss of 1 - k.

A profile's link writes it as ``loss: {model: gemodel, p: 1%, r: 30%, h: 0, k: 1}`` (harness/net/link.py): each
value a fraction in [0, 1] or a percentage with ``%``; ``r`` defaults to 1 - p, ``h`` to 0 and ``k`` to 1, as in
netem. What the emulation does with it (once per path direction, on the sender's delay line) is
harness/net/delayline.py's.

The figures a run records beside what its delay lines measured (harness/run/summary.py):

- the stationary loss rate: pi_B = p / (p + r) of packets find the link bad, so pi_G (1 - k) + pi_B (1 - h) are lost;
- the mean loss burst (a run of consecutive lost packets): the lost packets over the bursts they form, P(L) / (P(L) -
  P(L, L)), where P(L, L), two packets in a row lost, is sum over the first packet's state s and the next one's s'
  of pi_s l_s T(s, s') l_s' (l_s: the loss chance in state s, T the transitions). For h = 0, k = 1 it is 1 / r;
- the dispersion: how much more the count of lost packets in n varies than independent loss at the same rate
  would (n large), 1 + 2 pi_G pi_B (l_B - l_G)^2 lambda / ((1 - lambda) P(L) (1 - P(L))) with lambda = 1 - p - r.
  A probe that counts losses (harness/net/linkprobe.py) widens its binomial tolerance by its square root.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from harness.errors import UserError

MODEL_NAME = "gemodel"
_KEYS = {"model", "p", "r", "h", "k"}
_PROBABILITY = re.compile(r"(-?[0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(%?)")


class LossModelError(UserError):
    """A loss model that cannot be used; the message is one sentence naming the fix (harness/net/link.py adds where
    in the profile it stands and raises it as a ProfileError)."""


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.4g}%"


@dataclass(frozen=True)
class GilbertElliott:
    """The Gilbert-Elliott loss model (module doc): transition chances per packet and delivery chances per state."""

    # P(good -> bad) and P(bad -> good), drawn after each packet.
    p: float
    r: float
    # P(a packet is delivered) in the bad and in the good state.
    h: float = 0.0
    k: float = 1.0

    def __post_init__(self) -> None:
        for name in ("p", "r", "h", "k"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise LossModelError(
                    f"loss model {name} = {value!r} is not a probability; write a fraction in [0, 1] or a percentage "
                    "in [0%, 100%]"
                )
        if self.p + self.r == 0:
            raise LossModelError("loss model p + r = 0 has no steady state; set r (bad -> good) above 0")
        if self.p > 0 and self.r == 0:
            raise LossModelError(
                "loss model r = 0 keeps the link bad for ever once it turns bad; set r above 0 (bad runs last 1/r "
                "packets)"
            )
        # Tested on the settings, not on loss_rate: (1 - pi_B) + pi_B need not round to exactly 1.
        if self.k == 1 and (self.h == 1 or self.p == 0):
            raise LossModelError(
                "loss model loses no packet (k = 1, and h = 1 or p = 0); lower k or h, or remove the loss"
            )
        if self.k == 0 and (self.h == 0 or self.p == 0):
            raise LossModelError("loss model loses every packet (k = 0, and h = 0 or p = 0); raise k or h")

    @property
    def bad_share(self) -> float:
        """pi_B: the share of packets that find the link in the bad state."""
        return self.p / (self.p + self.r)

    @property
    def _state_loss(self) -> tuple[float, float]:
        """(l_G, l_B): the chance a packet is lost in the good and in the bad state."""
        return 1 - self.k, 1 - self.h

    @property
    def loss_rate(self) -> float:
        """The stationary share of packets lost: pi_G (1 - k) + pi_B (1 - h)."""
        good, bad = self._state_loss
        return (1 - self.bad_share) * good + self.bad_share * bad

    @property
    def mean_burst_packets(self) -> float:
        """The mean length of a run of consecutive lost packets (module doc); 1 / r for h = 0, k = 1."""
        good, bad = self._state_loss
        pi_b = self.bad_share
        pi_g = 1 - pi_b
        both = pi_g * good * ((1 - self.p) * good + self.p * bad) + pi_b * bad * (self.r * good + (1 - self.r) * bad)
        return self.loss_rate / (self.loss_rate - both)

    @property
    def loss_dispersion(self) -> float:
        """Var(packets lost in n) / (n P(L) (1 - P(L))) for large n: 1 for independent loss (module doc)."""
        good, bad = self._state_loss
        pi_b = self.bad_share
        memory = 1 - self.p - self.r
        loss = self.loss_rate
        return 1 + 2 * (1 - pi_b) * pi_b * (bad - good) ** 2 * memory / ((1 - memory) * loss * (1 - loss))

    def describe(self) -> str:
        """E.g. "bursty loss 3.846% (gemodel p 1%, r 25%, h 0%, k 100%; bursts of 4 packets)"."""
        values = ", ".join(f"{name} {_percent(getattr(self, name))}" for name in ("p", "r", "h", "k"))
        return (
            f"bursty loss {_percent(self.loss_rate)} ({MODEL_NAME} {values}; bursts of "
            f"{self.mean_burst_packets:.3g} packets)"
        )

    def to_dict(self) -> dict:
        return {"model": MODEL_NAME, "p": self.p, "r": self.r, "h": self.h, "k": self.k}

    @classmethod
    def from_dict(cls, data: dict) -> GilbertElliott:
        """The inverse of to_dict (a run's config.json)."""
        return cls(data["p"], data["r"], data["h"], data["k"])

    @classmethod
    def from_yaml(cls, data: dict) -> GilbertElliott:
        """A profile's ``loss:`` mapping (module doc), refused with one sentence naming the fix."""
        unknown = set(data) - _KEYS
        if unknown:
            raise LossModelError(f"loss has unknown keys {sorted(unknown)}; a loss model takes {sorted(_KEYS)}")
        if "model" not in data:
            raise LossModelError(
                f"loss as a mapping needs model: {MODEL_NAME} (Gilbert-Elliott); for independent loss write a "
                "percentage, e.g. loss: 0.1%"
            )
        if data["model"] != MODEL_NAME:
            raise LossModelError(
                f"loss model {data['model']!r} is not known; write model: {MODEL_NAME} (Gilbert-Elliott, as netem "
                "names it)"
            )
        if "p" not in data:
            raise LossModelError("loss model needs p, the chance per packet that the link turns bad, e.g. p: 1%")
        p = _probability(data["p"], "p")
        if p == 0 and {"r", "h"} & set(data):
            raise LossModelError(
                "loss model has p = 0, so the link never turns bad and r and h mean nothing; remove them (the loss "
                "is then 1 - k of every packet) or set p above 0"
            )
        r = _probability(data["r"], "r") if "r" in data else 1 - p
        h = _probability(data["h"], "h") if "h" in data else 0.0
        k = _probability(data["k"], "k") if "k" in data else 1.0
        return cls(p, r, h, k)


def _probability(value: object, name: str) -> float:
    """A fraction in [0, 1] (``0.3``) or a percentage (``30%``)."""
    match = _PROBABILITY.fullmatch(str(value).strip()) if not isinstance(value, bool) else None
    if match is None:
        raise LossModelError(
            f"loss model {name} {value!r} is not understood; write a fraction in [0, 1] (e.g. 0.3) or a percentage "
            "(e.g. 30%)"
        )
    number = float(match.group(1)) / (100 if match.group(2) else 1)
    if not 0 <= number <= 1:
        raise LossModelError(
            f"loss model {name} {value!r} is not a probability; write a fraction in [0, 1] or a percentage in "
            "[0%, 100%]"
        )
    return number


class GilbertElliottLoss:
    """The model's state machine, one draw per packet: starts good, as netem's does; `rng` seeds it."""

    def __init__(self, model: GilbertElliott, rng: random.Random):
        self.model = model
        self.random = rng.random
        self.bad = False

    def lost(self) -> bool:
        """Whether the next packet is lost: by the state it finds (netem's order), which then moves on."""
        model = self.model
        if self.bad:
            lost = self.random() >= model.h
            self.bad = self.random() >= model.r
        else:
            lost = self.random() >= model.k
            self.bad = self.random() < model.p
        return lost
