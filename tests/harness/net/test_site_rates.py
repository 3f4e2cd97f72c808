"""Per-site rates drawn from a distribution (a profile's `site_rates`, harness/net/site_rates.py): seeded, within the
stated range and shaped like the stated distribution, a named site kept as written (the straggler), recorded in the
profile a run stores, and refused in one sentence when malformed."""

from __future__ import annotations

import math
import statistics

import pytest

from harness.net.link import Profile, ProfileError
from harness.net.profiles import load_profile
from harness.net.site_rates import SiteRateDraw

DRAW = "site_rates: {sites: 20, distribution: loguniform, low: 10mbit, high: 100mbit, seed: 0}\n"


def write(tmp_path, text):
    path = tmp_path / "uneven.yaml"
    path.write_text("inter_cluster: {rate: 50mbit}\n" + text)
    return str(path)


def test_a_draw_is_seeded_and_stays_in_its_range():
    draw = SiteRateDraw(20, "loguniform", 10_000_000, 100_000_000, seed=0)
    rates = draw.rates_bps()
    assert sorted(rates) == list(range(20))
    assert all(10_000_000 <= r <= 100_000_000 for r in rates.values())
    assert SiteRateDraw(20, "loguniform", 10_000_000, 100_000_000, seed=0).rates_bps() == rates
    assert SiteRateDraw(20, "loguniform", 10_000_000, 100_000_000, seed=1).rates_bps() != rates
    assert len(set(rates.values())) == 20


@pytest.mark.parametrize(
    ("distribution", "transform"),
    [("uniform", lambda r: r), ("loguniform", math.log)],
)
def test_a_draw_has_the_stated_distribution(distribution, transform):
    """Over 4,000 sites, the (log-)rates' mean is the midpoint of the range and their spread a uniform's (range /
    sqrt(12)), each within 4 standard errors."""
    low, high = 1_000_000, 1_000_000_000
    values = [transform(r) for r in SiteRateDraw(4000, distribution, low, high, seed=7).rates_bps().values()]
    width = transform(high) - transform(low)
    sd = width / math.sqrt(12)
    assert statistics.fmean(values) == pytest.approx(
        (transform(low) + transform(high)) / 2, abs=4 * sd / math.sqrt(4000)
    )
    assert statistics.stdev(values) == pytest.approx(sd, rel=0.05)


def test_a_profile_draws_its_sites_keeps_a_named_straggler_and_records_the_draw(tmp_path):
    p = load_profile(write(tmp_path, DRAW + "sites:\n  7: {rate: 1mbit}\n"))
    drawn = SiteRateDraw(20, "loguniform", 10_000_000, 100_000_000, 0).rates_bps()
    assert [p.uplink(s).rate_bps for s in range(20)] == [1_000_000 if s == 7 else drawn[s] for s in range(20)]
    assert p.downlink(3).rate_bps == drawn[3] and p.uplink(20) == p.inter_cluster
    recorded = p.to_dict()
    assert recorded["site_rates"] == {
        "sites": 20, "distribution": "loguniform", "low_bps": 10_000_000, "high_bps": 100_000_000, "seed": 0,
    }  # fmt: skip
    assert Profile.from_dict(recorded) == p
    assert "rates drawn loguniform from 10 Mbit/s to 100 Mbit/s, seed 0" in "\n".join(p.topology_lines())
    # 20 drawn sites need 20 clusters.
    with pytest.raises(ProfileError, match="use --clusters 20 or more"):
        p.check_sites(4)


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("site_rates: {sites: 20}\n", "must give exactly distribution, high, low, seed, sites"),
        ("site_rates: [1, 2]\n", "must give exactly"),
        (DRAW.replace("sites: 20", "sites: 0"), "sites must be a whole number of sites >= 1"),
        (DRAW.replace("seed: 0", "seed: zero"), "seed must be a whole number"),
        (DRAW.replace("loguniform", "normal"), "distribution must be one of uniform, loguniform"),
        (DRAW.replace("low: 10mbit", "low: 1gbit"), "low (1gbit) is above high (100mbit); swap them"),
        (DRAW.replace("high: 100mbit", "high: fast"), "rate 'fast' is not understood"),
    ],
)
def test_a_malformed_draw_is_refused_in_one_sentence(tmp_path, text, expect):
    with pytest.raises(ProfileError) as refused:
        load_profile(write(tmp_path, text))
    assert expect in str(refused.value) and "\n" not in str(refused.value)


def test_a_draw_with_a_trace_is_refused(tmp_path):
    (tmp_path / "t.csv").write_text("seconds,rate\n0,10mbit\n1,20mbit\n")
    with pytest.raises(ProfileError, match="has a trace and sites"):
        load_profile(write(tmp_path, DRAW + "trace: t.csv\n"))
