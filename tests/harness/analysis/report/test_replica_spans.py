"""A fault-tolerant run's replica spans (up, down, healing) from its restarts and heals, worked out by hand."""

from __future__ import annotations

from harness.analysis.report.replica_spans import replica_spans


def test_each_replica_is_up_until_killed_then_down_until_restarted_then_healing_until_healed():
    events = {
        0: [{"kind": "step", "t": 11.0, "step_s": 1.0}, {"kind": "step", "t": 60.0, "step_s": 1.0}],
        1: [{"kind": "step", "t": 11.5, "step_s": 1.0}, {"kind": "step", "t": 59.0, "step_s": 1.0}],
    }
    summary = {
        "fault_tolerance": "torchft",
        "restarts": [
            {"rank": 1, "incarnation": 1, "killed_t": 20.0, "restarted_t": 22.0},
            {"rank": 1, "incarnation": 2, "killed_t": 40.0, "restarted_t": 42.0},
        ],
        "heals": [
            {"rank": 1, "incarnation": 1, "heal_s": 4.0},
            {"rank": 1, "incarnation": 2, "heal_s": None},  # never healed: healing to the end
        ],
    }
    spans = [(s["rank"], s["state"], s["start_s"], s["end_s"]) for s in replica_spans("r", summary, events)]
    # The training started at 10 (the first step's start) and ended at 60.
    assert spans == [
        (0, "up", 0.0, 50.0),
        (1, "up", 0.0, 10.0),
        (1, "down", 10.0, 12.0),
        (1, "healing", 12.0, 16.0),
        (1, "up", 16.0, 30.0),
        (1, "down", 30.0, 32.0),
        (1, "healing", 32.0, 50.0),
    ]


def test_no_spans_without_fault_tolerance():
    assert replica_spans("r", {}, {0: [{"kind": "step", "t": 1.0, "step_s": 1.0}]}) == []
