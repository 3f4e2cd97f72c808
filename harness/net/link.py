"""What a link is: LinkSpec (one link's rate, queue, delay, jitter, loss), SiteLink, Profile, and their units.

A profile names two links: the inter-cluster link (the slow WAN between sites that the methods are compared on)
and the intra-cluster link (between the pipeline stages of one site; unshaped by default). Rates use tc's units
(``1gbit``, ``500mbit``), sizes tc's byte units (``256kb`` = 256 KiB), times ``ms``/``us``/``s``, loss ``0.1%``.

What a link's keys mean, between two clusters (sites):

- ``rate``: the bandwidth each cluster gets onto the link, in each direction (``burst``: tbf's bucket).
- ``queue``: the bottleneck's buffer, as a size (``2mb``) or as line time at the rate (``100ms``); by default the
  bandwidth-delay product of the path, and never less than QUEUE_MIN_SEGMENTS GSO segments (``default_queue_bytes``).
- ``delay``: the ONE-WAY delay between two clusters; the round-trip time is 2 x delay (``rtt_ms``). A profile with
  a 40 ms RTT says ``delay: 20ms``.
- ``jitter``: how much the one-way delay varies (delay +- jitter); a round trip varies by up to 2 x jitter.
- ``loss``: the chance that a packet sent from one cluster never reaches the other (one-way), each packet alike; or
  a mapping, ``{model: gemodel, p: 1%, r: 30%}``, for bursty loss (harness/net/lossmodel.py).
- ``reorder`` (default false): whether jitter may reorder packets. Without it every packet leaves after the one
  ahead of it, as on a real path, and a jitter larger than the delay is refused (it could only be had by
  reordering).

How the emulation realises that: clusters connect in a star through a switch, and each cluster's access link is
emulated in both directions, so a packet between two clusters crosses two link hops. Each hop carries half of the
profile's one-way values: ``hop_delay_ms`` = delay / 2, ``hop_jitter_ms`` = jitter / 2, and ``hop_loss_pct`` such
that two hops lose the profile's one-way loss (1 - (1 - hop)^2 = loss). The backends apply the hop values; nobody
else should halve anything. harness/net/tcconfig.py, for real hosts, exports the full one-way values instead (each site
shapes its own egress once).

A profile's ``sites`` give single sites an access link of their own: ``rate`` (or ``up``/``down``), and ``delay``,
``jitter``, ``loss`` for that site's hop alone (one-way, each direction). The path between two sites then adds
their two hops: a site with ``delay: 80ms`` on a profile with ``delay: 20ms`` is 80 + 10 ms one-way from every
other site. A site's LinkSpec holds path figures like every LinkSpec (``hop_*`` halves them), so it stores twice its
hop's delay and jitter and the loss whose hop share is the site's; ``Profile.path`` composes two sites' hops.
A profile's ``site_rates`` draws many sites' rates from a stated distribution instead (harness/net/site_rates.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.errors import UserError
from harness.net.lossmodel import GilbertElliott, LossModelError
from harness.net.tracepoints import LinkTrace
from harness.units import format_rate

MIN_RATE_BPS = 8_000
# What tbf's netlink message can hold (pyroute2's tbf encoder, harness/net/shaping.py; the kernel's sch_tbf.c): the
# rate is a u32 of bytes/s (pyroute2 sends no 64-bit rate attribute), the queue limit a u32 of bytes, and the bucket
# a u32 of psched ticks that the kernel turns into nanoseconds and cuts to 2**32 - 1 (min(PSCHED_TICKS2NS(buffer),
# ~0U)): a bucket of more than 4.29 s of line time would silently be a smaller one. A value past a field made
# pyroute2 raise struct.error after the cluster was half built.
U32_MAX = 2**32 - 1
MAX_TBF_RATE_BPS = U32_MAX * 8
MAX_TBF_BUCKET_S = U32_MAX / 1e9
# psched ticks per microsecond as pyroute2 converts them (/proc/net/psched: 1000 ns per us over 64 ns per tick), and
# the kernel's nanoseconds per tick (PSCHED_SHIFT 6).
_TICKS_PER_US = 1000 / 64
_NS_PER_TICK = 64
# tbf sends a packet only when its bucket holds the whole packet: a burst below one full-size Ethernet frame (MTU
# 1500 plus the 14-byte header) drops every full-size packet, and the run can only time out.
MIN_BURST_BYTES = 1514
# The default burst: this much line time, but never less than one GSO segment. A bucket far above a few ms of line
# time lets whole payloads through unshaped on slow links (256 KiB is half a second at 4 Mbit/s); one below a GSO
# segment (64 KiB on veths) makes tbf split every segment, and TCP no longer reaches the rate (measured at
# 100 Mbit/s: busbw 0.86-0.89 of the rate with 2-32 KiB buckets, 0.96 with 128 KiB; docs/measurement.md,
# "Rate-true shaping").
BURST_LINE_TIME_S = 0.002
GSO_SEGMENT_BYTES = 64 * 1024
# The default queue: the path's bandwidth-delay product, what a well-run WAN bottleneck buffers, and at least this
# many GSO segments: veths hand tbf whole 64 KiB segments, so a queue of one or two drops a whole segment (44
# packets) whenever the next arrives early. Measured with a 12-step tiny AllReduce at 5.44 Mbit/s: tbf's old 50 ms
# (34 KB plus the bucket) retransmitted 13-52% of TCP segments, 4 segments (256 KiB) 0.2% (docs/links.md, "The
# queue").
QUEUE_MIN_SEGMENTS = 4

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_SIZE_UNITS = {"b": 1, "kb": 1024, "k": 1024, "mb": 1024**2, "m": 1024**2, "gb": 1024**3}
_TIME_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}
_LINK_KEYS = {"rate", "burst", "queue", "delay", "jitter", "loss", "reorder"}
# No terrestrial or satellite path is slower one way (geostationary: ~280 ms one way, ~600 ms RTT); a larger delay
# is almost certainly a unit mistake (2s for 2ms).
MAX_DELAY_MS = 2000.0
# A site's own access link: its rate in both directions, or up (from the site) and down (to it) apart.
_SITE_KEYS = {"rate", "up", "down", "burst", "queue", "delay", "jitter", "loss"}


class ProfileError(UserError):
    """A profile that cannot be used; the message is one sentence naming the fix."""


def _parse(value: object, units: dict[str, float], what: str, example: str, signed: bool = False) -> float:
    """`signed`: a negative number with a known unit gets its own message (else it is "not understood")."""
    text = str(value).strip().lower()
    negative = re.fullmatch(r"-\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z%]*)", text)
    if signed and negative and negative.group(2) in units:
        raise ProfileError(f"{what} {value!r} must not be negative; write 0 or more, e.g. {example}")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z%]*)", text)
    if not match or match.group(2) not in units:
        raise ProfileError(
            f"{what} {value!r} is not understood; write a number with a unit, e.g. {example} "
            f"(units: {', '.join(units)})"
        )
    return float(match.group(1)) * units[match.group(2)]


def parse_rate_bps(value: object, tbf: bool = True) -> int:
    """`tbf`: the rate will be tbf's and is refused beyond its field; False for a figure that is only compared
    (HARNESS_MAX_RATE)."""
    rate = _parse(value, _RATE_UNITS, "rate", "1gbit or 500mbit")
    if rate < MIN_RATE_BPS:
        raise ProfileError(
            f"rate {value!r} is below the {MIN_RATE_BPS // 1000} kbit/s that tbf can shape; use a larger rate"
        )
    if tbf and rate > MAX_TBF_RATE_BPS:
        raise ProfileError(_rate_too_large(str(value).strip()))
    return int(rate)


def _rate_too_large(shown: str) -> str:
    return (
        f"rate {shown} is more than tbf's 32-bit rate field holds ({format_rate(MAX_TBF_RATE_BPS)}); use at most "
        f"{MAX_TBF_RATE_BPS // 10**6}mbit"
    )


def tbf_buffer_ns(rate_bps: int, burst_bytes: int) -> int:
    """The bucket as the kernel gets it: pyroute2's ticks for `burst_bytes` at `rate_bps`, in nanoseconds."""
    ticks = int(int(1e6 * burst_bytes / (rate_bps / 8)) * _TICKS_PER_US)
    return ticks * _NS_PER_TICK


def default_queue_bytes(rate_bps: int, rtt_ms: float) -> int:
    """The bandwidth-delay product of a path of `rtt_ms` at `rate_bps`, at least QUEUE_MIN_SEGMENTS GSO segments."""
    return max(round(rate_bps / 8 * rtt_ms / 1000), QUEUE_MIN_SEGMENTS * GSO_SEGMENT_BYTES)


def max_burst_bytes(rate_bps: int) -> int:
    """The largest bucket the kernel's tbf keeps whole at `rate_bps` (MAX_TBF_BUCKET_S of line time)."""
    # The longest whole microsecond count whose ticks still fit, then the bytes below the next one; the loops only
    # absorb float rounding.
    max_ticks = U32_MAX // _NS_PER_TICK
    max_us = int((max_ticks + 1) / _TICKS_PER_US)
    while int(max_us * _TICKS_PER_US) > max_ticks:
        max_us -= 1
    burst = math.ceil((max_us + 1) * (rate_bps / 8) / 1e6) - 1
    while tbf_buffer_ns(rate_bps, burst + 1) <= U32_MAX:
        burst += 1
    while tbf_buffer_ns(rate_bps, burst) > U32_MAX:
        burst -= 1
    return burst


def check_tbf(rate_bps: int | None, burst_bytes: int, queue_bytes: int) -> None:
    """Every number tbf is given fits the field it ends in (U32_MAX); refuses with the largest value that fits."""
    if rate_bps is None:
        return
    if rate_bps > MAX_TBF_RATE_BPS:
        raise ProfileError(_rate_too_large(format_rate(rate_bps)))
    if tbf_buffer_ns(rate_bps, burst_bytes) > U32_MAX:
        raise ProfileError(
            f"burst {burst_bytes:,} bytes is {burst_bytes * 8 / rate_bps:.3g} s of line time at "
            f"{format_rate(rate_bps)}, longer than the {MAX_TBF_BUCKET_S:.2f} s the kernel's tbf bucket holds (32 bits "
            f"of nanoseconds); use a burst of at most {max_burst_bytes(rate_bps) // 1024}kb at this rate"
        )
    if queue_bytes > U32_MAX:
        raise ProfileError(
            f"queue {queue_bytes:,} bytes ({queue_bytes * 8 / rate_bps:.3g} s at {format_rate(rate_bps)}) is more than "
            f"tbf's 32-bit queue limit holds ({U32_MAX:,} bytes); use a queue of at most {U32_MAX // 1024**2}mb"
        )
    if queue_bytes < GSO_SEGMENT_BYTES:
        raise ProfileError(
            f"queue {queue_bytes:,} bytes is less than one {GSO_SEGMENT_BYTES // 1024} KiB GSO segment, the unit in "
            f"which veths hand TCP to tbf: every full segment would be dropped; use a queue of at least "
            f"{GSO_SEGMENT_BYTES // 1024}kb"
        )


def parse_size_bytes(value: object) -> int:
    size = _parse(value, _SIZE_UNITS, "size", "256kb")
    if size < 1:
        raise ProfileError(f"size {value!r} must be positive")
    return int(size)


def parse_time_ms(value: object, what: str = "time") -> float:
    return _parse(value, _TIME_UNITS, what, "20ms", signed=True)


def parse_queue(value: object, what: str) -> dict[str, float]:
    """`queue: 2mb` or `queue: 100ms` -> the LinkSpec field it sets (the other one cleared, so a site's queue
    replaces the inter_cluster link's whichever way each was written)."""
    text = str(value).strip().lower()
    if re.fullmatch(r"[0-9.e]+\s*(us|ms|s)", text):
        return {"queue_ms": parse_time_ms(value, what), "queue_size_bytes": None}
    try:
        return {"queue_size_bytes": parse_size_bytes(value), "queue_ms": None}
    except ProfileError:
        raise ProfileError(
            f"{what} {value!r} is not understood; write a size (e.g. 2mb, 512kb) or line time at the rate (e.g. 100ms)"
        ) from None


def parse_loss_pct(value: object) -> float:
    pct = _parse(value, {"%": 1.0, "": 1.0}, "loss", "0.1%", signed=True)
    if not 0 <= pct < 100:
        raise ProfileError(f"loss {value!r} must be a percentage in [0, 100)")
    return pct


def parse_loss(value: object, where: str) -> dict[str, object]:
    """`loss: 0.1%` (each packet alike) or `loss: {model: gemodel, ...}` (bursty, harness/net/lossmodel.py) -> the
    LinkSpec fields it sets (the other one cleared, so a site's loss replaces the inter_cluster link's)."""
    if isinstance(value, dict):
        try:
            return {"loss_model": GilbertElliott.from_yaml(value), "loss_pct": 0.0}
        except LossModelError as err:
            raise ProfileError(f"{where}: {err}") from None
    return {"loss_pct": parse_loss_pct(value), "loss_model": None}


@dataclass(frozen=True)
class LinkSpec:
    """How one link is shaped. An empty spec leaves the link unshaped."""

    rate_bps: int | None = None
    # None: derived from the rate (default_burst_bytes); a profile's `burst` overrides it.
    burst_bytes: int | None = None
    # The bottleneck's buffer as the profile gave it, a size or line time at the rate (at most one of them); neither:
    # default_queue_bytes. `queue_bytes` is what tbf gets.
    queue_size_bytes: int | None = None
    queue_ms: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    # Bursty loss (a profile's `loss:` mapping, harness/net/lossmodel.py): applied once per path direction, whole,
    # never halved into hops; a parsed link has it or loss_pct, a path (Profile.path) may have both.
    loss_model: GilbertElliott | None = None
    # Whether jitter may reorder packets (netem's behaviour); by default a packet never overtakes the one before it.
    reorder: bool = False

    def __post_init__(self) -> None:
        if self.burst_bytes is None:
            derived = default_burst_bytes(self.rate_bps) if self.rate_bps is not None else 0
            object.__setattr__(self, "burst_bytes", derived)
        check_burst(self.rate_bps, self.burst_bytes, f"{self.burst_bytes}b")
        if self.rate_bps is not None:
            check_tbf(self.rate_bps, self.burst_bytes, self.queue_bytes)

    @property
    def queue_bytes(self) -> int | None:
        """The bytes that may wait in the shaper (tbf's limit); None without a rate."""
        if self.rate_bps is None:
            return None
        if self.queue_size_bytes is not None:
            return self.queue_size_bytes
        if self.queue_ms is not None:
            return round(self.rate_bps / 8 * self.queue_ms / 1000)
        return default_queue_bytes(self.rate_bps, self.rtt_ms)

    @property
    def queue_delay_ms(self) -> float | None:
        """How long a full queue takes to drain: what it adds to the RTT of a packet behind it."""
        return None if self.rate_bps is None else self.queue_bytes * 8 / self.rate_bps * 1000

    @property
    def needs_netem(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_fraction > 0

    @property
    def loss_fraction(self) -> float:
        """The chance a packet is lost one way: the independent loss and the loss model's stationary rate composed."""
        return self.loss_pct / 100 + (self.loss_model.loss_rate if self.loss_model else 0.0) * (1 - self.loss_pct / 100)

    @property
    def shaped(self) -> bool:
        return self.rate_bps is not None or self.needs_netem

    @property
    def rtt_ms(self) -> float:
        """Round-trip time between two clusters: `delay` is one-way."""
        return 2 * self.delay_ms

    @property
    def hop_delay_ms(self) -> float:
        """The delay of one of the two link hops between two clusters (each cluster's access link): half."""
        return self.delay_ms / 2

    @property
    def hop_jitter_ms(self) -> float:
        return self.jitter_ms / 2

    @property
    def hop_loss_pct(self) -> float:
        """One hop's loss, such that two hops in a row lose the profile's one-way loss: 1 - (1 - hop)^2 = loss."""
        return 100 * (1 - math.sqrt(1 - self.loss_pct / 100))

    def describe(self) -> str:
        """E.g. "1 Gbit/s (burst 244 KiB = 2.0 ms), RTT 40 ms +- 2 ms, loss 1%"."""
        if not self.shaped:
            return "unshaped"
        parts = []
        if self.rate_bps is not None:
            line_time_ms = self.burst_bytes * 8 / self.rate_bps * 1000
            parts.append(
                f"{format_rate(self.rate_bps)} (burst {self.burst_bytes // 1024} KiB = {line_time_ms:.1f} ms, queue "
                f"{self.queue_bytes // 1024} KiB = {self.queue_delay_ms:.0f} ms)"
            )
        if self.delay_ms:
            rtt = f"RTT {self.rtt_ms:g} ms"
            if self.jitter_ms:
                rtt += f" +- {2 * self.jitter_ms:g} ms" + (" (reordering)" if self.reorder else "")
            parts.append(rtt)
        if self.loss_pct:
            parts.append(f"loss {self.loss_pct:g}%")
        if self.loss_model is not None:
            parts.append(self.loss_model.describe())
        return ", ".join(parts)

    def check(self, where: str) -> None:
        """Refuse delay settings no link has; `where` names the link (e.g. "mine.yaml: inter_cluster")."""
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ProfileError(f"{where}: delay and jitter must not be negative; write 0ms or more")
        if self.delay_ms > MAX_DELAY_MS:
            raise ProfileError(
                f"{where}: delay {self.delay_ms:g} ms is above {MAX_DELAY_MS:g} ms one-way; no terrestrial or "
                "satellite link is that slow (delay is one-way, half the RTT; check the unit)"
            )
        if self.jitter_ms and not self.delay_ms:
            raise ProfileError(f"{where} sets jitter without delay; add a delay (jitter varies it)")
        if self.jitter_ms > self.delay_ms and not self.reorder:
            raise ProfileError(
                f"{where}: jitter {self.jitter_ms:g} ms is larger than the delay {self.delay_ms:g} ms, which would "
                "reorder packets; lower the jitter or set reorder: true"
            )

    @classmethod
    def from_yaml(cls, data: object, where: str) -> LinkSpec:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ProfileError(f"{where} must be a mapping of {sorted(_LINK_KEYS)}, got {type(data).__name__}")
        _refuse_latency(data, where)
        if "queue" in data and "rate" not in data:
            raise ProfileError(f"{where} sets a queue without a rate; add a rate (the queue is the shaper's buffer)")
        unknown = set(data) - _LINK_KEYS
        if unknown:
            raise ProfileError(f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(_LINK_KEYS)}")
        parsers = {
            "rate": ("rate_bps", parse_rate_bps),
            "burst": ("burst_bytes", parse_size_bytes),
            "delay": ("delay_ms", lambda v: parse_time_ms(v, "delay")),
            "jitter": ("jitter_ms", lambda v: parse_time_ms(v, "jitter")),
            "reorder": ("reorder", lambda v: _parse_bool(v, f"{where}: reorder")),
        }
        kwargs = {field: parse(data[key]) for key, (field, parse) in parsers.items() if key in data}
        if "loss" in data:
            kwargs.update(parse_loss(data["loss"], where))
        if "queue" in data:
            kwargs.update(parse_queue(data["queue"], f"{where}: queue"))
        if "burst_bytes" in kwargs:
            check_burst(kwargs.get("rate_bps"), kwargs["burst_bytes"], str(data["burst"]).strip(), f"{where}: ")
        spec = _located(where, lambda: cls(**kwargs))
        spec.check(where)
        return spec

    def to_dict(self) -> dict:
        """Its fields, the loss model as a mapping (a run's config.json; from_dict reads it back, or its absence)."""
        return {**self.__dict__, "loss_model": self.loss_model and self.loss_model.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> LinkSpec:
        data = dict(data)
        # A run recorded before `queue` replaced tbf's `latency` holds the same bound, as line time, as latency_ms.
        if "latency_ms" in data:
            latency_ms = data.pop("latency_ms")
            data.setdefault("queue_ms", latency_ms if data.get("rate_bps") is not None else None)
        return cls(**{**data, "loss_model": data.get("loss_model") and GilbertElliott.from_dict(data["loss_model"])})


def _refuse_latency(data: dict, where: str) -> None:
    if "latency" in data:
        raise ProfileError(
            f"{where}: `latency` (tbf's queue bound) is now `queue`; write queue: {data['latency']} (or a size, e.g. "
            "queue: 2mb)"
        )


def _located(where: str, make: Callable[[], LinkSpec]) -> LinkSpec:
    """`make()`, a LinkSpec whose own checks may refuse it, with `where` (the profile and link) in the refusal."""
    try:
        return make()
    except ProfileError as err:
        raise ProfileError(f"{where}: {err}") from None


def _parse_bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise ProfileError(f"{what} {value!r} must be true or false")
    return value


def default_burst_bytes(rate_bps: float) -> int:
    """A rate-true bucket: BURST_LINE_TIME_S of line time at `rate_bps`, at least one GSO segment, at most what the
    kernel's tbf keeps (below ~122 kbit/s a GSO segment is longer than that; the kernel would cut it silently)."""
    burst = max(GSO_SEGMENT_BYTES, round(rate_bps / 8 * BURST_LINE_TIME_S))
    return burst if tbf_buffer_ns(int(rate_bps), burst) <= U32_MAX else max_burst_bytes(int(rate_bps))


def check_burst(rate_bps: int | None, burst_bytes: int, shown: str, where: str = "") -> None:
    """A shaped link's tbf bucket holds at least one full-size packet; burst matters only with a rate."""
    if rate_bps is not None and burst_bytes < MIN_BURST_BYTES:
        least = -(-MIN_BURST_BYTES // 1024)
        raise ProfileError(
            f"{where}burst {shown} is below one full-size packet ({MIN_BURST_BYTES:,} bytes): tbf would drop every "
            f"full-size packet; use at least {least}kb"
        )


@dataclass(frozen=True)
class SiteLink:
    """One site's own access link where it differs from the profile's inter_cluster link: `up` shapes what the
    site sends, `down` what it receives. Its delay, jitter and loss are its hop's (module doc), the inter_cluster
    link's half where the site sets none. A loss model (bursty loss) is not halved: it shapes what the site sends,
    and what it receives crosses the sender's model."""

    up: LinkSpec
    down: LinkSpec

    @classmethod
    def from_yaml(cls, data: object, default: LinkSpec, where: str) -> SiteLink:
        if not isinstance(data, dict) or not data:
            raise ProfileError(f"{where} must be a mapping of {sorted(_SITE_KEYS)}, e.g. {{rate: 100mbit}}")
        _refuse_latency(data, where)
        unknown = set(data) - _SITE_KEYS
        if unknown:
            raise ProfileError(f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(_SITE_KEYS)}")
        if "rate" in data and ({"up", "down"} & set(data)):
            raise ProfileError(f"{where} gives rate and up/down; give rate (both directions) or up and down")
        rate = parse_rate_bps(data["rate"]) if "rate" in data else default.rate_bps
        up = parse_rate_bps(data["up"]) if "up" in data else rate
        down = parse_rate_bps(data["down"]) if "down" in data else rate
        shape = {}
        if "burst" in data:
            shape["burst_bytes"] = parse_size_bytes(data["burst"])
        if "queue" in data:
            shape.update(parse_queue(data["queue"], f"{where}: queue"))
        # The site's own hop, stored as path figures (module doc): twice the delay and jitter, and the loss of which
        # one hop loses the site's.
        if "delay" in data:
            shape["delay_ms"] = 2 * parse_time_ms(data["delay"], "delay")
        if "jitter" in data:
            shape["jitter_ms"] = 2 * parse_time_ms(data["jitter"], "jitter")
        if "loss" in data:
            shape.update(parse_loss(data["loss"], where))
            # A loss model is stored whole: it applies once, to what the site sends (harness/net/delayline.py).
            shape["loss_pct"] = 100 * (1 - (1 - shape["loss_pct"] / 100) ** 2)

        def link(rate_bps: int | None) -> LinkSpec:
            # The burst follows the site's rate unless the site sets one.
            return _located(where, lambda: dataclasses.replace(default, rate_bps=rate_bps, burst_bytes=None, **shape))

        site = cls(up=link(up), down=link(down))
        # Checked as the site wrote it: its own hop (the stored path figures are twice that).
        hop = site.up
        LinkSpec(delay_ms=hop.hop_delay_ms, jitter_ms=hop.hop_jitter_ms, reorder=hop.reorder).check(where)
        return site

    def to_dict(self) -> dict:
        return {"up": self.up.to_dict(), "down": self.down.to_dict()}


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    inter_cluster: LinkSpec = field(default_factory=LinkSpec)
    intra_cluster: LinkSpec = field(default_factory=LinkSpec)
    source: str = ""
    # Sites (clusters, by index) whose access link differs from inter_cluster: uneven links, stragglers.
    sites: dict[int, SiteLink] = field(default_factory=dict)
    # The inter_cluster link's rate and/or delay over time (a profile's `trace`); its first row is inter_cluster's.
    trace: LinkTrace | None = None
    # How `sites` rates were drawn, where a profile's `site_rates` drew them: SiteRateDraw.to_dict()
    # (harness/net/site_rates.py), recorded beside the rates.
    site_draw: dict | None = None

    @property
    def needs_netem(self) -> bool:
        sites = any(link.up.needs_netem for link in self.sites.values())
        return self.inter_cluster.needs_netem or self.intra_cluster.needs_netem or sites

    @property
    def has_loss_model(self) -> bool:
        """Whether any link has bursty loss (a loss model), which only the userspace delay line runs."""
        links = [self.inter_cluster, self.intra_cluster, *(link.up for link in self.sites.values())]
        return any(link.loss_model is not None for link in links)

    def path(self, a: int, b: int) -> LinkSpec:
        """The path between sites a and b as one LinkSpec: the slower rate, and the two hops' delay, jitter and loss
        added (losses composed), and the loss model of what a sends. Without sites, the inter_cluster link itself."""
        hop_a, hop_b = self.uplink(a), self.uplink(b)
        rates = [r for r in (hop_a.rate_bps, self.downlink(b).rate_bps) if r is not None]
        return dataclasses.replace(
            self.inter_cluster,
            rate_bps=min(rates) if rates else None,
            burst_bytes=None,
            delay_ms=hop_a.hop_delay_ms + hop_b.hop_delay_ms,
            jitter_ms=hop_a.hop_jitter_ms + hop_b.hop_jitter_ms,
            loss_pct=100 * (1 - (1 - hop_a.hop_loss_pct / 100) * (1 - hop_b.hop_loss_pct / 100)),
            loss_model=hop_a.loss_model,
        )

    def uplink(self, cluster: int) -> LinkSpec:
        """What shapes the traffic cluster `cluster` sends onto the inter-cluster link."""
        return self.sites[cluster].up if cluster in self.sites else self.inter_cluster

    def downlink(self, cluster: int) -> LinkSpec:
        """What shapes the traffic cluster `cluster` receives from the inter-cluster link."""
        return self.sites[cluster].down if cluster in self.sites else self.inter_cluster

    def topology_lines(self) -> list[str]:
        """The sites around the switch and what shapes each one's link, for `harness profiles show`."""
        lines = ["every site --[" + self.inter_cluster.describe() + "]--> switch <--[same]-- every other site"]
        if self.site_draw is not None:
            draw = self.site_draw
            lines.append(
                f"  sites 0-{draw['sites'] - 1}: rates drawn {draw['distribution']} from {format_rate(draw['low_bps'])}"
                f" to {format_rate(draw['high_bps'])}, seed {draw['seed']} (each listed below)"
            )
        for site, link in sorted(self.sites.items()):
            up = format_rate(link.up.rate_bps) if link.up.rate_bps else "unshaped"
            down = format_rate(link.down.rate_bps) if link.down.rate_bps else "unshaped"
            hop = link.up
            extra = "".join(
                [
                    f", its hop {hop.hop_delay_ms:g} ms one-way" if hop.delay_ms else "",
                    f" +- {hop.hop_jitter_ms:g} ms" if hop.jitter_ms else "",
                    f", loss {hop.hop_loss_pct:.3g}%" if hop.loss_pct else "",
                    f", sends with {hop.loss_model.describe()}" if hop.loss_model else "",
                ]
            )
            lines.append(f"  except site {site}:  --[up {up}]--> switch --[down {down}]--> site {site}{extra}")
            if hop.delay_ms or hop.loss_fraction:
                other = 0 if site else 1
                path = self.path(site, other)
                lines.append(
                    f"    path site {site} <-> site {other}: RTT {path.rtt_ms:g} ms"
                    + (f", loss {100 * path.loss_fraction:.3g}%" if path.loss_fraction else "")
                    + " (a site's parsed delay_ms is twice its hop's: LinkSpecs hold path figures)"
                )
        return lines

    def check_sites(self, clusters: int) -> None:
        """Every site the profile shapes exists in a run of `clusters` clusters."""
        missing = sorted(site for site in self.sites if site >= clusters)
        if missing:
            raise ProfileError(
                f"profile {self.name!r} gives site {missing[0]} its own link, but the run has sites 0 to "
                f"{clusters - 1}; use --clusters {max(missing) + 1} or more, or remove that site from the profile"
            )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "inter_cluster": self.inter_cluster.to_dict(),
            "intra_cluster": self.intra_cluster.to_dict(),
            "sites": {str(site): link.to_dict() for site, link in sorted(self.sites.items())},
            "trace": self.trace.to_dict() if self.trace else None,
            "site_rates": self.site_draw,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        """The inverse of to_dict (a run's config.json)."""
        return cls(
            data["name"],
            data["description"],
            LinkSpec.from_dict(data["inter_cluster"]),
            LinkSpec.from_dict(data["intra_cluster"]),
            data["source"],
            {
                int(site): SiteLink(LinkSpec.from_dict(link["up"]), LinkSpec.from_dict(link["down"]))
                for site, link in data.get("sites", {}).items()
            },
            LinkTrace.from_dict(data["trace"]) if data.get("trace") else None,
            data.get("site_rates"),
        )
