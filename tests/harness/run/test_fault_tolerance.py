"""`--set fault_tolerance=torchft`: what it refuses before anything starts, how the runner restarts a killed rank,
and the summary's figures (heals, goodput's applied tokens) worked out by hand from fixed events."""

from __future__ import annotations

import json

import pytest

from harness.run import fault_tolerance
from harness.run.config import RunConfig
from harness.run.fault_tolerance import (
    FailureSchedule,
    FaultTolerance,
    FaultToleranceError,
    Restarts,
    check_fault_tolerance,
    summarize_fault_tolerance,
)
from trainers.registry import method_config

TORCHFT = FaultTolerance("torchft")


def check(
    ft=TORCHFT, method="allreduce", options=None, clusters=2, stages=1, backend="netns", kills=None, checkpoint_every=0
):
    refusal = method_config(method, options).fault_tolerance_refusal()
    check_fault_tolerance(ft, method, refusal, clusters, stages, backend, kills or {}, checkpoint_every)


def test_a_run_fault_tolerance_can_carry_is_accepted():
    pytest.importorskip("torchft")
    check()
    check(method="opendiloco", clusters=3, kills={10: 1, 20: 2}, ft=FaultTolerance("torchft", min_replicas=1))
    check(method="dilocox")
    check(method="dilocox", options={"overlap": "none", "compression": False})
    check(method="sparseloco")
    check(method="demo")
    check(ft=FaultTolerance())


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"ft": FaultTolerance("checkpoints")}, "--set fault_tolerance=checkpoints names no fault tolerance"),
        ({"ft": FaultTolerance(min_replicas=2)}, "--set min_replicas is a setting of fault tolerance"),
        ({"ft": FaultTolerance(restart_delay_s=5)}, "add --set fault_tolerance=torchft or drop it"),
        ({"method": "dilocox", "options": {"overlap": "delayed"}}, "use --set dilocox.overlap=streaming or none"),
        ({"method": "dilocox", "options": {"overlap": "eager"}}, "overlap=eager keeps a round's exchange in flight"),
        ({"method": "dilocox", "options": {"exchange": "reduce"}}, "use --set dilocox.exchange=gather"),
        ({"method": "cocktail"}, "cannot carry cocktail: its gather runs behind the next step"),
        ({"method": "local"}, "cannot carry local: local never communicates"),
        ({"stages": 2}, "one stage per cluster"),
        ({"backend": "docker"}, "on the netns backend"),
        ({"clusters": 1}, "at least 2 clusters"),
        ({"ft": FaultTolerance("torchft", min_replicas=3)}, "between 1 and the run's 2 clusters"),
        ({"ft": FaultTolerance("torchft", min_replicas=0)}, "between 1 and the run's 2 clusters"),
        ({"ft": FaultTolerance("torchft", restart_delay_s=-1)}, "restart_delay_s=-1 must be between 0 and 3600"),
        ({"ft": FaultTolerance("torchft", replica_timeout_s=0)}, "replica_timeout_s=0 must be a positive"),
        ({"kills": {10: 2}}, "takes down 2 of 2 replicas"),
        ({"clusters": 3, "kills": {10: 2}, "ft": FaultTolerance("torchft", min_replicas=2)}, "min_replicas=2"),
        ({"checkpoint_every": 10}, "drop --set checkpoint_every"),
        ({"ft": FaultTolerance("torchft", mtbf_s=-5)}, "mtbf_s=-5 must be a positive number of seconds"),
        ({"ft": FaultTolerance("torchft", mtbf_s="often")}, "or none for no random failures"),
        ({"ft": FaultTolerance(mtbf_s=60)}, "--set mtbf_s is a setting of fault tolerance"),
    ],
)
def test_what_fault_tolerance_cannot_honour_is_refused_naming_the_fix(arguments, message):
    pytest.importorskip("torchft")
    with pytest.raises(FaultToleranceError, match=message):
        check(**arguments)


def test_without_torchft_the_refusal_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchft(name, *args, **kwargs):
        if name == "torchft" or name.startswith("torchft."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchft)
    with pytest.raises(FaultToleranceError, match=r"pip install -e '\.\[ft\]'"):
        check()


def test_a_run_config_checks_fault_tolerance_and_keeps_it_in_config_json(tmp_path):
    pytest.importorskip("torchft")
    config = RunConfig.build(
        "allreduce", "100mbps", steps=20, model="tiny", fault_tolerance="torchft", min_replicas=1, restart_delay_s=3
    )
    config.save(tmp_path / "config.json")
    loaded = RunConfig.load(tmp_path / "config.json")
    assert loaded.fault_tolerance == FaultTolerance("torchft", min_replicas=1, restart_delay_s=3.0)
    calibrating = RunConfig.build("allreduce", "100mbps", steps=20, fault_tolerance="torchft", calibrate=True)
    with pytest.raises(Exception, match="calibrate without fault tolerance"):
        calibrating.validate()


class FakeProcess:
    def __init__(self, name):
        self.name, self.waited = name, False

    def wait(self, timeout=None):
        self.waited = True
        return -9


def test_a_killed_rank_is_started_again_after_the_delay_as_its_next_incarnation(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(fault_tolerance.time, "monotonic", lambda: clock[0])
    started = []
    restarts = Restarts(
        2.0, lambda rank, incarnation: started.append((rank, incarnation)) or f"new{incarnation}", tmp_path / "f"
    )
    procs = {0: FakeProcess("r0"), 1: FakeProcess("r1")}
    restarts.killed(1)
    assert restarts.expected(1) and not restarts.expected(0)
    clock[0] = 101.9
    restarts.poll(procs)
    assert started == [] and procs[1].name == "r1"
    clock[0] = 102.0
    old = procs[1]
    restarts.poll(procs)
    assert started == [(1, 1)] and procs[1] == "new1" and old.waited and not restarts.expected(1)
    restarts.killed(1)
    clock[0] = 105.0
    procs[1] = FakeProcess("again")
    restarts.poll(procs)
    assert started[-1] == (1, 2)
    logged = [json.loads(line) for line in (tmp_path / "f").read_text().splitlines()]
    assert [(e["event"], e["rank"], e["incarnation"]) for e in logged] == [("restarted", 1, 1), ("restarted", 1, 2)]


def _config(clusters=2, steps=40):
    return RunConfig.build("opendiloco", "100mbps", steps=steps, clusters=clusters, fault_tolerance="torchft")


def test_the_summary_counts_each_rounds_replicas_and_the_heal_by_hand():
    """Rounds of 10 steps, 2 replicas: [0, 10) with both; [10, 20) discarded on rank 0 (rank 1 was killed in it, at
    its step 16) and trained again with both once rank 1 had healed to step 10; [20, 30) with rank 0 alone (the
    quorum says 1); [30, 40) with both. Rank 1 logged its commits before and after its death."""
    tokens_per_step = 2 * 128  # 2 clusters x batch 2 x 64
    rank0 = [
        {"t": 0.0, "kind": "start", "tokens_per_step": tokens_per_step},
        {"t": 0.5, "kind": "step", "step": 0, "step_s": 0.1},
        {"t": 1.0, "kind": "commit", "from_step": 0, "to_step": 10, "participants": 2},
        {"t": 3.0, "kind": "discarded", "from_step": 10, "to_step": 20},
        {"t": 4.5, "kind": "commit", "from_step": 10, "to_step": 20, "participants": 2},
        {"t": 5.5, "kind": "commit", "from_step": 20, "to_step": 30, "participants": 1},
        {"t": 8.0, "kind": "commit", "from_step": 30, "to_step": 40, "participants": 2},
        {"t": 8.4, "kind": "step", "step": 39, "step_s": 0.1},
    ]
    rank1 = [
        {"t": 0.1, "kind": "start", "tokens_per_step": tokens_per_step},
        {"t": 1.0, "kind": "commit", "from_step": 0, "to_step": 10, "participants": 2},
        {"t": 2.5, "kind": "step", "step": 14, "step_s": 0.1},
        {"t": 2.6, "kind": "step", "step": 15, "step_s": 0.1},
        {"t": 4.0, "kind": "quorum", "step": 0, "participants": 2, "healed_to_step": 10, "heal_state_bytes": 1000,
         "heal_received_bytes": 1040},
        {"t": 4.5, "kind": "commit", "from_step": 10, "to_step": 20, "participants": 2},
        {"t": 8.0, "kind": "commit", "from_step": 30, "to_step": 40, "participants": 2},
    ]  # fmt: skip
    record = {"restarts": [{"rank": 1, "cause": "fault", "incarnation": 1, "killed_t": 2.7, "restarted_t": 3.2}]}
    summary = summarize_fault_tolerance(_config(), {0: rank0, 1: rank1}, record)
    (heal,) = summary["heals"]
    assert heal == {
        "rank": 1,
        "incarnation": 1,
        "cause": "fault",
        "killed_at_step": 16,
        "postponed_s": 0.0,
        "down_s": pytest.approx(0.5),
        "heal_s": pytest.approx(0.8),
        "healed_to_step": 10,
        "heal_state_bytes": 1000,
        "heal_received_bytes": 1040,
    }
    assert summary["rounds_discarded"] == 1 and summary["steps_discarded"] == 10
    assert summary["replicas_left"] == []
    replica_steps = 10 * 2 + 10 * 2 + 10 * 1 + 10 * 2
    assert summary["ft_applied_tokens"] == replica_steps * 128
    assert summary["ft_applied_fraction"] == pytest.approx(replica_steps / 80)
    # The training's wall time: rank 0's first step started at 0.4, its last ended at 8.4.
    assert summary["ft_wall_s"] == pytest.approx(8.0)
    assert summary["goodput_tokens_per_s"] == pytest.approx(replica_steps * 128 / 8.0)


def test_a_run_without_fault_tolerance_has_no_fault_tolerance_figures():
    config = RunConfig.build("opendiloco", "100mbps", steps=40)
    assert summarize_fault_tolerance(config, {0: [], 1: []}, {}) == {}


def test_random_failures_are_exponential_up_times_one_stream_per_replica():
    import random

    schedule = FailureSchedule(mtbf_s=30.0, seed="7", replicas=3, min_replicas=1, now=100.0)
    draws = {r: random.Random(f"7:{r}").expovariate(1 / 30.0) for r in range(3)}
    assert schedule.due_at == {r: 100.0 + draws[r] for r in range(3)}
    # Seeded: the same seed draws the same up times; another seed does not.
    assert FailureSchedule(30.0, "7", 3, 1, 100.0).due_at == schedule.due_at
    assert FailureSchedule(30.0, "8", 3, 1, 100.0).due_at != schedule.due_at
    # A replica's next up time is drawn from its own stream when it is back.
    second = random.Random("7:1")
    second.expovariate(1 / 30.0)
    schedule.restarted(1, now=500.0)
    assert schedule.due_at[1] == 500.0 + second.expovariate(1 / 30.0)


def test_a_random_failure_waits_while_it_would_leave_fewer_than_min_replicas_up():
    schedule = FailureSchedule(mtbf_s=10.0, seed="0", replicas=3, min_replicas=2, now=0.0)
    schedule.due_at = {0: 5.0, 1: 6.0, 2: 50.0}
    assert schedule.due(4.0, down=set()) == []
    # Both 0 and 1 are due; killing both would leave 1 < 2 up: the earlier one goes, the other waits.
    assert schedule.due(7.0, down=set()) == [0]
    assert schedule.due(7.0, down={0}) == []
    assert schedule.due(7.0, down=set()) == [0]
    schedule.restarted(0, now=8.0)
    assert 1 in schedule.due(8.0, down=set())


def test_a_replica_restarted_after_the_others_finished_is_counted_out_not_failed():
    rank0 = [{"t": 1.0, "kind": "start", "tokens_per_step": 256}, {"t": 1.0, "kind": "quorum", "step": 0,
             "participants": 2}]  # fmt: skip
    rank1 = [{"t": 5.0, "kind": "step", "step": 38, "step_s": 0.1}, {"t": 9.0, "kind": "left", "reason": "done"}]
    record = {"restarts": [{"rank": 1, "cause": "mtbf", "incarnation": 1, "killed_t": 6.0, "restarted_t": 8.0}]}
    summary = summarize_fault_tolerance(_config(), {0: rank0, 1: rank1}, record)
    assert summary["replicas_left"] == [1]
    assert summary["heals"][0]["healed_to_step"] is None and summary["heals"][0]["cause"] == "mtbf"
