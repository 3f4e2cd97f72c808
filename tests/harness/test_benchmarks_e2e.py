"""The harness's own benchmarks on this host (harness/benchmarks.py): a 16-site cluster builds and tears down
clean, and `harness bench-sites` measures each site count with a real run."""

from __future__ import annotations

import json
import os

import pytest

from harness.benchmarks import cluster_lifecycle
from harness.net.profiles import load_profile
from harness.userns import user_namespaces_work
from tests.harness.e2e import harness
from tests.harness.hoststate import link_names, netns_names

pytestmark = pytest.mark.e2e

if os.geteuid() != 0:
    pytest.skip("builds clusters in this process: needs root", allow_module_level=True)


def test_sixteen_sites_build_and_tear_down_clean():
    namespaces, links = netns_names(), link_names()
    figures = cluster_lifecycle(load_profile("100mbps"), clusters=16, stages=1, repeats=1)
    assert figures["setup_median_s"] > 0 and figures["teardown_median_s"] > 0
    # Every run key is fresh (hx......): nothing that is new on the host may be left, whoever else runs.
    assert {n for n in netns_names() - namespaces if n.startswith("hx")} == set()
    assert {n for n in link_names() - links if n.startswith("hx")} == set()


@pytest.mark.skipif(not user_namespaces_work() and os.geteuid() != 0, reason="needs root or user namespaces")
def test_bench_sites_measures_each_count_with_a_real_run(tmp_path):
    out = tmp_path / "cost"
    result = harness("bench-sites", "--sites", "2,3", "--steps", 10, "--profile", "1gbps", "--out", out,
                     env={"COLUMNS": "250"})  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((out / "emulation-cost.json").read_text())
    assert [r["sites"] for r in rows] == [2, 3] and all(r["status"] == "ok" for r in rows)
    for r in rows:
        summary = json.loads((out / f"sites-{r['sites']}" / "summary.json").read_text())
        assert summary["clusters"] == r["sites"] and len(summary["peak_rss_bytes_per_rank"]) == r["sites"]
        # A rank holds at least torch and the model: tens of MB, and the sum is every rank's.
        assert r["ranks_peak_rss_bytes"] == sum(summary["peak_rss_bytes_per_rank"]) > r["sites"] * 50 * 2**20
        assert 0 < r["harness_cpu_s"] < summary["run_cpu_s"] and r["cluster_setup_s"] > 0
    assert harness("bench-sites", "--sites", "1", "--out", tmp_path / "x").returncode == 2
