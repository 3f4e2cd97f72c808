"""--fault KIND:STEP:ARG: parsed and checked before anything starts, injected at its step, an outage restored after
its seconds (and at teardown), each one logged."""

from __future__ import annotations

import json
import os
import time

import pytest

from harness.net.link import LinkSpec
from harness.run.config import RunConfig
from harness.run.faults import Fault, FaultError, FaultInjector, check_faults, parse_fault


def test_parse_each_kind():
    assert parse_fault("link-down:50:10") == Fault("link-down", 50, seconds=10.0)
    assert parse_fault("rate:20:100mbit") == Fault("rate", 20, rate_bps=100_000_000)
    assert parse_fault("kill:7:3") == Fault("kill", 7, rank=3)


@pytest.mark.parametrize(
    "text, message",
    [
        ("link-down:50", "must be KIND:STEP:ARG"),
        ("flap:5:1", "unknown fault kind 'flap'"),
        ("link-down:x:1", "whole number of training steps"),
        ("link-down:5:-1", "between 0 and 3600 seconds"),
        ("link-down:5:soon", "number of seconds"),
        ("rate:5:fast", "rate 'fast' is not understood"),
        ("kill:5:last", "must be a whole number"),
    ],
)
def test_bad_faults_name_what_is_wrong(text, message):
    with pytest.raises(FaultError, match=message):
        parse_fault(text)


@pytest.mark.parametrize(
    "fault, backend, rate, message",
    [
        (Fault("kill", 5, rank=4), "netns", 10**9, "ranks 0 to 3"),
        (Fault("link-down", 0, seconds=1), "netns", 10**9, "between 1 and 99"),
        (Fault("link-down", 100, seconds=1), "netns", 10**9, "outside the run"),
        (Fault("link-down", 5, seconds=1), "docker", 10**9, "needs the netns backend"),
        (Fault("rate", 5, rate_bps=10**6), "netns", None, "has none"),
    ],
)
def test_faults_must_happen_inside_the_run_on_what_exists(fault, backend, rate, message):
    with pytest.raises(FaultError, match=message):
        check_faults((fault,), steps=100, world_size=4, backend=backend, link_rate_bps=rate)


def test_a_kill_works_on_docker_too():
    check_faults((Fault("kill", 5, rank=1),), steps=100, world_size=2, backend="docker", link_rate_bps=None)


class FakeCluster:
    def __init__(self):
        self.calls = []

    def set_link_up(self, up):
        self.calls.append(("up", up))

    def set_link_rate(self, rate_bps):
        self.calls.append(("rate", rate_bps))


def test_injected_at_their_steps_and_an_outage_restored_after_its_seconds(tmp_path):
    cluster, killed = FakeCluster(), []
    log = tmp_path / "faults.jsonl"
    faults = (Fault("rate", 30, rate_bps=5), Fault("link-down", 10, seconds=0.2), Fault("kill", 40, rank=1))
    injector = FaultInjector(faults, cluster, killed.append, log)
    injector.poll(9)
    assert cluster.calls == [] and injector.records == []
    injector.poll(12)  # a poll may see several steps at once: injected at the first poll at or past its step
    assert cluster.calls == [("up", False)]
    assert injector.records[0]["injected_at_step"] == 12
    injector.poll(13)
    assert cluster.calls == [("up", False)]  # not yet restored
    time.sleep(0.25)
    injector.poll(14)
    assert cluster.calls == [("up", False), ("up", True)]
    injector.poll(45)  # both remaining faults are due
    assert cluster.calls[-1] == ("rate", 5) and killed == [1]
    assert [r["fault"] for r in injector.records] == ["link-down", "rate", "kill"]
    assert 0.2 <= injector.records[0]["restored_t"] - injector.records[0]["injected_t"] < 1.0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["kind"], e["event"], e["fault"]) for e in events] == [
        ("fault", "injected", "link-down"),
        ("fault", "restored", "link-down"),
        ("fault", "injected", "rate"),
        ("fault", "injected", "kill"),
    ]


def test_teardown_restores_an_outage_still_in_progress(tmp_path):
    cluster = FakeCluster()
    injector = FaultInjector((Fault("link-down", 1, seconds=600),), cluster, None, tmp_path / "f.jsonl")
    injector.poll(1)
    injector.restore()
    injector.restore()  # idempotent: teardown may call it when nothing is down
    assert cluster.calls == [("up", False), ("up", True)]


# --- rates the link can really be given -------------------------------------------------------------------------


def test_a_fault_rate_above_tbfs_field_is_refused_when_parsed():
    with pytest.raises(FaultError, match=r"rate:5:100gbit.*32-bit rate field.*use at most 34359mbit"):
        parse_fault("rate:5:100gbit")


def test_a_fault_rate_is_held_to_the_machines_ceiling_like_a_profiles(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("HARNESS_MAX_RATE", raising=False)
    fault = parse_fault("rate:5:20gbit")
    with pytest.raises(FaultError, match=r"--fault rate asks for 20 Gbit/s, more than this machine can shape"):
        check_faults((fault,), steps=100, world_size=4, backend="netns", link_rate_bps=10**9)
    check_faults((parse_fault("rate:5:2gbit"),), steps=100, world_size=4, backend="netns", link_rate_bps=10**9)


def test_a_fault_rate_is_checked_with_the_links_queue_bound(monkeypatch):
    """The new rate keeps the link's queue time: 30 s of queue is fine at 1 Gbit/s, 37.5 GB at 10 Gbit/s is not."""
    monkeypatch.setenv("HARNESS_MAX_RATE", "30gbit")
    link = LinkSpec(rate_bps=10**9, queue_ms=30_000)
    with pytest.raises(FaultError, match=r"--fault rate at step 5: .*32-bit queue limit"):
        check_faults((parse_fault("rate:5:10gbit"),), 100, 4, "netns", link.rate_bps, link=link)


# --- an outage longer than the collective timeout ----------------------------------------------------------------


def test_an_outage_as_long_as_the_collective_timeout_is_warned_about():
    config = RunConfig.build("allreduce", "1gbps", steps=20, faults=("link-down:5:60",), collective_timeout_s=30)
    config.validate()
    (warning,) = [w for w in config.warnings() if "link-down" in w]
    assert "--fault link-down:5:60 keeps the link down for 60 s" in warning
    assert "collective timeout (30 s" in warning and "HARNESS_TIMEOUT_S" in warning
    config = RunConfig.build("allreduce", "1gbps", steps=20, faults=("link-down:5:10",), collective_timeout_s=30)
    assert not [w for w in config.warnings() if "link-down" in w]


def test_a_failure_during_or_just_after_an_outage_names_it(tmp_path):
    """The watchdog blamed rank 0 by tie-break when every rank waited on a dead link; the outage is the cause."""
    injector = FaultInjector((Fault("link-down", 3, seconds=0.3),), FakeCluster(), None, tmp_path / "f.jsonl")
    assert injector.outage_note(timeout_s=5) is None
    injector.poll(4)
    assert injector.outage_note(timeout_s=5) == (
        "during the injected link-down of 0.3 s at step 4, with a collective timeout of 5 s"
    )
    time.sleep(0.35)
    injector.poll(5)
    note = injector.outage_note(timeout_s=5)
    assert note.endswith("s after the injected link-down of 0.3 s at step 4 ended, with a collective timeout of 5 s")
    time.sleep(0.05)
    assert injector.outage_note(timeout_s=0.01) is None  # over for longer than a collective waits: not the cause
