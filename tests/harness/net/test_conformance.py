"""The token-bucket conformance check: a rate-true link never carries more than rate x window + burst."""

from __future__ import annotations

import os

import pytest

from harness.net.conformance import CONFORMANCE_TOLERANCE, conforms, max_excess
from harness.net.link import GSO_SEGMENT_BYTES, LinkSpec, default_burst_bytes
from harness.userns import user_namespaces_work
from tests.harness.e2e import SMALL_RUN, harness, summary_of

RATE = 8_000_000  # 1 MB/s


def test_a_link_at_its_rate_conforms():
    samples = [(t * 0.1, int(t * 0.1 * RATE / 8)) for t in range(50)]
    # The longest window is the worst: the bucket's allowance weighs least there.
    assert max_excess(samples, RATE, 10_000) == pytest.approx(4.9e6 / (4.9e6 + 10_000))
    assert conforms(max_excess(samples, RATE, 10_000))


def test_a_burst_above_the_bucket_is_the_worst_window():
    # 1 s at the rate, then 500 kB in 10 ms: that window carries 500 kB where 10 kB + 10 kB are allowed.
    samples = [(0.0, 0), (1.0, 1_000_000), (1.01, 1_500_000), (2.0, 1_500_000)]
    assert max_excess(samples, RATE, 10_000) == pytest.approx(500_000 / 20_000)
    assert conforms(max_excess(samples, RATE, 10_000)) is False


def test_too_few_samples_say_nothing():
    assert max_excess([(0.0, 0)], RATE, 1) is None and conforms(None) is None


def test_the_default_burst_is_a_few_ms_of_line_time_but_at_least_a_gso_segment():
    assert default_burst_bytes(1e9) == 250_000  # 2 ms at 1 Gbit/s
    assert default_burst_bytes(4e6) == GSO_SEGMENT_BYTES
    assert LinkSpec(rate_bps=100_000_000).burst_bytes == GSO_SEGMENT_BYTES
    assert LinkSpec(rate_bps=100_000_000, burst_bytes=8192).burst_bytes == 8192


@pytest.mark.e2e
@pytest.mark.alone
@pytest.mark.skipif(
    os.geteuid() != 0 and not user_namespaces_work(), reason="needs root or user namespaces to build namespaces"
)
def test_a_deliberately_oversized_burst_is_flagged(tmp_path):
    """4 MiB of bucket at 20 Mbit/s lets the first all-reduce (3.5 MB) through unshaped: not a rate-true link."""
    profile = tmp_path / "leaky.yaml"
    profile.write_text("description: oversized burst\ninter_cluster:\n  rate: 20mbit\n  burst: 4mb\n")
    out = tmp_path / "run"
    result = harness("run", "--profile", profile, "--steps", 4, *SMALL_RUN, "--out", out)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = summary_of(out)
    assert summary["link_burst_bytes"] == 4 << 20
    assert summary["link_max_excess"] > 2 * CONFORMANCE_TOLERANCE and summary["link_conforms"] is False
