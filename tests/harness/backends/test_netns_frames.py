"""Which links the netns backend makes carry wire-sized frames (one TCP segment each) instead of GSO frames."""

from __future__ import annotations

import pytest

from harness.backends.netns import WIRE_FRAMES_MAX_RATE_BPS, NetnsCluster
from harness.net.link import LinkSpec, Profile, SiteLink
from harness.net.topology import Topology


def cluster(profile: Profile, emulator: str | None = None) -> NetnsCluster:
    return NetnsCluster("hx000000", Topology(2), profile, link_emulator=emulator)


@pytest.mark.parametrize(
    ("link", "emulator", "wire_sized"),
    [
        (LinkSpec(rate_bps=5_440_000), None, True),  # a slow bottleneck drops packets, not 64 KiB GSO frames
        (LinkSpec(rate_bps=WIRE_FRAMES_MAX_RATE_BPS), None, True),
        (LinkSpec(rate_bps=10**9), None, False),  # fast links keep GSO: per-packet work would cost rate here
        (LinkSpec(), None, False),
        (LinkSpec(rate_bps=10**9, delay_ms=20, loss_pct=1), "userspace", True),  # the delay line drops packets
        (LinkSpec(rate_bps=10**9, delay_ms=20), "userspace", False),
    ],
)
def test_slow_or_lossy_links_carry_wire_sized_frames(link, emulator, wire_sized):
    assert cluster(Profile("p", "", inter_cluster=link), emulator).wire_sized_frames() is wire_sized


def test_one_slow_site_makes_every_uplink_send_wire_sized_frames():
    """Frames from a fast site reach the slow site's downlink shaper as they were sent."""
    fast = LinkSpec(rate_bps=10**9)
    slow = SiteLink(up=LinkSpec(rate_bps=10**9), down=LinkSpec(rate_bps=10 * 10**6))
    assert cluster(Profile("p", "", inter_cluster=fast, sites={1: slow})).wire_sized_frames()
