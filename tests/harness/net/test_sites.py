"""Per-site links (a profile's `sites`): uneven and asymmetric access links, checked against the run's clusters,
kept through a run's config.json, and shown as a topology."""

from __future__ import annotations

import re

import pytest

from harness.net.link import ProfileError
from harness.net.profiles import check_shapeable, load_profile
from harness.run.config import RunConfig


def write(tmp_path, text):
    path = tmp_path / "sites.yaml"
    path.write_text(text)
    return str(path)


def test_a_site_gets_its_own_rate_and_the_others_keep_the_profiles(tmp_path):
    p = load_profile(
        write(tmp_path, "inter_cluster: {rate: 1gbit, delay: 5ms}\nsites:\n  2: {up: 50mbit, down: 200mbit}\n")
    )
    assert p.uplink(0) == p.inter_cluster and p.downlink(1) == p.inter_cluster
    assert p.uplink(2).rate_bps == 50_000_000 and p.downlink(2).rate_bps == 200_000_000
    # The site's burst follows its own rate; its delay is the inter-cluster link's.
    assert p.uplink(2).burst_bytes == 64 * 1024 and p.downlink(2).burst_bytes == 64 * 1024
    assert p.uplink(2).delay_ms == 5.0
    assert "except site 2" in "\n".join(p.topology_lines()) and "up 50 Mbit/s" in "\n".join(p.topology_lines())


def test_the_shipped_straggler_profile():
    p = load_profile("straggler-1gbps-one-site-100mbps")
    assert [p.uplink(c).rate_bps for c in range(4)] == [10**9, 10**9, 10**9, 10**8]
    assert p.downlink(3).rate_bps == 10**8


@pytest.mark.parametrize(
    "sites, message",
    [
        ("  1: {bandwidth: 1gbit}\n", "unknown keys ['bandwidth']"),
        ("  1: {rate: 1gbit, up: 1gbit}\n", "give rate (both directions) or up and down"),
        ("  one: {rate: 1gbit}\n", "must map site numbers"),
        ("  1: {}\n", "must be a mapping"),
        ("  1: {delay: -10ms}\n", "must not be negative"),
        ("  1: {delay: 10ms, jitter: 20ms}\n", "larger than the delay"),
        ("  1: {loss: 100%}\n", "must be a percentage in [0, 100)"),
        ("  1: {rate: fast}\n", "rate 'fast' is not understood"),
    ],
)
def test_bad_sites_are_refused_naming_the_fix(tmp_path, sites, message):
    with pytest.raises(ProfileError, match=re.escape(message)):
        load_profile(write(tmp_path, "inter_cluster: {rate: 1gbit}\nsites:\n" + sites))


def test_a_sites_own_delay_and_loss_are_its_hop_and_paths_add_both_hops(tmp_path):
    """A site 80 ms away on a profile of 20 ms: its hop 80 ms, the others' 10 ms; losses compose over the path."""
    p = load_profile(
        write(tmp_path, "inter_cluster: {rate: 1gbit, delay: 20ms}\nsites:\n  2: {delay: 80ms, loss: 1%}\n")
    )
    assert p.needs_netem
    assert p.uplink(2).hop_delay_ms == pytest.approx(80) and p.uplink(2).hop_loss_pct == pytest.approx(1)
    assert p.uplink(0).hop_delay_ms == pytest.approx(10)
    assert p.path(0, 1).delay_ms == pytest.approx(20) and p.path(0, 1).loss_pct == 0
    assert p.path(0, 2).rtt_ms == pytest.approx(180) and p.path(0, 2).loss_pct == pytest.approx(1)
    assert p.path(0, 2).rate_bps == 10**9
    assert "site 2:" in p.topology_lines()[1] and "its hop 80 ms one-way, loss 1%" in p.topology_lines()[1]
    # A site without delay of its own keeps half the profile's, and a rate-only profile stays rate-only.
    (tmp_path / "b").mkdir()
    rate_only = load_profile(write(tmp_path / "b", "inter_cluster: {rate: 1gbit}\nsites:\n  1: {rate: 100mbit}\n"))
    assert not rate_only.needs_netem and rate_only.path(0, 1).rate_bps == 10**8


def test_a_site_the_run_does_not_have_is_refused(tmp_path):
    path = write(tmp_path, "inter_cluster: {rate: 1gbit}\nsites:\n  3: {rate: 100mbit}\n")
    with pytest.raises(ProfileError, match="gives site 3 its own link, but the run has sites 0 to 1; use --clusters 4"):
        RunConfig.build("allreduce", path, clusters=2).validate()


def test_a_site_rate_above_the_machine_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_MAX_RATE", "2gbit")
    with pytest.raises(ProfileError, match="site 1's uplink"):
        check_shapeable(load_profile(write(tmp_path, "inter_cluster: {rate: 1gbit}\nsites:\n  1: {up: 5gbit}\n")))


def test_sites_survive_a_runs_config_json(tmp_path):
    config = RunConfig.build("allreduce", "straggler-1gbps-one-site-100mbps", clusters=4)
    config.save(tmp_path / "config.json")
    assert RunConfig.load(tmp_path / "config.json").profile == config.profile


@pytest.mark.parametrize("key", ["true", "false", "yes"])
def test_a_site_named_by_a_yaml_boolean_is_refused(tmp_path, key):
    """YAML reads `true:` as a bool, which is an int to Python: the workers then crashed on int('True')."""
    with pytest.raises(ProfileError, match="must map site numbers"):
        load_profile(write(tmp_path, f"inter_cluster: {{rate: 1gbit}}\nsites:\n  {key}: {{rate: 10mbit}}\n"))


def test_a_sites_delay_is_checked_and_reported_at_its_own_value(tmp_path):
    """A site's LinkSpec holds path figures (twice its hop); its checks speak of what the site wrote."""
    p = load_profile(write(tmp_path, "inter_cluster: {rate: 1gbit, delay: 20ms}\nsites:\n  1: {delay: 1500ms}\n"))
    assert p.uplink(1).hop_delay_ms == 1500
    with pytest.raises(ProfileError, match=re.escape("delay 2500 ms is above 2000 ms one-way")):
        load_profile(write(tmp_path, "inter_cluster: {rate: 1gbit}\nsites:\n  1: {delay: 2500ms}\n"))
    with pytest.raises(ProfileError, match=re.escape("jitter 20 ms is larger than the delay 10 ms")):
        load_profile(write(tmp_path, "inter_cluster: {rate: 1gbit}\nsites:\n  1: {delay: 10ms, jitter: 20ms}\n"))
