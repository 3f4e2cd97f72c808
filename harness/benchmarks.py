"""Benchmarks of the harness itself (not of the methods): how long the emulated cluster takes to build and remove."""

from __future__ import annotations

import secrets
import statistics
import time

from harness.backends import make_backend
from harness.ownership import RunLock
from harness.profiles import Profile
from harness.topology import Topology


def cluster_lifecycle(profile: Profile, clusters: int, stages: int, repeats: int) -> dict[str, float]:
    """Median and max seconds to build (namespaces, bridge, veths, qdiscs) and tear down a cluster."""
    setup, teardown, total = [], [], []
    for _ in range(repeats):
        # A fresh run key each time, held like a run's: `harness cleanup` never takes a live benchmark's namespaces.
        run_key = "hx" + secrets.token_hex(3)
        backend = make_backend("netns", run_key, Topology(clusters, stages), profile)
        started = time.perf_counter()
        with RunLock(run_key):
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
