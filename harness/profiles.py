"""Network profiles: netem_profiles/*.yaml -> validated LinkSpecs.

A profile names two links: the inter-cluster link (the slow WAN between sites that the methods are compared on)
and the intra-cluster link (between the pipeline stages of one site; unshaped by default). Rates use tc's units
(``1gbit``, ``500mbit``), sizes tc's byte units (``256kb`` = 256 KiB), times ``ms``/``us``/``s``, loss ``0.1%``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import UserError, read_yaml
from harness.units import format_rate

PROFILE_DIR = Path(__file__).resolve().parent.parent / "netem_profiles"

# tbf holds ~95% of the set rate up to ~1.5 Gbit/s per core here (ARCHITECTURE.md, "Measured limits"); above that
# the CPU, not the qdisc, sets the rate and the benchmark would silently measure the wrong link. Override with
# HARNESS_MAX_RATE.
SHAPEABLE_BPS_PER_CORE = 1.5e9
MIN_RATE_BPS = 8_000
# tbf sends a packet only when its bucket holds the whole packet: a burst below one full-size Ethernet frame (MTU
# 1500 plus the 14-byte header) drops every full-size packet, and the run can only time out.
MIN_BURST_BYTES = 1514
# The default burst: this much line time, but never less than one GSO segment. A bucket far above a few ms of line
# time lets whole payloads through unshaped on slow links (256 KiB is half a second at 4 Mbit/s); one below a GSO
# segment (64 KiB on veths) makes tbf split every segment, and TCP no longer reaches the rate (measured at
# 100 Mbit/s: busbw 0.86-0.89 of the rate with 2-32 KiB buckets, 0.96 with 128 KiB; README "Rate-true shaping").
BURST_LINE_TIME_S = 0.002
GSO_SEGMENT_BYTES = 64 * 1024

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_SIZE_UNITS = {"b": 1, "kb": 1024, "k": 1024, "mb": 1024**2, "m": 1024**2, "gb": 1024**3}
_TIME_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}
_LINK_KEYS = {"rate", "burst", "latency", "delay", "jitter", "loss"}
_PROFILE_KEYS = {"description", "inter_cluster", "intra_cluster"}


class ProfileError(UserError):
    """A profile that cannot be used; the message is one sentence naming the fix."""


def _parse(value: object, units: dict[str, float], what: str, example: str) -> float:
    text = str(value).strip().lower()
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z%]*)", text)
    if not match or match.group(2) not in units:
        raise ProfileError(
            f"{what} {value!r} is not understood; write a number with a unit, e.g. {example} "
            f"(units: {', '.join(units)})"
        )
    return float(match.group(1)) * units[match.group(2)]


def parse_rate_bps(value: object) -> int:
    rate = _parse(value, _RATE_UNITS, "rate", "1gbit or 500mbit")
    if rate < MIN_RATE_BPS:
        raise ProfileError(
            f"rate {value!r} is below the {MIN_RATE_BPS // 1000} kbit/s that tbf can shape; use a larger rate"
        )
    return int(rate)


def parse_size_bytes(value: object) -> int:
    size = _parse(value, _SIZE_UNITS, "size", "256kb")
    if size < 1:
        raise ProfileError(f"size {value!r} must be positive")
    return int(size)


def parse_time_ms(value: object) -> float:
    return _parse(value, _TIME_UNITS, "time", "20ms")


def parse_loss_pct(value: object) -> float:
    pct = _parse(value, {"%": 1.0, "": 1.0}, "loss", "0.1%")
    if not 0 <= pct < 100:
        raise ProfileError(f"loss {value!r} must be a percentage in [0, 100)")
    return pct


@dataclass(frozen=True)
class LinkSpec:
    """How one link is shaped. An empty spec leaves the link unshaped."""

    rate_bps: int | None = None
    # None: derived from the rate (default_burst_bytes); a profile's `burst` overrides it.
    burst_bytes: int | None = None
    # tbf's queue bound, expressed as the longest a packet may wait; 50 ms held the rate well here.
    latency_ms: float = 50.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.burst_bytes is None:
            derived = default_burst_bytes(self.rate_bps) if self.rate_bps is not None else 0
            object.__setattr__(self, "burst_bytes", derived)
        check_burst(self.rate_bps, self.burst_bytes, f"{self.burst_bytes}b")

    @property
    def needs_netem(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0

    @property
    def shaped(self) -> bool:
        return self.rate_bps is not None or self.needs_netem

    def describe(self) -> str:
        if not self.shaped:
            return "unshaped"
        parts = []
        if self.rate_bps is not None:
            line_time_ms = self.burst_bytes * 8 / self.rate_bps * 1000
            parts.append(f"{format_rate(self.rate_bps)} (burst {self.burst_bytes // 1024} KiB = {line_time_ms:.1f} ms)")
        if self.delay_ms:
            parts.append(f"delay {self.delay_ms:g} ms" + (f" +- {self.jitter_ms:g} ms" if self.jitter_ms else ""))
        if self.loss_pct:
            parts.append(f"loss {self.loss_pct:g}%")
        return ", ".join(parts)

    @classmethod
    def from_yaml(cls, data: object, where: str) -> LinkSpec:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ProfileError(f"{where} must be a mapping of {sorted(_LINK_KEYS)}, got {type(data).__name__}")
        unknown = set(data) - _LINK_KEYS
        if unknown:
            raise ProfileError(f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(_LINK_KEYS)}")
        parsers = {
            "rate": ("rate_bps", parse_rate_bps),
            "burst": ("burst_bytes", parse_size_bytes),
            "latency": ("latency_ms", parse_time_ms),
            "delay": ("delay_ms", parse_time_ms),
            "jitter": ("jitter_ms", parse_time_ms),
            "loss": ("loss_pct", parse_loss_pct),
        }
        kwargs = {field: parse(data[key]) for key, (field, parse) in parsers.items() if key in data}
        if kwargs.get("jitter_ms") and not kwargs.get("delay_ms"):
            raise ProfileError(f"{where} sets jitter without delay; add a delay (jitter varies it)")
        if "burst_bytes" in kwargs:
            check_burst(kwargs.get("rate_bps"), kwargs["burst_bytes"], str(data["burst"]).strip(), f"{where}: ")
        return cls(**kwargs)


def default_burst_bytes(rate_bps: float) -> int:
    """A rate-true bucket: BURST_LINE_TIME_S of line time at `rate_bps`, at least one GSO segment."""
    return max(GSO_SEGMENT_BYTES, round(rate_bps / 8 * BURST_LINE_TIME_S))


def check_burst(rate_bps: int | None, burst_bytes: int, shown: str, where: str = "") -> None:
    """A shaped link's tbf bucket holds at least one full-size packet; burst matters only with a rate."""
    if rate_bps is not None and burst_bytes < MIN_BURST_BYTES:
        least = -(-MIN_BURST_BYTES // 1024)
        raise ProfileError(
            f"{where}burst {shown} is below one full-size packet ({MIN_BURST_BYTES:,} bytes): tbf would drop every "
            f"full-size packet; use at least {least}kb"
        )


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    inter_cluster: LinkSpec = field(default_factory=LinkSpec)
    intra_cluster: LinkSpec = field(default_factory=LinkSpec)
    source: str = ""

    @property
    def needs_netem(self) -> bool:
        return self.inter_cluster.needs_netem or self.intra_cluster.needs_netem

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "inter_cluster": self.inter_cluster.__dict__,
            "intra_cluster": self.intra_cluster.__dict__,
        }


def known_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str) -> Profile:
    """A profile by name (netem_profiles/NAME.yaml) or by a path to the user's own YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if _is_dir(path):
            raise _folder_error(name_or_path)
        if not _is_file(path):
            raise ProfileError(
                f"profile file {name_or_path} does not exist; pass a YAML file or one of: {', '.join(known_profiles())}"
            )
    else:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not _is_file(path):
            if _is_dir(Path(name_or_path)):
                raise _folder_error(name_or_path)
            raise ProfileError(
                f"unknown profile {name_or_path!r}; known profiles: {', '.join(known_profiles())} "
                "(or pass a path to your own YAML)"
            )
    data = read_yaml(path, "profile", ProfileError)
    if not isinstance(data, dict):
        raise ProfileError(f"profile {path} must be a YAML mapping with keys {sorted(_PROFILE_KEYS)}")
    unknown = set(data) - _PROFILE_KEYS
    if unknown:
        raise ProfileError(f"profile {path} has unknown keys {sorted(unknown)}; allowed: {sorted(_PROFILE_KEYS)}")
    return Profile(
        name=path.stem,
        description=str(data.get("description", "")),
        inter_cluster=LinkSpec.from_yaml(data.get("inter_cluster"), f"{path.name}: inter_cluster"),
        intra_cluster=LinkSpec.from_yaml(data.get("intra_cluster"), f"{path.name}: intra_cluster"),
        source=str(path),
    )


def _folder_error(name_or_path: str) -> ProfileError:
    return ProfileError(
        f"profile {name_or_path} is a folder; pass a profile YAML file or one of: {', '.join(known_profiles())}"
    )


def _is_file(path: Path) -> bool:
    # Path.is_file raises on a name too long for the file system; such a file does not exist either.
    try:
        return path.is_file()
    except OSError:
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def max_shapeable_rate_bps() -> float:
    override = os.environ.get("HARNESS_MAX_RATE")
    if override:
        try:
            return parse_rate_bps(override)
        except ProfileError as err:
            raise ProfileError(f"HARNESS_MAX_RATE: {err}") from None
    return SHAPEABLE_BPS_PER_CORE * (os.cpu_count() or 1)


def check_shapeable(profile: Profile) -> None:
    """Refuse a rate this machine's CPUs cannot push through a veth, so the link is really the bottleneck."""
    ceiling = max_shapeable_rate_bps()
    for which, spec in (("inter_cluster", profile.inter_cluster), ("intra_cluster", profile.intra_cluster)):
        if spec.rate_bps is not None and spec.rate_bps > ceiling:
            raise ProfileError(
                f"profile {profile.name!r} asks for {format_rate(spec.rate_bps)} on {which}, more than this "
                f"machine can shape faithfully (~{format_rate(ceiling)} with {os.cpu_count()} cores); use a slower "
                "profile or set HARNESS_MAX_RATE if you have measured that your machine keeps up"
            )
