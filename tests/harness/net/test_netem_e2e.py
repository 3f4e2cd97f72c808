"""The netem link emulator on a kernel that has sch_netem: each cluster link carries half of the profile's one-way
delay and the loss that composes to the profile's over two links, under tbf, and the link check measures the
profile's RTT. Skipped, with the reason, where the kernel has no sch_netem (this project's machines: the userspace
delay line covers them, tests/harness/net/test_delayline.py)."""

from __future__ import annotations

import os
import secrets

import pytest

from harness.backends.netns import NetnsCluster
from harness.lock import RunLock
from harness.net.linkprobe import check_link
from harness.net.profiles import load_profile
from harness.net.shaping import probe_qdiscs
from harness.net.topology import Topology
from tests.harness.hoststate import netns_names

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

if os.geteuid() != 0:
    pytest.skip("the netem path builds namespaces under /run/netns, which needs root", allow_module_level=True)
if not probe_qdiscs(userns=False)["netem"]:
    pytest.skip(
        "this kernel has no sch_netem (modprobe sch_netem); the userspace delay line is tested instead",
        allow_module_level=True,
    )


def test_netem_gives_each_hop_half_and_the_path_the_profile(tmp_path):
    profile = load_profile("wan-1gbps-40ms-rtt-loss1pct")
    topology = Topology(2)
    key = "hx" + secrets.token_hex(3)
    cluster = NetnsCluster(key, topology, profile, link_emulator="netem", log_dir=tmp_path)
    with RunLock(key):
        try:
            cluster.up()
            netem = [q for q in cluster.applied_qdiscs if q["kind"] == "netem"]
            # Uplink and bridge-side end of each of the two clusters: four hops, each a quarter of the RTT.
            assert len(netem) == 4
            assert all(q["delay"] == 10_000 for q in netem)  # microseconds: half of the 20 ms one-way delay
            assert all(abs((1 - q["loss"] / 100) ** 2 - 0.99) < 1e-9 for q in netem)
            kernel = cluster.kernel_qdiscs()
            assert {"netem", "tbf"} <= {q["kind"] for q in kernel}
            fields = check_link(cluster, topology, profile.inter_cluster, tmp_path / "link_check.json")
            assert fields["link_check_ok"], fields
            assert abs(fields["link_rtt_ms"] - 40) <= 2, fields
            assert 0.008 <= fields["link_loss_measured"] <= 0.012, fields
        finally:
            cluster.down()
    assert not [name for name in netns_names() if name.startswith(key)]
