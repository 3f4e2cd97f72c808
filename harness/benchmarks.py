"""Benchmarks of the harness itself (not of the methods): how long the emulated cluster takes to build and remove."""

from __future__ import annotations

import statistics
import time

from harness.backends import make_backend
from harness.profiles import Profile
from harness.topology import Topology


def cluster_lifecycle(profile: Profile, clusters: int, stages: int, repeats: int) -> dict[str, float]:
    """Median and max seconds to build (namespaces, bridge, veths, qdiscs) and tear down a cluster."""
    setup, teardown, total = [], [], []
    for i in range(repeats):
        backend = make_backend("netns", f"hx{i:06x}"[:8], Topology(clusters, stages), profile)
        started = time.perf_counter()
        try:
            backend.up()
        finally:
            backend.down()
        total.append(time.perf_counter() - started)
        setup.append(backend.setup_s)
        teardown.append(backend.teardown_s)
    return {
        "setup_median_s": statistics.median(setup),
        "teardown_median_s": statistics.median(teardown),
        "total_median_s": statistics.median(total),
        "total_max_s": max(total),
    }
