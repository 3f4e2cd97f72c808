"""Per-site rates drawn from a stated distribution: a profile's ``site_rates``, for uneven sites at many-site counts.

    site_rates:
      sites: 20                  # sites 0 to 19 each get a drawn rate (both directions)
      distribution: loguniform   # or uniform
      low: 10mbit
      high: 100mbit
      seed: 0

The rates are drawn once, when the profile is read, with Python's ``random.Random(seed)`` (Mersenne Twister, the
same numbers on every machine and Python 3 version), and become the profile's ``sites``: a run's config.json then
records every site's rate, and the draw itself beside them (``Profile.site_draw``, SiteRateDraw.to_dict()). A site
the profile's ``sites`` names keeps the link written there, so one straggler on a drawn spread is
``sites: {7: {rate: 1mbit}}`` beside the draw. A log-uniform draw suits access links, whose rates spread over orders
of magnitude (the consumer-uplink trace runs from 5 to 50 Mbit/s; cloud regions from tens of Mbit/s to Gbit/s).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from harness.net.link import ProfileError, parse_rate_bps

DISTRIBUTIONS = ("uniform", "loguniform")
_KEYS = {"sites", "distribution", "low", "high", "seed"}


@dataclass(frozen=True)
class SiteRateDraw:
    """Each of `sites` sites' rate drawn from `distribution` between low_bps and high_bps, seeded (module doc)."""

    sites: int
    distribution: str
    low_bps: int
    high_bps: int
    seed: int

    @classmethod
    def from_yaml(cls, data: object, where: str) -> SiteRateDraw:
        """A profile's ``site_rates`` mapping; refuses in one sentence naming the key to fix."""
        example = "site_rates: {sites: 20, distribution: loguniform, low: 10mbit, high: 100mbit, seed: 0}"
        if not isinstance(data, dict) or set(data) != _KEYS:
            raise ProfileError(f"{where} must give exactly {', '.join(sorted(_KEYS))}, e.g. {example}")
        sites, seed = data["sites"], data["seed"]
        if type(sites) is not int or sites < 1:
            raise ProfileError(f"{where}: sites must be a whole number of sites >= 1, not {sites!r}")
        if type(seed) is not int:
            raise ProfileError(f"{where}: seed must be a whole number, not {seed!r}")
        if data["distribution"] not in DISTRIBUTIONS:
            raise ProfileError(
                f"{where}: distribution must be one of {', '.join(DISTRIBUTIONS)}, not {data['distribution']!r}"
            )
        low, high = (parse_rate_bps(str(data[key])) for key in ("low", "high"))
        if low > high:
            raise ProfileError(f"{where}: low ({data['low']}) is above high ({data['high']}); swap them")
        return cls(sites, data["distribution"], low, high, seed)

    def rates_bps(self) -> dict[int, int]:
        """Site -> its drawn rate in bit/s, sites 0 to sites - 1."""
        draw = random.Random(self.seed)
        if self.distribution == "uniform":
            return {site: round(draw.uniform(self.low_bps, self.high_bps)) for site in range(self.sites)}
        low, high = math.log(self.low_bps), math.log(self.high_bps)
        return {site: round(math.exp(draw.uniform(low, high))) for site in range(self.sites)}

    def to_dict(self) -> dict:
        return {
            "sites": self.sites,
            "distribution": self.distribution,
            "low_bps": self.low_bps,
            "high_bps": self.high_bps,
            "seed": self.seed,
        }
