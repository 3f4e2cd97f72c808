"""Clusters x stages -> ranks, addresses and which links are slow.

Rank layout: rank = cluster * stages + stage. The ranks of one cluster (its pipeline stages) share a site and talk
over fast links; the data-parallel group of stage j holds stage j of every cluster and crosses the slow link.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from harness.errors import UserError

# RFC 2544's benchmarking range: never routed, so the emulated cluster cannot collide with a real network.
DEFAULT_SUBNET = "198.18.0.0/24"


@dataclass(frozen=True)
class Topology:
    clusters: int
    stages: int = 1
    subnet: str = DEFAULT_SUBNET

    def __post_init__(self) -> None:
        if self.clusters < 1:
            raise UserError(f"--clusters must be at least 1, got {self.clusters}")
        if self.stages < 1:
            raise UserError(f"--stages must be at least 1, got {self.stages}")
        hosts = ipaddress.ip_network(self.subnet).num_addresses - 2
        if self.clusters > hosts:
            raise UserError(f"--clusters {self.clusters} does not fit in subnet {self.subnet}; use fewer clusters")

    @property
    def world_size(self) -> int:
        return self.clusters * self.stages

    def rank(self, cluster: int, stage: int) -> int:
        return cluster * self.stages + stage

    def cluster_of(self, rank: int) -> int:
        return rank // self.stages

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def pipeline_ranks(self, cluster: int) -> list[int]:
        return [self.rank(cluster, s) for s in range(self.stages)]

    def data_parallel_ranks(self, stage: int) -> list[int]:
        return [self.rank(c, stage) for c in range(self.clusters)]

    def cluster_address(self, cluster: int) -> str:
        """The address of cluster `cluster`'s uplink; all its ranks bind to it."""
        return str(ipaddress.ip_network(self.subnet)[cluster + 1])

    @property
    def prefix_len(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    @property
    def master_address(self) -> str:
        return self.cluster_address(0)
