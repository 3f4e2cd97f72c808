"""Faults on purpose, on real runs: an outage and a rate change that DiLoCoX rides out, a killed rank that fails
AllReduce naming it; every fault is in the events and the summary, and the host is clean after each."""

from __future__ import annotations

import json
import os

import pytest

from harness.userns import user_namespaces_work
from tests.harness.e2e import SMALL_RUN, harness, run_marker, summary_of
from tests.harness.hoststate import leftovers, snapshot

pytestmark = pytest.mark.e2e

if os.geteuid() != 0 and not user_namespaces_work():
    pytest.skip("needs root or user namespaces to build network namespaces", allow_module_level=True)


def fault_events(out):
    return [json.loads(line) for line in (out / "events" / "faults.jsonl").read_text().splitlines()]


@pytest.mark.alone
def test_dilocox_rides_out_an_outage_and_a_rate_change(tmp_path):
    before = snapshot()
    out = tmp_path / "run"
    result = harness(
        "run", "--profile", "100mbps", "--method", "dilocox", "--set", "local_steps=10", "--steps", 40, *SMALL_RUN,
        "--fault", "link-down:12:3", "--fault", "rate:25:20mbit", "--out", out,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = summary_of(out)
    assert summary["status"] == "ok" and summary["steps"] == 40
    outage, rate = summary["faults"]
    assert outage["fault"] == "link-down" and outage["injected_at_step"] >= 12
    assert 3.0 <= outage["restored_t"] - outage["injected_t"] < 4.5
    assert rate["fault"] == "rate" and rate["rate_bps"] == 20_000_000 and rate["injected_at_step"] >= 25
    # DiLoCoX trains on through the outage (its exchanges wait), so the rate change may come before the restore.
    assert sorted((e["kind"], e["event"], e["fault"]) for e in fault_events(out)) == [
        ("fault", "injected", "link-down"),
        ("fault", "injected", "rate"),
        ("fault", "restored", "link-down"),
    ]
    # The rate change is in the applied qdiscs record: both ends of both clusters' veths, at 20 Mbit/s.
    environment = json.loads((out / "environment.json").read_text())
    changed = [q for q in environment["applied_qdiscs"] if q["kind"] == "tbf" and q["rate"] == "20000000bit"]
    assert len(changed) == 4
    assert "link-down injected at step" in result.stdout
    assert leftovers(before, run_marker(out)) == {}


def test_a_killed_rank_fails_allreduce_naming_it_and_the_fault(tmp_path):
    before = snapshot()
    out = tmp_path / "run"
    result = harness(
        "run", "--profile", "100mbps", "--method", "allreduce", "--steps", 30, *SMALL_RUN,
        "--fault", "kill:8:1", "--out", out,
    )  # fmt: skip
    assert result.returncode != 0
    summary = summary_of(out)
    assert summary["status"] == "failed"
    assert "rank 1 (cluster 1, stage 0) was killed by SIGKILL" in summary["failure"]
    assert "--fault kill injected on rank 1" in summary["failure"]
    (kill,) = summary["faults"]
    assert kill["fault"] == "kill" and kill["rank"] == 1 and kill["injected_at_step"] >= 8
    assert leftovers(before, run_marker(out)) == {}


@pytest.mark.alone
def test_an_outage_longer_than_the_collective_timeout_is_warned_about_and_named_in_the_failure(tmp_path):
    """Every rank waits on the dead link alike: the watchdog blamed rank 0 by tie-break, naming no outage."""
    before = snapshot()
    out = tmp_path / "run"
    result = harness(
        "run", "--profile", "100mbps", "--method", "allreduce", "--steps", 200, *SMALL_RUN,
        "--fault", "link-down:3:40", "--out", out, env={"HARNESS_TIMEOUT_S": "15", "COLUMNS": "300"},
    )  # fmt: skip
    assert result.returncode != 0
    text = " ".join((result.stdout + result.stderr).split())
    assert "--fault link-down:3:40 keeps the link down for 40 s, not less than the collective timeout (15 s" in text
    summary = summary_of(out)
    assert summary["status"] == "failed"
    assert "(during the injected link-down of 40 s at step " in summary["failure"], summary["failure"]
    assert "with a collective timeout of 15 s)" in summary["failure"]
    assert leftovers(before, run_marker(out)) == {}
