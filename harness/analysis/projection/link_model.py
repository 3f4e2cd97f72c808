"""The link model: what a run's time is made of besides its own compute, used by `harness project`
(harness/analysis/projection/project.py), the gate's step_time_residual (harness/analysis/gate/measures.py) and
composed times (harness/analysis/projection/composition.py).

(b) the link: the slowest site's rate (min of every site's uplink and downlink), the longest round trip between two
    sites, and what TCP gets out of them: goodput = min(efficiency x rate, window / RTT). A collective pays a round
    trip for every hand-over on top of its bytes:
        all-reduce of B bytes over n sites    2(n-1)/n B / goodput + turns x RTT: gloo's ring moves B as s =
                                              max(B / 1 MiB, 2n) segments, two in flight, so turns =
                                              2 ceil(s (n-1)/n / 2), which is 2(n-1) for a small B
        all-gather of p bytes from each site  (n-1) p / goodput + (n-1) RTT
(c) the schedule, which each method's config declares itself (`MethodConfig.sync_plan` in trainers/method.py, a
    `SyncPlan`; the method's file says what its own is): the collectives of one exchange with their bytes (from the
    method's own compressor and settings), how many steps apart exchanges are, how many steps of compute run while
    one is in flight, a warm-up with other exchanges, and whether the first exchange pays TCP's slow start. Here it
    becomes time the same way for every method: the exchange takes its longest collective's time (they run side by
    side) and sends their bytes together. A step then takes
    compute_s + max(0, exchange_s - hidden_steps x hide_s) / every_steps, where hide_s is the forward and backward
    part of compute_s (the events' compute_s), what runs while an exchange is in flight.

`Compute` is the step's own part: its seconds apart from waiting on the link, and the forward and backward part of
them that an exchange in flight runs beside ((a) of project.py's module doc says where it comes from).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.errors import UserError
from harness.net.link import Profile
from harness.run.config import RunConfig
from trainers import models
from trainers.comm import allgather_payload_bytes, allreduce_payload_bytes
from trainers.config import TrainConfig
from trainers.method import Exchange, SyncPlan

# Payload bytes per wire byte that a gloo all-reduce reaches on a tbf-shaped link (calibrate: busbw 0.92-0.95 of the
# rate at 2-8 clusters; a 1448-byte segment in a 1514-byte frame is 0.956 before ACKs).
DEFAULT_EFFICIENCY = 0.94
# Bytes TCP keeps in flight per connection: a single stream through a 40 ms delay line reached 554 Mbit/s with
# net.ipv4.tcp_wmem's maximum at 4 MiB (docs/links.md, "Measured on this machine"), 2.77 MB in flight: two thirds
# of the maximum.
WINDOW_SHARE_OF_WMEM = 2 / 3
# gloo's ring all-reduce (gloo/allreduce.cc) cuts its buffer into segments of at most kMaxSegmentSize, 1 MiB,
# and keeps two of them in flight per direction; torch does not change the segment size.
GLOO_SEGMENT_BYTES = 1 << 20
INITIAL_WINDOW_SEGMENTS = 10
MSS_BYTES = 1448  # a 1500-byte MTU less IP and TCP headers with timestamps


class ProjectionError(UserError):
    """A projection that cannot be made; the message names the fix."""


def default_window_bytes() -> int:
    try:
        wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        wmem_max = 4 << 20
    return int(WINDOW_SHARE_OF_WMEM * wmem_max)


@dataclass(frozen=True)
class LinkModel:
    rate_bps: float | None  # the slowest site's; None: unshaped (communication costs nothing here)
    rtt_s: float
    efficiency: float = DEFAULT_EFFICIENCY
    window_bytes: int = 4 << 20

    @classmethod
    def of(cls, profile: Profile, clusters: int, **kwargs: Any) -> LinkModel:
        rates = [r for c in range(clusters) for r in (profile.uplink(c).rate_bps, profile.downlink(c).rate_bps)]
        shaped = [r for r in rates if r is not None]
        # A ring waits for its slowest hop: the longest round trip between two sites.
        rtt_ms = max((profile.path(a, b).rtt_ms for a in range(clusters) for b in range(a + 1, clusters)), default=0.0)
        return cls(min(shaped) if shaped else None, rtt_ms / 1000, **kwargs)

    @property
    def goodput_bps(self) -> float:
        if self.rate_bps is None:
            return math.inf
        window_bound = 8 * self.window_bytes / self.rtt_s if self.rtt_s > 0 else math.inf
        return min(self.efficiency * self.rate_bps, window_bound)

    def allreduce_s(self, nbytes: int, n: int) -> float:
        """gloo's ring all-reduce (gloo/allreduce.cc): the buffer goes as segments of at most 1 MiB (at least 2n of
        them), two in flight per direction; a reduce-scatter then an all-gather, each passing (n-1)/n of the segments
        to the next site. Every two segments cost a round trip: on a long path the ring, not TCP, sets the pace."""
        segments = math.ceil(max(math.ceil(nbytes / GLOO_SEGMENT_BYTES), 2 * n) / n) * n
        turns = 2 * math.ceil(segments * (n - 1) // n / 2)
        return 8 * allreduce_payload_bytes(nbytes, n) / self.goodput_bps + turns * self.rtt_s

    def allgather_s(self, nbytes_per_site: int, n: int) -> float:
        return 8 * allgather_payload_bytes(nbytes_per_site, n) / self.goodput_bps + (n - 1) * self.rtt_s

    def exchange_s(self, exchange: Exchange, n: int) -> float:
        collective = {"all-reduce": self.allreduce_s, "all-gather": self.allgather_s}[exchange.collective]
        return collective(exchange.nbytes, n)

    def slow_start_extra_s(self, nbytes: int) -> float:
        """What sending `nbytes` on a fresh connection costs beyond the steady goodput: TCP starts at
        INITIAL_WINDOW_SEGMENTS segments and doubles its window every RTT until it holds the bandwidth-delay
        product (RFC 6928, 5681)."""
        if self.rtt_s <= 0 or math.isinf(self.goodput_bps) or nbytes <= 0:
            return 0.0
        bdp_bytes = self.goodput_bps * self.rtt_s / 8
        window, sent, elapsed = INITIAL_WINDOW_SEGMENTS * MSS_BYTES, 0.0, 0.0
        while sent + window < nbytes and window < bdp_bytes:
            sent, window, elapsed = sent + window, 2 * window, elapsed + self.rtt_s
        # The last window's bytes go at the goodput either way: what slow start adds is its round trips, less the
        # time the bytes sent during them would have taken at the goodput.
        return max(0.0, elapsed - 8 * sent / self.goodput_bps)


@dataclass(frozen=True)
class Schedule:
    """How a method uses the link: one exchange's payload (bytes each site sends) and time, every how many steps,
    and how many steps of compute run while it is in flight. A run also has a start: the method's warm-up steps,
    each with a blocking exchange of warmup_exchange_s, and its first exchange, which a fresh connection's slow start
    makes first_exchange_extra_s longer. `adaptive`: the method's first round's schedule (it changes its rounds)."""

    payload_bytes: int
    exchange_s: float
    every_steps: int
    hidden_steps: float
    warmup_steps: int = 0
    warmup_exchange_s: float = 0.0
    first_exchange_extra_s: float = 0.0
    adaptive: bool = False

    @classmethod
    def of(cls, plan: SyncPlan, n: int, link: LinkModel) -> Schedule:
        """A method's declared plan in time on `link` between n sites."""
        payload = sum(exchange.payload_bytes(n) for exchange in plan.exchanges)
        times = [link.exchange_s(exchange, n) for exchange in plan.exchanges]
        return cls(
            payload,
            sum(times) if plan.sequential else max(times),
            plan.every_steps,
            plan.hidden_steps,
            warmup_steps=plan.warmup_steps,
            warmup_exchange_s=max((link.exchange_s(exchange, n) for exchange in plan.warmup_exchanges), default=0.0),
            first_exchange_extra_s=link.slow_start_extra_s(payload) if plan.slow_start else 0.0,
            adaptive=plan.adaptive,
        )

    def blocked_s(self, hide_s: float) -> float:
        """Waited per exchange in steady state, when each step's compute that runs beside it takes hide_s."""
        return max(0.0, self.exchange_s - self.hidden_steps * hide_s)

    def step_s(self, compute_s: float, hide_s: float) -> float:
        """Steady state: a step's compute and its share of the wait."""
        return compute_s + self.blocked_s(hide_s) / self.every_steps

    def window_s(self, compute_s: float, hide_s: float, steps: int, from_step: int) -> float:
        """Seconds that steps from_step .. steps - 1 of a run take: what its tokens/s divides by."""
        total = 0.0
        first_exchange = self.warmup_steps + self.every_steps - 1
        for step in range(from_step, steps):
            total += compute_s
            if step < self.warmup_steps:
                total += self.warmup_exchange_s
            elif step == steps - 1:
                # The run ends waiting for its last exchange in full: nothing is left to hide it behind (every
                # method's finish() drains what is in flight, and a streaming round that ends the run sends at its
                # end). A method whose exchanges land a round late first applies the previous one, as every round.
                late = self.hidden_steps >= self.every_steps
                total += self.exchange_s + (self.blocked_s(hide_s) if late else 0.0)
            elif (step - self.warmup_steps + 1) % self.every_steps == 0:
                total += self.blocked_s(hide_s) + (self.first_exchange_extra_s if step == first_exchange else 0.0)
        return total


@functools.cache
def parameter_shapes(train: TrainConfig) -> tuple[torch.Size, ...]:
    """The shapes of the model a run trains (trainers.models.parameter_shapes; its vocabulary follows the tokenizer).
    Cached: the gate predicts every run it reads, and building even the meta model takes a tenth of a second."""
    return models.parameter_shapes(train.model_config())


def schedule(config: RunConfig, link: LinkModel) -> Schedule:
    """The schedule the run's method declares (module doc, (c)), in time on `link`."""
    plan = config.method_config.sync_plan(parameter_shapes(config.train))
    if plan is None:
        raise ProjectionError(
            f"harness project models methods that declare their exchanges across sites (their config's sync_plan), "
            f"not {config.method!r}, which declares none"
        )
    return Schedule.of(plan, config.clusters, link)


@dataclass(frozen=True)
class Compute:
    """A step's time apart from waiting on the link (`step_s`), the part of it an exchange in flight can run beside
    (`hide_s`: forward and backward; a method's compression runs before its exchange starts), and its source."""

    step_s: float
    hide_s: float
    source: str

    def scaled(self, factor: float, source: str) -> Compute:
        return Compute(self.step_s * factor, self.hide_s * factor, source)
