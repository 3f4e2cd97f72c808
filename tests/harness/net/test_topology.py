"""Clusters x stages -> ranks, process groups and addresses."""

import ipaddress
import itertools

import pytest

from harness.errors import UserError
from harness.net.topology import DEFAULT_SUBNET, Topology


def test_two_clusters_two_stages_layout():
    t = Topology(clusters=2, stages=2)
    assert t.world_size == 4
    assert [[t.rank(c, s) for s in range(2)] for c in range(2)] == [[0, 1], [2, 3]]
    assert [t.cluster_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [t.stage_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert t.pipeline_ranks(0) == [0, 1]
    assert t.pipeline_ranks(1) == [2, 3]
    assert t.data_parallel_ranks(0) == [0, 2]
    assert t.data_parallel_ranks(1) == [1, 3]


@pytest.mark.parametrize(("clusters", "stages"), [(1, 1), (2, 1), (3, 2), (4, 3), (2, 4)])
def test_rank_layout_and_groups_partition_the_world(clusters, stages):
    t = Topology(clusters, stages)
    world = list(range(clusters * stages))
    assert t.world_size == len(world)
    for c, s in itertools.product(range(clusters), range(stages)):
        r = t.rank(c, s)
        assert r == c * stages + s
        assert (t.cluster_of(r), t.stage_of(r)) == (c, s)
    pipelines = [t.pipeline_ranks(c) for c in range(clusters)]
    replicas = [t.data_parallel_ranks(s) for s in range(stages)]
    # Each family of groups covers every rank exactly once.
    assert sorted(itertools.chain(*pipelines)) == world
    assert sorted(itertools.chain(*replicas)) == world
    # A pipeline group stays inside one cluster; a data-parallel group holds one stage of every cluster.
    for c, group in enumerate(pipelines):
        assert len(group) == stages and {t.cluster_of(r) for r in group} == {c}
    for s, group in enumerate(replicas):
        assert len(group) == clusters and {t.stage_of(r) for r in group} == {s}
        assert [t.cluster_of(r) for r in group] == list(range(clusters))
    # A pipeline group and a data-parallel group meet in exactly one rank.
    for p, d in itertools.product(pipelines, replicas):
        assert len(set(p) & set(d)) == 1


def test_data_parallel_only_when_one_stage():
    t = Topology(clusters=3)
    assert t.stages == 1
    assert t.data_parallel_ranks(0) == [0, 1, 2]
    assert [t.pipeline_ranks(c) for c in range(3)] == [[0], [1], [2]]


@pytest.mark.parametrize("clusters", [1, 2, 8, 254])
def test_addresses_are_distinct_hosts_of_the_subnet(clusters):
    t = Topology(clusters)
    net = ipaddress.ip_network(DEFAULT_SUBNET)
    addresses = [ipaddress.ip_address(t.cluster_address(c)) for c in range(clusters)]
    assert len(set(addresses)) == clusters
    hosts = set(net.hosts())
    assert all(a in hosts for a in addresses)
    assert net.network_address not in addresses and net.broadcast_address not in addresses
    assert t.master_address == t.cluster_address(0)
    assert t.prefix_len == net.prefixlen


def test_default_subnet_is_the_benchmarking_range():
    t = Topology(2)
    assert ipaddress.ip_network(t.subnet).subnet_of(ipaddress.ip_network("198.18.0.0/15"))
    assert t.cluster_address(0) == "198.18.0.1"
    assert t.cluster_address(1) == "198.18.0.2"
    assert t.prefix_len == 24


def test_custom_subnet():
    t = Topology(2, subnet="10.9.8.0/29")
    assert [t.cluster_address(c) for c in range(2)] == ["10.9.8.1", "10.9.8.2"]
    assert t.prefix_len == 29


@pytest.mark.parametrize("clusters", [0, -1])
def test_clusters_below_one_raise(clusters):
    with pytest.raises(UserError, match=f"--clusters must be at least 1, got {clusters}"):
        Topology(clusters)


@pytest.mark.parametrize("stages", [0, -2])
def test_stages_below_one_raise(stages):
    with pytest.raises(UserError, match=f"--stages must be at least 1, got {stages}"):
        Topology(2, stages)


@pytest.mark.parametrize(("clusters", "subnet"), [(255, DEFAULT_SUBNET), (1000, DEFAULT_SUBNET), (7, "10.0.0.0/29")])
def test_too_many_clusters_for_the_subnet_raise(clusters, subnet):
    with pytest.raises(UserError, match=f"--clusters {clusters} does not fit in subnet {subnet}; use fewer"):
        Topology(clusters, subnet=subnet)


def test_largest_fit_is_accepted():
    assert Topology(6, subnet="10.0.0.0/29").cluster_address(5) == "10.0.0.6"
